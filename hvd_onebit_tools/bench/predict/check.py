"""Predicted against measured: the scale model's step times paired with `bench train --json`
reports of the emulated cluster (`bench predict --check`, `benchmarks/predict_check.py`),
each pair with its bound."""
from __future__ import annotations

from typing import Optional

from .job import Cluster, Job
from .model import DDP_METHODS, Model

# (method, phase of bench train's row) -> the predicted quantity
CHECK_PAIRS = (("local", "all"), ("horovod_fp32", "all"), ("horovod_fp16", "all"),
               ("onebit", "warmup"), ("onebit", "compression"), ("onebit_hierarchical", "warmup"),
               ("onebit_hierarchical", "compression"), ("onebit_refresh", "warmup"),
               ("onebit_refresh", "compression"), ("onebit_refresh", "refresh"),
               ("ddp_adam", "all"), ("ddp_onebit", "warmup"), ("ddp_onebit", "compression"),
               ("ddp_onebit_refresh", "warmup"), ("ddp_onebit_refresh", "compression"),
               ("ddp_onebit_refresh", "refresh"))
# the library's defaults (onebit_refresh) take flat 1-bit's steps, and a refresh step is
# priced as a full-precision one, as the whole-run figures price it; the DDP face's runs are
# priced as the Horovod face's (DDP_METHODS: DDP + Adam as an fp32 allreduce, the model prices
# one allreduce of the gradients, whoever runs it)
FULL_PRECISION = ("horovod_fp32",) + tuple(m for m, base in DDP_METHODS.items()
                                           if base == "horovod_fp32")
PREDICTED_AS = {"onebit": "onebit", "onebit_hierarchical": "onebit_hierarchical",
                "onebit_refresh": "onebit", "ddp_onebit_refresh": "onebit",
                **{m: base for m, base in DDP_METHODS.items() if base not in FULL_PRECISION}}


def bound_for(method: str, phase: str, bandwidth: str) -> float:
    """The bounds: 25%, and 15% for flat 1-bit's compressed step at 1 Gbit/s (either face)."""
    return 0.15 if (method in ("onebit", "ddp_onebit") and (phase, bandwidth) == (
        "compression", "1gbit")) else 0.25


def model_transport(config: dict) -> str:
    """The scale model's transport for flat 1-bit in a `bench train` run: 'auto' and 'torch'
    ran torch.distributed (on CPU 'auto' resolves to it), 'horovod' (and 'mpi', not modelled:
    the nearest) Horovod's."""
    return "torch" if config.get("transport", "auto") in ("auto", "torch") else "horovod"


def model_intra_node(config: dict, transport: str) -> str:
    """How a `bench train` run's hierarchical stages inside a node travelled: its
    ``intra_node`` ('auto' is shared memory on CPU with torch's transport); runs that predate
    the option used the network."""
    mode = config.get("intra_node", "network")
    if mode == "auto":
        mode = "shared_memory" if transport == "torch" else "network"
    return mode


def priced_intra_node(intra_node: str, transport: str, intra_bps) -> str:
    """What `bench predict --intra-node` prices: 'auto' as `bench train` runs it on the
    emulator, the node's links where --intra-bandwidth gives them a rate (GPU nodes: NVLink,
    PCIe; ``intra_node="auto"`` sends CUDA tensors over them), else shared memory as the
    library's ``intra_node="auto"`` runs CPU ranks on torch's transport. Shared memory serves
    torch's transport only: asked for on Horovod's, a ValueError."""
    if intra_node == "shared_memory" and transport != "torch":
        raise ValueError("--intra-node shared_memory serves torch's transport only, as the "
                         "library's intra_node does: give --transport torch (or auto)")
    if intra_node == "auto" and intra_bps is not None:
        intra_node = "network"
    return model_intra_node({"intra_node": intra_node}, transport)


class OtherModel(ValueError):
    """A `bench train` run of a model whose compute the calibration did not time."""


def model_difference(cal: dict, cfg: dict, params: int, cl: Cluster) -> list[str]:
    """How a `bench train` run's model (its ``config`` and parameter count) differs from the
    bench model of that name whose compute the calibration timed (its ``bench_models`` shape,
    where the file records it, and its parameter count); empty: the same model."""
    name = cfg["model"]
    try:
        calibrated = int(Model(cal).model_figures(name, cl)["params"])
    except KeyError:
        return [f"the calibration timed no {name} model"]
    out = []
    shape = cal.get("bench_models", {}).get(name, {})
    for key, value in shape.items():
        if key != "model" and key in cfg and cfg[key] != value:
            flag = {"batch": "batch-size"}.get(key, key.replace("_", "-"))  # bench train's
            out.append(f"--{flag} {cfg[key]} (calibrated: {value})")
    if params != calibrated:
        out.append(f"{params:,} parameters (calibrated: {calibrated:,})")
    return out


def _adam_estimate(cal: dict, name: str, params: int, cl: Cluster) -> Optional[float]:
    """Seconds of a fused Adam step over ``params`` at the calibrated model's rate per
    parameter (fused Adam's work is per element), or None without that model."""
    try:
        m = Model(cal).model_figures(name, cl)
    except KeyError:
        return None
    return m["adam_s"] * params / m["params"]


def _other_model_error(mismatched: list) -> OtherModel:
    lines = []
    for rep, diffs, adam in mismatched:
        local = [r["all_step_s"] for r in rep["rows"]
                 if r["method"] == "local" and "all_step_s" in r]
        measured = (f"; its local step measured {local[0] * 1e3:.2f} ms" if local else "")
        if adam is not None:
            measured += f", Adam's share about {adam * 1e3:.2f} ms at the calibrated rate"
        lines.append(f"a `bench train --model {rep['config']['model']}` run at "
                     f"{rep['rows'][0]['np']} ranks, {rep['bandwidth']}: {', '.join(diffs)}"
                     f"{measured}")
    return OtherModel(
        "the calibration's compute was measured on the bench models at their default sizes, "
        "not on the model of " + "; ".join(lines) + ". Its step times would be priced with "
        "another model's compute: pass that run's compute with --compute-ms (e.g. its local "
        "step) and Adam's share of it with --adam-ms, with only runs of that model in the "
        "folder, or compare runs of `bench train` at the calibrated sizes")


def check_report(reports: list[dict], cal: dict, compute_s: Optional[float] = None,
                 adam_s: Optional[float] = None) -> dict:
    """Pairs of predicted and measured step times for ``bench train --json`` reports (several
    runs of one configuration are pooled: median and range). A compressed step's pair also
    carries the predicted phases and the measured breakdown (median per part over the runs).

    Compute comes from the calibration's figures for the run's bench model, when the
    calibration timed that model (its shape and parameter count), else :class:`OtherModel`
    is raised; ``compute_s`` (with ``adam_s``, its Adam share: none without it) is every
    run's compute instead, as `bench predict --compute-ms` gives it."""
    import statistics

    from ...cluster.bandwidth import parse_bandwidth

    groups: dict = {}
    for rep in reports:
        cfg = rep["config"]
        key = (rep["rows"][0]["np"], rep.get("ranks_per_node", 1) or 1, rep["bandwidth"],
               cfg["model"], model_transport(cfg))
        groups.setdefault(key, []).append(rep)
    clusters, mismatched = {}, []
    for key, reps in groups.items():
        n, L, bw = key[:3]
        bps = None if bw in ("local", "real") else parse_bandwidth(bw)  # loopback: unshaped
        clusters[key] = Cluster(nodes=n // L, ranks_per_node=L, inter_bps=bps, colocated=True)
        if compute_s is None:
            for rep in reps:
                diffs = model_difference(cal, rep["config"], rep["rows"][0]["params"],
                                         clusters[key])
                if diffs:
                    mismatched.append((rep, diffs, _adam_estimate(
                        cal, rep["config"]["model"], rep["rows"][0]["params"], clusters[key])))
    if mismatched:
        raise _other_model_error(mismatched)
    pairs = []
    for (n, L, bw, model_name, transport), reps in sorted(groups.items()):
        cfg, row0 = reps[0]["config"], reps[0]["rows"][0]
        model = Model(cal, transport=transport, intra_node=model_intra_node(cfg, transport))
        cl = clusters[(n, L, bw, model_name, transport)]
        # a compute given stands for the run's own model: no calibrated bench model's figures
        job = (Job(params=row0["params"], model=model_name, warmup_frac=cfg["warmup_frac"])
               if compute_s is None else
               Job(params=row0["params"], compute_s=compute_s, adam_s=adam_s,
                   warmup_frac=cfg["warmup_frac"]))
        fp32 = model.predict("horovod_fp32", job, cl)
        preds = {("local", "all"): (model.compute(job, cl, free_running=True)[0], None)}
        preds.update({(m, "all"): (fp32.step_s, fp32.phases) for m in FULL_PRECISION})
        for method, predicted in PREDICTED_AS.items():
            preds[(method, "warmup")] = (fp32.step_s, fp32.phases)
            p = model.predict(predicted, job, cl)
            preds[(method, "compression")] = (p.step_s, p.phases)
        for method in ("onebit_refresh", "ddp_onebit_refresh"):
            preds[(method, "refresh")] = (fp32.step_s, fp32.phases)
        fp16 = model.predict("horovod_fp16", job, cl)
        preds[("horovod_fp16", "all")] = (fp16.step_s, fp16.phases)
        for method, phase in CHECK_PAIRS:
            rows = [r for rep in reps for r in rep["rows"]
                    if r["method"] == method and f"{phase}_step_s" in r]
            if not rows:
                continue
            vals = [r[f"{phase}_step_s"] for r in rows]
            pred, pred_phases = preds[(method, phase)]
            med = statistics.median(vals)
            bound = bound_for(method, phase, bw)
            parts = [r.get(f"{phase}_breakdown_s") or {} for r in rows]
            names = sorted({k for b in parts for k in b})
            breakdown = {k: statistics.median(b.get(k, 0.0) for b in parts) for k in names}
            pairs.append({"np": n, "ranks_per_node": L, "bandwidth": bw, "model": model_name,
                          "transport": (transport if "onebit" in method else
                                        "torch" if method.startswith("ddp") else "horovod"),
                          "method": method, "phase": phase, "predicted_s": pred,
                          "measured_s": med, "measured_min_s": min(vals),
                          "measured_max_s": max(vals), "measured_runs_s": vals,
                          "runs": len(vals), "ratio": pred / med, "bound": bound,
                          # the steps the runs' medians were taken over: a phase of a few
                          # steps (a short warmup) is a noisy figure
                          "timed_steps": sum(r.get(f"{phase}_timed_steps", 1) for r in rows),
                          "within": abs(pred / med - 1) <= bound,
                          "predicted_phases_s": pred_phases, "measured_breakdown_s": breakdown})
    # `local` checks the compute input (bench train's step without communication); the methods'
    # predictions are the rest
    methods = [p for p in pairs if p["method"] != "local"]
    compressed = [p for p in pairs if p["phase"] == "compression"]
    return {"pairs": pairs, "met": sum(p["within"] for p in pairs), "total": len(pairs),
            "methods_met": sum(p["within"] for p in methods), "methods_total": len(methods),
            "compressed_met": sum(p["within"] for p in compressed),
            "compressed_total": len(compressed),
            "compute": "calibrated" if compute_s is None else "given",
            "calibration_date": cal.get("machine", {}).get("date")}
