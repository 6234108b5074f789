"""The bandwidth-limited cluster emulator: real namespaces, real tbf links, real Horovod ranks.

Every scenario (normal exit, a crashing rank, timeout, SIGINT, SIGTERM, SIGKILL of the launcher)
checks afterwards that nothing of *that* cluster is left: no network namespace, no link, no
/etc/netns entry, no state file, no process. Cluster ids are read from the API or from the CLI's
--verbose log, so a concurrent cluster on the same machine cannot confuse the checks.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from hvd_onebit_tools.cluster import (EmulatedCluster, EmulatorError, check_privileges, cleanup_stale,
                                parse_bandwidth)
from hvd_onebit_tools.cluster.network import IFACE, NETNS_ETC, STATE_DIR
from tests.cli import hvd_onebit

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "emulator_scripts"
ALLREDUCE = str(SCRIPTS / "allreduce.py")
PROBE = str(SCRIPTS / "rank_probe.py")
CLI = [sys.executable, "-m", "hvd_onebit_tools.cli", "cluster", "run"]
TOKEN_VAR = "HOB_TEST_TOKEN"


def _can_build_namespaces() -> str | None:
    """None if this machine can run the emulator, else why not (the skip reason)."""
    if os.geteuid() != 0:
        return "the emulator needs root"
    try:
        check_privileges()
    except EmulatorError as e:
        return str(e)
    name = f"hob-probe-{uuid.uuid4().hex[:6]}"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


_SKIP_REASON = _can_build_namespaces() if sys.platform.startswith("linux") else "Linux only"
needs_netns = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")


# ----------------------------------------------------------------------------- helpers


def leftovers(cluster_id: str) -> list[str]:
    """Everything of cluster ``cluster_id`` still on the machine (should be [])."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           timeout=30).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if cluster_id in line]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           timeout=30).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
              if cluster_id in line]
    if NETNS_ETC.is_dir():
        found += [f"/etc/netns/{p.name}" for p in NETNS_ETC.iterdir() if cluster_id in p.name]
    if (STATE_DIR / f"{cluster_id}.json").exists():
        found.append(f"state file {cluster_id}.json")
    import tempfile

    found += [f"folder {p}"
              for p in Path(tempfile.gettempdir()).glob(f"hob-started-{cluster_id}-*")]
    return found


def token_processes(token: str) -> list[int]:
    """PIDs of live processes that carry the test's token in their environment."""
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(TOKEN_VAR) == token and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


def wait_gone(token: str, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (pids := token_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def cli_env(token: str) -> dict:
    env = dict(os.environ)
    env[TOKEN_VAR] = token
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_cli(args: list[str], token: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, cwd=REPO,
                          env=cli_env(token), timeout=timeout)


def cluster_id_from(stderr: str) -> str:
    m = re.search(r"\[emulator ([0-9a-f]{6})\]", stderr)
    assert m, f"no cluster id in --verbose output:\n{stderr}"
    return m.group(1)


def shaper(dev: str, netns: str | None = None) -> dict:
    """The tbf qdisc on ``dev`` (inside ``netns``, or in the root namespace): its rate in bits/s,
    the bytes it passed and how often it held a packet back for want of tokens (overlimits),
    cumulative since the link was made."""
    cmd = ["tc", "-s", "-j"] + (["-n", netns] if netns else []) + ["qdisc", "show", "dev", dev]
    qdiscs = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True,
                                       timeout=30).stdout)
    tbf = [q for q in qdiscs if q["kind"] == "tbf"]
    assert len(tbf) == 1, f"{netns or 'root'}/{dev}: qdiscs {qdiscs}"
    return {"rate_bps": tbf[0]["options"]["rate"] * 8, "bytes": tbf[0]["bytes"],
            "overlimits": tbf[0]["overlimits"]}


def host_shapers(host) -> dict:
    """Both tbf qdiscs of a host's link: "receive" on the bridge side, "send" in its namespace."""
    return {"receive": shaper(host.host_veth), "send": shaper(IFACE, host.netns)}


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


# ----------------------------------------------------------------------------- no root needed


def test_help_explains_every_option():
    out = hvd_onebit(["cluster", "run", "--help"])
    assert out.exit_code == 0, out.stderr
    for option in ("--np", "--bandwidth", "--queue-ms", "--timeout", "--json", "--log-dir", "--quiet", "--env",
                   "--kill-grace", "--verbose", "--nodes", "--ranks-per-node", "--intra-bandwidth",
                   "unlimited", "124", "130", "143"):
        assert option in out.stdout, option


# ----------------------------------------------------------------------------- real clusters


@needs_netns
def test_rate_is_enforced_and_bytes_are_counted():
    """2 ranks allreduce 4 MB at 50mbit: each sends and receives ~4 MB, and all of it goes through
    a tbf shaper at 50mbit on each end of its link that had to hold packets back. (How long it
    takes is a benchmark's figure, not a test's: `hvd-onebit bench allreduce --bandwidth 50mbit`
    prints the fp32 allreduce time per call on the same emulated links.)"""
    mbytes, rate = 4.0, "50mbit"
    with EmulatedCluster(np=2, bandwidth=rate) as cluster:
        cid = cluster.id
        result = cluster.run([sys.executable, ALLREDUCE, str(mbytes)], timeout=120)
        assert result.ok, [r.output for r in result.ranks]
        reports = [last_json(r.output) for r in result.ranks]
        shapers = [host_shapers(h) for h in cluster.hosts]
        # A second command in the same cluster: fresh rendezvous, counters are per-run deltas.
        small = cluster.run([sys.executable, ALLREDUCE, "0.5"], timeout=120)
        assert small.ok, [r.output for r in small.ranks]
        totals = cluster.counters()
    assert leftovers(cid) == []

    payload = mbytes * 1e6  # 2-rank ring: each rank sends N, gets N
    for rank, (r, rep) in enumerate(zip(result.ranks, reports)):
        assert (rep["rank"], rep["size"], rep["hostname"]) == (rank, 2, f"node{rank}")
        assert (rep["local_size"], rep["cross_size"]) == (1, 2)  # one host per rank
        for direction, tbf in shapers[rank].items():
            # the shaper runs at the requested rate and the payload went through it
            assert tbf["rate_bps"] == parse_bandwidth(rate), (rank, direction, tbf)
            assert tbf["bytes"] > payload, (rank, direction, tbf)
        # and the link was the bottleneck: this rank's stream passes its own send shaper, then
        # its peer's receive shaper, and one of the two had to hold packets back (a 4 MB burst
        # dwarfs a ~96 KiB bucket); which one depends on how the first paces the stream
        held = (shapers[rank]["send"]["overlimits"], shapers[1 - rank]["receive"]["overlimits"])
        assert sum(held) > 0, f"rank {rank}'s stream: overlimits (send, peer receive) {held}"
        for direction in (r.tx_bytes, r.rx_bytes):
            assert payload < direction < 1.25 * payload + 500_000, r  # + headers and control
        assert r.exit_code == 0 and not r.killed, \
            f"rank {rank}: exit code {r.exit_code}, killed {r.killed}"
    for rank, r in enumerate(small.ranks):
        assert 0.5e6 < r.tx_bytes < 1.5e6
        assert totals[rank][0] >= result.ranks[rank].tx_bytes + r.tx_bytes


@needs_netns
def test_ranks_see_their_own_host_and_horovodrun_environment():
    with EmulatedCluster(np=3, bandwidth="unlimited") as cluster:
        result = cluster.run([sys.executable, PROBE], env={"HOB_TEST_EXTRA": "yes"}, timeout=60)
        expected_env = [cluster.horovod_env(r) for r in range(3)]
        bridge_address, port = cluster.bridge_address, cluster.rendezvous_port
        addresses = [h.address for h in cluster.hosts]
        cid = cluster.id
    assert leftovers(cid) == []
    assert result.ok, [r.output for r in result.ranks]
    for rank, r in enumerate(result.ranks):
        probe = json.loads(r.output.splitlines()[0])
        assert probe["hostname"] == f"node{rank}" == r.hostname
        assert probe["resolved"] == addresses[rank] == r.address  # the Gloo process-set trap
        assert probe["peers"] == {f"node{i}": a for i, a in enumerate(addresses)}
        assert ipaddress.ip_address(r.address) in ipaddress.ip_network("198.18.0.0/15")
        env = probe["env"]
        assert env.pop("HOB_TEST_EXTRA") == "yes"
        assert env == expected_env[rank]
        assert env == {
            "HOROVOD_HOSTNAME": f"node{rank}", "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "3",
            "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
            "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": "3",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": bridge_address,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "emu0", "NCCL_SOCKET_IFNAME": "emu0", "PYTHONUNBUFFERED": "1",
        }
        assert probe["pid"] < 10  # its own PID namespace


@needs_netns
def test_nodes_share_a_namespace_and_get_horovodrun_local_and_cross_environment():
    with EmulatedCluster(np=4, ranks_per_node=2, bandwidth="unlimited") as cluster:
        result = cluster.run([sys.executable, PROBE], timeout=60)
        addresses = [h.address for h in cluster.hosts]
        cid = cluster.id
    assert leftovers(cid) == []
    assert result.ok, [r.output for r in result.ranks]
    assert len(addresses) == 2, addresses
    for rank, r in enumerate(result.ranks):
        node, local = divmod(rank, 2)
        probe = json.loads(r.output.splitlines()[0])
        assert probe["hostname"] == f"node{node}" == r.hostname, (rank, probe["hostname"])
        assert probe["resolved"] == addresses[node] == r.address
        assert probe["peers"] == {f"node{i}": a for i, a in enumerate(addresses)}
        env = probe["env"]
        got = {k: env[k] for k in ("HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE",
                                   "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                                   "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")}
        assert got == {"HOROVOD_HOSTNAME": f"node{node}", "HOROVOD_RANK": str(rank),
                       "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": str(local),
                       "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": str(node),
                       "HOROVOD_CROSS_SIZE": "2"}, (rank, got)
        assert probe["pid"] < 10  # still its own PID namespace


@needs_netns
def test_traffic_inside_a_node_stays_off_the_shaped_links():
    """4 MB allreduced by 2 ranks of one node: (almost) nothing on the node's link, and fast
    although the link is 20mbit; by 2 nodes of 2 ranks: the node links carry the traffic."""
    mbytes = 4.0
    with EmulatedCluster(np=2, ranks_per_node=2, bandwidth="20mbit") as one_node:
        inside = one_node.run([sys.executable, ALLREDUCE, str(mbytes)], timeout=120)
        inside_shapers = host_shapers(one_node.hosts[0])
    with EmulatedCluster(np=4, ranks_per_node=2, bandwidth="unlimited") as two_nodes:
        across = two_nodes.run([sys.executable, ALLREDUCE, str(mbytes)], timeout=120)
    assert inside.ok and across.ok, [r.output for r in inside.ranks + across.ranks]
    payload = mbytes * 1e6
    # each rank reports an even share of its node's link (integer division: within a byte each)
    assert 0 <= inside.node_bytes[0][0] - sum(r.tx_bytes for r in inside.ranks) < 2
    assert inside.node_bytes[0][0] < 0.05 * payload, inside.node_bytes
    for r in inside.ranks:
        rep = last_json(r.output)
        assert (rep["local_size"], rep["cross_size"]) == (2, 1)
    # ...and the node's 20mbit shapers, both ways, passed (almost) none of it: nothing was slowed
    for direction, tbf in inside_shapers.items():
        assert tbf["rate_bps"] == parse_bandwidth("20mbit"), (direction, tbf)
        assert tbf["bytes"] < 0.05 * payload, (direction, tbf)
    assert len(across.node_bytes) == 2
    for tx, rx in across.node_bytes:
        assert tx > 0.5 * payload and rx > 0.5 * payload, across.node_bytes
    assert sum(r.tx_bytes for r in across.ranks) <= sum(tx for tx, _ in across.node_bytes)


def test_bad_node_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        EmulatedCluster(np=3, ranks_per_node=2)
    out = run_cli(["--nodes", "2", "--np", "3", "--", "true"], token="x", timeout=60)
    assert out.returncode != 0 and "--np 3 is not --nodes 2 x --ranks-per-node 1" in out.stderr, \
        f"--nodes 2 --np 3 exited with {out.returncode}: {out.stderr!r}"
    out = run_cli(["--ranks-per-node", "2", "--", "true"], token="x", timeout=60)
    assert out.returncode != 0 and "give --np (and --ranks-per-node), or --nodes" in out.stderr, \
        out.stderr
    out = run_cli(["--np", "3", "--ranks-per-node", "2", "--", "true"], token="x", timeout=60)
    assert out.returncode != 0 and "--np 3 is not a multiple of --ranks-per-node 2" in out.stderr, \
        f"--np 3 --ranks-per-node 2 exited with {out.returncode}: {out.stderr!r}"
    # a log folder that cannot be made is refused before the cluster is built (a traceback)
    bad = hvd_onebit(["cluster", "run", "--np", "2", "--log-dir", "/proc/nope", "--", "true"])
    assert bad.exit_code == 2 and "cannot make the folder '/proc/nope'" in bad.output, bad.output


@needs_netns
def test_cli_normal_run_json_report_and_logs(tmp_path):
    token = uuid.uuid4().hex
    out = run_cli(["--np", "2", "--bandwidth", "1gbit", "--json", "--verbose",
                   "--log-dir", str(tmp_path), "--", "python", ALLREDUCE, "1"], token)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    got = {k: report[k] for k in ("np", "bandwidth", "returncode", "timed_out")}
    assert got == {"np": 2, "bandwidth": "1gbit", "returncode": 0, "timed_out": False}, \
        f"the report says {got}"
    assert report["wall_seconds"] > 0, f"the report's wall_seconds is {report['wall_seconds']}"
    for rank, r in enumerate(report["ranks"]):
        assert (r["exit_code"], r["hostname"]) == (0, f"node{rank}"), \
            f"rank {rank}: exit code {r['exit_code']} on host {r['hostname']!r}"
        assert 1e6 < r["tx_bytes"] < 2e6 and 1e6 < r["rx_bytes"] < 2e6, \
            f"rank {rank}: {r['tx_bytes']} bytes sent, {r['rx_bytes']} received, expected " \
            f"1-2 MB each way"
        log = Path(r["log_path"]).read_text()
        assert f'"rank": {rank}' in log
        assert f"[{rank}] " in out.stderr  # live output goes to stderr with --json
    assert leftovers(cluster_id_from(out.stderr)) == []
    assert wait_gone(token) == []


@needs_netns
def test_cli_table_report():
    token = uuid.uuid4().hex
    out = run_cli(["-n", "2", "-b", "unlimited", "-v", "--", "python", PROBE], token)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^rank\s+host\s+address\s+exit\s+tx bytes\s+rx bytes", out.stdout, re.M), \
        f"no table header in the output:\n{out.stdout}"
    assert re.search(r"^1\s+node1\s+198\.1[89]\.\d+\.3\s+0\s", out.stdout, re.M), \
        f"no row for rank 1 on node1 (198.18/19.x.3, exit 0) in the table:\n{out.stdout}"
    for text in ("bandwidth=unlimited", "-> ok"):
        assert text in out.stdout, f"{text!r} is not in the output:\n{out.stdout}"
    assert leftovers(cluster_id_from(out.stderr)) == []


@needs_netns
def test_a_crashing_rank_kills_the_others():
    token = uuid.uuid4().hex
    out = run_cli(["--np", "3", "--json", "-v", "--kill-grace", "1", "--",
                   "python", PROBE, "--fail-rank", "1", "--exit-code", "7", "--sleep", "600"],
                  token, timeout=90)
    assert out.returncode == 7, out.stderr
    report = json.loads(out.stdout)
    # ended by the crash: the others were killed (SIGTERM, below), none ran to the end or timeout
    assert report["first_failed_rank"] == 1 and not report["timed_out"], report
    codes = [(r["exit_code"], r["killed"]) for r in report["ranks"]]
    assert codes == [(128 + signal.SIGTERM, True), (7, False), (128 + signal.SIGTERM, True)]
    assert leftovers(cluster_id_from(out.stderr)) == []
    assert wait_gone(token) == []


@needs_netns
def test_a_rank_killed_by_a_signal_fails_the_job():
    """A rank SIGKILLed from outside (OOM killer style): reported as 137, others killed."""
    token = uuid.uuid4().hex
    cmd = ["sh", "-c", 'if [ "$HOROVOD_RANK" = 0 ]; then kill -9 $$; fi; sleep 600']
    out = run_cli(["--np", "2", "--json", "-v", "--kill-grace", "1", "--"] + cmd, token,
                  timeout=90)
    assert out.returncode == 137, out.stderr
    report = json.loads(out.stdout)
    assert [r["exit_code"] for r in report["ranks"]] == [137, 128 + signal.SIGTERM]
    assert leftovers(cluster_id_from(out.stderr)) == []
    assert wait_gone(token) == []


@needs_netns
def test_a_rank_killed_during_its_setup_reports_the_signal(tmp_path):
    """Peers are killed while rank 1 is still in its set-up (before its command started).

    A `hostname` that stalls for rank 1 holds it in the set-up when rank 0 fails at once. A
    SIGTERM sent then used to hit the set-up (126) or be dropped by the namespace's PID 1 (137
    after the grace period); the rank must report the SIGTERM its command got, 143, every time.
    """
    real = shutil.which("hostname")
    fake = tmp_path / "bin" / "hostname"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\n[ "$HOROVOD_RANK" = 1 ] && sleep 2\nexec {real} "$@"\n')
    fake.chmod(0o755)
    token = uuid.uuid4().hex
    env = cli_env(token)
    env["PATH"] = f"{fake.parent}{os.pathsep}{env['PATH']}"
    cmd = ["sh", "-c", 'if [ "$HOROVOD_RANK" = 0 ]; then exit 7; fi; sleep 600']
    out = subprocess.run(CLI + ["--np", "2", "--json", "-v", "--kill-grace", "20", "--"] + cmd,
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=90)
    assert out.returncode == 7, out.stderr
    report = json.loads(out.stdout)
    assert [(r["exit_code"], r["killed"]) for r in report["ranks"]] == [
        (7, False), (128 + signal.SIGTERM, True)]
    # SIGTERM reached its command (143 above): not lost in the set-up and then SIGKILLed after
    # the 20 s grace (137), and no timeout ended the job
    assert not report["timed_out"], report
    assert leftovers(cluster_id_from(out.stderr)) == []
    assert wait_gone(token) == []


@needs_netns
def test_timeout_kills_everything():
    token = uuid.uuid4().hex
    out = run_cli(["--np", "2", "--timeout", "3", "--kill-grace", "1", "-v", "--",
                   "python", PROBE, "--sleep", "600"], token, timeout=90)
    # 124 and TIMED OUT: the emulator's --timeout ended ranks that would sleep for 600 s
    assert out.returncode == 124, out.stderr
    assert "TIMED OUT" in out.stdout
    assert leftovers(cluster_id_from(out.stderr)) == []
    assert wait_gone(token) == []


def _start_and_wait_ready(token: str, np_: int = 2) -> tuple[subprocess.Popen, str]:
    """Start a CLI job whose ranks sleep; return once every rank has printed 'ready'."""
    # SIGINT at its default in the launcher, whatever this process inherited: a job started in
    # the background (nohup, `cmd &`) ignores SIGINT, and so would the launcher's Python, which
    # then never raises KeyboardInterrupt and the SIGINT test waits out its timeout
    proc = subprocess.Popen(CLI + ["--np", str(np_), "-v", "--kill-grace", "1", "--",
                                   "python", PROBE, "--sleep", "600"],
                            cwd=REPO, env=cli_env(token), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ready, deadline = set(), time.monotonic() + 90
    while len(ready) < np_ and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"rank (\d+) ready", line)
        if m:
            ready.add(int(m.group(1)))
    if len(ready) < np_:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"ranks never got ready: {ready}\n{out}\n{err}")
    return proc, token


@needs_netns
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_removes_everything(sig, code):
    proc, token = _start_and_wait_ready(uuid.uuid4().hex)
    proc.send_signal(sig)
    try:
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == code, err
    assert "ranks killed, cluster removed" in err
    assert leftovers(cluster_id_from(err)) == []
    assert wait_gone(token) == []


@needs_netns
def test_sigkill_of_the_launcher_kills_ranks_and_next_cluster_cleans_up():
    """Nothing can run on SIGKILL: ranks die with their launcher, cleanup_stale() does the rest."""
    proc, token = _start_and_wait_ready(uuid.uuid4().hex)
    proc.kill()
    _out, err = proc.communicate(timeout=60)
    cid = cluster_id_from(err)
    assert wait_gone(token) == []
    left = leftovers(cid)
    assert left != [] and any(item.startswith("folder ") for item in left), \
        f"nobody cleaned up yet, the run's start markers among it: {left}"
    assert cid in cleanup_stale()
    assert leftovers(cid) == []  # ...until the next cluster (or cleanup_stale) does


@needs_netns
def test_api_cleans_up_when_the_caller_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(np=2, bandwidth="100mbit") as cluster:
            cid = cluster.id
            assert leftovers(cid) != []
            raise RuntimeError("boom")
    assert leftovers(cid) == []


def _drop_caps_prefix() -> list[str] | None:
    if shutil.which("capsh"):
        return ["capsh", "--drop=cap_net_admin,cap_sys_admin", "--", "-c", 'exec "$0" "$@"']
    if shutil.which("setpriv"):
        return ["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-all", "--"]
    return None


@pytest.mark.skipif(os.geteuid() != 0 or _drop_caps_prefix() is None,
                    reason="needs root and capsh or setpriv to drop capabilities")
def test_without_cap_net_admin_it_is_a_clear_error():
    token = uuid.uuid4().hex
    out = subprocess.run(_drop_caps_prefix() + CLI + ["--np", "2", "--", "true"],
                         capture_output=True, text=True, cwd=REPO, env=cli_env(token),
                         timeout=60)
    assert out.returncode == 1, out
    assert "CAP_NET_ADMIN" in out.stderr and "Traceback" not in out.stderr, \
        f"expected a one-line error naming CAP_NET_ADMIN, no traceback; stderr:\n{out.stderr}"


def test_not_started_and_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="np must be"):
        EmulatedCluster(np=0)
    with pytest.raises(ValueError, match="cannot parse bandwidth"):
        EmulatedCluster(np=2, bandwidth="fast")
    with pytest.raises(EmulatorError, match="not started"):
        EmulatedCluster(np=2).run(["true"])
    out = subprocess.run(CLI + ["--np", "2", "--bandwidth", "1gbps", "--", "true"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "cannot parse bandwidth" in out.stderr, \
        f"--bandwidth 1gbps exited with {out.returncode} (expected 2): {out.stderr!r}"
