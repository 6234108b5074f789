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

    Rank 0 listens on a port the system picks, at the address Horovod reaches it at (its
    ``HOROVOD_HOSTNAME``, else its host name's address), or at rank 0's ``MASTER_ADDR`` and
    ``MASTER_PORT`` when both are set, and then tells the others through Horovod (listening
    first, no other process can take the port in between). Gloo is kept on
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
    timeout = datetime.timedelta(seconds=timeout_s)
    store, error, addr = None, None, None
    if hvd.rank() == 0:
        addr = _master_address()
        try:  # listening before the others are told where: no other process can take the port
            store = dist.TCPStore(addr[0], addr[1], hvd.size(), True, timeout=timeout,
                                  wait_for_workers=False)
            addr = (addr[0], store.port)
        except Exception as exc:  # the port is taken, the address is not this host's
            error = _first_line(exc)
    addr, listening = hvd.broadcast_object((addr, store is not None), root_rank=0,
                                           name="hvd_onebit.torch_dist_addr")
    if hvd.rank() != 0 and listening:
        try:
            store = dist.TCPStore(addr[0], addr[1], hvd.size(), False, timeout=timeout)
        except Exception as exc:  # unreachable, refused, timed out: agreed below
            error = _first_line(exc)
    flags = hvd.allgather(torch.tensor([[0 if store is not None else 1]], dtype=torch.int32),
                          name="hvd_onebit.torch_dist_joined").flatten().tolist()
    failed = [r for r, f in enumerate(flags) if f]
    if failed:
        raise TorchRendezvousError(
            f"torch.distributed's rendezvous at {addr[0]}:{addr[1]} (rank 0's address) failed "
            f"on rank(s) {failed} within {timeout_s:g} s"
            + (f" (this rank: {error})" if error else "")
            + ("" if listening else " (rank 0 could not listen there)")
            + "; set MASTER_ADDR and MASTER_PORT to an address of rank 0 every rank reaches, "
            "or pass transport='horovod'")
    dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size())


def _master_address() -> tuple[str, int]:
    """Where rank 0 listens: ``MASTER_ADDR`` and ``MASTER_PORT`` when both are set, else the
    address Horovod reaches it at and a port the system picks (0)."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
    try:
        ip = socket.gethostbyname(host if host != "localhost" else socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    return ip, 0


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
