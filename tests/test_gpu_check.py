"""benchmarks/gpu_check.py without a GPU: --dry-run runs its bit and virtual-rank checks on CPU
tensors under Triton's interpreter (in a subprocess: TRITON_INTERPRET is set there only) and
reports the CUDA-only checks as skipped; without --dry-run and without CUDA it says so."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (`make setup` installs it)")
def test_dry_run_checks_bits_and_virtual_ranks_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["ok"], \
        f"dry_run {report['dry_run']}, ok {report['ok']}: {report}"
    checks = report["checks"]
    failed = [({c: x for c, x in case.items() if not c.startswith("triton")}, k)
              for case in checks["bits"]["cases"]
              for k, v in case.items() if k.startswith("triton") and not v]
    assert checks["bits"]["ok"] and not failed, \
        f"bit checks ok={checks['bits']['ok']}, failing (case, check) {failed}: {checks['bits']}"
    vr = checks["virtual_ranks"]
    assert vr["ranks_identical"], f"the virtual ranks' results differ: {vr}"
    assert vr["equal_to_native_cpu"], f"the virtual ranks differ from the native CPU kernels: {vr}"
    assert {checks[k]["skipped"] for k in ("ratios", "memory", "host_syncs")} == {"needs CUDA"}
    cost = checks["host_cost"]
    timed = {k for k, e in cost["passes"].items() if e["host_us_per_call"] > 0}
    assert timed == {"add", "compress", "server", "decode", "momentum_compress",
                     "momentum_compress_preconditioned", "decode_update",
                     "decode_update_preconditioned"}, f"host_cost timed {sorted(timed)}"
    assert "worker_compress_momentum" in cost["profile_momentum_compress_preconditioned"], \
        f"the profile names no compression: {cost['profile_momentum_compress_preconditioned']}"
    # the profiled region is one engine step: whatever its top 25 by own time (on CPU, a
    # tie of zeros), they are the engine's calls, and there are hundreds of them
    host = checks["step_time"]["worlds"][0]["host_profile_rank0"]
    calls = re.search(r"(\d+) function calls", host)
    engine = [m for m in ("flat.py", "adam_terms.py", "variance.py", "averaging.py",
                          "transaction.py", "step.py") if m in host]
    assert calls and int(calls.group(1)) > 100 and engine, f"the step's host profile: {host}"
    paths = checks["engine_paths"]
    assert paths["ok"] and paths["buckets"] > 1 and paths["early_starts"] == 4 * paths["buckets"] \
        and set(paths["stages"]) == {"alone", "early", "tensor_options", "flushed_in_pieces"}, \
        f"the engine's paths: {paths}"
    assert checks["wide"]["ok"] and not checks["wide"]["wide"], f"wide: {checks['wide']}"
    grads = checks["gradient_paths"]
    storages = grads["storage_of_equals_storage"]
    assert grads["ok"] and len(grads["flags"]) == 6 and len(storages) == 5, \
        f"the non-finite flags and the gradients' storages: {grads}"
    probe = checks["probe"]
    assert probe["ok"] and probe["probe"]["device"] == "cpu" and probe["probe"]["ranks"] == 2, \
        f"check --probe under torchrun: {probe}"
    for w in checks["step_time"]["worlds"]:
        cpu, share = w["host_cpu_ms_per_rank_step"], w["host_cpu_share_of_wall"]
        assert cpu > 0 and 0 < share <= 1.05 * w["ranks"], \
            f"{w['ranks']} ranks: host CPU {cpu} ms per rank-step, {share} of the wall " \
            f"{w['wall_ms_per_step_all_ranks']} ms"


def test_without_cuda_the_report_says_so():
    proc = _run()
    report = json.loads(proc.stdout)
    if report["cuda_available"]:
        pytest.skip("this machine has CUDA")
    assert proc.returncode == 1 and "no CUDA device" in report["error"], \
        f"exited with {proc.returncode} (expected 1), error {report['error']!r}"
