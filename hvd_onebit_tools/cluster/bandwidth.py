"""Link rates: parsing ``"1gbit"``-style strings, and the tbf token bucket that enforces a rate."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
DEFAULT_QUEUE_MS = 2.0
MIN_QUEUE_BYTES = 256 * 1024  # a switch port's buffer is bytes, whatever the line rate


def parse_bandwidth(text: str | int | None) -> Optional[int]:
    """Parse a link rate into bits per second; ``None`` means unlimited (no qdisc).

    Accepts ``tc``'s bit units, 1000-based: ``"10mbit"``, ``"1.5gbit"``, ``"100kbit"``, ``"1tbit"``,
    the same per second as the tables print them (``"1 Gbit/s"``), a plain number of bits/s
    (``"5000000"``), and ``"unlimited"`` / ``"none"`` / ``"inf"``.
    Byte-per-second spellings (``"mbps"``, ``"MB/s"``) are rejected as ambiguous: in ``tc``
    ``mbps`` means megaBYTES per second, to most people megaBITS.
    """
    if text is None:
        return None
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"bandwidth must be positive, got {text}")
        return text
    s = str(text).strip().lower()
    if s in ("unlimited", "none", "inf", "infinite", "off"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*?)(?:(?<=bit)/s)?", s)
    unit = m.group(2) if m else ""
    if not m or (unit and unit not in _UNITS):
        raise ValueError(f"cannot parse bandwidth {text!r}: use e.g. 100mbit, 1gbit, 10gbit, "
                         "500kbit or unlimited")
    bps = int(round(float(m.group(1)) * _UNITS[unit or "bit"]))
    if bps < 8000:
        raise ValueError(f"bandwidth {text!r} is below 8kbit, too slow to run anything")
    return bps


def format_bandwidth(bps: Optional[int]) -> str:
    """``10**9 -> '1gbit'``, ``None -> 'unlimited'``: the inverse of :func:`parse_bandwidth`."""
    if bps is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps >= _UNITS[unit] and bps % _UNITS[unit] == 0:
            return f"{bps // _UNITS[unit]}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True)
class TbfParams:
    """Token-bucket settings for one veth end. All sizes in bytes, rate in bits/s."""

    rate_bps: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


def tbf_params(bps: int, queue_ms: float = DEFAULT_QUEUE_MS) -> TbfParams:
    """Choose tbf burst and queue limit (bytes) for a rate in bits/s; tuned from 10mbit to 10gbit.

    * burst: 1 ms worth of line rate, but at least 96 KiB. Below ~64 KiB tbf has to split the
      64 KiB GSO super-packets that veth carries, which costs CPU and throughput; much above 1 ms
      the link visibly runs faster than its rate in short bursts.
    * limit (the queue): burst + ``queue_ms`` of line rate, at least 2 bursts -- a shallow,
      switch-like buffer. Gloo's ring allreduce is a lock-step exchange of chunks, so every
      millisecond of queueing delay is paid at every step: a deep queue (tens of ms) makes a
      large allreduce several times slower than its wire time.
    * the queue is never below ``MIN_QUEUE_BYTES`` (256 KiB): a switch port's buffer is a number
      of bytes, so at low rates it holds many milliseconds. A queue of a few KB drops packets
      when several peers send to one host at once (an alltoall's incast), and TCP's 200 ms
      minimum retransmission timeout then dominates short exchanges. Model your own switches'
      buffers.
    """
    if queue_ms < 0:
        raise ValueError(f"queue_ms must be >= 0, got {queue_ms}")
    rate_bytes = bps / 8.0
    burst = max(96 * 1024, int(rate_bytes * 0.001))
    limit = max(2 * burst, burst + max(MIN_QUEUE_BYTES, int(rate_bytes * queue_ms / 1000)))
    return TbfParams(rate_bps=bps, burst_bytes=burst, limit_bytes=limit)
