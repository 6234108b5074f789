"""The train benchmark as a script: `python benchmarks/train.py [options]` = `hvd-onebit bench train --json [options]`.

See `hvd-onebit bench train --help` for the options; the logic lives in hvd_onebit_tools/bench/.
"""
import sys

from hvd_onebit_tools.cli import main

if __name__ == "__main__":
    main(["bench", "train", "--json", *sys.argv[1:]])
