""":class:`TorchJob`: the compression phase's transport in a torchrun job (the DDP face), on a
torch.distributed process group alone, without Horovod; with ``hierarchical``, the node layout
read from torchrun's own environment and the subgroups of the hierarchical collective."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .base import JobTransport
from .torch_distributed import TorchTransport, torch_subgroups

#: What torchrun tells each worker about its node (``torch.distributed.run``'s environment).
NODE_VARIABLES = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Place:
    """One rank's place as torchrun set it: node ``node`` (``GROUP_RANK``), local rank
    ``local`` of ``local_size`` (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); None where unset."""

    rank: int
    node: Optional[int]
    local: Optional[int]
    local_size: Optional[int]

    @classmethod
    def from_environment(cls, rank: int, environ=os.environ) -> "Place":
        values = []
        for name in NODE_VARIABLES:
            text = environ.get(name, "")
            values.append(int(text) if text.strip().lstrip("-").isdigit() else None)
        return cls(rank, *values)


def layout_problems(places: list[Place], world: int) -> list[str]:
    """What keeps ``places`` (every rank's, in rank order) from being nodes of the same number of
    ranks, numbered node by node (as torchrun numbers them); [] when nothing does."""
    unset = [p.rank for p in places if None in (p.node, p.local, p.local_size)]
    if unset:
        return [f"rank(s) {unset} have no {'/'.join(NODE_VARIABLES)} in their environment "
                "(not started by torchrun?)"]
    sizes = sorted({p.local_size for p in places})
    if len(sizes) > 1:
        per_node = {p.node: p.local_size for p in places}
        return [f"every node must run the same number of ranks, LOCAL_WORLD_SIZE by node "
                f"(GROUP_RANK): {dict(sorted(per_node.items()))}"]
    size = sizes[0]
    problems = []
    if len(places) != world:
        problems.append(f"the process group has {len(places)} of the job's {world} ranks; "
                        "hierarchical 1-bit runs on all of them")
    if world % size:
        problems.append(f"{world} ranks are not whole nodes of LOCAL_WORLD_SIZE={size}")
    misplaced = [(p.rank, p.node, p.local) for p in places
                 if not 0 <= p.local < size or p.rank != p.node * size + p.local]
    if misplaced:
        problems.append(f"ranks must be numbered node by node, rank = GROUP_RANK * "
                        f"LOCAL_WORLD_SIZE + LOCAL_RANK; (rank, GROUP_RANK, LOCAL_RANK) "
                        f"{misplaced[:6]}{' ...' if len(misplaced) > 6 else ''} are not")
    return problems


def node_layout(group, hierarchical) -> Optional[tuple[int, list[list[int]]]]:
    """This rank's rank and every rank's (node, local rank) from torchrun's environment, after
    one allgather on ``group``; the hierarchical collective's groups (one per node, one per
    local rank) made here, on every rank in the same order. A layout that is not nodes of one
    size, numbered node by node, is a ValueError on every rank with ``hierarchical=True``, and
    flat collectives (with a warning) with "auto"."""
    import torch.distributed as dist

    mine = Place.from_environment(dist.get_rank(group))
    places: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, mine, group=group)
    problems = layout_problems(places, dist.get_world_size())
    if problems:
        message = "hierarchical 1-bit needs torchrun's node layout: " + "; ".join(problems)
        if hierarchical is True:
            raise ValueError(message)
        warnings.warn(f"hvd_onebit: hierarchical='auto' stays flat: {message}")
        return None
    size = places[0].local_size
    nodes = [tuple(range(k * size, (k + 1) * size)) for k in range(len(places) // size)]
    columns = [tuple(row[i] for row in nodes) for i in range(size)]
    torch_subgroups(nodes + columns)
    return mine.rank, [[p.node, p.local] for p in places]


class TorchJob(JobTransport):
    """The 1-bit stages and the exact sums on one torch.distributed process group (Gloo for CPU
    tensors, NCCL for CUDA ones). Exact sums are an allgather of each tensor summed in rank
    order, so every rank gets the same bits whatever the backend's reduction order.

    Args:
        group: the process group (every rank of it builds this at the same point).
        hierarchical: False: flat collectives, no node layout read. True or "auto": the node
            layout from torchrun's environment (:func:`node_layout`, one allgather and the
            subgroups, now); the engine's collectives then decide as the Horovod face's do.
    """

    exact_average = True
    nodes_from = "torchrun: each of its --nnodes agents is a node (GROUP_RANK)"

    def __init__(self, group, hierarchical=False):
        import torch.distributed as dist

        self.group = group
        self._stages = TorchTransport(group=group)
        self.name = self._stages.name
        self._places = (node_layout(group, hierarchical)
                        if hierarchical is not False and dist.get_world_size(group) > 1 else None)

    def stages(self, device: torch.device) -> TorchTransport:
        """The stage transport for a collective on ``device``."""
        return TorchTransport(device=device, group=self.group)

    def exact_mean_(self, tensors: list[torch.Tensor], name: str) -> int:
        """The mean over ranks of each tensor, in place (the rank-order sum over the size)."""
        sums, nbytes = self.exact_sum(tensors, name)
        for t, total in zip(tensors, sums):
            t.copy_(total.div_(self.size))
        return nbytes

    def node_places(self) -> Optional[tuple[int, list[list[int]]]]:
        """This rank's rank and every rank's (GROUP_RANK, LOCAL_RANK), read at construction;
        None with flat collectives."""
        return self._places

    def gather_failures(self, failure: str) -> list[str]:
        import torch.distributed as dist

        failures: list = [None] * self.size
        dist.all_gather_object(failures, failure, group=self.group)
        return failures
