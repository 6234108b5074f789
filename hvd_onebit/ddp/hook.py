"""The DDP face's hold on its DDP model: DDP's own averaging while gradients are averaged (the
warmup, variance refresh steps), through the communication hook; in the compression phase, where
the momentum travels in 1 bit instead, DDP's gradient synchronisation is taken off for the step
(as ``model.no_sync()`` does), so DDP neither copies the gradients into its buckets nor back,
and each parameter's gradient hook tells the overlap (:mod:`hvd_onebit.overlap`) that the
gradient is final: the engine's buckets start from there, the rest in step().

A user's own ``no_sync()`` keeps its meaning: a backward pass inside it accumulates, and starts
nothing; the pass after it does.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..eager import eager
from ..overlap import Overlap
from .foreign_steps import ForeignSteps
from .weak_hooks import weakly

ALREADY_HOOKED = (
    "hvd_onebit.ddp.DistributedOptimizer registers its own communication hook on the DDP model, "
    "and DDP allows one; this model already has one (register_comm_hook was called on it). "
    "Wrap a model without a hook")


ALREADY_OURS = (
    "this DDP model is already trained by an hvd_onebit.ddp.DistributedOptimizer, whose "
    "communication hook it keeps (DDP allows one). To build the optimizer again, wrap the module "
    "in DDP again (model = DDP(model.module, ...)), build the optimizer on that, and load the "
    "old optimizer's state_dict() into it")


JOIN_REFUSED = (
    "hvd_onebit.ddp.DistributedOptimizer does not train inside DDP's join() context (uneven "
    "inputs): a rank that has run out of batches shadows DDP's gradient allreduce only, not "
    "the compressed steps or the agreement each step takes, so the other ranks would wait for "
    "it forever (DDP keeps the model's join setting after the context: wrap the module in DDP "
    "again to train on). Give every rank the same number of batches (e.g. DistributedSampler "
    "with drop_last=True); nothing was changed by this forward")


NEVER_RUN = (
    "hvd_onebit.ddp.DistributedOptimizer: a step was taken on gradients while the DDP model it "
    "was given has run no forward with gradients since it was built (its module hooks never "
    "ran), so the gradients did not come from its forward: from another DDP wrapper of the "
    "same module (PyTorch Lightning's, Accelerate's, Hugging Face Trainer's), which averages "
    "every step in full precision, so 1-bit Adam saves nothing; from model.forward(...), "
    "which skips the hooks the same way; or from model.module(...), which DDP does not "
    "average. Pass the DDP model the script runs, as model(x) (Lightning: "
    "self.trainer.strategy.model, in configure_optimizers; Trainer: set "
    "trainer.model_wrapped to it). (Gradients set by hand for a first step are no such case.)")

STEPPED_ELSEWHERE = (
    "hvd_onebit.ddp.DistributedOptimizer: the DDP model's parameters were stepped by another "
    "optimizer ({name}) since its last compressed step's forward, without this optimizer's "
    "step(): another optimizer steps the model while this one still holds it, and this one "
    "takes DDP's gradient sync off in the steps it counts as compressed, so that step was "
    "taken on each rank's own gradients (the ranks may now differ). To hand the model to "
    "another optimizer, drop this one first (del it, and whatever refers to it, such as an LR "
    "scheduler) or wrap the module in DDP again (model = DDP(model.module)); nothing was "
    "changed by this forward. (A write of the script's own, such as a weight clip under "
    "torch.no_grad(), is no such step.)")


PYTHON_REDUCER = (
    "this DDP model runs torch's Python reducer (built with "
    "torch._dynamo.config.optimize_ddp='python_reducer', which compiled autograd needs under "
    "DDP), and it calls a communication hook with one gradient, not a bucket: such hooks are "
    "not DDP's (torch's own allreduce_hook fails there too). Build the DDP model with "
    "compiled autograd off and optimize_ddp at another setting (torch.compile of the model "
    "works)")


def first_static_iteration(model) -> bool:
    """Whether ``model`` (a DDP module) was built with ``static_graph=True`` and has not run its
    first iteration: DDP records the graph in that iteration's backward, through its gradient
    sync, and its reducer asserts if that sync is off (a fresh DDP model whose first step is a
    compressed one: a resumed run, the optimizer built again)."""
    return bool(getattr(model, "static_graph", False)) and \
        not getattr(model, "_static_graph_delay_allreduce_enqueued", True)


def average(group, buffer: torch.Tensor) -> torch.futures.Future:
    """DDP's own averaging of a bucket, bit for bit: each gradient times 1/n, as DDP's reducer
    scales them into the bucket when no hook is registered (torch's ``allreduce_hook`` divides by
    n instead, which rounds otherwise where 1/n is inexact), then the allreduce's sum."""
    buffer.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


class HookState:
    """The state DDP hands :func:`onebit_comm_hook`: the optimizer's hooks held weakly (once the
    optimizer is gone, DDP's own averaging over ``group``). A model pickled or copied keeps it
    detached: DDP builds the copy's reducer again, without the hook."""

    __slots__ = ("_ref", "group")

    def __init__(self, hook: Optional["CommHook"] = None) -> None:
        self._ref = None if hook is None else weakref.ref(hook)
        self.group = None if hook is None else hook.group

    @property
    def detached(self) -> bool:
        return self._ref is None

    def hook(self) -> Optional["CommHook"]:
        return None if self._ref is None else self._ref()

    def __reduce__(self):
        return HookState, ()


def onebit_comm_hook(state: HookState, bucket):
    """DDP's communication hook (a module's function, so a DDP model pickles): the optimizer's
    own, or DDP's averaging once it is gone. DDP reads the parameter named ``bucket``."""
    if isinstance(bucket, tuple):  # (gradient, parameter): torch's Python reducer
        raise RuntimeError(f"hvd_onebit.ddp.DistributedOptimizer: {PYTHON_REDUCER}")
    alive = state.hook()
    return average(state.group, bucket.buffer()) if alive is None else alive.communicate(
        state, bucket)


def check_unhooked(model) -> None:
    """Raise a ValueError if ``model`` (a DDP module) has a communication hook already (a copy's
    detached one is not: its reducer has none)."""
    hooks = [state for _, state in getattr(model, "_comm_hooks", None) or ()
             if not (isinstance(state, HookState) and state.detached)]
    if hooks:
        ours = any(isinstance(state, HookState) for state in hooks)
        raise ValueError(ALREADY_OURS if ours else ALREADY_HOOKED)


class CommHook:
    """One optimizer's hooks on its DDP model, and what they count.

    Args:
        group: the process group DDP averages over.
        averaging: whether the coming step takes averaged gradients (decided from the step count,
            alike on every rank, so every rank's hooks do the same).
        overlap: the :class:`~hvd_onebit.overlap.Overlap` told of each gradient that is final
            for a compressed step; None: every bucket starts in step().
        watch, unwatch: the stall watch's begin and end (:mod:`hvd_onebit.stall`) of each of
            DDP's gradient allreduces, which DDP waits for in backward, outside step().
    """

    def __init__(self, group, averaging: Callable[[], bool], overlap: Optional[Overlap],
                 watch: Callable[[str], object], unwatch: Callable[[object], None],
                 ours: Callable[[object], bool]):
        """``ours(optimizer)``: whether a torch optimizer is the face this hook serves."""
        self.group = group
        self._ours = ours
        self._foreign: Optional[ForeignSteps] = None
        self._averaging = averaging
        self._overlap = overlap
        self._watch, self._unwatch = watch, unwatch
        self._final = True  # this backward ends the step (not inside the user's no_sync())
        self._local = False  # this forward's step is compressed: DDP's sync taken off
        # this compressed step's backward goes through DDP's sync: DDP's first iteration with
        # static_graph, or a reducer still armed by a forward with its sync on (in a step that
        # averages) whose backward never came; communicate() hands each bucket back as it is
        # (the gradients stay this rank's)
        self._through_ddp = False
        self._armed = False  # a forward armed DDP's reducer and no backward has reduced since
        # Gradient accumulation without no_sync(): training forwards with DDP's sync on since the
        # last step() or zero_grad() (the optimizer's, or gradients set to None), and how many
        # the last step had. The gradients are final (the buckets start from the hooks) at the
        # pass that many into a step; a step with a pass more has its buckets started again in
        # step() (the overlap's own check), one with a pass fewer starts them there.
        self._passes = 0
        self._expected_passes = 1
        self._last_pass = True
        self._completed: set = set()  # parameters whose gradient this pass's backward completed
        self.local_steps = 0  # forwards whose step kept its gradients local, over the run
        # The gradients are this rank's own: the last step's backward kept them local (a
        # compressed step's), and nothing averaged them since.
        self.gradients_local = False
        # With find_unused_parameters, the parameters that took a gradient in a local backward
        # since the last averaged one (DDP's reducer counts them as used: see _before_forward)
        self._used_locally: Optional[set] = None
        self._refused = False  # the forward under way was refused by _before_forward
        self.training_forwards = 0  # forwards with gradients on, since it was registered
        self._told_never_run = False

    def register(self, model) -> None:
        """Register on ``model`` (a DDP module); raises a ValueError if it has a hook already."""
        check_unhooked(model)
        try:
            model.register_comm_hook(state=HookState(self), hook=onebit_comm_hook)
        except RuntimeError as exc:  # a builtin hook, registered on the reducer alone
            if "once" in str(exc):
                raise ValueError(ALREADY_HOOKED) from exc
            raise
        self._foreign = ForeignSteps(model.module.parameters(), self._ours)
        model.register_forward_pre_hook(weakly(self._before_forward))
        # called when the forward raises too: the user's sync setting comes back either way
        model.register_forward_hook(weakly(self._after_forward), always_call=True)
        if getattr(model, "find_unused_parameters", False):
            self._used_locally = set()
        if self._overlap is not None or self._used_locally is not None:
            for p in model.module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(weakly(self._gradient_final))

    def _before_forward(self, model, args) -> None:
        """A compressed step's forward: DDP's gradient sync off for it, as no_sync() does, unless
        the user's no_sync() has it off already (then this pass only accumulates). A training
        forward under ``model.join()`` is refused on every rank (DDP keeps a model's join
        setting after the context, so it is refused there too; evaluation is not)."""
        join = getattr(model, "_join_config", None)
        refusal = None
        if join is not None and join.enable and torch.is_grad_enabled():
            refusal = JOIN_REFUSED
        elif torch.is_grad_enabled() and (stepper := self._foreign.stepped()):
            refusal = STEPPED_ELSEWHERE.format(name=stepper)
        if refusal is not None:
            self._refused = True  # the forward hook (always called) records nothing of it
            raise ValueError(refusal)
        self._final = model.require_backward_grad_sync
        self.training_forwards += torch.is_grad_enabled()
        self._local = torch.is_grad_enabled() and not self._averaging()
        if torch.is_grad_enabled() and self._final:
            if self._passes and not any(p.grad is not None for p in model.module.parameters()):
                self._passes = 0  # the passes before were zeroed (set to None): a skipped batch
            self._passes += 1
            self._last_pass = self._passes >= self._expected_passes
            self._completed.clear()
            if self._passes > self._expected_passes and self._overlap is not None:
                self._overlap.pass_again()  # onto the gradients the last pass's hooks started
            self.gradients_local = self._local
        if self._used_locally and torch.is_grad_enabled() and not self._local:
            # DDP's reducer (find_unused_parameters) counts a parameter whose gradient a local
            # backward accumulated as used at the next averaged backward, as it does across
            # no_sync() passes, and refuses it there if its gradient is None since
            # (zero_grad between our compressed steps, unlike no_sync()'s accumulation): it
            # takes a zero gradient instead, which DDP averages.
            for p in self._used_locally:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._used_locally.clear()
        self._through_ddp = self._local and self._final and (
            self._armed or first_static_iteration(model))
        if self._local:
            if not self._through_ddp:
                model.require_backward_grad_sync = False
            if self._final:
                self.local_steps += 1
        if torch.is_grad_enabled() and model.require_backward_grad_sync:
            self._armed = True  # DDP's forward arms its reducer for the next backward

    def _after_forward(self, model, args, output) -> None:
        """The user's own setting back, and the buffers synchronised at the next forward as DDP
        would have decided with it. The parameters' versions are read after the forward: one
        that writes a parameter in place (an embedding's ``max_norm``) is not another
        optimizer's step. Nothing of a refused forward: a retry is refused again."""
        if self._refused:
            self._refused = False
            return
        if self._local and self._final:
            # watched from a compressed step's forward with DDP's sync on until this
            # optimizer's step() or zero_grad(): another optimizer's step is refused
            self._foreign.watch()
        if self._local:
            model.require_backward_grad_sync = self._final
            if hasattr(model, "require_forward_param_sync"):
                model.require_forward_param_sync = self._final

    def end_step(self) -> None:
        """After each step of the optimizer: no gradient is this hook's to report until the
        next forward. (An optimizer built again, on the module wrapped in DDP again, leaves this
        one's gradient hooks on the module's parameters: they stay idle.)"""
        self._local = False
        self._foreign.unwatch()
        self._completed.clear()
        if self._passes:
            self._expected_passes = self._passes
        self._passes = 0

    def warn_if_never_run(self, gradients: Callable[[], bool]) -> None:
        """After a step: warn once (every rank alike) if the model has run no training forward
        while the step had gradients (``gradients()``, asked only then)."""
        if self.training_forwards == 0 and not self._told_never_run and gradients():
            self._told_never_run = True
            warnings.warn(NEVER_RUN)

    def discard_passes(self) -> None:
        """The passes since the last step count no more: zero_grad() (a skipped batch, whose
        gradients nothing will step on) or a state loaded over them (a rollback, which moves
        the parameters for this optimizer)."""
        self._passes = 0
        self._foreign.unwatch()

    @eager
    def _gradient_final(self, p: torch.Tensor) -> None:
        if self._local:
            if self._used_locally is not None:
                self._used_locally.add(p)
            # through DDP's sync the gradient is written again after its bucket: step() starts
            if (self._final and self._last_pass and self._overlap is not None
                    and not self._through_ddp):
                if p in self._completed:  # again in one backward: its gradient comes in parts
                    self._overlap.gradient_in_parts()
                self._completed.add(p)
                self._overlap.gradient_ready(p)

    def _average(self, buffer: torch.Tensor) -> torch.futures.Future:
        """DDP's own averaging (:func:`average`), watched by the stall watch."""
        token = self._watch("DDP's gradient allreduce in backward")

        def done(fut):
            self._unwatch(token)
            return fut.value()

        return average(self.group, buffer).then(done)

    def average_if_local(self, params: Iterable[torch.Tensor]) -> None:
        """Before a full-precision step: if the gradients are this rank's own (the step count
        moved past a compressed step since backward, e.g. a second ``step()`` with no backward
        landing on a variance refresh step), average them now, as DDP does (times 1/n, then the
        sum), one flat allreduce per dtype. Alike on every rank: whether the gradients are local
        follows from the step count. A parameter without a gradient on every rank keeps none; one
        without a gradient here takes the others' average with a zero for this rank's."""
        if not self.gradients_local:
            return
        self.gradients_local = False
        n = dist.get_world_size(self.group)
        by_dtype: dict = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, same in by_dtype.items():
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in same]
            has = torch.tensor([p.grad is not None for p in same], dtype=dtype,
                               device=same[0].device)
            flat = torch.cat([g.reshape(-1) for g in grads] + [has])
            flat[:-len(same)].mul_(1.0 / n)
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p, g, anywhere in zip(same, grads, flat[-len(same):].tolist()):
                numel = g.numel()
                if anywhere:
                    p.grad = flat[offset:offset + numel].view_as(p).clone()
                offset += numel

    @eager  # inside a torch.compile'd backward: run eagerly (hvd_onebit.eager)
    def communicate(self, state, bucket):
        """DDP's hook (``state`` is unused: this object holds its own). No annotations: DDP
        checks them against its own types. A compressed step reaches it only through DDP's sync
        kept on (``_through_ddp``) or a forward that ran outside the hooks: then the bucket goes
        back as it is."""
        self._armed = False
        if self._averaging():
            return self._average(bucket.buffer())
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
