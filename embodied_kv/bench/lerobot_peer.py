"""LeRobot's `PI05Policy` beside this engine, in one process (`bench latency --peer lerobot`).

What most pi0.5 users run today: LeRobot's port of openpi, the pinned release (PINNED),
`predict_action_chunk` eager or under `torch.compile` (its `compile_model` option, with the
mode it is given). The peer is built at the model's dims, loaded with the same weights
(`checkpoint.lerobot_state_dict`, LeRobot's names), and fed the same prefix: the same camera
images (ours in [-1, 1]; LeRobot takes [0, 1] and maps back) and the same prompt ids, padded
to `tokenizer_max_length` with an attention mask as LeRobot's processor pads them. It draws
its own noise; `chunk` takes ours, so that its chunk can be compared with ours.

LeRobot 0.6.1 needs Python >= 3.12 and transformers 5.4-5.5: it is not a dependency of this
package. `scripts/peer_wheels.sh` downloads the wheels a GPU machine lacks into
`.peer_wheels/`; `scripts/gpu_check.sh` installs them into a folder of their own that only
the steps running LeRobot read (docs/gpu.md). At a reduced depth (`--layers`, a CPU check
of the code path) LeRobot's Gemma and SigLIP depths are replaced while its model is built
(`_depths`); at pi0.5's depths nothing of LeRobot's is touched.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import time

import torch

from embodied_kv.kernels.packed_attention import KEY_BLOCK
from embodied_kv.model.checkpoint import lerobot_state_dict
from embodied_kv.model.config import PRESETS, ModelConfig

PINNED = "0.6.1"
# what `PI05Policy` imports that a GPU machine's image lacks (docs/gpu.md): LeRobot 0.6.1
# requires transformers 5.4-5.5 (its PaliGemma keys have `vision_model`), which requires
# tokenizers <= 0.23.0; the rest it imports at `lerobot.policies` (read with Python 3.12)
DEVICE_WHEELS = (
    "lerobot==0.6.1",  # = PINNED
    "transformers==5.5.4",
    "tokenizers==0.22.2",
    "draccus==0.11.6",
    "mergedeep==1.3.4",
    "toml==0.10.2",
    "gymnasium==1.2.2",
    "farama-notifications==0.0.4",
    "termcolor==3.2.0",
)
# LeRobot's gemma_2b / gemma_300m (modeling_pi05.get_gemma_config) and PaliGemma's SigLIP
FULL_DEPTH = (18, 18, 27)
CAMERA_KEY = "observation.images.camera{}"


def why_not(cfg: ModelConfig) -> str | None:
    """None when the peer can run for `cfg` here, else the reason (shown in the result)."""
    ref = PRESETS["pi05"]
    widths = lambda c: (c.vision.width, c.backbone.width, c.expert.width, c.vocab_size)  # noqa: E731
    if widths(cfg) != widths(ref):
        return f"the LeRobot peer has pi0.5's widths (--preset pi05), not {cfg.name}'s"
    try:
        version = importlib.metadata.version("lerobot")
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or SyntaxError on Python < 3.12
        return (f"LeRobot {PINNED} is not importable here ({type(e).__name__}: {e}); it needs "
                "Python >= 3.12 and its wheels: scripts/peer_wheels.sh, docs/gpu.md")  # fmt: skip
    if version != PINNED:
        return f"LeRobot {version} is installed; the peer is pinned to {PINNED}"
    return None


@contextlib.contextmanager
def _depths(modeling, cfg: ModelConfig):
    """LeRobot's model built at `cfg`'s depths (a reduced-depth check on a CPU); at pi0.5's
    depths, nothing is replaced."""
    depths = (cfg.backbone.layers, cfg.expert.layers, cfg.vision.layers)
    if depths == FULL_DEPTH:
        yield
        return
    get_gemma, mapping = modeling.get_gemma_config, modeling.CONFIG_MAPPING

    def gemma(variant: str):
        g = get_gemma(variant)
        g.depth = cfg.backbone.layers if variant == "gemma_2b" else cfg.expert.layers
        return g

    def paligemma(**kw):
        c = mapping["paligemma"](**kw)
        c.vision_config.num_hidden_layers = cfg.vision.layers
        return c

    modeling.get_gemma_config = gemma
    modeling.CONFIG_MAPPING = {"paligemma": paligemma, "gemma": mapping["gemma"]}
    try:
        yield
    finally:
        modeling.get_gemma_config, modeling.CONFIG_MAPPING = get_gemma, mapping


class LeRobotPeer:
    """One `PI05Policy` with `model`'s weights, on `model`'s device, reading `cams` cameras
    (`set_cameras` changes that: the weights do not depend on it)."""

    def __init__(self, model, cams: int, compile_mode: str | None = None):
        from lerobot.configs.types import FeatureType, PolicyFeature
        from lerobot.policies.pi05 import modeling_pi05
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        c = self.cfg = model.cfg
        self.model, self.cams, self.compile_mode = model, cams, compile_mode
        s = c.vision.image_size
        self._camera = PolicyFeature(type=FeatureType.VISUAL, shape=(3, s, s))
        self._state = PolicyFeature(type=FeatureType.STATE, shape=(c.state_dim,))
        action = PolicyFeature(type=FeatureType.ACTION, shape=(c.action_dim,))
        config = PI05Config(
            dtype="bfloat16" if model.dtype == torch.bfloat16 else "float32",
            chunk_size=c.action_horizon, n_action_steps=c.action_horizon,
            max_state_dim=c.state_dim, max_action_dim=c.action_dim,
            num_inference_steps=c.denoise_steps, image_resolution=(s, s),
            tokenizer_max_length=c.max_text_tokens, min_period=c.time_min_period,
            max_period=c.time_max_period, compile_model=compile_mode is not None,
            compile_mode=compile_mode or "max-autotune", device=str(model.device),
            input_features=self._inputs(cams), output_features={"action": action},
        )  # fmt: skip
        ours = torch.get_float32_matmul_precision()
        self.built_on = "device"
        try:  # on the device: seconds; LeRobot's own way, on the host then moved, the fallback
            with _depths(modeling_pi05, c), torch.device(model.device):
                self.policy = modeling_pi05.PI05Policy(config)
        except Exception as e:  # noqa: BLE001 - an init that needs host tensors
            self.built_on = f"host (on the device: {type(e).__name__}: {e})"
            with _depths(modeling_pi05, c):
                self.policy = modeling_pi05.PI05Policy(config)
        # LeRobot's compile_model sets torch.set_float32_matmul_precision("high") for the
        # process (TF32 on a GPU; bf16 GEMMs in inductor's code on a CPU with AMX): kept for
        # its own calls only (`_precision`), ours restored
        self.matmul_precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(ours)
        weights = lerobot_state_dict(model)
        missing, unexpected = self.policy.load_state_dict(weights, strict=False)
        # LeRobot's expert keeps an LM head no action reads; PaliGemma's is tied to the embedding
        untouched = [k for k in missing if not k.endswith("lm_head.weight")]
        if untouched or unexpected:
            raise RuntimeError(f"LeRobot's PI05Policy left {untouched[:5]} unloaded and did not "
                               f"take {list(unexpected)[:5]}")  # fmt: skip
        self.policy.eval()
        self.device = model.device
        self.set_cameras(cams)

    def _inputs(self, cams: int) -> dict:
        keys = [CAMERA_KEY.format(i) for i in range(cams)]
        return {**dict.fromkeys(keys, self._camera), "observation.state": self._state}

    def set_cameras(self, cams: int) -> None:
        """Read `cams` cameras from now on (LeRobot reads its config's image features at
        every call; a user with that many cameras configures exactly these)."""
        self.policy.config.input_features = self._inputs(cams)
        self.cams = cams
        self.keys = list(self.policy.config.image_features)

    def batch(self, obs) -> dict[str, torch.Tensor]:
        """LeRobot's batch for `obs`: images [1, 3, s, s] in [0, 1] on the host (the policy
        moves them, as our cycle does); the prompt padded to tokenizer_max_length on the
        device, as LeRobot's processor leaves it."""
        from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

        mask = obs.camera_mask or (True,) * self.cfg.num_cameras
        present = [i for i, m in enumerate(mask) if m]
        if len(present) != self.cams:
            raise ValueError(f"the peer reads {self.cams} cameras, got {len(present)}")
        pairs = zip(self.keys, present, strict=True)
        out = {k: ((obs.images[i].float() + 1) / 2)[None] for k, i in pairs}
        ids = self.model.prompt_tokens(obs).ids  # the ids our prefix embeds
        n, pad = len(ids), self.policy.config.tokenizer_max_length
        tokens = torch.zeros(1, pad, dtype=torch.long)
        tokens[0, :n] = torch.tensor(ids, dtype=torch.long)
        attention = torch.zeros(1, pad, dtype=torch.bool)
        attention[0, :n] = True
        out[OBS_LANGUAGE_TOKENS] = tokens.to(self.device)
        out[OBS_LANGUAGE_ATTENTION_MASK] = attention.to(self.device)
        return out

    def prefix_rows(self) -> int:
        """Rows LeRobot's prefill computes: every camera's image tokens and the padded prompt."""
        return self.cams * self.cfg.vision.tokens + self.policy.config.tokenizer_max_length

    @contextlib.contextmanager
    def _precision(self):
        """LeRobot's float32 matmul precision while it runs, the caller's afterwards."""
        ours = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.matmul_precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(ours)

    @torch.no_grad()
    def act_ms(self, batch: dict[str, torch.Tensor]) -> float:
        """One `predict_action_chunk`, wall clock (device synchronized before and after)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        with self._precision():
            chunk = self.policy.predict_action_chunk(batch)
        if cuda:
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - t) * 1e3
        if chunk.shape[1:] != (self.cfg.action_horizon, self.cfg.action_dim):
            raise RuntimeError(f"LeRobot returned a chunk of shape {tuple(chunk.shape)}")
        return ms

    @torch.no_grad()
    def chunk(self, batch: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """LeRobot's chunk [H, A] (fp32) from our noise [H, A]."""
        from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

        images, image_masks = self.policy._preprocess_images(batch)  # noqa: SLF001
        tokens, masks = batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK]
        noise = noise.to(self.device, torch.float32)[None]
        with self._precision():
            out = self.policy.model.sample_actions(images, image_masks, tokens, masks, noise=noise)
        return out[0].float()


@torch.no_grad()
def our_chunk(model, obs, noise: torch.Tensor) -> torch.Tensor:
    """Our chunk [H, A] for `obs` and `noise`, eager (no graphs): one prefill, the Euler loop."""
    graphs, model.graphs = model.graphs, None
    try:
        prefix = model.embed_prefix(obs)
        n = prefix.embeds.shape[0]
        arena = model.new_arena(1, -(-(n + model.cfg.action_horizon) // KEY_BLOCK) * KEY_BLOCK)
        slot = arena.allocate()
        model.prefill(arena, slot, prefix)
        return model.sample_actions(arena, slot, n, noise).float()
    finally:
        model.graphs = graphs


def agreement(peer: LeRobotPeer, obs, seed: int = 7) -> dict:
    """LeRobot's chunk against ours for the same observation and noise: max |difference| and
    the rms of our chunk (what the difference is small against)."""
    noise = peer.model.make_noise(seed)
    ours = our_chunk(peer.model, obs, noise)
    theirs = peer.chunk(peer.batch(obs), noise).to(ours.device)
    return {
        "max_abs_diff": float((ours - theirs).abs().max()),
        "chunk_rms": float(ours.pow(2).mean().sqrt()),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m embodied_kv.bench.lerobot_peer [--layers N] [--json PATH]`: LeRobot's chunk
    against ours at pi0.5's widths on this machine's CPU, 2 and 3 cameras (fp32), without
    timing anything (scripts/lerobot_cpu_check.sh --agreement; test_lerobot_parity.py)."""
    import argparse
    import json
    import sys

    from embodied_kv.bench.latency import observation
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.vla import build_model

    p = argparse.ArgumentParser(prog="python -m embodied_kv.bench.lerobot_peer")
    p.add_argument("--layers", type=int, default=1, help="backbone, expert and SigLIP depth")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    cfg = get_preset("pi05", args.layers, args.layers)
    why = why_not(cfg)
    if why is not None:
        print(f"lerobot_peer: {why}", file=sys.stderr)
        return 2
    model = build_model(cfg, "cpu", torch.float32)
    peer = LeRobotPeer(model, 2)
    rows = []
    for cams in (2, 3):
        peer.set_cameras(cams)
        row = {"cameras": cams, **agreement(peer, observation(cfg, cams, 9))}
        rows.append(row)
        print(f"{cams} cameras: LeRobot's chunk vs ours: max |diff| {row['max_abs_diff']:.3g} "
              f"(our chunk's rms {row['chunk_rms']:.3g})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pinned": PINNED, "layers": args.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
