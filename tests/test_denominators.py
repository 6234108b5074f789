"""The variance refresh's kernels: denominators, their ratio, and the factored errors materialised
natively, each against its torch twin, bit for bit."""
import pytest
import torch

from hvd_onebit import _C, kernels
from hvd_onebit.kernels.denominators import TWIN_SLICE
from hvd_onebit.layout import Layout
from tests.checks import assert_same_bits

SIZES = (1, 7, 8, 13, 1000, TWIN_SLICE + 5)  # below, at and past one SIMD group and one slice


def _variance(numel: int, seed: int) -> torch.Tensor:
    """A variance with the values a refresh meets: zeros (held elements), subnormals, tiny and
    large ones."""
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(numel, generator=g).square_() * 10.0 ** torch.randint(-12, 4, (numel,),
                                                                          generator=g)
    v[::5] = 0.0
    v[1::11] = 1e-41  # subnormal
    return v


def _native(v, out, sqrt_bc2, eps, divide, simd):
    _C.denominators(v, out, sqrt_bc2, eps, divide, simd)
    return out


@pytest.mark.parametrize("numel", SIZES)
def test_denominators_native_scalar_and_twin_give_the_same_bits(numel):
    v, sqrt_bc2, eps = _variance(numel, numel), 0.3141, 1e-8
    twin = kernels.denominators(v, torch.empty(numel), sqrt_bc2, eps, backend="torch")
    for simd in (True, False):
        got = _native(v, torch.empty(numel), sqrt_bc2, eps, False, simd)
        assert_same_bits(got, twin, f"denominators, {numel} elements, simd={simd}")
    held = int(torch.isinf(twin).sum())
    zeros = int((v == 0).sum())
    assert held == zeros, f"{held} infinite denominators for {zeros} zero variances"
    expect = (v.double().sqrt() / sqrt_bc2 + eps)[v != 0]
    worst = float(((twin[v != 0].double() - expect) / expect).abs().max()) if numel > 1 else 0.0
    assert worst < 3e-7, f"denominators off Adam's by a relative {worst:.3g}"


@pytest.mark.parametrize("numel", SIZES)
def test_the_ratio_of_old_to_new_denominators_is_zero_where_either_is_infinite(numel):
    old_v, new_v = _variance(numel, 1), _variance(numel, 2)
    new_v[3::7] = 0.0
    old = kernels.denominators(old_v, torch.empty(numel), 0.5, 1e-8, backend="torch")
    twin = kernels.divide_by_denominators(old.clone(), new_v, 0.7, 1e-8, backend="torch")
    for simd in (True, False):
        got = _native(new_v, old.clone(), 0.7, 1e-8, True, simd)
        assert_same_bits(got, twin, f"ratio, {numel} elements, simd={simd}")
    either = (old_v == 0) | (new_v == 0)
    nonzero = int((twin[either] != 0).sum())
    assert nonzero == 0, f"{nonzero} of {int(either.sum())} held elements have a non-zero ratio"
    finite = int(torch.isfinite(twin).sum())
    assert finite == numel, f"{numel - finite} of {numel} ratios are not finite"


def test_the_kernels_refuse_mismatched_tensors():
    with pytest.raises(ValueError, match="out has 3 elements, v 4"):
        kernels.denominators(torch.ones(4), torch.empty(3), 1.0, 1e-8)
    with pytest.raises(RuntimeError, match="v must be"):
        _C.denominators(torch.ones(4, dtype=torch.float64), torch.empty(4), 1.0, 1e-8, False, True)


@pytest.mark.parametrize("numel,n,block", [(1000, 4, 64), (37, 3, 8), (4096, 2, 256)])
def test_factored_errors_materialised_natively_match_the_twin(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y, send = torch.zeros(L.padded), torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    kernels.worker_compress(torch.randn(numel, generator=g), torch.zeros(L.padded),
                            torch.zeros(L.n * L.row_bytes, dtype=torch.uint8), y, send, L)
    z, row = torch.randn(L.chunk, generator=g), torch.empty(L.row_bytes, dtype=torch.uint8)
    prev_row = torch.empty(L.row_bytes, dtype=torch.uint8)
    kernels.set_identity_rows(prev_row, L, 1)
    kernels.server_compress(send, torch.zeros(L.chunk), prev_row, z, row, L)
    for name, fn, args in (("worker", kernels.worker_error, (y, send, L)),
                           ("server", kernels.server_error, (z, row, L))):
        native, twin = fn(*args, backend="native"), fn(*args, backend="torch")
        assert_same_bits(native, twin, f"{name} error, {numel} elements over {n} ranks")
        scale = float(args[0].abs().max())
        assert float(native.abs().max()) < scale + 1e-6, f"{name} error exceeds |y| {scale}"
