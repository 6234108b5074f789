"""What the scale model predicts for and what it returns: the cluster (nodes, ranks, links),
the training job (parameters, compute, warmup) and a prediction (the step's phases, bytes);
and a job's parameter count as quoted ('350M')."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks. Rates in bits/s (None: unlimited), latency in s.

    ``inter_bps`` is each node's link to the network, shared by its ranks; ``intra_bps`` each
    rank's link inside its node. ``ranks_per_node=1`` is the emulator: a link per rank.
    """

    nodes: int
    ranks_per_node: int = 1
    inter_bps: Optional[float] = 1e9
    intra_bps: Optional[float] = None
    inter_latency_s: float = 0.0
    intra_latency_s: float = 0.0
    colocated: bool = False  # every rank on this machine's cores (the emulator)

    @property
    def n(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass
class Job:
    """What the model needs of a training job.

    ``compute_s``: forward + backward + Adam's step; ``adam_s``: the Adam part of it (the
    compressed step replaces it; 0 if ``compute_s`` is given without it); ``None`` for both:
    from the calibration's bench model ``model`` (embedding or mlp). ``kernel_speedup`` / ``host_speedup`` divide the calibrated
    per-element kernel and per-byte host costs (a faster device or NIC than this machine's core).
    """

    params: int
    compute_s: Optional[float] = None
    adam_s: Optional[float] = None
    model: Optional[str] = None
    warmup_frac: float = 0.15
    kernel_speedup: float = 1.0
    host_speedup: float = 1.0


@dataclass
class Prediction:
    method: str
    phases: dict  # phase name -> seconds, in order (compute first)
    bytes_per_rank: int  # sent per step by each rank
    inter_node_bytes_per_node: Optional[int] = None
    notes: list = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())


def parse_params(text: str) -> int:
    """'350M' -> 350,000,000 (decimal, as parameter counts are quoted); '9.4e6', plain
    integers and the tables' own '437,760' too (commas between groups of three digits only:
    '1,5M' is a ValueError, not 15M); a count that is not whole ('1.5') is a ValueError, not
    1."""
    t = str(text).strip().lower()
    if "," in t:
        if not re.fullmatch(r"\d{1,3}(,\d{3})+", t):
            raise ValueError(f"{text!r}: commas only between groups of three digits")
        t = t.replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}.get(t[-1:] if t else "", None)
    value = float(t[:-1]) * mult if mult else float(t)
    whole = round(value)
    if abs(value - whole) > 1e-9 * max(1.0, abs(value)):
        raise ValueError(f"{text!r}: a parameter count is a whole number")
    return int(whole)
