"""hvd_onebit.DistributedOptimizer on real 1, 2 and 4-rank jobs.

Every scenario of a world size runs in that size's shared job (tests/worlds.py); each scenario's
exception comes back as data, so only the tests of that scenario fail (tests/scenarios.py).
"""
import numpy as np
import pytest
import torch

from hvd_onebit.config import DEFAULT_BLOCK_SIZE
from hvd_onebit.layout import Layout
from hvd_onebit.overlap import ZEROED
from tests.checks import assert_same_bits, assert_same_on_every_rank, difference
from tests.scenarios import scenario
from tests.worlds import shared_suite

pytestmark = pytest.mark.multirank


# Tensor fusion is off in the shared jobs (tests.worlds.DEFAULT_ENV): the bit-identity test
# against hvd.DistributedOptimizer needs Horovod's own results to be deterministic.
world = shared_suite("tests.workers_optimizer:suite", np=[1, 2, 4], timeout=400)


def assert_trains_like_exact_averaging(onebit_loss, exact_loss, start_loss, what):
    """1-bit's held-out loss against the same run with the momentum averaged exactly
    (compressor="none"): both below the start, 1-bit within 5% of exact. (Parameters are not
    compared: the sign noise sends a tiny model along another, equally good path.)"""
    assert exact_loss < start_loss, \
        f"{what}: the exact reference did not train ({exact_loss:.4f} vs start {start_loss:.4f})"
    assert onebit_loss < start_loss, \
        f"{what}: 1-bit did not train ({onebit_loss:.4f} vs start {start_loss:.4f})"
    assert onebit_loss <= exact_loss * 1.05, \
        f"{what}: 1-bit held-out loss {onebit_loss:.4f} vs exact averaging {exact_loss:.4f}"


def assert_same_params(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} parameters vs {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"{what}, parameter {i}")


def test_warmup_is_bit_identical_to_horovod(world):
    n, results = world
    for key in ("warmup_identical", "warmup_identical_passes2_fp16_adamw"):
        for rank, r in enumerate(scenario(results, key)):
            assert_same_params(r["onebit"], r["horovod"],
                               f"n={n} rank {rank} {key}: hvd_onebit vs hvd.DistributedOptimizer")


def test_identity_compressor_equals_adam_with_frozen_variance(world):
    n, results = world
    if n == 1:
        pytest.skip("one rank runs plain Adam (test_single_rank_is_plain_adam)")
    for key in ("frozen_adam", "frozen_adamw", "frozen_adam_unbounded"):
        for rank, (max_diff, min_moved, clamped) in enumerate(scenario(results, key)):
            assert min_moved > 1e-4, f"rank {rank} {key}: a parameter moved only {min_moved:.2e}"
            assert max_diff < 1e-5, \
                f"rank {rank} {key}: {max_diff:.2e} from the hand-written frozen-variance Adam"
    # the reference clamps some steps, so the match shows compressor="none" is bounded too
    for rank, (_, _, clamped) in enumerate(scenario(results, "frozen_adam")):
        assert clamped > 0.01, \
            f"rank {rank}: the bound engaged on {clamped:.3f} of steps, too few to test it"


def test_parameters_stay_identical_across_ranks_every_step(world):
    n, results = world
    for key in ("consistency", "consistency_passes2_buckets"):
        per_rank = scenario(results, key)
        assert_same_on_every_rank([r["hashes"] for r in per_rank],
                                  f"n={n} {key}: parameter hashes by step")
        assert per_rank[0]["nonfinite"] == 0, \
            f"n={n} {key}: {per_rank[0]['nonfinite']} non-finite parameter elements"


def test_float16_parameters_and_groups_with_different_betas(world):
    n, results = world
    paths = scenario(results, "other_paths")
    assert_same_on_every_rank([r["betas_hashes"] for r in paths],
                              f"n={n}: mixed-betas parameter hashes by step")
    for rank, r in enumerate(paths):
        assert_same_params(r["fp16_params"], paths[0]["fp16_params"],
                           f"n={n}: rank {rank}'s float16 parameters vs rank 0's")
    r, ref = paths[0], scenario(results, "other_paths_none")[0]
    assert r["fp16_phase"] == "compression", f"n={n}: fp16 run ended in phase {r['fp16_phase']!r}"
    for key in ("fp16", "betas"):
        moved = [float((p - s).abs().max()) for p, s in zip(r[f"{key}_params"], r[f"{key}_start"])]
        assert min(moved) > 0, f"{key}: a parameter did not train: moved {moved}"
        assert_trains_like_exact_averaging(r[f"{key}_val_loss"], ref[f"{key}_val_loss"],
                                           r["start_val_loss"], f"n={n} {key}")
    if n > 1:
        assert r["betas_buckets"] == 1, \
            f"n={n}: both groups should share one bucket, got {r['betas_buckets']}"


def test_phase_telemetry_and_bytes(world):
    n, results = world
    c = scenario(results, "consistency")[0]
    phases = c["phases"]
    assert phases[:5] == ["warmup"] * 5 and set(phases[5:]) == {"compression"}, \
        f"n={n}: phases by step {phases}"
    t = c["telemetry"]
    got = (t["phase"], t["steps"], t["skipped_steps"])
    assert got == ("compression", 30, 0), f"n={n}: telemetry (phase, steps, skipped) {got}"
    if n == 1:
        assert t["total_bytes"] == 0, f"n=1: {t['total_bytes']} bytes sent by one rank"
        return
    warm, comp = c["bytes"][0], c["bytes"][-1]
    numel = 8 * 32 + 32 + 32 * 32 + 32 + 32 + 1
    want_warm = int(2 * (n - 1) / n * 4 * numel)
    assert warm == want_warm, f"n={n}: warmup step sent {warm} bytes, fp32 ring is {want_warm}"
    # the 1-bit rows of the default layout (a scale per block, each chunk padded to whole
    # blocks, which on this tiny model is most of a chunk)
    want_comp = Layout.build(numel, n, DEFAULT_BLOCK_SIZE).wire_bytes
    assert comp == want_comp, f"n={n}: compressed step sent {comp} bytes, its layout {want_comp}"
    assert comp < warm / 15, f"n={n}: compressed step sent {comp} bytes, warmup {warm}"
    assert t["total_bytes"] == sum(c["bytes"]), \
        f"n={n}: telemetry total {t['total_bytes']} vs {sum(c['bytes'])} summed over steps"
    assert t["total_comm_seconds"] > 0, f"n={n}: total_comm_seconds {t['total_comm_seconds']}"
    buckets = scenario(results, "consistency_passes2_buckets")[0]["buckets"]
    assert buckets > 1, f"n={n}: 0.002 MiB buckets gave {buckets} bucket(s)"


def test_variance_is_frozen_at_freeze_step(world):
    n, results = world
    if n == 1:
        pytest.skip("one rank runs plain Adam: nothing is frozen")
    freeze = 5
    per_rank = scenario(results, "consistency")
    for rank, r in enumerate(per_rank):
        v = r["v_by_step"]  # after each step
        assert not np.array_equal(v[freeze - 2], v[freeze - 1]), \
            f"rank {rank}: v did not change in the last warmup step"
        for step in range(freeze, len(v)):
            np.testing.assert_array_equal(v[step], v[freeze - 1],
                                          err_msg=f"rank {rank}: v changed at step {step}")
        # the same v on every rank: it was built from allreduced gradients during warmup
        np.testing.assert_array_equal(v[-1], per_rank[0]["v_by_step"][-1],
                                      err_msg=f"rank {rank}'s frozen v differs from rank 0's")


def test_missing_gradients_and_requires_grad_changes(world):
    n, results = world
    missing = scenario(results, "missing")
    missing_none = scenario(results, "missing_none")
    assert_same_on_every_rank([m["hashes"] for m in missing], f"n={n}: parameter hashes by step")
    for rank, (m, none) in enumerate(zip(missing, missing_none)):
        for what in ("head", "bias"):  # frozen in the compression phase, and in the warmup
            assert torch.equal(m[f"{what}_at_freeze"], m[f"{what}_at_unfreeze"]), \
                f"rank {rank}: {what}, with requires_grad=False, moved: " \
                f"{difference(m[f'{what}_at_unfreeze'], m[f'{what}_at_freeze'])}"
            assert not torch.equal(m[f"{what}_at_unfreeze"], m[f"{what}_end"]), \
                f"rank {rank}: {what} did not train again after requires_grad=True"
        assert_trains_like_exact_averaging(m["val_loss"], none["val_loss"],
                                           m["start_val_loss"], f"n={n} rank {rank}")


def test_step_with_a_closure_averages_the_closures_gradients(world):
    """opt.step(closure): the closure's backward is the step's, in every kind of step (the
    same bits as backward before step()), and its loss comes back."""
    n, results = world
    runs = scenario(results, "closure")
    assert_same_on_every_rank([r["closure"] for r in runs], f"n={n}: hashes by step with a closure")
    for rank, r in enumerate(runs):
        if n > 1:
            assert r["refreshes"] > 0, f"n={n} rank {rank}: no refresh step in the run"
        same = [a == b for a, b in zip(r["plain"], r["closure"])]
        assert all(same), f"n={n} rank {rank}: step(closure) and backward + step() differ at " \
                          f"steps {[i for i, s in enumerate(same) if not s]}"
        assert all(isinstance(x, float) for x in r["losses"]) and len(r["losses"]) == len(same), \
            f"n={n} rank {rank}: step(closure) returned {r['losses']}"


def test_a_batch_skipped_after_backward_the_horovod_way_leaves_no_trace(world):
    """synchronize() then zero_grad() after a compressed step's backward (Horovod's way to
    skip a batch): allowed, the run goes on as if the batch had not been computed, and the
    buckets keep starting during backward; with a GradScaler too, and under
    backward_passes_per_step=2 after either of the two passes."""
    n, results = world
    if n == 1:
        pytest.skip("one rank: no compressed step")
    for rank, runs in enumerate(scenario(results, "skipped_batch")):
        for run, r in runs.items():
            plain = runs[r["reference"]]["hashes"]
            differ = [i for i, (a, b) in enumerate(zip(plain, r["hashes"])) if a != b]
            assert not differ and len(r["hashes"]) == len(plain), \
                f"n={n} rank {rank}, {run}: the run with batches skipped differs from " \
                f"{r['reference']} at steps {differ}"
        # accumulate_skip_half skips after the first of two backward passes, before any hook
        # started a bucket: no step starts again, and the skipped step's buckets start early too
        for run in ("skip", "skip_in_place", "accumulate_skip", "accumulate_skip_half",
                    "scaler_skip"):
            r, half = runs[run], run == "accumulate_skip_half"
            assert (r["started"] == 0) == half, \
                f"n={n} rank {rank}, {run}: {r['started']} buckets started from the hooks " \
                f"before the skip"
            restarts = 0 if half else 1
            assert r["restarts"] == restarts, f"n={n} rank {rank}, {run}: {r['restarts']} " \
                f"steps started their buckets again, expected {restarts}"
            later = (4 if half else 3) * r["buckets"]  # the steps after the skip
            assert r["early_after"] == later, \
                f"n={n} rank {rank}, {run}: {r['early_after']} buckets started during backward " \
                f"after the skip, expected {later}: the skip turned the overlap off"
        about = [w for run, r in runs.items() if run != "every"
                 for w in r["warnings"] if "overlap off" in w or "race" in w]
        assert not about, f"n={n} rank {rank}: warned {about}"
        # zeroed before every step: the second in a row turns the overlap off, saying why
        every = runs["every"]
        about = [w for w in every["warnings"] if "overlap off" in w]
        assert every["restarts"] == 2 and len(about) == 1 and ZEROED in about[0], \
            f"n={n} rank {rank}: batches skipped before every step: {every['restarts']} " \
            f"restarts (expected 2), warnings {every['warnings']}"


def test_a_branch_trained_on_some_ranks_only_is_averaged_as_horovod_does(world):
    """Each rank's hooks start allreduces that the other ranks start only when they
    synchronize: every one is started before any is waited for (else each rank waits for the
    others), and the warmup's steps are Horovod's own, bit for bit."""
    n, results = world
    runs = scenario(results, "branches_by_rank")
    for rank, r in enumerate(runs):
        assert r["onebit_freeze_20"] == r["horovod"], \
            f"n={n} rank {rank}: warmup parameter hashes by step, hvd_onebit " \
            f"{r['onebit_freeze_20']} vs hvd.DistributedOptimizer {r['horovod']}"
        assert r["onebit_freeze_3"][:3] == r["horovod"][:3], \
            f"n={n} rank {rank}: the 3 warmup steps before the freeze, hvd_onebit " \
            f"{r['onebit_freeze_3'][:3]} vs hvd.DistributedOptimizer {r['horovod'][:3]}"
    assert_same_on_every_rank([r["onebit_freeze_3"] for r in runs],
                              f"n={n}: parameter hashes by step through the compression phase")


def test_param_groups_masks_and_lr_schedule(world):
    n, results = world
    per_rank = scenario(results, "groups")
    assert_same_on_every_rank([g["hash"] for g in per_rank], f"n={n}: parameter hash")
    g = per_rank[0]
    assert not g["pad_row"].any(), f"n={n}: masked padding row moved to {g['pad_row']}"
    assert not g["pad_momentum"].any(), \
        f"n={n}: masked padding row has momentum {g['pad_momentum']}"
    want = [1e-2 * 0.5 ** 5, 5e-3 * 0.5 ** 5]
    assert g["lrs"] == pytest.approx(want), f"n={n}: learning rates {g['lrs']}, want {want}"


def test_broadcasts_zero_grad_and_skip_synchronize(world):
    n, results = world
    per_rank = scenario(results, "helpers")
    assert_same_on_every_rank([h["hash0"] for h in per_rank], f"n={n}: hash after broadcast")
    assert_same_on_every_rank([h["hash"] for h in per_rank], f"n={n}: hash after 6 steps")
    for rank, h in enumerate(per_rank):
        where = f"n={n} rank {rank}"
        assert h["steps_after_broadcast"] == 0, \
            f"{where}: broadcasting state took {h['steps_after_broadcast']} step(s)"
        assert all(g == 0.0 for g in h["zero_grads"]), \
            f"{where}: zero_grad(set_to_none=False) left max |grad| per parameter {h['zero_grads']}"
        assert all(kind == "NoneType" for kind in h["none_grads"]), \
            f"{where}: zero_grad(set_to_none=True) left .grad of types {h['none_grads']}"
        assert h["steps"] == 6, f"{where}: {h['steps']} steps counted, 6 taken"
        if n > 1:
            assert h["worker_error_norm"] > 0, \
                f"{where}: error feedback norm {h['worker_error_norm']} after 3 compressed steps"
            # Horovod's clipping recipe waits in synchronize(), before step(): counted there
            assert min(h["comm_seconds"]) > 0, \
                f"{where}: seconds of communication per step {h['comm_seconds']} (phases " \
                f"{h['phases']})"


def test_skip_synchronize_without_synchronize_still_averages_a_full_precision_step(world):
    """A misuse of Horovod's recipe at every step: the warmup and refresh steps average all the
    same, with a warning each, and the ranks stay the same bits (a refresh step stepped on each
    rank's own gradients, and the ranks parted for good)."""
    n, results = world
    runs = scenario(results, "skip_unsynchronized")
    assert_same_on_every_rank([r["hashes"] for r in runs], f"n={n}: hashes per step")
    if n > 1:
        for rank, r in enumerate(runs):
            assert r["refreshes"] == 2 and r["told"] == 5, \
                f"n={n} rank {rank}: {r['refreshes']} refresh steps, {r['told']} warnings " \
                "(expected 2 refreshes, and 5 full-precision steps told: 3 warmup, 2 refresh)"


def test_broadcast_in_the_compression_phase_changes_nothing(world):
    n, results = world
    for rank, (without, with_broadcast) in enumerate(scenario(results, "broadcast_mid_compression")):
        assert_same_params(with_broadcast, without,
                           f"n={n} rank {rank}: a broadcast of identical state changed the "
                           "training trajectory")


def test_bad_arguments_are_clear_errors(world):
    n, results = world
    wanted = {  # case: substrings its error must hold
        "sgd": ["wraps torch.optim.Adam or torch.optim.AdamW", "SGD"],
        "freeze0": ["freeze_step must be a positive int"],
        "freeze_float": ["freeze_step must be a positive int"],
        "adasum": ["op=hvd.Average or hvd.Sum"],
        # Horovod's own refusal, and two it would leave to the first step
        "predivide_sum": ["gradient_predivide_factor=2.0 needs op=hvd.Average"],
        "predivide_zero": ["gradient_predivide_factor must be a positive finite number, got 0.0"],
        "compression_name": ["compression must be a Horovod compressor", "'fp16'"],
        "mask_shape": ["does not broadcast"],
        "no_freeze_step": ["freeze_step is required", "max(1, total_steps // 20)", "'auto'"],
        "wrapped_twice": ["wraps a bare torch.optim.Adam or AdamW; this one is already wrapped",
                          "horovod.torch.optimizer.", "replace that wrapper"],
        # a channels_last conv weight; the 1x1 conv's weight stays contiguous either way
        "channels_last": ["Horovod's allreduce needs contiguous tensors", "1 parameter(s)",
                          "(0.weight)", "memory_format=torch.contiguous_format"],
        "named_dict": ["named_parameters should be a sequence of tuples"],
        "named_partial": ["named_parameters names 5 of the optimizer's 6 parameters",
                          "[(0, 5, (1,))]", "Pass model.named_parameters()"],
        "named_consumed": ["names 0 of the optimizer's 6", "named_parameters was empty",
                           "can be read once"],
        "amsgrad_loaded": ["amsgrad=True is not supported in the state dict loaded",
                           "param group(s) [0]", "set its groups' 'amsgrad' to False"],
        "amsgrad_added": ["amsgrad=True is not supported in a param group added"],
        "stepped_original": ["this Adam was wrapped by hvd_onebit.DistributedOptimizer",
                             "the wrapper is the optimizer to step", "Nothing was changed"],
    }
    if n > 1:
        wanted.update(reordered=["optimizers differ in the order, names, shapes or dtypes of "
                                 "their parameters (rank(s) [1"],
                      freeze_step=["differ in freeze_step (rank 0: 2, rank 1: 3"],
                      # converted after construction: refused at the first backward, named
                      # (one rank allreduces nothing, and takes any layout)
                      channels_last_later=["Horovod's allreduce needs contiguous tensors",
                                           "(0.weight)", "after the optimizer was built",
                                           "memory_format=torch.contiguous_format"],
                      channels_last_at_refresh=["Horovod's allreduce needs contiguous tensors",
                                                "(0.weight)", "after the optimizer was built"],
                      channels_last_between_passes=["Horovod's allreduce needs contiguous "
                                                    "tensors", "(weight)",
                                                    "after the optimizer was built"])
    for rank, bad in enumerate(scenario(results, "bad")):
        for case, parts in wanted.items():
            assert bad[case] is not None and all(p in bad[case] for p in parts), \
                f"rank {rank} {case}: error {bad[case]!r}, want it to mention {parts}"
        for case, said in (("bad_on_last", "block_size must be None or a positive multiple of 8, "
                                           "got 7"),
                           ("amsgrad_on_last", "amsgrad=True is not supported")):
            by = "" if rank == n - 1 else \
                f"rank {n - 1} refused to build hvd_onebit.DistributedOptimizer: "
            assert bad[case] is not None and by + said in bad[case], \
                f"rank {rank} {case} (refused on rank {n - 1} alone): error {bad[case]!r}, " \
                f"want it to say {by + said!r}"
        assert bad["frozen_then_channels_last"] is None, \
            f"rank {rank}: a frozen parameter made channels_last stopped training: " \
            f"{bad['frozen_then_channels_last']!r}"
        assert bad["wrapper_copy"] is None, f"rank {rank}: {bad['wrapper_copy']!r}"
        assert bad["own_synchronize"] is None, \
            f"rank {rank}: an Adam subclass with a synchronize() of its own was refused: " \
            f"{bad['own_synchronize']!r}"
        assert bad["amsgrad"] is not None and bad["amsgrad"].startswith(
            "ValueError: amsgrad=True is not supported"), f"rank {rank} amsgrad: {bad['amsgrad']!r}"


def test_single_rank_is_plain_adam(world):
    n, results = world
    if n != 1:
        pytest.skip("single-rank behaviour")
    single = scenario(results, "single")[0]
    assert_same_params(single["onebit"], single["adam"], "one rank: hvd_onebit vs torch Adam")
    assert single["total_bytes"] == 0, f"one rank sent {single['total_bytes']} bytes"
