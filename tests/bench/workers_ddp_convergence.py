"""Rank side of tests/bench/test_ddp_convergence.py: the convergence tools' DDP face in a
torchrun world (Gloo, Horovod blocked): the zoo's worker on one Adam cell and one 1-bit cell,
and examples/train_lm.py's ``main`` with ``--face ddp``, once per optimizer."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch.distributed as dist

from hvd_onebit_tools.bench.zoo.grid import plan_family
from hvd_onebit_tools.bench.zoo.models import train_lm_module
from hvd_onebit_tools.bench.zoo.worker import zoo_worker
from tests.scenarios import run_scenarios

ZOO_STEPS, ZOO_FREEZE = 20, "20%"
LM_STEPS = 8
LM_ARGS = ["--face", "ddp", "--steps", str(LM_STEPS), "--eval-every", "4", "--warmup-frac",
           "0.5", "--variance-refresh", "none", "--n-layer", "1", "--d-model", "32", "--n-head",
           "2", "--context", "32", "--batch-size", "4", "--eval-batches", "2"]


def zoo_cells(results: str) -> dict:
    """The embedding_bag family's Adam cell and its bounded 1-bit cell frozen at 20%, under DDP
    (the family whose data is the quickest to make); the records (rank 0's) and the lines rank 0
    wrote."""
    cells = plan_family("embedding_bag", [0], ["bounded"], freezes=[ZOO_FREEZE],
                        lr_rules=["scaled"], steps=ZOO_STEPS, batch=8)
    records = zoo_worker(cells, results, face="ddp")
    lines = Path(results).read_text().splitlines() if dist.get_rank() == 0 else []
    return {"records": records, "lines": len(lines)}


def train_lm(optimizer: str) -> dict:
    """examples/train_lm.py's summary after ``main`` with ``--face ddp --optimizer optimizer``."""
    return train_lm_module().main(["--optimizer", optimizer, *LM_ARGS])


def suite(scratch: str) -> dict:
    scenarios = {"zoo": partial(zoo_cells, f"{scratch}/cells.jsonl"),
                 "lm_adam": partial(train_lm, "adam"), "lm_onebit": partial(train_lm, "onebit")}
    return run_scenarios(scenarios, dist.get_rank())
