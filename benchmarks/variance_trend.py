"""`python benchmarks/variance_trend.py [options]`.

Does Adam's variance settle on this model? Its trend over a run, for choosing the freeze point. The
logic and its options (`--help`) live in hvd_onebit_tools/bench/studies/variance_trend.py.
"""
from hvd_onebit_tools.bench.studies.variance_trend import main

if __name__ == "__main__":
    main()
