"""The memory benchmark as a script: `python benchmarks/memory.py [options]` = `hvd-onebit bench dev memory --json [options]`.

See `hvd-onebit bench dev memory --help` for the options; the logic lives in hvd_onebit_tools/bench/.
"""
import sys

from hvd_onebit_tools.cli import main

if __name__ == "__main__":
    main(["bench", "dev", "memory", "--json", *sys.argv[1:]])
