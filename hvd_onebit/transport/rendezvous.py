"""torch.distributed's default group set up over Horovod's ranks, agreed on every rank."""
from __future__ import annotations

import os
import socket
from typing import Optional

import horovod.torch as hvd
import torch

# How long every rank may take to reach rank 0's rendezvous when torch.distributed is set up
RENDEZVOUS_TIMEOUT_S = 60.0


class TorchRendezvousError(RuntimeError):
    """Some rank could not reach torch.distributed's rendezvous; raised on every rank alike."""


def init_torch_distributed(device: torch.device | str = "cpu",
                           timeout_s: Optional[float] = None) -> None:
    """Initialise torch.distributed's default group over Horovod's ranks, unless it is already.

    Rank 0 listens on a free port of the address Horovod reaches it at (its
    ``HOROVOD_HOSTNAME``, else its host name's address), or at rank 0's ``MASTER_ADDR`` and
    ``MASTER_PORT`` when both are set, and tells the others through Horovod. Gloo is kept on
    Horovod's interface (``HOROVOD_GLOO_IFACE``). Every rank must call it at the same point.

    Every rank gets ``timeout_s`` (default ``HVD_ONEBIT_RENDEZVOUS_S`` or 60 s) to reach the
    rendezvous; whether all did is then agreed through one Horovod allgather, so a network that
    cannot carry it (a host name that resolves to a loopback address on a cluster, a firewall)
    is a :class:`TorchRendezvousError` on every rank, not a hang.
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if timeout_s is None:
        timeout_s = float(os.environ.get("HVD_ONEBIT_RENDEZVOUS_S", RENDEZVOUS_TIMEOUT_S))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface and iface != "lo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    addr = None
    if hvd.rank() == 0:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        else:
            host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
            try:
                ip = socket.gethostbyname(host if host != "localhost" else socket.gethostname())
            except OSError:
                ip = "127.0.0.1"
            with socket.socket() as s:
                s.bind((ip, 0))
                addr = (ip, s.getsockname()[1])
    addr = hvd.broadcast_object(addr, root_rank=0, name="hvd_onebit.torch_dist_addr")
    store, error = None, None
    try:
        store = dist.TCPStore(addr[0], addr[1], hvd.size(), hvd.rank() == 0,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=True)
    except Exception as exc:  # unreachable, refused, timed out: agreed below
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    flags = hvd.allgather(torch.tensor([[0 if store is not None else 1]], dtype=torch.int32),
                          name="hvd_onebit.torch_dist_joined").flatten().tolist()
    failed = [r for r, f in enumerate(flags) if f]
    if failed:
        raise TorchRendezvousError(
            f"torch.distributed's rendezvous at {addr[0]}:{addr[1]} (rank 0's address) failed "
            f"on rank(s) {failed} within {timeout_s:g} s"
            + (f" (this rank: {error})" if error else "")
            + "; set MASTER_ADDR and MASTER_PORT to an address of rank 0 every rank reaches, "
            "or pass transport='horovod'")
    dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size())
