"""The training forward computes what the engine computes: prefill and appended-text
logits, and the action expert's velocity, for the same samples and weights."""

import torch

from embodied_kv.model.trained import world_config
from embodied_kv.model.vla import Observation, build_model
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.batch import IGNORE, make_batch
from embodied_kv.train.forward import backbone_forward, expert_velocity, text_logits
from embodied_kv.world.dataset import DataConfig, make_sample

TOL = 1e-4  # fp32 on CPU: dense sdpa vs the packed reference, different summation order


@torch.no_grad()
def test_dense_training_forward_matches_the_engine(tmp_path):
    cfg = world_config()
    model = build_model(cfg, tokenizer_path=str(save_tokenizer(tmp_path / "tok.json")))
    samples = [make_sample(DataConfig(), s) for s in (0, 1, 2, 3)]
    assert {s.kind for s in samples} >= {"plan", "narration"}
    batch = make_batch(samples, model.tokenizer, cfg)
    out = backbone_forward(model, batch)
    for i, s in enumerate(samples):
        arena = model.new_arena(1, 256)
        prefix = model.embed_prefix(Observation(torch.from_numpy(s.images), s.state,
                                                s.instruction))  # fmt: skip
        p = prefix.embeds.shape[0]
        assert p == int(out.prefix_len[i])
        got = model.prefill(arena, 0, prefix)
        col = int(batch.prompt_len[i]) - 1
        ref = text_logits(model, out, torch.tensor([i]), torch.tensor([col]))[0]
        assert (got - ref).abs().max() < TOL
        noise = model.make_noise(i)
        t = torch.tensor(0.37)
        v_engine = model.expert.velocity(noise, t, arena, 0, p)
        sub = type(out)(out.hidden[i : i + 1], [k[i : i + 1] for k in out.keys],
                        [v[i : i + 1] for v in out.values], out.prefix_len[i : i + 1],
                        out.image_tokens)  # fmt: skip
        v_train = expert_velocity(model, sub, noise[None], t.reshape(1))[0]
        assert (v_engine - v_train).abs().max() < TOL
        if s.suffix:  # the question / facts appended causally, as manager.create does
            ids = model.tokenizer.encode(s.suffix, bos=False)
            got = model.append(arena, 0, torch.tensor(ids))
            col = int(batch.prompt_len[i]) + len(ids) - 1
            ref = text_logits(model, out, torch.tensor([i]), torch.tensor([col]))[0]
            assert (got - ref).abs().max() < TOL
        # the first label sits exactly where the engine reads its first token's logits
        first = int((batch.labels[i] != IGNORE).nonzero()[0])
        assert first == col


@torch.no_grad()
def test_per_row_flow_times_match_the_engine_s_held_prefix(tmp_path):
    """Training-time RTC: the training forward with a flow time per action row (the first
    d rows clean at t = 0) computes what the engine's prefixed loop does at a step
    (model/rtc_prefix.py row_modulation), for the same sample and weights."""
    from embodied_kv.model.rtc_prefix import row_modulation

    cfg = world_config()
    model = build_model(cfg, tokenizer_path=str(save_tokenizer(tmp_path / "tok.json")))
    s = make_sample(DataConfig(), 0)
    batch = make_batch([s], model.tokenizer, cfg)
    out = backbone_forward(model, batch)
    arena = model.new_arena(1, 256)
    prefix = model.embed_prefix(Observation(torch.from_numpy(s.images), s.state, s.instruction))
    p = prefix.embeds.shape[0]
    model.prefill(arena, 0, prefix)
    ex, h, d = model.expert, cfg.action_horizon, 4
    x = model.make_noise(0)
    t = torch.tensor([0.37])
    held = (torch.arange(h) < d)[:, None]
    mod = row_modulation(held, ex.modulation(torch.zeros(1)), ex.modulation(t), 0)
    ctx = ex.context(None, h, p, None, x.device, None, mod)
    v_engine = ex.velocity_at(x, ctx, 0, arena, 0, p).float()
    t_rows = torch.where(held[:, 0], 0.0, t)[None]  # [1, H]
    v_train = expert_velocity(model, out, x[None], t_rows)[0]
    assert (v_engine - v_train).abs().max() < TOL
    same = expert_velocity(model, out, x[None], t.expand(1, h))[0]  # every row at t
    assert (same - expert_velocity(model, out, x[None], t)[0]).abs().max() < TOL
    assert (v_train[:d] - same[:d]).abs().max() > 10 * TOL  # t = 0 changes those rows
