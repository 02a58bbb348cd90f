"""Fidelity of every KV-compression method against the full cache (`bench vlcache`).

Per world scene: the frame's prefix is prefilled once (with the statistics of every query
range any method reads), its question appended, and 32 tokens decoded greedily (EOS
ignored) over the full cache; then, for each method and budget, over a copy of the prefix
compacted to that method's selection. Reported per (method, budget):

    top1        the first answer token equals the full cache's
    greedy32    all 32 greedy tokens equal (exact) / the common prefix, as a fraction of 32
    hit_rate    CacheHitRate (VL-Cache §5): per layer and KV head, the overlap of the method's
                kept image rows with the top-k image rows of the first decode token's
                attention (that head's query heads) over the full cache (k = the rows that
                layer keeps), averaged over layers and heads
    chunk_err   the action expert reading the compressed prefix (`compress_expert`): its
                chunk's L2 distance from the full prefix's chunk, relative to the latter's
                norm (the default keeps the expert on the full prefix: error 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embodied_kv.engine.policy import answer_suffix
from embodied_kv.eval.world import episode
from embodied_kv.kernels.attn_stats import attn_stats_ref, kv_head_sums
from embodied_kv.kv.compress import (
    CompressConfig,
    PrefixLayout,
    StatsRecorder,
    compact,
    select,
)
from embodied_kv.kv.presses import ALL_ROWS, POST_VISION, WINDOW, get_press
from embodied_kv.model.vla import Observation, Prefix, StepInput
from embodied_kv.world import questions
from embodied_kv.world.render import CAMERAS, observation_images

GREEDY_TOKENS = 32  # VL-Cache reports agreement over the first 32 generated tokens
SCENE_SEED = 7_000_000  # above the training seeds (train/config.py) and eval world's


@dataclass(frozen=True)
class Prompt:
    prefix: Prefix
    question: list[int]  # ids of "\nQuestion: <q>\nAnswer: "
    answer: str


def world_prompts(model, n: int, seed: int = SCENE_SEED) -> list[Prompt]:
    """n world scenes rendered at the model's image size, each with a scene question. The
    world renders two views; a third camera repeats the top one (a longer visual prefix)."""
    cfg = model.cfg
    cams = tuple(CAMERAS[i % len(CAMERAS)] for i in range(cfg.num_cameras))
    out = []
    for i in range(n):
        scene, task = episode(seed + i)
        rng = np.random.default_rng(seed + 10**6 + i)
        qa = questions.sample_question(scene, rng, questions.KINDS[i % len(questions.KINDS)])
        images = torch.from_numpy(observation_images(scene, cfg.vision.image_size, cams))
        prefix = model.embed_prefix(Observation(images, scene.state(), task.instruction))
        ids = model.tokenizer.encode(answer_suffix(qa.question), bos=False)
        out.append(Prompt(prefix, ids, qa.answer))
    return out


class FirstDecodeAttention:
    """Observer of one decode step: per layer, the step's first token's attention summed over
    the query heads of each KV head, over the image rows [0, n_image) of `slot` -> scores
    L x [Hkv, n_image]."""

    def __init__(self, slot: int, n_image: int, layers: int, scale: float):
        self.slot, self.n_image, self.scale = slot, n_image, scale
        self.scores: list[torch.Tensor | None] = [None] * layers

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, length: int) -> None:
        keys = k_cache[self.slot, :length]
        col, _ = attn_stats_ref(q[:1], keys, self.scale, 0.5)  # [Hq, length]
        self.scores[layer] = kv_head_sums(col, keys.shape[1])[:, : self.n_image].cpu()


def greedy(model, arena, slot: int, ids: list[int], observer=None) -> list[int]:
    """Append `ids`, then GREEDY_TOKENS greedy tokens (EOS ignored). `observer(layer, q,
    k_cache, length)` sees the first decode step."""
    logits = model.append(arena, slot, torch.tensor(ids))
    out = []
    for i in range(GREEDY_TOKENS):
        tok = int(logits.argmax())
        out.append(tok)
        hook = None
        if observer is not None and i == 0:
            lens = (arena.length[:, slot] + 1).tolist()  # rows it reads, itself included

            def hook(layer, q, k_cache, lens=lens):
                observer(layer, q, k_cache, lens[layer])

        inputs = [StepInput(slot, ids=torch.tensor([tok]))]
        logits = model.step(arena, inputs, observer=hook)[0]
    return out


def measure(model, prompts: list[Prompt], methods: list[str], budgets: list[float]) -> dict:
    """-> {f"{method}@{budget}": {top1, greedy32_exact, greedy32_prefix, hit_rate, n}}."""
    layers, kv_heads = model.cfg.backbone.layers, model.cfg.backbone.kv_heads
    scale = model.backbone.scale
    longest = max(p.prefix.embeds.shape[0] + len(p.question) for p in prompts)
    arena = model.new_arena(3, -(-(longest + GREEDY_TOKENS + 1) // 64) * 64)
    master, full_slot, work = arena.allocate(), arena.allocate(), arena.allocate()
    rows: dict[str, dict[str, list]] = {}
    for p in prompts:
        layout = PrefixLayout(p.prefix.embeds.shape[0], p.prefix.n_image)
        ranges = {n: layout.query_rows(n, CompressConfig().window)
                  for n in (POST_VISION, ALL_ROWS, WINDOW)}  # fmt: skip
        rec = StatsRecorder(layout, master, ranges, layers, scale, CompressConfig().threshold,
                            model.cfg.backbone.heads, model.device)  # fmt: skip
        arena.clear(master)
        model.prefill(arena, master, p.prefix, observer=rec)
        stats = rec.stats()
        noise = model.make_noise(0)
        chunk = model.sample_actions(arena, master, layout.n_rows, noise).float()
        arena.copy_slot(master, full_slot)
        first = FirstDecodeAttention(full_slot, layout.n_image, layers, scale)
        ref = greedy(model, arena, full_slot, p.question, first)
        arena.clear(full_slot)
        for method in methods:
            for budget in budgets if method != "full" else [1.0]:
                cfg = CompressConfig(budget=budget, method=method)
                sel = select(get_press(method), cfg, layout, stats, layers, kv_heads)
                arena.copy_slot(master, work)
                compact(arena, work, sel)
                small = model.sample_actions(arena, work, layout.n_rows, noise, compressed=True)
                err = float((small.float() - chunk).norm() / chunk.norm())
                got = greedy(model, arena, work, p.question)
                arena.clear(work)
                common = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True))
                               if a != b), GREEDY_TOKENS)  # fmt: skip
                r = rows.setdefault(f"{method}@{budget:g}", {"top1": [], "exact": [],
                                                              "prefix": [], "hit": [],
                                                              "chunk": []})  # fmt: skip
                r["top1"].append(got[0] == ref[0])
                r["exact"].append(got == ref)
                r["prefix"].append(common / GREEDY_TOKENS)
                r["hit"].append(hit_rate(sel.keep, first.scores, layout.n_image))
                r["chunk"].append(err)
    return {
        key: {
            "top1": float(np.mean(r["top1"])),
            "greedy32_exact": float(np.mean(r["exact"])),
            "greedy32_prefix": float(np.mean(r["prefix"])),
            "hit_rate": float(np.mean(r["hit"])),
            "chunk_err": float(np.mean(r["chunk"])),
            "n": len(r["top1"]),
        }
        for key, r in rows.items()
    }


def hit_rate(keep: tuple[torch.Tensor, ...], true_scores: list[torch.Tensor], n_image: int):
    """Mean over layers and KV heads of |kept image rows ∩ top-k of the true scores| / k."""
    hits = []
    for kept, scores in zip(keep, true_scores, strict=True):  # [Hkv, rows], [Hkv, n_image]
        for head_kept, head_scores in zip(kept, scores, strict=True):
            img = head_kept[head_kept < n_image]
            k = img.shape[0]
            top = torch.sort(head_scores, descending=True, stable=True).indices[:k]
            hits.append(len(set(img.tolist()) & set(top.tolist())) / k)
    return float(np.mean(hits))
