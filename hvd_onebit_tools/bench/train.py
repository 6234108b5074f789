"""End-to-end training throughput: Horovod Adam (fp32, fp16), DDP Adam, DDP + PowerSGD, and
1-bit Adam through either face (Horovod's and DDP's).

Every method trains the same model on the same synthetic batches from the same initial weights,
one method after another inside one job, so they share the machine's state and network:

* ``local``: the same step with no communication at all. It gives the compute time, hence the
  share of a Horovod fp32 step that is communication (the benchmark reports it).
* ``horovod_fp32`` / ``horovod_fp16``: ``hvd.DistributedOptimizer`` around Adam, without and
  with ``hvd.Compression.fp16``.
* ``ddp_powersgd``: ``torch.nn.parallel.DistributedDataParallel`` over Gloo with PyTorch's
  PowerSGD communication hook (rank-1 approximation, error feedback, warm start), which starts
  compressing after ``powersgd_start`` vanilla-allreduce iterations.
* ``ddp_adam``: DDP over Gloo as a user builds it (its own buckets, its own allreduce from its
  hook, overlapping backward) and the same fused Adam.
* ``ddp_onebit``: the same DDP model under ``hvd_onebit.ddp.DistributedOptimizer``, with
  ``onebit``'s ``freeze_step`` and ``variance_refresh=None`` and, of its other options, those the
  DDP face takes: the DDP face's compression phase, comparable with ``onebit``'s. The summary
  sets its compressed step's speed-up over ``ddp_adam`` against ``onebit``'s over
  ``horovod_fp32`` (``ddp_face_speedup_vs_horovod_face``), and its bytes against ``ddp_adam``'s
  (:mod:`.train_ddp`).
* ``ddp_onebit_refresh``: the DDP face with the library's defaults, ``onebit_refresh``'s
  ``variance_refresh`` and ``freeze_step``, its refresh steps their own phase, ``refresh``: what
  a DDP user runs, measured without Horovod too. The summary sets its whole run against
  ``ddp_adam``'s and ``ddp_onebit``'s, and its bytes against ``ddp_onebit``'s.
* ``onebit``: ``hvd_onebit.DistributedOptimizer`` with ``freeze_step = warmup_frac * steps`` and
  ``variance_refresh=None``: the compression phase's throughput, no refresh step inside it.
* ``onebit_hierarchical``: the same with ``hierarchical=True`` (full precision inside nodes, 1-bit
  between them); meant for clusters with several ranks per node (``--ranks-per-node``).
* ``onebit_blocks``: ``onebit`` with another scale granularity, ``block_size`` elements per
  scale (default 0: one scale per chunk, the coarsest, against the default 512): its step time
  and bytes against ``onebit``'s in the same run (``onebit_blocks_compression_step_vs_onebit``).
* ``onebit_refresh``: 1-bit Adam with ``variance_refresh`` (default ``"doubling"``) and its own
  early ``freeze_step = refresh_freeze_frac * steps``: the library's defaults, a whole-run
  comparison with ``onebit`` (at ``warmup_frac``). Its refresh steps (full precision inside the
  compression phase, from the schedule) are their own phase, ``refresh``.

The DDP methods set up torch.distributed's default group over the Horovod job's ranks
(:func:`hvd_onebit.transport.rendezvous.init_torch_distributed`) unless a method before them
set it up already; where Horovod is not installed, they (and ``local``:
:data:`.world.HOROVOD_FREE`) run alone in a torchrun job.

Every row has the run's wall time (``run_seconds``) and bytes: ``run_measured_tx_bytes`` (rank
0's link counter summed over the steps, on the emulator; with ``--ranks-per-node``, its node's
link, which all the node's ranks share) and ``run_bytes_per_rank`` (1-bit:
the ring-allreduce figure for each full-precision step plus the wire bytes of each compressed
step; Horovod and DDP Adam: the ring figure every step).

The optimizer is ``torch.optim.Adam(fused=True)`` everywhere: the fastest Adam step on CPU, so
the baseline is not slowed by optimizer arithmetic that 1-bit Adam happens to skip.

Two models, both about 9.4M parameters, chosen for many parameters per FLOP, the regime where
communication dominates (as on the paper's Ethernet cluster, where BERT-Large's allreduce took most
of each step):

* ``embedding`` (default): an embedding-bag model (a large token table averaged per sample,
  then a small MLP head), the shape of recommendation and text-classification models. Its dense
  table gradient is one scatter pass, so compute is a small share of the step.
* ``mlp``: a wide MLP with few samples per step. Its backward pass still writes every weight
  gradient with a small matrix product, so when ranks share cores compute is a larger share.

Waiting: ``hvd.synchronize`` spins on ``sched_yield`` until an op finishes. When the ranks share
cores (the emulator puts 4 ranks on this machine's cores), spinning waiters take CPU from ranks
still computing. hvd_onebit's own waits sleep
(see :func:`hvd_onebit.transport.horovod.sleep_until_done`);
with ``wait="sleep"`` (default) the benchmark gives Horovod's optimizer the same sleeping wait, so
the baselines are not slowed by a waiting strategy that a machine with a core per rank would not
pay for. ``wait="spin"`` keeps Horovod's own (:mod:`.waits`).
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

from hvd_onebit.layout import ring_allreduce_bytes
from .allreduce import _iface_tx_bytes
from .refresh import (freeze_step_for, option_text, optimizer_options, refresh_run_figures,
                      run_steps)
from .train_ddp import (DDP_METHODS, DDP_ONEBIT_METHODS, ddp_summary, make_ddp_method,
                        onebit_phase)
from .waits import WAITS
from .waits import sleeping_horovod_waits as _sleeping_horovod_waits  # noqa: F401 (zoo)
from .world import World

# glibc serves allocations above 32 MiB (and, after heap trims, smaller ones) with fresh mmap()s,
# so a training step that allocates its gradients anew page-faults and zero-fills tens of MB each
# step. Serving everything from a heap that is
# never trimmed keeps those pages mapped. (jemalloc or tcmalloc via LD_PRELOAD do the same job.)
MALLOC_REUSE_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
METHODS = ("local", "horovod_fp32", "horovod_fp16", "ddp_powersgd", "ddp_adam", "ddp_onebit",
           "ddp_onebit_refresh", "onebit", "onebit_sync", "onebit_hierarchical",
           "onebit_refresh", "onebit_blocks")
ONEBIT_METHODS = ("onebit", "onebit_sync", "onebit_hierarchical", "onebit_refresh",
                  "onebit_blocks")
DEFAULT_METHODS = ("local", "horovod_fp32", "horovod_fp16", "ddp_powersgd", "ddp_adam",
                   "ddp_onebit", "ddp_onebit_refresh", "onebit", "onebit_refresh")
#: The methods with ``variance_refresh`` frozen at ``refresh_freeze_frac``, one per face.
REFRESH_METHODS = ("onebit_refresh", "ddp_onebit_refresh")
MODELS = ("mlp", "embedding")
IN_DIM = OUT_DIM = 256


def build_mlp(width: int, depth: int, in_dim: int = IN_DIM, out_dim: int = OUT_DIM):
    import torch.nn as nn

    layers, dim = [], in_dim
    for _ in range(depth):
        layers += [nn.Linear(dim, width), nn.GELU()]
        dim = width
    layers.append(nn.Linear(dim, out_dim))
    return nn.Sequential(*layers)


def build_embedding_model(vocab: int, dim: int, width: int, out_dim: int = OUT_DIM):
    """EmbeddingBag(vocab x dim, mean over each sample's tokens) -> Linear -> GELU -> Linear.

    The table's gradient is dense (``sparse=False``), as Horovod and Adam need.
    """
    import torch.nn as nn

    class EmbeddingBagModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.EmbeddingBag(vocab, dim, mode="mean")
            self.head = nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, out_dim))

        def forward(self, tokens):  # tokens: [batch, tokens per sample] int64
            return self.head(self.table(tokens))

    return EmbeddingBagModel()


def onebit_arguments(method: str, steps: int, warmup_frac: float, onebit_options: dict,
                     variance_refresh=None, refresh_freeze_frac: float = 0.05,
                     block_size: int = 0) -> dict:
    """``hvd_onebit.DistributedOptimizer``'s keyword arguments (beyond the optimizer and the
    parameters) for a 1-bit method; ``variance_refresh`` only for ``onebit_refresh``, and only
    when set; ``block_size`` only for ``onebit_blocks`` (0: one scale per chunk)."""
    options = dict(onebit_options)
    if method == "onebit_blocks":
        options["block_size"] = block_size or None
    refresh = variance_refresh if method == "onebit_refresh" else None
    if method == "onebit_hierarchical":
        options["hierarchical"] = True
    if method == "onebit_sync":
        options["overlap"] = False
    frac = refresh_freeze_frac if method == "onebit_refresh" else warmup_frac
    options["freeze_step"] = freeze_step_for(frac, steps)
    return optimizer_options(refresh, **options)


def _make_step(method: str, model, steps: int, warmup_frac: float, powersgd_start: int, lr: float,
               onebit_options: dict, variance_refresh=None, refresh_freeze_frac: float = 0.05,
               gradient_as_bucket_view: bool = False, block_size: int = 0):
    """Returns (step_fn(x, y) -> backward seconds, optimizer or None, phase_fn())."""
    import torch

    import hvd_onebit

    loss_fn = torch.nn.MSELoss()
    base = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    opt, net, phase = base, model, (lambda: "n/a")
    counter = {"it": 0}
    if method in ("horovod_fp32", "horovod_fp16"):
        import horovod.torch as hvd

        comp = hvd.Compression.fp16 if method == "horovod_fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp)
    elif method in ONEBIT_METHODS:
        options = onebit_arguments(method, steps, warmup_frac, onebit_options, variance_refresh,
                                   refresh_freeze_frac, block_size)
        opt = hvd_onebit.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                              **options)
        phase = onebit_phase(opt, variance_refresh if method == "onebit_refresh" else None,
                             counter)
    elif method in DDP_METHODS:
        net, opt, phase = make_ddp_method(method, model, base, steps, warmup_frac,
                                          powersgd_start, onebit_options, counter,
                                          gradient_as_bucket_view, variance_refresh,
                                          refresh_freeze_frac)
    elif method != "local":
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - start
        opt.step()
        counter["it"] += 1
        return backward

    return step, opt, phase


def train_worker(methods=METHODS, steps: int = 40, warmup_frac: float = 0.15,
                 model: str = "embedding", width: int = 2048, depth: int = 3, batch: int = 4,
                 vocab: int = 32768, embed_dim: int = 256, tokens: int = 2048,
                 lr: float = 1e-4, powersgd_start: int = 10, wait: str = "sleep",
                 transport: str = "auto", bucket_size_mb: Optional[float] = None,
                 intra_node: str = "auto", variance_refresh=None,
                 refresh_freeze_frac: float = 0.05,
                 gradient_as_bucket_view: bool = False, block_size: int = 0) -> list[dict]:
    """Runs in every rank of a Horovod job (after hvd.init()) or, for the methods that need no
    Horovod (:data:`.world.HOROVOD_FREE`), of a torchrun job. Returns one row per method (rank
    0's view).

    ``model="mlp"`` uses width/depth; ``model="embedding"`` uses vocab/embed_dim, ``tokens``
    token ids per sample, and ``width`` for its head. ``transport``, ``bucket_size_mb`` and
    ``intra_node`` are 1-bit Adam's options (None: its default bucket size);
    ``variance_refresh`` and ``refresh_freeze_frac`` are ``onebit_refresh``'s and
    ``ddp_onebit_refresh``'s;
    ``gradient_as_bucket_view`` is DDP's option for every DDP method; ``block_size`` is
    ``onebit_blocks``'s.
    """
    import torch

    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
    world = World.of_this_job()
    if world.horovod:
        _sleeping_horovod_waits(wait == "sleep")
    rows = []
    for method in methods:
        torch.manual_seed(0)
        net = (build_mlp(width, depth) if model == "mlp"
               else build_embedding_model(vocab, embed_dim, width))
        params = sum(p.numel() for p in net.parameters())
        options = {"transport": transport, "intra_node": intra_node}
        if bucket_size_mb is not None:
            options["bucket_size_mb"] = bucket_size_mb
        step, opt, phase = _make_step(method, net, steps, warmup_frac, powersgd_start, lr, options,
                                      variance_refresh, refresh_freeze_frac,
                                      gradient_as_bucket_view, block_size)
        g = torch.Generator().manual_seed(world.rank)
        if model == "mlp":
            inputs = [torch.randn(batch, IN_DIM, generator=g) for _ in range(4)]
        else:
            inputs = [torch.randint(vocab, (batch, tokens), generator=g) for _ in range(4)]
        batches = [(x, torch.randn(batch, OUT_DIM, generator=g)) for x in inputs]
        times, phases, tx, parts = [], [], [], []
        compressed_bytes = None
        world.start_line(f"bench.train.start.{method}")
        for i in range(steps):
            phases.append(phase())
            tx0 = _iface_tx_bytes()
            start = time.perf_counter()
            backward = step(*batches[i % len(batches)])
            times.append(time.perf_counter() - start)
            # where the compressed step's time went (hvd_onebit's own accounting)
            split = getattr(opt, "last_step_breakdown", None) or {}
            parts.append({"backward": backward, **split})
            tx1 = _iface_tx_bytes()
            tx.append(None if tx0 is None else tx1 - tx0)
            if phases[-1] == "compression":  # a compressed step's bytes (not a refresh's)
                compressed_bytes = getattr(opt, "last_step_bytes", None)
        # Every rank's step times: [ranks, steps]. The ranks are chained by the step's
        # collectives, so a rank delayed in step i lengthens its own step i and the others'
        # step i+1 (they wait for it in the next collective). The max over ranks step by step
        # would count that delay twice; the mean over ranks counts it once, and its sum over
        # the steps is the run's wall time. The run time is the slowest rank's own total.
        per_rank = world.gather_rows(torch.tensor([times], dtype=torch.float64),
                                     f"bench.train.times.{method}")
        times = per_rank.mean(0).tolist()
        row = {"method": method, "model": model, "np": world.size, "params": params,
               "batch_per_rank": batch, "steps": steps,
               "run_seconds": float(per_rank.sum(1).max()),
               "run_measured_tx_bytes": (sum(tx) if tx and None not in tx else None),
               "step_seconds": times, "step_phases": phases}
        # The first step of each phase pays one-off set-up (buffers, hooks): steady state skips it.
        for ph in sorted(set(phases)):
            idx = [i for i, p in enumerate(phases) if p == ph]
            steady = idx[1:] if len(idx) > 2 else idx
            key = "all" if ph == "n/a" else ph
            med = statistics.median(times[i] for i in steady)
            row[f"{key}_step_s"] = med
            row[f"{key}_samples_per_s"] = batch * world.size / med
            measured = [tx[i] for i in steady if tx[i] is not None]
            row[f"{key}_measured_tx_bytes_per_step"] = (statistics.median(measured)
                                                        if measured else None)
            row[f"{key}_steps"] = len(idx)
            row[f"{key}_timed_steps"] = len(steady)  # the steps its medians are taken over
            names = sorted({k for i in steady for k in parts[i]})
            row[f"{key}_breakdown_s"] = {k: statistics.median(parts[i].get(k, 0.0) for i in steady)
                                         for k in names}
        if method in ONEBIT_METHODS + DDP_ONEBIT_METHODS:
            row["freeze_step"] = opt.freeze_step
            row["compression_bytes_per_step"] = (opt.last_step_bytes if compressed_bytes is None
                                                 else compressed_bytes)
            refresh = variance_refresh if method in REFRESH_METHODS else None
            kinds = run_steps(steps, opt.freeze_step, refresh)
            row["variance_refresh"] = option_text(refresh)
            row["steps_by_kind"] = kinds
            row["run_bytes_per_rank"] = (
                kinds["full_precision_steps"] * ring_allreduce_bytes(params * 4, world.size)
                + kinds["compressed_steps"] * (row["compression_bytes_per_step"] or 0))
        elif method.startswith("horovod") or method == "ddp_adam":
            elem = 2 if method.endswith("fp16") else 4
            n = world.size
            row["bytes_per_step"] = ring_allreduce_bytes(params * elem, n)
            row["run_bytes_per_rank"] = steps * row["bytes_per_step"]
        rows.append(row)
        del opt, net, step
    return rows


def _measured_bytes_ratio(row: dict, base: dict) -> Optional[float]:
    """``row``'s measured link bytes per compressed step over ``base``'s (None: either has none)."""
    key = "compression_measured_tx_bytes_per_step"
    return row[key] / base[key] if row.get(key) and base.get(key) else None


def _ratio(a: Optional[dict], a_key: str, b: Optional[dict], b_key: str) -> Optional[float]:
    """``a[a_key] / b[b_key]``, or None where either row or figure is missing (a run too short
    for a phase has no median for it)."""
    if not a or not b or a.get(a_key) is None or not b.get(b_key):
        return None
    return a[a_key] / b[b_key]


def summarize(rows: list[dict]) -> dict:
    """Speed-ups against Horovod fp32 Adam and the communication share of its step; a ratio
    whose figures the run lacks is left out."""
    by = {r["method"]: r for r in rows}
    out: dict = {}
    fp32 = by.get("horovod_fp32")
    local = by.get("local")
    ob = by.get("onebit")
    sync = by.get("onebit_sync")
    hier = by.get("onebit_hierarchical")
    blocks = by.get("onebit_blocks")
    C, A = "compression_step_s", "all_step_s"
    ratios = {
        "onebit_compression_step_speedup_vs_fp32": (fp32, A, ob, C),
        "onebit_warmup_step_speedup_vs_fp32": (fp32, A, ob, "warmup_step_s"),
        "onebit_run_speedup_vs_fp32": (fp32, "run_seconds", ob, "run_seconds"),
        "onebit_warmup_fraction": (ob, "freeze_step", ob, "steps") if fp32 else (None,) * 4,
        "onebit_compression_step_vs_local": (ob, C, local, A),
        "onebit_overlap_step_vs_sync": (ob, C, sync, C),
        "onebit_hier_compression_step_speedup_vs_fp32": (fp32, A, hier, C),
        "onebit_hier_run_speedup_vs_fp32": (fp32, "run_seconds", hier, "run_seconds"),
        "onebit_hier_compression_step_speedup_vs_onebit": (ob, C, hier, C),
        # another scale granularity against the default's, in the same run
        "onebit_blocks_compression_step_vs_onebit": (blocks, C, ob, C),
    }
    if fp32 and local:
        out["comm_fraction_of_fp32_step"] = 1 - local[A] / fp32[A]
    for key, (a, a_key, b, b_key) in ratios.items():
        value = _ratio(a, a_key, b, b_key)
        if value is not None:
            out[key] = value
    if hier and ob:
        out["onebit_hier_measured_bytes_vs_onebit"] = _measured_bytes_ratio(hier, ob)
    if ob and blocks:
        out["onebit_blocks_compression_bytes_vs_onebit"] = _measured_bytes_ratio(blocks, ob)
    # the whole-run comparison: the refresh setting against Adam and the fixed warmup
    out.update(refresh_run_figures("onebit_refresh", by.get("onebit_refresh"), ob, fp32,
                                   ("fp32", "onebit")))
    for name in ("horovod_fp16", "ddp_powersgd"):
        r = by.get(name)
        if fp32 and r:
            out[f"{name}_run_speedup_vs_fp32"] = fp32["run_seconds"] / r["run_seconds"]
    ddp = by.get("ddp_powersgd")
    if ob and ddp:
        out["onebit_vs_ddp_powersgd_run_speedup"] = ddp["run_seconds"] / ob["run_seconds"]
        value = _ratio(ddp, C, ob, C)
        if value is not None:
            out["onebit_vs_ddp_powersgd_compression_step_speedup"] = value
    out.update(ddp_summary(by))
    return out


def plot(rows: list[dict], path: str, bandwidth: str) -> None:
    """A PNG bar chart of samples/s per method and phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for r in rows:
        for phase in ("all", "warmup", "compression"):
            if f"{phase}_samples_per_s" in r:
                labels.append(r["method"] + ("" if phase == "all" else f"\n{phase}"))
                values.append(r[f"{phase}_samples_per_s"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(f"Training throughput, {rows[0]['np']} ranks, {bandwidth}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
