"""Build step beyond pyproject.toml: the small C helpers of the host path (_native.c).

Built as an extension file so that pip compiles it with the package, but it holds no Python
module: native.py loads it with ctypes. optional=True: without a C compiler the package still
installs and its callers use their Python loops.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("reflex_engine._native", ["src/reflex_engine/_native.c"],
                             extra_compile_args=["-O2"], optional=True)])
