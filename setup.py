"""Builds brisk's optional C++ CPU kernels (brisk._C) with torch.utils.cpp_extension.

Metadata lives in pyproject.toml. Install with `pip install --no-build-isolation .` after torch,
so the extension compiles against the torch you run. A failed build is not fatal: brisk then
uses torch's own kernels (slower decode, same results).
"""

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch at build time: install the pure-Python package
    ext_modules, cmdclass = [], {}
else:
    ext_modules = [
        CppExtension(
            "brisk._C",
            ["brisk/kernels/bindings.cpp", "brisk/kernels/cpu_gemv.cpp", "brisk/kernels/cpu_paged_attention.cpp",
             "brisk/kernels/cpu_quant.cpp", "brisk/kernels/cpu_quant_vnni.cpp", "brisk/kernels/cpu_norm.cpp",
             "brisk/kernels/cpu_int8mm.cpp", "brisk/kernels/cpu_ternary.cpp", "brisk/kernels/cpu_rope.cpp", "brisk/kernels/cpu_decode_plan.cpp"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
