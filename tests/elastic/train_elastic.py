"""An elastic Horovod job with hvd_onebit, through the freeze, in one of three scenarios.

Run by tests/test_elastic.py under `horovodrun --gloo` with a host-discovery script. The "hosts"
are names of this machine (localhost, 127.0.0.1, 127.1, 127.0.1 all resolve to the loopback
address, so Horovod starts every worker locally). SCENARIO (environment):

* ``lost``: the worker on host 127.0.0.1 SIGKILLs itself after step KILL_STEP (compression phase);
  Horovod blacklists that host and the survivors finish in a smaller world.
* ``replace``: the worker at rank 1 SIGKILLs itself after KILL_STEP; a spare host is listed, so
  a new worker joins the compression phase in a world of the same size.
* ``grow``: after GROW_STEP, rank 0 adds a host to the discovery file; the job grows by one
  worker, which joins in the compression phase.
* ``to_one``: as ``lost`` from two workers, so one rank steps alone (as Adam: each of its steps
  is checked against torch's Adam on ``torch_adam_state_dict`` of the state before it); after
  REGROW_STEP it adds a host and the job is two ranks again.

Each process appends one JSON line per step to OUT_DIR/<pid>.jsonl, and one when it is done.
VARIANCE_REFRESH (environment, JSON, optional): the optimizer's ``variance_refresh``;
FLUSH_ON_COMMIT ("1"): ``flush_on_commit=True``, whose flush in the commit after the loss is
where the survivors meet it. Each step's line has the parameters' hash before the step too.
"""
import copy
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hvd_onebit  # noqa: E402
from hvd_onebit_tools.bench.refresh import optimizer_options  # noqa: E402
from tests.workers_optimizer import batch, make_model, params_hash  # noqa: E402

OUT = Path(os.environ["OUT_DIR"])
SCENARIO = os.environ["SCENARIO"]
TOTAL, FREEZE, KILL_STEP, GROW_STEP, REGROW_STEP = 24, 6, 12, 10, 15
HOST = os.environ.get("HOROVOD_HOSTNAME")
REFRESH = json.loads(os.environ.get("VARIANCE_REFRESH", "null"))
FLUSH = os.environ.get("FLUSH_ON_COMMIT") == "1"

warnings.simplefilter("ignore")
hvd.init()
torch.manual_seed(0)
model = make_model()
opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters(),
                                      freeze_step=FREEZE, flush_on_commit=FLUSH,
                                      **optimizer_options(REFRESH))
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
log = open(OUT / f"{os.getpid()}.jsonl", "a")


def should_die(step: int) -> bool:
    if step != KILL_STEP:
        return False
    if SCENARIO in ("lost", "to_one"):
        return HOST == "127.0.0.1"
    if SCENARIO == "replace" and hvd.rank() == 1:
        marker = OUT / "killed"
        if not marker.exists():  # once: the replacement must not die too
            marker.touch()
            return True
    return False


def adam_alongside():
    """torch's Adam on a copy of the model, loaded with torch_adam_state_dict of the state now and
    given this step's gradients; returns a function that steps it and gives its parameters."""
    twin = copy.deepcopy(model)
    adam = torch.optim.Adam(twin.parameters(), lr=1e-3)
    adam.load_state_dict(hvd_onebit.torch_adam_state_dict(opt.state_dict()))
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()

    def step():
        adam.step()
        return list(twin.parameters())
    return step


@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        step = state.batch
        if (SCENARIO == "grow" and step > GROW_STEP and hvd.size() < 3
                or SCENARIO == "to_one" and step > REGROW_STEP and hvd.size() < 2):
            time.sleep(0.2)  # give the driver time to notice the new host (bounded by the test)
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        nn.functional.mse_loss(model(x), y).backward()
        refreshes, before = opt.telemetry()["refreshes"], params_hash(model)
        adam = adam_alongside() if hvd.size() == 1 else None
        opt.step()
        adam_diff = None if adam is None else max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), adam()))
        refreshed = opt.telemetry()["refreshes"] > refreshes
        state.batch += 1
        log.write(json.dumps({"step": step, "size": hvd.size(), "rank": hvd.rank(),
                              "phase": opt.phase, "hash": params_hash(model), "host": HOST,
                              "before": before,
                              "opt_steps": opt.steps, "refreshed": refreshed,
                              "adam_diff": adam_diff}) + "\n")
        log.flush()
        if (SCENARIO == "grow" and step == GROW_STEP
                or SCENARIO == "to_one" and step == REGROW_STEP) and hvd.rank() == 0:
            with open(OUT / "hosts.txt", "a") as hosts:
                hosts.write("127.1:1\n")
        if should_die(step):
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker: no goodbye, no cleanup
        state.commit()


train(state)
log.write(json.dumps({"done": True, "size": hvd.size(), "rank": hvd.rank(),
                      "steps": opt.steps, "hash": params_hash(model)}) + "\n")
log.close()
