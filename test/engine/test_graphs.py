"""CUDA-graph replay = eager, bytes. The replay tests need a CUDA device and are
skipped without one (this project's CI has none); the masked-bucket expert path
that the denoise graph replays is checked on the CPU as well."""

import pytest
import torch

from embodied_kv.engine.graphs import GraphRunner
from embodied_kv.kv.capsule import capture, identity_of, restore
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; none here"
)


def test_runner_is_disabled_on_cpu(tiny_model):
    arena = tiny_model.new_arena(2, 256)
    g = GraphRunner(tiny_model, arena)
    assert not g.enabled and g.step([]) is None and g.sample_actions(0, 10, None) is None


def test_bucketed_expert_matches_exact_prefix(tiny_model):
    m = tiny_model
    arena = m.new_arena(2, 256)
    s = arena.allocate()
    m.prefill(arena, s, m.embed_prefix(synthetic_observation(m.cfg, 3)))
    n = arena.slot_len(s)
    noise = m.make_noise(0)
    exact = m.expert.sample(arena, s, n, noise)
    plen = torch.tensor(n)
    bucketed = m.expert.sample(arena, s, plen, noise, rows=256)
    assert torch.allclose(exact, bucketed, atol=1e-5)
    assert torch.equal(bucketed, m.expert.sample(arena, s, plen, noise, rows=256))


@pytest.fixture(scope="module")
def cuda_model():
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device; none here")
    return build_model(get_preset("tiny"), "cuda")


def prefilled(model, n_slots):
    arena = model.new_arena(n_slots + 1, 512)
    for i in range(n_slots):
        s = arena.allocate()
        model.prefill(arena, s, model.embed_prefix(synthetic_observation(model.cfg, i)))
    return arena


@needs_cuda
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_decode_replay_equals_eager(cuda_model, batch):
    m = cuda_model
    eager, graphed = prefilled(m, batch), prefilled(m, batch)
    runner = GraphRunner(m, graphed)
    ids = torch.arange(batch, device="cuda") + 40
    slots = list(range(batch))
    for _ in range(4):
        want = m.decode(eager, slots, ids)
        m.graphs = runner
        got = m.decode(graphed, slots, ids)
        m.graphs = None
        assert torch.equal(want, got)
        ids = want.argmax(-1)
    assert runner.replays == 4
    for s in slots:
        n = eager.slot_len(s)
        assert torch.equal(eager.k[:, s, :n], graphed.k[:, s, :n])


@needs_cuda
def test_denoise_replay_equals_eager_and_survives_restore(cuda_model):
    m = cuda_model
    arena = prefilled(m, 1)
    n = arena.slot_len(0)
    runner = GraphRunner(m, arena)
    noise = m.make_noise(7)
    rows = next(b for b in runner.denoise_buckets if b >= n)
    want = m.expert.sample(arena, 0, torch.tensor(n, device="cuda"), noise, rows=rows)
    got = runner.sample_actions(0, n, noise)
    assert torch.equal(want, got)
    ident = identity_of(m, arena)
    cap = capture("c", arena, None, ident)
    arena.k.normal_()
    arena.v.normal_()
    restore(cap, arena, None, ident)
    graphs_before = len(runner._denoise)
    assert torch.equal(runner.sample_actions(0, n, noise), want)  # no recapture needed
    assert len(runner._denoise) == graphs_before
