"""Buckets started from the gradient hooks during backward (overlap=True, the default) give the
same bits as buckets started in step(), with several buckets, backward_passes_per_step, a
parameter without gradients, param groups with different beta1, gradient clipping, GradScaler
and Adam's options changed between backward and step(); over Horovod's transport and
torch.distributed's. 2 real ranks."""
import pytest

from tests.checks import first_difference
from tests.worlds import shared_suite

pytestmark = pytest.mark.multirank

CASES = ["plain", "passes2", "clip", "scaler", "scaler_clip", "beta1", "beta2", "eps"]


results = shared_suite("tests.workers_overlap:suite", np=2, timeout=400)
# first in its job: the rendezvous is tried only where torch.distributed is not set up yet
fallback = shared_suite("tests.workers_overlap:rendezvous_fallback", np=2, timeout=120, order=-1)
# next (the last rank's Gloo fails to connect; the group is taken down again)
connect_fallback = shared_suite("tests.workers_overlap:rendezvous_fallback", np=2, timeout=120,
                                order=-1, kwargs={"broken": "connect"})
# next (the fallback set nothing up): torch.distributed set up at an address of this host
routed = shared_suite("tests.workers_overlap:rendezvous_interface", np=2, timeout=120, order=-1)


@pytest.mark.parametrize("case", CASES)
def test_overlap_is_bit_identical_to_starting_in_step(results, case):
    for rank, r in enumerate(results):
        on, off = r[(case, True)], r[(case, False)]
        assert on["error"] is None and off["error"] is None, \
            f"rank {rank}, {case}: overlap=True raised {on['error']!r}, " \
            f"overlap=False {off['error']!r}"
        assert on["buckets"] >= 4, f"rank {rank}: expected several buckets, got {on['buckets']}"
        assert on["hashes"] == off["hashes"], \
            f"rank {rank}, {case}: parameters differ from overlap=False at steps " \
            f"{[i for i, (a, b) in enumerate(zip(on['hashes'], off['hashes'])) if a != b]}"
        assert off["early_starts"] == 0, f"rank {rank}: overlap=False started buckets early"
    a, b = (r[(case, True)]["hashes"] for r in results)
    assert a == b, f"{case}: rank 1's parameters differ from rank 0's from step " \
                   f"{first_difference(a, b)} on"


def test_buckets_start_during_backward(results):
    for rank, r in enumerate(results):
        run = r[("plain", True)]
        # 6 compressed steps; the bucket holding the unused layer (and every bucket after it)
        # can only start in step(), the buckets before it start in the hooks
        assert 0 < run["early_starts"] < 6 * run["buckets"], \
            f"rank {rank}: {run['early_starts']} early starts over 6 steps of {run['buckets']} buckets"
        assert run["restarts"] == 0 and run["warnings"] == [], \
            f"rank {rank}: {run['restarts']} restarted steps (expected 0), warnings {run['warnings']}"
        assert set(run["breakdown"]) == {"compress", "wait", "server", "decode"}, \
            f"rank {rank}: the time breakdown's parts are {sorted(run['breakdown'])}"
        assert run["breakdown"]["compress"] > 0 and run["breakdown"]["decode"] > 0, \
            f"rank {rank}: compress and decode must have taken time: {run['breakdown']}"


def test_a_grad_scaler_keeps_the_overlap(results):
    for rank, r in enumerate(results):
        run = r[("scaler", True)]
        # the hooks unscale as GradScaler.unscale_ does: nothing to start again
        assert run["restarts"] == 0 and run["warnings"] == [], \
            f"rank {rank}: {run['restarts']} restarted steps (expected 0), warnings {run['warnings']}"
        plain = r[("plain", True)]["early_starts"]
        assert run["early_starts"] == plain > 0, \
            f"rank {rank}: {run['early_starts']} early starts with a GradScaler, {plain} without"


@pytest.mark.parametrize("case, what", [
    ("clip", "a gradient changed in place (e.g. clipped"),
    ("scaler_clip", "a gradient changed in place (e.g. clipped"),
    ("beta1", "beta1 changed (e.g. a scheduler that sets betas, such as OneCycleLR"),
    ("beta2", "beta2 changed (the preconditioned input reads its bias correction and bound)"),
    ("eps", "eps changed (the preconditioned input's denominator reads it)")])
def test_inputs_changed_after_backward_restart_once_then_start_in_step(results, case, what):
    for rank, r in enumerate(results):
        run = r[(case, True)]
        assert run["restarts"] == 1, f"rank {rank}, {case}: {run['restarts']} restarted steps"
        named = [w for w in run["warnings"] if "changed between backward and step(): " + what in w]
        assert len(named) == 1, \
            f"rank {rank}, {case}: no warning naming {what!r}, got {run['warnings']}"


def test_a_rank_clipping_alone_without_synchronize_stays_identical_to_the_others(results):
    """After the freeze, rank 1 clips its gradients in place between backward and step(), with
    no synchronize(), through refresh steps and compressed ones: every step averages what the
    ranks' gradients are at step() (a refresh step's allreduce starts there), so the ranks'
    parameters stay the same bits."""
    a, b = (r["clip_alone"]["hashes"] for r in results)
    assert a == b, f"rank 1's parameters differ from rank 0's from step {first_difference(a, b)}" \
                   f" on (of {len(a)})"
    refreshes, norms = results[0]["clip_alone"]["refreshes"], results[1]["clip_alone"]["norms"]
    assert refreshes >= 2 and min(norms) > 1e-3, \
        f"{refreshes} refresh steps, gradient norms {norms} before rank 1's clip at 1e-3: " \
        "the run must take refresh steps and clip in each"


def test_transports_give_the_same_bits(results):
    for rank, r in enumerate(results):
        auto, hvd_run = r[("plain", True)], r["horovod_transport"]
        assert auto["transport"] == "torch", f"rank {rank}: transport='auto' chose {auto['transport']}"
        assert hvd_run["transport"] == "horovod", \
            f"rank {rank}: transport='horovod' ran on {hvd_run['transport']!r}"
        assert hvd_run["hashes"] == auto["hashes"], \
            f"rank {rank}: transport='horovod' differs from transport='torch' from step " \
            f"{first_difference(hvd_run['hashes'], auto['hashes'])} on"
        assert hvd_run["early_starts"] == auto["early_starts"], \
            f"rank {rank}: {hvd_run['early_starts']} early starts over Horovod, " \
            f"{auto['early_starts']} over torch.distributed"


def test_zero_grad_with_buckets_in_flight_is_refused(results):
    for rank, r in enumerate(results):
        assert "zero_grad() was called after loss.backward()" in (r["zero_grad"]["zero_grad_error"]
                                                                  or ""), \
            f"rank {rank}: {r['zero_grad']['zero_grad_error']!r}"


def test_auto_transport_is_torch_distributed_where_it_can_serve(results):
    for rank, r in enumerate(results):
        choice = r["choice"]
        assert (choice["plain"], choice["hierarchical"], choice["explicit"], choice["elastic"]) \
            == ("torch", "torch", "horovod", "horovod"), f"rank {rank}: {choice}"
        assert "elastic" in (choice["elastic_torch_error"] or ""), \
            f"rank {rank}: transport='torch' in an elastic job: {choice['elastic_torch_error']!r}"


def test_an_unreachable_rendezvous_falls_back_to_horovod_on_every_rank(fallback):
    results = fallback
    for rank, r in enumerate(results):
        assert r["auto"] == "horovod", f"rank {rank}: transport='auto' chose {r['auto']}"
        assert any("198.18.255.1:29999" in w for w in r["auto_warnings"]), \
            f"rank {rank}: no warning naming the unreachable rendezvous: {r['auto_warnings']}"
        assert "TorchRendezvousError" in (r["torch_error"] or "") and \
            "rank(s) [" in r["torch_error"], f"rank {rank}: {r['torch_error']!r}"
        assert r["steps"] == 1, f"rank {rank}: {r['steps']} steps after the fallback, expected 1"


def test_gloo_connections_that_fail_after_the_rendezvous_fall_back_on_every_rank(
        connect_fallback):
    """The last rank's Gloo cannot connect (no such interface); the others wait for it, within
    the rendezvous's time, then all agree: no rank waits on in its connections."""
    for rank, r in enumerate(connect_fallback):
        assert r["auto"] == "horovod" and any("TorchConnectError" in w or "could not connect"
                                              in w for w in r["auto_warnings"]), \
            f"rank {rank}: transport='auto' chose {r['auto']}, warned {r['auto_warnings']}"
        assert "TorchConnectError" in (r["torch_error"] or "") and \
            "rank(s) [" in r["torch_error"] and "1]" in r["torch_error"], \
            f"rank {rank}: transport='torch' raised {r['torch_error']!r}"
        assert (r["steps"], r["initialized"]) == (1, False), \
            f"rank {rank}: {r['steps']} steps after the fallback (expected 1), " \
            f"torch.distributed left set up: {r['initialized']}"


def test_gloo_takes_the_interface_that_routes_to_rank_0_where_horovod_names_none(routed):
    for rank, r in enumerate(routed):
        if r["skipped"]:
            pytest.skip(f"no address of this host's but a loopback one: {r['skipped']}")
        assert (r["gloo"], r["transport"], r["phase"]) == \
            (r["interface"], "torch", "compression"), \
            f"rank {rank}: GLOO_SOCKET_IFNAME {r['gloo']!r} (the route to rank 0 leaves from " \
            f"{r['interface']!r}), transport {r['transport']}, phase {r['phase']}"
    assert routed[0]["hash"] == routed[1]["hash"], "the ranks' parameters differ"


@pytest.mark.parametrize("env, towards, want", [
    ({}, "eth1", "eth1"),  # mpirun: the route to rank 0
    ({"HOROVOD_GLOO_IFACE": "ib0"}, "eth1", "ib0"),  # horovodrun --gloo: Horovod's
    ({"GLOO_SOCKET_IFNAME": "eth2", "HOROVOD_GLOO_IFACE": "ib0"}, "eth1", None),  # the script's
    ({}, "lo", None),  # one host: Gloo's own choice
    ({"HOROVOD_GLOO_IFACE": "lo"}, None, None),
    ({}, None, None),  # the route could not be told
])
def test_the_gloo_interface_chosen(env, towards, want):
    from hvd_onebit.transport.rendezvous import gloo_interface
    got = gloo_interface(env, lambda: towards)
    assert got == want, \
        f"environment {env}, route through {towards!r}: chose {got!r}, want {want!r}"


def test_the_interface_towards_an_address_is_the_one_holding_the_route_source():
    from hvd_onebit.transport.rendezvous import interface_towards
    from tests.workers_overlap import host_interfaces
    for ip, name in host_interfaces().items():
        assert interface_towards(ip) == name, \
            f"towards {ip} (held by {name}): {interface_towards(ip)!r}"
