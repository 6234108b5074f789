"""A job whose MPI was initialised by mpi4py at MPI_THREAD_SERIALIZED before Horovod started:
transport='mpi' must refuse it at construction, on every rank. Writes OUT_DIR/rank<r>.json."""
import json
import os
from pathlib import Path

import mpi4py

mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_onebit  # noqa: E402

hvd.init()
try:
    hvd_onebit.DistributedOptimizer(torch.optim.Adam(torch.nn.Linear(4, 4).parameters()),
                                    freeze_step=2, transport="mpi")
    error = None
except RuntimeError as exc:
    error = str(exc)
Path(os.environ["OUT_DIR"], f"rank{hvd.rank()}.json").write_text(json.dumps(
    {"error": error, "thread_level": MPI.Query_thread(), "serialized": MPI.THREAD_SERIALIZED}))
