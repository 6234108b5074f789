"""The calibration file: its format versions, where `bench calibrate` saves it and
`bench predict` loads it from (the cache, else the one shipped beside this module), and
loading it with errors that say how to make one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

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
    return cal


def load_or_shipped(path=None, note: Optional[Callable[[str], None]] = None) -> dict:
    """The calibration at ``path``; without one, the cache's (:data:`DEFAULT_PATH`), and where
    the cache has none the one shipped beside this module (:data:`SHIPPED_PATH`), after ``note`` is
    told which file that is, whose machine it measured and how to measure this one's."""
    if path is not None:
        return load(path)
    cached = DEFAULT_PATH.expanduser()
    if cached.exists() or not SHIPPED_PATH.exists():
        return load(cached)
    cal = load(SHIPPED_PATH)
    if note is not None:
        machine = cal.get("machine", {})
        note(f"note: no calibration at {cached}; using the one shipped with hvd_onebit, "
             f"{SHIPPED_PATH} ({cal['cores']} cores, {machine.get('date', 'undated')}: the "
             "machine the documented figures come from). Measure this machine's with `hvd-onebit "
             f"bench calibrate` (root, about 3 minutes; it saves to {cached}), or pass "
             "--calibration PATH.")
    return cal
