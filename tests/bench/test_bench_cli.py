"""The `hvd-onebit bench` commands, run for real at toy sizes: JSON fields, tables, plots.

The emulated runs need root (network namespaces); the loopback runs (`--bandwidth local`) run
anywhere Horovod does. Speed is never asserted here: benchmarks print figures, tests check that
the figures are there and self-consistent.
"""
import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from tests.cli import hvd_onebit

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "hvd_onebit_tools.cli"]


def bench(*args, timeout=600):
    proc = subprocess.run(CLI + ["bench", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_bench_help_lists_every_command():
    result = hvd_onebit(["bench", "--help"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for command in ("allreduce", "train", "calibrate", "predict", "dev"):
        assert command in out, out
    result = hvd_onebit(["bench", "dev", "--help"])
    for command in ("kernel", "memory", "zoo"):
        assert command in result.stdout, result.output
    result = hvd_onebit(["bench", "train", "--help"])
    assert result.exit_code == 0, result.output
    train_help = result.stdout
    for option in ("--model", "--wait", "--malloc", "--warmup-frac", "--hosts", "--queue-ms"):
        assert option in train_help


def test_bench_kernel_json():
    report = json.loads(bench("dev", "kernel", "--numel", "64K", "--repeats", "2", "--json").stdout)
    for kernel in ("compress", "server", "decode"):
        assert report["backends"]["native"][f"{kernel}_ratio_to_add"] > 0
    from hvd_onebit.kernels.native_loader import load_native
    want = "avx512" if load_native().module.has_avx512() else "avx2"
    assert report["native_vector_path"] == want, (report["native_vector_path"], want)
    # its provenance, for a results table
    assert report["command"].startswith("hvd-onebit bench dev kernel") and \
        len(report["commit"]) == 40 and report["date"], \
        {k: report.get(k) for k in ("command", "commit", "date")}
    # each pass's bytes per second: its element rate times the bytes its streams move
    streams = report["streams"]
    per_element = {k: 4 * (s["reads"] + s["writes"]) + s["bits"] / 8 for k, s in streams.items()}
    native = report["backends"]["native"]
    for kernel in ("compress", "momentum_compress_preconditioned", "decode_update_preconditioned"):
        want = native[f"{kernel}_elems_per_s"] * per_element[kernel]
        assert native[f"{kernel}_bytes_per_s"] == pytest.approx(want), \
            f"{kernel}: {native[f'{kernel}_bytes_per_s']} B/s, streams give {want}"
    assert report["add_bytes_per_s"] == pytest.approx(report["add_elems_per_s"] * 12), \
        f"torch.add moves 12 bytes per element: {report['add_bytes_per_s']} B/s"
    fused = report["fused_optimizer_passes"]
    for key in ("momentum_compress_ms", "lerp_then_compress_ms", "decode_update_ms",
                "decode_then_addcdiv_ms", "momentum_compress_speedup", "decode_update_speedup"):
        assert fused[key] > 0
    refresh = report["refresh_passes"]
    timed = {f"{k}{suffix}": refresh.get(f"{k}{suffix}") for k in ("moments", "errors")
             for suffix in ("_ms", "_separate_ms", "_speedup", "_ratio_to_add")}
    missing = sorted(k for k, v in timed.items() if not v or v <= 0)
    assert not missing, f"refresh passes without a positive figure: {missing} in {refresh}"
    for k in ("moments", "errors"):
        assert refresh[f"{k}_bytes_per_s"] == pytest.approx(
            report["add_elems_per_s"] * refresh[f"{k}_ratio_to_add"] * per_element[k]), k


def test_bench_kernel_table_lists_every_pass_with_its_bytes_per_second():
    out = bench("dev", "kernel", "--numel", "64K", "--repeats", "2").stdout
    assert "GB/s" in out, out
    for kernel in ("momentum_compress_preconditioned", "decode_update_preconditioned"):
        assert any(line.split()[:2] == ["native", kernel] for line in out.splitlines()), out


def test_bench_allreduce_loopback_json_and_plot(tmp_path):
    plot, out = tmp_path / "speedup.png", tmp_path / "allreduce.json"
    report = json.loads(bench("allreduce", "--np", "2", "--numel", "64K", "--repeats", "2",
                              "--json", "--plot", str(plot), "--out", str(out)).stdout)
    assert json.loads(out.read_text()) == report, "--out wrote another report than --json printed"
    assert report["command"].startswith("hvd-onebit bench allreduce") and \
        len(report["commit"]) == 40 and report["date"], \
        f"the report's provenance: {report['command']!r}, commit {report['commit']!r}, " \
        f"date {report['date']!r}"
    rows = report["rows"]
    assert {r["method"] for r in rows} == {"fp32", "fp16", "onebit"}
    onebit = next(r for r in rows if r["method"] == "onebit")
    fp32 = next(r for r in rows if r["method"] == "fp32")
    assert (onebit["np"], onebit["numel"]) == (2, 64 * 1024), f"onebit row {onebit}"
    # the 1-bit allreduce sends 1/32 of the fp32 ring's bytes (plus a few scale bytes)
    assert onebit["bytes_per_rank"] * 30 < fp32["bytes_per_rank"], \
        f"onebit sends {onebit['bytes_per_rank']} bytes per rank, fp32 {fp32['bytes_per_rank']}: " \
        f"not under 1/30 of it"


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_bench_train_loopback_reports_phases_and_speedups(tmp_path, model):
    plot = tmp_path / "made" / "train.png"  # the folder is made before the run
    size = (["--width", "64", "--depth", "1"] if model == "mlp"
            else ["--vocab", "512", "--embed-dim", "16", "--tokens", "64", "--width", "32"])
    methods = ["local", "horovod_fp32", "onebit", "onebit_blocks", "ddp_adam", "ddp_onebit",
               "onebit_refresh", "ddp_onebit_refresh"]
    proc = bench("train", "--np", "2", "--bandwidth", "local", "--steps", "8", "--model", model,
                 "--methods", ",".join(methods), "--json", "--plot", str(plot), *size)
    report = json.loads(proc.stdout)
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == set(methods), f"rows of {sorted(rows)}, expected {sorted(methods)}"
    ob = rows["onebit"]
    # freeze_step: round(--warmup-frac * 8) at the default (the frozen variance's recommended share)
    got = {k: ob[k] for k in ("model", "freeze_step", "warmup_steps", "compression_steps")}
    assert got == {"model": model, "freeze_step": 2, "warmup_steps": 2, "compression_steps": 6}, \
        f"onebit row: {got}"
    fp32_bytes = rows["horovod_fp32"]["bytes_per_step"]
    assert ob["compression_bytes_per_step"] * 20 < fp32_bytes, \
        f"{ob['compression_bytes_per_step']} bytes per compressed step, horovod_fp32 " \
        f"{fp32_bytes}: not under 1/20 of it"
    # per-step times are means over ranks; the run is the slowest rank's own total
    assert len(ob["step_seconds"]) == 8, f"{len(ob['step_seconds'])} step times, expected 8"
    assert ob["step_phases"] == 2 * ["warmup"] + 6 * ["compression"], \
        f"phases {ob['step_phases']}"
    assert ob["run_seconds"] >= sum(ob["step_seconds"]) - 1e-9, \
        f"the run took {ob['run_seconds']} s, less than its steps' {sum(ob['step_seconds'])} s"
    # onebit_blocks at its default, one scale per chunk, against onebit's 512 elements per
    # scale: 4 bytes per 512 elements (1/16 of the signs' bytes), each chunk padded to whole blocks
    blocks = rows["onebit_blocks"]
    assert blocks["step_phases"] == ob["step_phases"], blocks["step_phases"]
    more = ob["compression_bytes_per_step"] / blocks["compression_bytes_per_step"]
    params = ob["params"]
    padded = -(-params // (2 * 512)) * 2 * 512
    assert 1 < more <= padded / params * (1 + 1 / 16) + 0.005, \
        f"onebit sends {ob['compression_bytes_per_step']} bytes per compressed step, " \
        f"onebit_blocks {blocks['compression_bytes_per_step']} ({more:.4f}x)"
    # the DDP face: onebit's warmup and phases, the same engine's bytes, DDP Adam's ring figure
    face, adam = rows["ddp_onebit"], rows["ddp_adam"]
    got = {k: face[k] for k in ("freeze_step", "warmup_steps", "compression_steps",
                                "step_phases", "compression_bytes_per_step", "run_bytes_per_rank")}
    want = {k: ob[k] for k in got}
    assert got == want, f"ddp_onebit row {got}, onebit's {want}"
    # the library's defaults through the DDP face: onebit_refresh's freeze and refresh steps
    keys = ("freeze_step", "variance_refresh", "steps_by_kind", "step_phases", "refresh_steps",
            "run_bytes_per_rank")
    got = {k: rows["ddp_onebit_refresh"].get(k) for k in keys}
    want = {k: rows["onebit_refresh"].get(k) for k in keys}
    assert got == want and got["step_phases"] == ["warmup"] + 7 * ["refresh"], \
        f"ddp_onebit_refresh row {got}, onebit_refresh's {want}"
    assert adam["bytes_per_step"] == fp32_bytes, \
        f"ddp_adam's ring figure {adam['bytes_per_step']}, horovod_fp32's {fp32_bytes}"
    assert face["compression_bytes_per_step"] * 25 < adam["bytes_per_step"], \
        f"ddp_onebit sends {face['compression_bytes_per_step']} bytes per compressed step, " \
        f"ddp_adam {adam['bytes_per_step']}: not under 1/25 of it"
    summary = report["summary"]
    for key in ("comm_fraction_of_fp32_step", "onebit_compression_step_speedup_vs_fp32",
                "onebit_run_speedup_vs_fp32", "ddp_onebit_compression_step_speedup_vs_ddp_adam",
                "ddp_face_speedup_vs_horovod_face", "ddp_onebit_run_speedup_vs_ddp_adam",
                "onebit_blocks_compression_step_vs_onebit", "onebit_refresh_run_speedup_vs_onebit",
                "ddp_onebit_refresh_run_speedup_vs_ddp_adam",
                "ddp_onebit_refresh_run_speedup_vs_ddp_onebit",
                "ddp_onebit_refresh_bytes_vs_ddp_onebit"):
        assert summary[key] == summary[key], f"summary {key} is NaN: {summary}"  # present
    assert summary["ddp_onebit_bytes_vs_ddp_adam"] == pytest.approx(
        face["compression_bytes_per_step"] / adam["bytes_per_step"]), summary
    got = (report["config"]["wait"], report["config"]["malloc"])
    assert got == ("sleep", "reuse"), f"(wait, malloc) by default {got}, expected sleep and reuse"
    assert plot.stat().st_size > 0, f"the plot {plot} is {plot.stat().st_size} bytes"


@pytest.mark.skipif(os.geteuid() != 0, reason="the emulator needs root")
def test_bench_train_on_the_emulator_counts_the_wire_bytes(tmp_path):
    out_json = tmp_path / "train.json"
    proc = bench("train", "--np", "2", "--bandwidth", "1gbit", "--steps", "6", "--model", "mlp",
                 "--width", "512", "--depth", "1", "--methods",
                 "horovod_fp32,onebit,ddp_adam,ddp_onebit", "--wait", "spin", "--malloc", "system",
                 "--out", str(out_json))
    out = proc.stdout
    for text in ("Horovod waits: spin, malloc: system", "onebit", "ddp_onebit", "compression",
                 "measured MB/step/rank", "ddp_onebit_measured_bytes_vs_ddp_adam"):
        assert text in out, f"{text!r} is not in the output:\n{out}"
    report = json.loads(out_json.read_text())
    assert report["command"].startswith("hvd-onebit bench train") and report["commit"], \
        f"the JSON's provenance: {report['command']!r}, commit {report['commit']!r}"
    rows = {r["method"]: r for r in report["rows"]}
    face = rows["ddp_onebit"]["compression_measured_tx_bytes_per_step"]
    adam = rows["ddp_adam"]["all_measured_tx_bytes_per_step"]
    assert face * 25 < adam, \
        f"ddp_onebit's compressed step put {face} bytes on rank 0's link, ddp_adam's step " \
        f"{adam}: not under 1/25 of it"


@pytest.mark.skipif(os.geteuid() != 0, reason="the emulator needs root")
def test_bench_train_on_emulated_nodes_runs_the_hierarchical_method(tmp_path):
    out = tmp_path / "train.json"
    proc = bench("train", "--np", "4", "--ranks-per-node", "2", "--bandwidth", "1gbit",
                 "--steps", "6", "--model", "mlp", "--width", "64", "--depth", "1",
                 "--methods", "onebit,onebit_hierarchical", "--out", str(out))
    # rank 0's link counter is its node's link, which the node's 2 ranks share
    assert "measured MB/step/node link" in proc.stdout and "MB/step/rank" not in proc.stdout, \
        proc.stdout
    report = json.loads(out.read_text())
    assert report["ranks_per_node"] == 2
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"onebit", "onebit_hierarchical"}
    for r in rows.values():
        assert r["compression_step_s"] > 0 and r["compression_measured_tx_bytes_per_step"] > 0, r
    assert "onebit_hier_compression_step_speedup_vs_onebit" in report["summary"]


BAD_TRAIN_OPTIONS = [
    (["--methods", "local,sgd"], "--methods", "unknown methods"),
    (["--methods", ""], "--methods", "name each method once"),
    (["--methods", "local,local"], "--methods", "name each method once"),
    (["--np", "1"], "--np", "1: a comparison of training steps needs 2 or more ranks"),
    (["--steps", "1"], "--steps", "1 is not in the range x>=2"),
    (["--warmup-frac", "1.5"], "--warmup-frac", "1.5 is not in the range 0<=x<=1"),
    (["--steps", "10", "--warmup-frac", "1", "--methods", "local,onebit,ddp_onebit"],
     "--warmup-frac", "freezes at step 10, leaving no compressed step for onebit, ddp_onebit"),
    (["--steps", "10", "--refresh-freeze-frac", "0.96", "--methods", "onebit_refresh"],
     "--refresh-freeze-frac", "leaving no compressed step for onebit_refresh"),
    (["--steps", "10", "--refresh-freeze-frac", "0.96", "--methods",
      "ddp_onebit,ddp_onebit_refresh"],
     "--refresh-freeze-frac", "leaving no compressed step for ddp_onebit_refresh"),
    (["--batch-size", "0"], "--batch-size", "0 is not in the range x>=1"),
    (["--batch", "0"], "--batch-size", "0 is not in the range x>=1"),
    (["--width", "0"], "--width", "0 is not in the range x>=1"),
    (["--depth", "-1"], "--depth", "-1 is not in the range x>=0"),
    (["--timeout", "-1"], "--timeout", "-1.0 is not in the range x>0"),
    (["--powersgd-start", "-1"], "--powersgd-start", "-1 is not in the range x>=0"),
    (["--bucket-size-mb", "0"], "--bucket-size-mb", "0.0 is not in the range x>0"),
    (["--block-size", "7"], "--block-size", "7 is not a multiple of 8"),
    (["--bandwidth", "7parsecs"], "--bandwidth", "cannot parse bandwidth '7parsecs'"),
    (["--intra-bandwidth", "fast"], "--intra-bandwidth", "cannot parse bandwidth 'fast'"),
    (["--hosts", "h1:1,h2:1"], "--hosts needs --shared-dir", "--hosts needs --shared-dir"),
    (["--out", "/proc/nope.json"], "--out", "cannot write into '/proc'"),
    (["--plot", "x.txt"], "--plot", "'x.txt': a plot is written as one of"),
    (["--transport", "mpi", "--bandwidth", "1gbit"], "--transport mpi",
     "the emulated cluster launches them over Gloo"),
]


@pytest.mark.parametrize("args,option,text", BAD_TRAIN_OPTIONS,
                         ids=[" ".join(a) for a, _, _ in BAD_TRAIN_OPTIONS])
def test_bench_train_refuses_a_bad_option_before_the_run_naming_it(args, option, text):
    """Refused by the command line, before any rank starts: no traceback from inside the job
    and no run lost to a summary it cannot make."""
    result = hvd_onebit(["bench", "train", *args])
    assert result.exit_code == 2 and option in result.output and text in result.output, \
        f"bench train {' '.join(args)}: exit {result.exit_code}, expected 2 with {option!r} " \
        f"and {text!r} in: {result.output!r}"


def test_bench_train_summary_leaves_out_a_ratio_whose_phase_did_not_run():
    from hvd_onebit_tools.bench.train import summarize

    rows = [{"method": "horovod_fp32", "all_step_s": 1.0, "run_seconds": 10.0},
            {"method": "onebit", "warmup_step_s": 1.1, "run_seconds": 11.0, "freeze_step": 10,
             "steps": 10}]
    got = summarize(rows)
    assert "onebit_compression_step_speedup_vs_fp32" not in got and \
        got["onebit_run_speedup_vs_fp32"] == pytest.approx(10 / 11), \
        f"a onebit row without compressed steps summarized as {got}"


def test_bench_train_with_the_mpi_transport_launches_its_ranks_through_mpi():
    report = json.loads(bench("train", "--np", "2", "--bandwidth", "local", "--steps", "4",
                              "--model", "mlp", "--width", "16", "--depth", "1", "--methods",
                              "onebit", "--transport", "mpi", "--json").stdout)
    ob = report["rows"][0]
    got = (ob["compression_steps"], ob["compression_timed_steps"], report["config"]["transport"])
    assert got == (3, 2, "mpi") and ob["compression_bytes_per_step"] > 0, \
        f"(compression steps, timed steps, transport) {got}, expected (3, 2, 'mpi'); " \
        f"{ob['compression_bytes_per_step']} bytes per compressed step"


def test_bench_on_a_real_host_list_through_horovodrun(tmp_path):
    """--hosts runs through horovodrun without emulation; here the 'cluster' is this machine."""
    shared = ["--hosts", "localhost:2", "--shared-dir", str(tmp_path)]
    report = json.loads(bench("allreduce", "--np", "2", "--numel", "4096", "--repeats", "1",
                              "--json", *shared).stdout)
    assert {r["method"] for r in report["rows"]} == {"fp32", "fp16", "onebit"}
    bad = [r for r in report["rows"] if (r["bandwidth"], r["np"]) != ("real", 2)]
    assert not bad, f"rows not on 2 real ranks: {bad}"
    report = json.loads(bench("train", "--np", "2", "--steps", "4", "--model", "mlp", "--width",
                              "32", "--depth", "1", "--methods", "horovod_fp32,onebit", "--json",
                              *shared).stdout)
    rows = {r["method"]: r for r in report["rows"]}
    got = (rows["onebit"]["compression_steps"], report["bandwidth"])
    assert got == (3, "real"), f"(onebit compression steps, bandwidth) {got}, expected (3, 'real')"


def test_np_is_one_parser_everywhere_a_count_or_a_list_where_the_command_sweeps():
    one_world = hvd_onebit(["bench", "dev", "kernel", "--np", "2,4"])
    assert one_world.exit_code == 2 and "give one rank count" in one_world.output, \
        one_world.output
    for command in (["bench", "predict"], ["bench", "train"], ["bench", "dev", "memory"],
                    ["cluster", "run"]):
        bad = hvd_onebit([*command, "--np", "0"])
        assert bad.exit_code == 2 and "rank counts are positive integers" in bad.output, \
            f"{command}: {bad.output}"
        word = hvd_onebit([*command, "--np", "four"])
        assert word.exit_code == 2 and "not a rank count" in word.output, \
            f"{command}: {word.output}"
    for command in (["train"], ["allreduce"], ["calibrate"], ["predict"], ["dev", "zoo"],
                    ["dev", "memory"]):
        help_text = hvd_onebit(["bench", *command, "--help"]).stdout
        assert "--np" in help_text and "--bandwidth" in help_text, f"bench {command} --help"


def test_bandwidth_is_one_parser_everywhere_refused_before_the_run():
    for command in (["train"], ["allreduce"], ["calibrate"], ["dev", "memory"], ["dev", "zoo"]):
        bad = hvd_onebit(["bench", *command, "--bandwidth", "7parsecs"])
        assert bad.exit_code == 2 and "cannot parse bandwidth '7parsecs'" in bad.output, \
            f"bench {command} --bandwidth 7parsecs: exit {bad.exit_code}, {bad.output!r}"


def leaf_commands(group=None, path=()):
    """Every command of `hvd-onebit` that runs something, with its words (e.g. bench dev zoo)."""
    import click

    from hvd_onebit_tools.cli import main

    group = main if group is None else group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from leaf_commands(command, path + (name,))
        else:
            yield path + (name,), command


def test_the_command_line_speaks_one_vocabulary():
    """An option's name means one thing in every command: one primary spelling (an older one
    is its alias), one type; a file is --out and a folder --out-dir; every bench command that
    prints JSON can also write it with its provenance (--out, or --out-dir for a folder)."""
    import click

    spellings, problems = {}, []
    for path, command in leaf_commands():
        names = {o for p in command.params for o in p.opts}
        for param in (p for p in command.params if isinstance(p, click.Option)):
            for name in param.opts + param.secondary_opts:
                spellings.setdefault(name, set()).add((param.opts[0], type(param.type).__name__))
            if type(param.type) is click.FloatRange:
                problems.append(f"{' '.join(path)} {param.opts[0]}: a FloatRange lets nan in")
            folder = isinstance(param.type, click.Path) and not param.type.file_okay
            if param.opts[0] == "--out" and folder:
                problems.append(f"{' '.join(path)} --out names a folder: --out-dir")
        if path[0] == "bench" and "--json" in names and not names & {"--out", "--out-dir"}:
            problems.append(f"{' '.join(path)} prints JSON but cannot write it (--out)")
    problems += [f"{name} means {sorted(uses)}" for name, uses in spellings.items()
                 if len(uses) > 1]
    for alias, primary in (("--sizes", "--numel"), ("--batch", "--batch-size")):
        problems += [f"{alias} is spelled first in {sorted(spellings[alias])}, not {primary}"
                     for first, _ in spellings.get(alias, ()) if first != primary]
    assert not problems, "\n".join(problems)


def test_every_number_option_refuses_nan_and_infinity_naming_the_option():
    """A float option given nan (or inf, where it prices no infinity) is refused before the
    command runs, not carried into a job (a nan queue depth ended in a traceback, a nan
    timeout ran with no limit)."""
    from hvd_onebit_tools.params import Finite

    checked, problems = 0, []
    for path, command in leaf_commands():
        for param in (p for p in command.params if isinstance(p.type, Finite)):
            for value in ("nan",) + (() if param.type.allow_inf else ("inf",)):
                result = hvd_onebit([*path, param.opts[0], value])
                checked += 1
                if result.exit_code != 2 or f"'{value}' is not a finite number" not in \
                        result.output or param.opts[0] not in result.output:
                    problems.append(f"{' '.join(path)} {param.opts[0]} {value}: exit "
                                    f"{result.exit_code}, {result.output[-200:]!r}")
    assert checked >= 30 and not problems, f"{checked} checked:\n" + "\n".join(problems)


def test_a_report_written_with_out_is_the_json_printed_with_its_provenance(tmp_path):
    """Every measuring or predicting command's --out file: the report --json prints, with the
    command, commit, date and machine."""
    runs = {"kernel": ["bench", "dev", "kernel", "--numel", "64K", "--repeats", "1"],
            "memory": ["bench", "dev", "memory", "--world", "inprocess", "--layers", "1",
                       "--width", "64", "--warmup", "1", "--compressed", "1"],
            "predict": ["bench", "predict", "--model", "mlp", "--np", "8"]}
    for benchmark, args in runs.items():
        out = tmp_path / f"{benchmark}.json"
        result = hvd_onebit([*args, "--json", "--out", str(out)])
        assert result.exit_code == 0, f"{benchmark}: {result.output}"
        printed, written = json.loads(result.stdout), json.loads(out.read_text())
        head = {k: written.get(k) for k in ("benchmark", "command", "commit", "date")}
        assert written == printed and head["benchmark"] == benchmark and \
            head["command"].startswith("hvd-onebit") and len(head["commit"]) == 40 and \
            written["machine"]["cpu_count"] == os.cpu_count(), \
            f"{benchmark}: written == printed {written == printed}, head {head}"


def test_sigterm_stops_the_job_a_bench_command_started(tmp_path):
    """A scheduler's or `timeout`'s SIGTERM unwinds the command as Ctrl-C does: its job's
    processes are stopped, not left running, and the command exits 143 saying so."""
    import signal
    import time

    proc = subprocess.Popen(CLI + ["bench", "allreduce", "--np", "2", "--numel", "4096",
                                   "--repeats", "1000000", "--methods", "fp32", "--json"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks, deadline = [], time.monotonic() + 120
    while not ranks and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        ranks = [pid for pid in descendants(proc.pid)
                 if b"hvd_onebit_tools.cluster.jobs" in cmdline(pid)]
    job = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    alive = [pid for pid in job if cmdline(pid)]
    for _ in range(20):
        alive = [pid for pid in alive if cmdline(pid)]
        if not alive:
            break
        time.sleep(0.25)
    assert ranks and proc.returncode == 143 and "terminated (SIGTERM)" in err and not alive, \
        f"ranks seen {ranks}, exit {proc.returncode}, processes left {alive}: {err[-1500:]}"


def test_a_second_sigterm_does_not_cut_the_clean_up_short():
    """The first SIGTERM unwinds; one more during the clean-up it runs (killing the job, taking
    the emulated cluster down) is ignored until the clean-up is done."""
    script = ("import os, signal, time\n"
              "from hvd_onebit_tools.cluster.processes import Terminated, sigterm_unwinds\n"
              "done = False\n"
              "try:\n"
              "    with sigterm_unwinds():\n"
              "        try:\n"
              "            os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
              "        finally:\n"
              "            os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2); done = True\n"
              "except Terminated:\n"
              "    print('clean-up done:', done, 'handler back:',\n"
              "          signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n")
    proc = subprocess.run(CLI[:1] + ["-c", script], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.stdout.strip() == "clean-up done: True handler back: True", \
        f"exit {proc.returncode}: {proc.stdout!r} {proc.stderr[-1000:]!r}"


def descendants(pid: int) -> list:
    """The processes under ``pid`` (read from /proc), children first."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def cmdline(pid: int) -> bytes:
    """``pid``'s command line; empty once it has gone (or is a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_provenance_records_the_variables_that_change_the_kernels(monkeypatch):
    from hvd_onebit_tools.bench.report import provenance

    monkeypatch.delenv("HVD_ONEBIT_NATIVE", raising=False)
    assert "environment" not in provenance(), "an unset variable was recorded"
    monkeypatch.setenv("HVD_ONEBIT_NATIVE", "avx2")
    got = provenance()
    assert got["environment"] == {"HVD_ONEBIT_NATIVE": "avx2"}, got.get("environment")
    assert len(got["commit"]) == 40, got["commit"]


def allreduce_rows(links, sizes=(65536, 1 << 20)):
    """Rows as `bench allreduce` measures them (fp32, fp16, onebit at np 2 on each link)."""
    from hvd_onebit_tools.bench.allreduce import summarize

    times = {"fp32": 2.0, "fp16": 1.0, "onebit": 0.5}
    return summarize([{"np": 2, "numel": n, "method": m, "bandwidth": link,
                       "median_s": t * n * (i + 1), "bytes_per_rank": 4 * n}
                      for i, link in enumerate(links) for n in sizes for m, t in times.items()])


def test_bench_allreduce_plot_draws_what_loopback_measured_against_buffer_size(tmp_path):
    """--bandwidth local (the default) measures loopback: the figure is the speed-up over fp32
    at each buffer size, titled so, not an empty 'emulated cluster' chart."""
    from hvd_onebit_tools.bench.allreduce import plot

    drawn = plot(allreduce_rows(["local"]), str(tmp_path / "ar.png"))
    assert (tmp_path / "ar.png").stat().st_size > 0, "no PNG"
    assert drawn["x"] == "buffer size" and "loopback" in drawn["title"] and \
        "emulated" not in drawn["title"], drawn
    assert drawn["series"] == {
        "fp16, np=2, loopback, no emulation": ([65536, 1 << 20], [2.0, 2.0]),
        "onebit, np=2, loopback, no emulation": ([65536, 1 << 20], [4.0, 4.0])}, drawn
    one_rate = plot(allreduce_rows(["1gbit"]), str(tmp_path / "one.png"))
    assert one_rate["x"] == "buffer size" and "emulated 1gbit" in one_rate["title"] and \
        len(one_rate["series"]) == 2, one_rate
    sweep = plot(allreduce_rows(["100mbit", "1gbit"], sizes=(65536,)), str(tmp_path / "bw.png"))
    assert sweep["x"] == "link rate" and "emulated cluster" in sweep["title"] and \
        sweep["series"]["onebit, np=2, 0.0625M elements"] == ([0.1, 1.0], [4.0, 4.0]), sweep


@pytest.mark.parametrize("args, option, text", [
    (["--np", "1"], "--np", "1: an allreduce job needs 2 or more ranks"),
    (["--numel", ""], "--numel", "'' names nothing"),
    (["--numel", "1e400K"], "--numel", "'1e400K' is not finite"),
    (["--sizes", "1M,-5"], "--sizes", "'-5' is not a positive element count"),
    (["--numel", "0"], "--numel", "'0' is not a positive element count"),
    (["--methods", ""], "--methods", "'' names nothing"),
    (["--bandwidth", ""], "--bandwidth", "'' names no link rate"),
    (["--repeats", "0"], "--repeats", "0 is not in the range x>=1"),
    (["--timeout", "0"], "--timeout", "0.0 is not in the range x>0"),
    (["--np", "2,,4"], "--np", "'2,,4' is not a rank count or a comma-separated list"),
    (["--np", "2,2"], "--np", "'2,2': name each rank count once"),
    (["--methods", "fp32,fp32"], "--methods", "'fp32,fp32': name each method once"),
    (["--plot", "FILE/x.png"], "--plot", "cannot make the folder")])
def test_bench_allreduce_refuses_a_bad_option_before_the_run(tmp_path, monkeypatch, args, option,
                                                              text):
    import hvd_onebit_tools.cluster.jobs as jobs

    monkeypatch.setattr(jobs, "run_job", lambda *a, **kw: pytest.fail("a job was launched"))
    (tmp_path / "FILE").write_text("")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    result = hvd_onebit(["bench", "allreduce", "--np", "2", *args])
    assert result.exit_code == 2 and option in result.output and text in result.output, \
        f"bench allreduce {' '.join(args)}: exit {result.exit_code}, expected 2 with " \
        f"{option!r} and {text!r} in: {result.output!r}"


def test_an_element_count_is_one_parser_with_suffixes_and_exponents():
    from hvd_onebit_tools.bench.cli.options import parse_count

    for text, want in (("16M", 16 << 20), ("1.5K", 1536), ("1e6", 10**6), (" 65536 ", 65536)):
        assert parse_count(text) == want, f"{text!r} read as {parse_count(text)}, not {want}"
    for text, error in (("1.5", ValueError), ("abc", ValueError), ("1e400", OverflowError)):
        with pytest.raises(error):
            parse_count(text)


def test_np_of_a_one_world_command_is_not_offered_as_a_list():
    """A command that runs one world says so from the first message: `--np abc` does not
    suggest 2,4,8, which it would then refuse."""
    for command in (["bench", "train"], ["bench", "dev", "kernel"], ["bench", "dev", "memory"]):
        word = hvd_onebit([*command, "--np", "abc"])
        assert word.exit_code == 2 and "'abc' is not a rank count (e.g. 4)" in word.output \
            and "comma-separated" not in word.output, f"{command}: {word.output}"
    for command in (["bench", "predict"], ["bench", "allreduce"]):
        word = hvd_onebit([*command, "--np", "abc"])
        assert word.exit_code == 2 and "comma-separated list" in word.output, \
            f"{command} (a sweep): {word.output}"


BAD_DEV_OPTIONS = [
    (["kernel", "--threads", "0"], "--threads", "0 is not in the range x>=1"),
    (["kernel", "--repeats", "0"], "--repeats", "0 is not in the range x>=1"),
    (["kernel", "--numel", "0"], "--numel", "'0' is not a positive element count"),
    (["kernel", "--numel", "1M,-5"], "--numel", "'-5' is not a positive element count"),
    (["memory", "--layers", "0"], "--layers", "0 is not in the range x>=1"),
    (["memory", "--width", "0"], "--width", "0 is not in the range x>=1"),
    (["memory", "--warmup", "0"], "--warmup", "0 is not in the range x>=1"),
    (["memory", "--compressed", "0"], "--compressed", "0 is not in the range x>=1"),
    (["memory", "--bucket-size-mb", "0"], "--bucket-size-mb", "0.0 is not in the range x>0"),
    (["memory", "--np", "1"], "--np", "1: the compression phase's memory needs 2 or more"),
    (["memory", "--world", "inprocess", "--variance-refresh", "doubling"], "--world horovod",
     "--variance-refresh: refresh steps average through Horovod"),
    (["zoo", "--timeout", "0"], "--timeout", "0.0 is not in the range x>0"),
    (["zoo", "--against", "bogus"], "--against", "unknown scheme 'bogus'"),
    (["zoo", "--np", "1"], "--np", "1: a comparison with Adam needs 2 or more ranks"),
]


@pytest.mark.parametrize("args,option,text", BAD_DEV_OPTIONS,
                         ids=[" ".join(a) for a, _, _ in BAD_DEV_OPTIONS])
def test_bench_dev_refuses_a_bad_option_before_measuring_naming_it(monkeypatch, args, option,
                                                                    text):
    """A one-line error naming the option, not a traceback from inside the measurement (an
    empty median, a division by zero parameters, torch's thread count)."""
    import hvd_onebit_tools.bench.kernel as kernel
    import hvd_onebit_tools.bench.memory as memory
    import hvd_onebit_tools.bench.zoo.runner as runner

    for module, name in ((kernel, "bench_kernels"), (memory, "bench_memory"),
                         (runner, "run_zoo")):
        monkeypatch.setattr(module, name, lambda *a, **kw: pytest.fail("it measured"))
    result = hvd_onebit(["bench", "dev", *args])
    assert result.exit_code == 2 and option in result.output and text in result.output, \
        f"bench dev {' '.join(args)}: exit {result.exit_code}, expected 2 with {option!r} " \
        f"and {text!r} in: {result.output!r}"


def test_bench_dev_memory_on_cuda_without_a_device_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = hvd_onebit(["bench", "dev", "memory", "--device", "cuda", "--world", "inprocess"])
    assert result.exit_code == 2 and "no CUDA device" in result.output, result.output


def test_train_lm_help_states_the_block_size_the_optimizer_gets_when_it_is_omitted():
    import inspect

    import hvd_onebit

    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    import train_lm

    parser = train_lm.build_parser()
    options = train_lm.onebit_options(parser.parse_args([]))
    default = inspect.signature(hvd_onebit.DistributedOptimizer).parameters["block_size"].default
    help_text = next(a.help for a in parser._actions if "--block-size" in a.option_strings)
    assert "block_size" not in options and f"block_size, {default}]" in help_text and \
        "one per chunk" not in help_text, \
        f"omitted, the optimizer gets block_size={default} (options {options}); " \
        f"help: {help_text!r}"


def test_the_refresh_runs_share_of_full_precision_steps_is_told_beside_a_long_runs():
    """A short `bench train` run of the defaults is mostly full-precision steps; the note under
    the table counts them, and the same setting's count over 10,000 steps, from the schedule."""
    from hvd_onebit.variance_refresh import RefreshSchedule
    from hvd_onebit_tools.bench.cli.train import refresh_share_note
    from hvd_onebit_tools.bench.refresh import DOUBLING, run_steps

    note = refresh_share_note(run_steps(40, 2, DOUBLING), DOUBLING, 0.05)
    long_fp = 500 + RefreshSchedule.from_option(DOUBLING).count(10000, 500)
    short = run_steps(40, 2, DOUBLING)["full_precision_steps"]
    assert short / 40 > long_fp / 10000, f"40 steps: {short} in full precision, 10,000: {long_fp}"
    assert note.startswith(f"onebit_refresh: {short} of 40 steps in full precision (warmup 2, ") \
        and f"over 10,000 steps takes {long_fp:,} ({long_fp / 10000:.1%})" in note, note


def test_a_failed_job_ends_the_command_with_what_its_ranks_said():
    """No traceback of the command around the ranks' own (a job past its --timeout, a rank
    that raised): the failure's text on stderr and exit status 1."""
    proc = subprocess.run(CLI[:1] + ["-c", "import sys; sys.argv = ['hvd-onebit'] + sys.argv[1:]; "
                                     "from hvd_onebit_tools.entry import main; main()",
                                     "bench", "train", "--np", "2", "--bandwidth", "local",
                                     "--steps", "4", "--model", "mlp", "--width", "8",
                                     "--depth", "1", "--methods", "local", "--timeout", "0.01"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1 and "\nhvd-onebit: " in proc.stderr \
        and "timed out" in proc.stderr and "hvd_onebit_tools/entry.py" not in proc.stderr, \
        f"exit {proc.returncode}, stderr:\n{proc.stderr[-2000:]}"


WITHOUT_HOROVOD = ("import sys; sys.argv = ['hvd-onebit'] + sys.argv[1:]; "
                   "from hvd_onebit_tools.cluster.torchrun import block_horovod; "
                   "block_horovod(); from hvd_onebit_tools.entry import main; main()")


def without_horovod(*args):
    """``hvd-onebit ARGS`` in a Python where ``import horovod`` fails, as a DDP user's."""
    return subprocess.run(CLI[:1] + ["-c", WITHOUT_HOROVOD, *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_bench_train_without_horovod_runs_ddps_methods_under_torchrun():
    """A DDP user measures DDP Adam against the DDP face without Horovod, with the paper's
    settings and with the library's defaults (a refresh schedule, its refresh steps a phase of
    their own): the default methods that need none run under torchrun (the others left out,
    with a note); one that needs Horovod, named, is refused naming those that do not; a
    Horovod-only command says so in one line."""
    proc = without_horovod("bench", "train", "--np", "2", "--bandwidth", "local", "--steps", "6",
                           "--model", "mlp", "--width", "32", "--depth", "1",
                           "--variance-refresh", '{"first_interval": 2}', "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {r["method"]: r for r in report["rows"]}
    got = (report["launcher"], sorted(rows), rows["ddp_onebit"].get("compression_steps"))
    assert got == ("torchrun", ["ddp_adam", "ddp_onebit", "ddp_onebit_refresh", "ddp_powersgd",
                                "local"], 5) and \
        "horovod_fp32, horovod_fp16, onebit, onebit_refresh left out" in proc.stderr, \
        f"(launcher, methods, ddp_onebit's compressed steps) {got}; stderr {proc.stderr[-800:]}"
    # frozen at round(0.05 * 6) -> 1, refreshed at steps 2 and 4 (every 2nd step from 0)
    refresh = rows["ddp_onebit_refresh"]
    got = {k: refresh.get(k) for k in ("freeze_step", "variance_refresh", "step_phases",
                                       "refresh_steps", "compression_steps")}
    assert got == {"freeze_step": 1, "variance_refresh": '{"first_interval":2}',
                   "step_phases": ["warmup", "compression", "refresh", "compression", "refresh",
                                   "compression"], "refresh_steps": 2, "compression_steps": 3}, \
        f"ddp_onebit_refresh row: {got}"
    assert refresh["steps_by_kind"]["refresh_steps"] == 2, refresh["steps_by_kind"]
    summary = report["summary"]
    keys = ("ddp_onebit_refresh_run_speedup_vs_ddp_adam",
            "ddp_onebit_refresh_run_speedup_vs_ddp_onebit",
            "ddp_onebit_refresh_bytes_vs_ddp_onebit", "ddp_onebit_refresh_speedup_any_schedule")
    bad = {k: summary.get(k) for k in keys
           if not isinstance(summary.get(k), float) or not 0 < summary[k] < float("inf")}
    assert not bad, f"summary figures missing or not finite and positive: {bad}; {summary}"
    # 3 full-precision steps (warmup, 2 refreshes) of ddp_onebit_refresh against 1 of ddp_onebit
    assert summary["ddp_onebit_refresh_bytes_vs_ddp_onebit"] > 1, summary
    named = without_horovod("bench", "train", "--np", "2", "--methods", "ddp_adam,onebit")
    assert named.returncode == 2 and "onebit needs Horovod" in named.stderr and \
        "local, ddp_adam, ddp_onebit, ddp_onebit_refresh, ddp_powersgd, which run under " \
        "torchrun" in named.stderr, f"exit {named.returncode}: {named.stderr[-800:]}"
    for args in (["allreduce", "--np", "2", "--numel", "4096"], ["dev", "memory"],
                 ["dev", "zoo", "--families", "mlp"]):
        horovod_only = without_horovod("bench", *args)
        assert horovod_only.returncode == 2 and "Error: this command runs its ranks as a " \
            "Horovod job" in horovod_only.stderr and "Traceback" not in horovod_only.stderr, \
            f"bench {' '.join(args)}: exit {horovod_only.returncode}, stderr:\n" \
            f"{horovod_only.stderr[-2000:]}"


@pytest.mark.skipif(not (Path(sys.executable).parent / "horovodrun").is_file(),
                    reason="Horovod's launcher is not installed beside this Python")
def test_the_launcher_is_the_one_beside_this_python_activated_or_not(tmp_path, monkeypatch):
    """`.venv/bin/hvd-onebit` run without activating the environment launches that
    environment's horovodrun, which PATH does not hold; a launcher found nowhere is named."""
    from hvd_onebit_tools.cluster.jobs import LaunchError, launcher

    monkeypatch.setenv("PATH", str(tmp_path))
    found = launcher("horovodrun")
    assert found == str(Path(sys.executable).parent / "horovodrun"), found
    with pytest.raises(LaunchError, match="mpirun is not beside .* nor on PATH: it is Open MPI"):
        launcher("mpirun")


HOSTS = ["--hosts", "localhost:2", "--shared-dir", "/tmp"]
BAD_REAL_CLUSTER = [
    (["--hosts", "localhost:2", "--shared-dir", "/nonexistent/hvd_onebit_shared"],
     "--shared-dir", "Directory '/nonexistent/hvd_onebit_shared' does not exist"),
    (["--hosts", "localhost:2", "--shared-dir", "/proc/version"], "--shared-dir",
     "Directory '/proc/version' is a file"),
    (["--hosts", "localhost:x", "--shared-dir", "/tmp"], "--hosts",
     "'localhost:x' is not host:slots, the slots a whole number 1 or more"),
    (["--hosts", "h1:2,h2", "--shared-dir", "/tmp"], "--hosts", "'h2' in 'h1:2,h2' is not"),
    (["--hosts", "h1:\u00b2", "--shared-dir", "/tmp"], "--hosts",
     "'h1:\u00b2' is not host:slots"),  # a digit to str.isdigit, not to int()
    (["--hosts", "localhost:0", "--shared-dir", "/tmp"], "--hosts", "'localhost:0' is not"),
    (["--np", "4", *HOSTS], "--np", "4 ranks do not fit the 2 slot(s) of --hosts localhost:2"),
    (["--bandwidth", "100mbit", *HOSTS], "--bandwidth", "would be ignored"),
    (["--ranks-per-node", "2", *HOSTS], "--ranks-per-node", "would be ignored"),
    (["--intra-bandwidth", "1gbit", *HOSTS], "--intra-bandwidth", "would be ignored"),
    (["--queue-ms", "5", *HOSTS], "--queue-ms", "would be ignored")]


@pytest.mark.parametrize("command", ["train", "allreduce"])
@pytest.mark.parametrize("args,option,text", BAD_REAL_CLUSTER,
                         ids=[" ".join(a[:2]) for a, _, _ in BAD_REAL_CLUSTER])
def test_a_real_cluster_s_options_are_checked_before_the_launch(monkeypatch, command, args,
                                                                option, text):
    """A missing or non-folder --shared-dir, a --hosts that is not host:slots, more ranks than
    slots, and the emulated cluster's options beside --hosts (which they would not shape) are
    usage errors naming the option: no job is launched, no traceback."""
    import hvd_onebit_tools.cluster.jobs as jobs

    monkeypatch.setattr(jobs, "run_job", lambda *a, **kw: pytest.fail("a job was launched"))
    if command == "allreduce" and option == "--bandwidth":
        args = [a.replace("100mbit", "local") for a in args]  # its default, given: still refused
    result = hvd_onebit(["bench", command, "--np", "2", *args])
    assert result.exit_code == 2 and option in result.output and text in result.output, \
        f"bench {command} {' '.join(args)}: exit {result.exit_code}, expected 2 with " \
        f"{option!r} and {text!r} in: {result.output!r}"


def test_a_launch_that_fails_before_any_rank_starts_says_so_with_the_launchers_error(tmp_path):
    """horovodrun failing before any rank starts (a host it cannot reach) is a failed launch
    with horovodrun's own error line, not each rank's 'returned no result'."""
    from hvd_onebit_tools.cluster.jobs import LaunchError, _collect

    log = ("ssh not successful for host nosuchhost.invalid:\nssh: Could not resolve hostname "
           "nosuchhost.invalid: Name or service not known\n\nTraceback (most recent call "
           "last):\n  File \"horovod/runner/launch.py\", line 655, in _run_static\n    raise "
           "RuntimeError('could not connect to some hosts via ssh')\nRuntimeError: could not "
           "connect to some hosts via ssh\n")
    (tmp_path / "output.log").write_text(log)
    with pytest.raises(LaunchError) as info:
        _collect(tmp_path, 2, 1, False, 60.0, "m:f", "gloo")
    text = str(info.value)
    assert "the launch failed before any rank started" in text and "returned no result" not in \
        text and text.endswith("RuntimeError: could not connect to some hosts via ssh") and \
        "Could not resolve hostname" in text and "launch.py" not in text, text
    result = hvd_onebit(["bench", "allreduce", "--np", "2", "--numel", "4096", "--repeats", "1",
                         "--hosts", "nosuchhost.invalid:2", "--shared-dir", str(tmp_path)])
    got = str(result.exception)
    assert isinstance(result.exception, LaunchError) and "the launch failed before any rank " \
        "started" in got and "returned no result" not in got, \
        f"exit {result.exit_code}, {result.exception!r}:\n{result.output[-2000:]}"


def test_version_without_the_package_installed_is_the_package_s_own(monkeypatch):
    """A checkout run with `python -m hvd_onebit_tools.cli` (no package metadata): --version
    prints hvd_onebit.__version__, not a RuntimeError."""
    import importlib.metadata

    from hvd_onebit import __version__

    real = importlib.metadata.version

    def version(name):
        if name.replace("-", "_") == "hvd_onebit":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    result = hvd_onebit(["--version"])
    assert result.exit_code == 0 and result.output == \
        f"hvd-onebit, version {__version__}\n", \
        f"exit {result.exit_code}, {result.exception!r}: {result.output!r}"
    from hvd_onebit_tools.bench.report import provenance

    assert provenance()["versions"]["hvd_onebit"] == __version__


def git_repo(root: Path, files: dict) -> str:
    """A git repository at ``root`` holding ``files`` (path -> text), committed: its commit."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True, env=env, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_a_report_s_commit_is_the_tools_checkout_s_or_none(tmp_path):
    """The commit is the tools' own checkout's; a copy installed into site-packages has none,
    even when the virtual environment sits inside the user's own git repository; and the
    versions name hvd_onebit's, so a report from an install still identifies the library."""
    from hvd_onebit_tools.bench.report import provenance, source_commit

    user = tmp_path / "userproj"
    site = user / "venv" / "lib" / "site-packages"
    user_commit = git_repo(user, {"train.py": "", "venv/lib/site-packages/hvd_onebit_tools/"
                                  "__init__.py": ""})
    assert source_commit(site / "hvd_onebit_tools") is None, \
        f"a copy in site-packages inside the user's repository reports {user_commit}"
    bare = tmp_path / "bare" / "hvd_onebit_tools"
    bare.mkdir(parents=True)
    assert source_commit(bare) is None, "a copy outside any repository reports a commit"
    other = tmp_path / "other"
    git_repo(other, {"README": ""})
    (other / "hvd_onebit_tools").mkdir()
    assert source_commit(other / "hvd_onebit_tools") is None, \
        "a repository that does not track the package reports its commit"
    checkout = tmp_path / "checkout"
    commit = git_repo(checkout, {"hvd_onebit_tools/__init__.py": ""})
    got = source_commit(checkout / "hvd_onebit_tools")
    assert got == commit, f"the checkout's commit is {commit}, reported {got}"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    report = provenance()
    assert report["commit"] == head and report["versions"].get("hvd_onebit"), \
        f"this checkout at {head}: commit {report['commit']}, versions {report['versions']}"


def test_the_help_of_a_count_says_what_its_suffix_means():
    """--params counts parameters in decimal (1M is 1,000,000), element counts are binary (1M is
    1,048,576): each option's help says which."""
    wants = {("bench", "predict"): "1M is 1,000,000", ("check",): "1M is 1,000,000",
             ("bench", "calibrate"): "1M is 1,048,576", ("bench", "allreduce"): "1M is 1,048,576",
             ("bench", "dev", "kernel"): "1M is 1,048,576"}
    missing = {}
    for command, want in wants.items():
        result = hvd_onebit([*command, "--help"])
        if want not in " ".join(result.output.split()):
            missing[" ".join(command)] = want
    assert not missing, f"help without the suffix's meaning: {missing}"
