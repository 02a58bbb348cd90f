#!/usr/bin/env bash
# A developer's check on a CPU machine with Python 3.11 (this project's): LeRobot's
# PI05Policy, built as `bench latency --peer lerobot` builds it, loads our weights and gives
# our chunk. Runs that bench at pi0.5's widths with one layer (~10 GB of memory, ~5 min).
# Not part of `make test`; on a GPU machine (Python 3.12) none of this is needed
# (scripts/peer_wheels.sh, docs/gpu.md).
# Usage: scripts/lerobot_cpu_check.sh [JSON [more bench latency arguments]], e.g.
#   scripts/lerobot_cpu_check.sh out/c.json --peer-compile default --cameras 2
# or, the chunks alone (no timing, ~2 minutes; test/model/test_lerobot_parity.py):
#   scripts/lerobot_cpu_check.sh --agreement out/a.json
#
# A side venv (.peer_cpu_venv/, ignored) reads .venv's packages and adds:
#  * the device's wheels (DEVICE_WHEELS), huggingface_hub < 2 (transformers 5.5 refuses 2.x)
#    and what LeRobot imports that .venv lacks (torchvision for torch 2.13, opencv, requests,
#    httpx, cloudpickle, typing-inspect, einops);
#  * LeRobot 0.6.1's five lines of Python 3.12 syntax (PEP 695) in their 3.11 forms;
#  * PyPI's torchvision is a CUDA build whose C++ ops cannot load beside a CPU torch: its
#    fake-op registrations are skipped (LeRobot imports torchvision.io, calls no op).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=bench
if [ "${1:-}" = "--agreement" ]; then MODE=agreement; shift; fi
OUT=${1:-$ROOT/out/latency_lerobot_cpu.json}
shift || true
VENV=$ROOT/.peer_cpu_venv
WHEELS=$VENV/wheels
SP=$VENV/lib/python3.11/site-packages
if [ ! -f "$VENV/.ready" ]; then
  rm -rf "$VENV"
  python3.11 -m venv "$VENV"
  echo "$ROOT/.venv/lib/python3.11/site-packages" > "$SP/zz_embodied_kv_venv.pth"
  "$ROOT/scripts/peer_wheels.sh" "$WHEELS"
  "$ROOT/.venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" \
    huggingface_hub==1.33.0 torchvision==0.28.0 "opencv-python-headless<4.14" requests \
    urllib3 charset-normalizer httpx httpcore h11 certifi sniffio cloudpickle typing-inspect \
    mypy-extensions einops
  "$ROOT/.venv/bin/python" -m pip install --quiet --no-index --no-deps --no-compile \
    --ignore-requires-python --target "$SP" "$WHEELS"/*.whl
  sed -i -E 's/^type (\w+) = /\1 = /' "$SP/lerobot/motors/motors_bus.py" \
    "$SP/lerobot/datasets/aggregate.py"
  sed -i -E 's/^class DataProcessorPipeline\[TInput, TOutput\]\(HubMixin\):/class DataProcessorPipeline(HubMixin, __import__("typing").Generic[TInput, TOutput]):/' \
    "$SP/lerobot/processor/pipeline.py"
  sed -i -E 's/^class Backtrackable\[T\]:/T = __import__("typing").TypeVar("T")\nclass Backtrackable(__import__("typing").Generic[T]):/' \
    "$SP/lerobot/datasets/streaming_dataset.py"
  sed -i -E 's/^def deserialize_json_into_object\[T: JsonLike\]\(/T = __import__("typing").TypeVar("T")\ndef deserialize_json_into_object(/' \
    "$SP/lerobot/utils/io_utils.py"
  sed -i -E 's/^@torch.library.register_fake\("torchvision::(\w+)"\)/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' \
    "$SP/torchvision/_meta_registrations.py"
  "$VENV/bin/python" -m compileall -q "$SP/lerobot" >/dev/null
  touch "$VENV/.ready"
fi
mkdir -p "$(dirname "$OUT")"
cd "$ROOT"
# the peer must import here, or the bench would run ours alone
PYTHONPATH=$ROOT "$VENV/bin/python" -c "from lerobot.policies.pi05.modeling_pi05 import PI05Policy"
if [ "$MODE" = agreement ]; then
  exec env PYTHONPATH="$ROOT" OMP_NUM_THREADS=2 "$VENV/bin/python" -m embodied_kv.bench.lerobot_peer \
    --layers 1 --json "$OUT"
fi
PYTHONPATH=$ROOT OMP_NUM_THREADS=2 "$VENV/bin/python" -m embodied_kv.cli bench latency \
  --preset pi05 --layers 1 --allow-cpu-pi05 --threads 2 --repeats 3 --peer lerobot --json "$OUT" \
  "$@"
