"""The flat collective's error feedback as state: read, folded, zeroed, saved and restored.

The two errors are kept factored (the last y and the rows sent, the last z and the row sent;
see :mod:`hvd_onebit.comm.flat`): ``e = y - decode(rows)`` is computed when asked for, never
stored, so these are fresh tensors.
"""
from __future__ import annotations

import torch

from .. import kernels


class FlatErrorFeedback:
    """Error-feedback state of :class:`~hvd_onebit.comm.flat.OneBitAllreduce` (a mixin over its
    ``_worker_y``, ``_sent``, ``_server_z``, ``_server_sent``, ``layout``, ``size``, ``rank``,
    ``block_size`` and ``backend``)."""

    @property
    def worker_error(self) -> torch.Tensor:
        """e_w: float32 [padded], this rank's worker error feedback (a fresh tensor)."""
        return kernels.worker_error(self._worker_y, self._sent, self.layout, self.backend)

    @property
    def server_error(self) -> torch.Tensor:
        """e_s: float32 [chunk], this rank's server error for the chunk it serves (a fresh tensor)."""
        return kernels.server_error(self._server_z, self._server_sent, self.layout,
                                    self.backend)

    def error_contribution(self) -> torch.Tensor:
        """float32 [padded]: this rank's share of what error feedback has yet to deliver,
        ``e_w / n`` plus its server error at its chunk's place; summed over the ranks it is
        ``mean_i e_w^i + concat_j e_s^j`` (see ``CompressedStep.flush_error_feedback``)."""
        e = self.worker_error.mul_(1.0 / self.size)
        chunk = self.layout.chunk
        e[self.rank * chunk:(self.rank + 1) * chunk].add_(self.server_error)
        return e

    def reset(self) -> None:
        """Zero both error-feedback buffers (e.g. after the world size changed)."""
        self._worker_y.zero_()
        self._sent.zero_()
        self._server_z.zero_()
        self._server_sent.zero_()

    def scale_error_feedback(self, ratio: torch.Tensor) -> None:
        """Multiply both errors elementwise by ``ratio`` (float32 [numel], one factor per
        element of the buffer; the padding keeps its errors): how errors measured in one unit
        per element are carried into another, e.g. at a variance refresh (``precondition=True``
        compresses ``m / denom``: old denominator over new). The server error takes the factors
        of the chunk this rank serves. Between calls only. Stored factored as
        :meth:`load_state_dict` stores a given error (y = e, rows that decode to +0), in the
        live buffers (with spare buffers, the ones the last commit adopted)."""
        if self._in_flight:
            raise RuntimeError("scale_error_feedback during a call")
        L = self.layout
        ratio = ratio.reshape(-1)
        if ratio.numel() != L.numel:
            raise ValueError(f"ratio has {ratio.numel()} elements, the buffer {L.numel}")
        # In place, one pass each (no materialised e); the padding past numel keeps its errors.
        kernels.rescale_error(self._worker_y, self._sent, ratio, L, L.n, self.backend)
        kernels.set_identity_rows(self._sent, L, L.n)
        lo, hi = self.rank * L.chunk, min((self.rank + 1) * L.chunk, L.numel)
        kernels.rescale_error(self._server_z, self._server_sent, ratio[lo:max(lo, hi)], L, 1,
                              self.backend)
        kernels.set_identity_rows(self._server_sent, L, 1)

    def state_dict(self) -> dict:
        """This rank's error feedback, with the layout it belongs to."""
        return {"numel": self.layout.numel, "size": self.size, "rank": self.rank,
                "block_size": self.block_size,
                "worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict) -> None:
        """Restore error feedback saved by :meth:`state_dict` on the same rank and layout."""
        expect = {"numel": self.layout.numel, "size": self.size, "rank": self.rank,
                  "block_size": self.block_size}
        got = {k: state.get(k) for k in expect}
        if got != expect:
            raise ValueError(f"error-feedback state was saved for {got}, this object is {expect}")
        # Factored form of a given e: y = e with rows that decode to +0, so y - (+0) = e.
        self._worker_y.copy_(state["worker_error"])
        kernels.set_identity_rows(self._sent, self.layout, self.layout.n)
        self._server_z.copy_(state["server_error"])
        kernels.set_identity_rows(self._server_sent, self.layout, 1)

