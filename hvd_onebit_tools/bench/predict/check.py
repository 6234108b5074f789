"""Predicted against measured: the scale model's step times paired with `bench train --json`
reports of the emulated cluster (`bench predict --check`, `benchmarks/predict_check.py`),
each pair with its bound."""
from __future__ import annotations

from .job import Cluster, Job
from .model import Model

# (method, phase of bench train's row) -> the predicted quantity
CHECK_PAIRS = (("local", "all"), ("horovod_fp32", "all"), ("horovod_fp16", "all"),
               ("onebit", "warmup"), ("onebit", "compression"), ("onebit_hierarchical", "warmup"),
               ("onebit_hierarchical", "compression"))
PREDICTED_AS = {"onebit": "onebit", "onebit_hierarchical": "onebit_hierarchical"}


def bound_for(method: str, phase: str, bandwidth: str) -> float:
    """The issue's bounds: 25%, and 15% for the compressed step at 1 Gbit/s."""
    return 0.15 if (method, phase, bandwidth) == ("onebit", "compression", "1gbit") else 0.25


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


def check_report(reports: list[dict], cal: dict) -> dict:
    """Pairs of predicted and measured step times for ``bench train --json`` reports (several
    runs of one configuration are pooled: median and range). A compressed step's pair also
    carries the predicted phases and the measured breakdown (median per part over the runs)."""
    import statistics

    from ...cluster.bandwidth import parse_bandwidth

    groups: dict = {}
    for rep in reports:
        cfg = rep["config"]
        key = (rep["rows"][0]["np"], rep.get("ranks_per_node", 1) or 1, rep["bandwidth"],
               cfg["model"], model_transport(cfg))
        groups.setdefault(key, []).append(rep)
    pairs = []
    for (n, L, bw, model_name, transport), reps in sorted(groups.items()):
        cfg, row0 = reps[0]["config"], reps[0]["rows"][0]
        model = Model(cal, transport=transport, intra_node=model_intra_node(cfg, transport))
        bps = None if bw in ("local", "real") else parse_bandwidth(bw)  # loopback: unshaped
        cl = Cluster(nodes=n // L, ranks_per_node=L, inter_bps=bps, colocated=True)
        job = Job(params=row0["params"], model=model_name, warmup_frac=cfg["warmup_frac"])
        fp32 = model.predict("horovod_fp32", job, cl)
        preds = {("local", "all"): (model.compute(job, cl, free_running=True)[0], None),
                 ("horovod_fp32", "all"): (fp32.step_s, fp32.phases)}
        for method, predicted in PREDICTED_AS.items():
            preds[(method, "warmup")] = (fp32.step_s, fp32.phases)
            p = model.predict(predicted, job, cl)
            preds[(method, "compression")] = (p.step_s, p.phases)
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
                          "transport": transport if method.startswith("onebit") else "horovod",
                          "method": method, "phase": phase, "predicted_s": pred,
                          "measured_s": med, "measured_min_s": min(vals),
                          "measured_max_s": max(vals), "measured_runs_s": vals,
                          "runs": len(vals), "ratio": pred / med, "bound": bound,
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
            "calibration_date": cal.get("machine", {}).get("date")}
