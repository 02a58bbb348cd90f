"""The arithmetic limit of one pi05 action on an H100 (bf16, batch 1, 10 Euler steps): what
the action would cost if every FLOP ran at the tensor cores' peak and every byte moved at
HBM bandwidth, with no launch, no gap and no overlap lost. `bench latency` divides its
measured action by it; `bench estimate` quotes its estimate against it.

    prefill  (compute-bound): 2 x backbone linear params x prefix rows
             + 2 x SigLIP params x 256 patches x cameras
             + the prefix's bidirectional attention, 4 x rows^2 x (8 heads x 256) per layer
    denoise  (memory-bound):  10 Euler steps, each reading the expert's weights and the
             prefix's KV (18 KiB a row: 18 layers x K and V x 1 KV head x 256 x 2 B)

At 48 text tokens (the pi0.5 prompt the published figures use) this is 5.31 / 6.61 ms for
2 / 3 cameras; a byte-level prompt (no PaliGemma tokenizer) makes the prefix longer, and
the limit of the rows a run actually prefilled is the one to divide by (docs/gpu.md).
"""

from __future__ import annotations

# H100 SXM, dense bf16 and HBM3
PEAK_FLOPS = 990e12
HBM_BYTES_PER_S = 3.35e12
# pi0.5 parameter counts (PaliGemma 2B backbone, Gemma 300M expert, SigLIP So400m/14)
BACKBONE_LINEAR_PARAMS = 1.98e9  # the 18 layers' q, k, v, o, gate, up, down
EXPERT_PARAMS = 0.43e9
SIGLIP_PARAMS = 0.41e9
PATCHES_PER_CAMERA = 256  # 224 px / 14 px patches, squared
LAYERS = 18
ATTENTION_WIDTH = 8 * 256  # query heads x head_dim
KV_BYTES_PER_ROW = LAYERS * 2 * 1 * 256 * 2  # 18 KiB
EULER_STEPS = 10
BYTES_PER_PARAM = 2  # bf16
TEXT_TOKENS = 48  # the prompt length of the published limit


def prefix_rows(cameras: int, text_tokens: int = TEXT_TOKENS) -> int:
    """Prefix rows of `cameras` images and `text_tokens` of prompt."""
    return cameras * PATCHES_PER_CAMERA + text_tokens


def limit_ms(cameras: int, rows: int) -> float:
    """The limit (ms) of one action whose prefix has `rows` rows, `cameras` of them images."""
    if cameras < 1 or rows < cameras * PATCHES_PER_CAMERA:
        raise ValueError(f"a prefix of {rows} rows cannot hold {cameras} cameras' patches")
    flops = (
        2 * BACKBONE_LINEAR_PARAMS * rows
        + 2 * SIGLIP_PARAMS * PATCHES_PER_CAMERA * cameras
        + 4 * rows * rows * ATTENTION_WIDTH * LAYERS
    )
    denoise_bytes = EULER_STEPS * (EXPERT_PARAMS * BYTES_PER_PARAM + rows * KV_BYTES_PER_ROW)
    return 1e3 * (flops / PEAK_FLOPS + denoise_bytes / HBM_BYTES_PER_S)
