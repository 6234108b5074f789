"""`hvd-onebit check` and the native kernels' loader: what a user sees about their environment.

The fallback runs in a child interpreter with ``HVD_ONEBIT_NATIVE=0``: the loader decides once
per process, and this process has the native kernels."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hvd_onebit import kernels
from hvd_onebit.kernels.native_loader import load_native
from hvd_onebit_tools.check import (FACES, FIX, OK, Finding, blocking, findings, readiness,
                                    report)

REPO = Path(__file__).resolve().parents[1]
BOTH = f"{FACES['horovod']} and {FACES['ddp']}"

from .cli import hvd_onebit

FALLBACK = """
import json, warnings, torch
from hvd_onebit import kernels
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    picked = [kernels.resolve_backend("auto", torch.device("cpu")) for _ in range(3)]
print(json.dumps({"picked": picked, "warnings": [str(w.message) for w in caught],
                  "categories": [w.category.__name__ for w in caught]}))
"""


def _child(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=300)


def test_the_native_kernels_load_here_and_auto_picks_them_on_cpu():
    native = load_native()
    assert native.module is not None, f"no native kernels in the test environment: {native}"
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "native"


def test_without_native_kernels_auto_falls_back_to_torch_and_warns_once_naming_the_fix():
    out = _child(FALLBACK, HVD_ONEBIT_NATIVE="0")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["picked"] == ["torch"] * 3
    assert got["categories"] == ["RuntimeWarning"], got
    message = got["warnings"][0]
    for words in ("torch twins", "slower", "HVD_ONEBIT_NATIVE=0", "--no-build-isolation",
                  "hvd-onebit check"):
        assert words in message, f"{words!r} missing from the warning: {message}"


def test_asking_for_native_kernels_that_are_off_names_why():
    code = ("import torch\nfrom hvd_onebit import kernels\n"
            "try:\n    kernels.resolve_backend('native', torch.device('cpu'))\n"
            "except RuntimeError as e:\n    print(e)\n")
    out = _child(code, HVD_ONEBIT_NATIVE="0")
    assert "native kernels are not available: HVD_ONEBIT_NATIVE=0" in out.stdout, out


def test_check_reports_every_part_and_ready_here():
    found = findings()
    parts = [f.part for f in found]
    assert parts == ["torch", "horovod", "torch.distributed", "native kernels", "triton",
                     "/dev/shm", "MPI thread level"]
    by_part = {f.part: f for f in found}
    assert by_part["torch"].found.startswith(torch.__version__), by_part["torch"]
    assert by_part["horovod"].status == OK and "gloo" in by_part["horovod"].found, by_part
    assert by_part["torch.distributed"].status == OK and \
        "gloo" in by_part["torch.distributed"].found, by_part
    assert by_part["native kernels"].status == OK, by_part["native kernels"]
    assert by_part["MPI thread level"].status == OK, by_part["MPI thread level"]
    text = report(found)
    assert text.splitlines()[-1] == f"ready: {BOTH}", text
    assert all(f.fix for f in found if f.status == FIX), f"a FIX without its fix: {found}"


def test_check_command_prints_the_report_and_a_fix_where_kernels_are_off():
    out = subprocess.run([sys.executable, "-m", "hvd_onebit_tools.cli", "check"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HVD_ONEBIT_NATIVE="0"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    native = [i for i, line in enumerate(lines) if line.startswith("native kernels")]
    assert len(native) == 1 and " FIX " in lines[native[0]], out.stdout
    assert "fix: install a C++ compiler" in lines[native[0] + 1], out.stdout
    assert lines[-1] == f"ready: {BOTH}", out.stdout
    out = subprocess.run([sys.executable, "-m", "hvd_onebit_tools.cli", "check", "--json"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HVD_ONEBIT_NATIVE="0"))
    report_json = json.loads(out.stdout)
    parts = {p["part"]: p for p in report_json["parts"]}
    assert out.returncode == 0 and report_json["ready"] and report_json["blocking"] == [], \
        out.stdout
    assert report_json["faces"] == {"horovod": {"ready": True, "blocking": []},
                                    "ddp": {"ready": True, "blocking": []}}, report_json
    assert parts["native kernels"]["status"] == FIX and \
        parts["native kernels"]["fix"].startswith("install a C++ compiler"), parts


BROKEN_HOROVOD = 'raise ImportError("undefined symbol: _ZN3c10 (built against another torch)")\n'
BLOCK_HOROVOD = ("import sys, runpy; sys.modules['horovod'] = None; sys.argv[0] = 'hvd-onebit'; "
                 "runpy.run_module('hvd_onebit_tools.cli', run_name='__main__')")


def _check(*argv, **env) -> tuple[subprocess.CompletedProcess, dict]:
    """``hvd-onebit check`` (with ``argv`` before it: how the interpreter starts the CLI) and
    ``check --json`` in children with ``env`` added."""
    env = dict(os.environ, **env)
    argv = argv or ("-m", "hvd_onebit_tools.cli")
    out = subprocess.run([sys.executable, *argv, "check"], capture_output=True, text=True,
                         timeout=300, env=env)
    as_json = subprocess.run([sys.executable, *argv, "check", "--json"], capture_output=True,
                             text=True, timeout=300, env=env)
    assert as_json.returncode == out.returncode, (out, as_json)
    return out, json.loads(as_json.stdout)


def test_a_broken_horovod_keeps_the_ddp_face_ready(tmp_path):
    """Horovod installed but not importable (built against another torch): FIX with the
    rebuild, the DDP face still ready, and the exit status 0 (a DDP job runs here)."""
    (tmp_path / "horovod" / "torch").mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("")
    (tmp_path / "horovod" / "torch" / "__init__.py").write_text(BROKEN_HOROVOD)
    out, report_json = _check(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    lines = out.stdout.splitlines()
    horovod = [i for i, line in enumerate(lines) if line.startswith("horovod ")]
    assert len(horovod) == 1 and " FIX " in lines[horovod[0]] and \
        "undefined symbol" in lines[horovod[0]], out.stdout
    assert "fix: rebuild Horovod against this torch" in lines[horovod[0] + 1], out.stdout
    assert lines[-1] == f"ready: {FACES['ddp']}; {FACES['horovod']} needs horovod", out.stdout
    assert out.returncode == 0, out.stdout + out.stderr
    assert (report_json["ready"], report_json["blocking"], report_json["faces"]) == \
        (True, [], {"horovod": {"ready": False, "blocking": ["horovod"]},
                    "ddp": {"ready": True, "blocking": []}}), report_json


def test_without_horovod_the_ddp_face_is_ready_and_the_install_is_named():
    out, report_json = _check("-c", BLOCK_HOROVOD)
    lines = out.stdout.splitlines()
    horovod = [i for i, line in enumerate(lines) if line.startswith("horovod ")]
    assert len(horovod) == 1 and " -- " in lines[horovod[0]] and \
        "not installed" in lines[horovod[0]], out.stdout
    # torch here is 2.1 or later, against which Horovod's last release needs two fixes
    fix = lines[horovod[0] + 1]
    assert "fix: for the Horovod face: build Horovod 0.28.1 from its sdist" in fix and \
        "CMAKE_POLICY_VERSION_MINIMUM=3.5" in fix and "docs/install.md" in fix, out.stdout
    assert lines[-1] == f"ready: {FACES['ddp']}; {FACES['horovod']} needs horovod", out.stdout
    assert out.returncode == 0 and report_json["ready"], out.stdout + out.stderr


def test_without_horovod_the_horovod_face_names_the_ddp_face(monkeypatch):
    """``hvd_onebit.DistributedOptimizer`` where Horovod does not import: an error that names
    the DDP face and where the Horovod build is told, not a bare ModuleNotFoundError; the
    rest of the package still imports."""
    import hvd_onebit

    monkeypatch.delattr(hvd_onebit, "DistributedOptimizer", raising=False)  # imported on use
    monkeypatch.setitem(sys.modules, "horovod", None)
    for module in ("horovod.torch", "hvd_onebit.optimizer"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ModuleNotFoundError) as caught:
        hvd_onebit.DistributedOptimizer
    message = str(caught.value)
    for part in ("hvd_onebit.DistributedOptimizer is the Horovod face",
                 "use hvd_onebit.ddp.DistributedOptimizer", "`hvd-onebit check` says how"):
        assert part in message, f"{part!r} not in {message!r}"
    assert hvd_onebit.Experimental.__name__ == "Experimental"


def test_readiness_names_each_face_and_what_blocks_it():
    """No face ready: exit status 1's report names each face's missing parts; torch missing
    blocks both."""
    torch_ok = Finding("torch", OK, "2", needed_by=tuple(FACES))
    hvd_fix = Finding("horovod", FIX, "broken", "rebuild", needed_by=("horovod",))
    dist_fix = Finding("torch.distributed", FIX, "none", "a build", needed_by=("ddp",))
    found = [torch_ok, hvd_fix, dist_fix]
    assert readiness(found) == (f"not ready: {FACES['horovod']} needs horovod; "
                                f"{FACES['ddp']} needs torch.distributed")
    assert blocking(found) == ["horovod", "torch.distributed"]
    torch_fix = dataclasses.replace(torch_ok, status=FIX)
    assert blocking([torch_fix, dataclasses.replace(hvd_fix, status=OK)]) == ["torch"]


def test_help_lists_check_and_the_cluster():
    out = hvd_onebit(["--help"])
    assert out.exit_code == 0, out.output
    assert "check" in out.output and "cluster" in out.output, out.output


def test_without_iproute2_the_cluster_stays_in_help_with_the_reason():
    bin_dir = os.path.dirname(sys.executable)
    out = subprocess.run([sys.executable, "-m", "hvd_onebit_tools.cli", "--help"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PATH=bin_dir))
    assert out.returncode == 0, out.stderr
    line = [line for line in out.stdout.splitlines() if line.strip().startswith("cluster")]
    assert len(line) == 1 and "unavailable" in line[0] and "iproute2" in out.stdout, out.stdout
    run = subprocess.run([sys.executable, "-m", "hvd_onebit_tools.cli", "cluster", "run",
                          "--np", "2", "--", "true"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PATH=bin_dir))
    assert run.returncode == 2 and "ip and tc not found" in run.stderr, run.stderr


def test_np_outside_a_job_says_how_to_launch_it():
    out = hvd_onebit(["check", "--np", "4", "--params", "10M", "--compute-ms", "50"])
    assert out.exit_code == 2, out.output
    assert "horovodrun -np 4 hvd-onebit check --probe --params 10M --compute-ms 50" in \
        " ".join(out.output.split()), out.output
    assert ("torchrun --nproc_per_node 4 -m hvd_onebit_tools.cli check --probe --params 10M "
            "--compute-ms 50") in " ".join(out.output.split()), out.output


@pytest.mark.parametrize("launched", [{"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1"},
                                      {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}])
def test_a_probe_in_a_job_of_one_rank_is_refused_before_any_collective(launched):
    """One rank has no link to probe: a usage error naming the size, where the prediction
    divided by the ranks' count less one."""
    out = hvd_onebit(["check", "--probe", "--params", "1M", "--compute-ms", "10"], env=launched)
    assert out.exit_code == 2 and "a probe of the link (this job's size) needs 2 or more ranks" \
        in " ".join(out.output.split()), f"exit {out.exit_code}: {out.output} {out.exception!r}"


def test_the_jobs_size_is_read_from_the_launcher_that_started_it(monkeypatch):
    """A size variable another launcher set, left in the environment, is not the job's."""
    from hvd_onebit_tools import check_probe

    for name in check_probe.LAUNCHED_SIZES + check_probe.HOROVOD_LAUNCHED + (
            check_probe.TORCHRUN_LAUNCHED,):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # left over from an earlier torchrun job
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    assert check_probe.launched_size() == 4, \
        f"under horovodrun with WORLD_SIZE=1 left over: {check_probe.launched_size()} ranks"


@pytest.mark.multirank
def test_the_prediction_options_without_a_probe_are_refused():
    out = hvd_onebit(["check", "--params", "10M"])
    assert out.exit_code == 2 and "give --probe too" in out.output, \
        f"exit {out.exit_code}: {out.output}"


def check_under_horovodrun(np_=None, *extra, env=None) -> subprocess.CompletedProcess:
    """``hvd-onebit check --probe --params 10M --compute-ms 50`` in a 2-rank horovodrun job
    (``np_``: ``--np NP`` instead of ``--probe``; ``extra``: more options; ``env``: more
    environment variables)."""
    bin_dir = os.path.dirname(sys.executable)
    return subprocess.run([os.path.join(bin_dir, "horovodrun"), "-np", "2", "-H", "localhost:2",
                           "--gloo", sys.executable, "-m", "hvd_onebit_tools.cli", "check",
                           *(["--probe"] if np_ is None else ["--np", str(np_)]),
                           "--params", "10M", "--compute-ms", "50", *extra],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"],
                                   **(env or {})))


@pytest.mark.parametrize("np_", [None, 2])
def test_probe_under_horovodrun_probes_the_link_and_prices_the_step(np_):
    out = check_under_horovodrun(np_)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split(":", 1)[1] for line in out.stdout.splitlines()
             if line.startswith("[0]<stdout>:")]
    assert not any(line.startswith("[1]<stdout>:ready") for line in out.stdout.splitlines()), \
        f"rank 1 printed a report too:\n{out.stdout}"
    link = [line for line in lines if line.startswith("link: 2 ranks")]
    assert len(link) == 1 and "Gbit/s bus rate" in link[0], lines
    step = [line for line in lines if line.startswith("predicted step (10M parameters, 50 ms")]
    assert len(step) == 1 and "Horovod fp32 (horovod_fp32)" in step[0] and \
        "1-bit Adam (onebit)" in step[0], lines
    assert any(line.startswith("freeze point: ") for line in lines), lines
    assert any(line.startswith("transport='auto' takes torch.distributed's collectives (its "
                               "rendezvous reached by every rank") for line in lines), lines


ON_HOROVOD = "transport='auto' takes Horovod's alltoall and allgather, with a warning: "


def auto_transport_line(out) -> str:
    """Rank 0's line of the probe's report on transport='auto', from a job that succeeded."""
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split(":", 1)[1] for line in out.stdout.splitlines()
             if line.startswith("[0]<stdout>:transport=")]
    assert len(lines) == 1, out.stdout
    return lines[0]


@pytest.mark.multirank
def test_probe_says_where_gloo_cannot_connect():
    """Past the rendezvous, Gloo's connections on an interface that does not exist: every rank
    agrees that transport='auto' stays on Horovod, and the report says why, naming the
    interface (the optimizer falls back alike)."""
    out = check_under_horovodrun(None, env={"GLOO_SOCKET_IFNAME": "bogus0",
                                            "HVD_ONEBIT_RENDEZVOUS_S": "3"})
    line = auto_transport_line(out)
    assert line.startswith(f"{ON_HOROVOD}torch.distributed's gloo group could not connect "
                           "rank(s) [0, 1]") and "interface bogus0" in line, out.stdout


@pytest.mark.multirank
def test_probe_says_where_transport_auto_stays_on_horovod():
    """A rendezvous no rank reaches (rank 0's MASTER_ADDR nowhere): the probe's report says that
    transport='auto' would stay on Horovod, naming the address, where it said only "ready"."""
    out = check_under_horovodrun(None, env={"MASTER_ADDR": "198.18.255.1", "MASTER_PORT": "29999",
                                            "HVD_ONEBIT_RENDEZVOUS_S": "3"})
    line = auto_transport_line(out)
    assert line.startswith(f"{ON_HOROVOD}torch.distributed's rendezvous at "
                           "198.18.255.1:29999"), out.stdout


@pytest.mark.multirank
def test_probe_json_has_the_link_and_the_prediction():
    out = check_under_horovodrun(None, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    text = "\n".join(line.split(":", 1)[1] for line in out.stdout.splitlines()
                     if line.startswith("[0]<stdout>:"))
    probe = json.loads(text)["probe"]
    assert (probe["ranks"], probe["ranks_per_node"], probe["via"], probe["device"]) == \
        (2, 2, "Horovod", "cpu"), probe
    assert probe["lines"][0].startswith("link: 2 ranks (one node; priced as ranks with links of "
                                        "their own), fp32 allreduce of 16 MiB of host memory "
                                        "through Horovod in "), probe["lines"][0]
    assert probe["bus_bps"] > 0 and probe["allreduce_s"] > 0, probe
    assert [line.split(":")[0] for line in probe["lines"]] == \
        ["link", "predicted step (10M parameters, 50 ms compute)", "freeze point", "calibration",
         "transport='auto' takes torch.distributed's collectives (its rendezvous reached by every "
         "rank)"], probe["lines"]
    assert probe["transport"].startswith("torch.distributed's"), probe["transport"]


@pytest.mark.multirank
@pytest.mark.parametrize("hosts, probe", [("localhost:2", False), ("127.0.0.1:1,127.1:1", True)])
def test_check_under_horovodrun_prints_one_report_per_node(hosts, probe):
    """Every rank checks (and exits 1 where its node cannot run a face); each node's first rank
    alone prints, where a job of 64 ranks printed 64 reports. With --probe, rank 0 prints the
    link, and the other nodes their own report (two "hosts": names of this machine)."""
    bin_dir = os.path.dirname(sys.executable)
    args = ["--probe", "--params", "10M", "--compute-ms", "50"] if probe else []
    out = subprocess.run([os.path.join(bin_dir, "horovodrun"), "-np", "2", "-H", hosts,
                          "--gloo", sys.executable, "-m", "hvd_onebit_tools.cli", "check", *args],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"]))
    lines = out.stdout.splitlines()
    ready = sorted(line[:3] for line in lines if "]<stdout>:ready" in line)
    link = [line[:3] for line in lines if "]<stdout>:link: " in line]
    assert out.returncode == 0 and ready == (["[0]", "[1]"] if probe else ["[0]"]), \
        f"exit {out.returncode}; reports from {ready}:\n{out.stdout}{out.stderr}"
    assert link == (["[0]"] if probe else []), f"link lines from {link}:\n{out.stdout}"


@pytest.mark.parametrize("env", [
    {"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "1"},
    {"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "1", "SLURM_LOCALID": "0", "PMI_RANK": "0"},
    {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    {"PMI_RANK": "3", "SLURM_LOCALID": "1"}])
def test_a_ranks_check_beside_its_nodes_first_prints_nothing_and_keeps_the_status(env):
    """The other launchers' local ranks (torchrun's, mpirun's, srun's; torchrun's under srun,
    where every rank inherits its agent's SLURM_LOCALID) as horovodrun's: the status still
    says whether this rank's node can run a face."""
    out = subprocess.run([sys.executable, "-m", "hvd_onebit_tools.cli", "check"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **env))
    first = subprocess.run([sys.executable, "-m", "hvd_onebit_tools.cli", "check"],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **{**env, "LOCAL_RANK": "0",
                                                   "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                                                   "SLURM_LOCALID": "0"}))
    assert (out.returncode, out.stdout) == (0, ""), f"a second rank printed:\n{out.stdout}"
    assert first.returncode == 0 and first.stdout.splitlines()[-1].startswith("ready: "), \
        f"the node's first rank printed no report:\n{first.stdout}{first.stderr}"


@pytest.mark.multirank
def test_np_unlike_the_jobs_size_is_a_usage_error_on_every_rank():
    out = check_under_horovodrun(np_=3)
    text = out.stdout + out.stderr
    for rank in (0, 1):
        error = [line for line in text.splitlines() if line.startswith(f"[{rank}]<stderr>:Error")]
        assert error and "--np 3 but this job has 2 ranks" in error[0], \
            f"rank {rank}: no usage error naming the sizes:\n{text}"
    assert out.returncode != 0 and "]<stderr>:Traceback" not in text, text


@pytest.mark.multirank
def test_np_under_torchrun_probes_the_link_without_horovod():
    """A DDP user's job: torchrun starts the ranks, the probe runs on torch.distributed (Gloo
    here), and Horovod is not imported (it is blocked in every rank)."""
    blocker = ("import sys, runpy; sys.modules['horovod'] = None; sys.argv[0] = 'hvd-onebit'; "
               "runpy.run_module('hvd_onebit_tools.cli', run_name='__main__')")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "--no-python", sys.executable, "-c", blocker,
                          "check", "--probe", "--params", "10M", "--compute-ms", "50"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    link = [line for line in lines if line.startswith("link: 2 ranks")]
    assert len(link) == 1, f"expected one link line (rank 0 alone prints):\n{out.stdout}"
    assert "through torch.distributed (gloo)" in link[0] and "Gbit/s bus rate" in link[0], link
    step = [line for line in lines if line.startswith("predicted step (10M parameters, 50 ms")]
    assert len(step) == 1 and "DDP + Adam (ddp_adam)" in step[0] and \
        "1-bit Adam (ddp_onebit)" in step[0] and \
        "`hvd-onebit bench predict --methods ddp_adam,ddp_onebit --params 10M --compute-ms 50 " \
        "--np 2 --bandwidth " in step[0], lines
    reports = [line for line in lines if line.startswith("freeze point: ")]
    assert len(reports) == 1, f"rank 0 alone reports; {len(reports)} reports:\n{out.stdout}"


def test_the_shared_memory_check_looks_where_the_library_puts_its_segments(monkeypatch, tmp_path):
    """HVD_ONEBIT_SHM_DIR moves the segments, and the check follows it; a directory that cannot
    hold them gets a fix the user can pass as written (the Experimental knob, not a keyword
    the optimizer refuses)."""
    from hvd_onebit import Experimental
    from hvd_onebit_tools.check import check_shm

    monkeypatch.setenv("HVD_ONEBIT_SHM_DIR", str(tmp_path))
    here = check_shm()
    assert here.part == str(tmp_path) and here.status in (OK, FIX), here
    monkeypatch.setenv("HVD_ONEBIT_SHM_DIR", str(tmp_path / "missing"))
    missing = check_shm()
    assert missing.part == str(tmp_path / "missing") and missing.status == FIX, missing
    knob = missing.fix.split("pass ", 1)[1]
    assert knob == "experimental=hvd_onebit.Experimental(intra_node='network')", missing.fix
    assert Experimental(intra_node="network").intra_node == "network"


@pytest.mark.parametrize("seconds", [1e-6, 10.0])
def test_the_verdict_follows_the_link_the_model_can_explain(seconds):
    """A probe faster than the calibrated hosts manage on any link gets no verdict (the model
    would overprice these hosts); a slow link gets one. The freeze guidance prints as plain
    text (single backticks)."""
    from hvd_onebit_tools.check_probe import LinkProbe, predict

    link, step, freeze, calibration = predict(
        LinkProbe(ranks=2, elements=4 << 20, seconds=seconds), "10M", 50.0)
    if seconds < 1e-3:
        assert "faster than the calibrated hosts" in link and "no verdict" in step, (link, step)
    else:
        assert "the scale model's link rate" in link and "1-bit Adam should help" in step, \
            (link, step)
    assert "``" not in freeze and "`variance_refresh=None`" in freeze, freeze
    assert calibration.startswith("calibration: "), calibration


def test_the_probe_prices_the_nodes_it_ran_on():
    """Ranks on several nodes share each node's link in the prediction; ranks on one node are
    priced with links of their own (the probe crossed no link between nodes), as a job of
    one rank per node is; the output says which, and which calibration priced it."""
    from hvd_onebit_tools.bench.calibrate.files import SHIPPED_PATH
    from hvd_onebit_tools.check_probe import LinkProbe, one_size, predict

    def lines(per_node):
        return predict(LinkProbe(ranks=4, elements=4 << 20, seconds=0.5, per_node=per_node),
                       "10M", 50.0, calibration=str(SHIPPED_PATH))

    spread, nodes, one_node, uneven = lines(1), lines(2), lines(4), lines(None)
    assert nodes[0].startswith("link: 4 ranks (2 nodes of 2),") and "Gbit/s per node" in nodes[0], \
        nodes[0]
    assert one_node[0].startswith("link: 4 ranks (one node; priced as ranks with links of their "
                                  "own),"), one_node[0]
    assert spread[0].startswith("link: 4 ranks,"), spread[0]
    assert uneven[0].startswith("link: 4 ranks (nodes of different sizes; priced as ranks with "
                                "links of their own),"), uneven[0]
    # priced alike, and the one node's verdict says the network was never crossed
    assert uneven[1] == spread[1] and one_node[1] == spread[1] + (
        " (at this rate; but every rank is on one node, so the probe crossed no network: probe "
        "with ranks on two or more nodes for your network's verdict)"), \
        f"one node: {one_node[1]!r}; uneven: {uneven[1]!r}; a link per rank: {spread[1]!r}"
    assert (one_size([2, 2, 2]), one_size([2, 3, 1]), one_size([3, 3, 2])) == (2, None, None)
    assert nodes[1] != spread[1], f"2 nodes of 2 priced as 4 links: {nodes[1]!r}"
    assert "CPU speeds" not in spread[1], spread[1]
    gpu = predict(LinkProbe(ranks=4, elements=4 << 20, seconds=0.5, device="cuda"), "10M", 50.0,
                  calibration=str(SHIPPED_PATH))
    assert " of GPU memory " in gpu[0] and gpu[1].endswith(
        "priced at the calibration's CPU speeds, which overstate a GPU's kernels and hosts: "
        "`bench predict --kernel-speedup --host-speedup` prices them (docs/predicting.md, GPU "
        "nodes)"), gpu
    assert nodes[3] == f"calibration: {SHIPPED_PATH} (2 cores, " \
        f"{json.loads(SHIPPED_PATH.read_text())['machine']['date']})", nodes[3]


def test_the_probe_checks_the_calibration_before_any_collective(monkeypatch, tmp_path):
    """Every rank loads the calibration first: a missing or bad one is a one-line error
    (a ClickException) before the probe's first allreduce, so no rank waits for another."""
    import click

    from hvd_onebit_tools import check_probe
    from hvd_onebit_tools.bench.calibrate.files import save
    from tests.bench.test_predict import fake_calibration

    probed = []
    monkeypatch.setattr(check_probe, "_probe_horovod", lambda *a: probed.append(a))
    monkeypatch.setattr(check_probe, "_probe_torch", lambda *a: probed.append(a))
    missing = tmp_path / "missing.json"
    with pytest.raises(click.ClickException, match="no calibration file at"):
        check_probe.probe(2, calibration=str(missing))
    cal = fake_calibration()
    cal["compute"]["1"]["models"]["mlp"]["adam_s"] = "fast"
    bad = save(cal, tmp_path / "bad.json")
    with pytest.raises(click.ClickException) as info:
        check_probe.probe(2, calibration=str(bad))
    field = "compute['1']['models']['mlp']['adam_s']"
    assert field in info.value.message and "'fast'" in info.value.message, \
        f"the error does not name {field} = 'fast': {info.value.message}"
    assert probed == [], f"the link was probed with a bad calibration: {probed}"
    with pytest.raises(click.ClickException, match=r"adam_s'\] is 'fast'"):
        check_probe.predict(check_probe.LinkProbe(ranks=2, elements=4 << 20, seconds=0.1),
                            "10M", 50.0, str(bad))


@pytest.mark.multirank
def test_a_missing_calibration_is_an_error_on_every_rank_before_the_probe(tmp_path):
    bin_dir = os.path.dirname(sys.executable)
    missing = tmp_path / "missing.json"
    out = subprocess.run([os.path.join(bin_dir, "horovodrun"), "-np", "2", "-H", "localhost:2",
                          "--gloo", sys.executable, "-m", "hvd_onebit_tools.cli", "check",
                          "--np", "2", "--params", "10M", "--compute-ms", "50",
                          "--calibration", str(missing)],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"]))
    text = out.stdout + out.stderr
    for rank in (0, 1):
        error = [line for line in text.splitlines() if line.startswith(f"[{rank}]<stderr>:Error")]
        assert error and f"no calibration file at {missing}" in error[0], \
            f"rank {rank}: no error naming {missing}:\n{text}"
    assert out.returncode != 0 and "]<stderr>:Traceback" not in text, text
    assert "link: 2 ranks" not in text and "]<stdout>:ready" not in text, \
        f"the checks or the probe ran with no calibration:\n{text}"
