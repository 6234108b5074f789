#!/usr/bin/env bash
# Fresh-machine set-up for hvd_onebit, idempotent: `make setup` runs it.
#
#   1. Debian packages: openmpi-bin, libopenmpi-dev, iproute2, g++, cmake (only those missing).
#   2. .venv with the CPU build of torch 2.13.0 and the Python dependencies (scikit-learn only
#      for the digits example's bundled data set; sphinx, myst-parser and sphinx-click for
#      `make docs`), and triton 3.9.0: the CUDA kernels, tested
#      here under Triton's interpreter on CPU tensors (a ~285 MB wheel, about 40 s to install).
#   3. Horovod 0.28.1 built from its PyPI sdist with PyTorch, Gloo and MPI. The sdist needs two
#      fixes to build against torch >= 2.1 with a recent cmake:
#        - CMAKE_POLICY_VERSION_MINIMUM=3.5, because cmake 4 rejects the bundled gloo's
#          cmake_minimum_required;
#        - C++17 instead of C++14 in CMakeLists.txt and horovod/torch/CMakeLists.txt, because
#          torch's headers need C++17.
#      The wheel is cached in ~/.cache/hvd_onebit/ so a second set-up reuses it (seconds, not
#      minutes). The build is checked with `horovodrun --check-build`.
#   4. `pip install --no-build-isolation -e .` of the project, which also compiles the native
#      sign-compression kernels against the venv's torch (with torch's own C++ standard).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_ONEBIT_VENV:-$ROOT/.venv}"
CACHE="${HVD_ONEBIT_CACHE:-$HOME/.cache/hvd_onebit}"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TRITON_VERSION=3.9.0
PY="$VENV/bin/python"

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. system packages -------------------------------------------------------------------
need_pkgs=()
command -v mpirun >/dev/null 2>&1 || need_pkgs+=(openmpi-bin)
command -v mpicxx >/dev/null 2>&1 || need_pkgs+=(libopenmpi-dev)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
command -v tc >/dev/null 2>&1 || need_pkgs+=(iproute2)
command -v g++ >/dev/null 2>&1 || need_pkgs+=(g++)
command -v cmake >/dev/null 2>&1 || need_pkgs+=(cmake)
command -v make >/dev/null 2>&1 || need_pkgs+=(make)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing Debian packages (${need_pkgs[*]}) and not root to install them"
    log "installing Debian packages: ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# --- 2. virtual environment ------------------------------------------------------------------
if [ ! -x "$PY" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
fi
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and not torch.version.cuda else 1)" 2>/dev/null; then
    # Take the CPU build that lies on disk when there is one; never let pip resolve a CUDA build.
    local_whl="$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n1 || true)"
    log "installing torch $TORCH_VERSION (CPU) ${local_whl:+from $local_whl}"
    pip_install "${local_whl:-torch==${TORCH_VERSION}}"
    "$PY" -c "import torch, sys; sys.exit(1 if torch.version.cuda else 0)" \
        || die "a CUDA build of torch was installed; the CPU build torch==${TORCH_VERSION}+cpu is required"
fi
# Pin torch in every later install so no resolver step can swap it for a CUDA build.
TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__)')"
deps=(numpy mpi4py click pytest matplotlib scikit-learn cloudpickle psutil pyyaml packaging setuptools wheel
      sphinx myst-parser sphinx-click)
if ! "$PY" -c "import numpy, mpi4py, click, pytest, matplotlib, sklearn, cloudpickle, psutil, yaml, packaging, setuptools, wheel, sphinx, myst_parser, sphinx_click" 2>/dev/null; then
    log "installing Python dependencies"
    pip_install "$TORCH_PIN" "${deps[@]}"
fi
if ! "$PY" -c "import torch, triton, sys; sys.exit(0 if triton.__version__ == '$TRITON_VERSION' else 1)" 2>/dev/null; then
    log "installing triton $TRITON_VERSION (the CUDA kernels; tested here under its interpreter)"
    pip_install "$TORCH_PIN" "triton==$TRITON_VERSION"
    "$PY" -c "import torch, triton" || die "triton $TRITON_VERSION does not import beside $TORCH_PIN"
fi

# --- 3. Horovod ------------------------------------------------------------------------------
horovod_ok() {  # one --check-build (it is slow to start), three ticks looked for in its output
    local report
    report="$("$VENV/bin/horovodrun" --check-build 2>/dev/null)" || return 1
    grep -Eq '\[X\] PyTorch' <<<"$report" && grep -Eq '\[X\] MPI' <<<"$report" &&
        grep -Eq '\[X\] Gloo' <<<"$report"
}
if ! "$PY" -c "import horovod; assert horovod.__version__ == '$HOROVOD_VERSION'" 2>/dev/null || ! horovod_ok; then
    torch_tag="$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')"
    wheel_dir="$CACHE/wheels/torch-$torch_tag"
    mkdir -p "$wheel_dir"
    whl="$(ls "$wheel_dir"/horovod-${HOROVOD_VERSION}-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$whl" ]; then
        log "building Horovod $HOROVOD_VERSION from source (about 5 minutes on 2 cores)"
        build="$(mktemp -d)"
        trap 'rm -rf "$build"' EXIT
        "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
            "horovod==$HOROVOD_VERSION" -d "$build"
        tar -xzf "$build"/horovod-${HOROVOD_VERSION}.tar.gz -C "$build"
        src="$build/horovod-$HOROVOD_VERSION"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
            || die "could not switch horovod/torch/CMakeLists.txt to C++17"
        (
            cd "$src"
            export CMAKE_POLICY_VERSION_MINIMUM=3.5
            export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
            export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
            export MAKEFLAGS="-j$(nproc)"
            "$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-cache-dir \
                --no-deps . -w "$wheel_dir"
        ) || die "Horovod build failed (see the compiler output above)"
        whl="$(ls "$wheel_dir"/horovod-${HOROVOD_VERSION}-*.whl | head -n1)"
    else
        log "using cached Horovod wheel $whl"
    fi
    pip_install --no-deps --force-reinstall "$whl"
    horovod_ok || {
        "$VENV/bin/horovodrun" --check-build || true
        die "Horovod is installed but not with PyTorch, MPI and Gloo all enabled (see --check-build above)"
    }
fi
log "Horovod $HOROVOD_VERSION OK: PyTorch, MPI and Gloo enabled"

# --- 4. the project ---------------------------------------------------------------------------
# Reinstall only when the native kernel sources changed since the last build.
stamp="$VENV/.hvd_onebit-installed"
src_hash="$(cat "$ROOT/setup.py" "$ROOT/setup.cfg" "$ROOT"/hvd_onebit/kernels/csrc/* 2>/dev/null | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$src_hash" ] || ! "$PY" -c "import torch, hvd_onebit._C" 2>/dev/null; then
    log "installing hvd_onebit (editable) and compiling its native kernels"
    (cd "$ROOT" && pip_install --no-build-isolation --no-deps -e .)
    "$PY" -c "import torch, hvd_onebit._C" || die "the native kernels (hvd_onebit._C) did not build"
    echo "$src_hash" > "$stamp"
fi
log "ready: $VENV"
