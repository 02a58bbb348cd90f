"""gpu-check's `mechanisms` profile: every seed's mechanism at pi05 on one GPU, in one
short run (issue #38), and its dry twin that runs the same benches on the CPU.

    make gpu-check-mechanisms        # = make gpu-check GPU_CHECK_ARGS="--profile mechanisms"

Each bench runs at `--preset pi05 --device cuda` with the arguments below, sized so the
five fit 8 minutes on an H100 with a budget each (a bench past its budget is killed and
recorded as such, status 124, and the next one starts). `--dry` runs the same list at
`--preset tiny --device cpu` with the dry arguments (graphs in emulation: the same
capture and replay code path), and checks that every JSON has the fields the profile
promises, so a crash the CPU could have shown never costs GPU time.

Compiled HF baselines (`torch.compile`, bench step) are not in this profile: their
compile alone took ~100 s per batch size on the H100 (issue #38), over any bench's
budget here; each JSON's row in summary.json says so (`skipped`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Bench:
    name: str
    gpu: tuple[str, ...]  # arguments after --preset pi05 --device cuda
    dry: tuple[str, ...]  # arguments after --preset tiny --device cpu
    budget_s: float  # the GPU run's wall-clock limit (the dry run: DRY_BUDGET_S)
    fields: tuple[str, ...]  # dotted paths every result JSON must hold ("rows.0.x": a row)
    gpu_fields: tuple[str, ...] = ()  # and the GPU run's JSON besides


SKIPPED_HF = ("compiled HF baselines skipped: torch.compile costs ~100 s per batch size on "
              "an H100 (issue #38), over this profile's per-bench budget")  # fmt: skip
DRY_BUDGET_S = 120.0  # per bench on a 2-core CPU (each takes a few seconds alone)

PROFILE = (
    # OxyGen: unified / isolated / the ablations / two processes; one row (64 tokens x 4
    # in flight), 8 frames a round, 2 rounds (eager modes: ~50 s a row on an H100)
    # (dry: without the two processes, whose spawn alone took 30-50 s on the loaded 2-core
    # CI machine; test/bench/test_bench_oxygen.py runs them at tiny)
    Bench("oxygen", ("--quick", "--repeats", "2"), ("--smoke", "--no-concurrent"), 110.0,
          ("speedup", "unified.action_hz", "unified.tokens_per_s", "isolated.action_hz",
           "isolated.tokens_per_s", "exact", "host_work_per_cycle.unified.launches",
           "host_work_per_cycle.isolated.syncs"), ("rows.0.concurrent.action_hz",)),
    # ActionFlow at K = 7 and 16, one prompt length, no FAST rows
    Bench("actionflow", ("--quick", "--ks", "7,16", "--fast-caps", "", "--repeats", "2"),
          ("--smoke", "--fast-caps", ""), 80.0,
          ("fps_vs_sequential_k7", "rows.0.K", "rows.1.K", "exact",
           "rows.0.host_work_per_action.actionflow.launches")),
    # VL-Cache: the decode step at 10 % and 5 % against the full cache at batch 1, 16, 64
    # (pi05 widths and depth, random weights); no fidelity or QA (the CPU measures those)
    Bench("vlcache", ("--quick", "--speed-only", "--layers", "18", "--batches", "1,16,64",
                      "--speed-budgets", "0.1,0.05", "--repeats", "5"),
          ("--quick", "--speed-only", "--batches", "1,2,3", "--speed-budgets", "0.1,0.05",
           "--repeats", "1", "--image-size", "32", "--cameras", "2"), 70.0,
          ("speed_batches.2.rows.0.decode_speedup", "speed.rows.1.budget",
           "speed.rows.0.host_work_per_step.launches")),
    # KEEP at 40 segments against full / prefix / reuse / CacheBlend, KEEP and full
    # recomputation also from CUDA graphs; random pi05 weights (TTFT, host work)
    Bench("keep", ("--segments", "40", "--requests", "8", "--graphs", "auto"),
          ("--segments", "10", "--requests", "2", "--graphs", "emulate", "--weights", ""),
          100.0,
          ("rows.0.ttft_ms", "rows.0.speedup_vs_full", "rows.0.host_work.prefill.syncs",
           "rows.0.host_work.refresh.d2h", "verdict")),
    # capsules: restore and first token vs cold at 1k and 4k tokens
    Bench("capsule", ("--quick",), ("--smoke",), 60.0,
          ("speedup_longest", "token_exact", "rows.0.restore_ms",
           "rows.0.host_work.restore.launches")),
)
GPU_BUDGET_S = sum(b.budget_s for b in PROFILE)  # 420 s of benches; < 8 min with startup


def command(bench: Bench, python: str, out: Path, dry: bool) -> list[str]:
    preset, device, extra = ("tiny", "cpu", bench.dry) if dry else ("pi05", "cuda", bench.gpu)
    return [python, "-m", "embodied_kv.cli", "bench", bench.name, "--preset", preset,
            "--device", device, "--json", str(out / f"{bench.name}.json"), *extra]  # fmt: skip


def missing_fields(result: dict, fields: tuple[str, ...]) -> list[str]:
    """The dotted paths `fields` that `result` does not hold (a number index into a list)."""
    missing = []
    for path in fields:
        node = result
        for key in path.split("."):
            if isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            elif isinstance(node, dict) and key in node:
                node = node[key]
            else:
                missing.append(path)
                break
    return missing


def read_result(path: Path) -> tuple[object, str | None]:
    """A step's JSON -> (result, None), or (None, why it cannot be read)."""
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as e:
        return None, f"{path.name}: {type(e).__name__}: {e}"


def check(bench: Bench, out: Path, dry: bool) -> str | None:
    """None if the bench's JSON is there with every promised field, else why not."""
    path = out / f"{bench.name}.json"
    result, problem = read_result(path)
    if problem:
        return problem
    missing = missing_fields(result, bench.fields + (() if dry else bench.gpu_fields))
    return f"{path.name} lacks {', '.join(missing)}" if missing else None
