"""A frame whose engine cycle fails (the action expert raising, injected as in
test/engine/test_session.py) leaves no request behind, never leaves the engine in its
safe state for the next client, and does not move the session's frame."""

from __future__ import annotations

import pytest

from embodied_kv.serve.config import ServeConfig
from embodied_kv.serve.policy import ServePolicy
from embodied_kv.serve.session import Session


def test_failed_cycles_leave_nothing_behind(serve_helpers, monkeypatch):
    engine = serve_helpers.reference_engine("tiny")
    msg, obs = serve_helpers.request("libero", engine)
    want = serve_helpers.chunks(engine, obs, 2)
    policy = ServePolicy(engine, ServeConfig())
    session = Session()
    real = engine.model.sample_actions

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the action expert failed")

    monkeypatch.setattr(engine.model, "sample_actions", broken)
    for _ in range(engine.cfg.max_cycle_failures + 1):
        with pytest.raises(RuntimeError, match="injected"):
            policy.handle(session, {**msg, "question": "what is on the table ?"})
        assert not engine.faults.safe
        assert not engine.manager.requests and not engine.policy.pending()
        assert session.frame == 0
    monkeypatch.setattr(engine.model, "sample_actions", real)
    other = Session()
    assert policy.handle(other, msg)["actions"].tobytes() == want[0].tobytes()
    reply = policy.handle(session, msg)
    assert reply["frame"] == 0 and reply["actions"].tobytes() == want[0].tobytes()
    assert policy.handle(session, msg)["actions"].tobytes() == want[1].tobytes()


def test_the_next_noise_is_drawn_after_the_reply_with_the_same_bytes(serve_helpers):
    """ServePolicy moves the draw of a session's next noise from the cycle's tail to after
    its reply (after_reply): the next frame takes it without drawing, and the chunks are
    the engine's own, whether after_reply ran or another session's frame came between."""
    engine = serve_helpers.reference_engine("tiny")
    msg, obs = serve_helpers.request("libero", engine)
    want = serve_helpers.chunks(engine, obs, 3)  # the robot's loop: drawn in the cycle
    policy = ServePolicy(engine, ServeConfig())
    assert not engine.loop.draw_ahead
    noise, session, other = engine.loop.noise, Session(), Session()
    assert policy.handle(session, msg)["actions"].tobytes() == want[0].tobytes()
    policy.after_reply(session)
    hits = noise.hits
    assert policy.handle(session, msg)["actions"].tobytes() == want[1].tobytes()
    assert noise.hits == hits + 1  # drawn after the reply, not on the action path
    policy.after_reply(session)
    assert policy.handle(other, msg)["actions"].tobytes() == want[0].tobytes()  # a miss
    assert policy.handle(session, msg)["actions"].tobytes() == want[2].tobytes()
