"""`bench rtc`'s timeline: the injected delay reaches the queue's measurement and RTC's
guide, switches and their jumps are counted where chunks land, temporal ensembling
averages landed chunks with ACT's weights. World presets with random weights (structure,
not skill); on the shipped world_smooth weights RTC joins the chunks (the full run:
bench/results/2026-11-27-cpu-intel-xeon-2core/rtc_full_dagger.json)."""

import numpy as np
import pytest

from embodied_kv.bench import rtc as bench
from embodied_kv.engine.loading import shipped_weights
from embodied_kv.eval import delayed
from embodied_kv.model.trained import TOKENIZER_FILE, load_trained, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer

from ..kv.conftest import world_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


@pytest.mark.parametrize("delay", [2, 8])
def test_injected_delay_is_measured_and_switches_counted(world_model, delay):  # noqa: F811
    ex = delayed.Guided("error")
    engine = delayed.make_engine(world_model, ex.rtc)
    trace = delayed.run_episode(engine, ex, bench.SEED, delay)
    period = max(delayed.REPLAN, delay)
    # every chunk after the first lands d ticks after its cycle starts, if within the budget
    ticks = delayed.TICKS
    landings = [t0 + delay for t0 in range(period, ticks, period) if t0 + delay < ticks]
    assert not trace.success  # random weights
    assert len(trace.actions) == delayed.TICKS  # every tick executed once
    assert len(trace.jumps) == len(landings)
    assert engine.queue.switches.last_delay == delay
    counters = engine.loop.rtc.counters
    assert counters.guided == counters.chunks - 1 and counters.last_delay == delay
    assert len(trace.lead_gaps) == counters.guided
    row = bench.summarise([trace])
    assert row["switches"] == len(trace.jumps) and row["ticks"] == delayed.TICKS
    assert row["jump_max"] == max(trace.jumps)


def test_ensemble_weights_the_oldest_chunk_most():
    ex = delayed.Ensemble()

    class _Queue:
        def pop(self, tick):
            return np.zeros(2), False

    class _Engine:
        queue = _Queue()
        robot = type("R", (), {"action_dim": 2})()

    ex.reset(_Engine())
    ex.landed(np.ones((4, 2)), 0)
    ex.landed(3 * np.ones((4, 2)), 2)
    assert ex.action(1).tolist() == [1.0, 1.0]
    w = np.exp(-delayed.ENSEMBLE_M * np.arange(2))
    want = (w[0] * 1 + w[1] * 3) / w.sum()
    assert np.allclose(ex.action(3), want)
    assert ex.action(9).tolist() == pytest.approx([want, want])  # none covers: the last


def test_the_smooth_world_runs_with_its_30_action_chunk(tmp_path):
    """`--preset world_smooth` (the default): a 30-action chunk covers d = 8 and the cycle
    after it, so every switch is from one landed chunk to the next (none runs out)."""
    tok = save_tokenizer(tmp_path / TOKENIZER_FILE)
    model = build_model(world_config("world_smooth"), tokenizer_path=str(tok))
    ex = delayed.Guided("error")
    engine = delayed.make_engine(model, ex.rtc)
    assert engine.loop.model.cfg.action_horizon == 30 and bench.DEFAULT_WORLD == "world_smooth"
    trace = delayed.run_episode(engine, ex, bench.SEED, 8)
    assert len(trace.actions) == delayed.TICKS
    assert len(trace.switch_gaps) == len(trace.jumps) > 0  # the old chunk held every switch
    counters = engine.loop.rtc.counters
    assert counters.guided == counters.chunks - 1 and counters.last_delay == 8


def test_rtc_joins_the_shipped_smooth_world_s_chunks():
    """The issue's measurement in small (bench rtc: 60 episodes, 4.4x at d = 8): on the
    shipped world_smooth weights at d = 8, guided chunks (`error`) join the executing one:
    the largest jump at a switch at least halves and what chunking adds at the switch (the
    gap to the old chunk's action) falls at least 10x. Deterministic on a CPU."""
    model = load_trained(shipped_weights("world_smooth"))
    rows = {}
    for ex in (delayed.Naive(), delayed.Guided("error")):
        engine = delayed.make_engine(model, ex.rtc)
        rows[ex.name] = bench.summarise(
            [delayed.run_episode(engine, ex, bench.SEED + e, 8) for e in range(3)]
        )
    naive, rtc = rows["naive"], rows["rtc-error"]
    assert naive["switches"] > 0 and rtc["switches"] > 0
    assert rtc["jump_max"] <= naive["jump_max"] / 2, (naive, rtc)
    assert rtc["switch_gap"] <= naive["switch_gap"] / 10, (naive, rtc)


def test_guided_executors_take_the_rtc_settings(world_model):  # noqa: F811
    """`bench rtc --schedule hard --max-guidance B`: the guided methods' engines guide with
    that schedule (W = 1 on the d stale actions, 0 after) and beta; rtc-prefix always holds
    the stale actions alone, rtc-prefix-band guides `--prefix-band` rows after them."""
    guided = [ex for ex in delayed.methods(0, schedule="hard", max_guidance=2.0) if ex.rtc.enabled]
    assert [ex.name for ex in guided] == ["rtc-vjp", "rtc-error", "rtc-prefix", "rtc-prefix-band"]
    assert all(ex.rtc.schedule == "hard" and ex.rtc.max_guidance == 2.0 for ex in guided)
    band = {ex.name: ex.rtc for ex in delayed.methods(0, 7) if ex.rtc.enabled}
    assert band["rtc-prefix"].schedule == "hard" and band["rtc-prefix-band"].schedule == "exp"
    assert band["rtc-prefix-band"].band == 7 and band["rtc-error"].band == 0
    ex = guided[1]
    engine = delayed.make_engine(world_model, ex.rtc)
    seen = []
    guide = engine.loop.rtc.guide
    engine.loop.rtc.guide = lambda queue, tick: seen.append(guide(queue, tick)) or seen[-1]
    delayed.run_episode(engine, ex, bench.SEED, 4, ticks=15)
    guides = [g for g in seen if g is not None]
    assert guides[-1].delay == 4  # measured: the first guided chunk still knew d = 0
    assert guides[0].delay == 0 and all(g.delay == 4 for g in guides[1:])
    assert all(g.weights[: g.delay].eq(1).all() and g.weights[g.delay :].eq(0).all()
               for g in guides)  # fmt: skip


def test_each_row_starts_with_its_own_measured_delay(world_model):  # noqa: F811
    """After the previous row's d = 2, `warm_delay` at d = 4: every guided chunk of the next
    episode holds 4 (a longer delay is taken at once)."""
    ex = delayed.Guided("prefix", schedule="hard")
    engine = delayed.make_engine(world_model, ex.rtc)
    bench.warm_delay(engine, ex, 2)
    assert engine.queue.delay_ticks() == 2
    bench.warm_delay(engine, ex, 4)
    seen = []
    guide = engine.loop.rtc.guide
    engine.loop.rtc.guide = lambda queue, tick: seen.append(guide(queue, tick)) or seen[-1]
    delayed.run_episode(engine, ex, bench.SEED, 4, ticks=20)
    delays = [g.delay for g in seen if g is not None]
    assert len(delays) >= 2 and set(delays) == {4}


def test_bench_refuses_a_bad_guidance_setting(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--max-guidance", "-1"])
    assert e.value.code == 2 and "max_guidance=-1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--prefix-band", "-2"])
    assert e.value.code == 2 and "rtc.band=-2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--methods", "rtc-prefix,rtc-magic"])
    assert e.value.code == 2 and "rtc-magic: not one of" in capsys.readouterr().err


def test_bench_refuses_weights_it_cannot_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--weights", str(tmp_path / "none.safetensors")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
