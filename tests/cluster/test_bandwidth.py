"""Link rates and the tbf token bucket: pure functions, no root needed."""
import pytest

from hvd_onebit_tools.cluster import format_bandwidth, parse_bandwidth, tbf_params


@pytest.mark.parametrize("text, bps", [
    ("10mbit", 10_000_000), ("100mbit", 100_000_000), ("1gbit", 10**9), ("10gbit", 10**10),
    ("2.5gbit", 2_500_000_000), ("500kbit", 500_000), ("64000", 64_000), (" 1GBit ", 10**9),
    ("unlimited", None), ("none", None), (None, None), (123_456, 123_456),
    # as the tables print a rate
    ("1 Gbit/s", 10**9), ("0.1 Gbit/s", 100_000_000), ("100mbit/s", 100_000_000),
])
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["fast", "1gbps", "100MB/s", "", "-5mbit", "10 mbits", "1bit",
                                  "1 GB/s", "1/s", "1gbit/"])
def test_parse_bandwidth_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_bandwidth(text)


def test_format_bandwidth_round_trips():
    for text in ("10mbit", "100mbit", "1gbit", "10gbit", "2500kbit", "unlimited"):
        assert format_bandwidth(parse_bandwidth(text)) == text


def test_tbf_params_are_sane_from_10mbit_to_10gbit():
    for text in ("10mbit", "100mbit", "1gbit", "10gbit"):
        p = tbf_params(parse_bandwidth(text))
        assert p.burst_bytes >= 64 * 1024  # whole GSO packets pass without being split
        assert p.limit_bytes >= 2 * p.burst_bytes
        assert p.limit_bytes >= p.burst_bytes + 256 * 1024  # a switch port's buffer at least
        if p.rate_bps >= 10**8:
            assert p.limit_bytes * 8 / p.rate_bps < 0.05  # and shallow: < 50 ms of line rate
        assert p.tc_args()[:3] == ["tbf", "rate", f"{p.rate_bps}bit"]


def test_queue_depth_sets_the_tbf_limit():
    bps = parse_bandwidth("100mbit")
    shallow, deep = tbf_params(bps), tbf_params(bps, queue_ms=50)
    assert deep.burst_bytes == shallow.burst_bytes
    assert shallow.limit_bytes == shallow.burst_bytes + 256 * 1024  # 2 ms is below the floor
    assert deep.limit_bytes == shallow.burst_bytes + int(bps / 8 * 0.050)
    with pytest.raises(ValueError, match="queue_ms"):
        tbf_params(bps, queue_ms=-1)
