"""``examples/train_lm.py`` as a job: the workload of ``make demo`` and ``benchmarks/convergence.py``.

:func:`train_lm` runs the script once on ``np`` ranks, on loopback through horovodrun (or, for
its DDP face, torchrun) or on an emulated cluster, and returns the JSON summary the script
writes; :func:`plot_val_loss` draws the validation-loss curves of several such runs.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..cluster.jobs import job_environment, run_command, wait_for_job
from ..cluster.torchrun import torchrun_command

SCRIPT = Path("examples") / "train_lm.py"


class TrainingFailed(RuntimeError):
    """A train_lm.py run failed or timed out; the message has the end of its output."""


def find_train_lm(script: str | os.PathLike | None = None) -> Path:
    """``script`` if given; else examples/train_lm.py in the current folder, or in the checkout
    this package lives in (when it does live in one)."""
    if script is not None:
        candidates = [Path(script)]
    else:
        candidates = [Path.cwd() / SCRIPT, Path(__file__).resolve().parents[2] / SCRIPT]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(f"cannot find {' or '.join(map(str, candidates))}: run from the "
                            "repository's root folder")


def run_local_torchrun(argv: Sequence[str], np: int, timeout: Optional[float] = None,
                 log=None, env: Optional[dict] = None) -> Optional[int]:
    """Run ``argv`` on ``np`` local ranks under torchrun and wait for it: the exit status, or
    None past ``timeout`` seconds. Output goes to ``log`` (a binary file; default: this
    process's). Every process of the job is killed before this returns."""
    token = uuid.uuid4().hex
    return wait_for_job(torchrun_command(np, argv), token, job_environment(token, extra=env),
                        timeout, log)


@dataclass
class LmRun:
    """One run: the script's JSON summary, the wall time (launch included) and, on an emulated
    cluster, the mean over ranks of the bytes each rank's link sent."""

    summary: dict
    wall_seconds: float
    measured_tx_bytes_per_rank: Optional[float] = None


def train_lm(optimizer: str, np: int, train_args: Sequence[str], out_dir: Path, timeout: float,
             cluster=None, on_output: Optional[Callable[[int, str], None]] = None,
             log_to_file: bool = True, script: str | os.PathLike | None = None,
             hosts: Optional[str] = None, tag: Optional[str] = None,
             face: str = "horovod") -> LmRun:
    """Run train_lm.py ``--optimizer optimizer`` on ``np`` ranks; raise TrainingFailed if it fails.

    ``face``: "horovod" (horovodrun, or the emulated ``cluster``) or "ddp" (``--face ddp``
    under torchrun, on this machine).

    The summary goes to ``out_dir/<tag>.json``, the output to ``out_dir/<tag>.log`` (``tag``
    defaults to ``optimizer``; without ``log_to_file`` the output goes to this process's output;
    on an emulated ``cluster``, to ``on_output(rank, line)``). ``hosts``: horovodrun's ``-H``
    (e.g. two names of this machine, ``127.0.0.1:2,127.1:2``, for 2 nodes of 2 ranks).
    """
    tag = tag or optimizer
    json_out = out_dir / f"{tag}.json"
    json_out.unlink(missing_ok=True)
    log_path = out_dir / f"{tag}.log"
    if face not in ("horovod", "ddp"):
        raise ValueError(f"face must be horovod or ddp, got {face!r}")
    if face == "ddp" and (cluster is not None or hosts):
        raise ValueError("the DDP face runs on this machine's loopback: no cluster or hosts")
    # --face only for the DDP face: the Horovod face is every example's default, and
    # train_digits.py (which the auto-freeze study runs here too) has no other
    argv = [str(find_train_lm(script)), "--optimizer", optimizer,
            *(["--face", face] if face == "ddp" else []), "--out", str(json_out),
            *train_args]
    if face == "horovod":
        argv.insert(0, sys.executable)
    what = f"train_lm.py --face {face} --optimizer {optimizer} on {np} ranks"
    start = time.monotonic()
    measured = None
    if cluster is not None:
        result = cluster.run(argv, env=job_environment(uuid.uuid4().hex), timeout=timeout,
                             cwd=os.getcwd(), on_output=on_output)
        if log_to_file:
            log_path.write_text("\n".join(f"--- rank {r.rank} output:\n{r.output}"
                                          for r in result.ranks))
        if not result.ok:
            failed = result.ranks[result.first_failed_rank or 0]
            raise TrainingFailed(f"{what} failed (exit {result.returncode}), rank "
                                 f"{failed.rank}'s output:\n{failed.output[-3000:]}")
        measured = sum(r.tx_bytes for r in result.ranks) / len(result.ranks)
    else:
        def launch(log=None):
            if face == "ddp":
                return run_local_torchrun(argv, np, timeout, log)
            return run_command(argv, np, "gloo", timeout, log, hosts=hosts)

        if log_to_file:
            with open(log_path, "wb") as log:
                rc = launch(log)
        else:
            rc = launch()
        if rc != 0 or not json_out.exists():
            why = f"timed out after {timeout:.0f}s" if rc is None else f"exited with {rc}"
            tail = log_path.read_text(errors="replace")[-4000:] if log_to_file else ""
            raise TrainingFailed(f"{what} {why}" + (f"; log {log_path}:\n{tail}" if tail else ""))
    return LmRun(json.loads(json_out.read_text()), time.monotonic() - start, measured)


LABELS = {"adam": "Horovod Adam", "onebit": "1-bit Adam",
          "onebit_hierarchical": "1-bit Adam, hierarchical"}


def plot_val_loss(summaries: dict[str, dict], path: Path, title: str,
                  threshold: Optional[float] = None,
                  labels: Optional[dict[str, str]] = None) -> None:
    """Validation loss against step for each run (``{"adam": summary, "onebit": summary}``), with
    1-bit Adam's freeze_step and an optional loss threshold marked; ``labels`` names runs
    otherwise than ``LABELS`` does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {**LABELS, **(labels or {})}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, s in summaries.items():
        curve = s["val_curve"]
        ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve],
                "-" if name == "adam" else "--", marker="o", markersize=2.5,
                label=f"{names.get(name, name)} (final {s['final_val_loss']:.3f})")
    freeze = summaries.get("onebit", {}).get("freeze_step")
    if freeze:
        ax.axvline(freeze, color="grey", ls=":", lw=1, label=f"freeze_step {freeze}")
    if threshold is not None:
        ax.axhline(threshold, color="tab:red", ls=":", lw=0.8, label=f"threshold {threshold:.3f}")
    losses = [c["val_loss"] for s in summaries.values() for c in s["val_curve"]]
    ax.set_ylim(min(losses) - 0.05, min(max(losses), min(losses) + 2.0))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
