"""OneBitAllreduce on real multi-rank jobs, checked against the NumPy reference.

Every scenario of a world size runs in that size's shared job (tests/worlds.py); each scenario's
exception comes back as data, so only the tests of that scenario fail (tests/scenarios.py).
"""
import numpy as np
import pytest
import torch

from hvd_onebit.layout import Layout
from hvd_onebit.transport.inprocess import run_threads
from tests.checks import assert_same_bits
from tests.onebit_reference import ReferenceOneBit
from tests.scenarios import scenario
from tests.workers_collective import fixed_input_outputs, rank_input
from tests.worlds import shared_suite

pytestmark = pytest.mark.multirank


def sizes_for(n):
    return [0, 1, 7, 8 * n - 1, 8 * n + 1, 1 << 20]


world = shared_suite("tests.workers_collective:suite", np=[1, 2, 3, 4], timeout=300,
                     kwargs={n: {"sizes": sizes_for(n)} for n in (1, 2, 3, 4)})
without_mpi = shared_suite("tests.workers_collective:mpi_transport_without_mpi", np=2, timeout=120)
transports_agree = shared_suite("tests.workers_collective:transports_agree", np=4, controller="mpi",
                                timeout=300)


def reference_outputs(n, numel, calls, block_size=None):
    ref = ReferenceOneBit(numel, n, block_size)
    return [ref.allreduce([rank_input(c, r, numel) for r in range(n)]) for c in range(calls)]


def assert_identical_across_ranks(per_rank, what):
    """per_rank[r] is rank r's list of outputs (one per call): the same bytes on every rank."""
    for rank, other in enumerate(per_rank[1:], start=1):
        assert len(other) == len(per_rank[0]), \
            f"{what}: rank {rank} made {len(other)} calls, rank 0 {len(per_rank[0])}"
        for call, (a, b) in enumerate(zip(per_rank[0], other)):
            assert_same_bits(b, a, f"{what}: rank {rank} vs rank 0, call {call}")


def test_matches_reference_for_edge_sizes(world):
    n, results = world
    per_size = scenario(results, "sizes")
    for numel in sizes_for(n):
        per_rank = [r[numel]["outputs"] for r in per_size]
        assert_identical_across_ranks(per_rank, f"n={n} numel={numel}")
        expected = reference_outputs(n, numel, calls=3)
        assert len(per_rank[0]) == len(expected), \
            f"n={n} numel={numel}: {len(per_rank[0])} outputs for {len(expected)} calls"
        for call, (got, want) in enumerate(zip(per_rank[0], expected)):
            assert got.shape == (numel,), f"n={n} call {call}: shape {got.shape}, not ({numel},)"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"n={n} numel={numel} call {call} vs reference")
        if n == 1:
            for call, got in enumerate(per_rank[0]):  # one rank: exact, no compression
                np.testing.assert_array_equal(got, rank_input(call, 0, numel),
                                              err_msg=f"n=1 numel={numel} call {call}: "
                                                      "one rank must return its input exactly")


def test_finer_blocks_match_reference(world):
    n, results = world
    per_rank = [r[5000]["outputs"] for r in scenario(results, "blocks")]
    assert_identical_across_ranks(per_rank, f"n={n} block_size=64")
    expected = reference_outputs(n, 5000, 2, block_size=64)
    assert len(per_rank[0]) == len(expected), f"n={n}: {len(per_rank[0])} outputs for 2 calls"
    for call, (got, want) in enumerate(zip(per_rank[0], expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"n={n} block_size=64 call {call} vs reference")


def test_native_and_torch_kernels_give_the_same_bits(world):
    n, results = world
    torch_runs = scenario(results, "torch_backend")
    native_runs = scenario(results, "native_backend")
    for rank, (t, nat) in enumerate(zip(torch_runs, native_runs)):
        t_out, n_out = t[4099]["outputs"], nat[4099]["outputs"]
        assert len(t_out) == len(n_out) == 2, f"rank {rank}: {len(t_out)} and {len(n_out)} calls"
        for call, (a, b) in enumerate(zip(t_out, n_out)):
            assert_same_bits(b, a, f"n={n} rank {rank} call {call}: native vs torch backend")


def test_inprocess_transport_gives_the_bits_of_the_horovod_job(world):
    """The same inputs through n virtual ranks of one process (threads, InProcessTransport)
    give every rank the bytes the n-rank Horovod job gave it: the in-process transport can
    stand in for Horovod in tests of the collective and the optimizer."""
    n, results = world
    in_process = run_threads(n, lambda t: fixed_input_outputs(sizes_for(n), transport=t))
    compared = 0
    for key in in_process[0]:
        horovod = scenario(results, key)
        threads = scenario(in_process, key)
        for rank in range(n):
            for numel, got in threads[rank].items():
                want = horovod[rank][numel]["outputs"]
                assert len(got["outputs"]) == len(want), \
                    f"{key} numel={numel} rank {rank}: {len(got['outputs'])} vs {len(want)} calls"
                for call, (a, b) in enumerate(zip(got["outputs"], want)):
                    assert_same_bits(a, b, f"n={n} rank {rank} {key} numel={numel} call {call}: "
                                           "in-process vs Horovod")
                    compared += 1
    want_compared = n * (3 * len(set(sizes_for(n))) + 2 * 3)
    assert compared == want_compared, f"compared {compared} outputs, expected {want_compared}"


def test_wire_bytes_match_the_formula(world):
    n, results = world
    rank0 = scenario(results, "sizes")[0]
    for numel in sizes_for(n):
        info = rank0[numel]
        layout = Layout.build(numel, n)
        chunk = -(-numel // (8 * n)) * 8
        row = 4 + 4 + -(-(chunk // 8) // 4) * 4  # status + one scale + signs padded to 4 bytes
        expected = 0 if numel == 0 or n == 1 else 2 * (n - 1) * row
        assert info["row_bytes"] == layout.row_bytes, \
            f"n={n} numel={numel}: row_bytes {info['row_bytes']}, layout says {layout.row_bytes}"
        assert info["wire_bytes"] == expected, \
            f"n={n} numel={numel}: {info['wire_bytes']} wire bytes, formula says {expected}"
    if n > 1:  # 1M floats: at least 30x below a bandwidth-optimal fp32 ring allreduce
        fp32_ring = 2 * (n - 1) / n * 4 * (1 << 20)
        wire = rank0[1 << 20]["wire_bytes"]
        assert wire * 30 <= fp32_ring, \
            f"n={n}: {wire} wire bytes for 1M floats, only {fp32_ring / wire:.1f}x below fp32 ring"


def test_error_feedback_makes_the_running_mean_converge(world):
    n, results = world
    first, running = scenario(results, "ef")[0]
    figures = f"n={n}: error of one call {first:.3g}, of the running mean {running:.3g}"
    if n == 1:
        # exact per call; only float summation error
        assert first == 0 and running < 1e-5, figures
    else:
        assert first > 0.1, f"{figures}; one call should be a coarse sign approximation (> 0.1)"
        assert running < first / 20, \
            f"{figures}; error feedback should bring the mean below first/20 = {first / 20:.3g}"


def test_nonfinite_input_raises_everywhere_and_keeps_state(world):
    n, results = world
    for rank, nf in enumerate(scenario(results, "nonfinite")):
        assert nf["inf_raised"] is not None, \
            f"n={n} rank {rank}: an all-inf call raised no NonFiniteInputError"
        for key, changed in nf["changed"].items():
            assert changed == 0, (f"n={n} rank {rank}: the rejected call changed {changed} of "
                                  f"{nf['sizes'][key]} elements of {key}")
        assert nf["recovered_nonfinite"] == 0, \
            f"n={n} rank {rank}: {nf['recovered_nonfinite']} non-finite outputs after recovering"
        if n > 1:
            assert nf["raised"] is not None, f"n={n} rank {rank}: rank 1's NaN raised nothing here"
            message, ranks = nf["raised"]
            assert ranks == [1] and "rank(s) [1]" in message and "unchanged" in message, \
                f"n={n} rank {rank}: ranks {ranks}, message {message!r}"
        else:
            # there is no rank 1; the all-inf call covers n = 1
            assert nf["raised"] is None, f"n=1: raised {nf['raised']!r} without a bad rank"


def test_async_dtypes_and_inplace(world):
    n, results = world
    per_rank = scenario(results, "async")
    for rank, a in enumerate(per_rank):
        where = f"n={n} rank {rank}"
        assert_same_bits(a["async"], a["sync"], f"{where}: allreduce_async vs allreduce")
        ip = a["inplace"]
        assert ip["returned_ptr"] == ip["out_ptr"], \
            f"{where}: allreduce(y, out=y) returned storage {ip['returned_ptr']:#x}, " \
            f"not y's {ip['out_ptr']:#x}"
        assert_same_bits(ip["out"], a["sync"], f"{where}: in-place output vs allreduce")
        assert a["two_in_flight"] is not None and "in flight" in a["two_in_flight"], \
            f"{where}: a second allreduce_async in flight gave {a['two_in_flight']!r}"
        u = a["update_fused"]
        assert_same_bits(u["w"], u["w_ref"], f"{where}: fused Adam epilogue weights vs "
                                             "AdamUpdate.apply")
        assert_same_bits(u["m"], u["m_ref"], f"{where}: fused epilogue momentum vs "
                                             "AdamUpdate.apply")
        held_m = np.count_nonzero(u["m"][::5])
        assert held_m == 0, f"{where}: {held_m} held elements got a non-zero momentum"
        assert_same_bits(u["w"][::5], u["w0"][::5], f"{where}: held weights moved")
        unmoved = int((u["w"][1::5] == u["w0"][1::5]).sum())
        assert unmoved == 0, f"{where}: {unmoved} of {u['w'][1::5].size} live weights did not move"
        for key in ("torch.float16", "torch.bfloat16"):
            d = a[key]
            assert (d["out_dtype"], d["out_shape"]) == (d["in_dtype"], d["in_shape"]), \
                f"{where}: {d['in_dtype']} {d['in_shape']} in, {d['out_dtype']} " \
                f"{d['out_shape']} out"
    if n > 1:
        for key in ("torch.float16", "torch.bfloat16"):
            inputs = [a[key]["input"] for a in per_rank]
            ref = ReferenceOneBit(4099, n).allreduce(inputs)
            got = per_rank[0][key]["output"]
            tol = 1e-2 if "bfloat16" in key else 1e-3
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol,
                                       err_msg=f"n={n} {key} output vs the reference")


def test_ranks_disagreeing_on_numel_get_a_clear_error(world):
    n, results = world
    for key in ("mismatch", "mismatch_deferred"):  # at construction, or the first call
        for rank, message in enumerate(scenario(results, key)):
            if n == 1:
                assert message is None, f"n=1 {key}: one rank raised {message!r}"
            else:
                assert message is not None and "ranks disagree" in message \
                    and "numel=100" in message, f"n={n} rank {rank} {key}: {message!r}"


def test_mpi_transport_matches_horovod_transport(transports_agree):
    results = transports_agree
    for rank, r in enumerate(results):
        assert len(r["horovod"]) == len(r["mpi"]) == 2, f"rank {rank}: calls {len(r['mpi'])}"
        for call, (a, b) in enumerate(zip(r["horovod"], r["mpi"])):
            assert_same_bits(b, a, f"rank {rank} call {call}: mpi vs horovod transport")
    assert_identical_across_ranks([r["mpi"] for r in results], "mpi transport")


def test_mpi_transport_needs_an_mpi_job(without_mpi):
    results = without_mpi
    for rank, message in enumerate(results):
        assert message and "launched with MPI" in message, f"rank {rank}: {message!r}"


def test_the_rows_belong_to_the_call_the_errors_to_the_collective():
    """Between calls a collective holds its errors alone: y (padded float32), z (chunk float32)
    and the scales of the rows last sent (a float32 per block of each); the fast memory adds
    its spare y and z. The rows live with the call: the worker's until stage 1 is in; the
    server's until stage 2 is in, or with lean memory until the commit, which writes it again
    (and the worker's rows into stage 1's received ones, so it allocates nothing)."""
    from hvd_onebit.comm.flat import OneBitAllreduce
    from hvd_onebit_tools.bench.memory import reachable_storages

    n, numel = 4, 10_000

    def rank_fn(t):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(t.rank))
        out = {}
        for spare in (False, True):
            c = OneBitAllreduce(numel, transport=t, block_size=512, spare_errors=spare,
                                name=f"spare{spare}")
            c.allreduce(x)
            handle = c.allreduce_async(x)
            c.claim(handle)
            c.wait_stage1(handle)
            out[spare, "send kept after stage 1"] = handle.send is not None
            c.start_stage2(handle)
            c.wait_stage2(handle)
            out[spare, "server row kept after stage 2"] = handle.server_row is not None
            c.commit(handle, None)
            c.release()
            out[spare, "held"] = sum(reachable_storages(c).values())
            out[spare, "layout"] = c.layout
        return out

    for rank, got in enumerate(run_threads(n, rank_fn)):
        L = got[False, "layout"]
        errors = 4 * (L.padded + L.chunk + L.n * L.nblocks + L.nblocks)
        want = {(False, "held"): errors, (True, "held"): errors + 4 * (L.padded + L.chunk),
                (False, "send kept after stage 1"): False,
                (True, "send kept after stage 1"): False,
                (False, "server row kept after stage 2"): True,
                (True, "server row kept after stage 2"): False}
        assert {k: got[k] for k in want} == want, (
            f"rank {rank} (padded {L.padded}, chunk {L.chunk}, {L.nblocks} blocks per row, rows "
            f"of {L.row_bytes} bytes): got {[(k, got[k]) for k in want]}, want {want}")


def test_an_abandoned_call_lets_go_of_every_row_it_held():
    """A call every rank abandons (here a NaN on rank 1) keeps none of its rows after the
    drain: a step started again at once would otherwise hold the old call's beside its own."""
    from hvd_onebit.comm.flat import OneBitAllreduce
    from hvd_onebit.comm.protocol import NonFiniteInputError

    def rank_fn(t):
        kept = {}
        for spare in (False, True):
            c = OneBitAllreduce(4096, transport=t, block_size=512, spare_errors=spare,
                                name=f"abandoned{spare}")
            x = torch.ones(4096)
            if t.rank == 1:
                x[7] = float("nan")
            handle = c.allreduce_async(x)
            with pytest.raises(NonFiniteInputError):
                c.synchronize(handle)
            kept[spare] = [name for name in ("send", "server_row", "sent_scales", "served_scales",
                                             "recv", "gathered", "source")
                           if getattr(handle, name) is not None]
        return kept

    for rank, kept in enumerate(run_threads(3, rank_fn)):
        assert kept == {False: [], True: []}, f"rank {rank}: the drained handle still holds {kept}"
