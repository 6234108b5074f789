"""`python benchmarks/hierarchical.py [options]`.

Hierarchical against flat 1-bit Adam on emulated nodes, each bandwidth run several times. The logic
and its options (`--help`) live in hvd_onebit_tools/bench/studies/hierarchical.py.
"""
from hvd_onebit_tools.bench.studies.hierarchical import main

if __name__ == "__main__":
    main()
