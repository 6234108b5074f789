"""`python benchmarks/convergence.py [options]`.

Convergence of 1-bit Adam against Adam on examples/train_lm.py: Horovod's face under horovodrun, or
with `--face ddp` DDP + hvd_onebit.ddp against DDP Adam under torchrun. The logic and its options
(`--help`) live in hvd_onebit_tools/bench/studies/convergence.py.
"""
from hvd_onebit_tools.bench.studies.convergence import main

if __name__ == "__main__":
    main()
