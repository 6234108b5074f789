"""The documentation's generated parts: every results table from a committed JSON that a
benchmark printed, and the settings that matter from the code itself (defaults from
``DistributedOptimizer``'s signature, guidance from its docstring), so no figure or default is
copied by hand.

The tables are written into the Markdown files themselves, between ``<!-- generated:NAME -->``
markers (``BLOCKS`` says which file holds which), so a Markdown viewer shows them as the Sphinx
site does; the zoo figures go to ``docs/figures/``, committed beside the pages that show them.
``python -m hvd_onebit_tools.docs_tables`` refreshes both; ``--check`` exits 1 when a block is
stale (``tests/test_docs.py`` fails then too).
"""
from __future__ import annotations

import argparse
import inspect
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures"
README = ROOT / "README.md"
SETTINGS = ("freeze_step", "variance_refresh", "hierarchical")
# The zoo tables' columns: (folder under docs/, scheme, label). The library's defaults ran as
# "default_blocks512" in the granularity run (block_size 512, the refresh schedule), beside one
# scale per chunk; at the longer length they ran as "default" in zoo_long_default; the frozen
# variance ("bounded") with a scale per 512 elements in zoo_frozen and zoo_long_default; the
# columns that say block_size=None come from runs at one scale per chunk.
ZOO_COLUMNS = {
    "zoo": (("granularity", "default_blocks512", "1-bit Adam (defaults)"),
            ("granularity", "default", "with block_size=None"),
            ("zoo_frozen", "bounded", "with variance_refresh=None"),
            ("zoo", "bounded", "with variance_refresh=None, block_size=None")),
    "zoo_long": (("zoo_long_default", "default", "1-bit Adam (defaults)"),
                 ("zoo_long_default", "bounded", "with variance_refresh=None"),
                 ("zoo_long", "bounded_refresh_doubling", "with block_size=None"),
                 ("zoo_long", "bounded", "with variance_refresh=None, block_size=None")),
}
# The figure of each zoo table: its first column's runs.
ZOO_FIGURES = {"zoo": ZOO_COLUMNS["zoo"][0], "zoo_long": ZOO_COLUMNS["zoo_long"][0]}
FADING = {"fading.json": "lr 3e-3", "fading_lr1e-2.json": "lr 1e-2"}  # under docs/step/
FADING_SETTINGS = {"doubling": "\"doubling\" (default)", "none": "None"}
# the two refresh gates, since retired, as measured with the code of their day (the files'
# provenance), beside the same day's default
FADING_RETIRED = {"fading_retired_gates.json": "lr 3e-3",
                  "fading_retired_gates_lr1e-2.json": "lr 1e-2"}
RETIRED_SETTINGS = {"doubling": "\"doubling\", then the default",
                    "lowering": "\"doubling\", accept=\"lowering\" (retired gate)",
                    "hypergradient": "\"doubling\", accept=\"hypergradient\" (retired gate)"}


def _load(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def shown_command(command: str) -> str:
    """A recorded command as the docs show it: an absolute output path of the machine that ran
    it becomes ``OUT/<its last part>`` (where it wrote is not part of what it measured)."""
    return re.sub(r"(?<![\w.])/(?:[\w.-]+/)+([\w.-]+)", r"OUT/\1", command)


def provenance(source: str, data: dict, dated: bool = True) -> str:
    """Where a table's figures come from: the file, its command, and the machine, commit and
    date where the JSON records them (``dated=False``: not the date, which the JSON keeps, for
    the README, which holds no dated line)."""
    command = shown_command(data.get("command", "its benchmark"))
    parts = [f"From `docs/{source}`, printed by `{command}`"]
    for key in ("machine", "commit", "date", "versions"):
        if key == "date" and not dated:
            continue
        if key in data:
            value = data[key]
            if key == "machine" and not dated and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k != "date"}
            if key == "commit" and data.get("uncommitted_changes"):
                value = f"{value} with uncommitted changes"
            parts.append(f"{key}: {json.dumps(value) if isinstance(value, dict) else value}")
    missing = [k for k in ("machine", "commit", "date") if k not in data and (dated or k != "date")]
    if missing:
        parts.append(f"the JSON does not record its {', '.join(missing)}")
    return "; ".join(parts) + "."


def headline(name: str = "convergence.json", dated: bool = True) -> str:
    """Adam against 1-bit Adam on the language-model example (``docs/<name>``: the Horovod
    face's run, or the DDP face's under torchrun where the JSON says ``"face": "ddp"``);
    ``dated``: as :func:`provenance`'s."""
    d = _load(name)
    adam = "Adam (DDP)" if d.get("face") == "ddp" else "Adam (Horovod allreduce)"
    onebit = "1-bit Adam, DDP face" if d.get("face") == "ddp" else "1-bit Adam"
    rows = [[adam, f"{d['final_val_loss_adam']:.4f}",
             f"{d['total_bytes_per_rank_adam'] / 1e6:,.0f}", f"{d['samples_per_sec_adam']:.0f}"],
            [f"{onebit} (freeze_step {d['freeze_step']}, {refresh_label(d)})",
             f"{d['final_val_loss_onebit']:.4f}", f"{d['total_bytes_per_rank_onebit'] / 1e6:,.0f}",
             f"{d['samples_per_sec_onebit_warmup']:.0f} (warmup), "
             f"{d['samples_per_sec_onebit_compression']:.0f} (compression phase)"]]
    cores = (d.get("machine") or {}).get("cpu_count")
    machine = f"sharing one machine's {cores} cores" if cores else "of one machine"
    where = (f"`examples/train_lm.py`, {d['world_size']} CPU ranks {machine} (loopback: no "
             f"link limit, so the samples/s show the cost of the compression, not its gain; "
             f"the warmup sends what Adam sends, and the two runs ran one after the other on "
             f"a machine whose speed moves between runs), {d['steps']} steps, "
             f"{d['params']:,} parameters.")
    return "\n\n".join([where, table(["optimizer", "final validation loss",
                                      "MB sent per rank", "samples/s"], rows),
                        provenance(name, d, dated=dated)])


def refresh_label(d: dict) -> str:
    """The variance setting of a convergence run, as its JSON records it."""
    return f"variance_refresh={d['variance_refresh']!r}".replace("'none'", "None")


def freeze_runs(example: str) -> str:
    name = f"auto_freeze_{example}.json"
    d = _load(name)
    rows = []
    for run, r in d["runs"].items():
        freeze = "-" if r["freeze_step"] is None else f"{r['freeze_step']}"
        rows.append([run, freeze, f"{r['final_val_loss']:.4f}", f"{r['ratio_to_adam']:.3f}",
                     f"{r['total_bytes_per_rank'] / 1e6:,.0f}"])
    return "\n\n".join([table(["run", "freeze step", "final validation loss", "ratio to Adam",
                               "MB sent per rank"], rows), provenance(name, d)])


def zoo(name: str = "zoo") -> str:
    """Every family: each column's scheme against Adam (:data:`ZOO_COLUMNS`), median and
    worst cell."""
    columns = [(folder, scheme, label, _load(f"{folder}/summary.json"))
               for folder, scheme, label in ZOO_COLUMNS[name]]
    families = sorted({f for _, s, _, d in columns for f in d["families"].get(s, {})})
    header = ["family"] + [f"{label}: median / worst ratio to Adam" for _, _, label, _ in columns]
    rows = []
    for fam in families:
        row = [fam]
        for _, s, _, d in columns:
            f = d["families"].get(s, {}).get(fam)
            row.append("-" if f is None else f"{f['median_ratio']:.3f} / {f['max_ratio']:.3f}"
                       + (f", {f['divergences']} diverged" if f["divergences"] else ""))
        rows.append(row)
    totals = ["every cell"] + [
        f"{d['schemes'][s]['median_ratio']:.3f} / {d['schemes'][s]['max_ratio']:.3f}, "
        f"{d['schemes'][s]['divergences']} diverged of {d['schemes'][s]['cells']}"
        for _, s, _, d in columns]
    sources = ", ".join(f"`docs/{folder}/summary.json` ({d['runs']} runs)"
                        for folder, d in {c[0]: c[3] for c in columns}.items())
    note = (f"Final {columns[0][3]['metric']} loss over Adam's in each cell (family, lr rule, "
            f"freeze, seed), each against the Adam cells of its own run. From {sources}, "
            f"printed by `hvd-onebit bench dev zoo`.")
    recorded = [provenance(f"{folder}/provenance.json", _load(f"{folder}/provenance.json"))
                for folder in dict.fromkeys(c[0] for c in columns)
                if (DOCS / folder / "provenance.json").exists()]
    return "\n\n".join([table(header, rows + [totals]), note, *recorded])


def fading() -> str:
    """The fading task: each variance_refresh setting's final loss over Adam's, per seed, worst
    and median, at each learning rate measured."""
    rows, notes = [], []
    runs = ([(n, lb, FADING_SETTINGS) for n, lb in FADING.items()]
            + [(n, f"{lb}, {n}", RETIRED_SETTINGS) for n, lb in FADING_RETIRED.items()])
    for name, label, settings in runs:
        d = _load(f"step/{name}")
        task = d["task"]
        for setting, text in settings.items():
            r = d["over_adam"].get(setting)
            if r is not None:
                rows.append([label, text, " / ".join(f"{x:.3f}" for x in r["per_seed"]),
                             f"{r['worst']:.3f}", f"{r['median']:.3f}"])
        p = d["provenance"]
        notes.append(f"{label}: {task['np']} ranks, {task['steps']} steps, batch {task['batch']} "
                     f"per rank, {task['samples']} points, frozen at {task['freeze']:.0%}; "
                     f"`{shown_command(p['command'])}`, commit {p['commit'][:10]}, "
                     f"{p['machine'].get('date', 'date not recorded')}")
    return "\n\n".join([table(["lr", "variance_refresh", "over Adam, per seed", "worst",
                                 "median"], rows), "From " + "; ".join(notes) + "."])


def zoo_figure(folder: str, scheme: str, label: str) -> Path:
    """One readable zoo figure: the defaults against Adam in every family (rows) and lr rule x
    freeze (columns), each cell the median over seeds of the final-loss ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    d = _load(f"{folder}/summary.json")
    cells = [c for c in d["cells"] if c["scheme"] == scheme]
    families = sorted({c["family"] for c in cells})
    columns = sorted({(c["lr_rule"], c["freeze"]) for c in cells})
    grid = np.full((len(families), len(columns)), np.nan)
    for i, fam in enumerate(families):
        for j, col in enumerate(columns):
            ratios = [c["ratio"] for c in cells if c["family"] == fam
                      and (c["lr_rule"], c["freeze"]) == col and c["ratio"] is not None]
            if ratios:
                grid[i, j] = float(np.median(ratios))
    fig, ax = plt.subplots(figsize=(1.1 * len(columns) + 3, 0.45 * len(families) + 1.6))
    span = max(0.05, float(np.nanmax(np.abs(np.log(grid)))))
    im = ax.imshow(np.log(grid), cmap="RdBu_r", vmin=-span, vmax=span, aspect="auto")
    ax.set_xticks(range(len(columns)), [f"{lr} lr\nfreeze {fr}" for lr, fr in columns],
                  fontsize=8)
    ax.set_yticks(range(len(families)), families, fontsize=8)
    for i in range(len(families)):
        for j in range(len(columns)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title(f"{label} over Adam, final loss, median over seeds "
                 "(below 1: better than Adam)", fontsize=9)
    fig.colorbar(im, ax=ax, label="log ratio")
    fig.tight_layout()
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{folder}_{scheme}.png"
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def settings() -> str:
    """The settings that matter: each option's default from the signature and its guidance
    from the docstring's Args."""
    from hvd_onebit import DistributedOptimizer
    from hvd_onebit.config import REQUIRED

    signature = inspect.signature(DistributedOptimizer)
    doc = inspect.getdoc(DistributedOptimizer) or ""
    rows = []
    for name in SETTINGS:
        default = signature.parameters[name].default
        default = "required" if default is inspect.Parameter.empty or default is REQUIRED \
            else f"`{default!r}`"
        rows.append([f"`{name}`", default, arg_doc(doc, name)])
    return table(["setting", "default", "guidance (DistributedOptimizer's docstring)"], rows)


def freeze_guidance(ddp: bool = False) -> str:
    """The docstring's guidance for ``freeze_step``, as the tuning page shows it (``ddp``: the
    DDP face's, which a job without Horovod can import)."""
    if ddp:
        from hvd_onebit.ddp import DistributedOptimizer
    else:
        from hvd_onebit import DistributedOptimizer

    return arg_doc(inspect.getdoc(DistributedOptimizer) or "", "freeze_step")


def arg_doc(doc: str, name: str) -> str:
    """One entry of a Google-style Args section, joined into one line, its type dropped: its
    first line and the lines indented deeper than it."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        match = re.match(rf"( *){name} \([^)]*\): (.*)", line)
        if match:
            indent, text = len(match.group(1)), [match.group(2)]
            for more in lines[i + 1:]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                text.append(more)
            return " ".join(" ".join(text).split()).replace("|", "\\|")
    raise ValueError(f"DistributedOptimizer's docstring documents no argument {name!r}")


def zoo_faces(name: str = "ddp/zoo_ddp/faces.json") -> str:
    """The DDP face's zoo cells against the Horovod face's (the same cells run in the same
    session, and any other zoo the report was given), each the ratio of the face's loss to its
    own Adam's."""
    d = _load(name)
    others = d["others"]
    rows = [[c["family"], c["lr_rule"], c["freeze"], c["seed"], f"{c['ratio']:.3f}",
             *(f"{c['others'][o]:.3f}" if c["others"].get(o) is not None else "-"
               for o in others), "yes" if c["diverged"] else "no"] for c in d["cells"]]
    header = ["family", "lr rule", "freeze", "seed", "DDP face",
              *(f"Horovod face (`{o}`)" for o in others), "diverged"]
    return "\n\n".join([table(header, rows), provenance(name, d)])


DDP_TRAIN = "ddp_train"  # bench train runs of both faces, one JSON per run


def ddp_train() -> str:
    """Each committed ``bench train`` run of both faces: each face's compressed step against
    its own fp32 Adam, their ratio, the whole run and the bytes on the wire."""
    rows, notes = [], []
    for path in sorted((DOCS / DDP_TRAIN).glob("run*.json")):
        d = json.loads(path.read_text())
        s = d["summary"]
        rows.append([path.stem, f"{s['onebit_compression_step_speedup_vs_fp32']:.2f}",
                     f"{s['ddp_onebit_compression_step_speedup_vs_ddp_adam']:.2f}",
                     f"{s['ddp_face_speedup_vs_horovod_face']:.3f}",
                     f"{s['ddp_onebit_run_speedup_vs_ddp_adam']:.2f}",
                     f"{s['ddp_onebit_run_speedup_vs_ddp_powersgd']:.2f}",
                     f"{s['ddp_onebit_measured_bytes_vs_ddp_adam']:.4f}",
                     _maybe(s.get("ddp_onebit_refresh_run_speedup_vs_ddp_adam"), ".2f")])
        notes.append(provenance(f"{DDP_TRAIN}/{path.name}", d))
    header = ["run", "Horovod face's compressed step over Horovod Adam's",
              "DDP face's over DDP Adam's", "DDP face's gain over the Horovod face's",
              "DDP face's whole run over DDP Adam's", "over DDP PowerSGD's",
              "DDP face's wire bytes per compressed step over DDP Adam's",
              "the defaults' whole run over DDP Adam's"]
    return "\n\n".join([table(header, rows), *notes])


def _maybe(value, spec: str) -> str:
    """``value`` formatted, or a dash where a run did not measure it."""
    return "-" if value is None else format(value, spec)


DIGITS_RUNS = {"refresh_5pct": '"doubling" (default), frozen at 5%',
               "refresh_auto": '"doubling", freeze_step="auto"',
               "frozen_20pct": "None, frozen at 20%", "auto": 'None, freeze_step="auto"'}


def refresh_digits(name: str = "step/refresh_digits.json") -> str:
    """The digits CNN: each variance setting's final validation loss over Adam's, per seed,
    worst and mean, and its bytes."""
    d = _load(name)
    rows = []
    for run, label in DIGITS_RUNS.items():
        s = d["summary"][run]
        ratios = [s["ratio_to_adam"][k] for k in sorted(s["ratio_to_adam"])]
        mb = [d["per_seed"][k]["runs"][run]["total_bytes_per_rank"] / 1e6
              for k in sorted(d["per_seed"])]
        rows.append([label, " / ".join(f"{r:.3f}" for r in ratios), f"{max(ratios):.3f}",
                     f"{s['mean_ratio_to_adam']:.3f}", f"{statistics.median(mb):.1f}"])
    adam_mb = statistics.median(d["per_seed"][k]["runs"]["adam"]["total_bytes_per_rank"] / 1e6
                                for k in d["per_seed"])
    note = f"Adam sends {adam_mb:.1f} MB per rank over the same run."
    return "\n\n".join([table(["variance_refresh", "over Adam, per seed", "worst", "mean",
                                 "MB sent per rank (median)"], rows), note,
                          provenance(name, d)])


def refresh_predict(name: str = "step/predict_refresh.json") -> str:
    """The scale model's whole-run speed and bytes of the default refresh (an early freeze and
    refresh steps) against a fixed warmup and a frozen variance, at several scales and lengths."""
    d = _load(name)
    i = d["inputs"]
    rows = [[r["np"], f"{r['inter_bps'] / 1e9:g} Gbit/s", r["method"], f"{r['run_steps']:,}",
             f"{r['fixed_run_speedup_vs_fp32']:.2f}", f"{r['refresh_full_precision_steps']:,}",
             f"{r['refresh_run_speedup_vs_fp32']:.2f}", f"{r['refresh_vs_fixed_run_speedup']:.2f}",
             f"{r['refresh_vs_fixed_bytes']:.3f}"] for r in d["rows"]]
    header = ["ranks", "links", "method", "steps",
              f"frozen at {i['warmup_frac']:.0%}: run over Horovod fp32's",
              f"{i['variance_refresh']} frozen at {i['refresh_freeze_frac']:.0%}: "
              "full-precision steps", "its run over Horovod fp32's", "speed over frozen's",
              "bytes over frozen's"]
    note = (f"{i['params']:,} parameters, {i['compute_s'] * 1e3:g} ms of compute per step, "
            f"the calibration of {d['calibration']['date']}.")
    return "\n\n".join([table(header, rows), note, provenance(name, d)])


KERNEL = "kernel"  # bench dev kernel runs: the 8-lane paths (before_*) and the default (after_*)
KERNEL_PASSES = {"compress": "compress", "server": "server step", "decode": "decode",
                 "momentum_compress": "momentum + compress",
                 "momentum_compress_preconditioned": "preconditioned momentum + compress (default)",
                 "decode_update": "decode + update",
                 "decode_update_preconditioned": "preconditioned decode + update (default)"}


def kernel() -> str:
    """Each native pass's element rate over ``torch.add``'s in the same process, the median of
    the committed runs with the AVX-512 paths forbidden and allowed, and its bytes per second."""
    runs = {which: [json.loads(p.read_text())
                    for p in sorted((DOCS / KERNEL).glob(f"{which}_*.json"))]
            for which in ("before", "after")}

    def median(which: str, key: str) -> float:
        return statistics.median(r["backends"]["native"][key] for r in runs[which])

    rows = []
    for key, label in KERNEL_PASSES.items():
        row = [label]
        for which in ("before", "after"):
            if runs[which]:
                ratios = [r["backends"]["native"][f"{key}_ratio_to_add"] for r in runs[which]]
                row.append(f"{median(which, f'{key}_ratio_to_add'):.2f} "
                           f"({min(ratios):.2f}-{max(ratios):.2f})")
        row.append(f"{median('after', f'{key}_bytes_per_s') / 1e9:.1f}")
        rows.append(row)
    add = statistics.median(r["add_bytes_per_s"] for r in runs["after"]) / 1e9
    paths = {w: sorted({r.get("native_vector_path") for r in runs[w]}) for w in runs if runs[w]}
    header = ["native pass"] + [f"{'/'.join(map(str, paths[w]))} paths: ratio to torch.add, "
                                f"median (range)" for w in ("before", "after") if w in paths] + [
        "GB/s moved (default paths)"]
    note = (f"torch.add moves {add:.1f} GB/s (12 bytes per element) in the same runs; "
            f"{len(runs['before'])} runs with the AVX-512 paths forbidden "
            f"(`HVD_ONEBIT_NATIVE=avx2`) and {len(runs['after'])} without, alternated.")
    notes = [provenance(f"{KERNEL}/{p.name}", json.loads(p.read_text()))
             for p in sorted((DOCS / KERNEL).glob("*.json"))[:1]]
    return "\n\n".join([table(header, rows), note, *notes])


MEMORY = "memory"  # bench dev memory --world inprocess runs: each memory option, 2 to 16 ranks


def memory() -> str:
    """The compression phase's held and peak memory beyond Adam's own per memory option and
    world size, with the peak's part that is the step's rows (two sets at once), beside
    ``1 + 1/n + 1/16``."""
    loaded = sorted(((p, json.loads(p.read_text())) for p in (DOCS / MEMORY).glob("*.json")),
                    key=lambda pd: (pd[1]["memory"] != "lean", pd[1]["ranks"]))
    runs = [d for _, d in loaded]
    rows = []
    for d in runs:
        c, n = d["phases"]["compression"], d["ranks"]
        rows.append([f"`{d['memory']}`", n, f"{c['held_ratio']:.4f}", f"{c['peak_ratio']:.4f}",
                     f"{c['max_step_transient_bytes'] / d['param_bytes']:.4f}",
                     f"{1 + 1 / n + 1 / 16:.4f}" if d["memory"] == "lean" else "-"])
    header = ["memory", "ranks", "held over the parameters' fp32 bytes", "peak",
              "peak over held (the step's rows)", "lean's bound: 1 + 1/n + 1/16"]
    first, first_run = loaded[0]
    commits = sorted({d.get("commit") for d in runs})
    note = (f"{len(runs)} runs, {runs[0]['layers']} layers of {runs[0]['width']}^2 "
            f"({runs[0]['param_bytes'] / 2**20:.0f} MiB of fp32 parameters), commit"
            f"{'s' if len(commits) > 1 else ''} {', '.join(map(str, commits))}; "
            f"peak: {runs[0]['peak_method']}.")
    return "\n\n".join([table(header, rows), note,
                         provenance(f"{MEMORY}/{first.name}", first_run)])


TENSORS = "tensors"  # bench dev tensors runs: before (an object per tensor and step) and after


def tensors() -> str:
    """The host cost per parameter tensor: DDP with fused Adam against the DDP face's
    compressed step at each tensor count, before and after the step stopped making Python
    objects per tensor, and what 1-bit adds per tensor in each run."""
    runs = {name: json.loads((DOCS / TENSORS / f"{name}.json").read_text())
            for name in ("before", "after")}
    rows = []
    for name, d in runs.items():
        for e in d["counts"]:
            low, high = e["ratio_range"]
            rows.append([name, e["tensors"], f"{e['ddp_adam']['whole_ms']:.1f}",
                         f"{e['ddp_onebit']['whole_ms']:.1f}",
                         f"{e['ratio']:.2f} ({low:.2f}-{high:.2f})"])
    header = ["run", "tensors", "DDP + fused Adam, ms a step", "1-bit (DDP face), ms a step",
              "1-bit over Adam (range)"]
    per = "; ".join(
        f"{name}: 1-bit adds {d['extra_us_per_tensor']['median']:.1f} us per tensor (from "
        f"{d['extra_us_per_tensor']['range'][0]:.1f} to {d['extra_us_per_tensor']['range'][1]:.1f}"
        f"), Adam's own {d['us_per_tensor']['ddp_adam']['median']:.1f} us"
        for name, d in runs.items())
    first = runs["before"]
    note = (f"{first['ranks']} ranks, {first['params']:,} parameters, means of "
            f"{first['steps']} steps, {first['reps']} repetitions each; per tensor, the slope "
            f"of the whole step over the counts: {per}.")
    return "\n\n".join([table(header, rows), note] + [
        provenance(f"{TENSORS}/{name}.json", d) for name, d in runs.items()])


STEP = "step_time"  # bench train runs with the 8-lane kernels (before_*) and the default (after_*)
BREAKDOWN = ("backward", "compress", "wait", "server", "decode")


def step_time() -> str:
    """The whole compressed step before and after the 16-lane passes, alternated in one
    session: its time, over the ``local`` step and against Horovod Adam's, where the time went,
    and the exchange started from the gradient hooks against the same step started in step()."""
    rows, notes = [], []
    for which, label in (("before", "8-lane passes"), ("after", "default")):
        for path in sorted((DOCS / STEP).glob(f"train_{which}_*.json")):
            d = json.loads(path.read_text())
            s, ob = d["summary"], {r["method"]: r for r in d["rows"]}["onebit"]
            parts = ob["compression_breakdown_s"]
            overlap = json.loads((DOCS / STEP / path.name.replace("train_", "overlap_"))
                                 .read_text())["summary"]["onebit_overlap_step_vs_sync"]
            rows.append([f"{label} ({path.stem.split('_')[-1]})",
                         f"{ob['compression_step_s'] * 1e3:.1f}",
                         f"{s['onebit_compression_step_vs_local']:.2f}",
                         f"{s['onebit_compression_step_speedup_vs_fp32']:.2f}",
                         " / ".join(f"{parts[k] * 1e3:.1f}" for k in BREAKDOWN),
                         f"{overlap:.3f}"])
            notes.append(provenance(f"{STEP}/{path.name}", d))
    header = ["passes (run)", "compressed step, ms", "over the local step",
              "Horovod Adam's step over it", "ms in " + " / ".join(BREAKDOWN),
              "hook-started over step()-started (the MLP's buckets)"]
    return "\n\n".join([table(header, rows), *notes])


GRANULARITY = "granularity"  # the whole zoo at each block size, and bench train's step time
# the zoo's measured cell-by-cell floor: its null changes against "bounded" at 10%, at the current
# defaults (zoo_frozen) and at one scale per chunk (zoo)
NULL_CHANGES = ("null_lr_up_1ppm", "null_lr_down_1ppm")
NULL_RUNS = (("zoo_frozen", "the zoo's null changes"), ("zoo", "at one scale per chunk"))


def granularity() -> str:
    """The scale granularity on the whole zoo: each block size against Adam, the finer one
    against the default cell by cell beside the zoo's null changes (its noise floor), and
    ``bench train``'s compressed step and bytes with finer scales against the default's."""
    d = _load(f"{GRANULARITY}/summary.json")
    base = d["against"]["base"]
    rows = [[f"`{name}`", s["cells"], f"{s['median_ratio']:.3f}", f"{s['max_ratio']:.3f}",
             s["over_1_05"], s["divergences"]] for name, s in d["schemes"].items()]
    header = ["scheme", "cells", "median ratio to Adam", "worst", "cells over 1.05", "diverged"]
    floors, floors_groups = [], []
    for folder, label in NULL_RUNS:
        null = _load(f"{folder}/summary.json")["against"]["schemes"]
        floors.append(label + ": " + ", ".join(
            f"{null[n]['worse_by_over_1pct']} of {null[n]['pairs']}" for n in NULL_CHANGES))
        floors_groups.append(label + ": " + ", ".join(
            f"{null[n]['groups_worse_beyond_seed_noise']} of {null[n]['seed_groups']}"
            for n in NULL_CHANGES))
    floor, floor_groups = "; ".join(floors), "; ".join(floors_groups)
    lines = []
    for name, a in d["against"]["schemes"].items():
        lines.append(
            f"`{name}` against `{base}`, cell by cell: {a['worse_by_over_1pct']} of "
            f"{a['pairs']} cells worse by over 1% ({floor}), "
            f"{a['better_by_over_1pct']} better by over 1%; {a['newly_over_1_05']} cells newly "
            f"over 1.05, {a['no_longer_over_1_05']} no longer; over seeds, "
            f"{a['groups_worse_beyond_seed_noise']} of {a['seed_groups']} groups worse beyond "
            f"the seeds' noise ({floor_groups}); median ratio of ratios "
            f"{a['median_ratio_of_ratios']:.4f}.")
    train_rows, notes = [], [provenance(f"{GRANULARITY}/provenance.json",
                                        _load(f"{GRANULARITY}/provenance.json"))]
    for path in sorted((DOCS / STEP).glob("train_after_*.json")):  # the runs of step_time()
        t = json.loads(path.read_text())
        s = t["summary"]
        train_rows.append([path.stem, t["config"]["block_size"],
                           f"{s['onebit_blocks_compression_step_vs_onebit']:.3f}",
                           f"{s['onebit_blocks_compression_bytes_vs_onebit']:.4f}"])
    parts = [table(header, rows), "\n\n".join(lines)]
    lm_rows = []
    for path in sorted((DOCS / GRANULARITY).glob("lm_*.json")):
        lm = json.loads(path.read_text())
        scales = {"lm_default": "one per chunk", "lm_blocks512": "one per 512 elements"}
        lm_rows.append([scales.get(path.stem, path.stem), f"{lm['final_val_loss_adam']:.4f}",
                        f"{lm['final_val_loss_onebit']:.4f}",
                        f"{lm['ratio_onebit_over_adam']:.4f}",
                        f"{lm['final_val_loss_onebit_hierarchical']:.4f}",
                        f"{lm['ratio_hierarchical_over_flat']:.4f}",
                        f"{lm['bytes_per_step_onebit_compression'] / 1e3:,.0f}"])
        notes.append(provenance(f"{GRANULARITY}/{path.name}", lm))
    if lm_rows:
        parts.append(table(["language model, scales", "Adam", "1-bit Adam", "over Adam",
                            "hierarchical (2 nodes x 2)", "hierarchical over flat",
                            "KB per step of the compression phase (refresh steps included)"],
                           lm_rows))
    if train_rows:
        parts.append(table(["bench train run (the step_time runs above)", "block_size",
                            "compressed step over one scale per chunk's",
                            "bytes on the wire over one scale per chunk's"], train_rows))
    return "\n\n".join(parts + notes)


GPU = "gpu"  # benchmarks/gpu_check.py's runs on a lent GPU machine
GPU_PASSES = ("momentum_compress_preconditioned", "decode_update_preconditioned",
              "momentum_compress", "decode_update", "compress", "server", "decode")


def _sweep_variant(sweep: dict, warps: int, cmax: int, maxnreg) -> dict:
    return next(v for v in sweep["checks"]["kernel_sweep"]["variants"]
                if (v["warps"], v["elements_per_program"], v["maxnreg"]) == (warps, cmax, maxnreg))


def _ratios_at(entries: Sequence[dict], numel: int) -> dict:
    return next(e for e in entries if e["numel"] == numel)


def gpu() -> str:
    """What ``benchmarks/gpu_check.py`` measured on a GPU: the Triton kernels' ratios to
    torch.add run by run, the profiler's reading of them, memory, host syncs, a 100M-parameter
    step against fused Adam, and the DDP face under torchrun."""
    first, check = _load(f"{GPU}/first_check.json"), _load(f"{GPU}/check.json")
    sweep, ddp, ncu = (_load(f"{GPU}/{n}.json") for n in ("sweep", "ddp_face", "ncu"))
    big = 128 << 20

    def triton_at(report: dict, numel: int) -> dict:
        e = _ratios_at(report["checks"]["ratios"]["sizes"], numel)["backends"]["triton"]
        return {k: e[f"{k}_ratio_to_add"] for k in GPU_PASSES}

    columns = [("first run, 128M", triton_at(first, big)),
               ("vector loads, 128M", triton_at(check, big)),
               ("+ int32 positions, 128M", _ratios_at(_sweep_variant(sweep, 8, 2048, None)
                                                      ["ratios"], big)),
               ("+ 64-register cap (shipped), 16M", _ratios_at(_sweep_variant(sweep, 8, 2048, 64)
                                                               ["ratios"], 16 << 20)),
               ("+ 64-register cap (shipped), 128M", _ratios_at(_sweep_variant(sweep, 8, 2048, 64)
                                                                ["ratios"], big))]
    rows = [[KERNEL_PASSES.get(k, k)] + [f"{c[k]:.2f}" for _, c in columns] for k in GPU_PASSES]
    ratios = table(["Triton pass, ratio to torch.add"] + [h for h, _ in columns], rows)
    variants = []
    for v in sweep["checks"]["kernel_sweep"]["variants"]:
        r = _ratios_at(v["ratios"], big)
        variants.append([v["warps"], v["elements_per_program"], v["maxnreg"] or "none",
                         v["bits_ok"]] + [f"{r[k]:.2f}" for k in GPU_PASSES[:2]])
    sweep_table = table(["warps", "elements per program", "register cap", "bits as on CPU",
                         "preconditioned compress, 128M", "preconditioned decode + update, 128M"],
                        variants)
    prof = table(["pass (no register cap)", "registers per thread", "achieved occupancy %",
                  "DRAM TB/s", "DRAM % of peak"],
                 [[KERNEL_PASSES.get(k["pass"], k["pass"]), int(k["registers_per_thread"]),
                   k["achieved_occupancy_pct"], k["dram_tbyte_per_s"], k["dram_throughput_pct"]]
                  for k in ncu["kernels"]])
    c = check["checks"]
    bits = [f"{name}: {'every case equal' if r['ok'] else 'a case differs'} "
            f"({len(r['cases'])} cases, against the {r['reference']})"
            for name, r in (("small cases", c["bits"]), ("1M and 64M elements",
                                                          sweep["checks"]["bits_large"]))]
    mem = table(["virtual ranks", "held over the parameters' fp32 bytes", "peak",
                 "1 + 1/n + 1/16", "peak <= 1.25"],
                [[w["ranks"], f"{w['held_ratio']:.4f}", f"{w['peak_ratio']:.4f}",
                  f"{w['bound_1_plus_1_over_n_plus_1_over_16']:.4f}",
                  "-" if w["within_1_25"] is None else w["within_1_25"]]
                 for w in c["memory_lean"]["worlds"]])
    face = ddp["checks"]["ddp_face"]
    gloo = face["gloo"]["reports"][0]
    nccl = face["nccl"]["reports"][0]["error"].splitlines()
    syncs = table(["step of the 1-bit face", "host syncs per rank", "where"],
                  [[s["step"], s["host_syncs_per_rank"], ", ".join(x["site"] for x in s["sites"])]
                   for s in gloo["onebit"]["host_syncs_last_steps"]])
    st = c["step_time"]
    step_rows = []
    for w in st["worlds"]:
        top = ", ".join(f"{k['name']} {k['ms_per_rank']:.2f}" for k in w["device_time"]["kernels"][:3])
        step_rows.append([w["ranks"], w["buckets"], f"{w['wall_ms_per_step_over_ranks']:.2f}",
                          f"{w['device_time']['total_ms_per_rank']:.2f}",
                          f"{w['ratio_wall_over_ranks_to_adam']:.1f}",
                          f"{w['ratio_device_time_per_rank_to_adam_wall']:.1f}", top])
    step = table(["virtual ranks", "buckets", "wall ms per step per rank", "GPU ms per rank",
                  "wall over fused Adam's", "GPU time over fused Adam's", "largest kernels, ms"],
                 step_rows)
    lines = [
        "**Kernels** (the default layout: a scale per 512 elements, 4 ranks; the target is 0.5 "
        "for every pass of the default step, the preconditioned ones):", ratios,
        "Launch settings at 128M elements (`kernel_sweep`):", sweep_table,
        "Nsight Compute on the passes before the register cap, 64M elements:", prof,
        "**Bits**, Triton and the torch kernels on the GPU against the native kernels on CPU: "
        + "; ".join(bits) + ".",
        f"**Memory** with `memory=\"lean\"`, the engine on virtual ranks "
        f"({c['memory_lean']['layers']} layers of {c['memory_lean']['width']}^2):", mem,
        f"**A step of {st['params']:,} parameters** (the engine's default options, virtual ranks "
        f"sharing the GPU) against torch's `Adam(fused=True)` step of the same parameters, "
        f"{st['adam_fused']['ms_per_step']:.2f} ms:", step,
        f"**The DDP face** under torchrun, 2 ranks on the one GPU: NCCL refuses them "
        f"(`{nccl[-1]}`); with Gloo on CUDA tensors the 1-bit face ran through the warmup "
        f"into the compression phase in {gloo['onebit']['buckets']} buckets, ranks identical "
        f"({gloo['onebit']['ranks_identical']}), loss {gloo['onebit']['first_loss']:.3f} to "
        f"{gloo['onebit']['last_loss']:.3f} (DDP + Adam: {gloo['adam']['last_loss']:.3f}); "
        f"host syncs of its last three steps:", syncs]
    notes = [provenance(f"{GPU}/{n}.json", d) for n, d in
             (("first_check", first), ("check", check), ("sweep", sweep), ("ddp_face", ddp),
              ("ncu", ncu))]
    return "\n\n".join(lines + notes)


def refresh_counts(run_lengths: Sequence[int] = (300, 1000, 3000, 10000, 30000, 100000)) -> str:
    """The full-precision steps of a run with the default refresh schedule frozen at 5%,
    against a fixed freeze at 20% with no refresh, per run length: counted by the schedule
    itself, no measurement."""
    from .bench.refresh import freeze_step_for, run_steps

    rows = []
    for S in run_lengths:
        d = run_steps(S, freeze_step_for(0.05, S), "doubling")
        fixed = freeze_step_for(0.2, S)
        rows.append([f"{S:,}", f"{d['freeze_step']:,}", f"{d['refresh_steps']:,}",
                     f"{d['full_precision_steps']:,} ({d['full_precision_steps'] / S:.1%})",
                     f"{fixed:,} ({fixed / S:.0%})"])
    return ("Full-precision steps per run (counted by the schedule, `RefreshSchedule.count`):\n\n"
            + table(["run steps", "freeze_step (5%)", "refresh steps",
                     "full precision, default", "full precision, None at 20%"], rows))


PARTS: Dict[str, Callable[[], str]] = {
    "headline": lambda: headline(dated=False), "headline_dated": headline,
    "settings": settings, "freeze_lm": lambda: freeze_runs("lm"),
    "freeze_digits": lambda: freeze_runs("digits"), "zoo": zoo,
    "zoo_long": lambda: zoo("zoo_long"), "fading": fading,
    "headline_ddp": lambda: headline("ddp/convergence.json"), "zoo_faces": zoo_faces,
    "ddp_train": ddp_train, "granularity": granularity, "kernel": kernel, "memory": memory,
    "refresh_predict": refresh_predict,
    "refresh_digits": refresh_digits,
    "step_time": step_time, "gpu": gpu, "refresh_counts": refresh_counts, "tensors": tensors}
# Which generated parts each Markdown file holds, in its <!-- generated:NAME --> blocks.
BLOCKS: Dict[str, Sequence[str]] = {
    "README.md": ("settings", "headline"),
    "docs/tuning.md": ("settings", "refresh_counts"),
    "docs/gpu.md": ("gpu",),
    "docs/results.md": ("headline_dated", "freeze_lm", "freeze_digits", "zoo", "zoo_long", "fading",
                        "refresh_digits", "refresh_predict", "headline_ddp", "zoo_faces", "ddp_train", "kernel",
                        "memory", "tensors", "step_time",
                        "granularity"),
}


def with_blocks(text: str, parts: Dict[str, str], names: Sequence[str], where: str) -> str:
    """``text`` with each named block replaced by its part; a missing block raises, naming
    the file."""
    for name in names:
        start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
        pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise ValueError(f"{where} has no {start} ... {end} block")
        text = pattern.sub(lambda _: f"{start}\n{parts[name]}\n{end}", text)
    return text


def readme_with(text: str, parts: Dict[str, str]) -> str:
    return with_blocks(text, parts, BLOCKS["README.md"], "README.md")


def generate() -> Dict[str, str]:
    return {name: make() for name, make in PARTS.items()}


def stale(parts: Dict[str, str]) -> Dict[Path, str]:
    """Each Markdown file whose blocks differ from ``parts``, with its fresh text."""
    out = {}
    for name, blocks in BLOCKS.items():
        path = ROOT / name
        current = path.read_text()
        fresh = with_blocks(current, parts, blocks, name)
        if fresh != current:
            out[path] = fresh
    return out


def write(parts: Dict[str, str]) -> List[Path]:
    """Refresh every file's blocks and the zoo figures; the paths written."""
    paths = [zoo_figure(*ZOO_FIGURES[name]) for name in ("zoo", "zoo_long")]
    for path, fresh in stale(parts).items():
        path.write_text(fresh)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if a Markdown file's generated blocks are stale")
    args = p.parse_args(argv)
    parts = generate()
    if args.check:
        old = stale(parts)
        for path in old:
            print(f"{path.relative_to(ROOT)}'s generated blocks are stale: run python -m "
                  "hvd_onebit_tools.docs_tables", file=sys.stderr)
        return 1 if old else 0
    write(parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
