"""Comparisons for the multi-rank tests whose failures name the figures, not just `assert False`."""
from __future__ import annotations

import numpy as np


def _array(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().float().cpu().numpy() if x.dtype.is_floating_point else x.detach().cpu().numpy()
    return np.asarray(x)


def difference(a, b) -> str:
    """How ``a`` and ``b`` differ, in figures: shapes, or how many elements, the largest |diff|
    and where (bit differences such as -0.0 vs 0.0 or NaN payloads count as differing)."""
    a, b = _array(a), _array(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if a.size == 0:
        return "both empty" if a.tobytes() == b.tobytes() else "empty arrays whose bytes differ"
    av, bv = a.reshape(-1), b.reshape(-1)
    if av.dtype.kind == "f":  # compare bits: -0.0 vs 0.0 and NaN payloads differ too
        bits_differ = av.view(f"u{av.itemsize}") != bv.view(f"u{bv.itemsize}")
    else:
        bits_differ = av != bv
    diff = np.abs(av.astype(np.float64) - bv.astype(np.float64))
    count = int(bits_differ.sum())
    if count == 0:
        return "bit-identical"
    worst = int(np.nanargmax(np.where(bits_differ, np.nan_to_num(diff, nan=np.inf), -1.0)))
    return (f"{count} of {av.size} elements differ, max |diff| {diff[worst]:.3g} at flat index "
            f"{worst} ({av[worst]!r} vs {bv[worst]!r})")


def assert_same_bits(a, b, what: str) -> None:
    """``a`` and ``b`` hold the same bytes (and shape and dtype); else say how they differ."""
    aa, bb = _array(a), _array(b)
    same = aa.shape == bb.shape and aa.dtype == bb.dtype and aa.tobytes() == bb.tobytes()
    assert same, f"{what}: {difference(aa, bb)}"


def assert_same_on_every_rank(per_rank: list, what: str) -> None:
    """Every rank's value equals rank 0's (hashes, lists of hashes, numbers...); else name the
    ranks and, for lists, the first index where they part."""
    first = per_rank[0]
    for rank, value in enumerate(per_rank[1:], start=1):
        if value == first:
            continue
        where = ""
        if isinstance(value, (list, tuple)) and isinstance(first, (list, tuple)):
            at = next((i for i, (x, y) in enumerate(zip(first, value)) if x != y),
                      min(len(first), len(value)))
            where = f" from index {at} on (lengths {len(first)} and {len(value)})"
        raise AssertionError(f"{what}: rank {rank} differs from rank 0{where}: "
                             f"{_short(value)} vs {_short(first)}")


def _short(value, limit=200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _as_array(x) -> np.ndarray:
    """A parameter as :func:`params_bytes` gives it (raw float32 bytes) or as an array/tensor."""
    if isinstance(x, (bytes, bytearray)):
        return np.frombuffer(x, dtype=np.float32 if len(x) % 4 == 0 else np.uint8)
    return _array(x)


def assert_same_params(got: list, want: list, what: str) -> None:
    """Two lists of parameters (raw bytes, arrays or tensors) hold the same bits, one by one;
    else name the parameters that differ and how (count, max |diff|, where)."""
    assert len(got) == len(want), f"{what}: {len(got)} parameters vs {len(want)}"
    bad = [f"parameter {i}: {difference(_as_array(a), _as_array(b))}"
           for i, (a, b) in enumerate(zip(got, want))
           if _as_array(a).tobytes() != _as_array(b).tobytes()
           or _as_array(a).shape != _as_array(b).shape]
    assert not bad, f"{what}: {len(bad)} of {len(got)} parameters differ: " + "; ".join(bad)


def first_difference(a: list, b: list):
    """The first index where two lists (hashes per step...) differ, or the shorter one's length
    if one is a prefix of the other; None if they are equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_equal_tensors(a, b, what: str) -> None:
    """``torch.equal(a, b)`` (same shape, equal values: -0.0 equals 0.0, NaN equals nothing);
    else say how they differ, in figures."""
    import torch

    assert torch.equal(a, b), f"{what}: {difference(a, b)}"
