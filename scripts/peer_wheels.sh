#!/usr/bin/env bash
# The wheels a GPU machine (Python 3.12, no network) lacks for `bench latency --peer lerobot`:
# LeRobot (pinned) and what it imports that the device image does not hold, into .peer_wheels/
# (ignored). A device call carries the folder (`carry: [".peer_wheels"]`) and
# scripts/gpu_check.sh installs it into a folder of its own for that one step (docs/gpu.md).
# The list is embodied_kv/bench/lerobot_peer.py DEVICE_WHEELS (`--list` prints it).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.peer_wheels}
PY=python3
[ -x "$ROOT/.venv/bin/python" ] && PY=$ROOT/.venv/bin/python
# the list without importing the package (torch): the tuple's lines in the source
mapfile -t WHEELS < <(sed -n '/^DEVICE_WHEELS = (/,/^)/p' "$ROOT/embodied_kv/bench/lerobot_peer.py" \
  | grep -o '"[^"]*==[^"]*"' | tr -d '"')
if [ "$DEST" = "--list" ]; then printf '%s\n' "${WHEELS[@]}"; exit 0; fi
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}"
echo "peer_wheels: ${#WHEELS[@]} wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
