"""The kernel benchmark as a script: `python benchmarks/kernel.py [options]` = `hvd-onebit bench dev kernel --json [options]`.

See `hvd-onebit bench dev kernel --help` for the options; the logic lives in hvd_onebit_tools/bench/.
"""
import sys

from hvd_onebit_tools.cli import main

if __name__ == "__main__":
    main(["bench", "dev", "kernel", "--json", *sys.argv[1:]])
