"""gpu-check's `action` profile, the default of `make gpu-check`: issue #33's measurement
of the action path in one device call of at most 8 minutes, and its dry twin on the CPU.

    latency           bench latency --quick --breakdown --kernels --peer lerobot: action
                      latency at 2 and 3 cameras with the limit, the regions, the top-20
                      kernels by device time, and LeRobot's PI05Policy timed in the same
                      rounds (its chunk against ours)
    triton_kernels    every Triton kernel of the pi05 path compiled by the machine's Triton
                      for its GPU, registers and spills from ptxas -v (kernels/offline_compile)
    precision         bench precision: the bf16 chunk's error against fp32 of the same
                      weights, the product's path beside the reference chain (goal <= 1.5x)
    cuda_tests        the tests whose CUDA half only a GPU runs (graph replay = eager in
                      `cuda` mode, the fused kernels against their references)
    kernel_sweep      the expert layer-step's kernels over their tile configurations
                      beside the torch chains, 18 layers' weights from HBM (bench/kernel_sweep)
    gemm_sweep        every GEMM shape of an action as F.linear runs it beside other ways
                      (cuBLASLt, padded rows, split N or K on two streams) and the estimate's
                      fitted price (bench/gemm_sweep: the floor under issue 33's 10 ms)
    latency_lerobot_compiled
                      on request (`--only latency_lerobot_compiled`, a call of its own):
                      LeRobot's policy under torch.compile (mode PEER_COMPILE) beside ours at
                      2 cameras; its compile ran past 140 s on an H200 (2026-12-04)

Each step has a budget (killed past it, status 124, the next one starts); the default
call's budgets add up to GPU_BUDGET_S. LeRobot runs from the wheels a device call carries
(scripts/peer_wheels.sh, docs/gpu.md): steps marked `peer` get their folder on the path;
without it `latency` still runs ours (its JSON says why LeRobot did not, and the step is
reported as lacking LeRobot's fields) and the compiled step is skipped. `--dry` runs the
steps that have a dry form at --preset tiny on the CPU and checks their JSON fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from embodied_kv.bench.mechanisms import missing_fields, read_result

PEER_COMPILE = "default"  # LeRobot's own default, max-autotune, autotunes for many minutes
DRY_BUDGET_S = 240.0
# what docs/gpu_next.md asks a GPU to check first: the CUDA halves of these files
# (the slowest last: test_row_bucket's CUDA arena test was still running at 135 s on an H200)
CUDA_TESTS = (
    "test/model/test_expert_step.py", "test/kernels/test_expert_attention.py",
    "test/kernels/test_gated_rms_norm.py", "test/kernels/test_rope_store.py",
    "test/kernels/test_flow_io.py", "test/kernels/test_l2_prefetch.py",
    "test/model/test_weight_prefetch.py", "test/engine/test_rtc.py", "test/engine/test_graphs.py",
    "test/model/test_flow_constants.py",
    "test/engine/test_frame_loop.py", "test/model/test_vision_fast.py", "test/model/test_rtc.py",
    "test/model/test_camera_frames.py", "test/kernels/test_row_bucket.py",
)  # fmt: skip


@dataclass(frozen=True)
class Step:
    name: str
    gpu: tuple[str, ...]  # argv after the interpreter; "{out}" is the results folder
    dry: tuple[str, ...] | None  # the CPU dry run's argv (None: not run dry)
    budget_s: float
    fields: tuple[str, ...] = ()  # dotted paths `<name>.json` must hold (dry and GPU)
    gpu_fields: tuple[str, ...] = ()  # and the GPU run's besides
    peer: bool = False  # LeRobot's folder on the path (EMBODIED_KV_PEER_SITE)
    needs_peer: bool = False  # skipped without it
    compiles: bool = False  # compiles Triton kernels: TRITON_INTERPRET (tests set it) unset
    on_request: bool = False  # runs only when `--only` names it (a call of its own)


LATENCY = ("-m", "embodied_kv.cli", "bench", "latency")
PI05 = ("--preset", "pi05", "--device", "cuda")
FRAMES = "480x640"  # a common robot camera: camera frames -> chunk, resized on the device
TINY = ("--preset", "tiny", "--device", "cpu")
PROFILE = (
    Step("latency",
         (*LATENCY, *PI05, "--quick", "--breakdown", "--kernels", "--peer", "lerobot",
          "--frames", FRAMES, "--json", "{out}/latency.json"),
         (*LATENCY, *TINY, "--quick", "--repeats", "2", "--breakdown", "--kernels", "--peer",
          "lerobot", "--frames", FRAMES, "--json", "{out}/latency.json"),
         150.0,  # 82 s on the H200 with three engines; now six (prev, unsplit, noprefetch)
         ("rows.0.graphs_ms.median", "rows.0.breakdown_ms.denoise", "rows.0.kernels.rows.0.name",
          "peer.pinned", "rows.0.graphs_frames_ms.median"),
         ("rows.0.limit_ms", "rows.1.breakdown_ms.denoise", "rows.1.kernels.rows.0.name",
          "rows.0.lerobot_ms.median", "rows.0.lerobot_over_ours",
          "rows.0.lerobot_vs_ours.max_abs_diff"), peer=True),
    Step("triton_kernels",
         ("-m", "embodied_kv.kernels.offline_compile", "--json", "{out}/triton_kernels.json"),
         ("-m", "embodied_kv.kernels.offline_compile", "--json", "{out}/triton_kernels.json"),
         30.0, ("0.registers", "0.spill_stores"), compiles=True),
    Step("precision",
         ("-m", "embodied_kv.cli", "bench", "precision", *PI05, "--quick", "--json",
          "{out}/precision.json"),
         ("-m", "embodied_kv.cli", "bench", "precision", *TINY, "--quick", "--json",
          "{out}/precision.json"),
         40.0, ("worst_ratio", "rows.0.bf16.rms", "rows.0.bf16_ref.rms")),
    Step("kernel_sweep",
         ("-m", "embodied_kv.bench.kernel_sweep", "--budget-s", "55", "--json",
          "{out}/kernel_sweep.json"),
         ("-m", "embodied_kv.bench.kernel_sweep", "--dry", "--json", "{out}/kernel_sweep.json"),
         80.0, ("kernels.expert_attention.candidates.0.err", "kernels.norm_gate_up.chain_err",
                 "kernels.gated_residual_down.candidates.0.ok"),
         ("kernels.expert_attention.chain_us", "kernels.expert_attention.best.config",
          "kernels.norm_qkv_rope.best_over_chain", "kernels.gated_residual_down.best.us")),
    Step("cuda_tests", ("-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *CUDA_TESTS),
         None, 150.0),
    Step("gemm_sweep",
         ("-m", "embodied_kv.bench.gemm_sweep", "--budget-s", "20", "--json",
          "{out}/gemm_sweep.json"),
         ("-m", "embodied_kv.bench.gemm_sweep", "--dry", "--json", "{out}/gemm_sweep.json"),
         30.0, ("rows.0.candidates.linear.err", "rows.15.candidates.split_n2.ok",
                "totals.prefill.estimate_ms"),
         ("rows.0.candidates.linear.us", "totals.prefill.linear_ms", "totals.expert.best_ms")),
    Step("latency_lerobot_compiled",
         (*LATENCY, *PI05, "--quick", "--cameras", "2", "--repeats", "5", "--peer", "lerobot",
          "--peer-compile", PEER_COMPILE, "--json", "{out}/latency_lerobot_compiled.json"),
         None, 420.0, (), ("rows.0.lerobot_compiled_ms.median", "peer.compiled_first_call_s"),
         peer=True, needs_peer=True, on_request=True),
)  # fmt: skip
# the default call's steps: 480 s (the 2026-12-04 H200 call took 82 / 16 / 27 s for latency,
# triton_kernels and precision; cuda_tests did not finish in 90 s)
GPU_BUDGET_S = sum(s.budget_s for s in PROFILE if not s.on_request)


def command(step: Step, python: str, out: Path, dry: bool) -> list[str] | None:
    """The step's argv (None: no dry form)."""
    argv = step.dry if dry else step.gpu
    if argv is None:
        return None
    return [python, *(a.replace("{out}", str(out)) for a in argv)]


def check(step: Step, out: Path, dry: bool) -> str | None:
    """None if the step's JSON (if it writes one) holds every promised field, else why not;
    a LeRobot that did not run is named with its reason."""
    fields = step.fields + (() if dry else step.gpu_fields)
    if not fields:
        return None
    path = out / f"{step.name}.json"
    result, problem = read_result(path)
    if problem:
        return problem
    missing = missing_fields(result, fields)
    off = result.get("kernels_off") if isinstance(result, dict) else None
    if off:  # ran, but some fused ops on their torch references: not the product's speed
        missing.append(f"kernels_off ({', '.join(f'{k}: {v}' for k, v in off.items())})")
    if not missing:
        return None
    why = ((result.get("peer") or {}).get("unavailable") if isinstance(result, dict) else None)
    return f"{path.name} lacks {', '.join(missing)}" + (f" (LeRobot: {why})" if why else "")
