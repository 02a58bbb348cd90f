"""Compile the attention kernels for a GPU that is not here: sm_90 (H100 / H200), offline.

`triton.compile` with `GPUTarget("cuda", 90, 32)` needs no GPU and no driver: triton 3.9 ships
ptxas in its wheel (triton/backends/nvidia/bin). The launches compiled are the ones the
dispatcher plans (`packed_attention.plan_kernel`) on `meta` tensors at pi05 shapes, with the
argument specialisation triton's launcher would apply (16-aligned pointers and 16-divisible
ints get a divisibility hint, ints equal to 1 become constants), so a change of configuration
in the dispatcher is a change of what this compiles. ptxas is then run once more with `-v` on
the PTX for registers and spills (the compiled kernel reports registers only once loaded on a
device).

Run it in a process where TRITON_INTERPRET is not set (under the interpreter `triton.jit`
returns functions that cannot be compiled):

    python -m embodied_kv.kernels.offline_compile [--json FILE]

Result (triton 3.9.0, its ptxas, sm_90; registers per thread, shared memory per program;
asserted spill-free by test/kernels/test_offline_compile.py):

    kernel          configuration (bf16, D=256, group 8)  warps stages regs spills smem     mma
    splitk_partial  block_n=64, 16 splits (T <= 1024)         4      2  168      0  76 KiB  mma.sync
    splitk_partial  block_n=64, 32 splits (T > 1024)          4      2  168      0  76 KiB  mma.sync
    splitk_reduce   16 splits                                 4      1   34      0   2 KiB  -
    splitk_reduce   32 splits                                 4      1   43      0   2 KiB  -
    prefill_tile    block_m=8 (64 rows), block_n=16           4      2  247      0  64 KiB  wgmma
    rms_norm        W=2048 plain (backbone)                   8      1   27      0   0 KiB  -
    rms_norm        W=1024 adaptive (expert)                  4      1   32      0   0 KiB  -
    rope            H=8 (queries) / H=1 (keys)                4      1 44/14     0   0 KiB  -
    expert_attention block_m=8 (64 rows), block_n=16, 32 splits 4   2  221      0  64 KiB  wgmma
    expert_attention_rope  the same, rotating q and the suffix k  4   2  254      0  64 KiB  wgmma
    expert_reduce   32 splits                                 4      1   43      0   2 KiB  -
    gelu_gate       F=16384 / F=4096, 1024 per program        4      1   31      0   0 KiB  -
    attn_stats      block_m=16, block_n=64 (VL-Cache)         4      2   88      0  40 KiB  mma.sync

The split-K tile has 16 rows (8 heads padded), below wgmma's 64: decode is memory-bound and
the tile reads each K/V row once for all heads. Alternatives measured for the prefill tile
are in prefill_tile.tile_config.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from embodied_kv.kernels import (
    expert_layer_step,
    flow_io,
    gated_rms_norm,
    gemm_residual,
    l2_prefetch,
    norm_gate_up,
    norm_qkv_rope,
    rope_store,
)
from embodied_kv.kernels.add_layer_norm import plan_add_layer_norm
from embodied_kv.kernels.attn_stats import BLOCK_M as STATS_BLOCK_M
from embodied_kv.kernels.attn_stats import plan_attn_stats
from embodied_kv.kernels.expert_attention import plan_expert_attention
from embodied_kv.kernels.gelu_gate import plan_gelu_gate
from embodied_kv.kernels.packed_attention import plan_kernel
from embodied_kv.kernels.prefill_tile import plan_tile
from embodied_kv.kernels.rms_norm import plan_rms_norm
from embodied_kv.kernels.rope import plan_rope
from embodied_kv.kernels.triton_base import INTERPRETED, Launch, triton

SM90 = 90
# pi0.5 backbone attention (docs/checkpoints.md): 8 query heads, 1 KV head, head_dim 256, bf16.
PI05_HEADS = (8, 1, 256)
# Arena rows per slot that select each split-K configuration (NUM_SPLITS = 16 up to 1024 rows,
# 32 beyond; a pi05 prefix of 2-3 cameras is 700-970 rows plus the decode budget).
PI05_MAX_LENS = (1024, 2048)
STEP_TOKENS = 16  # padded step size planned with (steps are ROW_BUCKET multiples)

_TORCH_TO_TRITON = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
}


@dataclass(frozen=True)
class CompileReport:
    name: str  # the Launch's name: kernel and configuration
    arch: int  # e.g. 90 for sm_90
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared_bytes: int  # dynamic shared memory per program
    wgmma: bool  # Hopper warpgroup MMA in the PTX (else mma.sync or no tensor-core dot)
    prefetch: bool = False  # an L2 prefetch instruction in the PTX (kernels/l2_prefetch.py)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def _signature(launch: Launch) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, specialised like triton's launcher."""
    names = [n for n in launch.kernel.arg_names if n not in launch.constexprs]
    if len(names) != len(launch.args):
        raise ValueError(f"{launch.name}: {len(launch.args)} args for parameters {names}")
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for i, (name, value) in enumerate(zip(names, launch.args, strict=True)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[value.dtype]
            aligned = value.data_ptr() % 16 == 0  # meta tensors: 0; CUDA allocations: 256
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{launch.name}: unsupported argument {name}={value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
            aligned = False
        elif value == 1:
            constexprs[name] = 1
            continue
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    # ASTSource wants the arguments in the kernel's order; attrs index that order.
    order = launch.kernel.arg_names
    signature = {n: signature[n] for n in order}
    attrs = {(order.index(names[i[0]]),): a for i, a in attrs.items()}
    return signature, constexprs, attrs


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        # The flags triton's own cubin step uses (backends/nvidia/compiler.py make_cubin).
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}",
               src, "-o", os.path.join(tmp, "kernel.o")]  # fmt: skip
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas output:\n{log}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_launch(launch: Launch, arch: int = SM90) -> CompileReport:
    """Compile one planned launch for `arch` without a GPU and report its resource use."""
    if triton is None or INTERPRETED:
        raise RuntimeError(
            "offline compilation needs triton without TRITON_INTERPRET (run it in its own "
            "process: python -m embodied_kv.kernels.offline_compile)"
        )
    from triton.backends.compiler import GPUTarget

    signature, constexprs, attrs = _signature(launch)
    src = triton.compiler.ASTSource(
        fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
    )
    regs, spill_st, spill_ld = _ptxas_usage(kernel.asm["ptx"], arch)
    return CompileReport(
        launch.name, arch, launch.num_warps, launch.num_stages, regs, spill_st, spill_ld,
        kernel.metadata.shared, "wgmma" in kernel.asm["ptx"],
        any(op in kernel.asm["ptx"] for op in ("prefetch.global.L2", "bulk.prefetch.L2")),
    )  # fmt: skip


def pi05_launches(n_tok: int = STEP_TOKENS) -> list[Launch]:
    """Every distinct launch the dispatchers plan for pi05 steps (meta tensors): attention
    and the fused RMSNorm, RoPE and GELU-gate kernels."""
    hq, hkv, d = PI05_HEADS
    launches: dict[str, Launch] = {}
    for max_len in PI05_MAX_LENS:
        meta = {"dtype": torch.bfloat16, "device": "meta"}
        q = torch.empty(n_tok, hq, d, **meta)
        k = torch.empty(2, max_len, hkv, d, **meta)  # [S, T, Hkv, D]: a layer of the arena
        idx = torch.empty(n_tok, dtype=torch.int64, device="meta")
        for decode in (True, False):
            for launch in plan_kernel(q, k, k, idx, idx, d**-0.5, torch.empty_like(q), decode):
                launches.setdefault(launch.name, launch)
        # the tile unsplit over keys too (bench latency's graphs_prev)
        for launch in plan_tile(q, k, k, idx, idx, d**-0.5, torch.empty_like(q), 1):
            launches.setdefault(launch.name, launch)
    # the fused RMSNorms: the backbone's (W 2048, plain) and the expert's (W 1024, adaptive)
    for width, adaptive in ((2048, False), (1024, True)):
        x = torch.empty(n_tok, width, dtype=torch.bfloat16, device="meta")
        w = torch.empty(width, device="meta")
        norm = plan_rms_norm(x, w, 1e-6, torch.empty_like(x), w if adaptive else None, True)
        launches.setdefault(norm.name, norm)
    # the action expert's attention: 50 suffix tokens over a 1024-row bucket of a slot
    q = torch.empty(50, hq, d, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1024, hkv, d, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(1024 + 50, device="meta")
    # unrotated q and suffix k with the suffix's RoPE tables (the chain) and rotated ones
    tables = (torch.empty(50, 1, d, device="meta"),) * 2
    # and the persistent queue (the default) beside the two launches (bench latency's prev)
    for rope in (tables, None):
        for reduce in ("queue", "launch"):
            for att in plan_expert_attention(q, kv, kv, q[:, :hkv], q[:, :hkv], d**-0.5, bias,
                                             q, None, reduce, rope):  # fmt: skip
                launches.setdefault(att.name, att)
    # VL-Cache's statistics: the prompt text's rows (here 64) over a 3-camera prefix (1024 rows)
    q = torch.empty(64, hq, d, dtype=torch.bfloat16, device="meta")
    blocks = -(-64 // STATS_BLOCK_M)
    colsum = torch.empty(blocks, hq, 1024, device="meta")
    below = torch.empty(blocks, hq, dtype=torch.int32, device="meta")
    stats = plan_attn_stats(q, kv, d**-0.5, 0.01, colsum, below)
    launches.setdefault(stats.name, stats)
    # the gated MLP activation of the backbone (16384) and of the expert (4096)
    for feat in (16_384, 4096):
        x = torch.empty(n_tok, feat, dtype=torch.bfloat16, device="meta")
        gg = plan_gelu_gate(x, x, torch.empty_like(x))
        launches.setdefault(gg.name, gg)
    # RoPE of the query heads and of the KV head
    table = torch.empty(n_tok, 1, d, device="meta")
    for heads in (hq, hkv):
        x = torch.empty(n_tok, heads, d, dtype=torch.bfloat16, device="meta")
        rot = plan_rope(x, table, table, torch.empty_like(x))
        launches.setdefault(rot.name, rot)
    # the vision tower's residual add + LayerNorm (SigLIP width 1152, 3 cameras of 256)
    x = torch.empty(3 * 256, 1152, dtype=torch.bfloat16, device="meta")
    w = torch.empty(1152, dtype=torch.bfloat16, device="meta")
    aln = plan_add_layer_norm(x, x, w, w, 1e-6, torch.empty_like(x), torch.empty_like(x))
    launches.setdefault(aln.name, aln)
    # the expert's fused layer-step (model/expert_step.py): norm -> q/k/v + RoPE,
    # norm -> gate/up + GELU-gate, and the two GEMMs with the gated residual
    fused = norm_qkv_rope.pi05_launches() + norm_gate_up.pi05_launches()
    # and the chain's (CUDA's default): addcmul + the post-attention norm in one kernel
    chain = gated_rms_norm.pi05_launches() + flow_io.pi05_launches()  # and the flow's head
    chain += rope_store.pi05_launches()  # the backbone's RoPE + K/V store
    fused += expert_layer_step.pi05_launches()  # the five as one persistent launch
    chain += l2_prefetch.pi05_launches()  # the weights' prefetch into L2 (both GPU modes)
    for launch in fused + gemm_residual.pi05_launches() + chain:
        launches.setdefault(launch.name, launch)
    return list(launches.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=SM90)
    parser.add_argument("--json", help="write the reports here")
    args = parser.parse_args(argv)
    reports = [compile_launch(launch, args.arch) for launch in pi05_launches()]
    print(f"{'kernel configuration':64} warps stages  regs  spill st/ld  smem     wgmma")
    for r in reports:
        print(
            f"{r.name:64} {r.num_warps:5} {r.num_stages:6} {r.registers:5} "
            f"{r.spill_stores:5}/{r.spill_loads:<5} {r.shared_bytes // 1024:3} KiB  {r.wgmma}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=1)
    return 1 if any(r.spills for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
