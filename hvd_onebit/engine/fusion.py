"""Buffer fusion: every parameter's momentum laid back to back in one flat buffer, exchanged in
buckets that are contiguous ranges of it.

1-bit compression only pays off on large messages: every call has a fixed cost (two collectives,
kernel start-up) and Horovod never fuses alltoalls. So the optimizer keeps each parameter's
``exp_avg`` as a *view* into one flat buffer, and one OneBitAllreduce per bucket moves a range of
it: two collectives per bucket per step, not per parameter. A bucket may end inside a parameter
(its next part opens the next bucket), so a large tensor is exchanged in pieces: the compression
of one piece runs while the previous one is on the wire. A bucket also has a same-sized *work*
buffer, allocated on first use, for paths that must materialise the local momentum
``beta1 * m + (1 - beta1) * g`` before the allreduce (the 1-bit path computes it inside its
compression kernel instead).
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from ..config import check_one_device


@dataclass(frozen=True)
class Segment:
    """A part of one parameter in a bucket: its elements [start, start + numel) in the
    parameter's row-major order, at ``offset`` in the bucket."""

    param: torch.Tensor
    start: int
    numel: int
    offset: int

    @functools.cached_property
    def whole(self) -> bool:
        """Whether this is all of its parameter (read for every step's views: computed once)."""
        return self.start == 0 and self.numel == self.param.numel()


@dataclass
class Bucket:
    """A contiguous range of the flat momentum buffer: parts of one or more parameters."""

    index: int
    segments: list[Segment]
    numel: int
    momentum: torch.Tensor  # [numel], a view into the flat buffer: the members' exp_avg
    _work: Optional[torch.Tensor] = None
    # the layout as another process of the same job names it (saved error feedback's key):
    # each segment's parameter name (its shape where unnamed), start and count, digested
    signature: str = ""

    @functools.cached_property
    def params(self) -> list[torch.Tensor]:
        """The parameters with a segment here, in bucket order (the segments never change)."""
        return [s.param for s in self.segments]

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Each segment's elements."""
        return [s.numel for s in self.segments]

    @functools.cached_property
    def layout(self) -> tuple:
        """Which elements of which parameters the bucket holds, in order: a bucket of another
        trainable set may have this one's index and size but not its elements."""
        return tuple((id(s.param), s.start, s.numel) for s in self.segments)

    @property
    def work(self) -> torch.Tensor:
        """[numel], like momentum: a buffer for the local momentum, allocated on first use."""
        if self._work is None:
            self._work = torch.empty_like(self.momentum)
        return self._work

    def piece(self, i: int, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Segment ``i``'s part of ``t``, a tensor shaped like its parameter: ``t`` itself for a
        whole parameter, else a flat view [numel] (only contiguous parameters are cut); None
        stays None."""
        if t is None:
            return None
        s = self.segments[i]
        return t if s.whole else t.reshape(-1)[s.start:s.start + s.numel]

    def momentum_view(self, i: int) -> torch.Tensor:
        """Segment ``i``'s momentum, flat [numel], sharing the bucket's storage."""
        s = self.segments[i]
        return self.momentum[s.offset:s.offset + s.numel]

    def work_view(self, i: int) -> torch.Tensor:
        s = self.segments[i]
        return self.work[s.offset:s.offset + s.numel]


def plan_buckets(params: list[torch.Tensor], bucket_numel: int
                 ) -> list[list[tuple[int, int, int]]]:
    """Cut the parameters, in the order given, into buckets of about ``bucket_numel`` elements.

    Returns per bucket its segments as (parameter index, start, numel). A contiguous parameter
    that does not fit in the open bucket fills it and goes on in the next (so a bucket ends at
    ``bucket_numel`` elements), except that a remainder of at most 1/16 of ``bucket_numel`` stays
    with its bucket rather than costing two collectives of its own; a small parameter joins the
    open bucket even where it overflows it, for the same reason. A non-contiguous parameter is
    never cut (its parts would not be views): it goes whole into the open bucket if it fits,
    else opens one. Deterministic, so every rank plans the same buckets.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_numel} elements")
    small = bucket_numel // 16
    buckets: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for i, p in enumerate(params):
        total, start = p.numel(), 0
        if not p.is_contiguous() or total <= small:
            if size and size + total > bucket_numel and total > small:
                buckets.append([])
                size = 0
            buckets[-1].append((i, 0, total))
            size += total
            continue
        while start < total:
            if size >= bucket_numel:
                buckets.append([])
                size = 0
            take = min(total - start, bucket_numel - size)
            if total - start - take <= small:
                take = total - start
            buckets[-1].append((i, start, take))
            start += take
            size += take
    return [b for b in buckets if b]


def fuse(params: list[torch.Tensor], momenta: list[torch.Tensor],
         bucket_numel: int) -> tuple[torch.Tensor, list[Bucket]]:
    """Copy ``momenta`` (one per parameter, float32, one device) into one fresh flat buffer cut
    into buckets; return the buffer and the buckets.

    The caller replaces each parameter's ``exp_avg`` with its view of the buffer
    (``flat[offset:offset + numel].view_as(p)``, offsets in ``params``' order, as
    :func:`param_offsets` gives them).
    """
    dtypes = {m.dtype for m in momenta}
    if len(dtypes) > 1:
        raise ValueError(f"momenta of one dtype only, got {sorted(str(d) for d in dtypes)}")
    offsets = param_offsets(params)
    total = sum(p.numel() for p in params)
    like = momenta[0] if momenta else torch.empty(0)
    flat = torch.empty(total, dtype=like.dtype, device=like.device)
    for p, m, off in zip(params, momenta, offsets):
        flat[off:off + p.numel()].view_as(p).copy_(m)
    out, at = [], 0
    for index, plan in enumerate(plan_buckets(params, bucket_numel)):
        segments, numel = [], 0
        for i, start, count in plan:
            segments.append(Segment(params[i], start, count, numel))
            numel += count
        out.append(Bucket(index=index, segments=segments, numel=numel,
                          momentum=flat[at:at + numel]))
        at += numel
    return flat, out


def param_offsets(params: list[torch.Tensor]) -> list[int]:
    """Where each parameter's momentum starts in the flat buffer (element offsets)."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    return offsets


class FusedBuckets:
    """The bucketed parameters' momenta fused (:func:`fuse`), each ``exp_avg`` a view into the
    flat buffer, kept while they fit the trainable set.

    Args:
        state: Adam's per-parameter state (``exp_avg`` is replaced by its view).
        bucket_numel: elements per bucket (:func:`plan_buckets`).
        names: parameter names, for each bucket's :attr:`Bucket.signature`.
    """

    def __init__(self, state, bucket_numel: int, names: Optional[Mapping] = None):
        self.state = state
        self.bucket_numel = bucket_numel
        self.names = names if names is not None else {}
        self.buckets: Optional[list[Bucket]] = None
        self.params: list[torch.Tensor] = []  # in the order given to fuse()
        self._views: dict[torch.Tensor, torch.Tensor] = {}  # exp_avg in the flat buffer
        # parameter -> the indices of the buckets holding a part of it, in order
        self.position: dict[torch.Tensor, list[int]] = {}
        self.index: dict[torch.Tensor, int] = {}  # parameter -> its place in params
        self.start_order: list[int] = []  # the places in the order of their first bucket
        self.cut: list[torch.Tensor] = []  # the parameters split across buckets

    def fits(self, active: list[torch.Tensor]) -> bool:
        """Whether the buckets hold exactly ``active``, every ``exp_avg`` is still a view (the
        view itself, or a tensor over the same memory), and every parameter split across
        buckets is still contiguous (its pieces are views of it; ``model.to(memory_format=...)``
        may have made it another layout since). Reads the state with ``get``: a removed entry
        is not put back (the state may be a defaultdict)."""
        state, none = self.state, {}
        return self.buckets is not None and len(active) == len(self.params) and all(
            a is b for a, b in zip(active, self.params)) and all(
            m is view or m is not None and m.data_ptr() == view.data_ptr()
            for m, view in ((state.get(p, none).get("exp_avg"), view)
                            for p, view in self._views.items())
        ) and all(p.is_contiguous() for p in self.cut)

    def fuse(self, active: list[torch.Tensor]) -> None:
        """(Re)build the buckets of ``active``; their ``exp_avg`` become views into them."""
        check_one_device(active)
        # Backward produces gradients roughly in the reverse of the parameters' order, so the
        # buckets are planned from the last parameter: the first bucket is the first one whose
        # gradients are all ready, and buckets start in order.
        order = active[::-1]
        flat, self.buckets = fuse(order, [self.state[p]["exp_avg"] for p in order],
                                  self.bucket_numel)
        self.params = list(active)
        self._views = {p: flat[off:off + p.numel()].view_as(p)
                       for p, off in zip(order, param_offsets(order))}
        for p, view in self._views.items():
            self.state[p]["exp_avg"] = view
        self.index = {p: i for i, p in enumerate(self.params)}
        self.position = {}
        for b in self.buckets:
            for p in b.params:
                self.position.setdefault(p, []).append(b.index)
        self.start_order = [self.index[p] for p in self.position]  # dicts keep first insertion
        self.cut = [p for p, at in self.position.items() if len(at) > 1]
        for b in self.buckets:
            named = tuple((self.names.get(s.param) or tuple(s.param.shape), s.start, s.numel)
                          for s in b.segments)
            b.signature = f"{zlib.crc32(repr(named).encode()):08x}"

    def clear(self) -> None:
        self.buckets = None
        self.params = []
        self._views = {}
        self.position = {}
        self.index = {}
        self.start_order = []
        self.cut = []
