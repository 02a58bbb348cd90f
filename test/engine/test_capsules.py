"""FlashRT's correctness gate, extended: restore = never interrupted, bytes and tokens.

A request that ended between the snapshot and the restore (its final event has left)
is not replayed (issue 35, docs/requests.md): those gates compare everything else byte
for byte, and `test_capsule_of_an_engine_that_never_ended_its_requests_replays_them`
keeps the token-exact replay of requests that were still open."""

import pytest
import torch

from embodied_kv.engine.engine import EPISODE_START, Engine, EngineConfig
from embodied_kv.kv.capsule_store import StoreConfig
from embodied_kv.kv.manager import Status
from embodied_kv.model.synthetic import synthetic_observation


def make_engine(tiny_model, tmp_path, **kw):
    cfg = EngineConfig(
        control_hz=0.01,  # a period of minutes: decode work per cycle is max_decode_steps
        replan_every=5,
        narrate_every=1,
        narration_tokens=12,
        max_decode_steps=3,
        history=4,
        store=StoreConfig(disk_dir=str(tmp_path / "capsules")),
        **kw,
    )
    return Engine(cfg, model=tiny_model)


def episode_obs(model, episode, n):
    return [
        synthetic_observation(model.cfg, 100 * episode + i, f"episode {episode}") for i in range(n)
    ]


def base_id(request_id):
    """`narration-3@<epoch>` -> `narration-3`: a replay runs in a new epoch (timeline)."""
    return request_id.split("@")[0]


def run_cycles(engine, observations, first_tick=0):
    """-> (chunks, texts of requests finished on the way, by id without the epoch)"""
    chunks, texts = [], {}
    for i, obs in enumerate(observations):
        engine.observe(obs)
        res = engine.cycle(first_tick + 5 * i)
        chunks.append(res.chunk)
        texts.update({base_id(e.request_id): e.text for e in res.events if finished(e)})
    return chunks, texts


def finished(event):
    """Done by decoding (ok or truncated), not dropped by a restore."""
    return event.done and event.status is not Status.CANCELLED


def drain(engine):
    return {base_id(e.request_id): e.text for e in engine.finish_all() if finished(e)}


def open_ids(engine):
    """Requests of the session not ended yet (live or waiting), without the epoch."""
    live = {r.request_id for r in engine.manager.requests.values() if not r.done}
    return {base_id(r) for r in live | {t.request_id for t in engine.policy.pending()}}


def without(texts, ids):
    return {k: v for k, v in texts.items() if k not in ids}


def live_bytes(engine):
    arena = engine.manager.arena
    return {
        s: (arena.k[:, s, : arena.slot_len(s)].clone(), arena.v[:, s, : arena.slot_len(s)].clone())
        for s in arena.in_use()
    }


def scribble(engine, other_obs):
    """Run an unrelated episode, then overwrite every byte of the arena."""
    engine.begin_episode()
    run_cycles(engine, other_obs)
    engine.manager.arena.k.normal_()
    engine.manager.arena.v.normal_()


def test_restore_after_unrelated_episode_equals_never_interrupted(tiny_model, tmp_path):
    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    obs = episode_obs(tiny_model, 1, 7)
    run_cycles(e, obs[:4])
    info, ms = e.snapshot("mid", "gpu")
    assert info.nbytes > 0 and ms >= 0
    saved, ended = live_bytes(e), open_ids(e)  # all of them end before the restore
    ref_chunks, ref_texts = run_cycles(e, obs[4:], first_tick=20)
    ref_texts.update(drain(e))

    scribble(e, episode_obs(tiny_model, 2, 3))
    cap = e.store.load("mid")
    for s in saved:  # the capsule holds the bytes; what a restore copies is gated below
        assert torch.equal(saved[s][0], cap.tensors[f"kv.k.{s}"])
        assert torch.equal(saved[s][1], cap.tensors[f"kv.v.{s}"])
    e.restore("mid")
    assert ended and live_bytes(e) == {} and e.manager.requests == {}  # ended: not restored
    chunks, texts = run_cycles(e, obs[4:], first_tick=20)
    texts.update(drain(e))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(chunks, ref_chunks, strict=True))
    assert texts == without(ref_texts, ended) and len(texts) >= 3


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_restore_from_lower_tiers(tiny_model, tmp_path, tier):
    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    obs = episode_obs(tiny_model, 1, 5)
    run_cycles(e, obs[:3])
    e.snapshot("b", tier)
    assert e.store.info("b").tier == tier
    ended = open_ids(e)
    ref_chunks, ref_texts = run_cycles(e, obs[3:], 15)
    ref_texts.update(drain(e))
    scribble(e, episode_obs(tiny_model, 3, 2))
    e.restore("b")
    # host: promoted on restore; disk: stays there (it is meant to survive the process)
    assert e.store.info("b").tier == {"host": "gpu", "disk": "disk"}[tier]
    chunks, texts = run_cycles(e, obs[3:], 15)
    texts.update(drain(e))
    assert [c.tobytes() for c in chunks] == [c.tobytes() for c in ref_chunks]
    assert ended and texts == without(ref_texts, ended)


def test_restore_equals_cold_prefill_tokens_and_chunk(tiny_model):
    model = tiny_model
    obs = synthetic_observation(model.cfg, 5, "cold or restored")
    prefix = model.embed_prefix(obs)

    def continue_from(arena, slot, logits):
        tok, toks = logits.argmax().view(1), []
        for _ in range(32):
            toks.append(int(tok))
            tok = model.decode(arena, [slot], tok)[0].argmax().view(1)
        return toks

    cold = model.new_arena(2, 512)
    s = cold.allocate()
    lg = model.prefill(cold, s, prefix)
    n = cold.slot_len(s)
    cold_chunk = model.sample_actions(cold, s, n, model.make_noise(1))
    cold_tokens = continue_from(cold, s, lg)

    from embodied_kv.kv.capsule import capture, identity_of, restore

    warm = model.new_arena(2, 512)
    ident = identity_of(model, warm)
    s2 = warm.allocate()
    lg2 = model.prefill(warm, s2, prefix)
    cap = capture("p", warm, None, ident)
    warm.k.normal_()  # everything overwritten
    warm.release(s2)
    restore(cap, warm, None, ident)
    assert torch.equal(model.sample_actions(warm, s2, n, model.make_noise(1)), cold_chunk)
    assert continue_from(warm, s2, lg2) == cold_tokens


def test_restore_then_append_equals_append_without_capsules(tiny_model, tmp_path):
    model = tiny_model
    e = make_engine(tiny_model, tmp_path, num_slots=4)
    text = torch.tensor(model.tokenizer.encode("memory: the cup is on the left shelf", bos=False))
    plain = model.new_arena(2, 512)
    p = plain.allocate()
    model.prefill(plain, p, model.embed_prefix(episode_obs(model, 4, 1)[0]))
    ref = model.append(plain, p, text)

    arena = e.manager.arena
    s = arena.allocate()
    model.prefill(arena, s, model.embed_prefix(episode_obs(model, 4, 1)[0]))
    e.snapshot("pre")
    arena.v.normal_()
    e.restore("pre")
    assert torch.equal(model.append(arena, s, text), ref)


def test_fork_branches_equal_cold_prefill_of_prefix_plus_suffix(tiny_model, tmp_path):
    model = tiny_model
    e = make_engine(tiny_model, tmp_path, num_slots=6)
    prefix = model.embed_prefix(episode_obs(model, 5, 1)[0])
    arena = e.manager.arena
    s = arena.allocate()
    model.prefill(arena, s, prefix)
    e.snapshot("root")
    suffixes = ["left", "right", "up"]
    branches = e.fork("root", 3)
    assert len(branches) == 3 and len({b[0] for b in branches}) == 3
    outs = []
    for (slot,), suf in zip(branches, suffixes, strict=True):
        ids = torch.tensor(model.tokenizer.encode(suf, bos=False))
        lg = model.append(arena, slot, ids)
        cold = model.new_arena(1, 512)
        c = cold.allocate()
        model.prefill(cold, c, prefix)
        assert torch.equal(model.append(cold, c, ids), lg)
        outs.append(lg)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_rollback_by_steps_equals_the_earlier_boundary(tiny_model, tmp_path):
    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    obs = episode_obs(tiny_model, 6, 6)
    run_cycles(e, obs[:3])  # boundaries auto-1, auto-2, auto-3
    ended = open_ids(e)
    ref_chunks, ref_texts = run_cycles(e, obs[3:], 15)
    ref_texts.update(drain(e))
    e.rollback(steps_back=3)  # back to auto-3 (after the third cycle)
    assert e.frame == 3
    chunks, texts = run_cycles(e, obs[3:], 15)
    texts.update(drain(e))
    assert [c.tobytes() for c in chunks] == [c.tobytes() for c in ref_chunks]
    assert ended and texts == without(ref_texts, ended)
    with pytest.raises(ValueError, match="boundaries kept"):
        e.rollback(steps_back=99)


def test_capsule_of_an_engine_that_never_ended_its_requests_replays_them(tiny_model, tmp_path):
    """The token-exact gate for language: an engine snapshots to disk with requests live
    and stops there (a crash); another engine on the same folder restores the capsule and
    goes on: every token and chunk equals a third engine that was never interrupted."""
    obs = episode_obs(tiny_model, 1, 7)
    ref = make_engine(tiny_model, tmp_path / "ref")
    ref.begin_episode()
    run_cycles(ref, obs[:4])
    ref_chunks, ref_texts = run_cycles(ref, obs[4:], first_tick=20)
    ref_texts.update(drain(ref))

    first = make_engine(tiny_model, tmp_path)
    first.begin_episode()
    run_cycles(first, obs[:4])
    first.snapshot("mid", "disk")
    carried, saved = open_ids(first), live_bytes(first)
    second = make_engine(tiny_model, tmp_path)
    second.restore("mid")
    restored = live_bytes(second)
    assert saved.keys() == restored.keys()
    for s in saved:
        assert torch.equal(saved[s][0], restored[s][0]) and torch.equal(saved[s][1], restored[s][1])
    chunks, texts = run_cycles(second, obs[4:], first_tick=20)
    texts.update(drain(second))
    assert [c.tobytes() for c in chunks] == [c.tobytes() for c in ref_chunks]
    assert carried and carried <= set(texts) and texts == ref_texts and len(texts) >= 5


def test_kv_only_restore_diverges(tiny_model, tmp_path):
    """The ablation: KV without the generation state, queue and frame is not the state."""
    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    obs = episode_obs(tiny_model, 7, 5)
    run_cycles(e, obs[:3])
    e.snapshot("x")
    ref_chunks, ref_texts = run_cycles(e, obs[3:], 15)
    ref_texts.update(drain(e))
    e.restore("x", kv_only=True)
    chunks, texts = run_cycles(e, obs[3:], 15)
    texts.update(drain(e))
    assert texts != ref_texts or any(
        a.tobytes() != b.tobytes() for a, b in zip(chunks, ref_chunks, strict=True)
    )


def test_episode_reset_reproduces_first_chunks(tiny_model, tmp_path):
    e = make_engine(tiny_model, tmp_path)
    obs = episode_obs(tiny_model, 8, 3)
    e.begin_episode()
    first, _ = run_cycles(e, obs)
    for _ in range(2):
        run_cycles(e, episode_obs(tiny_model, 9, 2), 99)
        e.restore(EPISODE_START)
        again, _ = run_cycles(e, obs)
        assert [c.tobytes() for c in again] == [c.tobytes() for c in first]
    assert e.store.info(EPISODE_START).pinned


def test_refusals_name_the_problem(tiny_model, tmp_path):
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.vla import build_model

    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    run_cycles(e, episode_obs(tiny_model, 1, 1))
    e.snapshot("mine", "disk")
    other_weights = Engine(e.cfg, model=build_model(get_preset("tiny", seed=1)))
    with pytest.raises(ValueError, match="other weights"):
        other_weights.restore("mine")  # found on disk by the second engine's store
    other_cfg = make_engine(tiny_model, tmp_path, max_len=1024)
    with pytest.raises(ValueError, match="another config"):
        other_cfg.restore("mine")
    with pytest.raises(ValueError, match="unknown capsule 'nope'"):
        e.restore("nope")


def test_corrupted_disk_capsule_is_refused_and_store_keeps_working(tiny_model, tmp_path):
    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    run_cycles(e, episode_obs(tiny_model, 1, 2))
    e.snapshot("bad", "disk")
    e.snapshot("good", "disk")
    payload = tmp_path / "capsules" / "bad.safetensors"
    data = payload.read_bytes()
    payload.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="truncated or corrupted"):
        e.restore("bad")
    assert "bad" not in e.store
    assert not (tmp_path / "capsules" / "bad.safetensors").exists()  # its files went too
    e.snapshot("edited", "disk")
    manifest = tmp_path / "capsules" / "edited.json"
    manifest.write_text(manifest.read_text().replace('"frame"', '"frome"'))
    fresh = make_engine(tiny_model, tmp_path)  # adopts what looks like a capsule ...
    with pytest.raises(ValueError, match="digest"):
        fresh.restore("edited")  # ... and refuses it when its bytes do not match
    assert "edited" not in fresh.store and not manifest.exists()
    e.restore("good")


def test_budgets_demote_lru_and_never_pinned(tiny_model, tmp_path):
    e = make_engine(tiny_model, tmp_path)
    e.begin_episode()
    run_cycles(e, episode_obs(tiny_model, 1, 2))
    size = e.snapshot("probe")[0].nbytes
    e.store.delete("probe")
    from embodied_kv.kv.capsule_store import CapsuleStore

    e.store = CapsuleStore(
        StoreConfig(
            gpu_bytes=2 * size + 10, host_bytes=size + 10, disk_dir=str(tmp_path / "tiered")
        ),
        e.model.device,
    )
    e.snapshot("pinned", "gpu", pin=True)
    e.snapshot("a")
    e.snapshot("b")  # gpu over budget: the LRU unpinned one ("a") goes to host
    tiers = {c.name: c.tier for c in e.store.list()}
    assert tiers == {"pinned": "gpu", "a": "host", "b": "gpu"}
    e.snapshot("c")  # b -> host, host over budget: a -> disk
    tiers = {c.name: c.tier for c in e.store.list()}
    assert tiers == {"pinned": "gpu", "a": "disk", "b": "host", "c": "gpu"}
    e.restore("a")  # read from disk; nothing fails
    assert e.store.info("pinned").tier == "gpu"
    assert sum(1 for c in e.store.list()) == 4
    small = CapsuleStore(StoreConfig(host_bytes=size // 2), e.model.device)
    with pytest.raises(ValueError, match="exceeds the host budget"):
        small.put(e.store.load("c"), "host", pin=True)
