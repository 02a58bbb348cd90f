"""A training run's state beside its weights, so that a run cut into several calls (a
GPU lent for minutes at a time) ends with the same weights as one uninterrupted run.

`train_state.safetensors` is the whole run in one atomically written file: the model's
weights (a copy of what weights.safetensors ships, so a kill between the two writes
cannot strand a run), AdamW's moments and step counts, the training-only patch head,
the noise generator's state, and in its metadata the step, the run's elapsed seconds
and the config that must not change across calls. safetensors only: loading runs no
code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from embodied_kv.model.weights import assign_state, atomic_save

STATE_FILE = "train_state.safetensors"
STATE_FORMAT = "embodied_kv.train_state.v1"
# fields a resumed call may change: where and how fast it runs, and when this call stops
# (`steps` and `minutes` stay: they set the learning-rate schedule)
PER_CALL = ("out", "until", "stop_after", "resume", "overwrite", "data_workers", "device",
            "threads", "log_every", "ckpt_every")  # fmt: skip


class ResumeError(ValueError):
    """The saved run cannot be continued with this config (nothing was changed)."""


@dataclasses.dataclass
class RunState:
    step: int  # optimiser steps taken
    elapsed: float  # seconds of training behind us, over every call


def run_fingerprint(cfg) -> str:
    """The config that decides the run's weights (JSON, sorted)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_CALL}
    return json.dumps(fields, sort_keys=True, default=str)


# options moved into a section since a run may have been saved: at the value that changes
# nothing (their default) they resume from there; another value is "gone from the code"
# (prefix_max moved to the data, which now draws d per sample: other draws than before)
MOVED = {"prefix_max": ("data", 0)}


def config_changes(saved: str, cfg) -> list[str]:
    """Where `cfg` differs from the saved fingerprint. A field the saved run did not
    know (added to the code since) counts as unchanged at its default, so a run
    resumes across versions that only add options."""
    old = json.loads(saved)
    new = json.loads(run_fingerprint(cfg))
    for key, (section, same) in MOVED.items():
        if old.get(key) == same and key not in new and isinstance(old.get(section), dict):
            old[section].setdefault(key, old.pop(key))
    return _diff(old, new, cfg, "")


def _diff(old: dict, new: dict, obj, prefix: str) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    out = []
    for k, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(k), dict):
            out += _diff(old[k], value, getattr(obj, k), f"{prefix}{k}.")
        elif k in old and old[k] != value:
            out.append(f"{prefix}{k}: saved {old[k]!r}, now {value!r}")
        elif k not in old and value != json.loads(json.dumps(defaults[k], default=str)):
            out.append(f"{prefix}{k}: new option, {value!r} is not its default")
    out += [f"{prefix}{k}: saved {old[k]!r}, gone from the code" for k in old if k not in new]
    return out


def save_state(
    out: Path, model: torch.nn.Module, cfg, opt: torch.optim.Optimizer,
    head: torch.nn.Module | None, gen: torch.Generator, state: RunState,
    ground: torch.nn.Module | None = None,
) -> Path:
    tensors = {"generator": gen.get_state()}
    tensors |= {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            tensors[f"opt.{i}.{name}"] = torch.as_tensor(value)
    if head is not None:
        tensors |= {f"head.{k}": v for k, v in head.state_dict().items()}
    if ground is not None:
        tensors |= {f"ground.{k}": v for k, v in ground.state_dict().items()}
    meta = {"format": STATE_FORMAT, "step": str(state.step), "elapsed": repr(state.elapsed),
            "config": run_fingerprint(cfg)}  # fmt: skip
    path = out / STATE_FILE
    atomic_save(tensors, path, meta)
    return path


@torch.no_grad()
def load_state(
    out: Path, model: torch.nn.Module, cfg, opt: torch.optim.Optimizer,
    head: torch.nn.Module | None, gen: torch.Generator, ground: torch.nn.Module | None = None,
) -> RunState:
    """Restore model, opt, head, gen (and the grounding head) in place from
    out/train_state.safetensors; ResumeError naming what does not match (then nothing
    was changed)."""
    path = check_resumable(out)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors' own error types: a cut or foreign file
        raise ResumeError(f"{path}: unreadable ({e})") from e
    if meta.get("format") != STATE_FORMAT:
        raise ResumeError(f"{path}: not a training state (format={meta.get('format')!r})")
    changes = config_changes(meta.get("config", "{}"), cfg)
    if changes:
        raise ResumeError(f"{path}: written by a run with another config; resume with the "
                          f"same flags ({'; '.join(changes)})")  # fmt: skip
    opt_state = _optimizer_state(opt, tensors, path)
    head_state = _head_state(tensors, "head.", head, path, "patch head")
    ground_state = _head_state(tensors, "ground.", ground, path, "grounding head")
    weights = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    try:  # checks every key and shape before it copies: the first change to the run
        assign_state(model, weights, str(path))
    except ValueError as e:
        raise ResumeError(f"{path}: its weights do not fit this run's model ({e})") from e
    opt.load_state_dict(opt_state)
    if head is not None:
        head.load_state_dict(head_state)
    if ground is not None:
        ground.load_state_dict(ground_state)
    gen.set_state(tensors["generator"])
    return RunState(int(meta["step"]), float(meta["elapsed"]))


def _head_state(tensors: dict, prefix: str, head, path: Path, what: str) -> dict:
    """The saved tensors of a training-only head, checked against `head` (None: unused)."""
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if head is not None:
        want = head.state_dict()
        if set(state) != set(want) or any(state[k].shape != want[k].shape for k in want):
            raise ResumeError(f"{path}: its {what} does not fit this run's")
    return state


def check_resumable(out: Path) -> Path:
    """The state file of the run in `out`; ResumeError when there is none to resume."""
    path = out / STATE_FILE
    if not path.is_file():
        raise ResumeError(f"nothing to resume in {out}: {STATE_FILE} does not exist")
    return path


def check_fresh(out: Path) -> None:
    """ResumeError when `out` holds a saved run (a fresh run would replace it)."""
    path = out / STATE_FILE
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                step = (f.metadata() or {}).get("step", "?")
        except Exception:  # an unreadable state is still somebody's run
            step = "?"
        raise ResumeError(f"{out} holds a saved run (step {step}): --resume continues it, "
                          "--overwrite starts a new one there")  # fmt: skip


def _optimizer_state(opt: torch.optim.Optimizer, tensors: dict, path: Path) -> dict:
    """The optimiser's state_dict from the file's `opt.<i>.<name>` tensors, checked
    against the parameters' shapes."""
    current = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = value
    if sorted(state) != list(range(len(params))):
        raise ResumeError(f"{path}: optimiser state for {len(state)} tensors, the run has "
                         f"{len(params)}")  # fmt: skip
    for i, p in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq"):
            if name not in state[i] or state[i][name].shape != p.shape:
                raise ResumeError(f"{path}: optimiser {name} of tensor {i} does not fit "
                                 f"shape {tuple(p.shape)}")  # fmt: skip
    return {"state": state, "param_groups": current["param_groups"]}
