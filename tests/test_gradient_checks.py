"""A full-precision step's check of the gradients for inf and NaN (one flag for all of them)."""
import pytest
import torch

from hvd_onebit.phases.gradients import nonfinite_flag


def _sparse(value: float) -> torch.Tensor:
    return torch.sparse_coo_tensor([[0, 2]], [1.0, value], (4,), check_invariants=True)


@pytest.mark.parametrize("case, tensors, flagged", [
    ("finite", [torch.randn(10), torch.randn(3, 4)], False),
    ("nan", [torch.randn(10), torch.tensor([1.0, float("nan")])], True),
    ("inf and -inf", [torch.tensor([float("inf"), -float("inf")])], True),
    ("empty", [torch.zeros(0), torch.ones(2)], False),
    ("float16 past its own range in sum", [torch.full((100_000,), 1.0, dtype=torch.float16)],
     False),
    ("float16 inf", [torch.tensor([1.0, float("inf")], dtype=torch.float16)], True),
    ("bfloat16 nan", [torch.tensor([float("nan")], dtype=torch.bfloat16)], True),
    ("sparse finite", [_sparse(3.0)], False),
    ("sparse inf", [_sparse(float("inf"))], True),
])
def test_the_flag_is_set_exactly_where_a_gradient_holds_inf_or_nan(case, tensors, flagged):
    got = nonfinite_flag(tensors)
    assert got.dtype == torch.bool and got.dim() == 0 and bool(got) == flagged, \
        f"{case}: flag {got}, want {flagged}"


def test_no_gradients_give_no_flag():
    assert nonfinite_flag([]) is None, "a flag for no gradients"
