"""`python benchmarks/variance_refresh.py [options]`.

The measurable targets of ``variance_refresh``, end to end, as one JSON object. The logic and its
options (`--help`) live in hvd_onebit_tools/bench/studies/variance_refresh.py.
"""
from hvd_onebit_tools.bench.studies.variance_refresh import main

if __name__ == "__main__":
    main()
