#!/usr/bin/env bash
# Install hvd_onebit as a user does: into a second virtual environment that already holds torch
# and nothing else, from an sdist of this checkout, with a plain `pip install` (build isolation
# on), away from the project's files; runs the DDP example there under torchrun while Horovod
# cannot be imported, then adds Horovod (the wheel `make setup` cached) and runs an example under
# horovodrun. Prints one JSON line: the steps' exit statuses and seconds, and the kernels
# the installed package uses. `make install-check` runs it; too slow for the test suite.
#
#   HVD_ONEBIT_CHECK_DIR   where the venv and the sdist go (default: a temporary folder)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEV_PY="${HVD_ONEBIT_VENV:-$ROOT/.venv}/bin/python"
CACHE="${HVD_ONEBIT_CACHE:-$HOME/.cache/hvd_onebit}"
WORK="${HVD_ONEBIT_CHECK_DIR:-$(mktemp -d)}"
mkdir -p "$WORK"
VENV="$WORK/venv"
PY="$VENV/bin/python"
log() { printf '[install-check] %s\n' "$*" >&2; }
steps=()
step() {  # step NAME COMMAND...: run it, record its status and seconds
    local name="$1"; shift
    local t0=$SECONDS rc=0
    log "$name: $*"
    "$@" >"$WORK/$name.log" 2>&1 || rc=$?
    steps+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"log\": \"$WORK/$name.log\"}")
    if [ $rc -ne 0 ]; then tail -n 30 "$WORK/$name.log" >&2; finish 1; fi
}
finish() {
    local IFS=,
    printf '{"work": "%s", "steps": {%s}}\n' "$WORK" "${steps[*]}"
    exit "$1"
}

torch_version="$("$DEV_PY" -c 'import torch; print(torch.__version__)')"
torch_tag="${torch_version/+/_}"
horovod_whl="$(ls "$CACHE"/wheels/torch-"$torch_tag"/horovod-*.whl 2>/dev/null | head -n1 || true)"
torch_whl="$(ls /opt/wheels/torch-"$torch_version"-*.whl 2>/dev/null | head -n1 || true)"

# The sdist of what the checkout tracks (uncommitted edits included), built without the venv's
# project install in the way.
step sdist bash -c "cd '$ROOT' && rm -rf '$WORK/src' && mkdir -p '$WORK/src' &&
    git ls-files -z | xargs -0 cp --parents -t '$WORK/src' &&
    cd '$WORK/src' && '$DEV_PY' setup.py -q sdist -d '$WORK/dist'"
sdist="$(ls "$WORK"/dist/hvd_onebit-*.tar.gz | head -n1)"
rm -rf "$WORK/src"

step venv python3 -m venv "$VENV"
step torch "$PY" -m pip install -q "${torch_whl:-torch==$torch_version}" numpy cloudpickle psutil \
    pyyaml packaging
# The user's command: a plain install, build isolation on, with the tools extra for the CLI.
step install "$PY" -m pip install -q "$sdist[tools]"
step unchanged "$PY" -c "import torch; assert torch.__version__ == '$torch_version', torch.__version__"
cd "$WORK"
step kernels "$PY" -c "
import torch, hvd_onebit, hvd_onebit.kernels as k
from hvd_onebit.kernels.native_loader import load_native
assert 'site-packages' in hvd_onebit.__file__, hvd_onebit.__file__
n = load_native(); print(n.origin, n.reason)
assert k.resolve_backend('auto', torch.device('cpu')) == 'native', n.reason"
# The benchmarks' entry points run on the installed tools (benchmarks/ is not a package: the
# studies they import must have been installed).
step studies "$PY" "$ROOT/benchmarks/convergence.py" --help
# The DDP face in an environment without Horovod: it must not be importable, and the example runs.
step no_horovod "$PY" -c "
import importlib.util as u; assert u.find_spec('horovod') is None, 'horovod is installed'"
step check_ddp "$VENV/bin/hvd-onebit" check
cp "$ROOT"/examples/ddp_train.py "$WORK/"
step ddp_example "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
    "$WORK/ddp_train.py" --optimizer onebit --steps 100
step ddp_example_phase "$PY" -c "
import json, re; text = open('$WORK/ddp_example.log').read()
summary = json.loads(text[text.index('{'):text.rindex('}') + 1])
assert summary['phase'] == 'compression' and summary['val_loss'] < 1.386, summary
print(summary)"
if [ -n "$horovod_whl" ]; then
    step horovod "$PY" -m pip install -q --no-deps "$horovod_whl"
    step check "$VENV/bin/hvd-onebit" check
    "$PY" -m pip install -q scikit-learn >/dev/null 2>&1 || true
    cp "$ROOT"/examples/train_digits.py "$ROOT"/examples/train_lm.py "$WORK/"
    step example env PATH="$VENV/bin:$PATH" "$VENV/bin/horovodrun" -np 2 -H localhost:2 --gloo \
        "$PY" "$WORK/train_digits.py" --steps 40 --eval-every 20
fi
cat "$WORK/kernels.log" >&2
finish 0
