"""A few dozen training steps lower the loss; the checkpoint loads into the engine."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from embodied_kv.cli import main
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.loading import own_layout_config
from embodied_kv.model.trained import TOKENIZER_FILE, WEIGHTS_FILE, load_trained
from embodied_kv.model.vla import Observation
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.loop import call_over, data_at, lr_at, run_done, train
from embodied_kv.train.resume import STATE_FILE, ResumeError, config_changes, run_fingerprint
from embodied_kv.world.dataset import DataConfig
from embodied_kv.world.render import observation_images
from embodied_kv.world.scene import make_scene

STEPS = 36
WINDOW = 6


def test_loss_falls_and_checkpoint_runs_in_the_engine(tmp_path):
    cfg = TrainConfig(out=str(tmp_path), steps=STEPS, batch=6, lr=3e-3, warmup=4,
                      log_every=1, ckpt_every=1000)  # fmt: skip
    records = train(cfg, progress=False)
    assert len(records) == STEPS
    first = np.mean([r["loss"] for r in records[:WINDOW]])
    last = np.mean([r["loss"] for r in records[-WINDOW:]])
    # from ~8.5 (ln 384 text + ~2.7 flow) to below 4 in this many steps; step-to-step
    # noise of the batch mean is ~0.3, so random fluctuation could not give a drop of half
    assert last < 0.5 * first, (first, last)
    assert np.mean([r["flow"] for r in records[-WINDOW:]]) < np.mean(
        [r["flow"] for r in records[:WINDOW]]
    )
    logged = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(STEPS))
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes left nothing behind
    assert (tmp_path / WEIGHTS_FILE).stat().st_mode & 0o777 == 0o644  # readable, shippable

    model = load_trained(tmp_path / WEIGHTS_FILE)
    assert model.cfg.tokenizer == "words" and (tmp_path / TOKENIZER_FILE).is_file()
    engine = Engine(EngineConfig(control_hz=1e-3, history=0, auto_episode_capsule=False,
                                 answer_tokens=4), model=model)  # fmt: skip
    scene = make_scene(np.random.default_rng(0))
    images = observation_images(scene, model.cfg.vision.image_size)
    engine.observe(Observation(torch.from_numpy(images), scene.state(),
                               "put the red ball in the blue box"))  # fmt: skip
    request_id, refused = engine.ask("how many red objects are there ?")
    assert refused is None
    result = engine.cycle(0)
    assert result.chunk.shape == (10, 8) and np.isfinite(result.chunk).all()
    assert any(e.request_id == request_id and e.done for e in result.events)


def test_same_seed_same_weights(tmp_path):
    for name in ("a", "b"):
        train(TrainConfig(out=str(tmp_path / name), steps=2, batch=2), progress=False)
    # tensor bytes, not file bytes: safetensors writes its metadata map in hash order
    a, b = (load_file(tmp_path / name / WEIGHTS_FILE) for name in ("a", "b"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_data_workers_make_the_same_run(tmp_path):
    """Samples rendered by worker processes (a GPU run's data loader) are the in-process
    samples: same weights in bytes after steps that cross the curriculum's boundary."""
    for name, workers in (("inline", 0), ("workers", 2)):
        cfg = TrainConfig(out=str(tmp_path / name), steps=3, batch=3, curriculum=2,
                          data_workers=workers)  # fmt: skip
        train(cfg, progress=False)
    a, b = (load_file(tmp_path / name / WEIGHTS_FILE) for name in ("inline", "workers"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="data_workers"):
        TrainConfig(steps=1, data_workers=-1)


def test_bad_train_config_and_missing_weights(tmp_path):
    with pytest.raises(ValueError, match="steps > 0 or minutes > 0"):
        TrainConfig()
    with pytest.raises(ValueError, match="does not exist"):
        load_trained(tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match="curriculum"):
        TrainConfig(steps=1, curriculum=-1)
    with pytest.raises(ValueError, match="buckets=0"):
        TrainConfig(steps=1, buckets=0)


def test_curriculum_starts_with_one_hop_static_facts():
    cfg = TrainConfig(steps=10, curriculum=5)
    data = DataConfig(two_hop_share=0.5, memory_updates=2)
    assert (data_at(cfg, data, 4).two_hop_share, data_at(cfg, data, 4).memory_updates) == (0, 0)
    assert data_at(cfg, data, 5) == data


def test_the_ramp_grows_updates_and_two_hop_queries_after_the_curriculum():
    cfg = TrainConfig(steps=100, curriculum=10, ramp=40)
    data = DataConfig(two_hop_share=0.5, memory_updates=24, memory_objects=8)
    at = {s: data_at(cfg, data, s) for s in (9, 10, 30, 49, 50, 99)}
    assert at[9].memory_objects == 2 and at[10].memory_objects == 8  # the curriculum ends
    assert [(at[s].memory_updates, at[s].two_hop_share) for s in (10, 30, 49)] == [
        (0, 0.0), (12, 0.25), (23, 0.4875)]
    assert at[50] == at[99] == data
    with pytest.raises(ValueError, match="ramp=-1"):
        TrainConfig(steps=1, ramp=-1)


def test_cli_train(tmp_path, capsys):
    assert main(["train", "--steps", "2", "--batch", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / WEIGHTS_FILE).is_file() and "trained 2 steps" in capsys.readouterr().out
    # --buckets reaches the run's config: a resume with another split is refused by name
    run = ["train", "--steps", "2", "--batch", "4", "--out", str(tmp_path / "b")]
    assert main([*run, "--buckets", "3", "--until", "1"]) == 0
    assert main([*run, "--buckets", "2", "--resume"]) == 2
    assert "buckets: saved 3, now 2" in capsys.readouterr().err
    assert main([*run, "--buckets", "3", "--resume"]) == 0


def test_minutes_budget_stops_on_time_and_anneals_by_time(tmp_path):
    records = train(TrainConfig(out=str(tmp_path), minutes=0.03, batch=2), progress=False)
    assert records and records[-1]["seconds"] < 0.03 * 60 + 2.0
    cfg = TrainConfig(steps=100, minutes=10, warmup=10, lr=1.0)
    assert run_done(cfg, 50, 60.0) == 0.5 and run_done(cfg, 10, 300.0) == 0.5
    assert lr_at(cfg, 0, 0.0) == 0.1 and lr_at(cfg, 20, 0.0) == 1.0
    assert lr_at(cfg, 99, 1.0) == pytest.approx(0.1)


def test_fine_tuning_starts_from_the_given_weights(tmp_path):
    """--init: step 0 of a fine-tune sees the loaded weights (its loss equals the loss of
    those weights on step 0's batch, far below a fresh init's), and the CLI passes the
    memory-stream flags through to the data."""
    base = tmp_path / "base"
    train(TrainConfig(out=str(base), steps=24, batch=6, lr=3e-3, warmup=4), progress=False)
    runs = {}
    for name, init in (("fresh", ""), ("tuned", str(base / WEIGHTS_FILE))):
        cfg = TrainConfig(out=str(tmp_path / name), steps=1, batch=6, init=init, curriculum=0,
                          data=DataConfig(memory_objects=8, memory_updates=24))  # fmt: skip
        runs[name] = train(cfg, progress=False)[0]["loss"]
    assert runs["tuned"] < 0.6 * runs["fresh"], runs
    other_seed = tmp_path / "seed3"  # data seed 3; the model keeps the file's init seed 0
    train(TrainConfig(out=str(other_seed), steps=1, batch=2, seed=3, init=str(base / WEIGHTS_FILE)),
          progress=False)  # fmt: skip
    assert own_layout_config(other_seed / WEIGHTS_FILE).seed == 0
    with pytest.raises(ValueError, match="do not exist"):
        TrainConfig(steps=1, init=str(tmp_path / "none.safetensors"))
    with pytest.raises(ValueError, match="memory_objects"):
        DataConfig(memory_objects=9)  # the vocabulary names 8 distinct containers
    out = tmp_path / "cli"
    argv = ["train", "--steps", "1", "--batch", "2", "--out", str(out), "--init",
            str(base / WEIGHTS_FILE), "--memory-objects", "8", "--memory-updates", "30",
            "--text-mix", "0.25,0.5,0.05,0.2", "--memory-hard", "0.8", "--turns", "8",
            "--two-hop-share", "0.5", "--two-hop-answer", "path"]
    assert main(argv) == 0 and (out / WEIGHTS_FILE).is_file()
    with safe_open(str(out / "train_state.safetensors"), "pt") as f:
        data = json.loads(f.metadata()["config"])["data"]
    assert (data["two_hop_answer"], data["turns"], data["memory_hard"]) == ("path", 8, 0.8)
    assert main(["train", "--steps", "1", "--memory-objects", "99"]) == 2
    assert main(["train", "--steps", "1", "--text-mix", "1,0"]) == 2  # four weights
    assert main(["train", "--steps", "1", "--two-hop-share", "2"]) == 2  # a share
    assert main(["train", "--steps", "1", "--turns", "0"]) == 2
    assert main(["train", "--steps", "1", "--two-hop-answer", "route"]) == 2


def test_embed_std_draws_the_fresh_text_embedding(tmp_path):
    """--embed-std: a fresh run's text embedding is drawn at that std (one step of
    warmup barely moves it); the default keeps the model's 0.02; with --init the file's
    embedding stays; out of range is refused with the reason."""
    stds = {}
    for name, extra in (("wide", ["--embed-std", "0.088"]), ("default", [])):
        out = tmp_path / name
        assert main(["train", "--steps", "1", "--batch", "2", "--out", str(out), *extra]) == 0
        stds[name] = float(load_file(out / WEIGHTS_FILE)["backbone.embed_tokens.weight"].std())
    assert stds["wide"] == pytest.approx(0.088, rel=0.05), stds
    assert stds["default"] == pytest.approx(0.02, rel=0.05), stds
    tuned = tmp_path / "tuned"
    argv = ["train", "--steps", "1", "--batch", "2", "--out", str(tuned), "--embed-std", "0.5",
            "--init", str(tmp_path / "default" / WEIGHTS_FILE)]
    assert main(argv) == 0
    std = float(load_file(tuned / WEIGHTS_FILE)["backbone.embed_tokens.weight"].std())
    assert std == pytest.approx(stds["default"], rel=0.05)
    assert main(["train", "--steps", "1", "--embed-std", "1.5"]) == 2
    with pytest.raises(ValueError, match="embed_std"):
        TrainConfig(steps=1, embed_std=-0.1)


def test_a_run_in_calls_ends_with_the_weights_of_one_call(tmp_path):
    """until + resume: the same optimiser moments, patch head, noise and schedule, so the
    same weights bytes as one uninterrupted run; the log holds every step once."""
    base = dict(steps=5, batch=3, curriculum=2, warmup=2, log_every=1, ckpt_every=2)
    train(TrainConfig(out=str(tmp_path / "one"), **base), progress=False)
    cut = tmp_path / "cut"
    first = train(TrainConfig(out=str(cut), until=3, **base), progress=False)
    assert [r["step"] for r in first] == [0, 1, 2]
    rest = train(TrainConfig(out=str(cut), resume=True, **base), progress=False)
    assert [r["step"] for r in rest] == [3, 4]
    a, b = load_file(tmp_path / "one" / WEIGHTS_FILE), load_file(cut / WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (load_file(d / STATE_FILE) for d in (tmp_path / "one", cut))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    logged = [json.loads(x)["step"] for x in (cut / "train_log.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2, 3, 4]


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys):
    base = dict(steps=4, batch=2, curriculum=0, ckpt_every=100)
    out = tmp_path / "run"
    with pytest.raises(ResumeError, match="nothing to resume"):
        train(TrainConfig(out=str(out), resume=True, **base), progress=False)
    train(TrainConfig(out=str(out), until=1, **base), progress=False)
    weights = (out / WEIGHTS_FILE).read_bytes()
    state = (out / STATE_FILE).read_bytes()
    with pytest.raises(ResumeError, match=r"holds a saved run \(step 1\): --resume"):
        train(TrainConfig(out=str(out), **base), progress=False)  # a forgotten --resume
    assert (out / STATE_FILE).read_bytes() == state
    with pytest.raises(ResumeError, match="another config"):
        train(TrainConfig(out=str(out), resume=True, **{**base, "batch": 3}), progress=False)
    (out / STATE_FILE).write_bytes(state[: len(state) // 2])  # a cut copy
    with pytest.raises(ResumeError, match="unreadable"):
        train(TrainConfig(out=str(out), resume=True, **base), progress=False)
    (out / STATE_FILE).write_bytes(state)
    assert (out / WEIGHTS_FILE).read_bytes() == weights  # refused calls changed nothing
    (out / WEIGHTS_FILE).write_bytes(b"cut")  # a kill after the state's write: no harm
    args = ["train", "--out", str(out), "--steps", "4", "--batch", "3", "--curriculum", "0",
            "--resume"]  # fmt: skip
    assert main(args) == 2 and "another config" in capsys.readouterr().err
    args[6] = "2"  # the run's own batch
    assert main([*args, "--until", "3"]) == 0
    assert "paused before step 3" in capsys.readouterr().out
    assert main(args) == 0 and "paused" not in capsys.readouterr().out
    with safe_open(str(out / STATE_FILE), framework="pt") as f:
        assert f.metadata()["step"] == "4"
    assert main(args[:-1]) == 2 and "holds a saved run (step 4)" in capsys.readouterr().err
    assert main([*args[:-1], "--overwrite", "--until", "1"]) == 0  # a new run in its place
    with safe_open(str(out / STATE_FILE), framework="pt") as f:
        assert f.metadata()["step"] == "1"


def test_a_call_ends_at_until_or_stop_after_but_the_schedule_does_not():
    cfg = TrainConfig(steps=100, until=40, stop_after=2.0, warmup=10, lr=1.0)
    assert not call_over(cfg, 39, 119.0)
    assert call_over(cfg, 40, 0.0) and call_over(cfg, 1, 120.0)
    assert not call_over(TrainConfig(steps=100), 99, 1e9)
    # the learning rate of step 50 is the same whether or not this call pauses there
    assert lr_at(cfg, 50, run_done(cfg, 50, 0.0)) == lr_at(
        TrainConfig(steps=100, warmup=10, lr=1.0), 50, 0.5
    )
    with pytest.raises(ValueError, match="until"):
        TrainConfig(steps=1, until=-1)


def test_a_saved_run_resumes_after_the_code_gains_an_option():
    cfg = TrainConfig(steps=10, lr=3e-4)
    saved = json.loads(run_fingerprint(cfg))
    del saved["embed_std"], saved["data"]["memory_hard"]  # options an older version lacked
    assert config_changes(json.dumps(saved), cfg) == []
    assert config_changes(json.dumps(saved), TrainConfig(steps=10, lr=3e-4, embed_std=0.1)) == [
        "embed_std: new option, 0.1 is not its default"
    ]
    assert config_changes(run_fingerprint(cfg), TrainConfig(steps=10, lr=1e-3)) == [
        "lr: saved 0.0003, now 0.001"
    ]
    # the schedule's length is the run's; where and how a call runs is the call's
    assert config_changes(run_fingerprint(cfg), TrainConfig(steps=10, lr=3e-4, minutes=5)) == [
        "minutes: saved 0.0, now 5"
    ]
    assert config_changes(run_fingerprint(cfg), TrainConfig(
        steps=10, lr=3e-4, threads=2, device="cuda", data_workers=4, until=3)) == []  # fmt: skip
    assert config_changes(json.dumps({**saved, "old": 1}), cfg) == [
        "old: saved 1, gone from the code"
    ]
    # prefix_max moved from the run into the data: off it resumes, on it draws otherwise now
    moved = {**saved, "prefix_max": 0}
    assert config_changes(json.dumps(moved), cfg) == []
    assert config_changes(json.dumps({**saved, "prefix_max": 8}), cfg) == [
        "prefix_max: saved 8, gone from the code"
    ]
