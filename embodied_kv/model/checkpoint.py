"""The public pi0.5 checkpoint layout (LeRobot `model.safetensors`, openpi-converted files).

Key map, with P = `paligemma_with_expert` (LeRobot prefixes every key with `model.`;
openpi-converted files do not):

    ours                          theirs
    vision.tower.*                P.paligemma.model.vision_tower.vision_model.*
    vision.projector.*            P.paligemma.model.multi_modal_projector.linear.*
    backbone.embed_tokens.weight  P.paligemma.model.language_model.embed_tokens.weight
                                  (or the tied P.paligemma.lm_head.weight)
    backbone.layers.{i}.*         P.paligemma.model.language_model.layers.{i}.*
    backbone.norm.weight          P.paligemma.model.language_model.norm.weight
    expert.layers.{i}.*           P.gemma_expert.model.layers.{i}.*   (adaptive norms: .dense.*)
    expert.norm.dense.*           P.gemma_expert.model.norm.dense.*
    expert.action_in_proj.*       action_in_proj.*     (also action_out_proj)
    expert.time_mlp_in.*          time_mlp_in.*        (older files: action_time_mlp_in.*)

PaliGemma paths written by transformers < 4.52 (`paligemma.language_model.model.*`,
`paligemma.vision_tower.*`, ...) are read too (LEGACY_PALIGEMMA).

Tensors that pi0 / pi0.5 files carry but this model does not use are reported as
ignored (IGNORED), anything else unknown is an error. Only safetensors are read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from embodied_kv.model.config import ModelConfig
from embodied_kv.model.weights import atomic_save, file_weights_id

P = "paligemma_with_expert"
LEROBOT_PREFIX = "model."  # LeRobot's PI05Policy keeps the network under `self.model`
TIED_HEAD = f"{P}.paligemma.lm_head.weight"
EMBED = "backbone.embed_tokens.weight"  # read from TIED_HEAD when the file has only that
OLD_NAMES = {"action_time_mlp_in.": "time_mlp_in.", "action_time_mlp_out.": "time_mlp_out."}
# PaliGemma's module paths before transformers 4.52 (older pi0 / pi0.5 conversions).
LEGACY_PALIGEMMA = {
    f"{P}.paligemma.language_model.model.": f"{P}.paligemma.model.language_model.",
    f"{P}.paligemma.language_model.lm_head.": f"{P}.paligemma.lm_head.",
    f"{P}.paligemma.vision_tower.": f"{P}.paligemma.model.vision_tower.",
    f"{P}.paligemma.multi_modal_projector.": f"{P}.paligemma.model.multi_modal_projector.",
}
RENAMES = {**OLD_NAMES, **LEGACY_PALIGEMMA}

# (our prefix, their prefix), first match wins.
PREFIXES = (
    ("vision.tower.", f"{P}.paligemma.model.vision_tower.vision_model."),
    ("vision.projector.", f"{P}.paligemma.model.multi_modal_projector.linear."),
    ("backbone.", f"{P}.paligemma.model.language_model."),
    ("expert.layers.", f"{P}.gemma_expert.model.layers."),
    ("expert.norm.", f"{P}.gemma_expert.model.norm."),
    ("expert.", ""),
)

# Present in public files, unused here (names after the `model.` prefix is stripped).
IGNORED = tuple(
    re.compile(p)
    for p in (
        rf"{P}\.gemma_expert\.lm_head\.",  # the expert's LM head (LeRobot keeps it)
        rf"{P}\.gemma_expert\.model\.embed_tokens\.",  # the expert has no token input
        rf"{P}\.gemma_expert\.model\.(layers\.\d+\.\w+_layernorm|norm)\.weight$",  # pi0 norms
        rf"{P}\.paligemma\.model\.vision_tower\.vision_model\.head\.",  # SigLIP pooling head
        r"\.position_ids$",  # buffers saved by old transformers
        r"^state_proj\.",  # pi0's continuous state input (pi0.5 puts state in the text)
    )
)


@dataclass(frozen=True)
class LoadReport:
    source: str
    loaded: int  # tensors copied into the model
    ignored: tuple[str, ...]  # keys of the file that this model does not use (as in the file)
    aliases: tuple[str, ...]  # "stored key -> our key" read under another name (tied, old)


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a VLA with this config and its shape, without allocating."""
    from embodied_kv.model.backbone import GemmaBackbone
    from embodied_kv.model.expert import ActionExpert
    from embodied_kv.model.vision import VisionEncoder

    with torch.device("meta"):
        parts = {
            "vision": VisionEncoder(cfg.vision, cfg.backbone.width),
            "backbone": GemmaBackbone(cfg.backbone, cfg.vocab_size, 1),
            "expert": ActionExpert(cfg, 1),
        }
    return {
        f"{name}.{k}": tuple(t.shape)
        for name, m in parts.items()
        for k, t in m.state_dict().items()
    }


def their_key(ours: str) -> str:
    """Our key -> the LeRobot key without the `model.` prefix."""
    for mine, theirs in PREFIXES:
        if ours.startswith(mine):
            return theirs + ours[len(mine) :]
    raise ValueError(f"no LeRobot name for parameter {ours!r}")


def lerobot_key_map(cfg: ModelConfig) -> dict[str, str]:
    """{our key: LeRobot key (with the `model.` prefix)} for every parameter."""
    return {k: LEROBOT_PREFIX + their_key(k) for k in our_shapes(cfg)}


def checkpoint_files(path: str | Path) -> list[Path]:
    """A .safetensors file, or a directory holding model.safetensors or sharded files."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: only .safetensors checkpoints are read (no pickle)")
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    # LeRobot's processor state files (policy_*processor_step_*.safetensors) hold statistics
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("policy_"))
    if not files and (path / "params").is_dir():
        raise ValueError(
            f"{path}: an openpi JAX checkpoint (params/, orbax) has no safetensors; convert it "
            "with openpi's examples/convert_jax_model_to_pytorch.py (model.safetensors)"
        )
    if not files:
        raise ValueError(f"{path}: no model.safetensors, index json or *.safetensors inside")
    return files


def scan(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """{normalised key: (file, key as stored, shape)} without reading tensor data.

    Normalised: `model.` prefix stripped, old time-MLP and PaliGemma paths renamed."""
    found: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for stored in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                key = normalise(stored)
                if key in found:
                    raise ValueError(
                        f"checkpoint holds {key!r} twice: {found[key][1]!r} in {found[key][0]} "
                        f"and {stored!r} in {f}"
                    )
                found[key] = (f, stored, tuple(h.get_slice(stored).get_shape()))
    return found


def normalise(stored: str) -> str:
    key = stored.removeprefix(LEROBOT_PREFIX)
    for old, new in RENAMES.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _names(keys: list[str], limit: int = 30) -> str:
    return ", ".join(keys[:limit]) + (
        f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    )


@torch.no_grad()
def load_pi05_checkpoint(model, path: str | Path) -> LoadReport:
    """Copy a pi0.5 checkpoint into `model` (any dtype -> the model's dtype and device).

    Every key and shape is checked before any tensor is read; ValueError names the
    missing, unexpected and mis-shaped tensors."""
    files = checkpoint_files(path)
    found = scan(files)
    own = model.state_dict()
    plan: dict[str, str] = {}  # our key -> normalised key in `found`
    for ours in own:
        theirs = their_key(ours)
        if theirs not in found and ours == EMBED and TIED_HEAD in found:
            theirs = TIED_HEAD
        plan[ours] = theirs
    used = set(plan.values())
    missing = [
        f"{LEROBOT_PREFIX}{t} ({o}{' or the tied ' + TIED_HEAD if t == their_key(EMBED) else ''})"
        for o, t in plan.items()
        if t not in found
    ]
    extra = sorted(k for k in found if k not in used)
    ignored = [k for k in extra if k == TIED_HEAD or any(p.search(k) for p in IGNORED)]
    unexpected = [found[k][1] for k in extra if k not in ignored]
    bad = [
        f"{found[t][1]}: file {found[t][2]} vs model {tuple(own[o].shape)}"
        for o, t in plan.items()
        if t in found and found[t][2] != tuple(own[o].shape)
    ]
    if missing or unexpected or bad:
        raise ValueError(
            f"{path}: not a pi0.5 checkpoint for preset {model.cfg.name!r}: "
            f"{len(missing)} missing [{_names(missing)}]; "
            f"{len(unexpected)} unexpected [{_names(unexpected)}]; "
            f"{len(bad)} mis-shaped [{_names(bad)}]"
        )
    aliases = [
        f"{found[t][1]} -> {o}"
        for o, t in plan.items()
        if t == TIED_HEAD or found[t][1].removeprefix(LEROBOT_PREFIX) != t
    ]
    by_file: dict[Path, list[str]] = {}
    for o, t in plan.items():
        by_file.setdefault(found[t][0], []).append(o)
    model.weights_id = None  # until every tensor is in (then: the files' identity)
    for f, ours in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for o in ours:
                own[o].copy_(h.get_tensor(found[plan[o]][1]))  # copy_ casts dtype and device
    model.weights_id = file_weights_id(model, files)
    return LoadReport(
        source=str(path),
        loaded=len(plan),
        ignored=tuple(found[k][1] for k in ignored),
        aliases=tuple(aliases),
    )


def lerobot_state_dict(
    model,
    *,
    prefix: bool = True,
    old_time_names: bool = False,
    head: str = "embed",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """`model`'s tensors under LeRobot's names (what `save_in_lerobot_layout` writes; what
    LeRobot's `PI05Policy.load_state_dict` takes with prefix=True).

    prefix: keys start with `model.` (LeRobot) or not (openpi-converted);
    old_time_names: `action_time_mlp_*`; head: the tied embedding stored as
    "embed" (embed_tokens), "lm_head" or "both"; dtype: e.g. torch.bfloat16 as
    released."""
    if head not in ("embed", "lm_head", "both"):
        raise ValueError(f"head={head!r}: use 'embed', 'lm_head' or 'both'")
    pre = LEROBOT_PREFIX if prefix else ""
    out = {}
    for ours, t in model.state_dict().items():
        theirs = their_key(ours)
        if old_time_names:
            for old, new in OLD_NAMES.items():
                if theirs.startswith(new):
                    theirs = old + theirs[len(new) :]
        t = t.detach().to(dtype) if dtype is not None else t.detach()
        if ours == EMBED:
            if head in ("lm_head", "both"):
                out[pre + TIED_HEAD] = t.clone()
            if head == "lm_head":
                continue
        out[pre + theirs] = t
    return out


def save_in_lerobot_layout(
    model,
    path: str | Path,
    *,
    prefix: bool = True,
    old_time_names: bool = False,
    head: str = "embed",
    dtype: torch.dtype | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write `model` as a LeRobot-layout safetensors file (tests; exporting a fine-tune):
    `lerobot_state_dict`'s tensors, plus `extra` (more tensors, by their full stored name)."""
    out = lerobot_state_dict(
        model, prefix=prefix, old_time_names=old_time_names, head=head, dtype=dtype
    )
    out.update(extra or {})
    atomic_save(out, Path(path), {"format": "pt"})
