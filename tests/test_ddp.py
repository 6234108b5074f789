"""The DDP face (``hvd_onebit.ddp``) under real torchrun (Gloo, CPU, Horovod blocked in the
ranks), at 2 and 4 ranks: one launch per world runs every scenario (tests/workers_ddp.py), more
run the example script and a restarted training script; at 3 ranks the same scenarios run in
the shared Horovod job. The compressed steps, their buckets started from the gradient hooks
with DDP's sync off, are checked bit for bit against the engine alone started in step(), fed
the same state and the same local gradients on the in-process transport. In the Horovod jobs of
2 and 3 ranks the two faces run side by side on the same gradients (tests/workers_ddp_faces.py)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hvd_onebit.transport.inprocess import run_threads
from tests.scenarios import scenario
from tests.torchrun_jobs import REPO, run_torchrun_script
from tests.workers_ddp import FREEZE, SKIPS, VARIANTS, differences, replay
from tests.workers_ddp_faces import COMPRESSED as FACES_COMPRESSED
from tests.worlds import Scratch, shared_suite

COMPRESSED = 4  # compressed steps of each compression scenario
# torchrun's agent shares its rendezvous store with the workers' init_process_group by default,
# and the keys a group's ranks publish there (Gloo's addresses) outlive a restart: a restarted
# rank may read its peer's address from the attempt before and fail to connect to it
# (pytorch/pytorch#135712). Each attempt's rank 0 hosts a store of its own with this.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

world2 = shared_suite("tests.workers_ddp:suite", np=2, controller="torchrun", timeout=400,
                      kwargs={"scratch": Scratch("ddp_flushed"), "stage": "save"})
world4 = shared_suite("tests.workers_ddp:suite", np=4, controller="torchrun", timeout=600,
                      stage=1, kwargs={"scratch": Scratch("ddp_flushed"), "stage": "load"})


# the two faces side by side, in the Horovod jobs other modules share: through every phase at
# two ranks (Horovod's average and DDP's are the same bits there), from a state common at the
# freeze at two and three ranks (where they are not: tests/workers_ddp_faces.py says why)
faces_through = shared_suite("tests.workers_ddp_faces:through", np=2, timeout=120)
faces = shared_suite("tests.workers_ddp_faces:suite", np=[2, 3], timeout=120)


# three ranks, where DDP's averaging and a hook's can differ in the last bit: the same
# scenarios in the shared Horovod job of three ranks, on a Gloo group set up beside Horovod
world3 = shared_suite("tests.workers_ddp_faces:ddp_suite", np=3, timeout=400)


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request, world2, world3, world4):
    return request.param, {2: world2, 3: world3, 4: world4}[request.param]


@pytest.mark.multirank
@pytest.mark.parametrize("variant", list(VARIANTS) + ["grad_scaler"])
def test_warmup_is_bit_identical_to_ddp_and_the_same_adam(world, variant):
    n, results = world
    for rank, found in enumerate(scenario(results, f"warmup_{variant}")):
        assert found == [], f"n={n} rank {rank} ({variant}): DDP + Adam and the face differ"


@pytest.mark.multirank
@pytest.mark.parametrize("name", [f"compression_{v}" for v in VARIANTS]
                         + ["compression_check_every"])
def test_compressed_steps_are_the_engines_on_the_same_gradients(world, name):
    n, results = world
    records = scenario(results, name)
    threads = run_threads(n, lambda t: replay(t.rank, t, records, n), timeout=120)
    for rank, (record, engine) in enumerate(zip(records, threads)):
        assert record["steps"] == FREEZE + COMPRESSED
        assert record["phases"] == ["compression"] * COMPRESSED
        assert record["buckets"] > 1, f"n={n}: the momentum spans {record['buckets']} bucket(s)"
        # every compressed step ran with DDP's gradient sync off: its gradients stayed local
        assert record["local_steps"] == COMPRESSED, record["local_steps"]
        if name == "compression_compiled":  # the module's forward (the DDP model's: torch's)
            assert record["graphs"] > 0, f"n={n} rank {rank}: torch.compile captured no graph"
        # the buckets started from the gradient hooks (all of them, but with find_unused_parameters,
        # and for a clip: it changes the gradients after backward, so they start again)
        started = {"compression_unused": 0, "compression_clip": record["buckets"]}.get(
            name, record["buckets"] * COMPRESSED)
        restarts = 1 if name == "compression_clip" else 0
        assert (record["early_starts"], record["restarts"]) == (started, restarts), \
            f"n={n} rank {rank} ({name}): early starts and restarts"
        for step, (face, alone) in enumerate(zip(record["params"], engine)):
            assert differences(face, alone, f"step {step}") == [], \
                f"n={n} rank {rank} ({name}): the face and the engine alone differ"
            assert differences(face, records[0]["params"][step], f"step {step}") == [], \
                f"n={n}: rank {rank} differs from rank 0 ({name})"


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_parameters_train_with_float32_state(world, dtype):
    n, results = world
    runs = scenario(results, f"low_precision_{dtype}")
    for rank, r in enumerate(runs):
        assert (r["dtypes"], r["state_dtypes"]) == ([f"torch.{dtype}"], ["torch.float32"])
        assert (r["steps"], r["phase"]) == (FREEZE + 3, "compression")
        finite = [bool(np.isfinite(p).all()) for p in r["params"]]
        assert all(finite), f"n={n} rank {rank}: finite parameters {finite}"
        assert differences(r["params"], runs[0]["params"], dtype) == [], \
            f"n={n}: rank {rank} differs from rank 0"


def refresh_runs(results, n: int, key: str) -> list[dict]:
    """Scenario ``key``'s runs (tests/workers_ddp.py's ``variance_refresh``), held to what every
    such run must show: every step taken, both kinds of compression-phase step (refreshes and
    1-bit ones), and every rank's parameters identical to rank 0's."""
    runs = scenario(results, key)
    for rank, r in enumerate(runs):
        assert (r["steps"], r["phase"]) == (r["iterations"] + r["extra_steps"], "compression"), \
            f"n={n} rank {rank} {key}: {r['steps']} steps, phase {r['phase']}, expected " \
            f"{r['iterations']} + {r['extra_steps']} second steps in the compression phase"
        assert r["refreshes"] > 0 and r["local_steps"] > 0, \
            f"n={n} rank {rank} {key}: {r['refreshes']} refreshes and {r['local_steps']} local " \
            f"steps: not both kinds, nothing was tested"
        assert differences(r["params"], runs[0]["params"], key) == [], \
            f"n={n} {key}: rank {rank} differs from rank 0 ({r['extra_refreshes']} refresh " \
            f"steps followed no backward)"
    return runs


@pytest.mark.multirank
def test_variance_refresh_steps_take_ddps_averaged_gradients(world):
    n, results = world
    for rank, r in enumerate(refresh_runs(results, n, "refresh")):
        # every compressed step is a refresh (DDP's allreduce) or a 1-bit one (gradients local)
        assert r["refreshes"] + r["local_steps"] == 6, r


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["refresh_second_steps", "refresh_unused_second_steps"])
def test_a_refresh_step_without_a_backward_averages_the_local_gradients(world, key):
    n, results = world
    for rank, r in enumerate(refresh_runs(results, n, key)):
        assert r["extra_refreshes"] > 0, \
            f"n={n} rank {rank} {key}: no second step() was a refresh step, nothing was tested"


@pytest.mark.multirank
def test_refresh_steps_with_find_unused_parameters_after_a_branch_used_locally(world):
    """DDP's reducer counts a parameter a compressed step's local backward used as used at the
    next averaged backward; its gradient, None since zero_grad, must not make DDP refuse it."""
    n, results = world
    refresh_runs(results, n, "refresh_unused")


@pytest.mark.multirank
@pytest.mark.parametrize("run", ["rebuilt", "rebuilt_static"])
def test_the_optimizer_built_again_as_the_refusal_says_trains_on(world, run):
    """The new DDP model's first iteration is a compressed step; with static_graph=True DDP
    records its graph there, through its own sync."""
    n, results = world
    runs = scenario(results, run)
    for rank, r in enumerate(runs):
        assert r["differences"] == [], f"n={n} rank {rank} ({run}): {r['differences']}"
        assert "already trained by an hvd_onebit.ddp.DistributedOptimizer" in r["again"], \
            f"n={n} rank {rank}: a second optimizer on the same DDP model: {r['again']!r}"
        assert (r["steps"], r["phase"]) == (FREEZE + 5, "compression"), \
            f"n={n} rank {rank}: {r['steps']} steps, phase {r['phase']}"
        assert r["old_started"] == 0, \
            f"n={n} rank {rank}: the old optimizer's hooks started {r['old_started']} buckets"
        assert differences(r["params"], runs[0]["params"], "params") == [], \
            f"n={n}: rank {rank} differs from rank 0"


@pytest.mark.multirank
def test_a_model_handed_to_plain_adam_once_the_optimizer_is_dropped_trains_as_ddp(world):
    """The optimizer's hooks on the DDP model hold it weakly: once the script drops it, the
    model is plain DDP again (its own averaging), and DDP + Adam from the 1-bit state trains
    as on the module wrapped in DDP again (bit for bit at two ranks; a fresh DDP model's first
    iteration sums in another bucket order, which may round apart at more), alike on every
    rank. While the 1-bit optimizer lives, the forward after another optimizer's step is
    refused on every rank; the script's own writes to the weights (a clip under no_grad) are
    not."""
    n, results = world
    runs = scenario(results, "handed_to_adam")
    for rank, r in enumerate(runs):
        if n == 2:
            assert r["differences"] == [], f"n={n} rank {rank}: {r['differences']}"
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(r["params"], r["rewrapped"]))
        assert worst < 1e-6, f"n={n} rank {rank}: {r['differences']} (largest {worst:.3g})"
        kept = r["kept"]
        assert kept["again"] == kept["error"], \
            f"n={n} rank {rank}: the forward retried after the refusal: {kept['again']!r}"
        assert kept["taken"] == 1 and "stepped by another optimizer (Adam)" in kept["error"] \
            and "another optimizer steps the model while this one still holds it" \
            in kept["error"], \
            f"n={n} rank {rank}: with the 1-bit optimizer kept, DDP + Adam took " \
            f"{kept['taken']} step(s), then {kept['error']!r}"
        assert differences(r["params"], runs[0]["params"], "params") == [], \
            f"n={n}: rank {rank} differs from rank 0 after DDP + Adam took over"
        clipped = r["clipped"]
        assert clipped["error"] == "accepted" and clipped["taken"] == clipped["steps"], \
            f"n={n} rank {rank}: with the weights clipped in place before each step, " \
            f"{clipped['taken']} of {clipped['steps']} steps taken, then {clipped['error']!r}"
        assert differences(clipped["params"], runs[0]["clipped"]["params"], "clipped") == [], \
            f"n={n}: rank {rank} differs from rank 0 with the weights clipped"


def test_a_model_left_unwrapped_on_one_process_is_refused_saying_to_use_plain_adam():
    """On one process the frameworks leave the model unwrapped (Accelerate's prepare()): the
    refusal says there is nothing to compress there, not to pass what prepare() returned."""
    import torch

    import hvd_onebit.ddp

    net = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError) as raised:
        hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(net.parameters()), net,
                                            freeze_step=1)
    assert "not in a job of several ranks" in str(raised.value) and "use plain Adam" in \
        str(raised.value), f"a bare module on one process: {raised.value}"


def test_a_hook_called_with_one_gradient_by_torchs_python_reducer_says_so():
    """Compiled autograd under DDP runs torch's Python reducer, which calls the communication
    hook with (gradient, parameter) where DDP hands a bucket: a clear refusal, not an
    AttributeError from inside the hook."""
    import torch

    from hvd_onebit.ddp.hook import HookState, onebit_comm_hook

    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError) as raised:
        onebit_comm_hook(HookState(), (torch.ones(3), p))
    assert "compiled autograd" in str(raised.value) and "Python reducer" in str(raised.value), \
        f"the hook called with (gradient, parameter) raised {raised.value!r}"


def test_another_optimizers_step_is_named_by_its_outermost_wrapper():
    """A wrapper optimizer (ZeroRedundancyOptimizer around SGD) steps the model through its
    inner one: torch's step hook runs for both, and the name given is the wrapper's, the
    optimizer the script holds. Steps of the face itself, and of an optimizer of other
    parameters, are not another optimizer's step of the model."""
    import torch

    from hvd_onebit.ddp.foreign_steps import ForeignSteps

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, inner):
            self.inner = inner
            super().__init__(inner.param_groups, {})

        def step(self, closure=None):
            return self.inner.step(closure)

    w = torch.nn.Parameter(torch.ones(3))
    other = torch.nn.Parameter(torch.ones(3))
    w.grad, other.grad = torch.ones(3), torch.ones(3)
    ours = torch.optim.SGD([w], lr=0.1)
    foreign = ForeignSteps([w], lambda o: o is ours)
    seen = []
    for label, stepper in (("ours", ours), ("elsewhere", torch.optim.SGD([other], lr=0.1)),
                           ("wrapped", Wrapper(torch.optim.SGD([w], lr=0.1)))):
        foreign.watch()
        stepper.step()
        seen.append((label, foreign.stepped()))
    foreign.unwatch()
    assert seen == [("ours", None), ("elsewhere", None), ("wrapped", "Wrapper")], \
        f"the steppers named after each step: {seen}"


@pytest.mark.multirank
def test_a_model_whose_forward_never_runs_is_warned_about_once(world):
    """The optimizer given a DDP model while the script runs another DDP wrapper's forward (as
    when a trainer wrapped the module itself): that one averages every step in full precision,
    and the optimizer says so once; given the wrapper the script runs, nothing is said."""
    n, results = world
    for rank, r in enumerate(scenario(results, "another_wrapper")):
        assert len(r["other"]) == 1 and "self.trainer.strategy.model" in r["other"][0] \
            and r["run"] == [] and r["other_phase"] == r["run_phase"] == "compression", \
            f"n={n} rank {rank}: warnings given another wrapper {r['other']}, given the one " \
            f"run {r['run']}; phases {r['other_phase']}, {r['run_phase']}"


@pytest.mark.multirank
def test_a_wrapper_of_a_subclass_of_the_optimizers_class_steps_it_as_the_optimizer_does(world):
    """PyTorch Lightning's optimizer wrapper is an object of a subclass of the optimizer's class
    that reads the optimizer's attributes; zero_grad() on it recursed without end."""
    n, results = world
    for rank, r in enumerate(scenario(results, "wrapper_copy")):
        assert (r["differences"], r["phase"]) == ([], "compression"), \
            f"n={n} rank {rank}: stepped through the copy: {r['differences']}, {r['phase']}"


@pytest.mark.multirank
def test_a_rollback_between_backward_and_step_is_not_taken_for_another_optimizer(world):
    n, results = world
    for rank, r in enumerate(scenario(results, "rolled_back")):
        assert r == "accepted", f"n={n} rank {rank}: the step after a rollback loaded between " \
                                f"a backward and step(): {r}"


@pytest.mark.multirank
def test_a_copy_of_the_model_leaves_training_alone_and_the_model_pickles(world):
    """An EMA's deep copy, run forward between steps and between a forward and its backward,
    changes no bit; torch.save(model) works as with DDP + Adam and its copy leaves the
    optimizer alone; the optimizer itself is refused with what to save instead, and the copy
    takes an optimizer of its own."""
    n, results = world
    for rank, r in enumerate(scenario(results, "copied")):
        assert r["differences"] == [] and r["loaded"] == [], \
            f"n={n} rank {rank}: {r['differences']} {r['loaded']}"
        assert r["early_starts_by_the_loaded"] == 0, \
            f"n={n} rank {rank}: the loaded copy's backward started " \
            f"{r['early_starts_by_the_loaded']} of the optimizer's buckets"
        for key in ("pickled_opt", "copied_opt"):
            assert r[key].startswith("TypeError: an hvd_onebit optimizer is not pickled") and \
                "opt.state_dict()" in r[key], f"n={n} rank {rank}: {key}: {r[key]}"
        assert (r["second_on_the_copy"], r["copy_join"]) == ("accepted", "accepted"), \
            f"n={n} rank {rank}: an optimizer on the copy: {r['second_on_the_copy']}; the " \
            f"copy's join(): {r['copy_join']}"


@pytest.mark.multirank
def test_a_compression_phase_checkpoint_resumes_bit_identically(world):
    n, results = world
    for rank, r in enumerate(scenario(results, "checkpoint")):
        assert r["phase"] == "compression"
        assert r["differ"] == [], f"n={n} rank {rank}: the resumed run differs"
        # the error feedback is part of it: resumed without it, the run takes other steps
        assert r["differ_without_errors"] != [], \
            f"n={n} rank {rank}: the error feedback made no difference to the resumed run"


@pytest.mark.multirank
def test_a_state_taken_before_a_flush_at_the_same_step_saves_as_flushed(world):
    """torch's state_dict() hands out the live momenta, which the flush changes: a state taken
    before it (Lightning's, before on_save_checkpoint) resumes as the state taken after it,
    without the warning that the error feedback was dropped."""
    n, results = world
    for rank, r in enumerate(scenario(results, "flushed_after_taken")):
        assert (r["taken_warnings"], r["after_warnings"], r["differ"]) == ([], [], []), \
            f"n={n} rank {rank}: resumed from the state taken before the flush: warnings " \
            f"{r['taken_warnings']}, differences {r['differ']} (after it: {r['after_warnings']})"


@pytest.mark.multirank
def test_a_checkpoint_through_torch_distributed_checkpoint_keeps_what_it_left_out_known(world):
    """torch.distributed.checkpoint keeps the optimizer's state and param_groups alone: the
    record param group 0 carries still says the error feedback was not flushed (dropped with
    a warning, or loaded beside it for the uninterrupted run's bits), and that the auto freeze's
    record of the variance did not come with the state."""
    n, results = world
    for rank, r in enumerate(scenario(results, "dcp")):
        assert r["phase"] == "compression", r["phase"]
        kept, dropped, auto = r["with_errors"], r["without_errors"], r["auto"]
        assert kept["differ"] == [] and kept["warnings"] == [], \
            f"n={n} rank {rank}: with its error feedback: {kept}"
        assert dropped["differ"] != [], f"n={n} rank {rank}: the error feedback changed nothing"
        flushed = [w for w in dropped["warnings"] if "before its error feedback was flushed" in w]
        assert len(flushed) == 1, f"n={n} rank {rank}: warnings without it: {dropped['warnings']}"
        assert (auto["steps"], auto["phase"]) == (2, "warmup"), auto
        left_out = [w for w in auto["warnings"] if "without the checkpoint's record" in w]
        assert len(left_out) == 1, f"n={n} rank {rank}: auto's warnings {auto['warnings']}"
        # written without the record: the loading optimizer's own is not taken for it
        assert r["without_record"] == {"steps": FREEZE + 2, "freeze_step": FREEZE,
                                       "phase": "compression"}, r["without_record"]
        decided = r["decided"]  # past the decision, the decision itself comes back
        assert decided["phases"] == ["compression"] * 2 and decided["saved"] is not None and \
            decided["resumed"] == decided["saved"], f"n={n} rank {rank}: {decided}"


@pytest.mark.multirank
def test_a_flushed_checkpoint_resumes_on_another_number_of_ranks(world2, world4):
    saved = scenario(world2, "flushed")
    resumed = scenario(world4, "flushed")
    assert saved[0]["phase"] == "compression" and saved[0]["flushed_bytes"] > 0, saved[0]
    for rank, r in enumerate(resumed):
        assert (r["steps"], r["phase"]) == (saved[0]["steps"], "compression")
        assert differences(r["params_loaded"], saved[0]["params"], "loaded") == []
        assert all(math.isfinite(x) for x in r["losses"]), f"rank {rank}: losses {r['losses']}"
        assert (r["steps_after"], r["phase_after"]) == (saved[0]["steps"] + 3, "compression")
        assert differences(r["params"], resumed[0]["params"], "after") == [], \
            f"4 ranks: rank {rank} differs from rank 0 after resuming"
        assert differences(r["params"], r["params_loaded"], "moved") != [], \
            f"rank {rank}: the resumed steps changed nothing"
    # a job of one rank steps as Adam from the variance torch_adam_state_dict gives: the
    # frozen variance with the step count's bias correction made its first step several
    # times too large
    one = resumed[0]["one_rank"]
    assert one["differences"] == [] and one["first_moves"][0] == one["first_moves"][1], \
        f"one rank: {one['differences']}; first step's largest move, the face and plain Adam " \
        f"loaded with torch_adam_state_dict: {one['first_moves']}"


@pytest.mark.multirank
def test_reentrant_checkpointing_turns_the_overlap_off_once_saying_why(world):
    """A layer used in three reentrant-checkpointed segments takes its gradient in three parts
    in one backward: the overlap goes off at the first compressed step with the warning that
    says so (not one that blames a zero_grad()), and the bits are overlap=False's."""
    n, results = world
    for rank, r in enumerate(scenario(results, "reentrant")):
        on, off = r[True], r[False]
        assert on["phase"] == "compression" and off["warnings"] == [] and \
            len(on["warnings"]) == 1 and "completed more than once with no forward between" in \
            on["warnings"][0] and "use_reentrant=False keeps the overlap" in on["warnings"][0], \
            f"n={n} rank {rank}: warnings with the overlap on {on['warnings']}, off " \
            f"{off['warnings']} (phase {on['phase']})"
        assert differences(on["params"], off["params"], "overlap") == [], \
            f"n={n} rank {rank}: the overlap changed the steps of a reentrant-checkpointed model"


@pytest.mark.multirank
def test_a_scheduler_on_the_wrapped_adam_keeps_scheduling_after_a_state_dict_is_loaded(world):
    """torch's load_state_dict replaces the param groups' dicts; the face keeps the ones the
    wrapped Adam (and a scheduler built on it) holds, so the lr the scheduler sets after a
    resume is the one the steps read."""
    n, results = world
    for rank, r in enumerate(scenario(results, "inner_scheduler")):
        kept, reloaded = r["kept"], r["reloaded"]
        assert reloaded["face_lrs"] == reloaded["inner_lrs"] == kept["face_lrs"], \
            f"n={n} rank {rank}: after a state dict was loaded the face steps with lr " \
            f"{reloaded['face_lrs']}, the scheduler set {reloaded['inner_lrs']} on the wrapped " \
            f"Adam (never reloaded: {kept['face_lrs']})"
        assert differences(reloaded["params"], kept["params"], "reloaded") == [], \
            f"n={n} rank {rank}: loading the face's own state dict mid-run changed the steps"


@pytest.mark.multirank
def test_refusals_are_clear_on_every_rank(world):
    n, results = world
    for rank, r in enumerate(scenario(results, "refusals")):
        for case, said in (("model_state", "a model's state_dict() goes to"),
                           ("optimizer_state_as_errors", "'param_groups', 'state']"),
                           ("none_as_errors", "got NoneType")):
            assert r[case].startswith("TypeError") and said in r[case], \
                f"n={n} rank {rank}: {case}: {r[case]}"
        assert r["not_ddp"].startswith("TypeError") and "DistributedDataParallel" in r["not_ddp"], \
            f"n={n} rank {rank}: {r['not_ddp']}"
        for case in ("other_params", "wrong_model"):  # the latter's model has an optimizer
            assert r[case].startswith("ValueError") and \
                "not parameters the DDP model averages" in r[case], f"n={n} rank {rank}: {r[case]}"
        assert r["hooked"].startswith("ValueError") and "already has one" in r["hooked"], \
            f"n={n} rank {rank}: {r['hooked']}"
        assert r["python_reducer"].startswith("ValueError") and "torch's Python reducer" in \
            r["python_reducer"], f"n={n} rank {rank}: {r['python_reducer']}"
        assert r["nested"].startswith("ValueError") and "wraps another DDP model" in \
            r["nested"], f"n={n} rank {rank}: DDP around DDP: {r['nested']}"
        assert "not in a job of several ranks" not in r["not_ddp"], \
            f"n={n} rank {rank}: a job of {n} ranks told it is alone: {r['not_ddp']}"
        assert r["after"] == 1, f"n={n} rank {rank}: the model took no face after the refusals"
        assert r["original_changed"] == [] and r["after_original"] == 1, \
            f"n={n} rank {rank}: stepping the Adam the face wrapped changed parameters " \
            f"{r['original_changed']}; the face took {r['after_original']} step(s) after it"
        assert r["after_join"] == 1, \
            f"n={n} rank {rank}: {r['after_join']} steps after one step and a refused one in join()"
        for at, u in zip((1, 4), r["unfrozen"]):
            assert "take a gradient now that the DDP model does not average (inner.weight, " \
                   "inner.bias)" in u["error"], \
                f"n={n} rank {rank}: a layer unfrozen after DDP was built, before step {at}: " \
                f"{u['error']!r}"
            assert (u["steps"], u["changed"]) == (at, []), \
                f"n={n} rank {rank}: the refused step (before it {at} steps) left " \
                f"{u['steps']} steps and changed {u['changed']}"
        added = r["added"]
        assert "1 parameter(s) added to the optimizer are not the DDP model's (shapes [(3,)])" \
               in added["error"] and (added["steps"], added["changed"]) == (1, []), \
            f"n={n} rank {rank}: a parameter not in the model added to the optimizer after " \
            f"step 1: {added['error']!r}, {added['steps']} steps, changed {added['changed']}"
        wanted = {"reordered": "order, names, shapes or dtypes of their parameters (rank(s) "
                               f"[{n - 1}]",
                  "subset": f"rank {n - 1}: {r['parameters'] - 1} (",
                  "freeze_step": f"freeze_step (rank 0: 3, rank 1: {3 if n > 2 else 4}",
                  "options": f"differ in check_every (rank(s) [{n - 1}] unlike rank 0's)",
                  "transport": "takes no transport", "process_group": "got 'world'",
                  "sgd": "hvd_onebit.ddp.DistributedOptimizer wraps torch.optim.Adam",
                  "sparse": "sparse gradient; Adam needs dense gradients: the DDP face takes "
                            "dense gradients only",
                  "join": "does not train inside DDP's join() context (uneven inputs)",
                  "original": "this Adam was wrapped by hvd_onebit.ddp.DistributedOptimizer, "
                              "and the wrapper is the optimizer to step",
                  "float64": "hvd_onebit.ddp.DistributedOptimizer trains float32, float16 and "
                             "bfloat16 parameters; got torch.float64: 4 parameter(s), "
                             "inner.weight (float64), inner.bias (float64), out.weight",
                  "ignored": "1 of the optimizer's trainable parameters are among those DDP "
                             "was told to ignore (inner.bias); it trains only what the DDP model "
                             "averages",
                  "split": "1 parameter(s) the DDP model averages are not in this optimizer "
                           f"({r['split_name']}): in compressed steps DDP averages no gradient"}
        for case, part in wanted.items():
            assert r[case].split(":")[0] in ("ValueError", "TypeError") and part in r[case], \
                f"n={n} rank {rank} {case}: {r[case]!r}, want it to say {part!r}"
        assert r["ignored_frozen"] == "accepted", \
            f"n={n} rank {rank}: a frozen parameter DDP ignores, in the optimizer: " \
            f"{r['ignored_frozen']!r}"
        ams = r["amsgrad_set"]
        assert "amsgrad=True is not supported (set on a param group after the optimizer was " \
               "built" in ams["error"] and (ams["steps"], ams["changed"], ams["after"]) == \
               (FREEZE + 1, [], FREEZE + 2), \
            f"n={n} rank {rank}: amsgrad set after the freeze: {ams['error']!r}, " \
            f"{ams['steps']} steps, changed {ams['changed']}, {ams['after']} steps after"
        alone = {"bad_on_last": ("ValueError", "block_size must be None or a positive multiple of "
                                               "8, got 7"),
                 "sgd_on_last": ("TypeError", "hvd_onebit.ddp.DistributedOptimizer wraps "
                                              "torch.optim.Adam or torch.optim.AdamW; got "
                                              "torch.optim.sgd.SGD")}
        for case, (kind, said) in alone.items():
            by = "" if rank == n - 1 else \
                f"rank {n - 1} refused to build hvd_onebit.ddp.DistributedOptimizer: "
            assert r[case].startswith(f"{kind}: ") and f"{by}{said}" in r[case], \
                f"n={n} rank {rank} {case} (refused on rank {n - 1} alone): {r[case]!r}, want " \
                f"a {kind} saying {by + said!r}"
        if n == 4:  # two replicas over the pairs {0, 1} and {2, 3}
            pairs, pair = r["pairs"], "[0, 1]" if rank < 2 else "[2, 3]"
            crossed = f"[{rank % 2}, {rank % 2 + 2}]"
            wanted = {"crossed": f"process_group holds ranks {crossed}, the DDP model averages "
                                 f"over {pair}: they must be the same ranks",
                      "not_member": ("process_group holds ranks [0], the DDP model averages "
                                     "over [0, 1]" if rank == 0 else
                                     "process_group does not hold this rank"),
                      "hierarchical": "hierarchical 1-bit runs on every rank of the job: the "
                                      "group has 2 of 4"}
            for case, part in wanted.items():
                assert pairs[case].startswith("ValueError") and part in pairs[case], \
                    f"rank {rank} {case}: {pairs[case]!r}, want it to say {part!r}"
            assert len(pairs["auto"]) == 1 and "hierarchical='auto' stays flat on a group of " \
                "2 of the job's 4 ranks" in pairs["auto"][0] and pairs["pair_identical"] and \
                pairs["phase"] == "compression", \
                f"rank {rank}: hierarchical='auto' on a pair: warnings {pairs['auto']}, the " \
                f"pair the same bits: {pairs['pair_identical']}, phase {pairs['phase']}"


@pytest.mark.multirank
def test_a_compiled_training_step_with_the_optimizers_step_inside_trains_as_eager(world):
    """``opt.step()`` inside a ``torch.compile``'d function (with zero_grad, forward and
    backward) runs eagerly there: the same bits as the eager steps, through the freeze."""
    n, results = world
    for rank, r in enumerate(scenario(results, "compiled_step")):
        assert r["phase"] == "compression" and not r["differences"], \
            f"n={n} rank {rank}: phase {r['phase']}, {r['differences']}"


@pytest.mark.multirank
def test_hierarchical_on_one_node_warns_naming_how_torchrun_numbers_nodes(world):
    """Every rank on one host: hierarchical=True trains (flat 1 bit has no stage between nodes)
    and warns that nothing travels in 1 bit, naming torchrun's numbering of nodes under
    torchrun rather than horovodrun's -H; without torchrun's layout it is refused."""
    n, results = world
    for rank, r in enumerate(scenario(results, "one_node_hierarchical")):
        if n == 3:  # DDP in a horovodrun job: no torchrun to number the nodes
            assert r["refused"].startswith("ValueError") and \
                "hierarchical 1-bit needs torchrun's node layout" in r["refused"], \
                f"rank {rank}: {r['refused']!r}"
            continue
        assert r["phase"] == "compression", f"n={n} rank {rank}: phase {r['phase']}"
        said = [w for w in r["warnings"] if f"hierarchical=True on one node of {n} ranks" in w
                and "nothing travels in 1 bit" in w]
        assert len(said) == 1 and "torchrun" in said[0] and "-H" not in said[0], \
            f"n={n} rank {rank}: warnings {r['warnings']}"


@pytest.mark.multirank
def test_a_batch_skipped_after_its_backward_leaves_no_trace(world):
    """Zeroed by opt.zero_grad() or model.zero_grad(), after the last of two backward passes
    or inside no_sync() after the first, under a GradScaler: the run goes on as if the batch
    had not been computed, and the buckets keep starting during backward."""
    n, results = world
    for rank, runs in enumerate(scenario(results, "skipped_batch")):
        assert sorted(runs) == sorted(SKIPS), f"n={n} rank {rank}: runs {sorted(runs)}"
        for how, r in runs.items():
            what = f"n={n} rank {rank}, skipped ({how})"
            # inside no_sync() no hook starts a bucket: nothing to start again
            half = SKIPS[how].passes < SKIPS[how].micro
            assert (r["started"] == 0) == half, \
                f"{what}: {r['started']} buckets started from the hooks before the skip"
            assert r["differences"] == [], f"{what}: {r['differences']}"
            steps = 5 if half else 4  # the compressed steps from the skip's on, or after it
            want = (steps * r["buckets"], 0 if half else 1, [])
            got = (r["early_after"], r["restarts"], r["overlap_warnings"])
            assert got == want, \
                f"{what}: after the skip, {got[0]} buckets started during backward (expected " \
                f"{want[0]}), {got[1]} steps started again (expected {want[1]}), overlap " \
                f"warnings {got[2]}"


@pytest.mark.multirank
def test_a_forward_without_backward_before_a_compressed_step_keeps_the_overlap(world):
    """A forward that armed DDP's reducer with no backward since (the warmup's last step taken
    without one): DDP reduces in the next backward although the compressed step turned its
    sync off, writing the gradients again after their hooks. That step starts its buckets in
    step() instead, with no warning, and the later steps start theirs during backward."""
    n, results = world
    for rank, r in enumerate(scenario(results, "forward_without_backward")):
        plain, extra = r["plain"], r["extra"]
        assert r["differences"] == [], f"n={n} rank {rank}: {r['differences']}"
        assert (extra["restarts"], extra["warnings"]) == (0, []), \
            f"n={n} rank {rank}: {extra['restarts']} restarts, warnings {extra['warnings']}"
        first = plain["early"] // 4  # the first of the four compressed steps' buckets
        assert (plain["early"], extra["early"]) == (4 * first, 3 * first) and first > 0, \
            f"n={n} rank {rank}: buckets started during backward {extra['early']}, without the " \
            f"forward {plain['early']}: the first compressed step's should start in step()"


@pytest.mark.multirank
def test_a_forward_that_raises_in_the_compression_phase_leaves_ddp_sync_as_it_was(world):
    """A caught exception in a compressed step's forward (after the optimizer turned DDP's
    gradient sync off for it) leaves the sync on, so the refresh steps after it are averaged
    by DDP: the run is the same bits as one without the failed forwards."""
    n, results = world
    for rank, r in enumerate(scenario(results, "forward_raises")):
        assert r["errors"] == ["RuntimeError"] * 2 and r["sync_after"] == [True, True], \
            f"n={n} rank {rank}: forwards raised {r['errors']}, DDP's sync after each " \
            f"{r['sync_after']}"
        assert r["refreshes"] >= 2 and r["differences"] == [], \
            f"n={n} rank {rank}: {r['refreshes']} refresh steps; {r['differences']}"


@pytest.mark.multirank
def test_a_forward_that_writes_a_parameter_in_place_is_not_another_optimizers_step(world):
    """An embedding's max_norm renormalises its rows in every forward: two passes a compressed
    step without no_sync() train through, alike on every rank."""
    n, results = world
    runs = scenario(results, "written_in_forward")
    for rank, r in enumerate(runs):
        assert (r["phase"], r["local_steps"]) == ("compression", 6), \
            f"n={n} rank {rank}: phase {r['phase']}, {r['local_steps']} local passes"
        assert differences(runs[0]["params"], r["params"], f"rank {rank} vs 0") == [], \
            f"n={n} rank {rank}: {differences(runs[0]['params'], r['params'], 'vs rank 0')}"


@pytest.mark.multirank
def test_gradients_accumulated_without_no_sync_keep_the_overlap(world):
    """Every backward pass with DDP's sync on, several a step: the buckets start from the hooks
    of the step's last pass, as many into the step as the last step had. A step with a pass
    more starts them again in step(), quietly, also at two steps in a row (a pass more is no
    batch skipped); one with a pass fewer starts them there; the steps after either start
    during backward again. The same bits as overlap=False."""
    n, results = world
    for rank, r in enumerate(scenario(results, "accumulated")):
        on, off = r["overlap"], r["off"]
        assert r["differences"] == [], f"n={n} rank {rank}: {r['differences']}"
        assert (on["restarts"], on["warnings"]) == (2, []), \
            f"n={n} rank {rank}: {on['restarts']} restarts, warnings {on['warnings']}"
        b = on["early"][0]
        assert on["early"] == [b, b, b, b, b, 0, b] and b > 0 and off["early"] == [0] * 7, \
            f"n={n} rank {rank}: buckets started during backward by step, with the passes " \
            f"2, 2, 3, 4, 4, 1, 1: {on['early']} (overlap=False: {off['early']})"


@pytest.mark.multirank
def test_an_empty_parameter_and_one_listed_twice_keep_the_overlap(world):
    """A parameter of no elements whose gradient is a view of DDP's bucket, and a param group
    listing a parameter twice: every compressed step starts its buckets during backward, and
    none is started again."""
    n, results = world
    for rank, r in enumerate(scenario(results, "odd_parameters")):
        assert (r["restarts"], r["warnings"]) == (0, []), \
            f"n={n} rank {rank}: {r['restarts']} restarts, warnings {r['warnings']}"
        assert r["early"] == 4 * r["buckets"] > 0, \
            f"n={n} rank {rank}: {r['early']} buckets started during backward in 4 compressed " \
            f"steps of {r['buckets']} buckets"


@pytest.mark.multirank
def test_changes_between_backward_and_step_give_the_bits_without_overlap(world):
    """Between a compressed step's backward and its step(), on every rank: a layer frozen (and
    unfrozen two steps later), the error feedback flushed, decoupled_weight_decay turned on, a
    weight given new memory (p.data = ..., which Adam's L2 decay reads): the same bits as with
    overlap=False, the last two with the overlap's warning. Adam's state replaced by another
    mapping is refused by step() and by state_dict() on every rank, and an entry of it removed
    between backward and step() too, naming the parameter: put back, the steps go on from
    their gradient hooks, the ranks identical."""
    n, results = world
    runs = scenario(results, "changed_mid_step")
    for rank, r in enumerate(runs):
        for name, warned in (("requires_grad", False), ("flush", False), ("decoupled", True),
                             ("data", True)):
            assert r[name]["differences"] == [], f"n={n} rank {rank}: {r[name]['differences']}"
            assert bool(r[name]["warnings"]) == warned, \
                f"n={n} rank {rank}: {name}: the overlap's warnings {r[name]['warnings']}"
        for call, said in r["replaced"].items():
            assert said.startswith("RuntimeError") and "opt.state = " in said, \
                f"n={n} rank {rank}: {call} with opt.state replaced: {said}"
        popped = r["popped"]
        assert "parameter out.weight lacks" in popped["step"], \
            f"n={n} rank {rank}: step() after opt.state.pop(out.weight): {popped['step']}"
        assert popped["early"] == 2 * popped["buckets"], \
            f"n={n} rank {rank}: {popped['early']} buckets started during backward in the 2 " \
            f"steps after, of {popped['buckets']} a step"
        assert differences(runs[0]["popped"]["params"], popped["params"], "vs rank 0") == [], \
            f"n={n} rank {rank}: {differences(runs[0]['popped']['params'], popped['params'], '')}"


@pytest.mark.multirank
def test_gradients_kept_as_ddp_bucket_views_keep_the_overlap(world):
    """gradient_as_bucket_view=True and zero_grad(set_to_none=False), the way to keep DDP's
    buckets as the gradients' memory: the layers' gradients accumulate into one DDP bucket
    (one version counter) after the optimizer's first bucket started; that is backward, not a
    change (it was taken for one: the buckets started again, the overlap off). A step with a
    pass more is one: its buckets start again, quietly, and the bits are overlap=False's."""
    n, results = world
    for rank, r in enumerate(scenario(results, "bucket_views")):
        on = r["overlap"]
        assert r["differences"] == [], f"n={n} rank {rank}: {r['differences']}"
        assert (on["restarts"], on["warnings"]) == (1, []) and on["early"] >= 4, \
            f"n={n} rank {rank}: {on['restarts']} restarts (expected 1: the step of two " \
            f"passes), {on['early']} buckets started during backward, warnings {on['warnings']}"
        assert on["storages"] == r["off"]["storages"] == 1, \
            f"n={n} rank {rank}: the gradients in {on['storages']} storages, not DDP's bucket"


@pytest.mark.multirank
def test_grad_scaler_through_a_wrapper_hiding_its_argument_is_refused_and_nothing_lost(world):
    """GradScaler.step() through a wrapper of opt.step without its grad_scaler argument (as
    Accelerate's fp16 wraps it) hands over each rank's own overflow flag as attributes: refused
    on every rank, in a warmup step and in a compressed step (whose buckets started during
    backward), with nothing stepped; the run then goes on as one that never met it (it failed
    inside torch's Adam with an AssertionError). At more than 2 ranks the refused backward was
    DDP's first iteration, after which DDP sums in another bucket order: the last bits."""
    n, results = world
    for rank, r in enumerate(scenario(results, "scaler_wrapped")):
        assert len(r["errors"]) == 2 and all(
            e.startswith("hvd_onebit: GradScaler.step() reached this optimizer's step() through "
                         "a wrapper") and "functools.wraps(opt.step)" in e for e in r["errors"]), \
            f"n={n} rank {rank}: {r['errors']}"
        assert r["after_leftovers"] == 1, \
            f"n={n} rank {rank}: a step through scaler.step(opt) with the attributes a raised " \
            f"closure leaves: {r['after_leftovers']}"
        assert r["steps_after_refusal"] == [0, 3], \
            f"n={n} rank {rank}: steps after each refusal {r['steps_after_refusal']} (expected " \
            f"0 and 3: nothing stepped)"
        assert r["differences"] == [] if n == 2 else r["max_diff"] < 1e-6, \
            f"n={n} rank {rank}: then {r['differences']}"


@pytest.mark.multirank
def test_step_with_a_closure_is_backward_then_step(world):
    n, results = world
    for rank, r in enumerate(scenario(results, "closure")):
        assert r["refreshes"] > 0, f"n={n} rank {rank}: no refresh step in the run"
        assert r["differences"] == [], f"n={n} rank {rank}: {r['differences']}"
        assert all(isinstance(x, float) for x in r["losses"]), \
            f"n={n} rank {rank}: step(closure) returned {r['losses']}"


@pytest.mark.multirank
def test_an_inf_written_into_one_ranks_averaged_gradient_skips_the_step_everywhere(world):
    """A full-precision step decides its skip from DDP's averages, alike on every rank unless a
    script changes one rank's: the ranks agree (a warmup step, a variance refresh step)."""
    n, results = world
    runs = scenario(results, "averaged_poisoned")
    for rank, run in enumerate(runs):
        counts = [{k: v for k, v in r.items() if k != "params"} for r in run]
        assert run == runs[0], f"n={n}: rank {rank}'s steps, skips or parameters differ from " \
                               f"rank 0's; rank {rank}'s counts: {counts}"
    rows = runs[0]
    assert [r["skipped"] for r in rows] == [0, 1, 1, 1, 1, 2, 2, 2], rows
    assert rows[5]["phase"] == "compression" and rows[5]["refreshes"] == rows[4]["refreshes"] \
        < rows[6]["refreshes"], f"n={n}: iteration 5 must be a skipped refresh step: {rows}"


@pytest.mark.multirank
def test_one_host_read_per_step_with_lr_and_betas_as_floats_or_tensors(world):
    """Each read of a tensor's value is a device-to-host sync on a GPU. A step reads once: its
    ranks' agreement (a full-precision step, the finiteness of the averaged gradients in it) or
    its buckets' statuses (a compressed step), through a GradScaler too (its overflow flags
    travel in the agreement). Tensor options are read once more, when first met or changed;
    the first compressed step also scans the frozen variance."""
    n, results = world
    for rank, r in enumerate(scenario(results, "host_reads")):
        floats, tensors = r["floats"]["counts"], r["tensors"]["counts"]
        once = [(0, 1)] * FREEZE
        assert floats == once + [(1, 1)] + once[:len(floats) - FREEZE - 1], \
            f"n={n} rank {rank}: reads per step (backward, step()) with float options {floats}"
        assert tensors == floats[:FREEZE] + [(2, 1)] + floats[FREEZE + 1:], \
            f"n={n} rank {rank}: reads per step with tensor options from the freeze {tensors}"
        assert r["scaled"]["counts"] == floats, \
            f"n={n} rank {rank}: reads per step through a GradScaler {r['scaled']['counts']}"
        assert differences(r["tensors"]["params"], r["floats"]["params"], "params") == [], \
            f"n={n} rank {rank}: tensor options stepped otherwise than their float values"


@pytest.mark.multirank
def test_a_nonfinite_value_on_one_rank_skips_the_step_on_every_rank(world):
    n, results = world
    runs = scenario(results, "grad_scaler")
    for rank, run in enumerate(runs):
        assert run == runs[0], f"n={n}: rank {rank}'s steps, scales or parameters differ"
    rows = runs[0]
    steps = [r["steps"] for r in rows]
    assert steps == [1, 1, 2, 3, 4, 4, 5, 6], steps
    assert (rows[1]["phase"], rows[5]["phase"]) == ("warmup", "compression")
    assert [r["skipped"] for r in rows] == [0, 1, 1, 1, 1, 2, 2, 2]
    scales = [r["scale"] for r in rows]
    assert scales == [256.0, 128.0, 128.0, 128.0, 128.0, 64.0, 64.0, 64.0], scales
    for it in (1, 5):  # the skipped steps left the parameters as they were
        assert rows[it]["params"] == rows[it - 1]["params"], f"iteration {it} moved parameters"


@pytest.mark.multirank
def test_the_ddp_face_never_imports_horovod(world2, world4):
    # torchrun's ranks cannot import Horovod (as where it is not installed): after every
    # scenario, nothing had tried, and the Horovod face is the package's still, imported on
    # first use, which needs Horovod
    for n, results in ((2, world2), (4, world4)):
        for rank, r in enumerate(scenario(results, "horovod_unused")):
            assert r["loaded"] == [], f"n={n} rank {rank}: Horovod modules {r['loaded']}"
            assert r["horovod_face"].startswith("ImportError"), \
                f"n={n} rank {rank}: the Horovod face without Horovod: {r['horovod_face']}"


@pytest.mark.multirank
def test_the_example_trains_under_torchrun_without_horovod():
    rc, text = run_torchrun_script(2, REPO / "examples" / "ddp_train.py", ["--steps", "40"])
    assert rc == 0, f"exit status {rc}:\n{text[-4000:]}"
    summary, _ = json.JSONDecoder().raw_decode(text[text.index("{\n"):])
    assert (summary["ranks"], summary["steps"], summary["phase"]) == (2, 40, "compression")
    assert summary["telemetry"]["steps"] == 40
    assert np.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(4), summary


@pytest.fixture(scope="module")
def script_end():
    """tests/scripts/ddp_exit.py on 2 ranks: its exit status, output and each rank's report."""
    rc, text = run_torchrun_script(2, REPO / "tests" / "scripts" / "ddp_exit.py", ["--steps", "6"])
    reports = sorted((json.loads(line) for line in text.splitlines()
                      if line.startswith('{"rank"')), key=lambda r: r["rank"])
    return rc, text, reports


@pytest.mark.multirank
def test_an_optimizer_dropped_with_its_model_is_freed(script_end):
    """The parameters' gradient hooks hold the optimizer weakly: once the script drops the model
    and the optimizer, its state and its error feedback go too."""
    rc, text, reports = script_end
    assert [r["rank"] for r in reports] == [0, 1], f"exit status {rc}:\n{text[-4000:]}"
    for r in reports:
        assert (r["phase"], r["steps"]) == ("compression", 6), r
        assert r["freed"], f"rank {r['rank']}: the dropped optimizer is still alive after " \
                           f"gc.collect(): {r}"


@pytest.mark.multirank
def test_a_rank_that_exits_right_after_a_collective_exits_cleanly(script_end):
    """A process that ends while Gloo's threads still hold its last collective's tensor (their
    drop of it waits for the GIL) is not aborted at the interpreter's exit, and torchrun reports
    the job done."""
    rc, text, _ = script_end
    assert rc == 0 and "terminate called" not in text, f"exit status {rc}:\n{text[-4000:]}"


@pytest.mark.multirank
def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(tmp_path):
    import torch

    steps, every, kill_at = 16, 3, 11
    rc, text = run_torchrun_script(2, REPO / "tests" / "scripts" / "ddp_restart.py",
                                   ["--dir", str(tmp_path), "--steps", str(steps),
                                    "--every", str(every), "--kill-at", str(kill_at)],
                                   max_restarts=1, env=RESTARTABLE)
    assert rc == 0, f"exit status {rc}:\n{text[-4000:]}"
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed == {"rank": 1, "step": kill_at}, killed
    resumed_from = kill_at // every * every  # the last checkpoint before the worker died
    runs = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank, run in enumerate(runs):
        assert (run["size"], run["attempt"], run["resumed_from"]) == (2, 1, resumed_from), \
            f"rank {rank}: size, restart count and resumed step {run['size']}, " \
            f"{run['attempt']}, {run['resumed_from']}"
        assert (run["steps"], run["phase"]) == (steps, "compression"), (run["steps"], run["phase"])
        assert len(run["losses"]) == steps - resumed_from
        assert all(math.isfinite(x) for x in run["losses"]), f"rank {rank}: {run['losses']}"
        params = [p.numpy() for p in run["params"]]
        assert differences(params, [p.numpy() for p in runs[0]["params"]], "final") == [], \
            f"rank {rank} ends with other parameters than rank 0"
        # the restart lost nothing: the run taken without interruption ends on the same bits
        assert differences(params, [p.numpy() for p in run["uninterrupted"]], "final") == [], \
            f"rank {rank}: the resumed run and the uninterrupted one differ"


def assert_faces_agree(n: int, runs: list[dict], what: str, first: int = 0) -> None:
    """Both faces went through the warmup and the compression phase in step, and from step
    ``first`` on took the same gradients and ended each step on the same parameters, on every
    rank; every rank ends on rank 0's parameters."""
    steps = FREEZE + FACES_COMPRESSED
    phases = [("warmup", "warmup")] * (FREEZE - 1) + [("compression", "compression")] * (
        FACES_COMPRESSED + 1)
    for rank, r in enumerate(runs):
        assert (r["steps"], r["phases"]) == ((steps, steps), phases), \
            f"n={n} rank {rank} ({what}): steps {r['steps']}, phases {r['phases']}"
        assert r["initial"] == [], f"n={n} rank {rank} ({what}): {r['initial']}"
        assert r["buckets"][0] == r["buckets"][1] > 1, \
            f"n={n} rank {rank} ({what}): the faces' momentum buckets {r['buckets']}"
        for step in range(first, steps):
            assert r["grads"][step] == [], \
                f"n={n} rank {rank} ({what}): the faces took other gradients: {r['grads'][step]}"
            assert r["params"][step] == [], \
                f"n={n} rank {rank} ({what}): the faces' parameters differ: {r['params'][step]}"
        assert r["digest"] == runs[0]["digest"], \
            f"n={n} ({what}): rank {rank}'s parameters differ from rank 0's"


@pytest.mark.multirank
def test_the_faces_take_the_same_steps_through_every_phase(faces_through):
    runs = faces_through
    assert_faces_agree(2, runs, "Horovod's own average")
    for rank, r in enumerate(runs):
        # refresh steps (each face's averaging) and 1-bit steps (gradients kept local)
        # alternate after the freeze
        assert r["refreshes"][0] == r["refreshes"][1] > 0, f"rank {rank}: {r['refreshes']}"
        assert r["local_steps"] == FACES_COMPRESSED - r["refreshes"][1], \
            f"rank {rank}: {r['local_steps']} local steps, {r['refreshes']} refreshes"


@pytest.mark.multirank
def test_the_faces_take_the_same_one_bit_steps_from_a_state_common_at_the_freeze(faces):
    n, results = faces
    runs = scenario(results, "from_freeze")
    # the DDP face resumed the Horovod face's checkpoint (model and optimizer) at the freeze
    for rank, r in enumerate(runs):
        assert r["synced"] == [], f"n={n} rank {rank}: {r['synced']}"
        assert (r["refreshes"], r["local_steps"]) == ((0, 0), FACES_COMPRESSED), \
            f"n={n} rank {rank}: refreshes {r['refreshes']}, local steps {r['local_steps']}"
    assert_faces_agree(n, runs, "common state at the freeze", first=FREEZE)
