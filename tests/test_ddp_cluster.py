"""The DDP face's hierarchical 1-bit Adam on the emulated cluster's 2 nodes x 2 ranks, launched as
torchrun launches a multi-node job (``hvd-onebit cluster run --torchrun``: one torchrun per node
in its namespace, Gloo on the shaped links, Horovod blocked in the ranks): one launch runs every
scenario (tests/cluster/ddp_workers.py).
The compressed steps, their buckets started from the gradient hooks and the node's stages in shared
memory, are checked bit for bit against the engine alone on the same state and local gradients,
every bucket started in step() and the node's stages on its links, and the collective on
torchrun's layout against the NumPy reference of the scheme; the emulated links' bytes
against the 1-bit payload and DDP's full-precision steps. The layout checks run in one process."""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hvd_onebit.transport.torch_job import Place, layout_problems
from tests.cluster.ddp_workers import COLLECTIVE_NUMEL, COMPRESSED, FREEZE, rank_input
from tests.cli import hvd_onebit
from tests.cluster.test_emulator import needs_netns
from tests.onebit_reference import ReferenceHierarchical
from tests.scenarios import scenario
from tests.torchrun_jobs import REPO

NODES, PER_NODE = 2, 2
# the wire target: a compressed step's bytes on a node's link at most this fraction of DDP Adam's
WIRE_TARGET = 25


@dataclass(frozen=True)
class ClusterJob:
    report: dict  # hvd-onebit cluster run --json's report: one line per node's torchrun
    results: list  # each rank's scenarios, in rank order


@pytest.fixture(scope="module")
def cluster_job(tmp_path_factory):
    """One job, launched as a user launches a DDP script on the emulated cluster (``hvd-onebit
    cluster run --torchrun``: one torchrun per node); every rank runs the scenarios with Horovod
    blocked and pickles its results into the job's folder."""
    from hvd_onebit_tools.cluster.jobs import _collect

    target, timeout = "tests.cluster.ddp_workers:suite", 600
    workdir = tmp_path_factory.mktemp("ddp_cluster")
    (workdir / "kwargs.pkl").write_bytes(pickle.dumps({}))
    logs = workdir / "logs"
    run = hvd_onebit(["cluster", "run", "--np", str(NODES * PER_NODE),
                      "--ranks-per-node", str(PER_NODE),
                      "--bandwidth", "1gbit", "--torchrun", "--json", "--quiet",
                      "--log-dir", str(logs), "--timeout", str(timeout),
                      "--env", f"PYTHONPATH={REPO}", "--",
                      "-m", "hvd_onebit_tools.cluster.torchrun", target, str(workdir),
                      "--without-horovod"])
    if not run.stdout.startswith("{"):
        pytest.fail(f"cluster run exited {run.exit_code} without a report:\n{run.output[-4000:]}")
    report = json.loads(run.stdout)
    (workdir / "output.log").write_text("\n".join(
        f"--- node {k} (torchrun) output:\n{Path(r['log_path']).read_text(errors='replace')}"
        for k, r in enumerate(report["ranks"])))
    results = _collect(workdir, NODES * PER_NODE, report["returncode"], report["timed_out"],
                       timeout, target, "hvd-onebit cluster run --torchrun")
    return ClusterJob(report=report, results=results)


@pytest.fixture(scope="module")
def runs(cluster_job):
    return scenario(cluster_job.results, "hierarchical")


@needs_netns
@pytest.mark.multirank
def test_the_cli_runs_one_torchrun_per_node_and_each_rank_in_its_node(runs, cluster_job):
    report = cluster_job.report
    assert (report["np"], report["launches"], len(report["ranks"])) == \
        (NODES * PER_NODE, "node", NODES), {k: report[k] for k in ("np", "launches")}
    for node, launch in enumerate(report["ranks"]):
        assert (launch["exit_code"], launch["hostname"]) == (0, f"node{node}"), launch
        # each node's hosts file names its peers' addresses as the store's sockets see them
        log = Path(launch["log_path"]).read_text(errors="replace")
        unnamed = log.count("hostname of the client socket cannot be retrieved")
        assert unnamed == 0, f"node {node}'s torchrun warned {unnamed} times that a peer's " \
            f"address has no name"
    node0 = report["ranks"][0]["address"]
    for rank, r in enumerate(runs):
        node, local = divmod(rank, PER_NODE)
        assert r["environment"] == {"RANK": str(rank), "LOCAL_RANK": str(local),
                                    "LOCAL_WORLD_SIZE": str(PER_NODE), "GROUP_RANK": str(node),
                                    "WORLD_SIZE": str(NODES * PER_NODE), "MASTER_ADDR": node0}, \
            r["environment"]
        assert r["hostname"] == f"node{node}", f"rank {rank} ran on {r['hostname']}"
        assert r["topology"] == [NODES, PER_NODE, node, local], \
            f"rank {rank}: topology [nodes, per node, node, local] {r['topology']}"
        assert (r["kinds"], r["intra"]) == (["HierarchicalOneBitAllreduce"], ["shared_memory"]), \
            f"rank {rank}: collectives {r['kinds']} with the node's stages in {r['intra']}"


@needs_netns
@pytest.mark.multirank
def test_hierarchical_steps_are_the_engines_on_the_same_gradients(runs):
    for rank, r in enumerate(runs):
        assert r["phases"][FREEZE - 1:] == ["compression"] * (COMPRESSED + 1), r["phases"]
        assert r["buckets"] > 1, f"the momentum spans {r['buckets']} bucket(s)"
        assert r["finite"], f"rank {rank}: a parameter is not finite"
        assert r["face_vs_alone"] == [], \
            f"rank {rank}: the face and the hierarchical engine alone differ"
        assert r["digests"] == runs[0]["digests"], f"rank {rank} differs from rank 0"
        # the hierarchical collective ran: the flat engine takes other steps on the same inputs
        assert len(r["face_vs_flat"]) > 0, f"rank {rank}: hierarchical and flat steps agree"


@needs_netns
@pytest.mark.multirank
def test_the_links_between_nodes_carry_the_one_bit_bytes(runs):
    numel = runs[0]["numel"]
    for node in range(NODES):
        mine = runs[node * PER_NODE:(node + 1) * PER_NODE]
        warmup = mine[0]["tx"][:FREEZE]
        compressed = mine[0]["tx"][FREEZE:]
        # what the node's ranks sent between nodes, by the collective's own count: one bit per
        # element of the whole momentum per node, plus a scale per 512 elements (1/16 of the
        # bits) and padding
        payload = [sum(r["step_bytes"][s] for r in mine)
                   for s in range(FREEZE, FREEZE + COMPRESSED)]
        for step, (sent, counted) in enumerate(zip(compressed, payload)):
            assert numel / 8 <= counted <= 1.02 * (1 + 1 / 16) * numel / 8, \
                f"node {node} step {step}: {counted} bytes counted for {numel} elements"
            # the link's bytes are that payload with TCP/IP's headers and the steps' small
            # messages around it
            assert counted <= sent <= 1.5 * counted, \
                f"node {node} step {step}: the link sent {sent} bytes, the collective {counted}"
        # a full-precision step sends at least each element once each way between two nodes
        assert min(warmup) >= 4 * numel, f"node {node}: warmup steps sent {warmup}"
        ratio = min(warmup) / max(compressed)
        assert ratio >= WIRE_TARGET, \
            f"node {node}: DDP's steps sent {warmup}, the 1-bit steps {compressed} ({ratio:.1f}x)"


@needs_netns
@pytest.mark.multirank
def test_the_collective_on_torchruns_layout_matches_the_reference(cluster_job):
    results = scenario(cluster_job.results, "collective")
    ref = ReferenceHierarchical(COLLECTIVE_NUMEL, nodes=NODES, per_node=PER_NODE)
    for call in range(len(results[0]["outputs"])):
        want = ref.allreduce([rank_input(call, r, COLLECTIVE_NUMEL)
                              for r in range(NODES * PER_NODE)])
        for rank, r in enumerate(results):
            assert r["topology"] == [NODES, PER_NODE, *divmod(rank, PER_NODE)], r["topology"]
            assert r["intra"] == "shared_memory", f"rank {rank}: the node's stages in {r['intra']}"
            np.testing.assert_allclose(r["outputs"][call], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} call {call}")
            assert r["outputs"][call].tobytes() == results[0]["outputs"][call].tobytes(), \
                f"rank {rank} differs from rank 0 at call {call}"


@needs_netns
@pytest.mark.multirank
def test_an_uneven_node_layout_is_refused_on_every_rank(cluster_job):
    for rank, r in enumerate(scenario(cluster_job.results, "uneven")):
        assert r["refused"].startswith("ValueError") and "LOCAL_WORLD_SIZE" in r["refused"] \
            and "{0: 2, 1: 3}" in r["refused"], f"rank {rank}: {r['refused']}"
        assert r["after"] == "warmup", f"rank {rank}: the model took no face after the refusal"


def places(rows) -> list[Place]:
    return [Place(rank, *row) for rank, row in enumerate(rows)]


def test_torchruns_layouts_pass_and_others_are_named():
    assert layout_problems(places([(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]), 4) == []
    assert layout_problems(places([(0, 0, 1), (1, 0, 1), (2, 0, 1)]), 3) == []
    unset = layout_problems(places([(0, 0, 2), (None, 1, 2)]), 2)
    assert len(unset) == 1 and "rank(s) [1]" in unset[0] and "GROUP_RANK" in unset[0], unset
    uneven = layout_problems(places([(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)]), 4)
    assert len(uneven) == 1 and "{0: 3, 1: 1}" in uneven[0], uneven
    # a node's ranks not consecutive, which the subgroups cannot follow
    crossed = layout_problems(places([(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]), 4)
    assert len(crossed) == 1 and "numbered node by node" in crossed[0] \
        and "(1, 1, 0)" in crossed[0], crossed
    partial = layout_problems(places([(0, 0, 2), (0, 1, 2)]), 4)
    assert len(partial) == 1 and "2 of the job's 4 ranks" in partial[0], partial


def test_place_reads_torchruns_environment():
    env = {"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert Place.from_environment(2, env) == Place(2, 1, 0, 2)
    assert Place.from_environment(0, {"LOCAL_RANK": "x"}) == Place(0, None, None, None)
