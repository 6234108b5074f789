"""Who is where: the node topology of a job, and the collectives of a group of its ranks.

:class:`Topology` says which ranks share a node (Horovod's local and cross ranks, or a layout
given for tests); :class:`SubsetTransport` runs a group's alltoall and allgather as Horovod
global alltoalls with splits, for the hierarchical collective on ``transport="horovod"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: node ``node`` of ``nodes``, local rank ``local`` of ``per_node``.

    Attributes:
        local_members: global ranks of this rank's node, by local rank.
        cross_members: global ranks with this rank's local rank, by node.
        grid: every rank's global rank, as ``grid[node][local]``.
    """

    rank: int
    node: int
    local: int
    nodes: int
    per_node: int
    local_members: tuple[int, ...]
    cross_members: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]

    @classmethod
    def from_layout(cls, rank: int, layout: Sequence[Sequence[int]]) -> "Topology":
        """From every rank's (node, local rank), in rank order (e.g. one allgather's result)."""
        nodes = 1 + max(node for node, _ in layout)
        per_node = 1 + max(local for _, local in layout)
        grid = {(node, local): r for r, (node, local) in enumerate(layout)}
        if len(grid) != len(layout) or len(layout) != nodes * per_node:
            raise ValueError("hierarchical 1-bit needs every node to run the same number of ranks "
                             f"(node, local rank) per rank: {[tuple(x) for x in layout]}")
        node, local = layout[rank]
        return cls(rank=rank, node=node, local=local, nodes=nodes, per_node=per_node,
                   local_members=tuple(grid[(node, i)] for i in range(per_node)),
                   cross_members=tuple(grid[(k, local)] for k in range(nodes)),
                   grid=tuple(tuple(grid[(k, i)] for i in range(per_node))
                              for k in range(nodes)))

    @classmethod
    def from_horovod(cls) -> "Topology":
        """This job's topology from Horovod (cross rank = node, local rank); one allgather."""
        import horovod.torch as hvd

        mine = torch.tensor([[hvd.cross_rank(), hvd.local_rank()]], dtype=torch.int64)
        layout = hvd.allgather(mine, name="hvd_onebit.topology").tolist()
        return cls.from_layout(hvd.rank(), layout)

    def signature(self) -> list[int]:
        """[nodes, per_node, node, local]: what error feedback saved in this role belongs to."""
        return [self.nodes, self.per_node, self.node, self.local]


class SubsetTransport:
    """A :class:`~hvd_onebit.transport.base.Transport` among ``members`` (global ranks, ascending),
    over Horovod's global alltoall with splits: every rank of the job takes part in each op, and
    sends rows only to the members of its own group (each group under the same op name).

    Args:
        members: the group's global ranks in ascending order; row j goes to ``members[j]``.
        rank: this process's global rank (one of ``members``).
        world: ranks in the job.
    """

    name = "horovod-subset"

    def __init__(self, members: Sequence[int], rank: int, world: int):
        if list(members) != sorted(members) or rank not in members:
            raise ValueError(f"members must be ascending and hold rank {rank}: {list(members)}")
        self.members = tuple(members)
        self.size = len(members)
        self.rank = self.members.index(rank)
        self._splits = torch.zeros(world, dtype=torch.int32)
        self._splits[list(members)] = 1
        # imported here, not with the module: only a job on Horovod's transport builds these
        import horovod.torch as hvd
        from ..transport.horovod import sleep_until_done
        self._hvd, self._sleep_until_done = hvd, sleep_until_done

    def alltoall_async(self, rows: torch.Tensor, name: str) -> Any:
        """rows: [size, ...]; row j goes to members[j]. Received: [size, ...] in member order."""
        return self._hvd.alltoall_async(rows, splits=self._splits, name=name)

    def allgather_async(self, row: torch.Tensor, name: str) -> Any:
        """row: [1, ...]; every member receives [size, ...] in member order."""
        return self.alltoall_async(row.expand(self.size, *row.shape[1:]).contiguous(), name)

    def wait(self, handle: Any) -> torch.Tensor:
        self._sleep_until_done(handle)
        out = self._hvd.synchronize(handle)
        return out[0] if isinstance(out, tuple) else out

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        return self.allgather_ints_wait(self.allgather_ints_async(values, name))

    def allgather_ints_async(self, values: list[int], name: str) -> Any:
        return self.allgather_async(torch.tensor([values], dtype=torch.int64), name)

    def allgather_ints_wait(self, handle: Any) -> list[list[int]]:
        return self.wait(handle).tolist()
