"""Adam's fused prologue and epilogue (hvd_onebit.kernels.fused_adam): the native kernels give the bits
of their torch references (single process, no Horovod job)."""
import math

import pytest
import torch

from hvd_onebit import OneBitAllreduce, _C, kernels
from hvd_onebit.comm.protocol import Epilogue, InputProducer
from hvd_onebit.kernels.fused_adam import AdamUpdate, MomentumInput, worker_compress_momentum
from hvd_onebit.layout import Layout
from hvd_onebit.transport.inprocess import run_threads
from tests.test_kernels import _previous_state, vector_width  # noqa: F401 (a fixture)


def preconditioning(sizes, g):
    """A frozen variance per segment (~20% zeros: held elements), sqrt(bc2), eps and a bound on
    |u| (every third unbounded; the others clamp part of their elements): the keyword arguments
    that precondition a MomentumInput."""
    variances = [torch.rand(s, generator=g) * 1e-4 + 1e-9 for s in sizes]
    for v in variances:
        v[torch.rand(v.shape, generator=g) < 0.2] = 0.0
    return dict(variances=variances, sqrt_bc2s=[0.1 + 0.05 * i for i in range(len(sizes))],
                eps=[1e-8 if i % 2 else 1e-6 for i in range(len(sizes))],
                bounds=[math.inf if i % 3 == 2 else 15.0 for i in range(len(sizes))])


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("precondition", [False, True], ids=["momentum", "preconditioned"])
@pytest.mark.parametrize("sizes,n", [([5, 0, 13, 1000, 7], 4), ([64, 64], 3), ([1], 2),
                                     ([4099], 1), ([300_001, 3, 200_000], 4)])
def test_momentum_input_compressed_in_one_pass_equals_materialised(sizes, n, precondition):
    """beta1*m + (1-beta1)*g computed inside the compression (AVX2 and scalar, called directly
    and through the collective's hook) gives the same bits as torch computing x first, across gradient boundaries that split 8-element groups and
    with missing gradients (zeros); preconditioned, x / denom (+-0 where the variance is 0)."""
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_scales = _previous_state(L, g)
    m = torch.randn(numel, generator=g)
    m[:1] = -0.0  # a negative zero times beta1 plus (1-beta1)*0 is +0 in both paths
    grads = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
    extra = preconditioning(sizes, g) if precondition else {}
    src = MomentumInput(m, grads, sizes, 0.9, **extra)
    x = src.materialize()
    expect = x.clone()
    for i, (grad, start) in enumerate(zip(grads, [sum(sizes[:k]) for k in range(len(sizes))])):
        here = slice(start, start + sizes[i])
        expect[here] = 0.9 * m[here] + (0.1 * grad if grad is not None else 0.0)
        if precondition:
            v = extra["variances"][i]
            denom = v.double().sqrt() / extra["sqrt_bc2s"][i] + extra["eps"][i]
            expect[here] = torch.where(v == 0, 0.0, expect[here] / denom).clamp(
                -extra["bounds"][i], extra["bounds"][i])
            assert bool((x[here][v == 0] == 0).all()), "held elements were not sent as 0"
            if extra["bounds"][i] != math.inf and sizes[i] > 100:
                at_bound = float((x[here].abs() == extra["bounds"][i]).float().mean())
                assert 0.05 < at_bound < 0.95, f"segment {i}: {at_bound:.2f} at the bound"
    torch.testing.assert_close(x, expect, rtol=1e-6, atol=1e-7)
    runs = []
    for impl in ("avx2", "scalar", "torch", "materialised", "hook"):
        y_out = torch.empty(L.padded)
        send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
        if impl == "materialised":
            ok = kernels.worker_compress(x, y_prev, prev_scales, y_out, send, L, "native")
        elif impl == "hook":  # what the collective calls
            ok = src.compress(y_prev, prev_scales, y_out, send, L, "native")
        elif impl == "torch":
            ok = worker_compress_momentum(src, y_prev, prev_scales, y_out, send, L, "torch")
        else:
            ok = _C.worker_compress_momentum(m, grads, sizes, 0.9, *src.native_precondition_args(),
                                             y_prev, prev_scales, y_out, send, *L.as_args(),
                                             impl == "avx2")
        runs.append((ok, y_out.numpy().tobytes(), send.numpy().tobytes()))
    names = ("avx2", "scalar", "torch", "materialised", "hook")
    for name, r in zip(names[1:], runs[1:]):
        assert r == runs[0], f"{name}: bits differ from the AVX2 pass's"
    assert runs[0][0] is True


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("precondition", [False, True], ids=["momentum", "preconditioned"])
@pytest.mark.parametrize("sizes", [[5, 0, 13, 1000, 7], [1], [300_001, 3, 1_100_000]])
def test_momentum_input_written_out_natively_equals_torch(sizes, precondition):
    """``materialize(backend="native")`` (one native pass, AVX2 and scalar; streaming stores
    past 2**20 elements) writes the bits of the torch reference, across gradient boundaries
    inside 8-element groups and with missing gradients."""
    numel = sum(sizes)
    g = torch.Generator().manual_seed(numel)
    m = torch.randn(numel, generator=g)
    m[:1] = -0.0
    grads = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
    src = MomentumInput(m, grads, sizes, 0.9, **(preconditioning(sizes, g) if precondition else {}))
    expect = src.materialize().numpy().tobytes()
    for simd in (True, False):
        out = torch.full((numel,), float("nan"))
        _C.momentum_update(m, grads, sizes, 0.9, *src.native_precondition_args(), out, simd)
        assert out.numpy().tobytes() == expect, f"avx2={simd}: bits differ from torch's"
    out = torch.full((numel,), float("nan"))
    assert src.materialize(out=out, backend="native") is out
    assert out.numpy().tobytes() == expect, "materialize(backend='native') differs from torch's"
    with pytest.raises(RuntimeError, match="must not be the momentum"):
        _C.momentum_update(m, grads, sizes, 0.9, [], [], [], [], m, True)


def test_momentum_input_rejects_mismatched_gradients():
    L = Layout.build(10, 2, None)
    args = (torch.zeros(L.padded), torch.zeros(L.n * L.row_bytes, dtype=torch.uint8),
            torch.empty(L.padded), torch.empty(L.n * L.row_bytes, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="gradient has 3 elements, needs 4"):
        _C.worker_compress_momentum(torch.zeros(10), [torch.zeros(3), torch.zeros(6)], [4, 6],
                                    0.9, [], [], [], [], *args, *L.as_args(), True)
    with pytest.raises(RuntimeError, match="gradients hold 9 elements, momentum 10"):
        _C.worker_compress_momentum(torch.zeros(10), [None, None], [4, 5], 0.9, [], [], [], [],
                                    *args, *L.as_args(), True)
    with pytest.raises(RuntimeError, match="variance has 5 elements, needs 6"):
        _C.worker_compress_momentum(torch.zeros(10), [None, None], [4, 6], 0.9,
                                    [torch.ones(4), torch.ones(5)], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0],
                                    *args, *L.as_args(), True)


def update_case(sizes, L, dtypes=(torch.float32,), unweighted_variances=False):
    """Inputs of a decode with Adam's update: random rows with scales in [0, 1), and per
    parameter (every third None) a weight of ``dtypes[i % len(dtypes)]``, a frozen variance with
    ~30% held elements (0, mask in ``held``), a step and a decay (every other one != 1); then
    sqrt(bc2), eps and a step bound per parameter (unbounded at i = 2, 6, ...; the others
    clamp a few percent of their elements, in vector groups and scalar tails)."""
    g = torch.Generator().manual_seed(sum(sizes))
    rows = torch.randint(0, 255, (L.n * L.row_bytes,), dtype=torch.uint8, generator=g)
    kernels.row_scales(rows, L, L.n).copy_(torch.rand(L.n, L.nblocks, generator=g))
    weights = [None if i % 3 == 1 else torch.randn(s, generator=g).to(dtypes[i % len(dtypes)])
               for i, s in enumerate(sizes)]
    # unweighted_variances: every other weightless parameter has a variance (a masked one,
    # preconditioned: its momentum is converted back, nothing updated)
    variances = [None if w is None and not (unweighted_variances and i % 6 == 1)
                 else torch.rand(s, generator=g) * 1e-4 + 1e-9
                 for i, (w, s) in enumerate(zip(weights, sizes))]
    held = [None if v is None else torch.rand(v.shape, generator=g) < 0.3 for v in variances]
    for v, h in zip(variances, held):
        if v is not None:
            v[h] = 0.0
    steps = [-1e-3 / 0.9 * (i + 1) for i in range(len(sizes))]
    decays = [1 - 1e-5 if i % 2 else 1.0 for i in range(len(sizes))]
    sqrt_bc2s = [math.sqrt(1 - 0.999 ** (10 * (i + 1))) for i in range(len(sizes))]
    eps = [1e-8 if i % 2 else 1e-6 for i in range(len(sizes))]
    bounds = [math.inf if i % 4 == 2 else 0.03 * (i + 1) for i in range(len(sizes))]
    return rows, weights, variances, held, steps, decays, sqrt_bc2s, eps, bounds


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("precond", [False, True], ids=["momentum", "preconditioned"])
@pytest.mark.parametrize("sizes,n", [([5, 0, 13, 1000, 7], 4), ([64, 64], 3), ([1], 2),
                                     ([300_001, 3, 200_000], 4)])
def test_decode_fused_with_adam_update_equals_torch(sizes, n, precond):
    """Decode + ``denom = sqrt(v)/sqrt_bc2 + eps``, ``w = w*decay + (step*m)/denom`` in one pass
    (AVX2 and scalar, called directly and through the collective's hook) gives the bits of
    torch's decode, the denominator, ``w.mul_(decay)`` and ``w.addcdiv_(m, denom, value=step)``;
    parameters given as None are only decoded. Elements with a zero variance (infinite
    denominator: held) keep their weight (times decay) and get a zero momentum, in vector
    groups and in the scalar tails alike. Preconditioned, the rows carry u = m / denom: the
    momentum stored is u * denom and the step clamp(step * u), a variance may come without
    its weight (converted only)."""
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    rows, weights, variances, held, steps, decays, sqrt_bc2s, eps, bounds = update_case(
        sizes, L, unweighted_variances=precond)
    results = []
    for impl in ("torch", "avx2", "scalar", "hook"):
        w = [None if t is None else t.clone() for t in weights]
        m = torch.full((numel,), float("nan"))
        update = AdamUpdate(w, variances, sizes, steps, decays, sqrt_bc2s, eps, bounds, precond)
        if impl == "torch":
            kernels.decode(rows, m, L, "torch")
            update.apply(m)
        elif impl == "hook":  # what the collective calls
            update.decode_into(rows, m, L, "native")
        else:
            _C.decode_update(rows, m, w, variances, sizes, steps, decays, sqrt_bc2s, eps,
                             update.bounds, precond, *L.as_args(), impl == "avx2")
        results.append((m.numpy().tobytes(), [None if t is None else t.numpy().tobytes() for t in w]))
    for impl, r in zip(("avx2", "scalar", "hook"), results[1:]):
        assert r[0] == results[0][0], f"{impl}: momentum differs from torch's"
        assert r[1] == results[0][1], f"{impl}: weights differ from torch's"
    before = [None if t is None else t.numpy().tobytes() for t in weights]
    unmoved = [i for i, (a, b) in enumerate(zip(results[0][1], before)) if a is not None and a == b]
    assert not unmoved, f"weights {unmoved} were not updated by torch's decode and update"
    m = torch.frombuffer(bytearray(results[1][0]), dtype=torch.float32)
    start = 0
    for i, (h, w0, decay) in enumerate(zip(held, weights, decays)):
        if h is not None and h.any():
            assert torch.all(m[start:start + sizes[i]][h] == 0), f"param {i}: held momentum"
            if w0 is not None:
                w1 = torch.frombuffer(bytearray(results[1][1][i]), dtype=torch.float32)
                assert torch.equal(w1[h], w0[h] * decay if decay != 1 else w0[h]), \
                    f"param {i}: held elements moved"
        start += sizes[i]


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("precond", [False, True], ids=["momentum", "preconditioned"])
@pytest.mark.parametrize("sizes", [[5, 0, 13, 1000, 7], [64, 64], [1], [300_001, 3, 200_000]])
@pytest.mark.parametrize("alias", [False, True], ids=["src", "in-place"])
def test_update_from_a_decoded_momentum_equals_torch(sizes, alias, precond):
    """Adam's update from a momentum that arrives decoded (the hierarchical collective's
    gathered mean): the native pass (AVX2 and scalar, and through ``copy_apply``) gives the bits
    of ``out.copy_(src)`` then the torch reference :meth:`AdamUpdate.apply`: weights, and the
    momentum with held elements (zero variance) set to +0; ``src`` may be ``out``."""
    numel = sum(sizes)
    L = Layout.build(numel, 2, None)
    _, weights, variances, held, steps, decays, sqrt_bc2s, eps, bounds = update_case(
        sizes, L, unweighted_variances=precond)
    src = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    results = {}
    for impl in ("torch", "avx2", "scalar", "hook"):
        w = [None if t is None else t.clone() for t in weights]
        m = src.clone() if alias else torch.full((numel,), float("nan"))
        given = m if alias else src.clone()
        update = AdamUpdate(w, variances, sizes, steps, decays, sqrt_bc2s, eps, bounds, precond)
        if impl == "torch":
            m.copy_(given)
            update.apply(m)
        elif impl == "hook":
            update.copy_apply(given, m, "native")
        else:
            _C.update(given, m, w, variances, sizes, steps, decays, sqrt_bc2s, eps,
                      update.bounds, precond, impl == "avx2")
        results[impl] = (m.numpy().tobytes(),
                         [None if t is None else t.numpy().tobytes() for t in w])
    for impl in ("avx2", "scalar", "hook"):
        assert results[impl][0] == results["torch"][0], f"{impl}: momentum differs from torch's"
        assert results[impl][1] == results["torch"][1], f"{impl}: weights differ from torch's"
    m = torch.frombuffer(bytearray(results["avx2"][0]), dtype=torch.float32)
    start = 0
    for i, (h, size) in enumerate(zip(held, sizes)):
        if h is not None:
            here = slice(start, start + size)
            assert torch.all(m[here][h] == 0), "held elements keep a momentum"
            want = src[here]
            if precond:
                want = want * AdamUpdate(weights, variances, sizes, steps, decays, sqrt_bc2s,
                                         eps).denominator(i)
            assert torch.equal(m[here][~h], want[~h]), \
                "updated elements' momentum is not the source's (times denom, preconditioned)"
        start += size


EDGE_SIZES = [1, 7, 9, 15, 16, 17, 0, 31, 33, 47, 64, 100, 5]  # ends off every 8-, 16-lane edge


def edge_variances(sizes, g):
    """Frozen variances with held elements (0) scattered, in a whole 16-element run and at a
    segment's first and last elements."""
    variances = [torch.rand(s, generator=g) * 1e-4 + 1e-9 for s in sizes]
    for v in variances:
        v[torch.rand(v.shape, generator=g) < 0.25] = 0.0
        v[:1] = 0.0
        v[-1:] = 0.0
        if v.numel() >= 48:
            v[16:32] = 0.0
    return variances


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("non_finite", [False, True], ids=["finite", "non-finite"])
@pytest.mark.parametrize("n", [1, 3])
def test_preconditioned_passes_at_the_vector_edges_equal_torch(n, non_finite):
    """The default step's two native passes (preconditioned momentum + compress, preconditioned
    decode + update) on segments ending off every 8- and 16-element edge, with held elements
    (zero variances) scattered and in whole groups, and non-finite gradients (+-inf, NaN) or
    scales: the bits of the torch twins, the status words included. A NaN scale's sign (in a
    row whose status already says not finite) is left out: the vector code's accumulators meet
    the NaN and the infinities in another order than the scalar code and torch."""
    sizes = EDGE_SIZES
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    g = torch.Generator().manual_seed(numel + n)
    y_prev, prev_scales = _previous_state(L, g)
    m = torch.randn(numel, generator=g) * 0.1
    grads = [None if i % 5 == 3 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
    if non_finite:
        grads[1][3], grads[4][15], grads[-2][50] = float("inf"), float("-inf"), float("nan")
    variances = edge_variances(sizes, g)
    src = MomentumInput(m, grads, sizes, 0.9, variances=variances,
                        sqrt_bc2s=[0.3] * len(sizes), eps=[1e-8] * len(sizes),
                        bounds=[math.inf if i % 4 == 2 else 2.0 for i in range(len(sizes))])
    runs = {}
    for impl in ("torch", "native", "scalar"):
        y_out = torch.full((L.padded,), 123.0)
        send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
        if impl == "scalar":
            ok = _C.worker_compress_momentum(m, grads, sizes, 0.9, *src.native_precondition_args(),
                                             y_prev, prev_scales, y_out, send, *L.as_args(), False)
        else:
            ok = worker_compress_momentum(src, y_prev, prev_scales, y_out, send, L, impl)
        scales = kernels.row_scales(send, L, L.n)
        scales[scales.isnan()] = float("nan")
        runs[impl] = (ok, y_out.numpy().tobytes(), send.numpy().tobytes())
    for impl in ("native", "scalar"):
        assert runs[impl] == runs["torch"], f"compress, {impl}: bits differ from torch's"
    assert runs["torch"][0] is (not non_finite), \
        f"compress reported finite={runs['torch'][0]} for non_finite={non_finite}"

    rows, weights, _, _, steps, decays, sqrt_bc2s, eps, bounds = update_case(sizes, L)
    if non_finite:
        kernels.row_scales(rows, L, L.n)[0, 0] = float("inf")
    results = {}
    for impl in ("torch", "native", "scalar"):
        w = [None if t is None else t.clone() for t in weights]
        out = torch.full((numel,), float("nan"))
        update = AdamUpdate(w, variances, sizes, steps, decays, sqrt_bc2s, eps, bounds, True)
        if impl == "torch":
            kernels.decode(rows, out, L, "torch")
            update.apply(out)
        else:
            _C.decode_update(rows, out, w, variances, sizes, steps, decays, sqrt_bc2s, eps,
                             update.bounds, True, *L.as_args(), impl == "native")
        results[impl] = [out.numpy().tobytes()] + [None if t is None else t.numpy().tobytes()
                                                    for t in w]
    for impl in ("native", "scalar"):
        assert results[impl] == results["torch"], f"decode + update, {impl}: bits differ"


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_through_the_collective_hooks_equal_the_unfused_steps(n, backend):
    """OneBitAllreduce given a MomentumInput and an AdamUpdate epilogue gives the bits of the
    same steps unfused: materialise the input, allreduce it, apply the update (n virtual ranks
    in one process)."""
    sizes = [1000, 3, 517]
    numel = sum(sizes)

    def rank_fn(t):
        g = torch.Generator().manual_seed(10 + t.rank)
        m0 = torch.randn(numel, generator=torch.Generator().manual_seed(0))  # same on all ranks
        grads = [torch.randn(s, generator=g) for s in sizes]
        shared = torch.Generator().manual_seed(1)
        w0 = [torch.randn(s, generator=shared) for s in sizes]
        variances = [torch.rand(s, generator=shared) * 1e-4 for s in sizes]
        variances[0][::7] = 0.0
        runs = []
        for fused in (True, False):
            comm = OneBitAllreduce(numel, transport=t, backend=backend, name=f"fused.{fused}")
            m, w = m0.clone(), [x.clone() for x in w0]
            for _ in range(3):
                src = MomentumInput(m, grads, sizes, 0.9)
                update = AdamUpdate(w, variances, sizes, [-1e-3] * 3, [1.0, 0.99, 1.0],
                                    [0.3] * 3, [1e-8] * 3)
                if fused:
                    comm.synchronize(comm.allreduce_async(src, out=m), epilogue=update)
                else:
                    m.copy_(comm.allreduce(src.materialize()))
                    update.apply(m)
            runs.append([m.numpy().tobytes()] + [x.numpy().tobytes() for x in w])
        return runs

    for fused, unfused in run_threads(n, rank_fn):
        assert fused == unfused


def test_the_adam_types_are_the_collective_hooks():
    src = MomentumInput(torch.zeros(4), [None], [4], 0.9)
    update = AdamUpdate([None], [None], [4], [0.0], [1.0])
    assert isinstance(src, InputProducer), f"MomentumInput's bases: {type(src).__mro__}"
    assert isinstance(update, Epilogue), f"AdamUpdate's bases: {type(update).__mro__}"


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("rows,numel,n", [(2, 1001, 2), (3, 8, 1), (1, 77, 3), (2, 300_007, 2)])
def test_node_mean_compressed_in_one_pass_equals_materialised(rows, numel, n):
    """The hierarchical collective's node mean, (r_0 + r_1 + ...) / k, computed inside the
    worker compression (AVX2, scalar, and through the producer's hook) gives the bits of torch
    summing in row order, dividing, then compressing; a non-finite row element is reported."""
    from hvd_onebit.comm.hierarchical import NodeMean

    L = Layout.build(numel, n, None)
    g = torch.Generator().manual_seed(numel + rows)
    y_prev, prev_scales = _previous_state(L, g)
    data = [torch.randn(numel, generator=g) * (k + 1) for k in range(rows)]
    mean = NodeMean(data, torch.empty(numel))
    x = mean.materialize()
    torch.testing.assert_close(x, sum(data) / rows, rtol=1e-6, atol=1e-6)
    assert isinstance(mean, InputProducer), f"NodeMean's bases: {type(mean).__mro__}"
    runs = {}
    for impl in ("materialised", "avx2", "scalar", "hook"):
        y_out = torch.empty(L.padded)
        send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
        if impl == "materialised":
            ok = kernels.worker_compress(x, y_prev, prev_scales, y_out, send, L, "torch")
        elif impl == "hook":
            ok = mean.compress(y_prev, prev_scales, y_out, send, L, "native")
        else:
            ok = _C.worker_compress_mean(data, y_prev, prev_scales, y_out, send, *L.as_args(),
                                         impl == "avx2")
        runs[impl] = (ok, y_out.numpy().tobytes(), send.numpy().tobytes())
    for impl in ("avx2", "scalar", "hook"):
        assert runs[impl] == runs["materialised"], f"{impl}: differs from torch's"
    assert runs["avx2"][0] is True
    data[-1][numel // 2] = float("inf")
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    assert mean.compress(y_prev, prev_scales, None, send, L, "native") is False, \
        "an inf in a row was not reported"


@pytest.mark.parametrize("impl", ["torch", "avx2", "scalar"])
def test_the_step_bound_clamps_the_step_and_nothing_else(impl):
    """With a bound, every element's step ``w1 - w0`` is ``clamp((step*m)/denom, -b, b)``: the
    elements whose unbounded step is longer move by exactly +-b (the same bits in every
    twin), the others by their unbounded step, and the momentum is the decoded one, unclamped.
    Without a bound (``inf``) the bits are those of an AdamUpdate given no bounds at all."""
    sizes = [4099, 517]
    numel = sum(sizes)
    L = Layout.build(numel, 2, None)
    g = torch.Generator().manual_seed(3)
    src = torch.randn(numel, generator=g)
    w0 = [torch.randn(s, generator=g) for s in sizes]
    variances = [torch.rand(s, generator=g) * 1e-4 + 1e-9 for s in sizes]
    steps, decays, sqrt_bc2s, eps = [-1e-3, -2e-3], [1.0, 1.0], [0.3, 0.5], [1e-8, 1e-8]
    unbounded = [torch.mul(src[:sizes[0]], steps[0]) / AdamUpdate(
        [w0[0]], [variances[0]], [sizes[0]], [steps[0]], [1.0], [0.3], [1e-8]).denominator(0)]
    bound = float(unbounded[0].abs().median())  # half of parameter 0's elements are clamped

    def run(bounds):
        w, m = [x.clone() for x in w0], src.clone()
        update = AdamUpdate(w, variances, sizes, steps, decays, sqrt_bc2s, eps, bounds)
        if impl == "torch":
            update.apply(m)
        else:
            _C.update(src, m, w, variances, sizes, steps, decays, sqrt_bc2s, eps,
                      update.bounds, False, impl == "avx2")
        return w, m

    w, m = run([bound, math.inf])
    b32 = float(torch.tensor(bound, dtype=torch.float32))
    moved = w[0] - w0[0]
    clamped = unbounded[0].abs() > b32
    assert 0.4 < float(clamped.float().mean()) < 0.6, \
        f"{float(clamped.float().mean()):.3f} of elements over the bound, expected about half"
    top = (w0[0] + torch.where(unbounded[0] > 0, b32, -b32))[clamped]
    assert torch.equal(w[0][clamped], top), \
        f"{impl}: clamped elements moved by up to {float(moved[clamped].abs().max()):.3e}, bound {b32:.3e}"
    assert torch.equal(w[0][~clamped], (w0[0] + unbounded[0])[~clamped]), \
        f"{impl}: elements inside the bound did not take their unbounded step"
    assert torch.equal(m, src), f"{impl}: the momentum was changed by the bound"
    w_none, m_none = run(None)
    assert torch.equal(w[1], w_none[1]) and torch.equal(m, m_none), \
        f"{impl}: an infinite bound changed the bits of the unbounded update"


def test_a_negative_or_nan_bound_is_refused():
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="step bounds must be >= 0"):
            AdamUpdate([None], [None], [4], [0.0], [1.0], bounds=[bad])
