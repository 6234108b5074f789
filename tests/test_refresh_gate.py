"""The refresh gates' decision (hvd_onebit/engine/refresh_gate.py), on tensors in one process:
the sums it compares (hvd_onebit/kernels/gate_sums.py, native and twin) and its choice."""

import pytest
import torch

from hvd_onebit import _C, kernels
from hvd_onebit.engine import refresh_gate
from hvd_onebit.engine.fusion import fuse
from hvd_onebit.kernels import gate
from tests.checks import assert_same_bits


def test_root_sums_are_over_the_trained_elements_whatever_the_chunk(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    v = torch.rand(103, generator=gen)
    v[::5] = 0  # held elements: in neither sum
    g = torch.randn(103, generator=gen)
    w = 0.01
    live = v > 0
    want = [float(v[live].double().sqrt().sum()),
            float(((1 - w) * v + w * g * g)[live].double().sqrt().sum())]
    for chunk, backend in ((7, "torch"), (103, "torch"), (1 << 20, "torch"), (0, "native")):
        monkeypatch.setattr(gate, "CHUNK", chunk)
        got = kernels.gate_sums(v.reshape(1, 103), g.reshape(1, 103), w,
                                backend=backend).tolist()
        assert got == pytest.approx(want, rel=1e-6), \
            f"{backend}, chunk {chunk}: {got}, want {want}"


@pytest.mark.parametrize("numel", (1, 7, 8, 13, 1000, (1 << 20) + 5))
def test_native_gate_sums_are_the_twins_and_alike_on_every_cpu_path(numel):
    gen = torch.Generator().manual_seed(numel)
    v = torch.rand(numel, generator=gen).square_() * 10.0 ** torch.randint(-8, 3, (numel,),
                                                                            generator=gen)
    v[::6] = 0.0
    g, m = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    twin = kernels.gate_sums(v, g, 0.003, m, sqrt_bc2=0.2, eps=1e-8, backend="torch")
    simd = _C.gate_sums(v, g, m, 0.003, 0.2, 1e-8, True)
    scalar = _C.gate_sums(v, g, m, 0.003, 0.2, 1e-8, False)
    # the bits every rank decides on: the same with and without AVX2
    assert_same_bits(simd, scalar, f"gate sums, {numel} elements, SIMD against scalar")
    assert simd.tolist() == pytest.approx(twin.tolist(), rel=1e-9, abs=1e-12), \
        f"native {simd.tolist()} against torch's {twin.tolist()}"
    two = _C.gate_sums(v, g, None, 0.003, 0.2, 1e-8, True)
    assert_same_bits(two, simd[:2], "the roots' sums without m")


def test_a_parameter_declines_when_its_mean_denominator_would_rise():
    a, b = torch.zeros(1), torch.zeros(2)
    # a: the roots' sum falls 10 -> 9 while sqrt(bc2) grows 0.2 -> 0.21: the mean falls
    # b: the sum grows 10 -> 11 while sqrt(bc2) grows 0.2 -> 0.21: 52.4 > 50, it rises
    sums = {a: torch.tensor([10.0, 9.0], dtype=torch.float64),
            b: torch.tensor([10.0, 11.0], dtype=torch.float64)}
    old, new = {a: 0.2, b: 0.2}, {a: 0.21, b: 0.21}
    got = refresh_gate.declined(sums, old, new)
    assert len(got) == 1 and got[0] is b, f"declined {[id(p) for p in got]}, want only b"
    assert refresh_gate.declined({}, {}, {}) == []


def test_the_bias_correction_alone_can_lower_the_mean():
    p = torch.zeros(1)
    # the raw roots grow 10 -> 10.4 (4%), sqrt(bc2) grows 5%: the mean denominator falls
    sums = {p: torch.tensor([10.0, 10.4], dtype=torch.float64)}
    assert refresh_gate.declined(sums, {p: 0.2}, {p: 0.21}) == [], \
        "a 4% larger sum under a 5% larger sqrt(bc2) lowers the mean and must be taken"


def test_the_third_sum_is_the_gradient_along_the_last_step_whatever_the_chunk(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    v = torch.rand(103, generator=gen)
    v[::4] = 0  # held: no step taken, not in the sum
    g, m = torch.randn(103, generator=gen), torch.randn(103, generator=gen)
    sqrt_bc2, eps = 0.3, 1e-3
    live = v > 0
    d = v.double().sqrt() / sqrt_bc2 + eps
    along = (g.double() * m.double() / d)[live]
    want = [float(along.sum()), float(along.square().sum())]
    for chunk, backend in ((5, "torch"), (103, "torch"), (1 << 20, "torch"), (0, "native")):
        monkeypatch.setattr(gate, "CHUNK", chunk)
        got = kernels.gate_sums(v, g, 0.01, m, sqrt_bc2=sqrt_bc2, eps=eps, backend=backend)
        assert got.numel() == 4, f"with the momentum: {got.numel()} sums, want 4"
        assert got[2:].tolist() == pytest.approx(want, rel=1e-5), \
            f"{backend}, chunk {chunk}: sum(g m / d), sum((g m / d)^2) = {got[2:].tolist()}, " \
            f"want {want}"
        two = kernels.gate_sums(v, g, 0.01, backend=backend)
        assert got[:2].tolist() == pytest.approx(two.tolist(), rel=1e-12), \
            f"chunk {chunk}: the roots' sums {got[:2].tolist()} differ without m {two.tolist()}"


def test_hypergradient_declines_a_fall_after_an_overshoot_and_a_rise_otherwise():
    names = ("rise while descending", "fall after overshoot", "rise after overshoot",
             "fall while descending", "fall, anti-aligned within the noise",
             "fall, anti-aligned by 4 standard errors")
    # [old roots, new roots, sum(g u), sum((g u)^2)]; sqrt(bc2) stays 1. An overshoot needs
    # sum(g u) < -5 sqrt(sum((g u)^2)): -0.5 against 5 * 0.06 is one, -0.5 against 5 * 1 and
    # -0.4 against 5 * 0.1 (4 standard errors) are not
    z = refresh_gate.OVERSHOOT_Z
    assert z == 5.0, f"the rows below are for Z = 5, not {z}"
    rows = ([10.0, 11.0, 0.5, 0.004], [10.0, 9.0, -0.5, 0.004], [10.0, 11.0, -0.5, 0.004],
            [10.0, 9.0, 0.5, 0.004], [10.0, 9.0, -0.5, 1.0], [10.0, 9.0, -0.4, 0.01])
    params = [torch.zeros(1) for _ in names]
    sums = {p: torch.tensor(r, dtype=torch.float64) for p, r in zip(params, rows)}
    ones = {p: 1.0 for p in params}
    got = {id(p) for p in refresh_gate.declined(sums, ones, ones)}
    assert [n for p, n in zip(params, names) if id(p) in got] == [
        "rise while descending", "fall after overshoot"], \
        f"declined {[n for p, n in zip(params, names) if id(p) in got]}"


def test_pieces_by_parameter_follows_a_parameter_cut_across_buckets():
    p, q = torch.zeros(40), torch.zeros(2)
    _, buckets = fuse([p, q], [torch.zeros(40), torch.zeros(2)], bucket_numel=24)
    assert len(buckets) == 2, f"planned {len(buckets)} buckets, want p cut across two"
    state = {p: {"exp_avg_sq": torch.arange(40.0)}, q: {"exp_avg_sq": torch.ones(2)}}
    got = refresh_gate.pieces_by_parameter(buckets, state, {p: torch.ones(40), q: None})
    assert list(got) == [p], f"parameters with pieces: {len(got)} (q has no gradient)"
    assert [v.tolist() for v, _ in got[p]] == [list(map(float, range(24))),
                                               list(map(float, range(24, 40)))], \
        f"p's pieces: {[v.numel() for v, _ in got[p]]} elements"
