"""The calibration file: its format versions, where `bench calibrate` saves it and
`bench predict` loads it from (the cache, else the one shipped beside this module), and
loading it with errors that say how to make one."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

from click import ClickException

CALIBRATION_VERSION = 6
# version 2: no torch.distributed collectives, no hierarchical passes; version 3: not the
# hierarchical collective's native passes (read, with what needs them refused); version 4: no
# fp16 allreduce of the bench models' own gradients (fp16 predicted from random normal values);
# version 5: no kernels timed inside the Horovod ranks (the bare processes' figures serve)
READABLE_VERSIONS = (2, 3, 4, 5, 6)
DEFAULT_PATH = Path("~/.cache/hvd_onebit/calibration.json")
# measured on the machine the documented figures come from; installed with the package
SHIPPED_PATH = Path(__file__).resolve().parent / "predict_calibration.json"


def save(cal: dict, path) -> Path:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal, indent=2))
    return p


class CalibrationMissing(FileNotFoundError):
    pass


class CalibrationInvalid(ValueError):
    """A calibration file whose values the model cannot use (a time below zero, a count or
    rate of zero, a string where a number belongs)."""


# what a value of the calibration must be, by the name it is stored under: times in seconds
# (0 or more: a lock-step time is a difference of two timings), and counts and rates the
# model divides by (more than 0)
TIME, POSITIVE, COUNT = "time", "positive", "count"
MODEL_FIGURES = {"params": COUNT, "step_s": TIME, "fwd_bwd_s": TIME, "adam_s": TIME,
                 "fp16_allreduce_s": TIME}
ROW_FIGURES = {"np": COUNT, "numel": COUNT, "row_bytes": COUNT}


def _field(path: tuple) -> str:
    return path[0] + "".join(f"[{k!r}]" if isinstance(k, str) else f"[{k}]" for k in path[1:])


def _number(value, path: tuple, kind: str, source: str):
    """``value`` as ``kind`` requires (counts become ints), or :class:`CalibrationInvalid`
    naming the field and the value."""
    what = {TIME: "a time in seconds, 0 or more", POSITIVE: "a number above 0",
            COUNT: "a whole number above 0"}[kind]
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value >= 0 if kind == TIME else value > 0)
          and (kind != COUNT or float(value).is_integer()))
    if not ok:
        raise CalibrationInvalid(
            f"{source}: {_field(path)} is {value!r}, not {what}: the file is not as `hvd-onebit "
            "bench calibrate` writes it (edited or damaged); run `hvd-onebit bench calibrate` "
            "again, or pass --calibration with another file")
    return int(value) if kind == COUNT else value


def _table(value, path: tuple, source: str) -> dict:
    if not isinstance(value, dict):
        raise CalibrationInvalid(
            f"{source}: {_field(path)} is {value!r}, not a table (a JSON object): the file is "
            "not as `hvd-onebit bench calibrate` writes it; run `hvd-onebit bench calibrate` "
            "again, or pass --calibration with another file")
    return value


def _figures(table, spec: dict, path: tuple, source: str) -> None:
    """``table``'s entries named in ``spec`` (name -> kind), each checked in place."""
    for key, kind in spec.items():
        if key in _table(table, path, source):
            table[key] = _number(table[key], path + (key,), kind, source)


def _compute_group(group, path: tuple, source: str) -> None:
    """The bench models' figures and the kernels' seconds per element of one process count
    (``compute[k]``) or one Horovod job (``collectives[n]["unlimited"]``)."""
    for name, figures in _table(group.get("models", {}), path + ("models",), source).items():
        _figures(figures, MODEL_FIGURES, path + ("models", name), source)
    kernels = _table(group.get("kernel_s_per_elem", {}), path + ("kernel_s_per_elem",), source)
    for name, rate in kernels.items():
        kernels[name] = _number(rate, path + ("kernel_s_per_elem", name), TIME, source)


def validate(cal: dict, source: str = "calibration") -> dict:
    """Every value the scale model reads from ``cal``, checked: times are numbers of seconds,
    0 or more; parameter counts, world sizes, buffer sizes, cores and the link rate are above
    0. Parameter counts stored as floats (older files) become ints. Returns ``cal``; raises
    :class:`CalibrationInvalid` naming the first bad field (``source``: the file, for the
    message) and its value."""
    cal["cores"] = _number(cal["cores"], ("cores",), COUNT, source)
    if cal.get("link_bps") is not None:  # None: no shaped link was measured
        cal["link_bps"] = _number(cal["link_bps"], ("link_bps",), POSITIVE, source)
    if cal.get("queue_ms") is not None:
        cal["queue_ms"] = _number(cal["queue_ms"], ("queue_ms",), TIME, source)
    for name, shape in _table(cal.get("bench_models", {}), ("bench_models",), source).items():
        _table(shape, ("bench_models", name), source)
    for k, group in _table(cal["compute"], ("compute",), source).items():
        _number(int(k) if str(k).isdigit() else k, ("compute", k), COUNT, source)
        _compute_group(_table(group, ("compute", k), source), ("compute", k), source)
    if not cal["compute"]:
        raise CalibrationInvalid(f"{source}: 'compute' is empty: run `hvd-onebit bench "
                                 "calibrate` again")
    for n, runs in _table(cal["collectives"], ("collectives",), source).items():
        _number(int(n) if str(n).isdigit() else n, ("collectives", n), COUNT, source)
        if "unlimited" not in _table(runs, ("collectives", n), source):
            raise CalibrationInvalid(f"{source}: collectives[{n!r}] has no 'unlimited' row: "
                                     "run `hvd-onebit bench calibrate` again")
        for bw, row in runs.items():
            path = ("collectives", n, bw)
            _figures(row, ROW_FIGURES, path, source)
            times = _table(row.get("median_s", {}), path + ("median_s",), source)
            for op, t in times.items():
                times[op] = _number(t, path + ("median_s", op), TIME, source)
            _compute_group(row, path, source)
    if not cal["collectives"]:
        raise CalibrationInvalid(f"{source}: 'collectives' is empty: run `hvd-onebit bench "
                                 "calibrate` again")
    return cal


def load(path) -> dict:
    """The saved calibration, or a clear error that says how to make one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CalibrationMissing(
            f"no calibration file at {p}: run `hvd-onebit bench calibrate --out {p}` on the "
            "machine whose constants you want (it needs root for the emulated cluster, "
            "about 3 minutes), or pass --calibration PATH")
    try:
        cal = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p} is not JSON ({exc}): not a calibration file from "
                         "`hvd-onebit bench calibrate`") from exc
    if not isinstance(cal, dict):
        raise ValueError(f"{p} holds a JSON {type(cal).__name__}, not a calibration file from "
                         "`hvd-onebit bench calibrate`")
    if cal.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{p} is calibration version {cal.get('version')}, this model reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}: run `hvd-onebit bench "
                         "calibrate` again")
    for key in ("compute", "collectives", "cores"):
        if key not in cal:
            raise ValueError(f"{p} has no {key!r}: not a calibration file from "
                             "`hvd-onebit bench calibrate`")
    return validate(cal, str(p))


def chosen_path(path=None) -> Path:
    """The calibration file :func:`load_or_shipped` reads: ``path``; without one, the cache's
    (:data:`DEFAULT_PATH`), and where the cache has none the one shipped beside this module
    (:data:`SHIPPED_PATH`)."""
    if path is not None:
        return Path(path)
    cached = DEFAULT_PATH.expanduser()
    return cached if cached.exists() or not SHIPPED_PATH.exists() else SHIPPED_PATH


def load_or_shipped(path=None, note: Optional[Callable[[str], None]] = None) -> dict:
    """The calibration at :func:`chosen_path`; when that is the one shipped, after ``note`` is
    told which file that is, whose machine it measured and how to measure this one's."""
    chosen = chosen_path(path)
    if chosen != SHIPPED_PATH or path is not None:
        return load(chosen)
    cached = DEFAULT_PATH.expanduser()
    cal = load(SHIPPED_PATH)
    if note is not None:
        machine = cal.get("machine", {})
        note(f"note: no calibration at {cached}; using the one shipped with hvd_onebit, "
             f"{SHIPPED_PATH} ({cal['cores']} cores, {machine.get('date', 'undated')}: the "
             "machine the documented figures come from). Measure this machine's with `hvd-onebit "
             f"bench calibrate` (root, about 3 minutes; it saves to {cached}), or pass "
             "--calibration PATH.")
    return cal


def check_calibration(cal: dict, path, nps: list[int], *, colocated: bool,
                      per_peer: bool) -> None:
    """Refuse a calibration that lacks what this prediction prices: the per-peer cost of its
    ops at a world size it did not measure, when it measured one (and --per-peer-us does not
    replace it); without --colocated, the 1-process figures (a rank with a core to itself)."""
    measured = sorted(int(n) for n in cal["collectives"])
    others = sorted(set(nps) - set(measured))
    if len(measured) == 1 and others and not per_peer:
        raise ClickException(
            f"{path}: 'collectives' holds one world size (np {measured[0]}), so the per-peer "
            f"cost of each op, the slope of its time against the world size, is unknown (it "
            f"would be priced as 0 at --np {','.join(map(str, others))}): calibrate with two "
            "world sizes or more (`hvd-onebit bench calibrate --np 2,4`), or give --per-peer-us")
    if not colocated and "1" not in cal["compute"]:
        timed = ",".join(sorted(cal["compute"], key=int))
        raise ClickException(
            f"{path}: 'compute' has no 1-process figures (timed with --procs {timed}), which "
            "price a rank with a core to itself: calibrate with --procs 1 among them (e.g. "
            "`hvd-onebit bench calibrate --procs 1,2,4`), or give --colocated to price ranks "
            "sharing this machine's cores")
