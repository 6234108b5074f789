"""`python benchmarks/predict_check.py [options]`.

Check the scale model against the emulated cluster: predicted vs measured step times. The logic and
its options (`--help`) live in hvd_onebit_tools/bench/studies/predict_check.py.
"""
from hvd_onebit_tools.bench.studies.predict_check import main

if __name__ == "__main__":
    main()
