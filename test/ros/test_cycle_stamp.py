"""The cycle thread stamps each chunk with the tick of its observation (the robot state's
capture): the ActionQueue then skips the actions the robot has already moved past, and
real-time chunking's d counts them. Stamps that cannot be right (none, from the future,
older than a chunk can cover) fall back to the cycle's start and are counted. A real
engine (tiny) and clock; no rclpy needed."""

import time

import numpy as np
import torch

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.ros.action_output import ControlClock
from embodied_kv.ros.cycle_thread import CycleThread
from embodied_kv.ros.observation import ObservationBuffer


def test_chunks_are_stamped_at_the_state_s_capture_tick():
    engine = Engine(EngineConfig(preset="tiny", control_hz=50.0, replan_every=5, blend=0,
                                 history=0, cuda_graphs=False))  # fmt: skip
    clock = ControlClock(50.0, t0=time.monotonic() - 100 * 0.02)  # tick 100 is now
    buffer = ObservationBuffer(2, engine.model.cfg.vision.image_size, 8, 2)
    thread = CycleThread(engine, clock, buffer.observation, lambda r, t: None, print,
                         buffer.state_stamp_ns)  # fmt: skip
    assert thread.max_age == engine.model.cfg.action_horizon - 5 == 5
    start = clock.now()
    buffer.set_state(np.zeros(8), clock.wall_ns(start - 3) + 1000)  # 3 ticks old
    assert thread.observed_tick(start) == start - 3
    assert thread.counters.observation_age_ticks == 3 and thread.counters.unstamped == 0
    for bad in (0, clock.wall_ns(start + 2) + 1000, clock.wall_ns(start - 6) + 1000):
        buffer.set_state(np.zeros(8), bad)  # none, from the future, older than a chunk
        assert thread.observed_tick(start) == start
    assert thread.counters.unstamped == 3 and thread.counters.observation_age_ticks == 0
    # the chunk of an observation 3 ticks old lands where the robot is: d counts the age
    buffer.set_state(np.zeros(8), clock.wall_ns(start - 3) + 1000)
    s = engine.model.cfg.vision.image_size
    buffer.set_image(0, torch.zeros(3, s, s))
    for t in range(start - 10, start):  # the robot ran up to tick start - 1
        engine.queue.pop(t)
    thread._cycle(buffer.observation(), thread.observed_tick(start))
    assert engine.queue.switches.last_delay == 3  # landed at tick `start`, observed at -3
    first = [engine.queue.pop(t)[0] for t in range(start, start + 5)]
    buffer.set_state(np.zeros(8), clock.wall_ns(start + 3) + 1000)  # 2 ticks old at +5
    thread._cycle(buffer.observation(), thread.observed_tick(start + 5))
    assert engine.queue.switches.last_delay == 2
    assert thread.counters.cycles == 2 and len(first) == 5


def test_a_state_older_than_its_instruction_marks_the_observation():
    """After a new instruction, a state stamped before it arrived (the scene before the task
    was given: a reset robot's first frames) makes `after_instruction` False until a newer
    state comes; unknown times (0) count as current; the same text again changes nothing."""
    buffer = ObservationBuffer(1, 8, 4, 1)
    buffer.set_image(0, torch.zeros(3, 8, 8))
    buffer.set_state(np.zeros(4), 1_000)
    assert buffer.observation().after_instruction  # no instruction time known
    buffer.set_instruction("stack the cups", 2_000)
    assert not buffer.observation().after_instruction  # state 1_000 < instruction 2_000
    buffer.set_instruction("stack the cups", 9_000)  # the same task: its time stays
    buffer.set_state(np.ones(4), 2_500)
    assert buffer.observation().after_instruction
    buffer.set_instruction("unstack the cups", 3_000)
    assert not buffer.observation().after_instruction
    buffer.set_state(np.ones(4), 0)  # unstamped: cannot tell, current
    assert buffer.observation().after_instruction
