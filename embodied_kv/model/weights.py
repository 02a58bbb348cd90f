"""Deterministic random init and the package's own safetensors layout.

Own layout: the VLA's state_dict keys, plus metadata `format` (version),
`config` (the ModelConfig as JSON) so a file is never loaded into another shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from embodied_kv.model.layers import AdaRMSNorm, RMSNorm

FORMAT = "embodied_kv.weights/1"
INIT_STD = 0.02  # embeddings and adaptive-norm modulation, as HF initialises Gemma


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter from a generator seeded with `seed` on the model's device.

    Projections get std fan_in**-0.5 (not HF's 0.02): with 0.02 a random Gemma with a
    tied head only echoes its input token, and greedy text would not depend on the
    context. Adaptive norms start as plain pre-norm residuals (gate bias 1), so the
    action expert depends on the prefix from the first step."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    ada_dense = {id(m.dense) for m in model.modules() if isinstance(m, AdaRMSNorm)}
    vision_pos = {
        id(m.position_embedding) for m in model.modules() if hasattr(m, "position_embedding")
    }
    for m in model.modules():
        if isinstance(m, AdaRMSNorm):
            m.dense.weight.normal_(0.0, INIT_STD, generator=g)
            m.dense.bias.zero_()
            m.dense.bias[2 * m.dense.out_features // 3 :] = 1.0
        elif isinstance(m, (nn.Linear, nn.Conv2d)) and id(m) not in ada_dense:
            fan_in = m.weight[0].numel()
            m.weight.normal_(0.0, fan_in**-0.5, generator=g)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding) and id(m) in vision_pos:
            # SigLIP `_init_weights`: position embeddings std 1/sqrt(width). At 0.02 they
            # are ~25x weaker than the patch features: the tower sees a bag of patches and
            # learns where things are only slowly (a world model trained so answered every
            # scene question with one word after 2,000 steps)
            m.weight.normal_(0.0, m.embedding_dim**-0.5, generator=g)
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, INIT_STD, generator=g)
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif isinstance(m, RMSNorm):
            m.weight.zero_()


def config_json(cfg) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def _same_config(saved: str | None, cfg, may_differ: tuple[str, ...]) -> bool:
    """The file's config (JSON) equals `cfg` but in the fields `may_differ`."""
    if saved is None:
        return False
    theirs, ours = json.loads(saved), json.loads(config_json(cfg))
    for k in may_differ:
        theirs.pop(k, None)
        ours.pop(k, None)
    return theirs == ours


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes: copies every weight to
    the host (seconds at pi05), so the engine uses `weights_identity` instead."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_identity(model: nn.Module) -> str:
    """What capsules check: the id the builder or loader recorded (`model.weights_id`),
    else the content hash (a model put together some other way)."""
    return getattr(model, "weights_id", None) or weights_digest(model)


def random_weights_id(cfg, dtype: torch.dtype, device: torch.device) -> str:
    """Random weights are a function of the config (seed included), the dtypes and the
    device type (the init generator runs on the device)."""
    key = {"random": config_json(cfg), "dtype": str(dtype), "device": torch.device(device).type}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def file_weights_id(model: nn.Module, files: list[Path], cache: Path | None = None) -> str:
    """Weights loaded from `files` into `model`: the files' sha256 (cached by path, size
    and mtime, so a restart hashes nothing), the config and the parameters' dtypes."""
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    key = {
        "files": [file_sha256(Path(f), cache) for f in files],
        "config": config_json(model.cfg),
        "dtypes": dtypes,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def digest_cache_path() -> Path:
    base = os.environ.get("EMBODIED_KV_CACHE_DIR") or Path.home() / ".cache" / "embodied_kv"
    return Path(base) / "weights_digests.json"


def file_sha256(path: Path, cache: Path | None = None) -> str:
    """sha256 of a file's bytes, remembered in `cache` (JSON) under its resolved path,
    size and mtime; the cache is rewritten atomically and never trusted past a change."""
    cache = cache or digest_cache_path()
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    known = {k: v for k, v in known.items() if _still_current(k)}
    known[key] = digest
    try:
        with atomic_path(cache) as tmp:
            Path(tmp).write_text(json.dumps(known, sort_keys=True, indent=0))
    except OSError:
        pass  # a read-only home only costs the next start another hash
    return digest


def _still_current(key: str) -> bool:
    """A cache entry whose file still exists with that size and mtime."""
    path, size, mtime = key.rsplit(":", 2)
    try:
        st = os.stat(path)
    except OSError:
        return False
    return f"{st.st_size}:{st.st_mtime_ns}" == f"{size}:{mtime}"


@contextmanager
def atomic_path(path: Path):
    """A temporary file beside `path` to write, renamed onto `path` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors written to a temporary file in the same directory, then renamed."""
    with atomic_path(path) as tmp:
        save_file({k: _owned(v) for k, v in tensors.items()}, tmp, metadata)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor owning its storage: safetensors refuses views of a shared one (the
    fused projections' parameters, model/fused.py)."""
    t = t.detach().contiguous().cpu()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def save_weights(model, path: str | Path) -> None:
    atomic_save(
        model.state_dict(), Path(path), {"format": FORMAT, "config": config_json(model.cfg)}
    )


SHAPE_FREE = ("name", "action_horizon", "seed")  # config fields that size no parameter


@torch.no_grad()
def load_weights(model, path: str | Path, may_differ: tuple[str, ...] = ()) -> None:
    """Load the own layout; ValueError naming the config mismatch or the bad tensors.
    `may_differ` (of SHAPE_FREE): config fields in which the file's model may differ from
    `model`'s (a fine-tune from another preset's weights, e.g. a longer chunk)."""
    if not set(may_differ) <= set(SHAPE_FREE):
        raise ValueError(f"may_differ={may_differ}: only fields of {SHAPE_FREE}")
    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{path}: not an embodied_kv weights file (format={meta.get('format')!r})"
            )
        if not _same_config(meta.get("config"), model.cfg, may_differ):
            raise ValueError(
                f"{path}: saved for another model config than preset {model.cfg.name!r}"
            )
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assign_state(model, tensors, str(path))
    model.weights_id = file_weights_id(model, [path])


def assign_state(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy tensors into the model's parameters; every key and shape must match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    bad = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(tensors))
        if tuple(tensors[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or bad:
        raise ValueError(
            f"{source}: cannot load — missing {missing[:20]}{'...' if len(missing) > 20 else ''}; "
            f"unexpected {unexpected[:20]}{'...' if len(unexpected) > 20 else ''}; "
            f"mis-shaped {bad[:20]}"
        )
    model.weights_id = None  # other bytes now; the caller that knows their source sets it
    for k, t in tensors.items():
        own[k].copy_(t.to(own[k].dtype))
