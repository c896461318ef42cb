"""Build steps beyond pyproject.toml: the C helpers of the host path and the CUDA kernel image.

_native.c is built as an extension file so that pip compiles it with the package, but it holds no
Python module: native.py loads it with ctypes. optional=True: without a C compiler the package
still installs and its callers use their Python loops.

The CUDA kernels (src/reflex_engine/kernels/*.cu) are compiled by build_kernels.py into
reflex_engine/cuda_image/ after the extensions, by the same build_ext command, so that
`pip install .`, `pip wheel .`, `pip install -e .` and `setup.py build_ext --inplace` all make it.
"""
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # a PEP 517 build does not put the project folder on sys.path
import build_kernels  # noqa: E402

KERNEL_DIR = os.path.join(ROOT, "src", "reflex_engine", "kernels")


class BuildExtAndKernels(build_ext):
    def run(self):
        inplace = self.inplace  # true for --inplace and editable installs; super().run() clears it meanwhile
        super().run()
        if inplace:
            package_dir = os.path.join(ROOT, self.get_finalized_command("build_py").get_package_dir("reflex_engine"))
        else:
            package_dir = os.path.join(self.build_lib, "reflex_engine")
        try:
            build_kernels.build_image(KERNEL_DIR, os.path.join(package_dir, build_kernels.IMAGE_DIR))
        except build_kernels.BuildError as e:
            sys.exit(f"reflex: {e}")


setup(ext_modules=[Extension("reflex_engine._native", ["src/reflex_engine/_native.c"],
                             extra_compile_args=["-O2"], optional=True)],
      cmdclass={"build_ext": BuildExtAndKernels})
