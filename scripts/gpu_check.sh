#!/usr/bin/env bash
# `make gpu-check`: embodied_kv/gpu_check.py with an interpreter whose torch sees CUDA.
# No setup.sh, no ROS build, no pip: a GPU machine keeps its own (CUDA) torch.
# Interpreter: $PYTHON if set; else the first of .venv/bin/python, python3 whose torch
# sees CUDA; else the first that has torch at all (gpu_check.py then says what is wrong).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
probe() { "$1" -c "import sys, torch; sys.exit(not ($2))" 2>/dev/null; }
py=${PYTHON:-}
if [ -z "$py" ]; then
  candidates=()
  [ -x "$ROOT/.venv/bin/python" ] && candidates+=("$ROOT/.venv/bin/python")
  command -v python3 >/dev/null && candidates+=(python3)
  for test in "torch.cuda.is_available()" "True"; do
    for c in "${candidates[@]}"; do
      if [ -z "$py" ] && probe "$c" "$test"; then py=$c; fi
    done
  done
fi
if [ -z "$py" ]; then
  echo "gpu-check: no Python with torch found (tried .venv/bin/python, python3); set PYTHON=..." >&2
  exit 2
fi
cd "$ROOT"
# LeRobot's wheels, where a device call carried them (scripts/peer_wheels.sh) and torch sees
# CUDA (the steps that read them run on a GPU alone): installed into a folder of their own,
# read only by the peer's steps (transformers 5.5 there, the machine's own elsewhere)
if ls "$ROOT"/.peer_wheels/lerobot-*.whl >/dev/null 2>&1 && probe "$py" "torch.cuda.is_available()"; then
  site=${TMPDIR:-/tmp}/embodied_kv_peer_site
  if "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
      "$ROOT"/.peer_wheels/*.whl; then
    export EMBODIED_KV_PEER_SITE=$site
  else
    echo "gpu-check: the wheels in .peer_wheels/ did not install; LeRobot's steps are skipped" >&2
  fi
fi
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$py" -m embodied_kv.cli gpu-check "$@"
