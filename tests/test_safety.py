"""The compression phase on real models' shapes, 2 ranks: several buckets with a non-finite value
in one, float16 and bfloat16 parameters, sparse embeddings, options checked at construction,
an exp_avg_mask that lives elsewhere."""
import json
import sys
from pathlib import Path

import pytest
import torch

from hvd_onebit_tools.cluster.jobs import run_command
from tests.checks import assert_same_on_every_rank, assert_same_params
from tests.scenarios import scenario
from tests.worlds import shared_suite

pytestmark = pytest.mark.multirank


results = shared_suite("tests.workers_safety:suite", np=2, timeout=400)
thread_multiple = shared_suite("tests.workers_safety:mpi_transport_error", np=2, controller="mpi",
                               timeout=120)


def deviation(run, ref):
    """||params - ref params|| / ||ref params - start||: how far a run strays from a reference
    run, against how far the reference moved from their common start."""
    num = sum(float((a - b).norm() ** 2) for a, b in zip(run["params"], ref["params"]))
    den = sum(float((b - s).norm() ** 2) for b, s in zip(ref["params"], ref["start"]))
    return (num / den) ** 0.5


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["first_bucket", "middle_bucket", "last_bucket"])
def test_nonfinite_value_in_one_bucket_skips_the_whole_step(results, layer, scaler):
    runs = scenario(results, "nonfinite")
    ref = [r[("reference", scaler)] for r in runs]
    for rank, r in enumerate(runs):
        run = r[(layer, scaler)]
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        # 0.01 MiB buckets (2621 elements): the three layers' 12480 cut into five
        assert run["buckets"] == 5, f"rank {rank}: expected five 0.01 MiB buckets, got {run['buckets']}"
        assert run["skipped"] == [s == 6 for s in range(10)], \
            f"rank {rank}: skipped flags per step {run['skipped']}"
        assert run["changed_at_bad_step"] == {"params": [], "momenta": [], "steps": [],
                                              "errors": []}, \
            f"rank {rank}: the skipped step changed {run['changed_at_bad_step']}"
        assert run["steps"] == 9 and run["nonfinite_params"] == {}, \
            f"rank {rank}: {run['steps']} steps taken (expected 9 of 10, one skipped), " \
            f"non-finite elements per parameter at the end {run['nonfinite_params']}"
        # A skipped step is as if step() had not been called: the rest of the run is bit-identical
        # to a run that left that step out.
        assert run["hashes"][-1] == ref[rank]["hashes"][-1], \
            f"rank {rank}: training after the skipped step differs from the run without it"
        if scaler:
            assert run["scales"][5:7] == [256.0, 128.0], f"rank {rank}: scales {run['scales']}"
    assert_same_on_every_rank([r[(layer, scaler)]["hashes"] for r in runs],
                              f"layer {layer}, scaler {scaler}: parameter hashes after each step")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_low_precision_parameters_train_like_float32(results, precision, size):
    bounds = {"fp16": (0.02, 0.03), "bf16": (0.1, 0.06)}  # (variance, parameters)
    runs = scenario(results, "low_precision")
    for rank, r in enumerate(runs):
        run, ref = r[f"{precision}_{size}"], r[f"fp32_{size}"]
        assert (run["phase"], run["steps"]) == ("compression", 8), \
            f"rank {rank}: {precision} {size} ended in {run['phase']!r} after {run['steps']} " \
            f"steps, expected 'compression' after 8"
        assert run["skipped"] == 0, f"rank {rank}: {run['skipped']} steps skipped (a float16 " \
                                    "sum of finite gradients must not overflow)"
        assert run["held_warnings"] == [], f"rank {rank}: {run['held_warnings']}"
        assert run["v_dtype"] == "torch.float32", \
            f"rank {rank}: the variance is kept in {run['v_dtype']}, not torch.float32"
        for i, (v, v_ref) in enumerate(zip(run["v"], ref["v"])):
            assert bool((v > 0).all()), \
                f"rank {rank}: {int((v <= 0).sum())} of {v.numel()} variance elements of " \
                f"parameter {i} are not positive at the freeze (min {float(v.min())})"
            rel = float(((v - v_ref) / v_ref).abs().max())
            assert rel < bounds[precision][0], \
                f"rank {rank}: parameter {i}'s variance {rel:.3g} off float32's " \
                f"(bound {bounds[precision][0]})"
        dev = deviation(run, ref)
        assert dev < bounds[precision][1], \
            f"rank {rank}: parameters {dev:.3g} off float32's (bound {bounds[precision][1]})"
    a, b = (r[f"{precision}_{size}"]["params"] for r in runs)
    assert_same_params(b, a, f"{precision} {size}: rank 1 vs rank 0")


def test_float16_with_exact_averaging_matches_the_float32_reference(results):
    for rank, lp in enumerate(scenario(results, "low_precision")):
        dev = deviation(lp["fp16_small_none"], lp["fp32_small_none"])
        assert dev < 0.01, f"rank {rank}: compressor='none' in float16 is {dev:.3g} off float32"
        # and 1-bit float16 strays from the exact float32 reference no further than 1-bit float32
        dev16 = deviation(lp["fp16_small"], lp["fp32_small_none"])
        dev32 = deviation(lp["fp32_small"], lp["fp32_small_none"])
        assert dev16 < dev32 * 1.05, \
            f"rank {rank}: 1-bit float16 is {dev16:.4g} off the exact float32 run, 1-bit " \
            f"float32 {dev32:.4g} (allowed up to {dev32 * 1.05:.4g})"


def test_sparse_embedding_with_sparse_as_dense_trains_like_a_dense_one(results):
    for rank, (sparse, dense) in enumerate(zip(scenario(results, "sparse"),
                                               scenario(results, "dense"))):
        assert sparse["phases"] == ["warmup"] * 2 + ["compression"] * 6, \
            f"rank {rank}: phase before each step {sparse['phases']}, expected 2 of warmup, " \
            f"6 of compression"
        for name, a, b in zip(("emb", "w", "b"), sparse["params"], dense["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank}: {name} differs from the dense run")


@pytest.mark.parametrize("case, expected", [
    ("block_size_12", "block_size must be None or a positive multiple of 8, got 12"),
    ("block_size_0", "block_size must be None or a positive multiple of 8, got 0"),
    ("block_size_float", "block_size must be None or a positive multiple of 8, got 64.0"),
    ("transport", "transport must be one of ('auto', 'horovod', 'mpi', 'torch'), got 'tcp'"),
    ("kernel_backend", "kernel_backend must be one of ('auto', 'native', 'torch', 'triton'), got 'cuda'"),
    ("native_on_meta", "native kernels run on CPU tensors only, got device meta"),
    ("bucket_zero", "bucket_size_mb must be a positive number of MiB, got 0"),
    ("bucket_nan", "bucket_size_mb must be a positive number of MiB, got nan"),
    ("bucket_str", "bucket_size_mb must be a positive number of MiB, got '64'"),
    ("compressor", "compressor must be one of ('onebit', 'none'), got 'twobit'"),
    ("float64", "float32, float16 and bfloat16 parameters; got torch.float64: 2 parameter(s), "
                "parameter 0 (float64), parameter 1 (float64)"),
    ("complex", "float32, float16 and bfloat16 parameters; got torch.complex64"),
    ("mpi_transport_under_gloo", "transport='mpi' needs the job launched with MPI"),
    ("check_every", "check_every must be a non-negative int, got -1"),
    ("intra_node", "intra_node must be one of ('auto', 'shared_memory', 'network'), got 'nvlink'"),
    ("intra_node_horovod", "intra_node='shared_memory' runs beside transport='torch' (or 'auto'), "
                           "got transport='horovod'"),
    ("passes", "backward_passes_per_step must be a positive int, got 0"),
])
def test_bad_options_fail_at_construction_on_every_rank(results, case, expected):
    for rank, r in enumerate(scenario(results, "errors")):
        got = r[case]
        assert got is not None and expected in got, f"rank {rank}, {case}: {got!r}"


def test_exp_avg_mask_on_another_device_and_dtype_is_applied(results):
    for rank, m in enumerate(scenario(results, "mask")):
        assert m["phase"] == "compression", f"rank {rank}: ended in {m['phase']!r}"
        assert not m["pad_row"].any(), f"rank {rank}: masked row moved: {m['pad_row']}"
        assert not m["pad_momentum"].any(), f"rank {rank}: masked momentum {m['pad_momentum']}"
        assert m["rows_moved"] == 9, f"rank {rank}: {m['rows_moved']} unmasked rows trained"


def test_mpi_transport_refuses_a_job_without_thread_multiple(tmp_path):
    """Horovod's background thread calls MPI too: transport='mpi' needs MPI_THREAD_MULTIPLE."""
    script = Path(__file__).parent / "scripts" / "mpi_serialized.py"
    code = run_command([sys.executable, str(script)], np=2, controller="mpi", timeout=120,
                       env={"OUT_DIR": str(tmp_path)})
    assert code == 0, f"the job exited with {code}"
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["thread_level"] == r["serialized"], \
            f"rank {rank}: MPI thread level {r['thread_level']}, expected MPI_THREAD_SERIALIZED " \
            f"({r['serialized']}): {r}"
        assert r["error"] is not None and "needs MPI initialised with MPI_THREAD_MULTIPLE" in \
            r["error"] and "MPI_THREAD_SERIALIZED" in r["error"], f"rank {rank}: {r['error']!r}"


def test_mpi_transport_accepts_a_job_with_thread_multiple(thread_multiple):
    for rank, r in enumerate(thread_multiple):
        assert r["thread_level"] == r["multiple"] and r["error"] is None, f"rank {rank}: {r}"


def test_hierarchical_on_one_node_says_nothing_travels_in_one_bit(results):
    """Both ranks on this host: hierarchical=True averages inside the node in full precision
    and warns; "auto" stays flat 1-bit, silently."""
    asked, auto = scenario(results, "one_node_hierarchical"), scenario(results, "one_node_auto")
    for rank in range(2):
        assert asked[rank]["phase"] == "compression", asked[rank]["phase"]
        assert any("hierarchical=True on one node of 2 ranks" in w and "nothing travels in 1 bit"
                   in w and "horovodrun --gloo follows -H" in w
                   for w in asked[rank]["warnings"]), \
            f"rank {rank}: no one-node warning: {asked[rank]['warnings']}"
        assert auto[rank]["warnings"] == [], f"rank {rank}, 'auto': {auto[rank]['warnings']}"
    for run, what in ((asked, "hierarchical=True"), (auto, "auto")):
        assert run[0]["hash"] == run[1]["hash"], f"{what}: the ranks' parameters differ"
