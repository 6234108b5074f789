"""Build script: metadata lives in setup.cfg; this file only adds the native kernels.

The extension ``hvd_onebit._C`` (the fused CPU sign-compression kernels) is built here only when
torch imports in the build environment, i.e. under ``pip install --no-build-isolation`` beside
the torch it will run with (``make setup`` installs so). Its C++ standard is the one torch's own
build flags name. A plain ``pip install .`` (an isolated build without torch) and a failed
compile both install the package without it: ``hvd_onebit.kernels.native_loader`` compiles the
kernels at first use, or the torch twins run with a warning.
"""
import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("HVD_ONEBIT_NATIVE", "1") != "0":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("hvd_onebit: torch is not importable in this build environment, so the native "
              "kernels compile at first use instead (install with `pip install "
              "--no-build-isolation .` to build them now)", file=sys.stderr)
    else:
        class OptionalBuildExtension(BuildExtension):
            """BuildExtension that leaves the kernels to first use when the compiler fails."""

            def run(self):
                try:
                    super().run()
                except Exception as exc:  # noqa: BLE001 - any compiler failure
                    print(f"hvd_onebit: the native kernels did not compile ({exc}); they will "
                          f"be compiled at first use, or the torch kernels run instead",
                          file=sys.stderr)

        ext_modules = [CppExtension("hvd_onebit._C", ["hvd_onebit/kernels/csrc/onebit_kernels.cpp"],
                                    extra_compile_args=["-O3", "-ffp-contract=off"])]
        cmdclass = {"build_ext": OptionalBuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
