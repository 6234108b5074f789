"""variance_refresh's schedule (hvd_onebit.variance_refresh): 0/1 Adam's doubling gaps, its
bounds, and the options' validation."""
import pytest

from hvd_onebit.config import Experimental
from hvd_onebit.variance_refresh import RefreshSchedule


def test_doubling_matches_zero_one_adams_counts():
    s = RefreshSchedule.from_option("doubling")
    counts = {n: s.count(n, freeze_step=0) for n in (1000, 10000, 100000)}
    # gaps 1, 2, 4, ... each for 16 updates: 16 * (1 + 2 + ... + 32) = 1008 steps hold 96
    assert counts == {1000: 96, 10000: 148, 100000: 201}, f"refreshes per run length: {counts}"


def test_is_update_agrees_with_the_listed_updates():
    for s in (RefreshSchedule(), RefreshSchedule(first_interval=3, growth=1.5,
                                                 updates_per_interval=4, last_step=500),
              RefreshSchedule(first_interval=7, growth=1)):
        listed = []
        for t in s.updates():
            if t >= 2000:
                break
            listed.append(t)
        flagged = [t for t in range(2000) if s.is_update(t)]
        assert flagged == listed, f"{s}: is_update marks {flagged[:20]}..., updates() lists " \
                                  f"{listed[:20]}..."


def test_refreshes_come_only_after_the_freeze_and_before_last_step():
    s = RefreshSchedule(last_step=300)
    marked = [t for t in range(1000) if s.is_refresh(t, freeze_step=50)]
    assert marked[:4] == [52, 56, 60, 64], f"first refreshes after a freeze at 50: {marked[:4]}"
    assert min(marked) >= 50 and max(marked) < 300, f"refreshes outside [50, 300): {marked}"
    assert not any(s.is_refresh(t, None) for t in range(100)), "a refresh before any freeze"
    assert s.count(1000, 50) == len(marked), f"count {s.count(1000, 50)} vs {len(marked)} marked"


@pytest.mark.parametrize("option, error", [
    ("weekly", "variance_refresh must be None"),
    (7, "variance_refresh must be None"),
    ({"first_interval": 0}, "first_interval must be a positive int"),
    ({"growth": 0.5}, "growth must be a number >= 1"),
    ({"updates_per_interval": True}, "updates_per_interval must be a positive int"),
    ({"last_step": -3}, "last_step must be a positive int or None"),
    ({"interval": 4}, "refresh_schedule: unknown field"),
    ({"variance_update": "twice"}, "variance_update must be one of"),
    ({"error_feedback": "drop"}, "error_feedback must be one of"),
])
def test_bad_options_name_what_is_wrong(option, error):
    with pytest.raises((ValueError, TypeError), match=error):
        RefreshSchedule.from_option(option)


def test_none_means_no_refresh_and_a_dict_overrides_defaults():
    assert RefreshSchedule.from_option(None) is None
    s = RefreshSchedule.from_option({"updates_per_interval": 8, "last_step": 5000})
    assert s.as_dict() == {"first_interval": 1, "growth": 2, "updates_per_interval": 8,
                           "last_step": 5000, "variance_update": "gap",
                           "error_feedback": "rescale"}, \
        f"schedule from a dict: {s.as_dict()}"


@pytest.mark.parametrize("value", ["lowering", "hypergradient", "always"])
def test_the_retired_accept_option_is_refused_saying_what_to_do(value):
    with pytest.raises(ValueError) as err:
        RefreshSchedule.from_option({"accept": value, "last_step": 90})
    message = str(err.value)
    assert f"accept={value!r} is no longer an option" in message, message
    assert "measured and retired" in message and "drop 'accept'" in message, message
    with pytest.raises(ValueError, match=f"accept={value!r} is no longer an option"):
        Experimental(refresh_schedule={"accept": value})
    assert "accept" not in RefreshSchedule().as_dict(), RefreshSchedule().as_dict()
