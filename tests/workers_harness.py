"""Worker functions for the harness self-tests (run inside each rank after hvd.init())."""
import os
import time

import horovod.torch as hvd
import torch


def allreduce_rank():
    """Returns (rank, size, sum of ranks via hvd.allreduce)."""
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    return hvd.rank(), hvd.size(), float(total.item())


def raise_on_rank(bad_rank=1):
    """Rank ``bad_rank`` raises; the others block in a collective that can never complete."""
    if hvd.rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    hvd.allreduce(torch.ones(1), name="never_completes")
    return hvd.rank()


def hang_on_rank(bad_rank=0):
    """Rank ``bad_rank`` sleeps forever; every rank records its pid (in HANG_PID_FILE + ".rank<r>")
    so the test can check all were killed."""
    with open(f"{os.environ['HANG_PID_FILE']}.rank{hvd.rank()}", "w") as f:
        f.write(str(os.getpid()))
    if hvd.rank() == bad_rank:
        time.sleep(3600)
    return hvd.rank()
