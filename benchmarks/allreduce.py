"""The allreduce benchmark as a script: `python benchmarks/allreduce.py [options]` = `hvd-onebit bench allreduce --json [options]`.

See `hvd-onebit bench allreduce --help` for the options; the logic lives in hvd_onebit_tools/bench/.
"""
import sys

from hvd_onebit_tools.cli import main

if __name__ == "__main__":
    main(["bench", "allreduce", "--json", *sys.argv[1:]])
