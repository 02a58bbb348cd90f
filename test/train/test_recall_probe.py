"""The recall probe: its lookup batches say what they claim, runs are seeded, the CLI
writes its records (the probe's finding itself is a measurement: docs/keep_research.md)."""

import json

import pytest
import torch

from embodied_kv.cli import main
from embodied_kv.model.config import get_preset
from embodied_kv.model.trained import world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import save_weights
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.recall_probe import (
    IGNORE,
    ProbeConfig,
    chain_batch,
    escape_step,
    greedy_place_accuracy,
    lookup_batch,
    lookup_logits,
    run_probe,
    word_ids,
    world_batch,
)


def world_model(tmp_path):
    tok = save_tokenizer(tmp_path / "tokenizer.json")
    return build_model(world_config("world", 0), "cpu", torch.float32, tokenizer_path=str(tok))


def chain_facts(row: list[int], dot: int, query: int):
    """A chain row's facts -> (facts, {container: place}, {movable: container}), keys and
    values as word ids."""
    facts, fact = [], []
    for t in row[: row.index(query)]:
        fact.append(t)
        if t == dot:
            facts.append(fact)
            fact = []
    place = {tuple(f[:2]): f[2] for f in facts if len(f) == 4}
    holder = {tuple(f[:2]): tuple(f[2:4]) for f in facts if len(f) == 5}
    return facts, place, holder


@pytest.mark.parametrize("data,width", [("chain", 1), ("chain-cot", 3)])
def test_chain_labels_name_the_movable_s_container_s_place(tmp_path, data, width):
    """Two hops: the movable's fact names a container, the container's fact its place.
    `chain` labels the place at each ':', `chain-cot` the container's two words, then it."""
    model = world_model(tmp_path)
    words = word_ids(model.tokenizer)
    cfg = ProbeConfig(pairs=8, queries=8, batch=4, data=data)
    ids, labels = chain_batch(torch.Generator().manual_seed(5), words, cfg)
    dot, query, colon = words["frame"]
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        facts, place, holder = chain_facts(row, dot, query)
        assert len(facts) == cfg.pairs and len(place) == len(holder) == 4
        assert set(place.values()) <= set(words["place"])
        at = [j for j, x in enumerate(lab) if x != IGNORE]
        assert len(at) == width * cfg.queries
        for j in at[::width]:
            assert row[j] == colon and row[j - 3] == query
            box = holder[(row[j - 2], row[j - 1])]
            want = [place[box]] if width == 1 else [*box, place[box]]
            assert lab[j : j + width] == want == row[j + 1 : j + 1 + width]


def test_greedy_place_accuracy_decodes_the_answer_as_a_plan_would(tmp_path):
    """One answer word (`chain`): greedy from each ':' is the teacher-forced argmax there.
    Three (`chain-cot`): the place is read after the model's own container words."""
    model = world_model(tmp_path)
    cfg = ProbeConfig(pairs=6, queries=4, batch=3, data="chain", steps=3)
    run_probe(model, cfg)
    ids, labels = chain_batch(torch.Generator().manual_seed(7), word_ids(model.tokenizer), cfg)
    with torch.no_grad():
        pred = lookup_logits(model.backbone, ids).argmax(-1)
    mask = labels != IGNORE
    forced = float((pred[mask] == labels[mask]).float().mean())
    assert greedy_place_accuracy(model, cfg, seed=7) == pytest.approx(forced)
    cot = ProbeConfig(pairs=6, queries=4, batch=3, data="chain-cot")
    assert 0.0 <= greedy_place_accuracy(model, cot, seed=7) <= 1.0
    with pytest.raises(ValueError, match="chain"):
        greedy_place_accuracy(model, ProbeConfig())


def test_every_label_is_the_place_of_the_queried_key(tmp_path):
    model = world_model(tmp_path)
    words = word_ids(model.tokenizer)
    cfg = ProbeConfig(pairs=8, queries=8, batch=4)
    ids, labels = lookup_batch(torch.Generator().manual_seed(3), words, cfg)
    dot, query, colon = words["frame"]
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        facts = {(row[i], row[i + 1]): row[i + 2] for i in range(0, 4 * cfg.pairs, 4)}
        assert len(facts) == cfg.pairs and row[3 : 4 * cfg.pairs : 4] == [dot] * cfg.pairs
        at = [j for j, x in enumerate(lab) if x != IGNORE]
        assert len(at) == cfg.queries
        for j in at:
            assert row[j] == colon and row[j - 3] == query
            assert facts[(row[j - 2], row[j - 1])] == lab[j] == row[j + 1]
            assert lab[j] in words["place"]


def test_probe_runs_are_seeded_and_redraw_the_embedding(tmp_path):
    cfg = ProbeConfig(steps=4, batch=4, log_every=2, seed=5, embed_std=0.088)
    runs = []
    for _ in range(2):
        model = world_model(tmp_path)
        runs.append(run_probe(model, cfg))
    assert runs[0] == runs[1] and [r["step"] for r in runs[0]] == [2, 4]
    std = float(model.backbone.embed_tokens.weight.std())
    assert abs(std - 0.088) < 0.005, std
    assert escape_step([{"step": 100, "acc": 0.4}, {"step": 200, "acc": 0.7}]) == 200
    assert escape_step([{"step": 100, "acc": 0.4}]) is None


def test_cli_writes_every_run(tmp_path, capsys):
    out = tmp_path / "probe.json"
    argv = ["recall-probe", "--steps", "2", "--seeds", "1,2", "--embed-std", "0,0.088",
            "--json", str(out)]
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["embed_std"], r["seed"]) for r in runs] == [(0, 1), (0, 2), (0.088, 1), (0.088, 2)]
    assert "0/2 runs learned the lookup" in capsys.readouterr().out
    assert main(["recall-probe", "--steps", "2", "--pairs", "99"]) == 2


def test_cli_layers_builds_a_fresh_backbone_of_that_depth(tmp_path, monkeypatch):
    from embodied_kv.train import recall_probe

    depths = []
    real = recall_probe.run_probe

    def spy(model, cfg, on_record=None):
        depths.append(len(model.backbone.layers))
        return real(model, cfg, on_record)

    monkeypatch.setattr(recall_probe, "run_probe", spy)
    argv = ["recall-probe", "--data", "chain", "--layers", "2", "--steps", "2", "--seeds", "1",
            "--embed-std", "0.088"]  # fmt: skip
    assert main(argv) == 0 and depths == [2]
    assert main([*argv, "--init", str(tmp_path / "w.safetensors")]) == 2  # one or the other


def test_world_batches_label_each_answer_of_the_world_text(tmp_path):
    model = world_model(tmp_path)
    tok = model.tokenizer
    cfg = ProbeConfig(pairs=4, queries=3, batch=3, data="world")
    ids, labels = world_batch(torch.Generator().manual_seed(1), tok, cfg)
    places = set(word_ids(tok)["place"])
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        at = [j for j, x in enumerate(lab) if x != IGNORE]
        assert len(at) == cfg.queries and row[0] == tok.bos_id
        for j in at:
            assert tok.decode(row[j - 1 : j + 1]).split() == ["Answer", ":"]
            assert lab[j] == row[j + 1] and lab[j] in places
    assert run_probe(world_model(tmp_path), ProbeConfig(steps=2, batch=2, data="world"))
    with pytest.raises(ValueError, match="containers"):
        ProbeConfig(data="world", pairs=9)


def test_world_batches_with_updates_label_the_latest_place(tmp_path):
    """--updates: a stream holds later facts about its containers; each label is the place
    in the latest fact about the queried container, and some streams hold an earlier,
    different place for it (else the test would not tell latest from first)."""
    tok = world_model(tmp_path).tokenizer
    cfg = ProbeConfig(pairs=4, queries=3, batch=16, data="world", updates=8)
    ids, labels = world_batch(torch.Generator().manual_seed(2), tok, cfg)
    superseded = 0
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        facts = tok.decode(row).split("Query")[0].split(" .")
        for j in (j for j, x in enumerate(lab) if x != IGNORE):
            subject = " ".join(tok.decode(row[:j]).split("where is the ")[-1].split()[:2])
            said = [f.split()[-1] for f in facts if f"the {subject} is on the" in f]
            assert tok.decode([lab[j]]).strip() == said[-1]
            superseded += len(set(said)) > 1
    assert superseded > 0
    with pytest.raises(ValueError, match="updates"):
        ProbeConfig(data="pairs", updates=2)


def test_init_starts_from_a_weights_file_and_a_bad_one_is_refused(tmp_path, capsys):
    """--init: the shipped world weights (their embedding kept at --embed-std 0) start the
    run, so its first window differs from a fresh init's; a file of another preset is
    refused with its reason and exit 2, nothing trained."""
    shipped = "embodied_kv/data/world/weights.safetensors"
    outs = []
    for extra in ([], ["--init", shipped]):
        out = tmp_path / f"probe{len(outs)}.json"
        argv = ["recall-probe", "--steps", "1", "--seeds", "1", "--embed-std", "0",
                "--json", str(out), *extra]  # fmt: skip
        assert main(argv) == 0
        outs.append(json.loads(out.read_text()))
    assert outs[1]["args"]["init"] == shipped
    assert outs[0]["runs"][0]["records"] != outs[1]["runs"][0]["records"]
    bad = tmp_path / "other.safetensors"
    save_weights(build_model(get_preset("tiny")), bad)
    assert main(["recall-probe", "--steps", "1", "--seeds", "1", "--init", str(bad)]) == 2
    assert "another model config" in capsys.readouterr().err
