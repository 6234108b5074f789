"""`bench dev tensors`'s sweep, small, in the DDP face's torchrun world."""
from hvd_onebit_tools.bench.tensors import sweep

COUNTS = (4, 16)


def suite() -> list[dict]:
    return sweep(COUNTS, params=4096, steps=2, reps=1)
