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
