"""`python benchmarks/gpu_check.py [options]`.

One-go check of hvd_onebit on a CUDA machine; prints one JSON object. The logic and its options
(`--help`) live in hvd_onebit_tools/bench/gpu_check.py.
"""
import sys

from hvd_onebit_tools.bench.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
