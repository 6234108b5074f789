"""The compressed step's error feedback over its lifetime: saved, restored, reset, flushed.

Each bucket's collective keeps its rank-local error feedback; this part of the engine moves it
in and out (``error_feedback_state_dict``, a checkpoint's errors applied at the next fusing),
resets it with a warning when it cannot apply, and folds every rank's into the momentum with
one exact allreduce (:meth:`ErrorFeedbackLifecycle.flush_error_feedback`).
"""
from __future__ import annotations

import math
import warnings

import torch

from ..comm.flat import OneBitAllreduce
from ..comm.protocol import NonFiniteInputError
from ..config import group_masks
from ..kernels.fused_reference import frozen_denominator
from ..layout import ring_allreduce_bytes
from ..transport.horovod import exact_allreduces


class ErrorFeedbackLifecycle:
    """The error-feedback half of :class:`~hvd_onebit.engine.step.CompressedStep` (a mixin over
    its buckets, collectives, state and config)."""

    def saved_comms(self) -> dict[str, OneBitAllreduce]:
        """The collectives by the key their error feedback is saved under
        ("bucket:numel:dtype"; the world size is checked separately)."""
        return {f"{k[0]}:{k[1]}:{k[2]}": c for k, c in self.comms.items()}

    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers (rank-local: save one file per rank)."""
        return {"world_size": self.world, "rank": self.rank, "space": self._error_space,
                "buckets": {k: c.state_dict() for k, c in self.saved_comms().items()}}

    @property
    def _error_space(self) -> str:
        """What the error feedback is measured in: "preconditioned" (``m / denom``) or
        "momentum" (a checkpoint without the entry was written before preconditioning)."""
        return "preconditioned" if self.preconditioned else "momentum"

    def load_error_feedback_state_dict(self, state: dict) -> None:
        """Restore :meth:`error_feedback_state_dict` from the same rank of a same-size job; with
        another world size, rank or layout it is dropped with a warning (errors restart at 0)."""
        if state.get("world_size") != self.world or state.get("rank") != self.rank:
            self._reset_error_feedback(
                f"hvd_onebit: error feedback saved by rank {state.get('rank')} of "
                f"{state.get('world_size')} does not fit rank {self.rank} of "
                f"{self.world}; it is reset to zero")
            return
        saved_space = state.get("space", "momentum")
        if saved_space != self._error_space:
            self._reset_error_feedback(
                f"hvd_onebit: the saved error feedback is in units of the {saved_space} and this "
                f"optimizer compresses the {self._error_space} (precondition="
                f"{self.preconditioned}); it is reset to zero (error feedback restarts, the "
                "momentum is kept)")
            return
        self._pending_error_feedback = state
        if self.buckets is not None:
            self._apply_pending_error_feedback()

    def _reset_error_feedback(self, why: str) -> None:
        """Drop a saved error feedback that cannot apply (``why``, warned) and zero the live one."""
        warnings.warn(why)
        self._pending_error_feedback = None
        for comm in self.comms.values():
            comm.reset()

    def _apply_pending_error_feedback(self) -> None:
        state, self._pending_error_feedback = self._pending_error_feedback, None
        if state is None:
            return
        saved = state.get("buckets", {})
        mine = self.saved_comms()
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
                for c in mine.values():
                    c.reset()
                return

    def flush_error_feedback(self, param_groups: list[dict]) -> int:
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
        would leave at zero stay zero: ``exp_avg_mask`` is applied, and elements held fixed
        (frozen variance 0) keep a zero momentum. Preconditioned, the errors are in units of
        ``m / denom``: ``e * denom / beta1`` is added instead (0 where held).

        All or nothing: the new momenta are computed aside, and only if every value of every
        bucket is finite (checked on the allreduced values, the same on every rank) are they
        written and the errors zeroed; otherwise every rank raises
        :class:`~hvd_onebit.comm.protocol.NonFiniteInputError` and nothing changed.
        """
        if self.config.compressor != "onebit" or self.buckets is None or self.world == 1:
            return 0
        beta1s = {p: float(g["betas"][0]) for g in param_groups for p in g["params"]}
        groups = {p: g for g in param_groups for p in g["params"]}
        if any(beta1s[p] == 0 for p in self.params):
            raise ValueError("flush_error_feedback needs beta1 > 0: with beta1 = 0 the momentum "
                             "does not carry into the next step, so the error cannot be folded")
        comms = [self.comms[self._key(b)] for b in self.buckets]
        sums = [c.error_contribution() for c in comms]
        sums, nbytes = self._exact_sum(sums)
        new = []
        for b, e in zip(self.buckets, sums):
            m = b.momentum.clone()
            for i, seg in enumerate(b.segments):
                lo, hi = seg.offset, seg.offset + seg.numel
                fold = e[lo:hi]
                if self.preconditioned:  # back to the momentum's units; held elements get 0
                    v, sqrt_bc2, eps = self._denominator_terms(seg.param, groups[seg.param])
                    denom = frozen_denominator(b.piece(i, v).reshape(-1), sqrt_bc2, eps)
                    fold = fold.mul_(denom).masked_fill_(denom == math.inf, 0.0)
                m[lo:hi].add_(fold.div_(beta1s[seg.param]))
            new.append(m)
        bad = [b.index for b, m in zip(self.buckets, new) if not bool(torch.isfinite(m).all())]
        if bad:
            raise NonFiniteInputError(
                [], f"in the error feedback (or the momentum it was folded into) of bucket(s) "
                f"{bad}, seen by flush_error_feedback; nothing was folded")
        for b, m in zip(self.buckets, new):
            b.momentum.copy_(m)
            for p in b.params:
                exp_avg = self.state[p]["exp_avg"]
                exp_avg.masked_fill_(self.state[p]["exp_avg_sq"] == 0, 0.0)  # held elements
        owner = set(self.params)
        for group in param_groups:
            for p, mask in zip(group["params"], group_masks(group)):
                if mask is not None and p in owner:
                    m = self.state[p]["exp_avg"]
                    m.mul_(mask.to(device=m.device, dtype=m.dtype))
        for c in comms:
            c.reset()
        return nbytes

    def _exact_sum(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """The sum over ranks of each tensor, the same bits on every rank, and the bytes this
        rank sent: Horovod's allreduce (a ring: each chunk is reduced once, then copied), or
        with a transport object an allgather summed in rank order."""
        if isinstance(self.transport, str):
            sums = exact_allreduces(tensors, "hvd_onebit.flush", self.process_set)
            return sums, sum(ring_allreduce_bytes(4 * t.numel(), self.world) for t in tensors)
        handles = [self.transport.allgather_async(t.view(1, -1), name=f"hvd_onebit.flush{i}")
                   for i, t in enumerate(tensors)]
        out = []
        for t, h in zip(tensors, handles):
            rows = self.transport.wait(h).view(self.world, -1)
            total = rows[0].clone()
            for r in range(1, self.world):
                total.add_(rows[r])
            out.append(total)
        return out, sum(4 * t.numel() * (self.world - 1) for t in tensors)

