#!/usr/bin/env bash
# The GPU check (hvd_onebit_tools/bench/gpu_check.py, docs/gpu.md) as one command for a lent
# device machine, which has torch, CUDA and Triton but no network: click, the one package the
# check needs beyond them, comes as a wheel from a folder carried with the checkout and is
# imported from the wheel itself (nothing is installed). Run it from the checkout's root:
#
#   mkdir .gpu && pip download --no-deps click -d .gpu     # here, once (.gpu is not committed)
#   OUT=/tmp/gpu launch/gpu_check.sh --dry-run              # here: the CPU parts, in seconds
#   OUT=$OUT launch/gpu_check.sh                            # there, carrying .gpu
#
#   OUT       folder for nvidia_smi.txt and gpu_check.{json,stdout,stderr} (required)
#   WHEELS    folder holding click's wheel (default .gpu)
#   LIMIT_S   seconds before the check is stopped (default 400; the JSON keeps what finished)
# Other arguments go to the check. Prints each check's verdict; the exit status is the check's.
set -u
: "${OUT:?set OUT to the folder for the results}"
WHEELS="${WHEELS:-.gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
{ nvidia-smi || echo "no nvidia-smi here"; } > "$OUT/nvidia_smi.txt" 2>&1
path="$PWD"
if ! "$PY" -c "import click" 2>/dev/null; then
    wheel="$(ls "$WHEELS"/click-*.whl 2>/dev/null | head -n 1)"
    if [ -z "$wheel" ]; then
        echo "gpu_check: no click here and no click wheel in $WHEELS: pip download --no-deps" \
             "click -d $WHEELS, and carry it" >&2
        exit 2
    fi
    path="$path:$PWD/$wheel"
fi
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" timeout "${LIMIT_S:-400}" \
    "$PY" benchmarks/gpu_check.py --out "$OUT/gpu_check.json" "$@" \
    > "$OUT/gpu_check.stdout" 2> "$OUT/gpu_check.stderr"
rc=$?
"$PY" - "$OUT/gpu_check.json" "$rc" <<'EOF'
import json, sys
path, rc = sys.argv[1], sys.argv[2]
try:
    report = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"gpu_check: exit status {rc}, no report ({exc}); see gpu_check.stderr")
    sys.exit(0)
print(f"gpu_check: exit status {rc}, device {report.get('device')}, "
      f"torch {report.get('torch')}, error {report.get('error')}")
for name, check in (report.get("checks") or {}).items():
    verdict = check.get("ok") if isinstance(check, dict) else check
    print(f"  {name}: ok={verdict}")
EOF
exit "$rc"
