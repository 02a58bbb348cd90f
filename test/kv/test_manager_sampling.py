"""The manager picks every request's next token in one batch (greedy on the device, one host
read per step) with the per-request semantics it always had: argmax, or the request's own
generator drawing from softmax(logits / temperature) on the host."""

import pytest
import torch

from embodied_kv.kv.manager import KVCacheManager, TaskKind
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import StepInput, build_model

QUESTIONS = ["where?", "what is on the table", "why", "count the cups please"]
TEMPERATURE = 0.8
MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(get_preset("tiny"))


def generator(i, sampled):
    return torch.Generator().manual_seed(50 + i) if sampled else None


def reference_pick(logits, gen):
    """The per-request pick as it was before batching (one host read per request)."""
    if gen is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / TEMPERATURE, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def alone(model, obs, i, sampled):
    arena = model.new_arena(1, 256)
    slot = arena.allocate()
    model.prefill(arena, slot, model.embed_prefix(obs))
    gen, ids, tokens = generator(i, sampled), model.tokenizer.encode(QUESTIONS[i], bos=False), []
    for _ in range(MAX_NEW):
        logits = model.step(arena, [StepInput(slot, ids=torch.tensor(ids))])[0]
        token = reference_pick(logits, gen)
        if token == model.tokenizer.eos_id:
            break
        tokens.append(token)
        ids = [token]
    return tokens


def test_batched_pick_equals_each_request_alone(tiny_model):
    obs = synthetic_observation(tiny_model.cfg, 9, "look around")
    sampled = [False, True, True, False]
    manager = KVCacheManager(tiny_model, num_slots=5, max_len=256)
    fp = manager.prefill_frame(0, tiny_model.embed_prefix(obs))
    reqs = []
    for i, q in enumerate(QUESTIONS):
        ids = tiny_model.tokenizer.encode(q, bos=False)
        reqs.append(
            manager.create(
                fp, f"r{i}", TaskKind.ANSWER, MAX_NEW, ids,
                generator=generator(i, sampled[i]), temperature=TEMPERATURE,
            )  # fmt: skip
        )
    while manager.live():
        manager.decode_step()
    for i, req in enumerate(reqs):
        assert req.tokens == alone(tiny_model, obs, i, sampled[i]), i
    assert reqs[1].tokens != reqs[2].tokens  # the sampled ones really sampled
