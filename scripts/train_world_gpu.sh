#!/usr/bin/env bash
# One GPU window, one command: fine-tune the shipped `world` model with issue 34's recipe
# (scripts/world_task.flags; docs/world_training.md), then `eval world` it (flow actions,
# then the `ar` bins action tokens). Everything it makes lands in $RESULTS: the run
# (weights.safetensors, tokenizer.json, train_log.jsonl, train_state.safetensors),
# train.txt, eval_flow.{json,txt}, eval_ar.{json,txt}, summary.txt.
#
#   RESULTS=$OUT scripts/train_world_gpu.sh          # a device machine: ~8 min train + eval
#
# Settings (environment): MINUTES (training wall clock; the learning-rate schedule follows
# it; default 8), DEVICE (cuda), WORKERS (--data-workers, 12), SEED (data seed, 4), INIT
# (weights to start from; default the shipped embodied_kv/data/world/weights.safetensors),
# EVAL_ARGS (default --episodes 50 --sanity 10), PYTHON (default .venv/bin/python, else
# python3). Nothing is installed; a run without CUDA stops at once unless DEVICE=cpu
# (test/train/test_gpu_script.py runs it that way, tiny, to check the plumbing).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-8}
WORKERS=${WORKERS:-12}
SEED=${SEED:-4}
INIT=${INIT:-embodied_kv/data/world/weights.safetensors}
EVAL_ARGS=${EVAL_ARGS:---episodes 50 --sanity 10}
RESULTS=${RESULTS:-out/world_gpu}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ] && ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "train_world_gpu: no CUDA device visible to $py's torch; DEVICE=cpu for a dry run" >&2
  exit 2
fi
mkdir -p "$RESULTS"
run="$RESULTS/run"
# shellcheck disable=SC2046  # the flags file is one line of flags, split on purpose
"$py" -m embodied_kv.cli train --out "$run" --overwrite --init "$INIT" --seed "$SEED" \
  --device "$DEVICE" --data-workers "$WORKERS" --threads 4 --minutes "$MINUTES" \
  --ckpt-every 500 $(cat scripts/world_task.flags) > "$RESULTS/train.txt" 2>&1 \
  || { tail -n 20 "$RESULTS/train.txt" >&2; exit 1; }
tail -n 2 "$RESULTS/train.txt"
status=0
for mode in flow ar; do
  # shellcheck disable=SC2086  # EVAL_ARGS is a list of flags
  "$py" -m embodied_kv.cli eval world --weights "$run/weights.safetensors" \
    --action-mode "$mode" $EVAL_ARGS --json "$RESULTS/eval_$mode.json" \
    > "$RESULTS/eval_$mode.txt" 2>&1 || status=1
  cat "$RESULTS/eval_$mode.txt"
done
{
  echo "train_world_gpu: device $DEVICE, $MINUTES min, init $INIT, seed $SEED"
  tail -n 1 "$run/train_log.jsonl"
  grep -h "trained\|first-action" "$RESULTS"/eval_*.txt || true
} | tee "$RESULTS/summary.txt"
exit $status
