"""The figures `bench predict --plot` draws: speed-up against ranks for a sweep, or one
prediction's phases as stacked bars."""
from __future__ import annotations

from .model import GROUP_METHOD
from .sweep import crossovers


def _save_speedup(fig, ax, path: str, xlabel: str, title: str, **xscale) -> None:
    """The end of each whole-run speed-up figure: the line at 1, a log x axis, the labels, the
    legend beside the axes, written to ``path``."""
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", **xscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("whole-run speed-up over Horovod fp32 Adam")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_sweep(rows: list[dict], path: str, title: str) -> None:
    """Whole-run speed-up over Horovod fp32 against ranks, one line per method and bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...cluster.bandwidth import format_bandwidth

    fig, ax = plt.subplots(figsize=(10.5, 5))
    styles = {"horovod_fp16": ("tab:gray", "fp16"), "onebit": ("tab:blue", "flat 1-bit"),
              "ddp_onebit": ("tab:purple", "flat 1-bit, DDP face"),
              "onebit_hierarchical": ("tab:green", "hierarchical 1-bit (hierarchical.py)"),
              GROUP_METHOD: ("tab:olive", "hierarchical 1-bit, stages as group collectives")}
    dashes = ["-", "--", ":", "-."]
    bws = sorted({r["inter_bps"] or 0 for r in rows})
    cross = crossovers(rows)
    for i, bps in enumerate(bws):
        sel = sorted((r for r in rows if (r["inter_bps"] or 0) == bps), key=lambda r: r["np"])
        label_bw = format_bandwidth(int(bps)) if bps else "unlimited"
        for m, (color, name) in styles.items():
            if m not in sel[0]["methods"]:
                continue
            xs = [r["np"] for r in sel]
            # the whole run with the refresh setting (the library's default) where priced
            ys = [r["methods"][m].get("run_refresh", r["methods"][m])["run_speedup_vs_fp32"]
                  for r in sel]
            ax.plot(xs, ys, dashes[i % len(dashes)], color=color, marker="o", ms=3,
                    label=f"{name}, {label_bw}")
        c = cross.get(str(sel[0]["inter_bps"]), {})
        for j, (key, color, text) in enumerate((
                ("flat_onebit_stops_paying_at", "tab:blue", "flat 1-bit <= fp32"),
                ("hierarchical_beats_flat_from", "tab:green", "hierarchical > flat"),
                ("hierarchical_group_beats_flat_from", "tab:olive", "group hierarchical > flat"))):
            if c.get(key):
                ax.axvline(c[key], color=color, ls=dashes[i % len(dashes)], lw=0.8, alpha=0.6)
                right = c[key] > max(r["np"] for r in rows) / 4  # keep the label inside
                ax.text(c[key] / 1.03 if right else c[key] * 1.03,
                        0.02 + 0.05 * (3 * i + j),
                        f"{text} from n={c[key]} ({label_bw})", fontsize=7, color=color,
                        ha="right" if right else "left", transform=ax.get_xaxis_transform())
    _save_speedup(fig, ax, path, "ranks", title, base=2)


def plot_phases(pred: dict, path: str, title: str) -> None:
    """Stacked bars of each method's step time by phase (one world size and bandwidth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(pred)
    phases = list(dict.fromkeys(p for m in names for p in pred[m]["phases_s"]))
    bottom = [0.0] * len(names)
    for ph in phases:
        vals = [pred[m]["phases_s"].get(ph, 0.0) * 1e3 for m in names]
        ax.bar(names, vals, bottom=bottom, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_run_lengths(rows: list[dict], path: str, title: str) -> dict:
    """`--run-lengths`' figure: each 1-bit method's whole-run speed-up over Horovod fp32
    against run length, at the fixed warmup (solid) and with the refresh setting (dashed), one
    pair of lines per method, world size and bandwidth. Returns what it drew: label -> (run
    lengths, speed-ups)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...cluster.bandwidth import format_bandwidth

    fig, ax = plt.subplots(figsize=(10.5, 5))
    drawn = {}
    curves = sorted({(r["np"], r["inter_bps"] or 0, r["method"]) for r in rows})
    for i, (n, bps, method) in enumerate(curves):
        sel = sorted((r for r in rows if (r["np"], r["inter_bps"] or 0, r["method"])
                      == (n, bps, method)), key=lambda r: r["run_steps"])
        xs = [r["run_steps"] for r in sel]
        where = f"{method}, np={n}, {format_bandwidth(int(bps)) if bps else 'unlimited'}"
        color = f"C{i % 10}"
        for key, style, setting in (("fixed_run_speedup_vs_fp32", "-", "fixed warmup"),
                                    ("refresh_run_speedup_vs_fp32", "--", "refresh")):
            ys = [r[key] for r in sel]
            label = f"{where}: {setting}"
            ax.plot(xs, ys, style, color=color, marker="o", ms=3, label=label)
            drawn[label] = (xs, ys)
    _save_speedup(fig, ax, path, "run length (steps)", title)
    plt.close(fig)
    return drawn
