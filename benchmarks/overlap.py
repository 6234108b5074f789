"""`python benchmarks/overlap.py [options]`.

The compressed step against its targets, each configuration run several times. The logic and its
options (`--help`) live in hvd_onebit_tools/bench/studies/overlap.py.
"""
from hvd_onebit_tools.bench.studies.overlap import main

if __name__ == "__main__":
    main()
