"""bench/kernel_sweep.py on the CPU: its dry run (every kernel's candidate through the Triton
interpreter against the fp32 reference), and its GPU grid holds the tiles the kernels use
today, so a GPU run always times the product's configuration beside the others."""

import json

import pytest
import torch

from embodied_kv.bench import kernel_sweep
from embodied_kv.kernels import expert_attention, gemm_residual, norm_gate_up, norm_qkv_rope
from embodied_kv.kernels.triton_base import INTERPRETED, triton

pytestmark = pytest.mark.skipif(
    triton is None or not INTERPRETED, reason="the dry sweep runs the kernels interpreted"
)


def test_dry_sweep_checks_every_kernel_against_fp32(tmp_path):
    out = tmp_path / "sweep.json"
    assert kernel_sweep.main(["--dry", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["kernels"]) == {
        "expert_attention", "norm_qkv_rope", "norm_gate_up", "gated_residual_o",
        "gated_residual_down", "chain_gated_rms_norm", "chain_rope_qk", "chain_rope_attention",
        "expert_attention_3cam", "layer_step",
    }  # fmt: skip
    for name, row in result["kernels"].items():
        assert row["candidates"], name
        for cand in row["candidates"]:  # torch's SDPA too, beside the attention kernel
            assert "error" not in cand and cand["ok"] and cand["err"] < 1e-5, (name, cand)


def labels(candidates) -> list[str]:
    return [label for label, _ in candidates]


def test_the_grid_holds_the_committed_tiles():
    s = kernel_sweep.PI05
    cfg = gemm_residual.gemm_config(s["n"], s["w"], s["f"], torch.bfloat16)
    want = {
        "norm_qkv_rope": f"block_k={norm_qkv_rope.QKV_BLOCK_K} "
                         f"block_h={norm_qkv_rope.QKV_BLOCK_H} warps=4 stages=3",
        "norm_gate_up": f"block_k={norm_gate_up.GATE_BLOCK_K} "
                        f"block_n={norm_gate_up.GATE_BLOCK_N} warps=4 stages=3",
        "gated_residual_down": f"block_n={cfg.block_n} block_k={cfg.block_k} "
                               f"split_k={cfg.split_k} warps=4 stages=3",
        "expert_attention": f"blocks_per_split={expert_attention.BLOCKS_PER_SPLIT} "
                            f"reduce={expert_attention.REDUCE} block_n=16 warps=4 "
                            "stages=2",
    }  # fmt: skip
    grids = {name: labels(cands(False)) for name, *_, cands in kernel_sweep.kernels(s)}
    for name, label in want.items():
        assert label in grids[name], (name, label)


def test_patched_restores_the_module():
    before = norm_qkv_rope.QKV_BLOCK_K
    with pytest.raises(RuntimeError), kernel_sweep.patched(norm_qkv_rope, QKV_BLOCK_K=7):
        assert norm_qkv_rope.QKV_BLOCK_K == 7
        raise RuntimeError
    assert norm_qkv_rope.QKV_BLOCK_K == before
