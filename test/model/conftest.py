import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from embodied_kv.model.checkpoint import save_in_lerobot_layout
from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model


@pytest.fixture(scope="session")
def tiny_model():
    return build_model(get_preset("tiny"))


class AllocationCounter(TorchDispatchMode):
    """Bytes of every new tensor storage created on a real device, by dtype.

    Counted at the dispatcher: an op's output whose storage is none of its inputs' is
    an allocation (views and in-place ops are not). Meta tensors cost nothing."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter[torch.dtype] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {ptr for ptr in _storage_ptrs((args, kwargs))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in known:
                    known.add(ptr)
                    self.bytes[t.dtype] += t.untyped_storage().nbytes()
        return out


def _storage_ptrs(tree):
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            yield t.untyped_storage().data_ptr()


@pytest.fixture
def count_allocations():
    return AllocationCounter


# -- checkpoint directories in the two public layouts, written as the references write them --

P05_PRE_STEPS = (  # LeRobot processor_pi05.make_pi05_pre_post_processors, input_steps in order
    "rename_observations_processor",
    "to_batch_processor",
    "relative_actions_processor",
    "normalizer_processor",
    "pi05_prepare_state_tokenizer_processor_step",
    "tokenizer_processor",
    "device_processor",
)


def make_stats(dim: int, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Per-dimension statistics as a dataset would have them (q01 < q10 < q90 < q99)."""
    rng = np.random.default_rng(seed)
    mean = rng.uniform(-1, 1, dim) * scale
    std = rng.uniform(0.1, 0.5, dim) * scale
    return {
        "mean": mean, "std": std, "min": mean - 3 * std, "max": mean + 3 * std,
        "q01": mean - 2.3 * std, "q10": mean - 1.3 * std, "q50": mean,
        "q90": mean + 1.3 * std, "q99": mean + 2.3 * std, "count": np.array([1000.0]),
    }  # fmt: skip


def write_lerobot_policy(
    folder: Path,
    model,
    state: dict[str, np.ndarray],
    action: dict[str, np.ndarray],
    modes: tuple[str, str] = ("QUANTILES", "QUANTILES"),
    relative: dict | None = None,
    eps: float = 1e-8,
) -> Path:
    """A LeRobot `save_pretrained` policy dir: model.safetensors, config.json and the
    processor pipelines with their normalizer state files (processor/pipeline.py
    `_save_pretrained`: `<name>_step_<i>_<registry_name>.safetensors`, flat keys
    `<feature>.<stat>` from `_NormalizationMixin.state_dict`)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_in_lerobot_layout(model, folder / "model.safetensors")
    s_dim, a_dim = len(state["mean"]), len(action["mean"])
    image = {"type": "VISUAL", "shape": [3, 224, 224]}
    inputs = {"observation.images.base_0_rgb": image,
              "observation.state": {"type": "STATE", "shape": [s_dim]}}  # fmt: skip
    outputs = {"action": {"type": "ACTION", "shape": [a_dim]}}
    norm_map = {"VISUAL": "IDENTITY", "STATE": modes[0], "ACTION": modes[1]}
    (folder / "config.json").write_text(json.dumps({
        "type": "pi05", "input_features": inputs, "output_features": outputs,
        "normalization_mapping": norm_map, "max_state_dim": 32, "max_action_dim": 32,
    }))  # fmt: skip
    stats = {f"observation.state.{k}": v for k, v in state.items()}
    stats |= {f"action.{k}": v for k, v in action.items()}
    image_stats = {"mean": np.full((3, 1, 1), 0.5), "std": np.full((3, 1, 1), 0.25)}
    stats |= {f"observation.images.base_0_rgb.{k}": v for k, v in image_stats.items()}
    tensors = {k: torch.tensor(np.asarray(v), dtype=torch.float32) for k, v in stats.items()}
    pre_steps = []
    for i, name in enumerate(P05_PRE_STEPS):
        step: dict = {"registry_name": name, "config": {}}
        if name == "normalizer_processor":
            step["config"] = {"eps": eps, "features": inputs | outputs, "norm_map": norm_map}
            step["state_file"] = f"policy_preprocessor_step_{i}_normalizer_processor.safetensors"
            save_file(tensors, folder / step["state_file"])
        if name == "relative_actions_processor":
            step["config"] = relative or {"enabled": False, "exclude_joints": [],
                                          "action_names": None}  # fmt: skip
        pre_steps.append(step)
    post_file = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    save_file(tensors, folder / post_file)
    post_steps = [
        {"registry_name": "unnormalizer_processor", "state_file": post_file,
         "config": {"eps": eps, "features": outputs, "norm_map": norm_map}},
        {"registry_name": "absolute_actions_processor", "config": {"enabled": bool(relative)}},
        {"registry_name": "device_processor", "config": {"device": "cpu"}},
    ]  # fmt: skip
    for name, steps in (("policy_preprocessor", pre_steps), ("policy_postprocessor", post_steps)):
        (folder / f"{name}.json").write_text(json.dumps({"name": name, "steps": steps}, indent=2))
    return folder


def write_openpi_checkpoint(
    folder: Path, model, stats: dict[str, dict[str, np.ndarray]], asset_id: str = "trossen"
) -> Path:
    """An openpi checkpoint converted to PyTorch: model.safetensors (keys without the
    `model.` prefix) and assets/<asset_id>/norm_stats.json (openpi's
    openpi/shared/normalize.py `save`)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_in_lerobot_layout(model, folder / "model.safetensors", prefix=False)
    assets = folder / "assets" / asset_id
    assets.mkdir(parents=True)
    body = {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in stats.items()}
    (assets / "norm_stats.json").write_text(json.dumps({"norm_stats": body}, indent=2))
    return folder


@pytest.fixture
def checkpoint_writers():
    """The writers above (test modules cannot import conftest under importlib mode)."""
    return write_lerobot_policy, write_openpi_checkpoint, make_stats
