"""The scale model (`hvd-onebit bench predict`) and its calibration (`bench calibrate`).

The arithmetic runs on a hand-made calibration whose constants make every term easy to check;
one test calibrates for real (a small model, loopback, 2 ranks) and compares a prediction with
`bench train`'s measurement under a loose bound: this machine's timings are noisy, and the tight
check is the benchmark `benchmarks/predict_check.py`.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_onebit_tools.bench.calibrate.compute import measure_compute
from hvd_onebit_tools.bench.calibrate.files import (CALIBRATION_VERSION, SHIPPED_PATH, CalibrationMissing,
                                             CalibrationInvalid, load, load_or_shipped, save)
from hvd_onebit_tools.bench.calibrate.run import disagreements
from hvd_onebit_tools.bench.predict.check import OtherModel, check_report, priced_intra_node
from hvd_onebit_tools.bench.predict.constants import (KINDS, OPS, TCP_EFFICIENCY, _bytes_per_rank,
                                                constants)
from hvd_onebit_tools.bench.predict.job import Cluster, Job, parse_params
from hvd_onebit_tools.bench.predict.model import GROUP_METHOD, HIERARCHICAL_NOTE, METHODS, Model
from hvd_onebit_tools.bench.predict.sweep import crossovers
from hvd_onebit_tools.bench.predict.tables import print_check
from hvd_onebit.config import DEFAULT_BLOCK_SIZE
from hvd_onebit.layout import Layout, ring_allreduce_bytes
from tests.cli import hvd_onebit

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "hvd_onebit_tools.cli", "bench"]
NUMEL, ROW = 1 << 20, 1 << 16


def fake_calibration(alpha=(1e-3, 2e-3), host_per_byte=1e-9, link_bps=10**9, overlap=0.5,
                     torch_alpha=(0.2e-3, 0.3e-3), torch_host_per_byte=2e-9):
    """Calibration measured at np = 2 and 4: tiny Horovod ops take alpha[n] (torch.distributed's:
    torch_alpha[n]), host cost per byte sent is ``host_per_byte`` (``torch_host_per_byte``) and
    on the shaped link (where the wire takes longer) ``overlap`` of it hides behind the wire."""
    coll = {}
    for n, a, ta in zip((2, 4), alpha, torch_alpha):
        unl, shaped = {}, {}
        for op in KINDS:
            unl[f"{op}_tiny"] = shaped[f"{op}_tiny"] = ta if op.startswith("torch_") else a
        for op in OPS:
            torch_op = op.startswith("torch_")
            nbytes = _bytes_per_rank(op, n, NUMEL, ROW)
            host = (torch_host_per_byte if torch_op else host_per_byte) * nbytes
            wire = nbytes * 8 / (link_bps * TCP_EFFICIENCY)
            unl[op] = (ta if torch_op else a) + host
            shaped[op] = (ta if torch_op else a) + wire + (1 - overlap) * host
        coll[str(n)] = {"unlimited": {"np": n, "numel": NUMEL, "row_bytes": ROW, "median_s": unl},
                        "1gbit": {"np": n, "numel": NUMEL, "row_bytes": ROW, "median_s": shaped}}
    model = {"params": 1_000_000, "step_s": 0.011, "fwd_bwd_s": 0.010, "adam_s": 0.002}
    kern = {"compress_momentum": 1e-9, "server": 0.5e-9, "decode_update": 1e-9,
            "add": 0.25e-9, "compress": 0.75e-9, "decode": 0.4e-9,
            "momentum_update": 1.5e-9, "compress_mean": 1.25e-9,
            "update": 2.5e-9}
    compute = {str(k): {"models": {"mlp": {**model, "fwd_bwd_s": 0.010 * k / 2 if k > 2 else 0.010}},
                        "kernel_s_per_elem": kern} for k in (1, 2, 4)}
    return {"version": CALIBRATION_VERSION, "cores": 2, "link": "1gbit",
            "link_bps": link_bps, "compute": compute, "collectives": coll}


def test_constants_recover_the_calibrated_terms():
    c = constants(fake_calibration())
    # a line through (n-1, alpha): 1 ms at n=2, 2 ms at n=4
    assert c["alpha_allreduce_per_peer_s"] == pytest.approx(0.5e-3)
    assert c["alpha_allreduce_s"] == pytest.approx(0.5e-3)
    # torch.distributed's ops: 0.2 ms at n=2, 0.3 ms at n=4
    for kind in ("torch_alltoall", "torch_allgather"):
        assert c[f"alpha_{kind}_per_peer_s"] == pytest.approx(0.05e-3)
        assert c[f"alpha_{kind}_s"] == pytest.approx(0.15e-3)
    for n in (2, 4):
        assert c[f"host_allreduce_fp32_s_per_byte@{n}"] == pytest.approx(1e-9)
        assert c[f"host_torch_alltoall_s_per_byte@{n}"] == pytest.approx(2e-9)
        assert c[f"kappa@{n}"] == pytest.approx(0.5)


def test_step_times_are_the_sum_of_their_terms():
    model = Model(fake_calibration())
    job = Job(params=1_000_000, model="mlp", warmup_frac=0.2)
    cl = Cluster(nodes=4, inter_bps=10**9)
    b = ring_allreduce_bytes(4 * job.params, 4)
    host = 1e-9 * b
    wire = b * 8 / (1e9 * TCP_EFFICIENCY)
    fp32 = model.predict("horovod_fp32", job, cl)
    assert fp32.phases["compute"] == pytest.approx(0.012)
    assert fp32.phases["allreduce_fp32"] == pytest.approx(2e-3 + wire + 0.5 * host)
    assert fp32.bytes_per_rank == b

    # flat 1-bit on transport='torch' (the default): torch.distributed's per-op and host costs
    onebit = model.predict("onebit", job, cl)
    layout = Layout.build(job.params, 4, DEFAULT_BLOCK_SIZE)  # the optimizer's rows
    sent = 3 * layout.row_bytes
    wire = sent * 8 / (1e9 * TCP_EFFICIENCY)
    assert onebit.bytes_per_rank == layout.wire_bytes
    assert onebit.phases["compute"] == pytest.approx(0.010)  # Adam's pass is replaced
    assert onebit.phases["alltoall"] == pytest.approx(0.3e-3 + wire + 0.5 * 2e-9 * sent)
    assert onebit.phases["allgather"] == pytest.approx(0.3e-3 + wire + 0.5 * 2e-9 * sent)
    assert onebit.phases["compress"] == pytest.approx(1e-3)
    assert onebit.phases["server"] == pytest.approx(0.5e-3)
    # on Horovod's transport: its costs
    hvd_onebit = Model(fake_calibration(), transport="horovod").predict("onebit", job, cl)
    stage = wire + 0.5 * 1e-9 * sent
    assert hvd_onebit.phases["alltoall"] == pytest.approx(2e-3 + stage)
    assert hvd_onebit.phases["allgather"] == pytest.approx(2e-3 + stage)
    assert hvd_onebit.step_s - onebit.step_s == pytest.approx(2 * (1.7e-3 - 0.5e-9 * sent))

    # link latency: 2 (n-1) steps in the ring, 1 in the alltoall, n-1 in the ring allgather
    cl_lat = Cluster(nodes=4, inter_bps=10**9, inter_latency_s=1e-4)
    assert model.predict("horovod_fp32", job, cl_lat).step_s - fp32.step_s == pytest.approx(6e-4)
    assert model.predict("onebit", job, cl_lat).step_s - onebit.step_s == pytest.approx(4e-4)

    rows = model.predict_all(job, cl)
    run = 0.2 * fp32.step_s + 0.8 * onebit.step_s
    assert rows["onebit"]["run_speedup_vs_fp32"] == pytest.approx(fp32.step_s / run)
    assert rows["onebit"]["warmup_step_s"] == pytest.approx(fp32.step_s)
    assert rows["onebit_hierarchical"]["notes"] == [
        f"{HIERARCHICAL_NOTE}; inside a node: the node links, unlimited"], \
        f"notes {rows['onebit_hierarchical']['notes']}"


@pytest.mark.parametrize("given, transport, intra_bps, priced", [
    ("auto", "torch", None, "shared_memory"),  # CPU ranks, as the library runs them
    ("auto", "torch", 100 * 10**9, "network"),  # the node's links given a rate: GPU nodes
    ("auto", "horovod", None, "network"),  # shared memory serves torch's transport only
    ("shared_memory", "torch", 10**9, "shared_memory"),
    ("network", "torch", None, "network"),
])
def test_intra_node_auto_prices_what_the_library_runs(given, transport, intra_bps, priced):
    got = priced_intra_node(given, transport, intra_bps)
    assert got == priced, (f"--intra-node {given} on {transport}, intra {intra_bps} bit/s: "
                           f"priced {got}, expected {priced}")
    with pytest.raises(ValueError, match="serves torch's transport only"):
        priced_intra_node("shared_memory", "horovod", None)


def test_hierarchical_follows_hierarchical_py_and_ranks_share_cores():
    # Horovod's transport: global ops, hvd_onebit/comm/hierarchical.py's way there
    model = Model(fake_calibration(), transport="horovod")
    job = Job(params=8_000_000, compute_s=0.1, adam_s=0.01)
    cl = Cluster(nodes=16, ranks_per_node=8, inter_bps=10**10, intra_bps=10**11)
    hier = model.predict("onebit_hierarchical", job, cl)
    P, S, n = 8_000_000, 1_000_000, 128
    # between nodes: the 1-bit two-stage allreduce of |m|/L among N = 16, for each of L ranks
    inter = Layout.build(S, 16, DEFAULT_BLOCK_SIZE)
    assert hier.inter_node_bytes_per_node == 8 * inter.wire_bytes
    # inside the node: the scatter and the gather send (L-1) shards of float32 each
    intra = 7 * S * 4
    assert hier.bytes_per_rank == 2 * intra + inter.wire_bytes
    # four Horovod alltoalls (with splits) of all n ranks: alpha = 0.5 ms + 0.5 ms x (n-1)
    a = model.alpha("alltoall", n)
    assert a == pytest.approx(0.5e-3 + 0.5e-3 * 127)
    intra_t = a + max(1e-9 * intra, intra * 8 / (1e11 * TCP_EFFICIENCY)) + 0.5 * min(
        1e-9 * intra, intra * 8 / (1e11 * TCP_EFFICIENCY))
    assert hier.phases["scatter"] == pytest.approx(intra_t)
    assert hier.phases["gather"] == pytest.approx(intra_t + 0.25e-9 * P)  # + the row copies
    sent = 15 * inter.row_bytes
    wire = 8 * sent * 8 / (1e10 * TCP_EFFICIENCY)  # the node's 8 ranks share its link
    assert hier.phases["alltoall"] == pytest.approx(a + wire + 0.5 * 1e-9 * sent)
    assert hier.phases["allgather"] == pytest.approx(hier.phases["alltoall"])
    # the native passes: momentum and commit over P; the node mean inside the shard's
    # compression (calibrated with 2 rows, an add of S per further row); kernels over S
    assert hier.phases["materialize"] == pytest.approx(1.5e-9 * P)
    assert "node_mean" not in hier.phases
    assert hier.phases["compress"] == pytest.approx(1.25e-9 * S + 0.25e-9 * 6 * S)
    assert hier.phases["server"] == pytest.approx(0.5e-9 * S)
    assert hier.phases["decode"] == pytest.approx(0.4e-9 * S)
    assert hier.phases["commit"] == pytest.approx(2.5e-9 * P)
    assert hier.phases["compute"] == pytest.approx(0.09)
    flat = model.predict("onebit", job, cl)
    fp32 = model.predict("horovod_fp32", job, cl)
    # the flat alltoall puts L (n-L) rows on a node's link: more than hierarchical's shard
    assert flat.inter_node_bytes_per_node > hier.inter_node_bytes_per_node
    assert fp32.inter_node_bytes_per_node > flat.inter_node_bytes_per_node
    # with collectives of their own groups each stage pays its group's per-op cost instead
    grp = Model(fake_calibration(), transport="horovod", hierarchical_global_ops=False)
    saved = hier.step_s - grp.predict("onebit_hierarchical", job, cl).step_s
    assert model.predict(GROUP_METHOD, job, cl).step_s == pytest.approx(hier.step_s - saved)
    assert model.hierarchical_global_ops, \
        f"hierarchical_global_ops not restored after the grouped prediction: " \
        f"{model.hierarchical_global_ops!r}"
    assert saved == pytest.approx(4 * a - 2 * model.alpha("alltoall", 8)
                                  - 2 * model.alpha("alltoall", 16))
    # colocated ranks compute at the speed calibrated with that many processes at once
    jm = Job(params=1_000_000, model="mlp")
    alone = model.compute(jm, Cluster(nodes=4))[0]
    shared = model.compute(jm, Cluster(nodes=4, colocated=True))[0]
    assert (alone, shared) == (pytest.approx(0.012), pytest.approx(0.022)), \
        f"compute seconds alone {alone}, colocated {shared}; expected 0.012 and 0.022"


def test_hierarchical_on_torch_groups_with_shared_memory_or_the_node_s_links():
    """transport='torch' (the library's default): the stages between nodes are torch.distributed
    collectives of the N ranks with one local rank; inside the node a barrier each through
    shared memory, or a torch alltoall / allgather of the node's ranks over its links."""
    job = Job(params=8_000_000, compute_s=0.1, adam_s=0.01)
    cl = Cluster(nodes=16, ranks_per_node=8, inter_bps=10**10, intra_bps=10**11)
    shm = Model(fake_calibration(), intra_node="shared_memory").predict(
        "onebit_hierarchical", job, cl)
    net = Model(fake_calibration()).predict("onebit_hierarchical", job, cl)
    model = Model(fake_calibration())
    P, S = 8_000_000, 1_000_000
    inter = Layout.build(S, 16, DEFAULT_BLOCK_SIZE)
    sent = 15 * inter.row_bytes
    wire = 8 * sent * 8 / (1e10 * TCP_EFFICIENCY)
    # stage 1: one latency step; torch's per-op cost of 16 ranks (0.15 ms + 0.05 ms x 15)
    a16 = model.alpha("torch_alltoall", 16)
    assert a16 == pytest.approx(0.15e-3 + 0.05e-3 * 15)
    assert shm.phases["alltoall"] == pytest.approx(a16 + wire + 0.5 * 2e-9 * sent)
    assert shm.phases["allgather"] == pytest.approx(
        model.alpha("torch_allgather", 16) + wire + 0.5 * 2e-9 * sent)
    # shared memory: a barrier of the node's 8 ranks for the scatter and the gather, no copy
    barrier = model.alpha("torch_allgather", 8)
    assert shm.phases["scatter"] == pytest.approx(barrier)
    assert shm.phases["gather"] == pytest.approx(barrier)
    assert shm.bytes_per_rank == inter.wire_bytes, "shared memory sends nothing on a link"
    # the node's links: a torch alltoall of (L-1) float32 shards, the same for the gather
    intra = 7 * S * 4
    t = model.alpha("torch_alltoall", 8) + max(2e-9 * intra, intra * 8 / (1e11 * TCP_EFFICIENCY)) \
        + 0.5 * min(2e-9 * intra, intra * 8 / (1e11 * TCP_EFFICIENCY))
    assert net.phases["scatter"] == pytest.approx(t)
    assert net.phases["gather"] == pytest.approx(t)
    assert net.bytes_per_rank == 2 * intra + inter.wire_bytes
    assert net.inter_node_bytes_per_node == shm.inter_node_bytes_per_node == 8 * inter.wire_bytes
    for name in ("materialize", "compress", "server", "decode", "commit", "compute"):
        assert shm.phases[name] == pytest.approx(net.phases[name]), name
    assert shm.step_s < net.step_s
    with pytest.raises(ValueError, match="intra_node must be one of"):
        Model(fake_calibration(), intra_node="nvlink")


def test_colocated_compute_prefers_the_figures_timed_inside_the_ranks():
    cal = fake_calibration()
    cal["collectives"]["4"]["unlimited"]["models"] = {
        "mlp": {"params": 1_000_000, "step_s": 0.03, "fwd_bwd_s": 0.025, "adam_s": 0.004}}
    model = Model(cal)
    job = Job(params=1_000_000, model="mlp")
    assert model.compute(job, Cluster(nodes=4, colocated=True)) == pytest.approx((0.029, 0.004))
    assert model.compute(job, Cluster(nodes=4, colocated=True), free_running=True)[0] == \
        pytest.approx(0.03)
    # np=2 is nearest the calibration's 2-rank job, which has none: the bare processes' figures
    assert model.compute(job, Cluster(nodes=2, colocated=True))[0] == pytest.approx(0.012)
    assert model.compute(job, Cluster(nodes=4))[0] == pytest.approx(0.012)  # a core each
    assert constants(cal)["mlp_fwd_bwd_ms@4ranks"] == pytest.approx(25)


def test_colocated_kernels_prefer_the_rates_timed_inside_the_ranks():
    """Version 6 times the kernels inside the calibration's Horovod ranks, in lock-step; a
    colocated prediction at that world size uses them, a version-5 file the bare processes'."""
    cal = fake_calibration()
    in_ranks = {name: 4 * rate for name, rate in
                cal["compute"]["2"]["kernel_s_per_elem"].items()}
    cal["collectives"]["2"]["unlimited"]["kernel_s_per_elem"] = in_ranks
    job = Job(params=1_000_000, model="mlp")
    model = Model(cal)
    two = model.predict("onebit", job, Cluster(nodes=2, colocated=True))
    assert two.phases["compress"] == pytest.approx(4e-9 * 1_000_000), two.phases
    assert two.phases["decode_update"] == pytest.approx(4e-9 * 1_000_000), two.phases
    # 4 ranks: that job timed none (a version-5 file): the bare processes' 4-process rates
    four = model.predict("onebit", job, Cluster(nodes=4, colocated=True))
    assert four.phases["compress"] == pytest.approx(1e-9 * 1_000_000), four.phases
    # not colocated: a core to itself, the one-process rates
    alone = model.predict("onebit", job, Cluster(nodes=2))
    assert alone.phases["compress"] == pytest.approx(1e-9 * 1_000_000), alone.phases
    assert constants(cal)["kernel_compress_momentum_ns_per_elem@2ranks"] == pytest.approx(4)


def test_fp16_of_a_calibrated_model_uses_its_own_gradients_cost():
    """Horovod's fp16 allreduce costs what it cost on the model's own gradient (float16
    subnormals are slow to convert and sum), not the random normal buffer's cost."""
    cal = fake_calibration()
    n, params = 4, 1_000_000
    nbytes = ring_allreduce_bytes(2 * params, n)
    alpha = cal["collectives"]["4"]["unlimited"]["median_s"]["allreduce_tiny"]
    cal["collectives"]["4"]["unlimited"]["models"] = {
        "mlp": {"params": params, "step_s": 0.03, "fwd_bwd_s": 0.025, "adam_s": 0.004,
                "fp16_allreduce_s": alpha + 5e-9 * nbytes}}  # 5x the random buffer's 1e-9
    model = Model(cal)
    cl = Cluster(nodes=4, inter_bps=None, colocated=True)  # unshaped: alpha + host
    own = model.predict("horovod_fp16", Job(params=params, model="mlp"), cl)
    assert own.phases["allreduce_fp16"] == pytest.approx(alpha + 5e-9 * nbytes), own.phases
    # no model named (or a version-4 calibration without the figure): the random buffer's cost
    generic = model.predict("horovod_fp16", Job(params=params, compute_s=0.03), cl)
    assert generic.phases["allreduce_fp16"] == pytest.approx(alpha + 1e-9 * nbytes), \
        generic.phases
    # fp32 is not affected by the model's fp16 figure
    fp32 = model.predict("horovod_fp32", Job(params=params, model="mlp"), cl)
    assert fp32.phases["allreduce_fp32"] == pytest.approx(
        alpha + 1e-9 * ring_allreduce_bytes(4 * params, n)), fp32.phases
    assert constants(cal)["mlp_fp16_allreduce_ms@4ranks"] == pytest.approx(
        (alpha + 5e-9 * nbytes) * 1e3)


def test_fp16_allreduce_has_its_own_overlap_of_host_and_wire():
    """Compression.fp16 casts the whole buffer before and after the allreduce, outside the
    ring's pipeline: its share of host time not hidden behind the wire (kappa) is measured on
    the shaped link for the fp16 allreduce itself, and the fp32 ring keeps its own."""
    cal = fake_calibration(overlap=0.5)
    n, alpha = 4, 2e-3
    fp16_bytes = _bytes_per_rank("allreduce_fp16", n, NUMEL, ROW)
    host = 1e-9 * fp16_bytes
    wire = fp16_bytes * 8 / (10**9 * TCP_EFFICIENCY)
    # the fp16 allreduce on the shaped link hid none of its host time (kappa 1)
    cal["collectives"]["4"]["1gbit"]["median_s"]["allreduce_fp16"] = alpha + wire + host
    c = constants(cal)
    assert c["kappa_allreduce_fp16@4"] == pytest.approx(1.0), c
    assert c["kappa@4"] == pytest.approx(0.5), f"kappa@4 {c['kappa@4']}, expected 0.5: {c}"
    assert c["kappa_allreduce_fp16@2"] == pytest.approx(0.5), \
        f"kappa_allreduce_fp16@2 {c['kappa_allreduce_fp16@2']}, expected 0.5: {c}"
    model = Model(cal)
    cl = Cluster(nodes=4, inter_bps=10**9, colocated=True)
    params = 1_000_000
    b16 = ring_allreduce_bytes(2 * params, n)
    fp16 = model.predict("horovod_fp16", Job(params=params, compute_s=0.03), cl)
    w16 = b16 * 8 / (1e9 * TCP_EFFICIENCY)
    assert fp16.phases["allreduce_fp16"] == pytest.approx(
        alpha + max(w16, 1e-9 * b16) + 1.0 * min(w16, 1e-9 * b16)), fp16.phases
    fp32 = model.predict("horovod_fp32", Job(params=params, compute_s=0.03), cl)
    b32 = ring_allreduce_bytes(4 * params, n)
    w32 = b32 * 8 / (1e9 * TCP_EFFICIENCY)
    assert fp32.phases["allreduce_fp32"] == pytest.approx(
        alpha + max(w32, 1e-9 * b32) + 0.5 * min(w32, 1e-9 * b32)), fp32.phases
    # a calibration whose shaped links did not time the fp16 allreduce: fp16 takes the ring's
    for runs in cal["collectives"].values():
        del runs["1gbit"]["median_s"]["allreduce_fp16"]
    c = constants(cal)
    assert "kappa_allreduce_fp16@4" not in c, c
    unmeasured = Model(cal).predict("horovod_fp16", Job(params=params, compute_s=0.03), cl)
    assert unmeasured.phases["allreduce_fp16"] == pytest.approx(
        alpha + max(w16, 1e-9 * b16) + 0.5 * min(w16, 1e-9 * b16)), unmeasured.phases


def test_a_version_2_calibration_predicts_on_horovods_transport_only():
    cal = fake_calibration()
    cal["version"] = 2
    for runs in cal["collectives"].values():
        for row in runs.values():
            row["median_s"] = {k: v for k, v in row["median_s"].items()
                               if not k.startswith("torch_")}
    job = Job(params=1_000_000, model="mlp")
    cl = Cluster(nodes=4)
    assert Model(cal, transport="horovod").predict("onebit", job, cl).step_s > 0
    with pytest.raises(ValueError, match="--transport horovod"):
        Model(cal).predict("onebit", job, cl)


def test_crossovers_find_where_flat_stops_paying():
    rows = [{"np": n, "inter_bps": 1e10, "methods": {
        "onebit": {"run_speedup_vs_fp32": s, "run_step_s": 1 / s},
        "onebit_hierarchical": {"run_speedup_vs_fp32": h, "run_step_s": 1 / h}}}
        for n, s, h in ((8, 0.9, 0.8), (16, 3.0, 2.0), (64, 1.5, 2.5), (512, 0.8, 2.0),
                        (1024, 0.5, 1.0))]
    # from n on for good: the dip at 8 (one node) is not a crossover
    assert crossovers(rows) == {"10000000000.0": {"flat_onebit_stops_paying_at": 512,
                                                  "hierarchical_beats_flat_from": 64}}
    assert parse_params("350M") == 350_000_000, parse_params("350M")
    assert parse_params("9.4e6") == 9_400_000, parse_params("9.4e6")
    assert parse_params("437,760") == 437_760, parse_params("437,760")  # as the tables print it
    for decimal_comma in ("1,5M", "2,5e6", "1,,0"):
        with pytest.raises(ValueError, match="commas only between groups of three digits"):
            parse_params(decimal_comma)
    assert parse_params("1.1M") == 1_100_000, parse_params("1.1M")  # 1.1 * 1e6 rounds off
    for fraction in ("1.5", "0.0025k"):  # 1.5 and 2.5 parameters: not taken as 1 and 2
        with pytest.raises(ValueError, match="a parameter count is a whole number"):
            parse_params(fraction)


def test_the_crossover_line_says_when_a_crossing_is_not_in_the_sweep(tmp_path):
    path = save(fake_calibration(), tmp_path / "cal.json")
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--np", "4,8", "--bandwidth", "100gbit",
                       "--json"])
    assert proc.exit_code == 0, proc.output
    crossing = json.loads(proc.stdout)["crossovers"]["100000000000"]
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--np", "4,8", "--bandwidth", "100gbit"])
    *_, line, pricing = proc.stdout.splitlines()
    assert "None" not in line and line.startswith("link 100 Gbit/s: "), line
    assert pricing.startswith("priced at the calibration's CPU speeds") and \
        "torch.add 4.00 G elements/s" in pricing and "--kernel-speedup" in pricing, pricing
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--np", "4,8", "--bandwidth", "100gbit",
                       "--kernel-speedup", "10"])
    assert proc.stdout.splitlines()[-1].startswith("link 100 Gbit/s: "), \
        f"a priced speed-up still printed the CPU note: {proc.stdout.splitlines()[-1]!r}"
    for key, never in (("flat_onebit_stops_paying_at", "flat 1-bit pays at every n up to n=8"),
                       ("hierarchical_beats_flat_from",
                        "hierarchical does not beat flat up to n=8")):
        expected = never if crossing[key] is None else f"from n={crossing[key]}"
        assert expected in line, f"{key} = {crossing[key]}: expected {expected!r} in {line!r}"


def test_the_crossover_line_says_by_how_much_hierarchical_wins_there(tmp_path):
    """A crossing's margin, so that one of a few percent reads as the tie it is within the
    model's error."""
    path = save(fake_calibration(), tmp_path / "cal.json")
    args = ["bench", "predict", "--calibration", str(path), "--params", "350M", "--compute-ms",
            "100", "--np", "8,16", "--ranks-per-node", "8", "--bandwidth", "1gbit"]
    report = json.loads(hvd_onebit(args + ["--json"]).stdout)
    n = report["crossovers"]["1000000000"]["hierarchical_beats_flat_from"]
    assert n == 16, f"the fake calibration's crossing moved: {report['crossovers']}"
    ms = next(r["methods"] for r in report["rows"] if r["np"] == n)
    # over the run the table heads with, the refresh setting's (not the fixed warmup's)
    margin = (ms["onebit"]["run_refresh"]["run_s"]
              / ms["onebit_hierarchical"]["run_refresh"]["run_s"] - 1)
    fixed = ms["onebit"]["run_step_s"] / ms["onebit_hierarchical"]["run_step_s"] - 1
    out = hvd_onebit(args).stdout.splitlines()
    line = out[-2]
    assert "8 ranks per node, sharing its link" in out[0], f"the head says {out[0]!r}"
    assert f"hierarchical beats flat from n=16 (by {margin:.0%} over the run there)" in line \
        and f"{margin:.0%}" != f"{fixed:.0%}", \
        f"margin {margin:.3f} (the fixed warmup's {fixed:.3f}): {line!r}"


def test_calibration_round_trip_and_clear_errors(tmp_path):
    cal = fake_calibration()
    path = save(cal, tmp_path / "sub" / "cal.json")
    assert load(path) == json.loads(json.dumps(cal))
    with pytest.raises(CalibrationMissing, match="bench calibrate"):
        load(tmp_path / "missing.json")
    (tmp_path / "old.json").write_text(json.dumps({**cal, "version": 0}))
    with pytest.raises(ValueError, match="version"):
        load(tmp_path / "old.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ValueError, match=r"text\.json is not JSON"):
        load(tmp_path / "text.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list\.json holds a JSON list"):
        load(tmp_path / "list.json")
    # the CLI: a clear error without a file; JSON and a plot with one
    proc = hvd_onebit(["bench", "predict", "--calibration", str(tmp_path / "missing.json"),
                       "--model", "mlp"])
    assert proc.exit_code != 0 and "bench calibrate" in proc.stderr, \
        f"predict without a calibration exited with {proc.exit_code}, stderr {proc.stderr!r} " \
        f"(expected a failure that names 'bench calibrate')"
    plot = tmp_path / "sweep.png"
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--np", "8,64,512", "--ranks-per-node", "8",
                       "--bandwidth", "10gbit,100gbit", "--latency-us", "5", "--plot", str(plot),
                       "--json"])
    assert proc.exit_code == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert plot.stat().st_size > 0, f"the plot {plot} is {plot.stat().st_size} bytes"
    assert len(report["rows"]) == 6, f"{len(report['rows'])} rows, expected 6: {report['rows']}"
    assert set(report["rows"][0]["methods"]) == set(METHODS)
    # the defaults price what transport='auto' and intra_node='auto' run on CPU ranks
    assert report["note"] == f"{HIERARCHICAL_NOTE}; inside a node: shared memory", \
        f"note {report['note']!r}"
    got = {k: report["inputs"][k] for k in ("transport", "intra_node")}
    assert got == {"transport": "torch", "intra_node": "shared_memory"}, f"inputs {got}"


def test_predict_without_a_cached_calibration_uses_the_one_installed_with_the_tools(
        tmp_path, monkeypatch):
    """`bench predict` with nothing in the cache (HOME an empty folder, so ~/.cache/hvd_onebit/
    has no calibration.json) predicts from the package's predict_calibration.json and says so on
    stderr, naming the file and `hvd-onebit bench calibrate`; a calibration in the cache comes
    first."""
    shipped = REPO / "hvd_onebit_tools" / "bench" / "calibrate" / "predict_calibration.json"
    assert SHIPPED_PATH == shipped, f"SHIPPED_PATH is {SHIPPED_PATH}, the package file {shipped}"
    args = ["bench", "predict", "--model", "mlp", "--np", "4,16", "--bandwidth", "1gbit", "--json"]
    env = {"HOME": str(tmp_path)}
    proc = hvd_onebit(args, env=env)
    assert proc.exit_code == 0, f"exit {proc.exit_code} with an empty cache:\n{proc.stderr}"
    assert str(shipped) in proc.stderr and "hvd-onebit bench calibrate" in proc.stderr, (
        f"stderr does not name {shipped} and `hvd-onebit bench calibrate`:\n{proc.stderr}")
    report = json.loads(proc.stdout)
    # the same report as with --calibration naming the installed file
    docs = json.loads(shipped.read_text())
    explicit = hvd_onebit(args + ["--calibration", str(shipped)], env=env)
    assert explicit.exit_code == 0, explicit.stderr
    assert "no calibration at" not in explicit.stderr, (
        f"a note with --calibration given:\n{explicit.stderr}")
    assert report == json.loads(explicit.stdout), "the fallback's report differs from the docs'"
    assert report["calibration"] == docs["machine"], (report["calibration"], docs["machine"])
    mlp_params = docs["compute"]["1"]["models"]["mlp"]["params"]
    assert report["inputs"]["params"] == mlp_params, (
        f"{report['inputs']['params']} parameters, the docs' mlp has {mlp_params}")
    assert not (tmp_path / ".cache").exists(), "predict wrote to the cache"

    # in-process: the note, then the cache's own calibration first, silently
    monkeypatch.setenv("HOME", str(tmp_path))
    notes = []
    assert load_or_shipped(None, note=notes.append) == docs, "not the docs calibration"
    assert len(notes) == 1 and str(shipped) in notes[0], notes
    cached = fake_calibration()
    save(cached, tmp_path / ".cache" / "hvd_onebit" / "calibration.json")
    notes.clear()
    assert load_or_shipped(None, note=notes.append) == json.loads(json.dumps(cached)), (
        "the cache's calibration was not preferred to the docs'")
    assert notes == [], f"a note with a calibration in the cache: {notes}"
    with pytest.raises(CalibrationMissing, match="bench calibrate"):
        load_or_shipped(tmp_path / "missing.json")  # a path given is never replaced


def test_check_pairs_predictions_with_a_train_report():
    cal = fake_calibration()
    rows = [{"method": "local", "np": 4, "params": 1_000_000, "all_step_s": 0.02},
            {"method": "onebit", "np": 4, "params": 1_000_000, "warmup_step_s": 0.1,
             "compression_step_s": 0.05}]
    report = {"bandwidth": "1gbit", "config": {"model": "mlp", "warmup_frac": 0.2}, "rows": rows}
    result = check_report([report, report], cal)
    pairs = {(p["method"], p["phase"]): p for p in result["pairs"]}
    assert set(pairs) == {("local", "all"), ("onebit", "warmup"), ("onebit", "compression")}
    assert pairs[("local", "all")]["predicted_s"] == pytest.approx(0.011)  # the free-running step
    assert not pairs[("local", "all")]["within"], \
        f"0.011 s predicted for 0.02 s measured (0.55) counted as within: {pairs[('local', 'all')]}"
    assert pairs[("onebit", "compression")]["bound"] == 0.15, pairs[("onebit", "compression")]
    assert pairs[("local", "all")]["runs"] == 2, pairs[("local", "all")]
    # the counts: every pair; the methods' (local is the compute input); the compressed steps'
    methods = [p for p in result["pairs"] if p["method"] != "local"]
    assert (result["met"], result["total"]) == (sum(p["within"] for p in result["pairs"]), 3)
    assert (result["methods_met"], result["methods_total"]) == (
        sum(p["within"] for p in methods), 2), result
    assert (result["compressed_met"], result["compressed_total"]) == (
        int(pairs[("onebit", "compression")]["within"]), 1), result
    # transport 'auto' ran torch.distributed: predicted with its constants
    torch_step = Model(cal).predict("onebit", Job(params=1_000_000, model="mlp"),
                                    Cluster(nodes=4, inter_bps=10**9, colocated=True))
    assert pairs[("onebit", "compression")]["predicted_s"] == pytest.approx(torch_step.step_s)
    assert pairs[("onebit", "compression")]["transport"] == "torch"
    assert pairs[("onebit", "compression")]["predicted_phases_s"] == torch_step.phases

    # the DDP face's runs (bench train's ddp_* methods), priced as the Horovod face's
    ddp_rows = [{"method": "ddp_adam", "np": 4, "params": 1_000_000, "all_step_s": 0.2},
                {"method": "ddp_onebit", "np": 4, "params": 1_000_000, "warmup_step_s": 0.2,
                 "compression_step_s": 0.05}]
    ddp = {(p["method"], p["phase"]): p
           for p in check_report([{**report, "rows": rows + ddp_rows}], cal)["pairs"]}
    assert {("ddp_adam", "all"), ("ddp_onebit", "warmup"), ("ddp_onebit", "compression")} \
        <= set(ddp), f"the DDP runs were not compared: {sorted(ddp)}"
    fp32 = Model(cal).predict("horovod_fp32", Job(params=1_000_000, model="mlp"),
                              Cluster(nodes=4, inter_bps=10**9, colocated=True))
    assert ddp[("ddp_adam", "all")]["predicted_s"] == pytest.approx(fp32.step_s)
    assert ddp[("ddp_onebit", "compression")]["predicted_s"] == pytest.approx(torch_step.step_s)
    assert (ddp[("ddp_onebit", "compression")]["bound"],
            ddp[("ddp_onebit", "compression")]["transport"]) == (0.15, "torch")

    # bench train --np 4 --ranks-per-node 2 --transport horovod, with onebit_hierarchical
    hier_rows = rows + [{"method": "onebit_hierarchical", "np": 4, "params": 1_000_000,
                         "warmup_step_s": 0.1, "compression_step_s": 0.06,
                         "compression_breakdown_s": {"wait": 0.03, "decode": 0.01}}]
    hier_report = {"bandwidth": "1gbit", "ranks_per_node": 2, "rows": hier_rows,
                   "config": {"model": "mlp", "warmup_frac": 0.2, "transport": "horovod"}}
    result = check_report([hier_report], cal)
    pairs = {(p["method"], p["phase"]): p for p in result["pairs"]}
    cl = Cluster(nodes=2, ranks_per_node=2, inter_bps=10**9, colocated=True)
    job = Job(params=1_000_000, model="mlp")
    hvd_model = Model(cal, transport="horovod")
    assert pairs[("onebit_hierarchical", "compression")]["predicted_s"] == pytest.approx(
        hvd_model.predict("onebit_hierarchical", job, cl).step_s)
    assert pairs[("onebit", "compression")]["predicted_s"] == pytest.approx(
        hvd_model.predict("onebit", job, cl).step_s)
    assert pairs[("onebit_hierarchical", "compression")]["measured_breakdown_s"] == {"wait": 0.03,
                                                                           "decode": 0.01}
    assert pairs[("onebit_hierarchical", "compression")]["bound"] == 0.25
    assert {p["ranks_per_node"] for p in result["pairs"]} == {2}


def test_small_prediction_against_measurement_on_loopback():
    """Calibrate a small MLP and the kernels (in bare processes and inside the Horovod ranks,
    which a colocated prediction uses) and the collectives at np=2 on loopback, then pair the
    predictions with bench train's measured steps there: every pair is made, finite and
    positive. How close they are is a timing, measured by benchmarks/predict_check.py, not
    asserted here (steps of a few ms on a shared 2-core machine swing with whatever else runs).
    The kernels inside the ranks are timed on the calibration's own buffer size: their lock-step
    time is a barrier-to-barrier time less an empty barrier's, and on a small buffer the fastest
    kernels take less than that difference's noise."""
    from hvd_onebit_tools.bench.train import MALLOC_REUSE_ENV
    from hvd_onebit_tools.cluster.jobs import run_job

    small = {"mlp": {"model": "mlp", "width": 1024, "depth": 2, "batch": 4}}
    compute = measure_compute(procs=(2,), models=small, kernel_numel=1 << 18, repeats=3,
                              seconds=0.5)
    coll = run_job("hvd_onebit_tools.bench.calibrate.ranks:collectives_worker", np=2,
                   kwargs={"numel": 1 << 20, "repeats": 5, "tiny_repeats": 9, "models": small},
                   timeout=180, env=MALLOC_REUSE_ENV).results[0]
    assert set(coll["models"]["mlp"]) == {"params", "step_s", "fwd_bwd_s", "adam_s",
                                          "fp16_allreduce_s"}
    params = compute["2"]["models"]["mlp"]["params"]
    assert isinstance(params, int), f"the 2-process parameter count is {params!r}, not an int"
    # every kernel the bare processes time is timed inside the ranks too
    assert set(coll["kernel_s_per_elem"]) == set(compute["2"]["kernel_s_per_elem"]), coll
    assert min(coll["kernel_s_per_elem"].values()) > 0, coll["kernel_s_per_elem"]
    # the fp16 allreduce of the model's own gradient costs at least a tiny allreduce
    assert coll["models"]["mlp"]["fp16_allreduce_s"] > coll["median_s"]["allreduce_tiny"], coll
    cal = {"version": CALIBRATION_VERSION, "cores": 2, "link": None, "link_bps": None,
           "compute": compute, "collectives": {"2": {"unlimited": coll}}}
    proc = subprocess.run(CLI + ["train", "--np", "2", "--bandwidth", "local", "--model", "mlp",
                                 "--width", "1024", "--depth", "2", "--steps", "12",
                                 "--methods", "local,horovod_fp32,onebit", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = check_report([json.loads(proc.stdout)], cal)
    print_check(result, echo=print)
    pairs = {(p["method"], p["phase"]): p for p in result["pairs"]}
    assert len(pairs) == 4, f"{len(pairs)} (method, phase) pairs, expected 4: {sorted(pairs)}"
    bad = {k: p["predicted_s"] for k, p in pairs.items() if not math.isfinite(p["predicted_s"])}
    assert not bad, f"non-finite predictions (seconds) for {bad}"
    for key in (("horovod_fp32", "all"), ("onebit", "compression")):
        assert math.isfinite(pairs[key]["ratio"]) and pairs[key]["ratio"] > 0, pairs[key]
        assert pairs[key]["measured_s"] > 0 and pairs[key]["predicted_s"] > 0, pairs[key]


def test_the_rows_are_priced_at_the_optimizers_block_size():
    """The 1-bit bytes are those of the rows the optimizer sends: a scale per
    ``block_size`` elements by default (its default), one per chunk with ``block_size=None``."""
    job = Job(params=8_000_000, compute_s=0.1, adam_s=0.01)
    cl = Cluster(nodes=4, inter_bps=10**9)
    got = {b: Model(fake_calibration(), block_size=b).predict("onebit", job, cl).bytes_per_rank
           for b in (DEFAULT_BLOCK_SIZE, None, 2048)}
    want = {b: Layout.build(job.params, 4, b).wire_bytes for b in got}
    assert got == want, f"bytes per rank by block size: {got}, the layouts': {want}"
    assert Model(fake_calibration()).block_size == DEFAULT_BLOCK_SIZE
    assert got[DEFAULT_BLOCK_SIZE] > got[2048] > got[None], got


@pytest.mark.parametrize("where, value, field", [
    (("compute", "1", "models", "mlp", "step_s"), -2.0, "compute['1']['models']['mlp']['step_s']"),
    (("compute", "2", "models", "mlp", "params"), 0, "compute['2']['models']['mlp']['params']"),
    (("compute", "1", "kernel_s_per_elem", "server"), "fast",
     "compute['1']['kernel_s_per_elem']['server']"),
    (("collectives", "2", "1gbit", "median_s", "allreduce_fp32"), "slow",
     "collectives['2']['1gbit']['median_s']['allreduce_fp32']"),
    (("collectives", "4", "unlimited", "numel"), 0, "collectives['4']['unlimited']['numel']"),
    (("link_bps",), 0, "link_bps"),
    (("cores",), -1, "cores")])
def test_a_calibration_the_model_cannot_use_is_refused_naming_the_field(tmp_path, where, value,
                                                                        field):
    """A time below zero, a count or link rate of zero, a string for a number: `bench predict`
    stops with one line naming the field and its value (as it does for a missing file), not a
    negative step time or a TypeError."""
    cal = fake_calibration()
    inner = cal
    for key in where[:-1]:
        inner = inner[key]
    inner[where[-1]] = value
    path = save(cal, tmp_path / "cal.json")
    with pytest.raises(CalibrationInvalid) as info:
        load(path)
    assert field in str(info.value) and repr(value) in str(info.value), \
        f"{field} = {value!r}: the error does not name both: {info.value}"
    for args in (["--params", "8M", "--compute-ms", "50"], ["--model", "mlp", "--colocated"]):
        proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--np", "4", *args])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
        assert proc.exit_code == 1 and errors and field in errors[0], \
            f"{field} = {value!r}, {args}: exit {proc.exit_code}, output:\n{proc.output}"
        assert isinstance(proc.exception, SystemExit), \
            f"{field} = {value!r}: {proc.exception!r} escaped as a traceback"


def test_parameter_counts_load_as_ints_and_the_shipped_file_stores_ints(tmp_path):
    cal = fake_calibration()
    cal["compute"]["2"]["models"]["mlp"]["params"] = 1_000_000.0
    got = load(save(cal, tmp_path / "cal.json"))["compute"]["2"]["models"]["mlp"]["params"]
    assert isinstance(got, int) and got == 1_000_000, f"a count stored as 1000000.0 loads as {got!r}"
    shipped = json.loads(SHIPPED_PATH.read_text())
    floats = {k: m["params"] for k, group in shipped["compute"].items()
              for name, m in group["models"].items() if not isinstance(m["params"], int)}
    assert not floats, f"the shipped calibration stores parameter counts as floats: {floats}"


def test_calibration_warns_where_a_free_step_and_its_phases_disagree_with_a_core_each():
    """The same work timed free-running and in lock-step: with a core per process the figures
    agree unless something else took the cores; beyond the cores they need not."""
    compute = {"1": {"models": {"mlp": {"step_s": 0.010, "fwd_bwd_s": 0.006, "adam_s": 0.005}}},
               "2": {"models": {"mlp": {"step_s": 0.050, "fwd_bwd_s": 0.006, "adam_s": 0.005}}},
               "4": {"models": {"mlp": {"step_s": 0.050, "fwd_bwd_s": 0.006, "adam_s": 0.005}}}}
    lines = disagreements(compute, cores=2)
    assert len(lines) == 1 and "mlp with 2 process(es)" in lines[0] and "50.0 ms" in lines[0], \
        f"with 2 cores, a 50 ms step against 11 ms of phases at 2 processes: {lines}"


def shaped_calibration():
    """The hand-made calibration with the shape its mlp was timed at, as `bench calibrate`
    records it."""
    cal = fake_calibration()
    cal["bench_models"] = {"mlp": {"model": "mlp", "width": 2048, "depth": 3, "batch": 4}}
    return cal


def train_run(width: int, params: int) -> dict:
    """A `bench train --json` report of an mlp run at 4 ranks on 1gbit."""
    rows = [{"method": "local", "np": 4, "params": params, "all_step_s": 0.004},
            {"method": "horovod_fp32", "np": 4, "params": params, "all_step_s": 0.03},
            {"method": "onebit", "np": 4, "params": params, "warmup_step_s": 0.03,
             "compression_step_s": 0.01}]
    return {"bandwidth": "1gbit", "rows": rows,
            "config": {"model": "mlp", "width": width, "depth": 3, "batch": 4,
                       "vocab": 32768, "warmup_frac": 0.2}}


def test_check_prices_a_run_of_the_calibrated_shape_with_its_figures():
    """`local` is predicted with the free-running step, every step with collectives with the
    lock-step phases (forward + backward and Adam), as `bench predict --model` prices them."""
    cal = shaped_calibration()
    pairs = {(p["method"], p["phase"]): p
             for p in check_report([train_run(2048, 1_000_000)], cal)["pairs"]}
    local, fp32 = pairs[("local", "all")], pairs[("horovod_fp32", "all")]
    timed = cal["compute"]["4"]["models"]["mlp"]  # 4 colocated ranks: 4 processes at once
    assert local["predicted_s"] == pytest.approx(timed["step_s"]), \
        f"local predicted {local['predicted_s']} s, the free-running step is {timed['step_s']} s"
    phases = timed["fwd_bwd_s"] + timed["adam_s"]
    assert fp32["predicted_phases_s"]["compute"] == pytest.approx(phases), \
        f"fp32 compute {fp32['predicted_phases_s']} s, fwd_bwd_s + adam_s is {phases} s"
    job = Job(params=1_000_000, model="mlp")
    cl = Cluster(nodes=4, colocated=True)
    assert Model(cal).compute(job, cl)[0] == pytest.approx(phases), \
        f"bench predict --model prices {Model(cal).compute(job, cl)[0]} s, --check {phases} s"


def test_check_pairs_the_defaults_steps_with_flat_one_bits_and_a_refresh_with_fp32():
    """`onebit_refresh` (the library's defaults) takes flat 1-bit's warmup and compressed steps,
    and a refresh step is priced as a full-precision one, as the whole-run figures price it;
    each pair counts the steps its medians were taken over."""
    run = train_run(2048, 1_000_000)
    run["rows"].append({"method": "onebit_refresh", "np": 4, "params": 1_000_000,
                        "warmup_step_s": 0.05, "warmup_timed_steps": 2,
                        "compression_step_s": 0.01, "compression_timed_steps": 30,
                        "refresh_step_s": 0.04, "refresh_timed_steps": 7})
    pairs = {(p["method"], p["phase"]): p
             for p in check_report([run], shaped_calibration())["pairs"]}
    fp32 = pairs[("horovod_fp32", "all")]["predicted_s"]
    got = {phase: (pairs[("onebit_refresh", phase)]["predicted_s"],
                   pairs[("onebit_refresh", phase)]["timed_steps"])
           for phase in ("warmup", "compression", "refresh")}
    assert got == {"warmup": (fp32, 2), "refresh": (fp32, 7),
                   "compression": (pairs[("onebit", "compression")]["predicted_s"], 30)}, got


def test_check_refuses_a_run_of_another_size_naming_what_differs(tmp_path):
    """A run at --width 256 (another parameter count) against a calibration that timed the mlp
    at width 2048: refused with what differs and what to pass, in process and on the command
    line; with --compute-ms the run is priced with the compute given."""
    cal = shaped_calibration()
    run = train_run(256, 200_000)
    with pytest.raises(OtherModel) as info:
        check_report([run], cal)
    text = str(info.value)
    for words in ("--width 256 (calibrated: 2048)", "200,000 parameters (calibrated: 1,000,000)",
                  "local step measured 4.00 ms", "--compute-ms", "--adam-ms"):
        assert words in text, f"{words!r} missing from the refusal: {text}"
    # the same parameter count at another shape is another model too
    with pytest.raises(OtherModel, match=r"--width 1024 \(calibrated: 2048\)"):
        check_report([train_run(1024, 1_000_000)], cal)
    # named by the flag bench train documents
    other_batch = train_run(2048, 1_000_000)
    other_batch["config"]["batch"] = 8
    with pytest.raises(OtherModel, match=r"--batch-size 8 \(calibrated: 4\)"):
        check_report([other_batch], cal)

    path = save(cal, tmp_path / "cal.json")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "train_small.json").write_text(json.dumps(run))
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--check", str(runs)])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert proc.exit_code == 1 and errors and "--width 256 (calibrated: 2048)" in errors[0], \
        f"--check of a width-256 run: exit {proc.exit_code}, output:\n{proc.output}"
    assert "pairs within their bound" not in proc.stdout, \
        f"pairs were printed for another model's compute:\n{proc.stdout}"

    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--check", str(runs),
                       "--compute-ms", "4", "--adam-ms", "1", "--json"])
    assert proc.exit_code == 0, proc.output
    result = json.loads(proc.stdout)
    pairs = {(p["method"], p["phase"]): p for p in result["pairs"]}
    assert result["compute"] == "given", result["compute"]
    assert pairs[("local", "all")]["predicted_s"] == pytest.approx(0.004), \
        f"local predicted {pairs[('local', 'all')]['predicted_s']} s with --compute-ms 4"
    compressed = pairs[("onebit", "compression")]["predicted_phases_s"]["compute"]
    assert compressed == pytest.approx(0.003), \
        f"compressed step's compute {compressed} s: 4 ms less --adam-ms 1 is 0.003 s"


@pytest.mark.parametrize("args, option, text", [
    (["--np", "1"], "--np", "1: a collectives job needs 2 or more ranks"),
    (["--np", "3"], "--numel", "4,194,304 elements do not split evenly over [3]"),
    (["--np", "2"], "--np", "2: the per-peer cost of each op is the slope of its time against "
                            "the world size, which one world size cannot give"),
    (["--numel", "0"], "--numel", "'0' is not a positive element count"),
    (["--numel", "abc"], "--numel", "'abc' is not a positive element count"),
    (["--repeats", "0"], "--repeats", "0 is not in the range x>=1"),
    (["--repeats", "-3"], "--repeats", "-3 is not in the range x>=1"),
    (["--procs", "0"], "--procs", "'0': process counts are 1 or more"),
    (["--procs", "1,-2"], "--procs", "'1,-2': process counts are 1 or more"),
    (["--procs", "abc"], "--procs", "'abc' is not a process count")])
def test_calibrate_refuses_bad_options_before_measuring(tmp_path, monkeypatch, args, option, text):
    """Refused at parsing, naming the option and the value: nothing is measured."""
    import hvd_onebit_tools.bench.calibrate.run as run

    measured = []
    monkeypatch.setattr(run, "calibrate", lambda **kw: measured.append(kw))
    proc = hvd_onebit(["bench", "calibrate", "--out", str(tmp_path / "cal.json"), *args])
    assert proc.exit_code == 2 and option in proc.stderr and text in proc.stderr, \
        f"{args}: exit {proc.exit_code}, expected {option} and {text!r} in:\n{proc.output}"
    assert measured == [], f"{args}: calibration started with {measured}"


BAD_NUMBERS = [
    (["--np", "1"], "--np", "2 or more ranks"),
    (["--np", "4,6", "--ranks-per-node", "4"], "--np", "[6] rank(s) do not fill whole nodes"),
    (["--ranks-per-node", "0"], "--ranks-per-node", "0 is not in the range"),
    (["--compute-ms", "-5"], "--compute-ms", "-5.0 is not in the range"),
    (["--adam-ms", "-1"], "--adam-ms", "-1.0 is not in the range"),
    (["--params", "-5"], "--params", "'-5' is not a positive parameter count"),
    (["--params", "abc"], "--params", "'abc' is not a positive parameter count"),
    (["--warmup-frac", "-1"], "--warmup-frac", "-1.0 is not in the range 0<=x<=1"),
    (["--warmup-frac", "1.5"], "--warmup-frac", "1.5 is not in the range 0<=x<=1"),
    (["--latency-us", "-5"], "--latency-us", "-5.0 is not in the range x>=0"),
    (["--intra-latency-us", "-5"], "--intra-latency-us", "-5.0 is not in the range x>=0"),
    (["--kernel-speedup", "0"], "--kernel-speedup", "0.0 is not in the range x>0"),
    (["--block-size", "-2"], "--block-size", "-2 is not in the range x>=0"),
    (["--params", "1e400"], "--params", "'1e400' is over 1,000,000,000,000,000 parameters"),
    (["--params", "infM"], "--params", "'infM' is over 1,000,000,000,000,000 parameters"),
    (["--params", "nan"], "--params", "'nan' is not a positive parameter count"),
    (["--compute-ms", "nan"], "--compute-ms", "'nan' is not a finite number"),
    (["--compute-ms", "inf"], "--compute-ms", "'inf' is not a finite number"),
    (["--compute-ms", "1e308"], "--compute-ms",
     "1e+308 is beyond what the model prices (at most 1e+07)"),
    (["--kernel-speedup", "1e-300"], "--kernel-speedup",
     "1e-300 is beyond what the model prices (from 1e-06 to 1e+06)"),
    (["--host-speedup", "1e-300"], "--host-speedup",
     "1e-300 is beyond what the model prices (at least 1e-06)"),
    (["--adam-ms", "nan"], "--adam-ms", "'nan' is not a finite number"),
    (["--adam-ms", "60"], "--adam-ms", "60 ms is more than --compute-ms 50"),
    (["--latency-us", "inf"], "--latency-us", "'inf' is not a finite number"),
    (["--intra-latency-us", "nan"], "--intra-latency-us", "'nan' is not a finite number"),
    (["--per-peer-us", "inf"], "--per-peer-us", "'inf' is not a finite number"),
    (["--kernel-speedup", "inf"], "--kernel-speedup", "'inf' is not a finite number"),
    (["--kernel-speedup", "nan"], "--kernel-speedup", "'nan' is not a finite number"),
    (["--host-speedup", "nan"], "--host-speedup", "'nan' is not a finite number"),
    (["--warmup-frac", "nan"], "--warmup-frac", "'nan' is not a finite number"),
    (["--refresh-freeze-frac", "nan"], "--refresh-freeze-frac", "'nan' is not a finite number"),
    (["--run-steps", "0"], "--run-steps", "0 is not in the range 1<=x"),
    (["--check", ".", "--transport", "torch"], "--transport", "would be ignored"),
    (["--params", "1,5M"], "--params", "1,5M"),  # a decimal comma: not 15M
    (["--transport", "horovod", "--intra-node", "shared_memory"], "--intra-node",
     "serves torch's transport only"),
    (["--run-lengths", "0,100"], "--run-lengths", "0 is not in the range 1<=x"),
    (["--run-lengths", "1e400"], "--run-lengths", "'1e400'"),
    (["--run-lengths", ""], "--run-lengths", "'' names nothing"),
    (["--methods", ""], "--methods", "'' names nothing"),
    (["--run-lengths", "100", "--methods", "horovod_fp32"], "--methods", "names no onebit method"),
    (["--block-size", "7"], "--block-size", "7 is not a multiple of 8"),
    (["--np", str(1 << 30)], "--np", "a prediction prices at most 16,777,216 ranks"),
    (["--bandwidth", ""], "--bandwidth", "'' names no link rate"),
    (["--bandwidth", "1" + "0" * 400 + "tbit"], "--bandwidth", "is not a finite link rate")]


@pytest.mark.parametrize("args, option, text", BAD_NUMBERS,
                         ids=[" ".join(a) for a, _, _ in BAD_NUMBERS])
def test_predict_refuses_non_finite_and_out_of_range_numbers_before_any_work(
        tmp_path, monkeypatch, args, option, text):
    """No traceback and no table of nan or inf: each value is refused by click, naming the
    option and the value, and no model is built."""
    import hvd_onebit_tools.bench.predict.model as model

    built = []
    monkeypatch.setattr(model, "Model", lambda *a, **kw: built.append(a) or pytest.fail("built"))
    path = save(fake_calibration(), tmp_path / "cal.json")
    base = {"--params": "8M", "--compute-ms": "50", "--np": "4"}
    for k in args[::2]:
        base.pop(k, None)
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), *args,
                       *[x for kv in base.items() for x in kv]])
    assert proc.exit_code == 2 and option in proc.stderr and text in proc.stderr, \
        f"{args}: exit {proc.exit_code}, expected {option} and {text!r} in:\n{proc.output}"
    assert proc.exception is None or isinstance(proc.exception, SystemExit), proc.exception
    assert built == [], f"{args}: a model was built before the refusal"


def test_predict_host_speedup_inf_still_drops_the_host_cost(tmp_path):
    """The one infinite value with a meaning ('inf' drops the host cost: NIC offload) is kept,
    and its figures are finite; the JSON says "inf", which every parser reads."""
    path = save(fake_calibration(), tmp_path / "cal.json")
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--host-speedup", "inf", "--json"])
    assert proc.exit_code == 0, proc.output
    strict = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert strict["inputs"]["host_speedup"] == "inf", strict["inputs"]
    steps = {m: p["step_s"] for m, p in json.loads(proc.stdout)["rows"][0]["methods"].items()}
    assert all(math.isfinite(s) and s > 0 for s in steps.values()), \
        f"step seconds with --host-speedup inf: {steps}"


def test_predict_refuses_a_plot_it_cannot_write_before_predicting(tmp_path, monkeypatch):
    import hvd_onebit_tools.bench.predict.model as model

    monkeypatch.setattr(model, "Model", lambda *a, **kw: pytest.fail("a model was built"))
    path = save(fake_calibration(), tmp_path / "cal.json")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--plot", str(blocker / "dir" / "x.png")])
    assert proc.exit_code == 2 and "--plot" in proc.stderr and "cannot make the folder" in \
        proc.stderr, f"exit {proc.exit_code}: {proc.output}"
    made = tmp_path / "new" / "dir" / "x.png"
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--np", "4,8", "--plot", str(made), "--check",
                       str(tmp_path)])
    assert proc.exit_code == 2 and "--plot" in proc.stderr and "--check" in proc.stderr, \
        f"--plot with --check: exit {proc.exit_code}: {proc.output}"


def test_predict_makes_the_plot_folder_and_draws_the_sweep(tmp_path):
    path = save(fake_calibration(), tmp_path / "cal.json")
    plot = tmp_path / "new" / "dir" / "sweep.png"
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--np", "4,8", "--plot", str(plot), "--json"])
    assert proc.exit_code == 0, proc.output
    assert json.loads(proc.stdout)["plot"] == str(plot) and plot.stat().st_size > 0, \
        f"{plot}: exists {plot.exists()}"


def test_predict_run_lengths_plot_draws_the_speed_up_against_run_length(tmp_path):
    from hvd_onebit_tools.bench.predict.plots import plot_run_lengths

    path = save(fake_calibration(), tmp_path / "cal.json")
    plot = tmp_path / "run_lengths.png"
    proc = hvd_onebit(["bench", "predict", "--calibration", str(path), "--params", "8M",
                       "--compute-ms", "50", "--run-lengths", "1000,10000", "--methods",
                       "horovod_fp32,onebit", "--plot", str(plot), "--json"])
    assert proc.exit_code == 0, proc.output
    report = json.loads(proc.stdout)
    assert report["plot"] == str(plot) and plot.stat().st_size > 0, \
        f"report's plot {report.get('plot')!r}, {plot} exists: {plot.exists()}"
    rows = report["rows"]
    drawn = plot_run_lengths(rows, str(tmp_path / "again.png"), "title")
    expected = {f"onebit, np=4, 1gbit: {setting}": ([1000, 10000], [r[key] for r in rows])
                for setting, key in (("fixed warmup", "fixed_run_speedup_vs_fp32"),
                                     ("refresh", "refresh_run_speedup_vs_fp32"))}
    assert drawn == expected, f"drew {drawn}, the rows hold {expected}"


def test_predict_states_the_freeze_step_it_prices_when_a_fraction_rounds_to_step_0(tmp_path):
    """freeze_step is at least 1 in the library: --refresh-freeze-frac 0 prices a freeze after
    step 1, and the printed text says step 1, not 0%."""
    from hvd_onebit_tools.bench.predict.runs import frozen_at

    path = save(fake_calibration(), tmp_path / "cal.json")
    args = ["bench", "predict", "--calibration", str(path), "--params", "8M", "--compute-ms",
            "50", "--refresh-freeze-frac", "0", "--run-lengths", "1000"]
    proc = hvd_onebit([*args, "--json"])
    assert proc.exit_code == 0, proc.output
    freezes = {r["refresh_freeze_step"] for r in json.loads(proc.stdout)["rows"]}
    assert freezes == {1}, f"refresh freeze steps priced: {freezes}"
    header = hvd_onebit(args).stdout.splitlines()[0]
    assert "frozen at step 1 (0.1%, freeze_step is at least 1)" in header and \
        "frozen at 0%" not in header, header
    table = hvd_onebit([*args[:-2], "--run-steps", "1000"]).stdout
    assert "variance_refresh=doubling frozen at step 1 (0.1%, freeze_step is at least 1)" in \
        table, table
    got = (frozen_at(0.05, [10000]), frozen_at(0.05, [1000, 10000]), frozen_at(0, [100, 1000]),
           frozen_at(0.001, [100, 10000]))
    assert got == ("step 500 (5%)", "5% of each run",
                   "step 1 of each run (0% rounds to 0; freeze_step is at least 1)",
                   "0.1% of each run (step 1 at 100 steps: freeze_step is at least 1)"), got


def test_predict_refuses_an_adam_share_past_a_calibrated_models_compute():
    """--adam-ms is Adam's part of the step's compute: with --model the compute is the
    calibration's, and a share past it is refused as one past --compute-ms is."""
    proc = hvd_onebit(["bench", "predict", "--model", "mlp", "--adam-ms", "1e6"])
    assert proc.exit_code == 2 and "--adam-ms" in proc.stderr \
        and "is more than the step's compute" in proc.stderr, proc.output


def test_predict_refuses_horovods_group_collectives_on_torchs_transport():
    """--hierarchical-ops chooses how Horovod's collectives run the hierarchical stages; on
    torch.distributed's transport (auto's choice) it priced nothing and was ignored."""
    args = ["bench", "predict", "--model", "mlp", "--np", "8", "--ranks-per-node", "4",
            "--hierarchical-ops", "group"]
    for transport in ([], ["--transport", "torch"]):
        proc = hvd_onebit([*args, *transport])
        assert proc.exit_code == 2 and "--hierarchical-ops" in proc.stderr and \
            "add --transport horovod" in proc.stderr, f"{transport}: {proc.output}"
    priced = hvd_onebit([*args, "--transport", "horovod", "--json"])
    assert priced.exit_code == 0 and \
        json.loads(priced.stdout)["inputs"]["hierarchical_ops"] == "group", priced.output


def test_predict_names_the_ddp_faces_methods_as_bench_train_does(tmp_path):
    """`--methods ddp_adam,ddp_onebit`: the DDP face's rows under bench train's names, priced as
    horovod_fp32 and onebit (the same allreduce; flat 1-bit's stages on torch.distributed), with
    their whole runs and the flat crossover; ddp_onebit on Horovod's transport is refused."""
    path = save(fake_calibration(), tmp_path / "cal.json")
    args = ["bench", "predict", "--calibration", str(path), "--params", "8M", "--compute-ms",
            "50", "--np", "4,64", "--bandwidth", "1gbit", "--run-steps", "1000", "--json"]
    both = json.loads(hvd_onebit(
        args + ["--methods", "horovod_fp32,onebit,ddp_adam,ddp_onebit"]).stdout)
    ddp = json.loads(hvd_onebit(args + ["--methods", "ddp_adam,ddp_onebit"]).stdout)
    for row in both["rows"]:
        ms = row["methods"]
        for ours, theirs in (("ddp_adam", "horovod_fp32"), ("ddp_onebit", "onebit")):
            same = {k: v for k, v in ms[ours].items() if k != "method"}
            assert same == {k: v for k, v in ms[theirs].items() if k != "method"}, \
                f"np={row['np']}: {ours} {ms[ours]['step_s']} s, {theirs} {ms[theirs]['step_s']} s"
        assert "run_refresh" in ms["ddp_onebit"] and "run_refresh" not in ms["ddp_adam"], ms
    assert ddp["crossovers"] == both["crossovers"] and \
        [list(r["methods"]) for r in ddp["rows"]] == [["ddp_adam", "ddp_onebit"]] * 2, \
        f"{ddp['crossovers']} against {both['crossovers']}"
    table = hvd_onebit(args[:-1] + ["--methods", "ddp_adam,ddp_onebit"]).stdout
    verdicts = [line for line in table.splitlines() if line.startswith("link 1 Gbit/s: ")]
    assert len(verdicts) == 1 and "flat 1-bit" in verdicts[0] and \
        "hierarchical" not in verdicts[0], f"the verdicts of a DDP sweep: {verdicts}"
    # a sweep without a flat 1-bit row has no verdict to give, and gives none
    alone = hvd_onebit(args + ["--methods", "ddp_adam"])
    assert json.loads(alone.stdout)["crossovers"] == {"1000000000": {}}, alone.stdout[-300:]
    assert not [line for line in hvd_onebit(args[:-1] + ["--methods", "ddp_adam"]).stdout
                .splitlines() if line.startswith("link ")], "a verdict on methods not priced"
    refused = hvd_onebit(args + ["--methods", "ddp_onebit", "--transport", "horovod"])
    assert refused.exit_code == 2 and "runs on torch.distributed" in refused.stderr, \
        refused.output


def test_predict_refuses_a_calibration_of_one_world_size_for_another(tmp_path):
    """Collectives timed at one world size fit each op's per-peer cost as 0: a prediction at
    another world size is refused, naming the file and the field, unless --per-peer-us gives
    the cost; at the world size measured it is priced."""
    cal = fake_calibration()
    del cal["collectives"]["4"]
    path = save(cal, tmp_path / "one_world.json")
    args = ["bench", "predict", "--calibration", str(path), "--model", "mlp"]
    refused = hvd_onebit([*args, "--np", "1024"])
    error = " ".join(refused.stderr.split())
    assert refused.exit_code == 1 and str(path) in error and "'collectives' holds one world " \
        "size (np 2)" in error and "--np 2,4" in error and "--per-peer-us" in error, \
        f"exit {refused.exit_code}: {refused.output!r}"
    for more in (["--np", "2"], ["--np", "1024", "--per-peer-us", "5"]):
        priced = hvd_onebit([*args, *more, "--json"])
        assert priced.exit_code == 0, f"{more}: exit {priced.exit_code}: {priced.output[-600:]}"


def test_the_probe_s_prediction_refuses_a_calibration_of_one_world_size_for_another(tmp_path):
    """`check --probe` prices the probed job with the calibration as `bench predict` does: one of
    another world size alone is refused on the rank that prints the prediction, naming it."""
    import click

    from hvd_onebit_tools.check_probe import LinkProbe, predict

    cal = fake_calibration()
    del cal["collectives"]["4"]
    path = save(cal, tmp_path / "one_world.json")
    with pytest.raises(click.ClickException) as raised:
        predict(LinkProbe(ranks=8, elements=1 << 20, seconds=0.01), "350M", 200.0, str(path))
    assert str(path) in raised.value.message and "holds one world size (np 2)" \
        in raised.value.message, f"the probe's prediction raised {raised.value.message!r}"


def test_predict_without_colocated_refuses_a_calibration_without_one_process_figures(tmp_path):
    """A rank with a core to itself is priced with the 1-process figures: a calibration made
    without them (--procs 2) is refused saying what is missing and how to get it; with
    --colocated it prices, and its footer names the process count of the torch.add rate."""
    cal = fake_calibration()
    del cal["compute"]["1"]
    path = save(cal, tmp_path / "no_one_process.json")
    args = ["bench", "predict", "--calibration", str(path), "--model", "mlp", "--np", "4"]
    refused = hvd_onebit(args)
    error = " ".join(refused.stderr.split())
    assert refused.exit_code == 1 and str(path) in error and "'compute' has no 1-process " \
        "figures (timed with --procs 2,4)" in error and "--procs 1,2,4" in error and \
        "--colocated" in error, f"exit {refused.exit_code}: {refused.output!r}"
    priced = hvd_onebit([*args, "--colocated", "--json"])
    pricing = json.loads(priced.stdout)["pricing"] if priced.exit_code == 0 else priced.output
    assert "with 2 processes at once" in pricing and "in one process" not in pricing, pricing
