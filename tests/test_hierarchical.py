"""Hierarchical 1-bit allreduce on 2 nodes x 2 ranks: real horovodrun jobs whose two "hosts"
are names of this machine (127.0.0.1 and 127.1), so Horovod sets local and cross ranks as on a
cluster; checked against the NumPy reference of the scheme."""
import json
from pathlib import Path

import numpy as np
import pytest

from tests.checks import difference, first_difference
from tests.onebit_reference import ReferenceHierarchical
from tests.scenarios import scenario
from tests.workers_collective import rank_input
from tests.worlds import DEFAULT_ENV, shared_suite

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.multirank
HOSTS = "127.0.0.1:2,127.1:2"


def on_two_nodes(target, env=None, **kwargs):
    """A shared suite of tests.workers_hierarchical on 2 "nodes" x 2 ranks (a module fixture)."""
    return shared_suite(f"tests.workers_hierarchical:{target}", np=4, hosts=HOSTS, kwargs=kwargs,
                        timeout=240, env=env)


def reference(numel, calls, block_size=None, skip=()):
    ref = ReferenceHierarchical(numel, nodes=2, per_node=2, block_size=block_size)
    return [None if c in skip else ref.allreduce([rank_input(c, r, numel) for r in range(4)])
            for c in range(calls)]


SIZES = [1, 7, 1001, 1 << 16]


# torch-shm: torch.distributed between nodes, the node's shared memory inside them
TRANSPORTS = ["horovod", "torch", "torch-shm"]


# every collective scenario below (:func:`collective_suite`)
collective = on_two_nodes("collective_suite", sizes=SIZES, transports=TRANSPORTS)


@pytest.fixture(scope="module")
def sizes(collective):
    return scenario(collective, "sizes")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("numel", SIZES)
def test_matches_the_reference_and_is_identical_on_every_rank(sizes, numel, transport):
    results = [r[(numel, transport)] for r in sizes]
    expected = reference(numel, 3)
    for rank, r in enumerate(results):
        assert r["topology"] == [2, 2, rank // 2, rank % 2], r["topology"]
        assert r["errors"] == [None] * 3, r["errors"]
        want_intra = "shared_memory" if transport == "torch-shm" else "network"
        assert r["intra"] == want_intra, \
            f"numel={numel} {transport} rank {rank}: inside the node {r['intra']!r}, " \
            f"expected {want_intra!r}"
        for call, (got, want) in enumerate(zip(r["outputs"], expected)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"numel={numel} rank {rank} call {call}")
            assert got.tobytes() == results[0]["outputs"][call].tobytes(), \
                f"numel={numel}: rank {rank} differs from rank 0 at call {call}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bytes_between_nodes_are_half_of_flat_1bit(sizes, transport):
    numel = 1 << 16
    for rank, r in enumerate(x[(numel, transport)] for x in sizes):
        # 2 x 2: a rank's 1-bit rows of half the buffer go to one other node; flat 1-bit sends
        # rows of a quarter of it to two ranks of the other node, in both stages
        assert r["wire_bytes"] <= 0.55 * r["flat_wire_bytes_between_nodes"], \
            f"{transport} rank {rank}: {r['wire_bytes']} bytes between nodes, flat 1-bit " \
            f"{r['flat_wire_bytes_between_nodes']} (allowed up to 0.55 of it)"
        want = 0 if transport == "torch-shm" else 2 * 1 * (numel // 2) * 4
        assert r["intra_bytes"] == want, \
            f"{transport} rank {rank}: {r['intra_bytes']} bytes inside the node, expected {want}"


def test_bad_inputs_get_the_flat_collectives_errors_and_change_nothing(collective):
    """Both collectives check their input with the same rules: the same error type for every
    bad input, naming the collective; a refused call leaves nothing in flight and no state."""
    from tests.onebit_reference import ReferenceOneBit

    good = [rank_input(0, r, 1001) for r in range(4)]
    want = {}  # the good call's output, after the good call that was in flight
    for kind, ref in (("flat", ReferenceOneBit(1001, 4)),
                      ("hierarchical", ReferenceHierarchical(1001, nodes=2, per_node=2))):
        ref.allreduce(good)
        want[kind] = ref.allreduce(good)
    for rank, r in enumerate(scenario(collective, "bad_inputs")):
        flat, hier = r["flat"]["errors"], r["hierarchical"]["errors"]
        for case in flat:
            assert flat[case] is not None and hier[case] is not None, \
                f"rank {rank} {case}: flat raised {flat[case]}, hierarchical {hier[case]}"
            assert flat[case][0] == hier[case][0], \
                f"rank {rank} {case}: flat raised {flat[case]}, hierarchical {hier[case]}"
            assert "'t.bad.hier'" in hier[case][1], \
                f"rank {rank} {case}: the hierarchical error does not name the collective: " \
                f"{hier[case]}"
        for kind in ("flat", "hierarchical"):
            np.testing.assert_allclose(r[kind]["after"], want[kind], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank}: {kind}'s second good call, "
                                               "after the refused ones")


def test_finer_blocks_match_the_reference(collective):
    numel = 5000
    results = scenario(collective, "finer_blocks")
    for call, (got, want) in enumerate(zip(results[0]["outputs"],
                                           reference(numel, 3, block_size=64))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"block_size=64 rank 0 call {call} vs the reference")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_nonfinite_input_on_one_rank_raises_everywhere_and_changes_nothing(collective,
                                                                           transport):
    numel = 1001
    results = scenario(collective, f"nonfinite[{transport}]")
    expected = reference(numel, 4, skip=(1,))
    for rank, r in enumerate(results):
        # the inf (element 500) is in shard 0: the group of local rank 0 (ranks 0 and 2) saw it
        assert r["errors"][1] is not None and "[0, 2]" in r["errors"][1], \
            f"rank {rank}: {r['errors']}"
        assert [e is None for e in r["errors"]] == [True, False, True, True], \
            f"rank {rank}: errors per call {r['errors']}, expected one at call 1 only"
        np.testing.assert_array_equal(r["worker_error"][1], r["worker_error"][0],
                                      err_msg=f"rank {rank}: error feedback changed")
        for call in (0, 2, 3):  # the skipped call is as if it had not been made
            np.testing.assert_allclose(r["outputs"][call], expected[call], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} call {call}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_several_calls_commit_all_or_nothing(collective, transport):
    results = scenario(collective, f"all_or_nothing[{transport}]")
    for rank, r in enumerate(results):
        calls = r["calls"]
        assert [c["error"] is None for c in calls] == [True, False, True], \
            f"{transport} rank {rank}: errors per call {[c['error'] for c in calls]}, " \
            f"expected one at call 1 only"
        assert calls[1]["outputs_changed"] == [0.0, 0.0], \
            f"{transport} rank {rank}: the failed call 1 changed the outputs by max |diff| " \
            f"{calls[1]['outputs_changed']}: {calls[1]}"
        assert calls[1]["errors_changed"] == [0.0, 0.0], \
            f"{transport} rank {rank}: the failed call 1 changed the error feedback by max " \
            f"|diff| {calls[1]['errors_changed']}: {calls[1]}"
        # one host read of device values per transaction, committed or not
        assert [c["host_reads"] for c in calls] == [1, 1, 1], \
            f"{transport} rank {rank}: host reads per call {[c['host_reads'] for c in calls]}, " \
            f"expected 1 each, at {[c['host_reads_where'] for c in calls]}"
        assert all(d > 0 for d in calls[2]["outputs_changed"]), \
            f"{transport} rank {rank}: call 2 left an output unchanged (max |diff| per " \
            f"collective {calls[2]['outputs_changed']})"
        for k, (a, b) in enumerate(zip(r["final"], results[0]["final"])):
            assert a.tobytes() == b.tobytes(), \
                f"{transport}: rank {rank}'s final output {k} differs from rank 0's: " \
                f"{difference(a, b)}"


# Tensor fusion off (tests.worlds.DEFAULT_ENV): with it, Horovod's own warmup allreduce is not
# bit-reproducible run to run on more than two ranks, and the paths are compared bitwise
paths = on_two_nodes("optimizer_paths")
# where the nodes cannot share memory: intra_node="auto" takes the network, "shared_memory" raises
NO_SHM = {**DEFAULT_ENV, "HVD_ONEBIT_SHM_DIR": "/nonexistent/hvd_onebit"}
no_shm_auto = on_two_nodes("without_shared_memory", env=NO_SHM, intra_node="auto")
no_shm_asked = on_two_nodes("without_shared_memory", env=NO_SHM, intra_node="shared_memory")
# node 0 alone cannot share memory: it raised while node 1 went on into the stage between
# nodes, and every rank waited for the others
no_shm_node0 = on_two_nodes("without_shared_memory", intra_node="shared_memory", node=0)


def test_optimizer_trains_like_the_flat_path_with_identical_ranks(paths):
    for rank, r in enumerate(paths):
        hier, flat, auto = r[True], r[False], r["auto"]
        assert (hier["topology"], flat["topology"]) == ([2, 2, rank // 2, rank % 2], None), \
            f"rank {rank}: topology {hier['topology']} hierarchical, {flat['topology']} flat, " \
            f"expected {[2, 2, rank // 2, rank % 2]} and None"
        assert auto["topology"] == hier["topology"], "auto: 2 nodes x 2 ranks is hierarchical"
        assert (hier["told"], flat["told"], auto["told"]) == ([None, True], [None, False],
                                                              [None, True]), \
            f"rank {rank}: telemetry's hierarchical before and after the first compressed step: " \
            f"True {hier['told']}, False {flat['told']}, auto {auto['told']}"
        assert auto["hashes"] == hier["hashes"], \
            f"rank {rank}: transport='auto' and the hierarchical run part at step " \
            f"{first_difference(auto['hashes'], hier['hashes'])} (parameter hashes per step)"
        # transport="auto" is torch.distributed's subgroups, with the node's shared memory
        # inside a node; Horovod's transport and the network inside nodes give the same bits
        assert (hier["transport"], r["horovod"]["transport"]) == ("torch", "horovod"), \
            f"rank {rank}: transports {hier['transport']!r} (auto) and " \
            f"{r['horovod']['transport']!r} (asked for horovod), expected 'torch' and 'horovod'"
        assert hier["intra"] == ["shared_memory"], hier["intra"]
        assert (r["network"]["intra"], r["horovod"]["intra"]) == (["network"], ["network"]), \
            f"rank {rank}: inside the node {r['network']['intra']} (network asked) and " \
            f"{r['horovod']['intra']} (horovod), expected ['network'] for both"
        assert r["horovod"]["hashes"] == hier["hashes"], f"rank {rank}: the transports differ"
        assert r["network"]["hashes"] == hier["hashes"], \
            f"rank {rank}: shared memory and the network inside nodes differ"
        assert hier["phase"] == "compression", f"rank {rank}: ended in {hier['phase']!r}"
        assert hier["hashes"] == paths[0][True]["hashes"], f"rank {rank} differs from rank 0"
        # the same data and warmup: the loss follows the flat path's within tolerance
        for step, (a, b) in enumerate(zip(hier["losses"], flat["losses"])):
            assert a == pytest.approx(b, rel=0.1, abs=0.02), (step, hier["losses"], flat["losses"])
        assert hier["val_loss"] == pytest.approx(flat["val_loss"], rel=0.05), \
            (hier["val_loss"], flat["val_loss"])


def test_variance_refreshes_through_the_hierarchical_collective_follow_the_flat_path(paths):
    """The default schedule (a refresh every step at first, frozen at step 2): the refreshes
    rescale each role's error feedback; every rank ends with rank 0's bits, and the loss
    follows the flat path's with the same refreshes."""
    for rank, r in enumerate(paths):
        hier, flat = r["refresh_True"], r["refresh_False"]
        assert (hier["phase"], hier["told"][-1]) == ("compression", True), \
            f"rank {rank}: phase {hier['phase']}, hierarchical {hier['told']}"
        assert hier["refreshes"] == flat["refreshes"] > 0, \
            f"rank {rank}: {hier['refreshes']} refreshes hierarchical, {flat['refreshes']} flat"
        assert hier["hashes"] == paths[0]["refresh_True"]["hashes"], \
            f"rank {rank} parts from rank 0 at step " \
            f"{first_difference(hier['hashes'], paths[0]['refresh_True']['hashes'])}"
        for step, (a, b) in enumerate(zip(hier["losses"], flat["losses"])):
            assert a == pytest.approx(b, rel=0.1, abs=0.02), (rank, step, hier["losses"],
                                                              flat["losses"])
        assert hier["val_loss"] == pytest.approx(flat["val_loss"], rel=0.05), \
            (rank, hier["val_loss"], flat["val_loss"])


def test_error_feedback_belongs_to_the_rank_s_role(paths):
    for rank, r in enumerate(paths):
        hier = r[True]
        assert hier["same_role_warnings"] == [] and hier["norm_after_same_role"] > 0, hier
        assert any("does not fit" in w and "reset to zero" in w
                   for w in hier["other_role_warnings"]), hier["other_role_warnings"]
        assert hier["norm_after_other_role"] == 0.0, \
            f"rank {rank}: error feedback norm {hier['norm_after_other_role']} left after " \
            f"loading another role's, expected 0.0"


uneven = shared_suite("tests.workers_hierarchical:uneven_nodes", np=4, hosts="127.0.0.1:3,127.1:1",
                      timeout=240)


def test_nodes_of_unequal_rank_counts_are_refused_when_built_and_auto_stays_flat(uneven):
    """3 ranks on one "node" and 1 on the other: hierarchical=True is refused when the optimizer
    is built, on every rank, before any step; "auto" trains flat, alike on every rank."""
    for rank, r in enumerate(uneven):
        assert r["true"] is not None and "needs every node to run the same number of ranks" in \
            r["true"] and f"runs {3 if rank < 3 else 1} of the 4" in r["true"], \
            f"rank {rank}: hierarchical=True gave {r['true']!r}"
        assert r["auto"]["phase"] == "compression" and \
            r["auto"]["hash"] == uneven[0]["auto"]["hash"], f"rank {rank}: auto {r['auto']}"


def test_nodes_that_cannot_share_memory_use_the_network_or_raise_as_asked(no_shm_auto,
                                                                          no_shm_asked):
    auto = no_shm_auto
    for rank, r in enumerate(auto):
        assert r.get("error") is None and r["intra"] == ["network"], f"rank {rank}: {r}"
        assert any("use the network" in w and "/nonexistent/hvd_onebit" in w
                   for w in r["warnings"]), f"rank {rank}: {r['warnings']}"
        assert r["hashes"][-1] == auto[0]["hashes"][-1], f"rank {rank} differs from rank 0"
    asked = no_shm_asked
    for rank, r in enumerate(asked):
        assert r["error"].startswith("SharedMemoryError") and "rank(s) [0, 1, 2, 3]" in \
            r["error"], f"rank {rank}: {r['error']}"


def test_a_rank_lost_while_its_node_maps_the_segment_leaves_no_file(tmp_path):
    """Local rank 1 dies inside the mapping, after local rank 0 created the segment: rank 0's
    exchange raises, and the file is gone (it stayed in /dev/shm, up to the buckets' bytes
    again per node and crash)."""
    from tests.torchrun_jobs import run_torchrun_script

    rc, text = run_torchrun_script(2, REPO / "tests" / "scripts" / "shm_lost_rank.py", [],
                                   timeout=120, env={"HVD_ONEBIT_SHM_DIR": str(tmp_path)})
    reports = [json.loads(line) for line in text.splitlines() if line.startswith('{"rank"')]
    assert rc not in (0, None) and [r["rank"] for r in reports] == [0], \
        f"exit status {rc} (expected a failed job, not a hang), reports {reports}:\n{text[-3000:]}"
    assert reports[0]["error"] is not None, f"rank 0's exchange did not raise: {reports[0]}"
    assert list(tmp_path.iterdir()) == [], \
        f"segments left behind: {sorted(p.name for p in tmp_path.iterdir())}"


def test_shared_memory_failing_on_one_node_raises_on_every_rank(no_shm_node0):
    """intra_node="shared_memory" where one node can share memory and another cannot: every
    rank raises, naming the ranks that failed (it hung: the node that could went on into the
    stage between nodes, a collective the other node never reached)."""
    for rank, r in enumerate(no_shm_node0):
        assert (r.get("error") or "").startswith("SharedMemoryError") and \
            "failed on rank(s) [0, 1]" in r["error"], f"rank {rank}: {r.get('error') or r}"
