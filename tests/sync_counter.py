"""Counting the host reads of tensor values (what is a device-to-host sync on a GPU) on CPU.

:class:`HostReads` wraps the ``torch.Tensor`` methods that hand a tensor's values to Python
(``tolist``, ``item``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``numpy``) for the
time of a ``with`` block and counts their calls per thread (virtual ranks are threads). It is
instrumentation of torch, not a stand-in for it: every call still runs.
"""
from __future__ import annotations

import threading
import traceback
from collections import defaultdict

import torch

METHODS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy")


class HostReads:
    """``with HostReads() as reads: ...``; then ``reads.count(thread_ident)``, ``reads.where``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls: dict[int, list[str]] = defaultdict(list)
        self.ours: dict[int, list[bool]] = defaultdict(list)  # made by a line of hvd_onebit
        self._saved = {}

    def __enter__(self):
        for name in METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            where = traceback.extract_stack(limit=3)[0]
            with self._lock:
                self.calls[threading.get_ident()].append(
                    f"{name} at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}")
                self.ours[threading.get_ident()].append(
                    "/hvd_onebit/" in where.filename.replace("\\", "/"))
            return original(tensor, *args, **kwargs)
        return counted

    def count(self, ident: int) -> int:
        return len(self.calls.get(ident, []))

    def count_ours(self, ident: int) -> int:
        """The reads made by the library's own lines (not torch's, such as its Adam's)."""
        return sum(self.ours.get(ident, []))
