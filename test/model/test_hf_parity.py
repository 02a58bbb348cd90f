"""The backbone on the packed step vs transformers' GemmaForCausalLM with the same weights."""

import pytest
import torch

from embodied_kv.model.hf_interop import to_hf_gemma
from embodied_kv.model.vla import StepInput
from embodied_kv.storage.step import Segment, commit_step, plan_step

# fp32 on CPU. Measured max |diff| ~1e-6 on logits of magnitude ~1: the two differ only in
# summation order (packed padded GEMMs vs HF's eager attention) and RoPE tables (ours fp64).
LOGIT_ATOL = 1e-4
GREEDY_TOKENS = 16
PROMPTS = [
    "Task: pick up the red block, State: 12 200 31 7;\nAction: ",
    "What is on the table?",
    "Plan: walk to the shelf, look for the blue mug, grasp it by the handle and lift it. " * 2,
]


@pytest.fixture(scope="module")
def hf(tiny_model):
    return to_hf_gemma(tiny_model)


def ids_of(model, text):
    return torch.tensor(model.tokenizer.encode(text))


@torch.no_grad()
def all_position_logits(model, ids):
    """Logits at every position of a causal sequence through one packed step."""
    arena = model.new_arena(1, 512)
    slot = arena.allocate()
    n = ids.shape[0]
    plan = plan_step(arena, [Segment(slot, n, causal=True)])
    x = torch.zeros(plan.n_padded, model.cfg.backbone.width)
    x[:n] = model.backbone.embed(ids)
    hidden = model.backbone(x, plan, arena)
    commit_step(arena, plan)
    return model.backbone.logits(hidden, torch.arange(n))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_causal_logits_match_gemma(tiny_model, hf, prompt):
    ids = ids_of(tiny_model, prompt)
    ours = all_position_logits(tiny_model, ids)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    arena = tiny_model.new_arena(1, 512)
    last = tiny_model.append(arena, arena.allocate(), ids)  # the public path, last token only
    assert (last - ref[-1]).abs().max().item() < LOGIT_ATOL


def test_bidirectional_prefix_matches_gemma_with_full_mask(tiny_model, hf):
    """pi0.5's prefix attends both ways; HF does the same with an all-visible 4D mask."""
    ids = ids_of(tiny_model, PROMPTS[0])
    n = ids.shape[0]
    arena = tiny_model.new_arena(1, 512)
    ours = tiny_model.step(arena, [StepInput(arena.allocate(), ids=ids, causal=False)])[0]
    with torch.no_grad():
        ref = hf(input_ids=ids[None], attention_mask=torch.zeros(1, 1, n, n)).logits[0, -1]
        causal = hf(input_ids=ids[None]).logits[0, -1]
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    assert (ours - causal).abs().max().item() > 100 * LOGIT_ATOL  # the mask matters


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_equals_generate(tiny_model, hf, prompt):
    ids = ids_of(tiny_model, prompt)
    n = ids.shape[0]
    with torch.no_grad():
        out = hf.generate(
            ids[None],
            attention_mask=torch.ones(1, n, dtype=torch.long),
            max_new_tokens=GREEDY_TOKENS,
            min_new_tokens=GREEDY_TOKENS,
            do_sample=False,
        )
    ref = out[0, n:].tolist()
    arena = tiny_model.new_arena(1, 512)
    slot = arena.allocate()
    tok = tiny_model.append(arena, slot, ids).argmax().view(1)
    ours = [int(tok)]
    for _ in range(GREEDY_TOKENS - 1):
        tok = tiny_model.decode(arena, [slot], tok)[0].argmax().view(1)
        ours.append(int(tok))
    assert ours == ref


def test_shared_weights_are_the_same_tensors(tiny_model):
    shared = to_hf_gemma(tiny_model, share=True)
    ours = tiny_model.backbone.layers[1].mlp.up_proj.weight
    assert shared.model.layers[1].mlp.up_proj.weight.data_ptr() == ours.data_ptr()
    emb = tiny_model.backbone.embed_tokens.weight
    assert shared.lm_head.weight.data_ptr() == emb.data_ptr()
    copied = to_hf_gemma(tiny_model)
    assert copied.model.embed_tokens.weight.data_ptr() != emb.data_ptr()
    assert copied.lm_head.weight is copied.model.embed_tokens.weight  # tied
    assert torch.equal(copied.model.embed_tokens.weight, emb)
