"""Builds brisk's C++ CPU kernels (brisk._C) with torch.utils.cpp_extension.

Metadata lives in pyproject.toml. Install with `pip install --no-build-isolation .` after torch,
so the extension compiles against the torch you run (ninja, when installed, compiles the files in
parallel). The kernels are never lost silently: without torch at build time, or when the compiler
fails, the install stops with the reason and the fix. `BRISK_ALLOW_NO_KERNELS=1` installs the pure
Python package anyway (torch's kernels: the same results, slower decode), and brisk says so on
stderr when it starts.
"""

import os
import sys

from setuptools import setup

ALLOW_NO_KERNELS = os.environ.get("BRISK_ALLOW_NO_KERNELS", "") not in ("", "0")
SOURCES = [f"brisk/kernels/{name}.cpp" for name in (
    "bindings", "cpu_gemv", "cpu_paged_attention", "cpu_quant", "cpu_quant_vnni", "cpu_norm", "cpu_int8mm",
    "cpu_ternary", "cpu_rope", "cpu_decode_plan", "cpu_isa", "cpu_blocks", "cpu_vmem", "cpu_sparse24")]
NO_TORCH = """
brisk: torch is not importable in this build environment, so the C++ kernels cannot be compiled.
  pip builds in an isolated environment unless told not to. Install torch first, then build here:
      pip install torch==2.13.0 "setuptools>=68" wheel ninja
      pip install --no-build-isolation -e .
  (or set BRISK_ALLOW_NO_KERNELS=1 to install without the kernels: slower decode, same results)
"""
FAILED = """
brisk: compiling the C++ kernels failed (the compiler's error is above). Install a C++ compiler
  (Debian: apt-get install g++) and retry, or set BRISK_ALLOW_NO_KERNELS=1 to install without them.
"""


def _extension() -> tuple[list, dict]:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        if not ALLOW_NO_KERNELS:
            sys.exit(NO_TORCH)
        print("brisk: installing without the C++ kernels (BRISK_ALLOW_NO_KERNELS is set)", file=sys.stderr)
        return [], {}

    class Build(BuildExtension):
        """Stops with a message when the compiler fails, unless the user allowed a build without kernels."""

        def run(self) -> None:
            try:
                super().run()
            except Exception:
                if not ALLOW_NO_KERNELS:
                    print(FAILED, file=sys.stderr)
                    raise
                print("brisk: the C++ kernels failed to compile; installing without them "
                      "(BRISK_ALLOW_NO_KERNELS is set)", file=sys.stderr)

    ext = CppExtension("brisk._C", SOURCES, extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": Build}


ext_modules, cmdclass = _extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
