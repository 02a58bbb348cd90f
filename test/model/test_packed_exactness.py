"""Batch invariance of the packed step: token ids and bytes, not tolerances."""

import pytest
import torch

from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import StepInput

INSTRUCTIONS = [
    "pick up the red block",
    "open the drawer and put the sponge inside",
    "wave",
    "stack the cups",
    "fold the towel in half, then in half again",
    "",
    "push the button",
    "sort the screws by size please",
]
N_TOKENS = 32


def make_obs(seed, instruction, cameras=None):
    return synthetic_observation(get_preset("tiny"), seed, instruction, cameras)


def prefill_all(model, arena, n):
    """n slots with prefixes of different lengths (instructions and camera masks differ)."""
    slots, first = [], []
    for i in range(n):
        cams = (True, False) if i % 3 == 2 else None
        prefix = model.embed_prefix(make_obs(i, INSTRUCTIONS[i], cams))
        s = arena.allocate()
        first.append(model.prefill(arena, s, prefix))
        slots.append(s)
    return slots, first


def pick(logits, gen):
    if gen is None:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=gen)[0]


def decode_alone(model, n, sample):
    arena = model.new_arena(8, 512)
    slots, first = prefill_all(model, arena, n)
    tokens, logits = [], []
    for i, s in enumerate(slots):
        gen = torch.Generator().manual_seed(100 + i) if sample else None
        tok = pick(first[i], gen)
        toks, lgs = [int(tok)], []
        for _ in range(N_TOKENS - 1):
            lg = model.decode(arena, [s], tok.view(1))[0]
            tok = pick(lg, gen)
            toks.append(int(tok))
            lgs.append(lg)
        tokens.append(toks)
        logits.append(torch.stack(lgs))
    return tokens, logits


def decode_together(model, n, sample):
    arena = model.new_arena(8, 512)
    slots, first = prefill_all(model, arena, n)
    gens = [torch.Generator().manual_seed(100 + i) if sample else None for i in range(n)]
    cur = torch.stack([pick(first[i], gens[i]) for i in range(n)])
    tokens, logits = [[int(t)] for t in cur], [[] for _ in range(n)]
    for _ in range(N_TOKENS - 1):
        lg = model.decode(arena, slots, cur)
        cur = torch.stack([pick(lg[i], gens[i]) for i in range(n)])
        for i in range(n):
            tokens[i].append(int(cur[i]))
            logits[i].append(lg[i])
    return tokens, [torch.stack(x) for x in logits]


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_batched_decode_equals_one_by_one(tiny_model, n, sample):
    alone_tok, alone_lg = decode_alone(tiny_model, n, sample)
    tog_tok, tog_lg = decode_together(tiny_model, n, sample)
    assert tog_tok == alone_tok
    for a, b in zip(alone_lg, tog_lg, strict=True):
        assert torch.equal(a, b)
    if sample:  # the sampled sequences really vary, so the comparison has teeth
        assert len({t for seq in tog_tok for t in seq}) > 5


def test_prefixes_really_differ_in_length(tiny_model):
    arena = tiny_model.new_arena(8, 512)
    slots, _ = prefill_all(tiny_model, arena, 8)
    assert len({arena.slot_len(s) for s in slots}) >= 5


def test_chunked_prefill_equals_prefill_at_once(tiny_model):
    model = tiny_model
    text = "Plan: walk to the table, look for the cup, grasp it, lift it carefully and wait. " * 2
    ids = torch.tensor(model.tokenizer.encode(text))
    n = ids.shape[0]
    arena = model.new_arena(4, 512)
    once, chunked = arena.allocate(), arena.allocate()
    lg_once = model.append(arena, once, ids)
    for a, b in [(0, 37), (37, 38), (38, 100), (100, n)]:
        lg_chunk = model.append(arena, chunked, ids[a:b])
    assert torch.equal(arena.k[:, once, :n], arena.k[:, chunked, :n])
    assert torch.equal(arena.v[:, once, :n], arena.v[:, chunked, :n])
    assert torch.equal(lg_once, lg_chunk)
    tok_a, tok_b = lg_once.argmax().view(1), lg_chunk.argmax().view(1)
    for _ in range(16):
        la = model.decode(arena, [once], tok_a)[0]
        lb = model.decode(arena, [chunked], tok_b)[0]
        assert torch.equal(la, lb)
        tok_a, tok_b = la.argmax().view(1), lb.argmax().view(1)


def test_mixed_step_equals_separate_steps(tiny_model):
    """A prefill packed with decode tokens of other slots (ActionFlow / piggybacked
    language) = the same work in separate steps."""
    model = tiny_model
    sep, mix = model.new_arena(4, 512), model.new_arena(4, 512)
    for arena in (sep, mix):
        slots, _ = prefill_all(model, arena, 2)
    prefix = model.embed_prefix(make_obs(9, "a new frame"))
    ids = torch.tensor([65, 66])
    s_new = sep.allocate()
    lg_prefill = model.prefill(sep, s_new, prefix)
    lg_dec = model.decode(sep, [0, 1], ids)
    m_new = mix.allocate()
    lg = model.step(
        mix,
        [
            StepInput(0, ids=ids[0:1]),
            StepInput(m_new, embeds=prefix.embeds, causal=False),
            StepInput(1, ids=ids[1:2]),
        ],
    )
    assert torch.equal(lg[1], lg_prefill)
    assert torch.equal(lg[0], lg_dec[0]) and torch.equal(lg[2], lg_dec[1])
    for s in (0, 1, s_new):
        n = sep.slot_len(s)
        assert n == mix.slot_len(s)
        assert torch.equal(sep.k[:, s, :n], mix.k[:, s, :n])


def test_layers_with_different_lengths_get_their_own_attention_plan(tiny_model, monkeypatch):
    """The backbone plans the reference attention once per distinct kv_len row of a step and
    shares it between layers; a slot that keeps fewer rows in one layer (a compressed slot)
    gets that layer's own plan: the bytes of planning inside every attention call."""
    model = tiny_model
    shared, per_call = model.new_arena(4, 512), model.new_arena(4, 512)
    for arena in (shared, per_call):
        prefill_all(model, arena, 3)
        arena.length[1, 0] -= 5  # layer 1 of slot 0 forgets its last 5 rows
        arena.length[2, 2] -= 64  # and layer 2 of slot 2 a whole key block
    ids = torch.tensor([70, 71, 72])
    lg_shared = model.decode(shared, [0, 1, 2], ids)
    monkeypatch.setattr(type(model.backbone), "_ref_plans", lambda self, step, arena: None)
    lg_per_call = model.decode(per_call, [0, 1, 2], ids)
    assert torch.equal(lg_shared, lg_per_call)
    monkeypatch.undo()
    intact = model.new_arena(4, 512)
    prefill_all(model, intact, 3)
    assert not torch.equal(model.decode(intact, [0, 1, 2], ids)[0], lg_shared[0])
