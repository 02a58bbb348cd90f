#!/usr/bin/env bash
# Idempotent dev setup behind `make demo` / `make test`:
#   1. system tools: python3.11 (+ venv, headers), cmake >= 3.21, gcc/g++
#   2. .venv with the pinned requirements.lock (torch first: CPU or CUDA build)
#   3. the msg/srv interfaces, built with cmake into build/ and installed into
#      .venv (generated embodied_kv/msg, embodied_kv/srv land in its
#      site-packages; the Python sources stay in the repo, on PYTHONPATH)
# Steps 2 and 3 are skipped when their inputs are unchanged (content hashes).
#
# Environment: PYTHON (default python3.11), EMBODIED_KV_TORCH=cpu|cuda (default:
# cuda when `nvidia-smi -L` lists a GPU), EMBODIED_KV_TORCH_INDEX (index of the
# CUDA build, default https://pypi.org/simple).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
BUILD="$ROOT/build"
PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=2.13.0
CMAKE_MIN=3.21  # IMPORTED_TARGETS, used by the wheel workaround in CMakeLists.txt
CPU_INDEX=https://download.pytorch.org/whl/cpu

say() { echo "setup: $*"; }
die() { echo "setup: $*" >&2; exit 1; }

# --- 1. system tools: stop at the first missing one, with what to install ---
command -v "$PYTHON" >/dev/null \
  || die "$PYTHON not found; install it: sudo apt-get install python3.11 python3.11-venv python3.11-dev"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$PYTHON is not Python 3.11; install it: sudo apt-get install python3.11 python3.11-venv python3.11-dev"
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null \
  || die "$PYTHON cannot create venvs; install it: sudo apt-get install python3.11-venv"
"$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || die "Python 3.11 headers (Python.h) missing; install them: sudo apt-get install python3.11-dev"
command -v cmake >/dev/null || die "cmake not found; install it: sudo apt-get install cmake"
cmake_version=$(cmake --version | head -n1 | awk '{print $3}')
[ "$(printf '%s\n%s\n' "$CMAKE_MIN" "$cmake_version" | sort -V | head -n1)" = "$CMAKE_MIN" ] \
  || die "cmake $cmake_version is older than $CMAKE_MIN; install a newer one: sudo apt-get install cmake (or pip install cmake)"
command -v gcc >/dev/null || die "gcc not found; install it: sudo apt-get install build-essential"
command -v g++ >/dev/null || die "g++ not found; install it: sudo apt-get install build-essential"

hash_of() { cat "$@" | sha256sum | cut -c1-16; }

# --- 2. venv + pinned dependencies ---
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  say "creating $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

flavour=${EMBODIED_KV_TORCH:-}
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi
deps_key="$(hash_of "$ROOT/requirements.lock" "$ROOT/requirements-nodeps.lock")-$flavour"
if [ "$(cat "$VENV/.embodied_kv-deps" 2>/dev/null)" != "$deps_key" ]; then
  start=$SECONDS
  if [ "$flavour" = cuda ]; then
    say "installing torch $TORCH_VERSION (CUDA build)"
    # Bypass pip config and find-links here: a local +cpu wheel would outrank
    # the PyPI CUDA build of the same version.
    env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${PIP[@]}" install -q \
      --index-url "${EMBODIED_KV_TORCH_INDEX:-https://pypi.org/simple}" \
      -c "$ROOT/requirements.lock" "torch==$TORCH_VERSION"
    "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' \
      || say "warning: a GPU is present but the installed torch has no CUDA"
  else
    # A local wheel (pip's find-links) first; then PyTorch's CPU index. Never the
    # PyPI build, which pulls several GB of CUDA libraries.
    say "installing torch $TORCH_VERSION (CPU build)"
    if ! "${PIP[@]}" install -q -c "$ROOT/requirements.lock" "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
      say "no local CPU wheel; fetching it from $CPU_INDEX"
      "${PIP[@]}" install -q --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple \
        -c "$ROOT/requirements.lock" "torch==$TORCH_VERSION+cpu"
    fi
  fi
  say "installing requirements.lock"
  "${PIP[@]}" install -q -r "$ROOT/requirements.lock"
  # openpi-client's numpy<2 pin cannot resolve beside numpy 2 (requirements-nodeps.lock)
  "${PIP[@]}" install -q --no-deps -r "$ROOT/requirements-nodeps.lock"
  echo "$deps_key" > "$VENV/.embodied_kv-deps"
  say "dependencies installed in $((SECONDS - start)) s"
fi

# --- 3. interfaces (msg/, srv/, action/) into the venv prefix ---
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
iface_key="$(hash_of "$ROOT"/msg/*.msg "$ROOT"/srv/*.srv "$ROOT"/action/*.action "$ROOT/CMakeLists.txt" "$ROOT/package.xml")-$deps_key"
if [ "$(cat "$BUILD/.embodied_kv-interfaces" 2>/dev/null)" != "$iface_key" ] \
   || [ ! -f "$site/embodied_kv/msg/__init__.py" ]; then
  say "building msg/srv interfaces"
  start=$SECONDS
  rm -rf "$BUILD" "$site/embodied_kv"  # only generated code lives in the venv's embodied_kv
  mkdir -p "$BUILD"
  log="$BUILD/cmake.log"
  export VIRTUAL_ENV="$VENV" AMENT_PREFIX_PATH="$VENV" PATH="$VENV/bin:$PATH"
  if ! { cmake -S "$ROOT" -B "$BUILD" \
           -DCMAKE_INSTALL_PREFIX="$VENV" -DCMAKE_PREFIX_PATH="$VENV" \
           -DPython3_EXECUTABLE="$VENV/bin/python" \
           -DEMBODIED_KV_INSTALL_PYTHON=OFF -DBUILD_TESTING=OFF \
         && cmake --build "$BUILD" -j "$(nproc)" \
         && cmake --install "$BUILD"; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "interface build failed; full log: $log"
  fi
  "$VENV/bin/python" -c 'import embodied_kv.msg, embodied_kv.srv, embodied_kv.action' \
    || die "interfaces built but embodied_kv.msg/.srv/.action do not import from $VENV"
  echo "$iface_key" > "$BUILD/.embodied_kv-interfaces"
  say "interfaces built in $((SECONDS - start)) s"
fi
