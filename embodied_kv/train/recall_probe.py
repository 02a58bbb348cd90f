"""`embodied-kv recall-probe`: can this backbone learn a two-word-key lookup, and
after how many steps? The world's memory queries need exactly that binding (KEEP's
accuracy rows wait for it), and the world data mixes it with everything else; this
probe isolates the architecture, its init and the optimiser.

A sequence is `pairs` facts `<colour> <shape> <place> .` over distinct (colour, shape)
keys (the world's words: 4 x 5 keys, 5 places), then `queries` lookups
`Query <colour> <shape> : <place>`; the loss and accuracy count the place after each
`:`. The model is the world preset's backbone alone (text rows, causal mask), trained
with AdamW as `train` trains. Guessing the most frequent place of a sequence scores
~0.4 at 8 pairs: accuracy well above it means the lookup was learned ("escape").

`data="world"`: the same lookup in the world's own memory text instead (world/memory.py:
2..`pairs` containers, two movables, `queries` one-hop queries per stream, text only),
the form the world model's plan samples give it; with no updates by default, and
0..`updates` of them per stream (`--updates`: then a query asks for the latest of several
facts about its container, as the world model's long streams do).

`data="chain"`: two hops in the bare form. Half the facts place a container,
`<colour> <container> <place> .`, half put a movable in one of them,
`<colour> <movable> <colour> <container> .` (in random order); every query asks for a
movable's place, `Query <colour> <movable> : <place>`: its container's fact, then that
container's place, in one forward pass. `layers` changes the backbone's depth (the world
model has 4): whether two lookups in a row need more layers than one. `data="chain-cot"`:
the same facts, but the answer names the container first,
`Query <colour> <movable> : <colour> <container> <place>`, labelled at every answer word:
two one-hop lookups, the second keyed by words just written (as a plan that says where
the key is before where that is)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from embodied_kv.bench.report import write_json
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import load_weights
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.batch import IGNORE, pad_rows
from embodied_kv.train.forward import backbone_layers
from embodied_kv.train.loop import model_config, redraw_embedding
from embodied_kv.world.memory import sample_queries
from embodied_kv.world.vocab import COLOURS, CONTAINERS, MOVABLES, PLACES

SHAPES = MOVABLES + CONTAINERS
ESCAPE_ACC = 0.6  # mean accuracy over a log window above this: the lookup is learned
CHAINS = ("chain", "chain-cot")  # two-hop data: the place at once, or the container first


@dataclass(frozen=True)
class ProbeConfig:
    steps: int = 1200
    pairs: int = 8
    queries: int = 8
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    seed: int = 0  # data order and the redrawn embedding
    embed_std: float = 0.0  # 0: the model's own init (train.loop.TrainConfig.embed_std)
    log_every: int = 100
    data: str = "pairs"  # or "world", "chain", "chain-cot"
    updates: int = 0  # world: fact updates per stream, 0 .. this, uniform

    def __post_init__(self):
        if self.data in CHAINS and not 2 <= self.pairs <= 2 * len(COLOURS) * len(CONTAINERS):
            raise ValueError(f"chain: pairs in [2, {2 * len(COLOURS) * len(CONTAINERS)}]: {self}")
        if self.data not in ("pairs", "world", *CHAINS) or (
            self.data == "world" and not 2 <= self.pairs <= 8
        ):
            raise ValueError(f"data 'pairs', 'chain', 'chain-cot' or 'world' (2 .. 8 "
                             f"containers): {self}")  # fmt: skip
        if not 1 <= self.pairs <= len(COLOURS) * len(SHAPES) or self.queries < 1:
            raise ValueError(f"pairs in [1, {len(COLOURS) * len(SHAPES)}], queries >= 1: "
                             f"{self}")  # fmt: skip
        if self.updates and self.data != "world" or self.updates < 0:
            raise ValueError(f"updates >= 0, and only for data 'world': {self}")
        if self.steps < 1 or self.batch < 1 or self.lr <= 0 or not 0 <= self.embed_std < 1:
            raise ValueError(f"bad probe config: {self}")


def word_ids(tokenizer) -> dict[str, list[int]]:
    def ids(words):
        return [tokenizer.encode(w, bos=False)[0] for w in words]

    return {"colour": ids(COLOURS), "shape": ids(SHAPES), "place": ids(PLACES),
            "frame": ids([".", "Query", ":"])}  # fmt: skip


def lookup_batch(gen: torch.Generator, words: dict, cfg: ProbeConfig):
    """-> ids [B, L], labels [B, L] (the place after each query's ':', else IGNORE)."""
    n_shapes = len(words["shape"])
    colour, shape, place = (torch.tensor(words[k]) for k in ("colour", "shape", "place"))
    dot, query, colon = words["frame"]
    rows, labels = [], []
    for _ in range(cfg.batch):
        keys = torch.randperm(len(colour) * n_shapes, generator=gen)[: cfg.pairs]
        c, s = colour[keys // n_shapes], shape[keys % n_shapes]
        p = place[torch.randint(len(place), (cfg.pairs,), generator=gen)]
        ids = torch.stack([c, s, p, torch.full_like(p, dot)], 1).reshape(-1).tolist()
        lab = [IGNORE] * len(ids)
        for i in torch.randint(cfg.pairs, (cfg.queries,), generator=gen).tolist():
            ids += [query, int(c[i]), int(s[i]), colon, int(p[i])]
            lab += [IGNORE, IGNORE, IGNORE, int(p[i]), IGNORE]
        rows.append(ids)
        labels.append(lab)
    return torch.tensor(rows), torch.tensor(labels)


def chain_batch(gen: torch.Generator, words: dict, cfg: ProbeConfig):
    """-> ids [B, L], labels [B, L]: two-hop lookups (module doc), labelled from each ':'."""
    n_box = max(1, cfg.pairs // 2)  # containers; the other facts are movables
    n_mov = cfg.pairs - n_box
    colour, place = torch.tensor(words["colour"]), torch.tensor(words["place"])
    boxes, movables = (torch.tensor(words["shape"])[i] for i in _kinds())
    dot, query, colon = words["frame"]
    rows, labels = [], []
    for _ in range(cfg.batch):
        box = _keys(gen, colour, boxes, n_box)  # [n_box, 2]
        mov = _keys(gen, colour, movables, n_mov)
        at = place[torch.randint(len(place), (n_box,), generator=gen)]  # each box's place
        inside = torch.randint(n_box, (n_mov,), generator=gen)  # each movable's box
        facts = [[*box[b].tolist(), int(at[b]), dot] for b in range(n_box)]
        facts += [[*mov[m].tolist(), *box[inside[m]].tolist(), dot] for m in range(n_mov)]
        ids = [t for i in torch.randperm(len(facts), generator=gen).tolist() for t in facts[i]]
        lab = [IGNORE] * len(ids)
        for m in torch.randint(n_mov, (cfg.queries,), generator=gen).tolist():
            answer = [int(at[inside[m]])]
            if cfg.data == "chain-cot":
                answer = [*box[inside[m]].tolist(), *answer]
            ids += [query, *mov[m].tolist(), colon, *answer]
            lab += [IGNORE, IGNORE, IGNORE, *answer, IGNORE]
        rows.append(ids)
        labels.append(lab)
    return torch.tensor(rows), torch.tensor(labels)


def _kinds() -> tuple[list[int], list[int]]:
    """Indices into SHAPES of the containers and of the movables."""
    return ([SHAPES.index(s) for s in CONTAINERS], [SHAPES.index(s) for s in MOVABLES])


def _keys(gen: torch.Generator, colour: torch.Tensor, shapes: torch.Tensor, n: int):
    """n distinct (colour, shape) keys -> [n, 2] word ids."""
    pick = torch.randperm(len(colour) * len(shapes), generator=gen)[:n]
    return torch.stack([colour[pick // len(shapes)], shapes[pick % len(shapes)]], 1)


def world_batch(gen: torch.Generator, tokenizer, cfg: ProbeConfig):
    """-> ids [B, L] (pad-filled), labels [B, L]: one-hop memory queries in the world's
    text, each label at the token before the answer (as train/batch.py lays out a plan)."""
    rng = np.random.default_rng(int(torch.randint(2**31, (1,), generator=gen)))
    rows, labels = [], []
    for _ in range(cfg.batch):
        n = int(rng.integers(2, cfg.pairs + 1))
        updates = int(rng.integers(cfg.updates + 1)) if cfg.updates else 0  # 0: no draw
        queries = sample_queries(rng, [1] * cfg.queries, n, 2, updates)
        ids, lab = [tokenizer.bos_id], [IGNORE]
        for i, q in enumerate(queries):
            ids += tokenizer.encode(q.prompt if i == 0 else q.follow_up, bos=False)
            answer = tokenizer.encode(q.answer, bos=False)
            lab += [IGNORE] * (len(ids) - len(lab) - 1) + [answer[0]]
            ids += answer
            lab += [IGNORE] * len(answer)
        rows.append(ids)
        labels.append(lab)
    return pad_rows(rows, labels, tokenizer.pad_id)


def lookup_logits(bb, ids: torch.Tensor) -> torch.Tensor:
    b, seq = ids.shape
    x = bb.embed(ids.reshape(-1)).reshape(b, seq, -1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    x, _, _ = backbone_layers(bb, x, causal[None].expand(b, -1, -1))
    return bb.norm(x) @ bb.embed_tokens.weight.t()


def run_probe(model, cfg: ProbeConfig, on_record=None) -> list[dict]:
    """Train `model`'s backbone on the lookup -> a record per log window:
    {step, loss, acc} (means over the window's steps); `on_record(record)` sees each as it
    is made (progress of a long run)."""
    bb = model.backbone
    words = word_ids(model.tokenizer)
    if cfg.embed_std > 0:
        redraw_embedding(model, cfg.embed_std, cfg.seed)
    params = list(bb.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    records, window = [], []
    bb.train()
    for step in range(1, cfg.steps + 1):
        if cfg.data == "world":
            ids, labels = world_batch(gen, model.tokenizer, cfg)
        elif cfg.data in CHAINS:
            ids, labels = chain_batch(gen, words, cfg)
        else:
            ids, labels = lookup_batch(gen, words, cfg)
        ids, labels = ids.to(model.device), labels.to(model.device)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / cfg.warmup)
        logits = lookup_logits(bb, ids).float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        mask = labels != IGNORE
        acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean()
        window.append((float(loss.detach()), float(acc)))
        if step % cfg.log_every == 0 or step == cfg.steps:
            losses, accs = zip(*window, strict=True)
            records.append({"step": step, "loss": round(sum(losses) / len(window), 4),
                            "acc": round(sum(accs) / len(window), 4)})  # fmt: skip
            window.clear()
            if on_record is not None:
                on_record(records[-1])
    return records


@torch.no_grad()
def greedy_place_accuracy(model, cfg: ProbeConfig, seed: int = 10_000) -> float:
    """Two-hop data, end to end: each query's answer written greedily from its ':' (the
    facts and the earlier queries as given), right when its last word is the place ->
    accuracy over a fresh batch. For `chain` that is the first word; for `chain-cot` the
    place follows the model's own container, not the true one (as a plan decodes)."""
    if cfg.data not in CHAINS:
        raise ValueError(f"greedy place accuracy is for {CHAINS}, not {cfg.data!r}")
    bb = model.backbone
    bb.eval()
    words = word_ids(model.tokenizer)
    ids, _ = chain_batch(torch.Generator().manual_seed(seed), words, cfg)
    ids = ids.to(model.device)
    colon = words["frame"][2]
    width = 3 if cfg.data == "chain-cot" else 1  # answer words
    starts = (ids[0] == colon).nonzero().view(-1).tolist()  # every row has the same layout
    right = 0
    for j in starts:
        seq = ids[:, : j + 1]
        for _ in range(width):
            nxt = lookup_logits(bb, seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        right += int((seq[:, -1] == ids[:, j + width]).sum())
    bb.train()
    return right / (len(starts) * ids.shape[0])


def escape_step(records: list[dict]) -> int | None:
    """The first logged step whose window's accuracy passed ESCAPE_ACC (None: never)."""
    return next((r["step"] for r in records if r["acc"] > ESCAPE_ACC), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv recall-probe", description=__doc__)
    p.add_argument("--seeds", default="1,2,3,4", help="one run per seed (data, embedding)")
    p.add_argument("--embed-std", default="0.02,0.088",
                   help="one arm per value (0: the model's own init)")  # fmt: skip
    p.add_argument("--steps", type=int, default=ProbeConfig.steps)
    p.add_argument("--pairs", type=int, default=ProbeConfig.pairs,
                   help="facts per sequence (world: most containers per stream)")
    p.add_argument("--data", default="pairs",
                   help="pairs (bare facts), chain (two hops, bare), chain-cot (two hops, the "
                   "container named first) or world (its text)")
    p.add_argument("--updates", type=int, default=0,
                   help="world: fact updates per stream, 0 .. this (default 0: none)")
    p.add_argument("--layers", type=int, default=0,
                   help="backbone depth (0: the preset's; the world model has 4)")
    p.add_argument("--lr", type=float, default=ProbeConfig.lr)
    p.add_argument("--preset", default="world")
    p.add_argument("--init", default="", help="a weights file of the preset to start from "
                   "(e.g. the shipped world model; --embed-std then redraws its embedding)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write every run's records here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
        stds = [float(x) for x in args.embed_std.split(",")]
        given = {"steps": args.steps, "pairs": args.pairs, "lr": args.lr, "data": args.data,
                 "updates": args.updates}
        configs = [[ProbeConfig(seed=seed, embed_std=std, **given) for seed in seeds]
                   for std in stds]  # fmt: skip
    except ValueError as e:
        print(f"embodied-kv recall-probe: {e}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(f"{tmp}/tokenizer.json")
        for std, arm in zip(stds, configs, strict=True):
            for cfg in arm:
                try:  # every run loads the same --init: a wrong file fails the first, untrained
                    model = _probe_model(args, tok)
                except (ValueError, OSError) as e:
                    print(f"embodied-kv recall-probe: {e}", file=sys.stderr)
                    return 2
                label = f"embed_std {std:g} seed {cfg.seed}"
                records = run_probe(model, cfg, on_record=lambda r, label=label: print(
                    f"  {label} step {r['step']}: acc {r['acc']:.3f} loss {r['loss']:.3f}",
                    flush=True))  # fmt: skip
                runs.append({"embed_std": std, "seed": cfg.seed, "escape_step":
                             escape_step(records), "records": records})  # fmt: skip
                last = records[-1]
                end = ""
                if cfg.data in CHAINS:  # the two-hop answer as a plan writes it
                    runs[-1]["greedy_place_acc"] = greedy_place_accuracy(model, cfg)
                    end = f", greedy place accuracy {runs[-1]['greedy_place_acc']:.3f}"
                print(f"embed_std {std:g} seed {cfg.seed}: escape at step "
                      f"{runs[-1]['escape_step']}, last window acc {last['acc']:.3f} "
                      f"loss {last['loss']:.3f}{end}", flush=True)  # fmt: skip
    for std in stds:
        arm = [r for r in runs if r["embed_std"] == std]
        escaped = sum(r["escape_step"] is not None for r in arm)
        print(f"embed_std {std:g}: {escaped}/{len(arm)} runs learned the lookup "
              f"within {args.steps} steps")  # fmt: skip
    if args.json:  # atomic, with the machine's stamp (date, torch, cpu) as benchmarks write
        write_json({"args": vars(args), "runs": runs}, args.json)
    return 0


def _probe_model(args, tokenizer_path):
    """The probe's model (fp32, the world's word tokenizer): fresh, or `--init`'s weights."""
    cfg = model_config(args.preset, 0, args.init or "")  # the file's init seed
    if args.layers:
        if args.init:
            raise ValueError("--layers builds a fresh model of that depth; --init loads one")
        depth = {"layers": args.layers}
        cfg = replace(cfg, backbone=replace(cfg.backbone, **depth),
                      expert=replace(cfg.expert, **depth))  # fmt: skip
    model = build_model(cfg, args.device, torch.float32, tokenizer_path=str(tokenizer_path))
    if args.init:
        load_weights(model, args.init)
    return model
