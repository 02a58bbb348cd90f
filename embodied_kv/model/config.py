"""Model presets: frozen dataclasses looked up by name.

`pi05` carries the real dimensions of pi0.5 (openpi `pi05` / LeRobot `PI05Config`);
`tiny` keeps the same structure, small enough that a 2-core CPU runs the robot loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP So400m/14 in pi0.5 (PaliGemma's vision tower, no pooling head)."""

    image_size: int = 224  # pixels, square
    patch_size: int = 14  # 224/14 -> 256 tokens per camera
    width: int = 1152  # hidden_size
    layers: int = 27  # num_hidden_layers
    mlp: int = 4304  # intermediate_size
    heads: int = 16  # num_attention_heads

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} not a multiple of patch {self.patch_size}"
            )
        if self.width % self.heads:
            raise ValueError(f"vision width {self.width} not divisible by heads {self.heads}")

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma transformer; the backbone and the action expert share depth and heads."""

    width: int  # hidden_size
    layers: int  # num_hidden_layers
    mlp: int  # intermediate_size (gated GELU-tanh)
    heads: int = 8  # num_attention_heads
    kv_heads: int = 1  # num_key_value_heads (MQA)
    head_dim: int = 256
    rms_eps: float = 1e-6
    rope_theta: float = 10_000.0

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} not a multiple of kv_heads={self.kv_heads}")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vision: VisionConfig
    backbone: GemmaConfig  # PaliGemma's Gemma 2B
    expert: GemmaConfig  # Gemma 300M action expert
    vocab_size: int  # 257_152 (PaliGemma); tied LM head
    num_cameras: int = 3  # openpi: base_0_rgb, left_wrist_0_rgb, right_wrist_0_rgb
    action_horizon: int = 50  # openpi: action_horizon
    action_dim: int = 32  # openpi: action_dim (padded)
    state_dim: int = 32  # state dims discretised into the prompt (padded)
    state_bins: int = 256  # openpi: np.digitize over linspace(-1, 1, 257)
    max_text_tokens: int = 200  # openpi: max_token_len for pi05
    denoise_steps: int = 10  # Euler steps from t=1 to t=0
    time_min_period: float = 4e-3  # openpi: sinusoidal time embedding
    time_max_period: float = 4.0
    tokenizer: str = "gemma"  # "bytes" (no download), "gemma" (SentencePiece from a path) or
    # "words" (model/word_tokenizer.py: the world's closed vocabulary, tokenizer.json from a path)
    seed: int = 0  # random init

    def __post_init__(self):
        b, e = self.backbone, self.expert
        if (b.layers, b.heads, b.kv_heads, b.head_dim) != (
            e.layers,
            e.heads,
            e.kv_heads,
            e.head_dim,
        ):
            raise ValueError(
                "backbone and expert share attention in every layer: layers, heads, kv_heads, "
                "head_dim "
                f"must match, got {(b.layers, b.heads, b.kv_heads, b.head_dim)} vs "
                f"{(e.layers, e.heads, e.kv_heads, e.head_dim)}"
            )
        if min(self.num_cameras, self.action_horizon, self.action_dim, self.denoise_steps) < 1:
            raise ValueError(f"cameras, horizon, action_dim and denoise_steps must be >= 1: {self}")

    @property
    def prefix_tokens_max(self) -> int:
        return self.num_cameras * self.vision.tokens + self.max_text_tokens


PRESETS: dict[str, ModelConfig] = {
    "pi05": ModelConfig(
        name="pi05",
        vision=VisionConfig(),
        backbone=GemmaConfig(width=2048, layers=18, mlp=16_384),
        expert=GemmaConfig(width=1024, layers=18, mlp=4096),
        vocab_size=257_152,
    ),
    "tiny": ModelConfig(
        name="tiny",
        vision=VisionConfig(image_size=32, patch_size=8, width=64, layers=2, mlp=128, heads=4),
        backbone=GemmaConfig(width=128, layers=4, mlp=384, heads=4, kv_heads=1, head_dim=32),
        expert=GemmaConfig(width=64, layers=4, mlp=192, heads=4, kv_heads=1, head_dim=32),
        vocab_size=264,  # 256 bytes + BOS/EOS/PAD, rounded up
        num_cameras=2,
        action_horizon=10,
        action_dim=8,
        state_dim=8,
        max_text_tokens=96,
        tokenizer="bytes",
    ),
}
# `world`: `tiny` trained on the numpy tabletop world (embodied_kv/world/, train/): the
# world's word tokenizer, 64-pixel cameras (8x8 patches of 8 px, 128 image tokens for two
# cameras: shapes 8 px wide tell a ball from a block, and VL-Cache has a visual prefix to
# compress) and room for the 256 `bins` action ids above the text ids (V 640: words < 384).
# Attention as multi-head (4 KV heads, not tiny's one) with RoPE base 1e6: with one 32-wide
# KV head a layer reads at most 32 dims from the image and fact rows, and at base 1e4 only
# 10 of those 32 dims turn slowly enough to match content 100-200 rows back (1e6: 18); the
# 45-minute runs with tiny's attention never lifted scene answers off the prior (docs/world.md,
# "Attention of the `world` preset").
_WORLD_ATTENTION = {"kv_heads": 4, "rope_theta": 1e6}
PRESETS["world"] = replace(
    PRESETS["tiny"],
    name="world",
    vision=replace(PRESETS["tiny"].vision, image_size=64),
    backbone=replace(PRESETS["tiny"].backbone, **_WORLD_ATTENTION),
    expert=replace(PRESETS["tiny"].expert, **_WORLD_ATTENTION),
    vocab_size=640,
    tokenizer="words",
)

# `world_smooth`: the `world` model whose expert learns the world's waypoint labels
# (world/expert.py: each action the arm's position one step on, within the physics' reach,
# as a real robot's joint-position targets) over a 30-action chunk: action trajectories
# without the far targets' flips, the chunks real-time chunking joins (docs/rtc.md). Same
# parameters as `world` (the horizon sizes no weight): fine-tuned from its weights.
PRESETS["world_smooth"] = replace(PRESETS["world"], name="world_smooth", action_horizon=30)


def get_preset(
    name: str, layers: int | None = None, vision_layers: int | None = None, **overrides
) -> ModelConfig:
    """A preset by name; `layers` (backbone and expert) and `vision_layers` change only
    the depth, every width stays (CI runs the pi05 widths at 2 layers on a CPU)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    cfg = replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
    for what, n in (("layers", layers), ("vision_layers", vision_layers)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{what}={n!r} must be a positive integer")
    if layers is not None:
        cfg = replace(
            cfg,
            backbone=replace(cfg.backbone, layers=layers),
            expert=replace(cfg.expert, layers=layers),
        )
    if vision_layers is not None:
        cfg = replace(cfg, vision=replace(cfg.vision, layers=vision_layers))
    return cfg
