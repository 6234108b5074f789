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

from hvd_onebit.bench import calibrate as cal_mod
from hvd_onebit.bench import predict as pm
from hvd_onebit.layout import Layout, ring_allreduce_bytes

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "hvd_onebit.cli", "bench"]
NUMEL, ROW = 1 << 20, 1 << 16


def fake_calibration(alpha=(1e-3, 2e-3), host_per_byte=1e-9, link_bps=10**9, overlap=0.5):
    """Calibration measured at np = 2 and 4: tiny ops take alpha[n], host cost per byte sent
    is ``host_per_byte`` and on the shaped link (where the wire takes longer) ``overlap`` of it
    hides behind the wire."""
    coll = {}
    for n, a in zip((2, 4), alpha):
        unl, shaped = {}, {}
        for op in ("allreduce", "alltoall", "allgather"):
            unl[f"{op}_tiny"] = shaped[f"{op}_tiny"] = a
        for op in pm.OPS:
            nbytes = pm._bytes_per_rank(op, n, NUMEL, ROW)
            host = host_per_byte * nbytes
            wire = nbytes * 8 / (link_bps * pm.TCP_EFFICIENCY)
            unl[op] = a + host
            shaped[op] = a + wire + (1 - overlap) * host
        coll[str(n)] = {"unlimited": {"np": n, "numel": NUMEL, "row_bytes": ROW, "median_s": unl},
                        "1gbit": {"np": n, "numel": NUMEL, "row_bytes": ROW, "median_s": shaped}}
    model = {"params": 1_000_000, "step_s": 0.011, "fwd_bwd_s": 0.010, "adam_s": 0.002}
    kern = {"compress_momentum": 1e-9, "server": 0.5e-9, "decode_update": 1e-9}
    compute = {str(k): {"models": {"mlp": {**model, "fwd_bwd_s": 0.010 * k / 2 if k > 2 else 0.010}},
                        "kernel_s_per_elem": kern} for k in (1, 2, 4)}
    return {"version": cal_mod.CALIBRATION_VERSION, "cores": 2, "link": "1gbit",
            "link_bps": link_bps, "compute": compute, "collectives": coll}


def test_constants_recover_the_calibrated_terms():
    c = pm.constants(fake_calibration())
    # a line through (n-1, alpha): 1 ms at n=2, 2 ms at n=4
    assert c["alpha_allreduce_per_peer_s"] == pytest.approx(0.5e-3)
    assert c["alpha_allreduce_s"] == pytest.approx(0.5e-3)
    for n in (2, 4):
        assert c[f"host_allreduce_fp32_s_per_byte@{n}"] == pytest.approx(1e-9)
        assert c[f"kappa@{n}"] == pytest.approx(0.5)


def test_step_times_are_the_sum_of_their_terms():
    model = pm.Model(fake_calibration())
    job = pm.Job(params=1_000_000, model="mlp", warmup_frac=0.2)
    cl = pm.Cluster(nodes=4, inter_bps=10**9)
    b = ring_allreduce_bytes(4 * job.params, 4)
    host = 1e-9 * b
    wire = b * 8 / (1e9 * pm.TCP_EFFICIENCY)
    fp32 = model.predict("horovod_fp32", job, cl)
    assert fp32.phases["compute"] == pytest.approx(0.012)
    assert fp32.phases["allreduce_fp32"] == pytest.approx(2e-3 + wire + 0.5 * host)
    assert fp32.bytes_per_rank == b

    onebit = model.predict("onebit", job, cl)
    layout = Layout.build(job.params, 4)
    sent = 3 * layout.row_bytes
    stage = sent * 8 / (1e9 * pm.TCP_EFFICIENCY) + 0.5 * 1e-9 * sent
    assert onebit.bytes_per_rank == layout.wire_bytes
    assert onebit.phases["compute"] == pytest.approx(0.010)  # Adam's pass is replaced
    assert onebit.phases["alltoall"] == pytest.approx(2e-3 + stage)
    assert onebit.phases["allgather"] == pytest.approx(2e-3 + stage)
    assert onebit.phases["compress"] == pytest.approx(1e-3)
    assert onebit.phases["server"] == pytest.approx(0.5e-3)

    # link latency: 2 (n-1) steps in the ring, 1 in the alltoall, n-1 in the ring allgather
    cl_lat = pm.Cluster(nodes=4, inter_bps=10**9, inter_latency_s=1e-4)
    assert model.predict("horovod_fp32", job, cl_lat).step_s - fp32.step_s == pytest.approx(6e-4)
    assert model.predict("onebit", job, cl_lat).step_s - onebit.step_s == pytest.approx(4e-4)

    rows = model.predict_all(job, cl)
    run = 0.2 * fp32.step_s + 0.8 * onebit.step_s
    assert rows["onebit"]["run_speedup_vs_fp32"] == pytest.approx(fp32.step_s / run)
    assert rows["onebit"]["warmup_step_s"] == pytest.approx(fp32.step_s)
    # one rank per node: hierarchical is the flat scheme
    assert rows["onebit_hierarchical"]["step_s"] == pytest.approx(onebit.step_s)
    assert pm.HIERARCHICAL_NOTE in rows["onebit_hierarchical"]["notes"]


def test_hierarchical_sends_a_shard_between_nodes_and_ranks_share_cores():
    model = pm.Model(fake_calibration())
    job = pm.Job(params=8_000_000, compute_s=0.1, adam_s=0.01)
    cl = pm.Cluster(nodes=16, ranks_per_node=8, inter_bps=10**10, intra_bps=10**11)
    hier = model.predict("onebit_hierarchical", job, cl)
    # between nodes: the 1-bit two-stage allreduce of |m|/L among N = 16, for each of L ranks
    inter = Layout.build(job.params // 8, 16).wire_bytes
    assert hier.inter_node_bytes_per_node == 8 * inter
    assert hier.bytes_per_rank == ring_allreduce_bytes(4 * job.params, 8) + inter
    flat = model.predict("onebit", job, cl)
    fp32 = model.predict("horovod_fp32", job, cl)
    # the flat alltoall puts L (n-L) rows on a node's link: more than hierarchical's shard
    assert flat.inter_node_bytes_per_node > hier.inter_node_bytes_per_node
    assert fp32.inter_node_bytes_per_node > flat.inter_node_bytes_per_node
    # the same scheme with every stage a global Horovod op pays alltoall's per-op cost at n
    glob = pm.Model(fake_calibration(), hierarchical_global_ops=True)
    extra = glob.predict("onebit_hierarchical", job, cl).step_s - hier.step_s
    assert extra == pytest.approx(4 * model.alpha("alltoall", 128) - model.alpha("allreduce", 8)
                                  - model.alpha("alltoall", 16) - model.alpha("allgather", 16))
    # colocated ranks compute at the speed calibrated with that many processes at once
    jm = pm.Job(params=1_000_000, model="mlp")
    alone = model.compute(jm, pm.Cluster(nodes=4))[0]
    shared = model.compute(jm, pm.Cluster(nodes=4, colocated=True))[0]
    assert alone == pytest.approx(0.012) and shared == pytest.approx(0.022)


def test_crossovers_find_where_flat_stops_paying():
    rows = [{"np": n, "inter_bps": 1e10, "methods": {
        "onebit": {"run_speedup_vs_fp32": s, "run_step_s": 1 / s},
        "onebit_hierarchical": {"run_speedup_vs_fp32": h, "run_step_s": 1 / h}}}
        for n, s, h in ((8, 0.9, 0.8), (16, 3.0, 2.0), (64, 1.5, 2.5), (512, 0.8, 2.0),
                        (1024, 0.5, 1.0))]
    # from n on for good: the dip at 8 (one node) is not a crossover
    assert pm.crossovers(rows) == {"10000000000.0": {"flat_onebit_stops_paying_at": 512,
                                                     "hierarchical_beats_flat_from": 64}}
    assert pm.parse_params("350M") == 350_000_000 and pm.parse_params("9.4e6") == 9_400_000


def test_calibration_round_trip_and_clear_errors(tmp_path):
    cal = fake_calibration()
    path = cal_mod.save(cal, tmp_path / "sub" / "cal.json")
    assert cal_mod.load(path) == json.loads(json.dumps(cal))
    with pytest.raises(cal_mod.CalibrationMissing, match="bench calibrate"):
        cal_mod.load(tmp_path / "missing.json")
    (tmp_path / "old.json").write_text(json.dumps({**cal, "version": 0}))
    with pytest.raises(ValueError, match="version"):
        cal_mod.load(tmp_path / "old.json")
    # the CLI: a clear error without a file; JSON and a plot with one
    proc = subprocess.run(CLI + ["predict", "--calibration", str(tmp_path / "missing.json"),
                                 "--model", "mlp"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "bench calibrate" in proc.stderr
    plot = tmp_path / "sweep.png"
    proc = subprocess.run(CLI + ["predict", "--calibration", str(path), "--params", "8M",
                                 "--compute-ms", "50", "--np", "8,64,512", "--ranks-per-node",
                                 "8", "--bandwidth", "10gbit,100gbit", "--latency-us", "5",
                                 "--plot", str(plot), "--json"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert plot.stat().st_size > 0 and len(report["rows"]) == 6
    assert set(report["rows"][0]["methods"]) == set(pm.METHODS)
    assert "not checked against a measurement" in report["note"]


def test_check_pairs_predictions_with_a_train_report():
    cal = fake_calibration()
    rows = [{"method": "local", "np": 4, "params": 1_000_000, "all_step_s": 0.02},
            {"method": "onebit", "np": 4, "params": 1_000_000, "warmup_step_s": 0.1,
             "compression_step_s": 0.05}]
    report = {"bandwidth": "1gbit", "config": {"model": "mlp", "warmup_frac": 0.2}, "rows": rows}
    result = pm.check_report([report, report], cal)
    pairs = {(p["method"], p["phase"]): p for p in result["pairs"]}
    assert set(pairs) == {("local", "all"), ("onebit", "warmup"), ("onebit", "compression")}
    assert pairs[("local", "all")]["predicted_s"] == pytest.approx(0.011)  # the free-running step
    assert not pairs[("local", "all")]["within"]  # 0.011 / 0.02 = 0.55
    assert pairs[("onebit", "compression")]["bound"] == 0.15 and pairs[("local", "all")]["runs"] == 2


def test_small_prediction_against_measurement_on_loopback():
    """Calibrate a small MLP and the collectives at np=2 on loopback, then predict bench train's
    steps there. Only the fp32 step and the compressed step are asserted, within a factor 3:
    steps of a few ms on a shared 2-core machine swing with the scheduler's time slices (the
    tight check is benchmarks/predict_check.py)."""
    from hvd_onebit.bench.train import MALLOC_REUSE_ENV
    from hvd_onebit.testing import run_job

    small = {"mlp": {"model": "mlp", "width": 1024, "depth": 2, "batch": 4}}
    compute = cal_mod.measure_compute(procs=(2,), models=small, kernel_numel=1 << 18, repeats=3,
                                      seconds=0.5)
    coll = run_job("hvd_onebit.bench.calibrate:collectives_worker", np=2,
                   kwargs={"numel": 1 << 20, "repeats": 5, "tiny_repeats": 9}, timeout=120,
                   env=MALLOC_REUSE_ENV).results[0]
    cal = {"version": cal_mod.CALIBRATION_VERSION, "cores": 2, "link": None, "link_bps": None,
           "compute": compute, "collectives": {"2": {"unlimited": coll}}}
    proc = subprocess.run(CLI + ["train", "--np", "2", "--bandwidth", "local", "--model", "mlp",
                                 "--width", "1024", "--depth", "2", "--steps", "12",
                                 "--methods", "local,horovod_fp32,onebit", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = pm.check_report([json.loads(proc.stdout)], cal)
    pm.print_check(result, echo=print)
    pairs = {(p["method"], p["phase"]): p for p in result["pairs"]}
    assert len(pairs) == 4 and all(math.isfinite(p["predicted_s"]) for p in pairs.values())
    for key in (("horovod_fp32", "all"), ("onebit", "compression")):
        assert 1 / 3 < pairs[key]["ratio"] < 3, pairs[key]
