"""Training batches: several turns per sample, the `actions` kind's bins ids, and length
buckets whose accumulated gradients equal the whole batch's."""

import numpy as np
import pytest
import torch

from embodied_kv.model.action_tokens import BinTokenizer
from embodied_kv.model.prompt import WordTokenizer
from embodied_kv.model.trained import world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.batch import IGNORE, make_batch
from embodied_kv.train.loop import length_buckets
from embodied_kv.train.losses import compute_losses
from embodied_kv.world.dataset import DataConfig, make_sample


def _samples(kind: str, n: int = 1, **data):
    mix = tuple(float(k == kind) for k in ("answer", "plan", "narration", "actions"))
    cfg = DataConfig(text_mix=mix, **data)
    return [make_sample(cfg, s) for s in range(n)]


def test_turns_are_labelled_where_the_engine_predicts_them(tmp_path):
    tok = WordTokenizer(save_tokenizer(tmp_path / "tok.json"))
    cfg = world_config()
    for kind in ("answer", "plan"):
        (s,) = _samples(kind, turns=3)
        assert len(s.turns) == 3 and s.turns[0][0].startswith("\n")
        b = make_batch([s], tok, cfg)
        ids, labels = b.ids[0].tolist(), b.labels[0].tolist()
        targets = [(i, lab) for i, lab in enumerate(labels) if lab != IGNORE]
        # per turn: the answer word, then EOS; each label is the next input id
        assert [lab for _, lab in targets] == [
            x for _, t in s.turns for x in [*tok.encode(t, bos=False), tok.eos_id]
        ]
        assert all(ids[i + 1] == lab for i, lab in targets)
        # the first answer follows exactly the text the engine appends to the prompt
        first = targets[0][0]
        assert tok.decode(ids[int(b.prompt_len[0]) : first + 1]) == tok.decode(
            tok.encode(s.turns[0][0], bos=False)
        )


def test_actions_kind_carries_the_chunk_as_bins_ids(tmp_path):
    tok = WordTokenizer(save_tokenizer(tmp_path / "tok.json"))
    cfg = world_config()
    (s,) = _samples("actions")
    assert s.turns == ()
    b = make_batch([s], tok, cfg)
    p = int(b.prompt_len[0])
    labels = b.labels[0, : int(b.text_len[0])].tolist()
    bins = BinTokenizer(cfg.vocab_size, cfg.action_horizon, cfg.action_dim, 0, 384)
    want = bins.encode(s.actions)
    assert labels[p - 1 : -1] == want and labels[-1] == IGNORE
    assert b.ids[0, p : p + len(want)].tolist() == want
    assert min(want) >= 384 > tok.vocab_size  # above every word id
    chunk, ok = bins.decode(want)
    assert ok and np.abs(chunk - s.actions).max() <= 1 / 127


@pytest.mark.parametrize("parts", [2, 4])
def test_length_buckets_give_the_whole_batch_gradient(tmp_path, parts):
    tok_path = save_tokenizer(tmp_path / "tok.json")
    cfg = world_config()
    model = build_model(cfg, tokenizer_path=str(tok_path))
    model.train()
    samples = [make_sample(DataConfig(), s) for s in range(8)]
    groups = length_buckets(samples, parts)
    assert sorted(id(s) for p in groups for s in p) == sorted(id(s) for s in samples)
    assert len(groups) == parts

    def grads(groups):
        model.zero_grad()
        batches = [make_batch(g, model.tokenizer, cfg) for g in groups]
        for b in batches:  # flow off: its noise is drawn per bucket, in bucket order
            gen = torch.Generator().manual_seed(0)
            loss = compute_losses(model, b, gen, 0.0, b.size / 8)
            loss.total.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole, split = grads([samples]), grads(groups)
    assert len(whole) == len(split)
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_turn_counts_score_first_words_and_whole_answers(tmp_path):
    """Two-hop path answers all begin with "in": the whole-answer count tells a wrong
    place from a right one where the first-word count cannot."""
    from embodied_kv.train.losses import turn_counts, turn_starts

    tok = WordTokenizer(save_tokenizer(tmp_path / "tok.json"))
    samples = _samples("plan", 2, turns=3, two_hop_share=1.0, two_hop_answer="path")
    samples += _samples("answer", 1, turns=2)
    b = make_batch(samples, tok, world_config())
    rows, cols = (b.labels != IGNORE).nonzero(as_tuple=True)
    right = torch.ones(len(rows), dtype=torch.bool)
    starts = turn_starts(b, rows, cols)
    assert turn_counts(b, rows, starts, right) == (
        {"plan": [6, 6], "answer": [2, 2]}, {"plan": [6, 6], "answer": [2, 2]}
    )
    # every turn's last word (the place; EOS follows) wrong in the first sample
    nxt = b.labels[rows, (cols + 1).clamp(max=b.labels.shape[1] - 1)]
    wrong = (rows == 0) & (nxt == tok.eos_id) & (cols + 1 < b.labels.shape[1])
    first, whole = turn_counts(b, rows, starts, right & ~wrong)
    assert first == {"plan": [6, 6], "answer": [2, 2]}
    assert whole == {"plan": [3, 6], "answer": [2, 2]}
    # the answers' first words wrong: both counts lose those turns
    first_rows = b.labels[rows, cols - 1] == IGNORE
    first, whole = turn_counts(b, rows, starts, right & ~(first_rows & (rows == 2)))
    assert first == {"plan": [6, 6], "answer": [0, 2]} and whole["answer"] == [0, 2]
