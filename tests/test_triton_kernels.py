"""The Triton kernels, run under Triton's interpreter on CPU tensors (tests/triton_cases.py).

``TRITON_INTERPRET=1`` has to be in the environment before triton is first imported, so the
cases run in a pytest subprocess of their own: neither the variable nor an interpreted triton
reaches any other test of this session. Skipped only where triton is not installed (`make setup`
installs it); an installed triton that fails to import fails here."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (`make setup` installs it)")
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
         str(ROOT / "tests" / "triton_cases.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
