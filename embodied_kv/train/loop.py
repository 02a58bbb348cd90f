"""`embodied-kv train`: the tiny VLA trained pi0.5-style on world samples.

Seeded end to end: sample i of step s is world sample `data_seed(seed, s, i)`, the
noise and flow times come from one generator seeded with `seed`, init from cfg.seed.
Checkpoints are the package's own safetensors layout, written atomically."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from embodied_kv.engine.loading import own_layout_config
from embodied_kv.model.config import ModelConfig
from embodied_kv.model.trained import TOKENIZER_FILE, WEIGHTS_FILE, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import SHAPE_FREE, load_weights, save_weights
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.action_bins import action_id_range, noisy_inputs
from embodied_kv.train.batch import make_batch
from embodied_kv.train.config import TRAIN_SEED_STRIDE, TrainConfig
from embodied_kv.train.grounding import GroundHead
from embodied_kv.train.losses import add_counts, compute_losses, expert_losses, head_outputs
from embodied_kv.train.resume import (
    RunState,
    check_fresh,
    check_resumable,
    load_state,
    save_state,
)
from embodied_kv.train.samples import StepSamples
from embodied_kv.world.dataset import DataConfig, Sample
from embodied_kv.world.expert import labels_of


def model_data(data: DataConfig, mcfg: ModelConfig) -> DataConfig:
    """`data` made for the model: its image and patch size, its chunk and its labels."""
    return DataConfig(**{**vars(data), "image_size": mcfg.vision.image_size,
                         "patch": mcfg.vision.patch_size, "horizon": mcfg.action_horizon,
                         "labels": labels_of(mcfg.name)})  # fmt: skip


def data_seed(seed: int, step: int, i: int, batch: int) -> int:
    return seed * TRAIN_SEED_STRIDE + step * batch + i


def data_at(cfg: TrainConfig, data: DataConfig, step: int) -> DataConfig:
    """The data config of `step`: the curriculum's easy phase, the ramp (memory updates
    and two-hop share growing from 0), then `data` as given."""
    if step < cfg.curriculum:
        return DataConfig(**{**vars(data), "two_hop_share": 0.0, "memory_updates": 0,
                             "memory_objects": 2})  # fmt: skip
    f = (step - cfg.curriculum) / cfg.ramp if cfg.ramp else 1.0
    if f >= 1:
        return data
    return DataConfig(**{**vars(data), "two_hop_share": f * data.two_hop_share,
                         "memory_updates": int(f * data.memory_updates)})  # fmt: skip


def lr_at(cfg: TrainConfig, step: int, done: float) -> float:
    """Linear warmup over cfg.warmup steps, then cosine to 10% over the run; `done` is
    the share of the run behind us (steps, or time under a minutes-only budget)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def run_done(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Share of the run behind us: the larger of steps and time when both bound it."""
    shares = [step / cfg.steps] if cfg.steps else []
    shares += [elapsed / (60 * cfg.minutes)] if cfg.minutes else []
    return max(shares)


def train(cfg: TrainConfig, progress: bool = True) -> list[dict]:
    """Run the training; returns the logged records (also in out/train_log.jsonl)."""
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    if cfg.resume:
        check_resumable(out)  # before anything is written
    elif not cfg.overwrite:
        check_fresh(out)  # a forgotten --resume does not replace hours of a saved run
    out.mkdir(parents=True, exist_ok=True)
    tok_path = save_tokenizer(out / TOKENIZER_FILE)
    mcfg = model_config(cfg.preset, cfg.seed, cfg.init)
    data = model_data(cfg.data, mcfg)
    model = build_model(mcfg, cfg.device, torch.float32, tokenizer_path=str(tok_path))
    if cfg.init and not cfg.resume:  # resumed: the weights come from the state
        # ValueError naming the mismatch: nothing trained. Another preset's weights of the
        # same parameters start a preset with a longer chunk (world -> world_smooth)
        load_weights(model, cfg.init, SHAPE_FREE)
    elif cfg.embed_std > 0 and not cfg.resume:
        redraw_embedding(model, cfg.embed_std, cfg.seed)
    model.train()
    for part in cfg.freeze:
        getattr(model, part).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    head = None
    if cfg.patch_weight > 0 and not expert_only(cfg):
        torch.manual_seed(cfg.seed)  # the patch head's init (+ position, object outputs)
        outputs = head_outputs(cfg.position_weight > 0, cfg.object_weight > 0)
        head = torch.nn.Linear(mcfg.backbone.width, outputs).to(cfg.device)
        params += list(head.parameters())
    ground = None
    if cfg.ground_weight > 0 and not expert_only(cfg):
        torch.manual_seed(cfg.seed + 1)  # the grounding head's init
        ground = GroundHead(mcfg.backbone.width, cfg.ground_layer,
                            centres=cfg.object_weight > 0).to(cfg.device)  # fmt: skip
        params += list(ground.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    run = RunState(0, 0.0)
    if cfg.resume:
        run = load_state(out, model, cfg, opt, head, gen, ground)
    log_path = out / "train_log.jsonl"
    keep_log(log_path, run.step)
    records: list[dict] = []
    call_start = time.perf_counter()
    start = call_start - run.elapsed
    bar = tqdm(total=cfg.steps or None, initial=run.step, disable=not progress, unit="step",
               dynamic_ncols=True)  # fmt: skip
    step = run.step
    bins_ids = action_id_range(mcfg)  # (lo, n) of the `bins` ids, for --bin-noise
    first_acc: dict[str, list[int]] = {}  # per kind over the log window: [right, counted]
    answer_acc: dict[str, list[int]] = {}  # the same over whole answers
    stage_err: dict[str, list[float]] = {}  # per task stage over the log window: [sum, n]
    source = StepSamples(
        lambda s: data_at(cfg, data, s), lambda s, i: data_seed(cfg.seed, s, i, cfg.batch),
        cfg.batch, cfg.data_workers,
    )  # fmt: skip
    try:
        while True:
            elapsed = time.perf_counter() - start
            done = run_done(cfg, step, elapsed)
            if done >= 1.0 or call_over(cfg, step, time.perf_counter() - call_start):
                break
            if step and step % cfg.log_every == 0:  # ETA of the bar from the share done
                bar.total = max(step + 1, round(step / done))
            samples = source.get(step)
            batches = [make_batch(part, model.tokenizer, mcfg).to(model.device)
                       for part in length_buckets(samples, cfg.buckets)]  # fmt: skip
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step, done)
            opt.zero_grad(set_to_none=True)
            parts = []
            for b in batches:  # gradients accumulate: the step's loss is the full batch's mean
                if cfg.bin_noise > 0:
                    b = replace(b, ids=noisy_inputs(b.ids, *bins_ids, cfg.bin_noise, gen))
                losses = step_losses(cfg, model, b, gen, head, ground)
                losses.total.backward()
                parts.append(losses)
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            rec = step_record(step, parts, time.perf_counter() - start)
            records.append(rec)
            add_counts(first_acc, rec["first"])
            add_counts(answer_acc, rec["whole"])
            add_counts(stage_err, rec.pop("stage"))
            if step % cfg.log_every == 0:
                rec["first_acc"], rec["answer_acc"] = shares(first_acc), shares(answer_acc)
                rec["stage_err"] = shares(stage_err)
                first_acc.clear()
                answer_acc.clear()
                stage_err.clear()
                with open(log_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", text=f"{rec['text']:.3f}",
                            flow=f"{rec['flow']:.3f}", acc=f"{rec['text_acc']:.2f}")  # fmt: skip
            step += 1
            if step % cfg.ckpt_every == 0:
                save_run(cfg, model, opt, head, gen, RunState(step, time.perf_counter() - start),
                         ground)  # fmt: skip
    finally:
        source.close()  # worker processes end with the run, also when it fails
    bar.close()
    save_run(cfg, model, opt, head, gen, RunState(step, time.perf_counter() - start), ground)
    return records


def expert_only(cfg: TrainConfig) -> bool:
    """Only the expert learns: the text losses and the heads could move nothing."""
    return {"vision", "backbone"} <= set(cfg.freeze)


def step_losses(cfg: TrainConfig, model, b, gen, head, ground):
    """One length bucket's losses, weighted by its share of the step's samples."""
    if expert_only(cfg):
        return expert_losses(model, b, gen, b.size / cfg.batch, cfg.flow_dims)
    return compute_losses(model, b, gen, cfg.flow_weight, b.size / cfg.batch, head,
                          cfg.patch_weight, cfg.flow_dims, ground, cfg.ground_weight,
                          cfg.position_weight, cfg.object_weight, cfg.bin_sigma,
                          cfg.bin_weight, cfg.name_weight, cfg.bin_first)  # fmt: skip


def call_over(cfg: TrainConfig, step: int, call_seconds: float) -> bool:
    """This call's own end (`until`, `stop_after`), before the run's."""
    return bool(cfg.until and step >= cfg.until) or bool(
        cfg.stop_after and call_seconds >= 60 * cfg.stop_after
    )


def keep_log(path: Path, step: int) -> None:
    """The log of the steps before `step` (a resumed run drops what it will redo)."""
    lines = path.read_text().splitlines() if step and path.is_file() else []
    kept = [x for x in lines if json.loads(x)["step"] < step]
    path.write_text("".join(x + "\n" for x in kept))


def save_run(cfg: TrainConfig, model, opt, head, gen, run: RunState, ground=None) -> None:
    """The state that resumes the run (weights included, the training-only heads too),
    then the weights it ships (the model's own parameters only)."""
    out = Path(cfg.out)
    save_state(out, model, cfg, opt, head, gen, run, ground)
    save_checkpoint(model, out)


def model_config(preset: str, seed: int, init: str = "") -> ModelConfig:
    """The preset's config at `seed`; with an `init` file, the file's own config where it
    differs from that only in its init seed (so `--init shipped.safetensors` needs no
    `--seed`; any other mismatch is left to load_weights, which names it)."""
    mcfg = world_config(preset, seed)
    saved = own_layout_config(init) if init else None
    if saved is not None and replace(mcfg, seed=saved.seed) == saved:
        return saved
    return mcfg


@torch.no_grad()
def redraw_embedding(model, std: float, seed: int) -> None:
    """The text embedding drawn again from N(0, std), seeded (the rest of the fresh init
    stays as `init_weights` drew it)."""
    weight = model.backbone.embed_tokens.weight
    g = torch.Generator(device=weight.device).manual_seed(seed)
    weight.normal_(0.0, std, generator=g)


def length_buckets(samples: list[Sample], parts: int) -> list[list[Sample]]:
    """The step's samples in `parts` groups of similar text length (sorted, stable), so
    padding to each group's longest wastes less compute than padding to the step's."""
    if parts <= 1:
        return [samples]

    def length(s: Sample) -> int:
        words = sum(len((a + " " + b).split()) for a, b in s.turns)
        return words + (s.actions.size if s.kind == "actions" else 0)  # H x A bins ids

    ordered = sorted(samples, key=length)
    size = -(-len(ordered) // parts)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def shares(counts: dict[str, list[int]]) -> dict[str, float]:
    """Per-kind [right, counted] -> right / counted, where anything was counted."""
    return {k: round(r / n, 3) for k, (r, n) in counts.items() if n}


def step_record(step: int, parts: list, seconds: float) -> dict:
    """One step's log record from its buckets' losses (means weighted as in the loss)."""
    n = sum(p.n_samples for p in parts)
    n_text = sum(p.n_text for p in parts) or 1
    first: dict[str, list[int]] = {}
    whole: dict[str, list[int]] = {}
    stage: dict[str, list[float]] = {}
    bins_sum, bins_n = (sum(p.bins_err[i] for p in parts) for i in (0, 1))
    first_sum, first_n = (sum(p.bins_err_first[i] for p in parts) for i in (0, 1))
    for p in parts:
        add_counts(first, p.first_right)
        add_counts(whole, p.whole_right)
        add_counts(stage, p.stage_err)
    return {
        "step": step,
        "loss": float(sum(p.total.detach() for p in parts)),
        "text": sum(p.text * p.n_samples for p in parts) / n,
        "flow": sum(p.flow * p.n_samples for p in parts) / n,
        "text_acc": sum(p.text_acc * p.n_text for p in parts) / n_text,
        "patch": sum(p.patch * p.n_samples for p in parts) / n,
        "patch_acc": sum(p.patch_acc * p.n_samples for p in parts) / n,
        "flow_real": sum(p.flow_real * p.n_samples for p in parts) / n,
        "ground": sum(p.ground * p.n_samples for p in parts) / n,
        "ground_recall": sum(p.ground_recall * p.n_samples for p in parts) / n,
        "position": sum(p.position * p.n_samples for p in parts) / n,
        "object": sum(p.object * p.n_samples for p in parts) / n,
        "object_rows": sum(p.object_rows * p.n_samples for p in parts) / n,
        "names": sum(p.names * p.n_samples for p in parts) / n,
        # |greedy bin - target| in action units over the step's `bins` ids (None: none)
        "bins_err": round(bins_sum / bins_n, 4) if bins_n else None,
        "bins_err_first": round(first_sum / first_n, 4) if first_n else None,  # first ids
        "first": first,
        "whole": whole,
        "stage": stage,
        "seconds": round(seconds, 2),
    }


def save_checkpoint(model, out: Path) -> Path:
    """weights.safetensors in the own layout, renamed into place (a crash leaves the
    previous checkpoint whole)."""
    path = out / WEIGHTS_FILE
    model.eval()
    save_weights(model, path)
    path.chmod(0o644)  # the temp file was 0600; the weights ship beside tokenizer.json
    model.train()
    return path

