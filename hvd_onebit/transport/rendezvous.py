"""torch.distributed's default group set up over Horovod's ranks, agreed on every rank."""
from __future__ import annotations

import fcntl
import os
import socket
import struct
from typing import Mapping, Optional

import horovod.torch as hvd
import torch

# How long every rank may take to reach rank 0's rendezvous when torch.distributed is set up
RENDEZVOUS_TIMEOUT_S = 60.0


class TorchRendezvousError(RuntimeError):
    """Some rank could not reach torch.distributed's rendezvous; raised on every rank alike."""


class TorchConnectError(RuntimeError):
    """After the rendezvous, torch.distributed's group could not connect some rank to the
    others (within the rendezvous's time on Gloo); raised on every rank alike."""


def init_torch_distributed(device: torch.device | str = "cpu",
                           timeout_s: Optional[float] = None) -> None:
    """Initialise torch.distributed's default group over Horovod's ranks, unless it is already.

    Rank 0 listens on a port the system picks, at the address Horovod reaches it at (its
    ``HOROVOD_HOSTNAME``, else its host name's address), or at rank 0's ``MASTER_ADDR`` and
    ``MASTER_PORT`` when both are set, and then tells the others through Horovod (listening
    first, no other process can take the port in between). Gloo is kept on
    Horovod's interface (``HOROVOD_GLOO_IFACE``); where Horovod names none (mpirun), on the
    interface that routes to rank 0's address (:func:`gloo_interface`), not on the host name's
    address, which may be a loopback one. Every rank must call it at the same point.

    Every rank gets ``timeout_s`` (default ``HVD_ONEBIT_RENDEZVOUS_S`` or 60 s) to reach the
    rendezvous, and on Gloo as long again to connect to the others; whether all did is then
    agreed through one Horovod allgather each, so a network that cannot carry them (a host
    name that resolves to a loopback address on a cluster, a firewall that drops the
    connections between the ranks) is a :class:`TorchRendezvousError` or a
    :class:`TorchConnectError` on every rank, not a hang. The group's collectives then get
    torch's default timeout.
    """
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.distributed.constants import default_pg_timeout

    # torch's own setter of a group's timeout (private; without it, Gloo's connections are not
    # bounded by the rendezvous's time, whose short timeout would stay on every collective)
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)

    if dist.is_initialized():
        return
    if timeout_s is None:
        timeout_s = float(os.environ.get("HVD_ONEBIT_RENDEZVOUS_S", RENDEZVOUS_TIMEOUT_S))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
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
    iface = gloo_interface(os.environ, lambda: interface_towards(addr[0]))
    if backend == "gloo" and iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    bounded = backend == "gloo" and set_timeout is not None  # NCCL connects lazily
    error = None
    try:  # Gloo connects every pair of ranks here: bounded, then agreed
        dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size(),
                                **({"timeout": timeout} if bounded else {}))
    except Exception as exc:  # noqa: BLE001 - refused, timed out, no such interface: agreed
        error = exc
    flags = hvd.allgather(torch.tensor([[0 if error is None else 1]], dtype=torch.int32),
                          name="hvd_onebit.torch_dist_connected").flatten().tolist()
    failed = [r for r, f in enumerate(flags) if f]
    if failed:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise TorchConnectError(
            f"torch.distributed's {backend} group could not connect rank(s) {failed} to the "
            f"others after the rendezvous at {addr[0]}:{addr[1]}"
            + (f" within {timeout_s:g} s" if bounded else "")
            + (f" (this rank: {_first_line(error)})" if error is not None else "")
            + f"; on Gloo, this rank used interface "
            f"{os.environ.get('GLOO_SOCKET_IFNAME', '(its host name)')}: set "
            "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for NCCL) on every rank to the interface "
            "of the network between the nodes, or pass transport='horovod'") from error
    if bounded:
        set_timeout(default_pg_timeout)


def gloo_interface(env: Mapping[str, str], towards) -> Optional[str]:
    """The interface Gloo's connections should use, or None to leave Gloo's choice (its own
    ``GLOO_SOCKET_IFNAME``, else the host name's address): the one the script set itself,
    then Horovod's (``HOROVOD_GLOO_IFACE``, set by ``horovodrun --gloo``), then ``towards()``:
    the interface that routes to rank 0's rendezvous address. A loopback one is left to Gloo
    (a single host, whose host name's address serves)."""
    if "GLOO_SOCKET_IFNAME" in env:
        return None
    iface = env.get("HOROVOD_GLOO_IFACE") or towards()
    return iface if iface and iface != "lo" else None


def interface_towards(host: str) -> Optional[str]:
    """The name of this host's network interface whose address the route to ``host`` leaves
    from (Linux; IPv4), or None where it cannot be told. No packet is sent: connecting a UDP
    socket only chooses the route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    info = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(info[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


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
