"""An elastic Horovod job with hvd_onebit; one worker kills itself in the compression phase.

Run by tests/test_elastic.py under `horovodrun --gloo` with a host-discovery script listing two
local "hosts" (localhost and this machine's hostname). The worker on the hostname host SIGKILLs
itself after step KILL_STEP; Horovod blacklists that host and the survivors must restore the last
commit, rebuild their 1-bit buffers for the smaller world and finish. Each process appends one
JSON line per step to OUT_DIR/<pid>.jsonl.
"""
import json
import os
import signal
import sys
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hvd_onebit  # noqa: E402
from tests.workers_optimizer import batch, make_model, params_hash  # noqa: E402

OUT = Path(os.environ["OUT_DIR"])
TOTAL, FREEZE, KILL_STEP = 24, 6, 12
VICTIM_HOST = os.environ["VICTIM_HOST"]

warnings.simplefilter("ignore")
hvd.init()
torch.manual_seed(0)
model = make_model()
opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters(),
                                      freeze_step=FREEZE)
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
log = open(OUT / f"{os.getpid()}.jsonl", "a")


@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        step = state.batch
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        state.batch += 1
        state.commit()
        log.write(json.dumps({"step": step, "size": hvd.size(), "rank": hvd.rank(),
                              "phase": opt.phase, "hash": params_hash(model),
                              "host": os.environ.get("HOROVOD_HOSTNAME")}) + "\n")
        log.flush()
        if step == KILL_STEP and os.environ.get("HOROVOD_HOSTNAME") == VICTIM_HOST:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker: no goodbye, no cleanup


train(state)
log.write(json.dumps({"done": True, "size": hvd.size(), "rank": hvd.rank(),
                      "steps": opt.steps, "hash": params_hash(model)}) + "\n")
log.close()
