"""Build script: metadata lives in setup.cfg; this file only adds the native kernels.

The extension ``hvd_onebit._C`` holds the fused CPU sign-compression kernels. It is optional at
run time (``hvd_onebit.kernels`` falls back to pure torch), but `make setup` builds it.
"""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "hvd_onebit._C",
            ["hvd_onebit/kernels/csrc/onebit_kernels.cpp"],
            extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
