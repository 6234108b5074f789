"""OneBitAllreduce on the in-process transport: n virtual ranks as threads of one process.

No Horovod job is launched; every world size from 1 to 8 runs in seconds. That these bits are the
Horovod job's bits is checked in tests/test_collective.py.
"""
import numpy as np
import pytest
import torch

from hvd_onebit import NonFiniteInputError, OneBitAllreduce, synchronize_all
from hvd_onebit.transport.base import Transport
from hvd_onebit.transport.inprocess import InProcessTransport, InProcessWorld, run_threads
from tests.checks import assert_same_bits
from tests.onebit_reference import ReferenceOneBit
from tests.workers_collective import rank_input

SIZES = [0, 1, 7, 8 * 8 + 1, 4099, 100_003]
WORLDS = range(1, 9)


def allreduce_calls(transport, numel, calls, **kwargs):
    comm = OneBitAllreduce(numel, transport=transport, name=f"calls.{numel}", **kwargs)
    return [comm.allreduce(torch.from_numpy(rank_input(c, transport.rank, numel))).numpy().copy()
            for c in range(calls)]


def assert_same_bytes_on_every_rank(per_rank):
    for rank, other in enumerate(per_rank[1:], start=1):
        assert len(other) == len(per_rank[0]), f"rank {rank}: {len(other)} outputs vs rank 0's"
        for call, (a, b) in enumerate(zip(other, per_rank[0])):
            assert_same_bits(a, b, f"rank {rank} vs rank 0, output {call}")


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("numel", SIZES)
def test_matches_reference_and_is_identical_on_every_rank(n, numel):
    per_rank = run_threads(n, lambda t: allreduce_calls(t, numel, calls=3))
    assert_same_bytes_on_every_rank(per_rank)
    ref = ReferenceOneBit(numel, n)
    for call, got in enumerate(per_rank[0]):
        want = ref.allreduce([rank_input(call, r, numel) for r in range(n)])
        assert got.shape == (numel,), f"n={n} call={call}: shape {got.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"n={n} call={call}")


@pytest.mark.parametrize("n", [2, 5])
def test_finer_blocks_and_both_backends(n):
    numel = 5000
    by_backend = {b: run_threads(n, lambda t: allreduce_calls(t, numel, 2, block_size=64, backend=b))
                  for b in ("native", "torch")}
    assert_same_bytes_on_every_rank(by_backend["native"] + by_backend["torch"])
    ref = ReferenceOneBit(numel, n, block_size=64)
    for call, got in enumerate(by_backend["native"][0]):
        want = ref.allreduce([rank_input(call, r, numel) for r in range(n)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 4])
def test_nonfinite_input_on_one_rank_raises_on_every_rank_and_keeps_state(n):
    numel = 1001

    def rank_fn(t):
        comm = OneBitAllreduce(numel, transport=t, name="nf")
        x = torch.from_numpy(rank_input(0, t.rank, numel))
        comm.allreduce(x)  # some error feedback to protect
        before = comm.state_dict()
        bad = x.clone()
        if t.rank == n - 1:
            bad[numel // 2] = float("nan")
        out = torch.full((numel,), 7.0)
        with pytest.raises(NonFiniteInputError) as info:
            comm.allreduce(bad, out=out)
        after = comm.state_dict()
        changed = {key: int((before[key] != after[key]).sum())
                   for key in ("worker_error", "server_error")}
        changed["out"] = int((out != 7.0).sum())  # the rejected call wrote nothing either
        return info.value.ranks, changed, comm.allreduce(x).numpy()

    results = run_threads(n, rank_fn)
    for rank, (ranks, changed, _) in enumerate(results):
        assert ranks == [n - 1], f"rank {rank}: the error names ranks {ranks}, not [{n - 1}]"
        assert changed == {"worker_error": 0, "server_error": 0, "out": 0}, \
            f"rank {rank}: elements the rejected call changed: {changed}"
    assert_same_bytes_on_every_rank([[r[2]] for r in results])
    nonfinite = int((~np.isfinite(results[0][2])).sum())
    assert nonfinite == 0, f"{nonfinite} non-finite outputs after recovering"


@pytest.mark.parametrize("n", [1, 3])
def test_synchronize_all_commits_nothing_anywhere_when_one_call_is_bad(n):
    sizes = [300, 4099, 17]

    def rank_fn(t):
        comms = [OneBitAllreduce(s, transport=t, name=f"bucket{i}") for i, s in enumerate(sizes)]
        xs = [torch.from_numpy(rank_input(i, t.rank, s)) for i, s in enumerate(sizes)]
        synchronize_all([(c, c.allreduce_async(x)) for c, x in zip(comms, xs)])
        before = [c.state_dict() for c in comms]
        outs = [torch.full((s,), 3.0) for s in sizes]
        bad = [x.clone() for x in xs]
        if t.rank == n - 1:
            bad[1][5] = float("inf")  # the middle bucket, on one rank only
        handles = [c.allreduce_async(x, out=o) for c, x, o in zip(comms, bad, outs)]
        with pytest.raises(NonFiniteInputError) as info:
            synchronize_all(list(zip(comms, handles)))
        changed = [{"worker_error": int((b["worker_error"] != c.state_dict()["worker_error"]).sum()),
                    "server_error": int((b["server_error"] != c.state_dict()["server_error"]).sum()),
                    "out": int((o != 3.0).sum())} for b, c, o in zip(before, comms, outs)]
        # every call is ready for the next step, on every rank
        after = synchronize_all([(c, c.allreduce_async(x)) for c, x in zip(comms, xs)])
        return info.value.ranks, changed, [a.numpy() for a in after]

    results = run_threads(n, rank_fn)
    untouched = {"worker_error": 0, "server_error": 0, "out": 0}
    for rank, (ranks, changed, _) in enumerate(results):
        assert ranks == [n - 1], f"rank {rank}: the error names ranks {ranks}, not [{n - 1}]"
        assert changed == [untouched] * len(sizes), \
            f"rank {rank}: elements changed per call (sizes {sizes}): {changed}"
    assert_same_bytes_on_every_rank([r[2] for r in results])


def test_a_rank_that_never_joins_gives_a_clear_timeout_not_a_hang():
    """The waiting ranks get the world's own timeout (0.5 s, named in the error), not a hang."""
    def rank_fn(t):
        comm = OneBitAllreduce(64, transport=t, name="lonely")
        if t.rank == 2:
            return "left"  # never calls allreduce
        with pytest.raises(TimeoutError, match=r"'lonely.alltoall'.*rank\(s\) \[2\] never "
                                               r"joined it within 0\.5 s"):
            comm.allreduce(torch.ones(64))
        return "timed out"

    world = InProcessWorld(3, timeout=0.5)
    got = run_threads(3, rank_fn, world=world)
    assert got == ["timed out", "timed out", "left"], got


def test_a_failing_rank_aborts_the_others_at_once_and_is_reported():
    """The rank left waiting is aborted by the failure (a RuntimeError naming it), not released
    by the 30 s timeout (a TimeoutError)."""
    waiter_got = []

    def rank_fn(t):
        if t.rank == 1:
            raise KeyError("boom")
        try:
            t.wait(t.alltoall_async(torch.zeros(2, 4, dtype=torch.uint8), "op"))
        except BaseException as exc:
            waiter_got.append(exc)
            raise

    with pytest.raises(KeyError, match="boom") as info:
        run_threads(2, rank_fn, timeout=30)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "virtual rank 1 of 2" in notes, notes
    assert len(waiter_got) == 1, f"rank 0's wait ended with {waiter_got}"
    assert type(waiter_got[0]) is RuntimeError and "rank 1 failed with KeyError" in str(
        waiter_got[0]), f"rank 0's wait ended with {waiter_got[0]!r}, not the abort"


def test_ops_match_by_name_and_order_whatever_the_interleaving():
    """Ranks start several ops before waiting and in different orders; a name used again is
    matched by call order, as Horovod matches it."""
    n = 4

    def rank_fn(t):
        names = ["a", "b", "c"] if t.rank % 2 == 0 else ["c", "a", "b"]
        handles = {}
        for repeat in range(2):
            for name in names:
                row = torch.full((n, 3), 10 * t.rank + repeat, dtype=torch.uint8)
                handles[name, repeat] = t.alltoall_async(row, name)
        gathered = t.allgather_async(torch.tensor([[t.rank, 1]], dtype=torch.uint8), "g")
        ints = t.allgather_ints_async([t.rank, -t.rank], "i")
        got = {key: t.wait(h) for key, h in sorted(handles.items(), reverse=True)}
        return got, t.wait(gathered), t.allgather_ints_wait(ints)

    for rank, (alltoalls, gathered, ints) in enumerate(run_threads(n, rank_fn)):
        for (name, repeat), rows in alltoalls.items():
            assert rows.tolist() == [[10 * r + repeat] * 3 for r in range(n)]
        assert gathered.tolist() == [[r, 1] for r in range(n)]
        assert ints == [[r, -r] for r in range(n)]


def test_ranks_disagreeing_on_an_op_get_an_error_not_a_hang():
    def rank_fn(t):
        with pytest.raises(RuntimeError, match="'x'.*do not fit together"):
            t.wait(t.allgather_async(torch.zeros(1, 4 + t.rank, dtype=torch.uint8), "x"))
        with pytest.raises(RuntimeError, match="different collectives"):
            if t.rank:
                t.allgather_ints_wait(t.allgather_ints_async([1], "y"))
            else:
                t.wait(t.allgather_async(torch.zeros(1, 4, dtype=torch.uint8), "y"))

    run_threads(2, rank_fn, timeout=5)


def test_transport_objects_and_their_errors():
    world = InProcessWorld(2)
    assert isinstance(InProcessTransport(world, 1), Transport), \
        f"InProcessTransport's bases: {InProcessTransport.__mro__}"
    with pytest.raises(ValueError, match="outside a world of 2"):
        InProcessTransport(world, 2)
    with pytest.raises(ValueError, match="at least one rank"):
        InProcessWorld(0)
    with pytest.raises(TypeError, match="Transport object"):
        OneBitAllreduce(10, transport=object())
    single = OneBitAllreduce(10, transport=InProcessTransport(InProcessWorld(1), 0))
    got = (single.transport, single.size, single.process_set)
    assert got == (None, 1, None), f"one rank: (transport, size, process_set) {got}"


def test_a_hierarchical_collectives_errors_into_a_flat_one_name_the_topology():
    """A checkpoint of a hierarchical job (each rank's errors of its shard, with its role)
    resumed flat, e.g. on one node: the error names both, not the shard's internal sizes."""
    def rank_fn(t):
        flat = OneBitAllreduce(100, transport=t, name="flat")
        saved = {**flat.state_dict(), "numel": 50, "topology": [2, 2, 0, t.rank]}
        with pytest.raises(ValueError) as caught:
            flat.load_state_dict(saved)
        return str(caught.value)

    for rank, message in enumerate(run_threads(2, rank_fn, timeout=5)):
        assert message == (f"error feedback was saved by the hierarchical collective in topology "
                           f"role [2, 2, 0, {rank}] ([nodes, ranks per node, node, local rank]), "
                           "and this job's 1-bit stage is flat"), f"rank {rank}: {message}"


def test_mismatched_layouts_are_a_clear_error_on_every_rank():
    def rank_fn(t):
        with pytest.raises(ValueError, match="ranks disagree.*numel=100.*numel=101"):
            OneBitAllreduce(100 + t.rank, transport=t, name="mismatch")

    run_threads(2, rank_fn, timeout=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [2, 4])
def test_virtual_ranks_share_one_gpu(n):
    numel = 100_003

    def rank_fn(t):
        comm = OneBitAllreduce(numel, transport=t, device="cuda", name="gpu")
        return [comm.allreduce(torch.from_numpy(rank_input(c, t.rank, numel)).cuda()).cpu().numpy()
                for c in range(3)]

    per_rank = run_threads(n, rank_fn)
    assert_same_bytes_on_every_rank(per_rank)
    ref = ReferenceOneBit(numel, n)
    for call, got in enumerate(per_rank[0]):
        want = ref.allreduce([rank_input(call, r, numel) for r in range(n)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
