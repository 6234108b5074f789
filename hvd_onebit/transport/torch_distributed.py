"""The torch.distributed transport (Gloo for CPU tensors, NCCL for CUDA) and its subgroups.

No negotiation round (unlike Horovod's): one collective costs about one network round trip plus
its bytes, and it needs nothing but the ranks' TCP reachability, which a Horovod job already has.
In a Horovod job its default group is set up by
:func:`~hvd_onebit.transport.rendezvous.init_torch_distributed`; the hierarchical collective's
groups come from :func:`torch_subgroups`. Under torchrun (the DDP face) it runs on a group the
caller gives, with no Horovod at all: Horovod is imported only where a Horovod job is checked.
"""
from __future__ import annotations

import atexit
import gc
import os
import time
from typing import Any, Optional

import torch


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None,
                      async_op: bool = False):
    """torch.distributed's allgather of one tensor into one output tensor (``output``: the
    ranks' tensors one after another along dim 0). torch 2.13 names it ``all_gather_single``
    and warns (FutureWarning) on every call of the older name, ``all_gather_into_tensor``, which
    calls it; older torch has only the older name. Either way the same collective."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


#: How long the exit handler of :func:`settle_at_exit` lets torch.distributed's threads run.
SETTLE_S = 0.2

_SETTLE_REGISTERED: list = []


def settle(seconds: float = SETTLE_S) -> None:
    """Let torch.distributed's threads finish with this process's last collectives, at its exit:
    collect the garbage (the optimizer's parts refer to one another), then release the GIL for
    ``seconds``. Gloo's threads drop each finished collective's tensors after the caller's wait
    returns, and dropping a tensor Python also holds takes the GIL; a thread that asks for it
    once the interpreter has begun to finalize is ended there, which aborts the process
    ("terminate called without an active exception") after its training has ended, and the
    launcher reports the job failed. The process group itself stays alive to the end (once a DDP
    model was built on it, it outlives the model and destroy_process_group()), so nothing joins
    those threads first."""
    gc.collect()
    time.sleep(seconds)


def settle_at_exit() -> None:
    """Register :func:`settle` to run at the interpreter's exit, once per process (an exit
    handler runs while the interpreter is still whole; those registered later run before it)."""
    if not _SETTLE_REGISTERED:
        atexit.register(settle)
        _SETTLE_REGISTERED.append(True)


class _TorchWork:
    def __init__(self, work, result: torch.Tensor):
        self.work = work
        self.result = result


class TorchTransport:
    """Stage collectives through torch.distributed: Gloo for CPU tensors, NCCL for CUDA ones.

    Ops go straight to the process group, with no negotiation round in Horovod's background
    thread: one collective costs about one network round trip plus its bytes. They are matched
    by the order of the calls (every caller here starts them in the same order on every rank).
    In a Horovod job the process group is torch.distributed's default group, initialised on first
    use with the ranks of Horovod's global process set (:func:`init_torch_distributed`), or the
    one the script initialised itself if its ranks agree with Horovod's.

    Args:
        process_set: must be Horovod's global process set (None: that one).
        device: where the tensors live: CPU needs a Gloo group, CUDA an NCCL one.
        members: a subgroup's global ranks, ascending (its group from :func:`torch_subgroups`,
            in a Horovod job or a torchrun one); None: every rank.
        group: a torch.distributed process group to run on as it is, without Horovod (the
            DDP face's); ``process_set`` and ``members`` are then not read.
    """

    name = "torch"

    def __init__(self, process_set=None, device: torch.device | str = "cpu",
                 members: Optional[tuple[int, ...]] = None, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.device = torch.device(device)
        settle_at_exit()
        if group is None and members is not None:
            # made by torch_subgroups, so torch.distributed is set up and the job was checked
            # when it was (a Horovod job's or a torchrun job's alike: no Horovod needed here)
            group = _SUBGROUPS.get(tuple(members))
            if group is None:
                raise RuntimeError(f"no torch.distributed group for ranks {tuple(members)}: "
                                   "create the job's groups with torch_subgroups() first")
        if group is not None:  # a subgroup's ranks are its members' in ascending order
            self.group = group
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            return
        from .rendezvous import init_torch_distributed

        check_torch_transport(process_set, torch.device(device))
        init_torch_distributed(torch.device(device))
        self.group = None
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()

    def alltoall_async(self, rows: torch.Tensor, name: str) -> _TorchWork:
        """rows: [n, row_bytes] uint8; row j goes to rank j."""
        out = torch.empty_like(rows)
        return _TorchWork(self._dist.all_to_all_single(out, rows.contiguous(), group=self.group,
                                                       async_op=True), out)

    def allgather_async(self, row: torch.Tensor, name: str) -> _TorchWork:
        """row: [1, row_bytes] uint8; every rank receives [n, row_bytes]."""
        out = torch.empty((self.size * row.shape[0], *row.shape[1:]), dtype=row.dtype,
                          device=row.device)
        return _TorchWork(all_gather_single(out, row.contiguous(), group=self.group,
                                            async_op=True), out)

    def wait(self, handle: _TorchWork) -> torch.Tensor:
        handle.work.wait()  # Gloo: a condition-variable wait (no spinning); NCCL: a stream wait
        return handle.result

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        out: list = [None] * self.size
        self._dist.all_gather_object(out, [int(v) for v in values], group=self.group)
        return [list(v) for v in out]

    def allgather_ints_async(self, values: list[int], name: str) -> list[list[int]]:
        return self.allgather_ints(values, name)  # small and rare: done at once

    def allgather_ints_wait(self, handle: list[list[int]]) -> list[list[int]]:
        return handle


# torch.distributed subgroups by their members (global ranks, ascending); made collectively, once
_SUBGROUPS: dict[tuple[int, ...], Any] = {}


def torch_subgroups(groups: list[tuple[int, ...]]) -> None:
    """Create the torch.distributed groups of ``groups`` (each a tuple of global ranks,
    ascending), those not made yet. Every rank must call it with the same list at the same point
    (``dist.new_group`` is a collective of the default group, even for non-members)."""
    import torch.distributed as dist

    for members in groups:
        if tuple(members) not in _SUBGROUPS:
            _SUBGROUPS[tuple(members)] = dist.new_group(list(members))


def check_torch_transport(process_set, device: torch.device) -> None:
    """Raise (the same error on every rank, without a collective) if transport='torch' cannot
    serve this Horovod job (``process_set`` None: Horovod's global one)."""
    import horovod.torch as hvd
    import torch.distributed as dist

    if process_set is None:
        process_set = hvd.global_process_set

    if not dist.is_available():
        raise RuntimeError("transport='torch' needs torch.distributed, which this torch build "
                           "lacks; use transport='horovod'")
    if process_set.process_set_id != hvd.global_process_set.process_set_id:
        raise ValueError("transport='torch' reduces over all of Horovod's ranks; with a process "
                         "set use transport='horovod'")
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise ValueError("transport='torch' cannot follow an elastic job's changing ranks (a "
                         "torch.distributed group has a fixed size); use transport='horovod'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"transport='torch' moves CPU (Gloo) or CUDA (NCCL) tensors, the "
                         f"parameters are on {device}")
    if dist.is_initialized():
        backend = dist.get_backend()
        if dist.get_world_size() != hvd.size() or dist.get_rank() != hvd.rank():
            raise RuntimeError(
                f"transport='torch': torch.distributed was initialised with rank "
                f"{dist.get_rank()} of {dist.get_world_size()}, Horovod has rank {hvd.rank()} of "
                f"{hvd.size()}; they must agree")
        needed = "nccl" if device.type == "cuda" else "gloo"
        if needed not in str(backend):
            raise RuntimeError(f"transport='torch' with {device.type} tensors needs a "
                               f"{needed} process group; torch.distributed was initialised with "
                               f"{backend}")
