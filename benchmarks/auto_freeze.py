"""`python benchmarks/auto_freeze.py [options]`.

freeze_step="auto" against fixed warmups and Adam, on examples/train_lm.py or train_digits.py. The
logic and its options (`--help`) live in hvd_onebit_tools/bench/studies/auto_freeze.py.
"""
from hvd_onebit_tools.bench.studies.auto_freeze import main

if __name__ == "__main__":
    main()
