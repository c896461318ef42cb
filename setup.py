"""Build step beyond pyproject.toml: the reader's small C helper (see gguf/_strings.c).

It is built as an extension file so that pip compiles it with the package, but it holds no
Python module: gguf/native.py loads it with ctypes. optional=True: without a C compiler the
package still installs and the reader uses its Python loop.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("reflex_engine.gguf._strings", ["src/reflex_engine/gguf/_strings.c"],
                             extra_compile_args=["-O2"], optional=True)])
