"""The test helpers themselves (tests/scenarios.py, tests/checks.py): no job is launched."""
import numpy as np
import pytest

from tests.checks import assert_same_bits, assert_same_on_every_rank, difference
from tests.scenarios import failure, run_scenarios, scenario


def boom():
    raise ValueError("deliberate failure in scenario b")


def test_a_raising_scenario_fails_only_its_own_tests_with_the_traceback():
    per_rank = [run_scenarios({"a": lambda: rank, "b": boom, "c": lambda: rank * 10}, rank=rank)
                for rank in range(2)]
    assert scenario(per_rank, "a") == [0, 1]
    assert scenario(per_rank, "c") == [0, 10]  # ran after b raised
    assert "deliberate failure in scenario b" in failure(per_rank[1]["b"])
    with pytest.raises(pytest.fail.Exception) as info:
        scenario(per_rank, "b")
    message = str(info.value)
    for text in ("rank 0: scenario 'b' raised", "rank 1: scenario 'b' raised", "Traceback",
                 "in boom", "ValueError: deliberate failure in scenario b"):
        assert text in message, f"{text!r} missing from:\n{message}"
    with pytest.raises(pytest.fail.Exception, match="scenario 'd' did not run"):
        scenario(per_rank, "d")


def test_differences_are_described_in_figures():
    a = np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32)
    b = np.array([-0.0, 1.0, 2.5, 3.0], dtype=np.float32)
    text = difference(a, b)
    assert text.startswith("2 of 4 elements differ, max |diff| 0.5 at flat index 2"), text
    assert difference(a, a.copy()) == "bit-identical"
    assert "shape/dtype" in difference(a, a[:2])
    with pytest.raises(AssertionError, match=r"call 3: 2 of 4 elements differ"):
        assert_same_bits(b, a, "call 3")
    assert_same_bits(a, a.copy(), "same")
    with pytest.raises(AssertionError, match=r"hashes: rank 2 differs from rank 0 from index 1"):
        assert_same_on_every_rank([["x", "y"], ["x", "y"], ["x", "z"]], "hashes")
    assert_same_on_every_rank([1, 1, 1], "numbers")


def test_parameter_lists_and_step_lists_say_where_they_part():
    import torch

    from tests.checks import assert_equal_tensors, assert_same_params, first_difference

    a = [np.zeros(3, dtype=np.float32).tobytes(), np.ones(2, dtype=np.float32).tobytes()]
    b = [a[0], np.array([1.0, 1.5], dtype=np.float32).tobytes()]
    assert_same_params(a, list(a), "same")
    with pytest.raises(AssertionError, match=r"run: 1 of 2 parameters differ: parameter 1: "
                                             r"1 of 2 elements differ, max \|diff\| 0.5"):
        assert_same_params(a, b, "run")
    with pytest.raises(AssertionError, match="run: 1 parameters vs 2"):
        assert_same_params(a[:1], b, "run")
    assert first_difference(["x", "y"], ["x", "y"]) is None
    assert first_difference(["x", "y", "z"], ["x", "q", "z"]) == 1
    assert first_difference(["x"], ["x", "y"]) == 1
    assert_equal_tensors(torch.tensor([0.0]), torch.tensor([-0.0]), "signed zeros are equal")
    with pytest.raises(AssertionError, match=r"t: 1 of 2 elements differ, max \|diff\| 2"):
        assert_equal_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]), "t")
