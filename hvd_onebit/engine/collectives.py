"""The buckets' 1-bit collectives: one per bucket, flat or hierarchical, kept while the bucket
layout and the world stay as they are (their error feedback belongs to both).
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from ..comm.flat import OneBitAllreduce
from ..comm.hierarchical import HierarchicalOneBitAllreduce
from ..comm.topology import Topology
from ..transport.base import JobTransport
from .fusion import Bucket


class Collectives:
    """The 1-bit collective of each bucket, keyed by its layout (which parameters' elements,
    in order), the world size and a generation that :meth:`reset` bumps.

    Args:
        transport: the compression phase's transport.
        onebit: whether the compressor is the 1-bit one (else no collective is built).
        block_size, backend: as for :class:`~hvd_onebit.OneBitAllreduce`.
        hierarchical: True, False or "auto" (see :meth:`topology`).
        intra_node: "auto", "shared_memory" or "network": the hierarchical stages inside a node.
        spare_errors: ``device -> bool``, whether the collectives keep spare error buffers.
        shared_memory: ``(transport name, device) -> bool``, whether the stages inside a node go
            through shared memory (raises where "shared_memory" was asked for and cannot be).
    """

    def __init__(self, transport: JobTransport, *, onebit: bool, block_size: Optional[int],
                 backend: str, hierarchical, intra_node: str,
                 spare_errors: Callable[[torch.device], bool],
                 shared_memory: Callable[[str, torch.device], bool]):
        self.transport = transport
        self.onebit = onebit
        self.block_size = block_size
        self.backend = backend
        self.hierarchical = hierarchical
        self.intra_node = intra_node
        self.spare_errors = spare_errors
        self.shared_memory = shared_memory
        self.comms: dict[tuple, object] = {}
        self._generation = 0
        self._topology: Topology | bool | None = None  # None: not decided yet; False: flat

    def key(self, b: Bucket) -> tuple:
        return (b.index, b.numel, str(b.momentum.dtype).replace("torch.", ""),
                self.transport.size, self._generation, b.layout, b.signature)

    def of(self, b: Bucket):
        """Bucket ``b``'s collective."""
        return self.comms[self.key(b)]

    def covers(self, buckets: list[Bucket]) -> bool:
        """Whether every bucket has its collective (in this world and generation)."""
        return all(self.key(b) in self.comms for b in buckets if self.onebit)

    def fit(self, buckets: list[Bucket]) -> None:
        """Keep the collectives of ``buckets`` and build the missing ones; error feedback
        belongs to a bucket layout and a world size, so a change starts from zero."""
        wanted = {self.key(b) for b in buckets}
        self.comms = {k: c for k, c in self.comms.items() if k in wanted}
        for b in buckets:
            key = self.key(b)
            if key not in self.comms and self.onebit:
                self.comms[key] = self._build(b)

    def saved(self) -> dict[str, object]:
        """The collectives by the key their error feedback is saved under
        ("bucket:numel:dtype:signature", :attr:`Bucket.signature`; the world size is checked
        separately)."""
        return {f"{k[0]}:{k[1]}:{k[2]}:{k[6]}": c for k, c in self.comms.items()}

    def zero_errors(self) -> None:
        """Zero every collective's error feedback, keeping the collectives (no communication)."""
        for comm in self.comms.values():
            comm.reset()

    def reset(self) -> None:
        """Drop every collective (and its error feedback) and the topology decision."""
        self.comms.clear()
        self._topology = None
        self._generation += 1

    def _build(self, b: Bucket):
        """The 1-bit collective of bucket ``b``: hierarchical (nodes) or flat."""
        device = b.momentum.device
        common = dict(block_size=self.block_size, backend=self.backend, device=device,
                      defer_check=True, spare_errors=self.spare_errors(device))
        topology = self.topology()
        if topology is None:
            return OneBitAllreduce(b.numel, transport=self.transport.stages(device),
                                   name=f"hvd_onebit.bucket{b.index}", **common)
        kind = self.transport.kind(device)
        name = f"hvd_onebit.hier{b.index}"
        if self.shared_memory(kind, device):
            from ..transport.shared_memory import SharedMemoryError

            comm, failure = None, ""
            try:
                comm = HierarchicalOneBitAllreduce(b.numel, topology, name=name, transport=kind,
                                                   **common, intra="shared_memory")
            except SharedMemoryError as exc:  # the same on every rank of this node
                failure = str(exc)
            if self.intra_node == "shared_memory":
                # asked for: every rank raises if any node failed (none waits for it)
                self._raise_if_any_failed(failure)
            if comm is not None:
                return comm
            # each node chooses for itself: the stages between nodes are the same either way
            warnings.warn(f"hvd_onebit: this node's stages use the network: {failure}")
        return HierarchicalOneBitAllreduce(b.numel, topology, name=name, transport=kind,
                                           **common)

    def _raise_if_any_failed(self, failure: str) -> None:
        """Raise SharedMemoryError on every rank if any rank's ``failure`` is not empty."""
        from ..transport.shared_memory import SharedMemoryError

        failed = {rank: f for rank, f in enumerate(self.transport.gather_failures(failure))
                  if f}
        if failed:
            raise SharedMemoryError(f"intra_node='shared_memory' failed on rank(s) "
                                    f"{sorted(failed)}: {next(iter(failed.values()))}")

    @property
    def decided_hierarchical(self) -> Optional[bool]:
        """Whether the 1-bit stage is hierarchical, once :meth:`topology` has decided (at the
        first compressed step); None before. Reads only: no collective."""
        return None if self._topology is None else self._topology is not False

    def topology(self) -> Optional[Topology]:
        """The nodes' layout when the 1-bit stage is hierarchical in this world, else None.

        ``hierarchical="auto"`` is on when there are several nodes of several ranks each, all
        alike; the decision rests on one allgather of every rank's (node, local rank), so it is
        the same on every rank. Kept until :meth:`reset` (an elastic reset re-decides)."""
        if self._topology is None:
            mode = self.hierarchical
            places = None
            if mode is not False and self.transport.size > 1:
                places = self.transport.node_places()
            if places is None:
                self._topology = False
            else:
                try:
                    topo = Topology.from_layout(*places)
                except ValueError as exc:
                    if mode is True:
                        raise
                    warnings.warn(f"hvd_onebit: hierarchical='auto' stays flat: {exc}")
                    topo = None
                if mode == "auto" and topo is not None and (topo.nodes == 1 or topo.per_node == 1):
                    topo = None
                elif topo is not None and topo.nodes == 1:
                    warnings.warn(
                        f"hvd_onebit: hierarchical=True on one node of {topo.per_node} ranks: the "
                        "momentum is averaged in full precision inside the node and nothing "
                        "travels in 1 bit (hierarchical='auto' stays flat 1-bit here). The nodes "
                        f"are as numbered by {self.transport.nodes_from}")
                self._topology = topo if topo is not None else False
        return self._topology or None
