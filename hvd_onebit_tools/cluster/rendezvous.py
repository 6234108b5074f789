"""Horovod's side of the emulated cluster: its rendezvous server and each rank's environment.

Horovod is launched the way ``horovodrun --gloo`` would launch it, without horovodrun: Horovod's
own rendezvous server listens on the bridge address, and every rank gets exactly the
``HOROVOD_*`` environment of :func:`horovod.runner.gloo_run.launch_gloo`. Each host is a node
with ``slots`` ranks: with one slot per host (``local_size`` 1, ``cross_size`` N) every collective
crosses the emulated links; with L slots, ``HOROVOD_LOCAL_*`` and ``HOROVOD_CROSS_*`` describe N
nodes of L ranks, as ``horovodrun -H node0:L,node1:L,...`` would. Horovod is imported only here,
and only when a cluster starts.
"""
from __future__ import annotations

from typing import Sequence

from .network import IFACE


def start_server(address: str):
    """Horovod's rendezvous HTTP server, bound to ``address`` only; returns (server, port)."""
    from horovod.runner.http.http_server import (RendezvousHandler, RendezvousHTTPServer,
                                                 RendezvousServer)
    from horovod.runner.util.threads import in_thread

    server = RendezvousServer(verbose=0)
    # RendezvousServer.start() binds to all addresses on a random port; we want one address only.
    server._httpd = RendezvousHTTPServer((address, 0), RendezvousHandler, 0)
    server._listen_thread = in_thread(target=server._httpd.serve_forever)
    return server, server._httpd.server_address[1]


def stop_server(server) -> None:
    server.stop()
    server._httpd.server_close()


def host_alloc_plan(hostnames: Sequence[str], slots: int = 1):
    """Horovod's slot plan: ``slots`` ranks on each host, host by host (rank = host * slots +
    local rank)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    hosts = parse_hosts(",".join(f"{name}:{slots}" for name in hostnames))
    return get_host_assignments(hosts, len(hostnames) * slots)


def horovod_env(hostnames: Sequence[str], rank: int, rendezvous_address: str,
                rendezvous_port: int, slots: int = 1) -> dict[str, str]:
    """The environment ``horovodrun --gloo`` would give ``rank`` (see gloo_run.launch_gloo)."""
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

    slot = host_alloc_plan(hostnames, slots)[rank]
    env = {k: str(v) for k, v in create_slot_env_vars(slot).items()}
    env.update({k: str(v) for k, v in create_run_env_vars(
        rendezvous_address, [IFACE], rendezvous_port).items()})
    env["PYTHONUNBUFFERED"] = "1"  # as horovodrun does, so output interleaves sensibly
    return env
