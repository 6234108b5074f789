"""The compressed step's error feedback over its lifetime: saved, restored, reset, flushed.

Each bucket's collective keeps its rank-local error feedback; :class:`ErrorFeedback` moves it
in and out (``state_dict``, a checkpoint's errors applied at the next fusing), resets it with a
warning when it cannot apply, and folds every rank's into the momentum with one exact allreduce
(:meth:`ErrorFeedback.flush`). It also knows whether the errors hold anything not delivered yet
(:attr:`ErrorFeedback.outstanding`), which the optimizer's checkpoint records, so that a run
resumed from a checkpoint saved before its error feedback was flushed into it says so instead
of dropping it silently (:meth:`ErrorFeedback.expect_saved`).
"""
from __future__ import annotations

import math
import warnings
from typing import Mapping, Optional

import torch

from ..comm.protocol import NonFiniteInputError
from ..kernels.fused_reference import frozen_denominator
from ..param_groups import groups_by_param
from ..transport.base import JobTransport
from ..values import described
from .adam_terms import AdamTerms, mask_momentum, masked_params
from .collectives import Collectives
from .fusion import FusedBuckets


class ErrorFeedback:
    """The error feedback of the buckets' collectives, as a whole.

    Args:
        state: Adam's per-parameter state.
        fused: the buckets.
        collectives: their collectives, which hold the errors.
        terms: Adam's terms (the denominators the preconditioned errors are measured in).
        transport: the compression phase's transport (rank, world, the exact sum).
    """

    def __init__(self, state: Mapping, fused: FusedBuckets, collectives: Collectives,
                 terms: AdamTerms, transport: JobTransport):
        self.state = state
        self.fused = fused
        self.collectives = collectives
        self.terms = terms
        self.transport = transport
        self._pending: Optional[dict] = None  # a checkpoint's, applied at the next fusing
        # Whether the errors may hold what compression has not delivered yet: set by a committed
        # compressed step on several ranks (and by errors loaded), cleared when they are zeroed.
        self.outstanding = False
        # The step count of a loaded checkpoint that was saved with outstanding errors, until
        # its errors are loaded too or the next fusing says they were not.
        self._unsaved_at: Optional[int] = None
        # On one rank, the optimizer's last load said its checkpoint's errors are dropped: the
        # errors' own load, saved on several ranks, drops them without saying it again.
        self._told_one_rank = False

    @property
    def space(self) -> str:
        """What the error feedback is measured in: "preconditioned" (``m / denom``) or
        "momentum" (a checkpoint without the entry was written before preconditioning)."""
        return "preconditioned" if self.terms.preconditioned else "momentum"

    @property
    def undelivered(self) -> bool:
        """Whether this rank holds error feedback not delivered yet, live or loaded and waiting
        for the next fusing, or a checkpoint's that was expected and not given (a state saved
        now records it, so that resuming the state warns in turn)."""
        return (self.outstanding or self._unsaved_at is not None
                or bool((self._pending or {}).get("buckets")))

    def _step(self) -> Optional[int]:
        """The optimizer's step count as its bucketed parameters' Adam state records it (the
        largest; None before any is bucketed): what errors are saved at and must be loaded at.
        Read as the frozen variance follows it, on the host (no device sync per parameter)."""
        steps = [self.terms.variance.host_step(p) for p in self.fused.params
                 if "step" in self.state[p]]
        return int(max(steps)) if steps else None

    def state_dict(self) -> dict:
        """This rank's error-feedback buffers (rank-local: save one file per rank), with the
        step count they belong to; loaded ones not applied yet (until the next fusing) as they
        were loaded."""
        if self._pending is not None:
            return self._pending
        return {"world_size": self.transport.size, "rank": self.transport.rank,
                "space": self.space, "step": self._step(),
                "buckets": {k: c.state_dict() for k, c in self.collectives.saved().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` from the same rank of a same-size job; with another
        world size, rank or layout it is dropped with a warning (errors restart at 0), and with
        another step count at the fusing that applies it."""
        if not isinstance(state, dict) or "buckets" not in state:
            raise TypeError("hvd_onebit: load_error_feedback_state_dict() takes what "
                            "error_feedback_state_dict() returned (its key buckets, with "
                            f"world_size, rank, ...); got {described(state)} (the optimizer's "
                            "state_dict() goes to load_state_dict())")
        world, rank = self.transport.size, self.transport.rank
        self._unsaved_at = None  # given: applied below or at the fusing, or dropped with a warning
        if state.get("world_size") != world or state.get("rank") != rank:
            told, self._told_one_rank = self._told_one_rank, False
            self.reset(None if told else  # the optimizer's load said so already
                       f"hvd_onebit: error feedback saved by rank {state.get('rank')} of "
                       f"{state.get('world_size')} does not fit rank {rank} of "
                       f"{world}; it is reset to zero")
            return
        saved_space = state.get("space", "momentum")
        if saved_space != self.space:
            self.reset(f"hvd_onebit: the saved error feedback is in units of the {saved_space} "
                       f"and this optimizer compresses the {self.space} (precondition="
                       f"{self.terms.preconditioned}); it is reset to zero (error feedback "
                       "restarts, the momentum is kept)")
            return
        self._pending = state
        if self.fused.buckets is not None:
            self.apply_pending()

    def reset(self, why: Optional[str]) -> None:
        """Drop a saved error feedback that cannot apply (``why``, warned unless None: said
        already) and zero the live one."""
        if why is not None:
            warnings.warn(why)
        self._pending = None
        self.zeroed()

    def zeroed(self) -> None:
        """Zero the live errors (each collective's); nothing is outstanding after."""
        self.collectives.zero_errors()
        self.outstanding = False

    def committed(self) -> None:
        """A compressed step committed on several ranks: its errors now hold what it did not
        deliver."""
        self.outstanding = True

    def expect_saved(self, step: Optional[int]) -> None:
        """A checkpoint at ``step`` was loaded that was saved with outstanding errors (without
        :meth:`flush`). Unless this rank's errors are loaded too (:meth:`load_state_dict`,
        before the next fusing), the next fusing warns that they were dropped. On one rank,
        which has no error feedback and fuses nothing, that is said now. None: nothing
        expected."""
        self._told_one_rank = step is not None and self.transport.size == 1
        if self._told_one_rank:
            warnings.warn(_dropped(step, "this job has one rank, which keeps none",
                                   ANOTHER_WORLD_ADVICE))
            step = None
        self._unsaved_at = step

    def apply_pending(self) -> None:
        """Load the checkpoint's errors into the collectives just built, if they fit."""
        state, self._pending = self._pending, None
        unsaved_at, self._unsaved_at = self._unsaved_at, None
        if state is None:
            if unsaved_at is not None:
                warnings.warn(_dropped(unsaved_at, "this rank's was not restored"))
            return
        saved = state.get("buckets", {})
        if not saved:  # saved before the compression phase: no errors yet, nothing to restore
            return
        saved_step, step = state.get("step"), self._step()
        if saved_step is not None and step is not None and saved_step != step:
            warnings.warn(f"hvd_onebit: error feedback saved at step {saved_step} does not fit "
                          f"this optimizer at step {step}: load it with the optimizer state "
                          "saved with it (load_state_dict). It is reset to zero")
            self.zeroed()
            return
        mine = self.collectives.saved()
        if all(k.count(":") == 2 for k in saved):  # saved without the buckets' signatures
            mine = {k.rsplit(":", 1)[0]: c for k, c in mine.items()}
        if set(saved) != set(mine):
            warnings.warn("hvd_onebit: saved error feedback is for another bucket layout "
                          f"({sorted(saved)} vs {sorted(mine)}); it is reset to zero")
            return
        for key, comm in mine.items():
            try:
                comm.load_state_dict(saved[key])
            except ValueError as exc:  # another topology role or layout
                warnings.warn(f"hvd_onebit: saved error feedback does not fit ({exc}); it is "
                              "reset to zero")
                self.zeroed()
                return
        self.outstanding = True

    def flush(self, param_groups: list[dict]) -> int:
        """Fold every rank's worker error and every server's error into the momentum, with one
        exact allreduce, then zero both; returns the bytes this rank sent (0: nothing to flush).

        What compression has not delivered yet: rank i's worker error ``e_w^i`` (padded, full
        size) and server j's error ``e_s^j`` (its chunk). Error feedback adds them to the next
        call's input on its way through, so the next averaged momentum gains, on average,

            e = mean_i e_w^i + concat_j e_s^j

        on top of ``mean_i(beta1 * m + (1 - beta1) * g_i)``. Each rank contributes
        ``e_w^i / n`` plus its own server chunk at its place, and one allreduce (Sum) gives e,
        the same on every rank. Adding ``e / beta1`` to the momentum m (each parameter with its
        group's beta1) makes the next step's average ``beta1 * (m + e / beta1) + (1 - beta1) *
        mean_i g_i``: what error feedback would have delivered, with nothing left behind. The
        momentum stays identical on every rank (each adds the same e), so rank 0's
        ``state_dict()`` is then a complete checkpoint, for any world size. Entries the step
        would leave at zero stay zero: ``exp_avg_mask`` is applied, and held elements
        (frozen variance 0) keep a zero momentum. Preconditioned, the errors are in units of
        ``m / denom``: ``e * denom / beta1`` is added instead (0 where held).

        All or nothing: the new momenta are computed aside, and only if every value of every
        bucket is finite (checked on the allreduced values, the same on every rank) are they
        written and the errors zeroed; otherwise every rank raises
        :class:`~hvd_onebit.comm.protocol.NonFiniteInputError` and nothing changed. The new
        momenta are written over each bucket's contribution as its pieces of
        :data:`FLUSH_PIECE` elements are summed, so that the flush holds the parameters' fp32
        bytes and about a bucket's worth beside the state (all the contributions, their sums
        and the new momenta at once took about four times the parameters' bytes).
        """
        buckets, params = self.fused.buckets, self.fused.params
        if not self.collectives.onebit or buckets is None or self.transport.size == 1:
            return 0
        groups = groups_by_param(param_groups)
        beta1s = {p: float(g["betas"][0]) for p, g in groups.items()}
        if any(beta1s[p] == 0 for p in params):
            raise ValueError("flush_error_feedback needs beta1 > 0: with beta1 = 0 the momentum "
                             "does not carry into the next step, so the error cannot be folded")
        new, bad, nbytes = [], [], 0
        for b in buckets:
            folded = self.collectives.of(b).error_contribution()  # the new momentum, in place
            for lo in range(0, b.numel, FLUSH_PIECE):
                hi = min(lo + FLUSH_PIECE, b.numel)
                (e,), sent = self.transport.exact_sum([folded[lo:hi]],
                                                      f"hvd_onebit.flush.{b.index}.{lo}.")
                nbytes += sent
                folded[lo:hi] = self._folded(b, lo, hi, e, groups, beta1s)
            new.append(folded[:b.numel])
            if not bool(torch.isfinite(new[-1]).all()):
                bad.append(b.index)
        if bad:
            raise NonFiniteInputError(
                [], f"in the error feedback (or the momentum it was folded into) of bucket(s) "
                f"{bad}, seen by flush_error_feedback; nothing was folded")
        for b, m in zip(buckets, new):
            b.momentum.copy_(m)
            for p in b.params:
                exp_avg = self.state[p]["exp_avg"]
                exp_avg.masked_fill_(self.state[p]["exp_avg_sq"] == 0, 0.0)  # held elements
        for _, p, mask in masked_params(param_groups, params):
            mask_momentum(self.state, p, mask)
        self.zeroed()
        return nbytes

    def _folded(self, b, lo: int, hi: int, e: torch.Tensor, groups: dict,
                beta1s: dict) -> torch.Tensor:
        """Elements [lo, hi) of bucket ``b``'s momentum with their summed errors ``e`` folded
        in (``e`` becomes them)."""
        for i, seg in enumerate(b.segments):
            a, z = max(lo, seg.offset), min(hi, seg.offset + seg.numel)
            if a >= z:
                continue
            fold = e[a - lo:z - lo]
            if self.terms.preconditioned:  # back to the momentum's units; held elements get 0
                d = self.terms.denominator(seg.param, groups[seg.param])
                variance = b.piece(i, d.variance).reshape(-1)[a - seg.offset:z - seg.offset]
                denom = frozen_denominator(variance, d.sqrt_bc2, d.eps)
                fold.mul_(denom).masked_fill_(denom == math.inf, 0.0)
            fold.div_(beta1s[seg.param]).add_(b.momentum[a:z])
        return e


FLUSH_PIECE = 1 << 22  # elements flush_error_feedback sums at once (16 MiB of float32)

SAME_WORLD_ADVICE = ("To keep it, call opt.flush_error_feedback() on every rank before saving "
                     "(rank 0's state_dict() is then complete), or save each rank's "
                     "opt.error_feedback_state_dict() and load it after load_state_dict()")
# each rank's saved errors fit only the same rank of a job of the same size
ANOTHER_WORLD_ADVICE = ("To keep it on another number of ranks, call opt.flush_error_feedback() "
                        "on every rank before saving: rank 0's state_dict() is then complete")


def _dropped(step: int, why: str, advice: str = SAME_WORLD_ADVICE) -> str:
    """The warning when a checkpoint's undelivered error feedback is dropped at a resume."""
    return (f"hvd_onebit: the checkpoint loaded (step {step}, compression phase) was saved "
            f"before its error feedback was flushed into it, and {why}: what 1-bit compression "
            "had not delivered yet is dropped, and the run goes on from zero error feedback, a "
            f"little off the run that never stopped. {advice}")
