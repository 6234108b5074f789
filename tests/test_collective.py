"""OneBitAllreduce on real multi-rank jobs, checked against the NumPy reference."""
import numpy as np
import pytest

from hvd_onebit.layout import Layout
from hvd_onebit.cluster.jobs import run_ranks
from hvd_onebit.transport.inprocess import run_threads
from tests.onebit_reference import ReferenceOneBit
from tests.workers_collective import fixed_input_outputs, rank_input

pytestmark = pytest.mark.multirank


def sizes_for(n):
    return [0, 1, 7, 8 * n - 1, 8 * n + 1, 1 << 20]


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world(request):
    n = request.param
    results = run_ranks("tests.workers_collective:suite", np=n,
                        kwargs={"sizes": sizes_for(n)}, timeout=300)
    return n, results


def reference_outputs(n, numel, calls, block_size=None):
    ref = ReferenceOneBit(numel, n, block_size)
    return [ref.allreduce([rank_input(c, r, numel) for r in range(n)]) for c in range(calls)]


def assert_identical_across_ranks(per_rank):
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0], other):
            assert a.tobytes() == b.tobytes()


def test_matches_reference_for_edge_sizes(world):
    n, results = world
    for numel in sizes_for(n):
        per_rank = [r["sizes"][numel]["outputs"] for r in results]
        assert_identical_across_ranks(per_rank)
        expected = reference_outputs(n, numel, calls=3)
        for got, want in zip(per_rank[0], expected):
            assert got.shape == (numel,)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"n={n} numel={numel}")
        if n == 1:
            for call, got in enumerate(per_rank[0]):  # one rank: exact, no compression
                np.testing.assert_array_equal(got, rank_input(call, 0, numel))


def test_finer_blocks_match_reference(world):
    n, results = world
    per_rank = [r["blocks"][5000]["outputs"] for r in results]
    assert_identical_across_ranks(per_rank)
    for got, want in zip(per_rank[0], reference_outputs(n, 5000, 2, block_size=64)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_native_and_torch_kernels_give_the_same_bits(world):
    n, results = world
    for r in results:
        for a, b in zip(r["torch_backend"][4099]["outputs"], r["native_backend"][4099]["outputs"]):
            assert a.tobytes() == b.tobytes()


def test_inprocess_transport_gives_the_bits_of_the_horovod_job(world):
    """The same inputs through n virtual ranks of one process (threads, InProcessTransport)
    give every rank the bytes the n-rank Horovod job gave it: the in-process transport can
    stand in for Horovod in tests of the collective and the optimizer."""
    n, results = world
    in_process = run_threads(n, lambda t: fixed_input_outputs(sizes_for(n), transport=t))
    compared = 0
    for rank in range(n):
        for key, per_size in in_process[rank].items():
            for numel, got in per_size.items():
                want = results[rank][key][numel]["outputs"]
                assert len(got["outputs"]) == len(want)
                for a, b in zip(got["outputs"], want):
                    assert a.tobytes() == b.tobytes(), (n, rank, key, numel)
                    compared += 1
    assert compared == n * (3 * len(set(sizes_for(n))) + 2 * 3)


def test_wire_bytes_match_the_formula(world):
    n, results = world
    for numel in sizes_for(n):
        info = results[0]["sizes"][numel]
        layout = Layout.build(numel, n)
        chunk = -(-numel // (8 * n)) * 8
        row = 4 + 4 + -(-(chunk // 8) // 4) * 4  # status + one scale + signs padded to 4 bytes
        expected = 0 if numel == 0 or n == 1 else 2 * (n - 1) * row
        assert info["row_bytes"] == layout.row_bytes
        assert info["wire_bytes"] == expected
    if n > 1:  # 1M floats: at least 30x below a bandwidth-optimal fp32 ring allreduce
        fp32_ring = 2 * (n - 1) / n * 4 * (1 << 20)
        assert results[0]["sizes"][1 << 20]["wire_bytes"] * 30 <= fp32_ring


def test_error_feedback_makes_the_running_mean_converge(world):
    n, results = world
    first, running = results[0]["ef"]
    if n == 1:
        assert first == 0 and running < 1e-5  # exact per call; only float summation error
    else:
        assert first > 0.1  # one call is a coarse sign approximation
        assert running < first / 20  # error feedback recovers what compression dropped


def test_nonfinite_input_raises_everywhere_and_keeps_state(world):
    n, results = world
    for rank, r in enumerate(results):
        nf = r["nonfinite"]
        assert nf["inf_raised"]
        assert nf["untouched"]
        assert nf["recovered_finite"]
        if n > 1:
            message, ranks = nf["raised"]
            assert ranks == [1] and "rank(s) [1]" in message and "unchanged" in message
        else:
            assert nf["raised"] is None  # there is no rank 1; the all-inf call covers n = 1


def test_async_dtypes_and_inplace(world):
    n, results = world
    for r in results:
        a = r["async"]
        assert a["async_equal"] and a["inplace"] and a["update_fused"]
        assert "in flight" in a["two_in_flight"]
        for key in ("torch.float16", "torch.bfloat16"):
            same_dtype, same_shape, _, _ = a[key]
            assert same_dtype and same_shape
    if n > 1:
        for key in ("torch.float16", "torch.bfloat16"):
            inputs = [r["async"][key][2] for r in results]
            ref = ReferenceOneBit(4099, n).allreduce(inputs)
            got = results[0]["async"][key][3]
            tol = 1e-2 if "bfloat16" in key else 1e-3
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_ranks_disagreeing_on_numel_get_a_clear_error(world):
    n, results = world
    for r in results:
        if n == 1:
            assert r["mismatch"] is None and r["mismatch_deferred"] is None
        else:
            for key in ("mismatch", "mismatch_deferred"):  # at construction, or the first call
                assert "ranks disagree" in r[key] and "numel=100" in r[key]


def test_mpi_transport_matches_horovod_transport():
    results = run_ranks("tests.workers_collective:transports_agree", np=4, controller="mpi",
                        timeout=300)
    for r in results:
        for a, b in zip(r["horovod"], r["mpi"]):
            assert a.tobytes() == b.tobytes()
    assert_identical_across_ranks([r["mpi"] for r in results])


def test_mpi_transport_needs_an_mpi_job():
    results = run_ranks("tests.workers_collective:mpi_transport_without_mpi", np=2,
                        controller="gloo", timeout=120)
    for message in results:
        assert message and "launched with MPI" in message
