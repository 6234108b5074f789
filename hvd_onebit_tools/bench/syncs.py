"""Device-to-host syncs on CUDA, each with the Python stack that made it.

``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn at every synchronizing CUDA call;
the warning names one source line, often inside torch. :class:`SyncRecorder` keeps the whole
Python stack of each, so a report can name the line of this project that led to it, and tell
the in-process transport's own waits (a stand-in for the network) from the optimizer's.
"""
from __future__ import annotations

import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path

OURS = "hvd_onebit"
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning in "warn" mode
TRANSPORT = ("hvd_onebit", "transport")


def _frame(f) -> str:
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _our_frames(stack) -> list:
    """The frames in the library itself (not its tools), innermost last."""
    return [f for f in stack if f"/{OURS}/" in f.filename.replace("\\", "/")]


class SyncRecorder:
    """``with SyncRecorder() as syncs: ...`` on a CUDA machine; then :meth:`summary`.

    Threads (virtual ranks) share it: every sync of the block is recorded, from any thread.
    """

    def __init__(self):
        self.stacks: list[list] = []
        self._lock = threading.Lock()
        self._saved = None

    def __enter__(self):
        import torch

        self._saved = warnings.catch_warnings()
        self._saved.__enter__()
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE not in str(message):
                return
            stack = traceback.extract_stack()[:-1]
            with self._lock:
                self.stacks.append(stack)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._saved.__exit__(*exc)

    def summary(self, ranks: int = 1) -> dict:
        """Counts per rank: all, the in-process transport's, the rest; the sites of the rest (the
        innermost line of the library, or the innermost line at all) with their counts and one
        stack each (the library's frames, else the last few)."""
        transport, ours = 0, Counter()
        example = {}
        for stack in self.stacks:
            mine = _our_frames(stack)
            if any("/".join(TRANSPORT) in f.filename.replace("\\", "/") for f in mine):
                transport += 1
                continue
            site = _frame(mine[-1] if mine else stack[-1])
            ours[site] += 1
            example.setdefault(site, [_frame(f) for f in (mine or stack[-6:])][-8:])
        return {"syncs_per_rank": len(self.stacks) / ranks,
                "transport_syncs_per_rank": transport / ranks,
                "host_syncs_per_rank": sum(ours.values()) / ranks,
                "sites": [{"site": site, "per_rank": n / ranks, "stack": example[site]}
                          for site, n in ours.most_common()]}
