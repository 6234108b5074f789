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


def test_the_bias_correction_factor_is_the_float32_reciprocal_of_the_float32_root():
    # every twin multiplies the root by inverse_root_bc2(sqrt_bc2): the native code computes
    # 1.0f / float(sqrt_bc2), the host rounds a float64 quotient; both must be one number
    import math

    import numpy as np

    from hvd_onebit.kernels.fused_reference import inverse_root_bc2

    roots = [math.sqrt(1 - 0.999 ** t) for t in range(1, 20000, 7)]
    roots += [math.sqrt(1 - 0.98 ** t) for t in range(1, 3000, 3)] + [1.0, 0.3141, 1e-3]
    wrong = [r for r in roots if inverse_root_bc2(r) != float(np.float32(1) / np.float32(r))]
    assert not wrong, f"{len(wrong)} of {len(roots)} factors differ, first at {wrong[0]!r}"
    # and the native pass multiplies the float32 root by that factor (v = 2, eps = 0)
    root = np.sqrt(np.float32(2.0))
    for r in roots[::5]:
        out = float(_native(torch.full((1,), 2.0), torch.empty(1), r, 0.0, False, False))
        want = float(root * np.float32(inverse_root_bc2(r)))
        assert out == want, f"native denominator {out!r} at sqrt_bc2 {r!r}, {want!r} expected"


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
    with pytest.raises(ValueError, match="as many elements: 4, 4, 3, None"):
        kernels.refresh_moments(torch.zeros(4), torch.ones(4), torch.ones(3), None, 0.9, 0.1,
                                1.0, 1.0, 1e-8)
    with pytest.raises(ValueError, match="as many elements: 4, 4, 4, 5"):
        kernels.refresh_moments(torch.zeros(4), torch.ones(4), torch.ones(4), torch.empty(5),
                                0.9, 0.1, 1.0, 1.0, 1e-8)


def _moments(numel: int, seed: int):
    """A momentum, a variance (see :func:`_variance`) and an averaged gradient with zeros."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-6, 2, (numel,), generator=g)
    grad[2::9] = 0.0
    return torch.randn(numel, generator=g), _variance(numel, seed + 1), grad


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("beta1,weight", [(0.9, 1 - 0.999 ** 3), (0.3, 0.5)])
def test_refresh_moments_native_scalar_and_twin_give_the_same_bits(numel, beta1, weight):
    m0, v0, g = _moments(numel, numel)
    args = (beta1, weight, 0.31, 0.47, 1e-8)
    twin = [m0.clone(), v0.clone(), torch.empty(numel)]
    kernels.refresh_moments(twin[0], twin[1], g, twin[2], *args, backend="torch")
    for simd in (True, False):
        got = [m0.clone(), v0.clone(), torch.empty(numel)]
        _C.refresh_moments(got[0], got[1], g, got[2], *args, simd)
        for name, a, b in zip(("m", "v", "ratio"), got, twin):
            assert_same_bits(a, b, f"{name}, {numel} elements, simd={simd}")
        no_ratio = [m0.clone(), v0.clone()]
        _C.refresh_moments(no_ratio[0], no_ratio[1], g, None, *args, simd)
        assert_same_bits(no_ratio[1], twin[1], f"v without a ratio, {numel} elements")
    m_err = float((twin[0].double() - (beta1 * m0.double() + (1 - beta1) * g.double())).abs()
                  .max())
    assert m_err < 1e-5 * float(m0.abs().max() + g.abs().max()), f"m off Adam's by {m_err:.3g}"
    held = v0 == 0
    expect = (1 - weight) * v0.double() + weight * g.double().square()
    worst = float(((twin[1].double() - expect).abs() / expect.clamp_min(1e-30)).max())
    assert worst < 1e-6, f"v off its update by a relative {worst:.3g}"
    either = held | (twin[1] == 0)
    assert int((twin[2][either] != 0).sum()) == 0, "held elements before or after: ratio not 0"


@pytest.mark.parametrize("numel,n,block", [(1000, 4, 64), (37, 3, 8), (4096, 2, 256)])
def test_a_factored_error_rescaled_in_place_is_the_error_times_the_ratio(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y, send = torch.zeros(L.padded), torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    kernels.worker_compress(torch.randn(numel, generator=g), torch.randn(L.padded, generator=g),
                            torch.zeros(L.n * L.nblocks), y, send, L)
    scales = kernels.row_scales(send, L, L.n).reshape(-1).clone()
    ratio = torch.rand(numel, generator=g) * 2
    ratio[::6] = 0.0
    e = kernels.worker_error(y, scales, L)
    expect = torch.cat([e[:numel] * ratio, e[numel:]])
    args = (L.chunk, L.block, L.row_bytes)
    zero = torch.zeros(L.n * L.nblocks)  # what the caller sets the scales to afterwards
    for impl in ("simd", "scalar", "torch"):
        got_y = y.clone()
        if impl == "torch":
            kernels.rescale_error(got_y, scales, ratio, L, L.n, backend="torch")
        else:
            _C.rescale_error(got_y, scales, ratio, L.n, *args, impl == "simd")
        got = kernels.worker_error(got_y, zero, L)
        assert_same_bits(got, expect, f"worker error x ratio, {impl}, {numel} over {n} ranks")
    z, z_scales = y[:L.chunk].clone(), scales[:L.nblocks].clone()
    e_s = kernels.server_error(z, z_scales, L)
    part = ratio[:min(L.chunk, numel) // 2]  # a server chunk's tail past the buffer keeps its e
    expect_s = torch.cat([e_s[:part.numel()] * part, e_s[part.numel():]])
    for impl in ("simd", "scalar", "torch"):
        got_z = z.clone()
        if impl == "torch":
            kernels.rescale_error(got_z, z_scales, part, L, 1, backend="torch")
        else:
            _C.rescale_error(got_z, z_scales, part, 1, *args, impl == "simd")
        assert_same_bits(kernels.server_error(got_z, zero[:L.nblocks], L), expect_s,
                         f"server error x ratio, {impl}, chunk {L.chunk}")
    with pytest.raises(ValueError, match=f"ratio has {L.padded + 1} elements"):
        kernels.rescale_error(y, scales, torch.ones(L.padded + 1), L, L.n)
