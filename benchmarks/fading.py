"""`python benchmarks/fading.py [options]`.

A task whose gradients grow and then fade as it fits, the variance refresh's settings on it and
what the refresh gates see. The logic and its options (`--help`) live in
hvd_onebit_tools/bench/studies/fading.py.
"""
from hvd_onebit_tools.bench.studies.fading import main

if __name__ == "__main__":
    main()
