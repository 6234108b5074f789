"""The convergence zoo as a script: `python benchmarks/zoo.py [options]` = `hvd-onebit bench dev zoo [options]`.

Horovod Adam against 1-bit Adam on seven model families (4 ranks; about 35 minutes on two cores
for the whole zoo), or with `--face ddp` DDP + Adam against DDP + hvd_onebit.ddp under torchrun;
see `hvd-onebit bench dev zoo --help` for the options and hvd_onebit_tools/bench/zoo/ for the
logic. The report alone: `python benchmarks/zoo.py --report-only`.
"""
import sys

from hvd_onebit_tools.cli import main

if __name__ == "__main__":
    main(["bench", "dev", "zoo", *sys.argv[1:]])
