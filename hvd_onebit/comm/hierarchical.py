"""Hierarchical 1-bit allreduce for nodes of several ranks (fast links inside, a slow network
between).

For N nodes of L ranks and a buffer of ``numel`` elements, padded to L shards of S elements:

0. *Inside each node* (full precision, the fast links): a reduce-scatter, so local rank i holds
   its node's mean of shard i (the L shards summed in local-rank order, in float32, / L).
1-2. *Across nodes*, among the N ranks with local rank i: the two-stage 1-bit allreduce
   (:class:`~hvd_onebit.OneBitAllreduce`) of shard i, with worker and server error feedback on
   this stage only. Each rank sends about ``2 (N-1)/N * S/8`` bytes between nodes, and the L
   ranks of a node send in parallel: a node sends ``2 (N-1)/N * numel/8`` in all, where flat 1-bit
   sends ``L`` times ``2 (n-1)/n * numel/8``.
3. *Inside each node*: an allgather of the L averaged shards. Every rank ends with the same bits.

Each stage runs on a transport among the group's members: torch.distributed subgroups (one per
node, one per local rank; ``transport="torch"``), or, with ``transport="horovod"``, Horovod's
global alltoall with splits, every rank sending only to the members of its own group
(:class:`SubsetTransport`; Horovod registers process sets only at ``hvd.init`` or with dynamic
process sets, which a user's script does not ask for). With CPU buffers and torch's transport, the
two stages inside a node can instead go through memory the node's ranks share
(``intra="shared_memory"``, :mod:`hvd_onebit.transport.shared_memory`), as MPI does between ranks of a host.

All or nothing, on every rank, with no extra collective: a non-finite value anywhere in a node
makes that shard's node mean non-finite, so the 1-bit stage of that shard's group sees it in its
status words (as does a group whose server average overflowed). Groups may therefore disagree
after stage 1, so every group goes on through stage 2 (a group that stopped would leave the
others waiting in the same global alltoall), and a group that saw a bad value sends a row of NaNs
in stage 3: every rank of every node (each group spans every node) then knows, and every rank
decides the same. Nothing (outputs, error feedback) is written until stage 3 is in: it is driven
by :func:`~hvd_onebit.comm.transaction.synchronize_all` like the flat collective. The stages send the
buffers themselves, no status columns, so each costs no copy of its own.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import kernels
from ..transport.registry import either, supporting
from .flat import AllreduceHandle, OneBitAllreduce
from .protocol import Epilogue, InputProducer, Status, check_input
from .topology import SubsetTransport, Topology
from .transaction import TransactionalCollective


@dataclass
class NodeMean:
    """An allreduce input given as the node's mean of one shard: ``(rows[0] + rows[1] + ...) /
    len(rows)``, summed in row (local-rank) order in float32, then divided. The native worker
    compression computes it in its own pass (:func:`worker_compress_mean`), so the mean is never
    written out; :meth:`materialize` is the torch reference (the same bits). An
    ``InputProducer`` of :mod:`hvd_onebit.comm.protocol`.

    Attributes:
        rows: one float32 [shard] per local rank, contiguous (read only).
        like: a float32 [shard] tensor, also :meth:`compress`'s scratch where it materializes.
    """

    rows: list[torch.Tensor]
    like: torch.Tensor

    def materialize(self, out: Optional[torch.Tensor] = None,
                    backend: str = "torch") -> torch.Tensor:
        out = torch.empty_like(self.like) if out is None else out
        out.copy_(self.rows[0])
        for row in self.rows[1:]:
            out.add_(row)
        return out.div_(float(len(self.rows)))

    def compress(self, y_prev: torch.Tensor, prev_scales: torch.Tensor, y_out: torch.Tensor,
                 send: torch.Tensor, layout, backend: str = "auto") -> bool:
        if kernels.pick(backend, self.like.device,
                        native=lambda: kernels.native_ready(self.rows)) == "native":
            return kernels.native_module().worker_compress_mean(
                self.rows, y_prev, prev_scales, y_out, send, *layout.as_args(), True)
        return kernels.worker_compress(self.materialize(out=self.like), y_prev, prev_scales, y_out,
                                       send, layout, backend)


@dataclass
class HierarchicalHandle:
    """A hierarchical allreduce in flight (see :class:`HierarchicalOneBitAllreduce`)."""

    out: torch.Tensor
    out32: torch.Tensor
    stage0: object = None  # the intra-node reduce-scatter
    inner: Optional[AllreduceHandle] = None  # the 1-bit stages of this rank's shard
    stage1: Status = field(default_factory=Status.none)  # the 1-bit stage 1's input statuses
    stage2_started: bool = False  # False: the group abandoned this call after stage 1
    stage3: object = None  # the intra-node allgather
    gathered: Optional[torch.Tensor] = None  # stage 3's rows: [per_node, 1 + shard]
    started: float = field(default_factory=time.perf_counter)
    done: bool = False


class HierarchicalOneBitAllreduce(TransactionalCollective):
    """Mean over all ranks of a fixed-size buffer: full precision inside nodes, 1-bit between.

    Args:
        numel: elements per call; the same on every rank.
        topology: this rank's place (:meth:`Topology.from_horovod`).
        block_size, backend, device: as for :class:`~hvd_onebit.OneBitAllreduce` (of the 1-bit
            stage between nodes).
        name: prefix of the op names, identical on every rank.
        defer_check: as for :class:`~hvd_onebit.OneBitAllreduce`.
        transport: "horovod" (global alltoalls with splits) or "torch" (torch.distributed
            subgroups, made here on first use: every rank must build its collectives at the
            same point, as the optimizer does).
        spare_errors: as for :class:`~hvd_onebit.OneBitAllreduce` (its 1-bit stage).
        intra: how the stages inside a node travel: "network" (the transport's) or
            "shared_memory" (CPU buffers with ``transport="torch"``: through a segment the node's
            ranks share, :mod:`hvd_onebit.transport.shared_memory`; same bits, no copies through the
            kernel). Raises :class:`~hvd_onebit.transport.shared_memory.SharedMemoryError` on every rank
            of a node that cannot share memory.

    Same calling convention as the flat collective (``allreduce``, ``allreduce_async`` and
    ``synchronize``, or :func:`~hvd_onebit.comm.transaction.synchronize_all`); the epilogue is applied
    after the last stage, as the gathered mean is copied out (``Epilogue.copy_apply``).
    """

    def __init__(self, numel: int, topology: Topology, *, block_size: Optional[int] = None,
                 backend: str = "auto", device: torch.device | str = "cpu",
                 name: str = "hvd_onebit.hier", defer_check: bool = False,
                 transport: str = "horovod", spare_errors: bool = False,
                 intra: str = "network"):
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        self.topology = topology
        self.numel = numel
        self.name = name
        self.device = torch.device(device)
        world = topology.nodes * topology.per_node
        if intra not in ("network", "shared_memory"):
            raise ValueError(f"intra must be 'network' or 'shared_memory', got {intra!r}")
        if intra == "shared_memory" and (transport not in supporting("shared_memory")
                                         or self.device.type != "cpu"):
            raise ValueError(f"intra='shared_memory' moves CPU buffers beside transport="
                             f"{either(supporting('shared_memory'))}, got transport={transport!r} "
                             f"on {self.device}")
        if transport not in supporting("hierarchical"):
            raise ValueError(f"the hierarchical collective runs on transport "
                             f"{either(supporting('hierarchical'))}, got {transport!r}")
        self.intra = intra
        shared = intra == "shared_memory"
        L = topology.per_node
        self.shard = max(1, math.ceil(numel / L))
        if transport == "torch":  # imported here: a job on Horovod's transport needs neither
            from ..transport.shared_memory import SharedMemoryTransport
            from ..transport.torch_distributed import TorchTransport, torch_subgroups

            nodes = [tuple(row) for row in topology.grid]
            columns = [tuple(row[i] for row in topology.grid) for i in range(topology.per_node)]
            # rows are exchanged in member order, which must be the ranks' order (as torch's
            # group ranks are); SubsetTransport checks the same
            if any(list(g) != sorted(g) for g in nodes + columns):
                raise ValueError(f"hierarchical 1-bit needs ranks numbered node by node: {nodes}")
            torch_subgroups(nodes + columns)
            self.cross = TorchTransport(device=device, members=tuple(topology.cross_members))
        else:  # "horovod", the other transport the registry runs hierarchical stages on
            self.local = SubsetTransport(topology.local_members, topology.rank, world)
            self.cross = SubsetTransport(topology.cross_members, topology.rank, world)
        # The stage between nodes first: its construction is a collective of the ranks across
        # nodes, which a node whose shared memory fails (below: raised on that node's ranks,
        # then agreed over every rank by the engine) would leave the other nodes waiting in.
        self.inner = OneBitAllreduce(self.shard, block_size=block_size, transport=self.cross,
                                     backend=backend, device=self.device, name=f"{name}.cross",
                                     defer_check=defer_check, spare_errors=spare_errors)
        if transport == "torch":
            self.local = (SharedMemoryTransport(topology.local_members, self.shard,
                                                name=f"{name}.node") if shared
                          else TorchTransport(device=device, members=tuple(topology.local_members)))
        f32 = dict(dtype=torch.float32, device=self.device)
        # this rank's input, padded: L shards (the padding stays zero)
        self._full = self.local.input_row() if shared else torch.zeros(L * self.shard, **f32)
        self._shard_in = torch.zeros(self.shard, **f32)  # the node's mean of this rank's shard
        # its average over nodes, decoded straight into the node's segment where there is one
        # (with one node the 1-bit stage's commit writes it again: a private buffer then)
        self._shard_out = (self.local.output_row() if shared and topology.nodes > 1
                           else torch.zeros(self.shard, **f32))
        self._in_flight = False
        self.wire_bytes = 0  # bytes this rank sent between nodes in the last call
        self.intra_bytes = 0  # bytes this rank sent inside its node (on a network) last call
        self.total_wire_bytes = 0
        self.calls = 0

    @property
    def layout(self):
        """The 1-bit stage's layout (of this rank's shard among the nodes)."""
        return self.inner.layout

    # ---- the collective -------------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.synchronize(self.allreduce_async(tensor, out))

    def allreduce_async(self, tensor: torch.Tensor | InputProducer,
                        out: Optional[torch.Tensor] = None) -> HierarchicalHandle:
        """Read the input (a tensor, or an input producer such as Adam's momentum update) and
        start the intra-node reduce-scatter."""
        check_input(f"HierarchicalOneBitAllreduce {self.name!r}", self.numel, self.device,
                    self._in_flight, tensor, out)
        producer = not isinstance(tensor, torch.Tensor)
        like = tensor.like if producer else tensor
        if out is None:
            out = torch.empty_like(like, memory_format=torch.contiguous_format)
        x32 = self._full[:self.numel]  # the padding past numel stays zero
        if producer:
            tensor.materialize(out=x32, backend=self.inner.backend)
        else:
            x32.copy_(tensor.reshape(-1))
        out32 = (out.view(-1) if out.dtype == torch.float32
                 else torch.empty(out.numel(), dtype=torch.float32, device=out.device))
        handle = HierarchicalHandle(out=out, out32=out32)
        handle.stage0 = self.local.alltoall_async(self._full.view(self.topology.per_node,
                                                                  self.shard),
                                                  name=f"{self.name}.scatter")
        self._in_flight = True
        return handle

    # ---- the phases, driven by synchronize_all ------------------------------------------------------

    def wait_stage1(self, handle: HierarchicalHandle) -> Status:
        """The node's reduce-scatter, then stage 1 of the 1-bit allreduce among the nodes.
        Returns nothing: what this group saw is only known to it yet, and is reported (to
        everyone alike) after stage 3."""
        stage0, handle.stage0 = handle.stage0, None
        recv = self.local.wait(stage0)  # [per_node, shard], from each local rank
        # A non-finite value on any rank of the node leaves this mean non-finite, and the 1-bit
        # stage's status words carry that to every group.
        mean = NodeMean([recv[i] for i in range(self.topology.per_node)], self._shard_in)
        if self.intra == "shared_memory" and not self.inner.spare_errors:
            # the lean commit reads its input again, after the node's ranks may have reused
            # their rows in the segment: a private copy then
            mean = mean.materialize(out=self._shard_in)
        handle.inner = self.inner.allreduce_async(mean, out=self._shard_out)
        self.inner.claim(handle.inner)
        handle.stage1 = self.inner.wait_stage1(handle.inner)
        return Status.none()

    def start_stage2(self, handle: HierarchicalHandle) -> None:
        self.inner.start_stage2(handle.inner)
        handle.stage2_started = True

    def wait_stage2(self, handle: HierarchicalHandle) -> Status:
        """Stage 2 among the nodes, the decode of this rank's shard (nothing committed), and the
        intra-node allgather, whose rows carry each group's stage-2 status. No decision here
        reads the device: the statuses go into the row as NaNs, and out as flags."""
        if not handle.stage2_started:
            return Status.none()  # the group was abandoned after stage 1 (the same everywhere)
        servers = self.inner.wait_stage2(handle.inner)
        if handle.inner.gathered is None:  # one node: the 1-bit stage is the identity
            row = handle.inner.local.view(1, self.shard)
        else:
            row = self.inner.decode_only(handle.inner).view(1, self.shard)
        # A row of NaNs tells the node that this group saw a bad value (decoded shards are
        # always finite); the flag stays on the device.
        flags = [st.bad.reshape(-1) for st in (handle.stage1, servers) if st.ranks]
        if flags:
            row.masked_fill_(torch.cat(flags).any(), math.nan)
        handle.stage3 = self.local.allgather_async(row, name=f"{self.name}.gather")
        stage3, handle.stage3 = handle.stage3, None
        handle.gathered = self.local.wait(stage3)
        nodes = self.topology.nodes
        ranks = [r for i in range(self.topology.per_node) for r in self._ranks_of_group(i)]
        return Status(torch.isnan(handle.gathered[:, 0]).repeat_interleave(nodes), ranks)

    def commit(self, handle: HierarchicalHandle, epilogue: Optional[Epilogue]) -> None:
        """Adopt the 1-bit stage's error feedback, write the output, apply the epilogue."""
        self.inner.commit(handle.inner, None)
        mean = handle.gathered.reshape(-1)[:self.numel]
        if epilogue is not None and handle.out32.data_ptr() == handle.out.data_ptr():
            # the copy out and Adam's update in one pass (one native kernel on CPU)
            epilogue.copy_apply(mean, handle.out32, self.inner.backend)
        else:
            handle.out32.copy_(mean)
            if handle.out32.data_ptr() != handle.out.data_ptr():
                handle.out.view(-1).copy_(handle.out32)
            if epilogue is not None:
                epilogue.apply(handle.out)
        L = self.topology.per_node
        self.wire_bytes = self.inner.wire_bytes
        self.total_wire_bytes += self.wire_bytes
        # through shared memory nothing is sent: the rows are written and read in place
        self.intra_bytes = 0 if self.intra == "shared_memory" else 2 * (L - 1) * self.shard * 4
        self.calls += 1
        handle.gathered = None

    def drain(self, handle: HierarchicalHandle) -> None:
        for attr in ("stage0", "stage3"):
            pending = getattr(handle, attr)
            setattr(handle, attr, None)
            if pending is not None:
                self.local.wait(pending)
        if handle.inner is not None:
            self.inner.drain(handle.inner)
        handle.gathered = None

    def release(self) -> None:
        self.inner.release()
        self._in_flight = False

    def _ranks_of_group(self, local: int) -> list[int]:
        return [row[local] for row in self.topology.grid]

    # ---- error feedback: the 1-bit stage's, in this rank's role ---------------------------------

    @property
    def worker_error(self) -> torch.Tensor:
        return self.inner.worker_error

    @property
    def server_error(self) -> torch.Tensor:
        return self.inner.server_error

    def error_contribution(self) -> torch.Tensor:
        """float32 [per_node * shard]: this rank's share of what error feedback has yet to
        deliver, at its shard's place (the 1-bit stage's, over the nodes' means); summed over
        every rank of the job it is what the flat collective's contributions sum to."""
        t = self.topology
        e = torch.zeros(t.per_node * self.shard, dtype=torch.float32, device=self.device)
        e[t.local * self.shard:(t.local + 1) * self.shard] = \
            self.inner.error_contribution()[:self.shard]
        return e

    def reset(self) -> None:
        self.inner.reset()

    def scale_error_feedback(self, ratio: torch.Tensor) -> None:
        """Multiply the errors elementwise by ``ratio`` (float32 [numel], per element of the
        buffer; see :meth:`OneBitAllreduce.scale_error_feedback`): the 1-bit stage's errors are
        of this rank's shard of the node's mean, so they take that shard's factors (1 past the
        buffer's end)."""
        t = self.topology
        full = torch.ones(t.per_node * self.shard, dtype=torch.float32, device=self.device)
        full[:self.numel] = ratio.reshape(-1)
        self.inner.scale_error_feedback(full[t.local * self.shard:(t.local + 1) * self.shard])

    def state_dict(self) -> dict:
        """The 1-bit stage's error feedback, with the topology role it belongs to."""
        return {**self.inner.state_dict(), "topology": self.topology.signature()}

    def load_state_dict(self, state: dict) -> None:
        if list(state.get("topology", [])) != self.topology.signature():
            raise ValueError(f"error feedback was saved in topology role {state.get('topology')}, "
                             f"this rank is {self.topology.signature()} "
                             "([nodes, ranks per node, node, local rank])")
        self.inner.load_state_dict({k: v for k, v in state.items() if k != "topology"})
