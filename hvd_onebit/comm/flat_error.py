"""The flat collective's error feedback as an object: its buffers, read, folded, zeroed, scaled,
saved and restored.

The two errors are kept factored (the last y and the scales of the rows sent, the last z and
the scales of the row sent; the signs sent were y's and z's own, so they are not kept; see
:mod:`hvd_onebit.comm.flat`): ``e = y - s * sign(y)`` is computed when asked for, never stored,
so these are fresh tensors.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..layout import Layout


class FlatErrorFeedback:
    """The worker and server error feedback of one :class:`~hvd_onebit.comm.flat.OneBitAllreduce`.

    Args:
        layout: the collective's layout (chunks, blocks, rows).
        size, rank: the ranks taking part and this one.
        block_size: as the collective was given it (saved with the errors).
        backend: the resolved kernel backend.
        device: where the buffers live.
        spare: keep a second y and z, written by the passes and adopted at the commit.

    Every buffer is written here (zeros, not empty): the pages are touched now, not in the
    first call, which would otherwise page-fault ~4 bytes per element.
    """

    def __init__(self, layout: Layout, size: int, rank: int, block_size, backend: str,
                 device: torch.device, spare: bool):
        self.layout, self.size, self.rank = layout, size, rank
        self.block_size, self.backend = block_size, backend
        L = layout
        f32 = dict(dtype=torch.float32, device=device)
        # The worker error, factored as the last call's y and the scales of the rows it sent
        # (e = y - s * sign(y)); zero y and zero scales mean e = 0. The rows themselves belong
        # to the call that sends them; their scales are kept at the commit.
        self.worker_y = torch.zeros(L.padded, **f32)
        self.worker_y_next = torch.zeros(L.padded, **f32) if spare else None
        self.sent_scales = torch.zeros(L.n * L.nblocks, **f32)
        # The server error, factored the same way: the last call's z and its row's scales.
        self.server_z = torch.zeros(L.chunk, **f32)
        self.server_z_next = torch.zeros(L.chunk, **f32) if spare else None
        self.server_scales = torch.zeros(L.nblocks, **f32)

    def adopt_spares(self) -> None:
        """The commit with spare buffers: the y and z the passes wrote become the errors."""
        self.worker_y, self.worker_y_next = self.worker_y_next, self.worker_y
        self.server_z, self.server_z_next = self.server_z_next, self.server_z

    def adopt_scales(self, sent: torch.Tensor, served: torch.Tensor) -> None:
        """The commit: the scales of the rows just sent (``sent``: float32 [n, nblocks], the
        worker's rows'; ``served``: [1, nblocks], the server's row's) become the errors' scales
        (the rows' signs are those of the y and z just stored)."""
        L = self.layout
        self.sent_scales.view(L.n, L.nblocks).copy_(sent)
        self.server_scales.view(1, L.nblocks).copy_(served)

    @property
    def worker_error(self) -> torch.Tensor:
        """e_w: float32 [padded], this rank's worker error feedback (a fresh tensor)."""
        return kernels.worker_error(self.worker_y, self.sent_scales, self.layout)

    @property
    def server_error(self) -> torch.Tensor:
        """e_s: float32 [chunk], this rank's server error for the chunk it serves (a fresh tensor)."""
        return kernels.server_error(self.server_z, self.server_scales, self.layout)

    def contribution(self) -> torch.Tensor:
        """float32 [padded]: this rank's share of what error feedback has yet to deliver,
        ``e_w / n`` plus its server error at its chunk's place; summed over the ranks it is
        ``mean_i e_w^i + concat_j e_s^j`` (see ``CompressedStep.flush_error_feedback``)."""
        e = self.worker_error.mul_(1.0 / self.size)
        chunk = self.layout.chunk
        e[self.rank * chunk:(self.rank + 1) * chunk].add_(self.server_error)
        return e

    def reset(self) -> None:
        """Zero both errors."""
        self.worker_y.zero_()
        self.sent_scales.zero_()
        self.server_z.zero_()
        self.server_scales.zero_()

    def scale(self, ratio: torch.Tensor) -> None:
        """Multiply both errors elementwise by ``ratio`` (float32 [numel]; the padding keeps its
        errors); the server error takes the factors of the chunk this rank serves. Stored
        factored as :meth:`load_state_dict` stores a given error (y = e, zero scales), in the
        live buffers."""
        L = self.layout
        ratio = ratio.reshape(-1)
        if ratio.numel() != L.numel:
            raise ValueError(f"ratio has {ratio.numel()} elements, the buffer {L.numel}")
        # In place, one pass each (no materialised e); the padding past numel keeps its errors.
        kernels.rescale_error(self.worker_y, self.sent_scales, ratio, L, L.n, self.backend)
        self.sent_scales.zero_()
        lo, hi = self.rank * L.chunk, min((self.rank + 1) * L.chunk, L.numel)
        kernels.rescale_error(self.server_z, self.server_scales, ratio[lo:max(lo, hi)], L, 1,
                              self.backend)
        self.server_scales.zero_()

    def _signature(self) -> dict:
        return {"numel": self.layout.numel, "size": self.size, "rank": self.rank,
                "block_size": self.block_size}

    def state_dict(self) -> dict:
        """Both errors, with the layout they belong to."""
        return {**self._signature(), "worker_error": self.worker_error,
                "server_error": self.server_error}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` saved on the same rank and layout."""
        expect = self._signature()
        if state.get("topology") is not None:
            raise ValueError(f"error feedback was saved by the hierarchical collective in topology "
                             f"role {list(state['topology'])} ([nodes, ranks per node, node, local "
                             "rank]), and this job's 1-bit stage is flat")
        got = {k: state.get(k) for k in expect}
        if got != expect:
            raise ValueError(f"error-feedback state was saved for {got}, this object is {expect}")
        # Factored form of a given e: y = e with zero scales, so y - (+-0) = e, signed zeros
        # included (a -0 in y has sign +1 and takes +0; any other y is unchanged by a zero).
        self.worker_y.copy_(state["worker_error"])
        self.sent_scales.zero_()
        self.server_z.copy_(state["server_error"])
        self.server_scales.zero_()
