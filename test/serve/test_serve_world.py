"""Acceptance: `embodied-kv serve --preset world` (the shipped weights) in its own
process, driven by the pinned openpi-client: per layout, the chunk is the engine's own
chunk for the same observation in bytes; reset starts the frames again; SIGTERM exits 0."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from embodied_kv.serve.process import ServeProcess

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(serve_helpers):
    return serve_helpers.reference_engine("world")


@pytest.mark.parametrize("layout", ["libero", "droid", "aloha"])
def test_openpi_client_gets_the_engines_chunk(engine, layout, serve_helpers):
    msg, obs = serve_helpers.request(layout, engine)
    want = serve_helpers.chunks(engine, obs, 2)
    server = ServeProcess("--preset", "world", "--layout", layout)
    try:
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        meta = client.get_server_metadata()
        assert meta["layout"] == layout and meta["preset"] == "world"
        assert "data/world" in meta["weights"]
        first = client.infer(msg)
        h, a = engine.model.cfg.action_horizon, engine.robot.action_dim
        assert first["actions"].shape == (h, a) == want[0].shape
        assert first["actions"].dtype == want[0].dtype
        assert first["actions"].tobytes() == want[0].tobytes()
        assert (first["frame"], first["noise_seed"]) == (0, engine.cfg.seed)
        assert first["action_latency_ms"] > 0 and first["server_timing"]["infer_ms"] > 0
        second = client.infer(msg)  # frame 1: other noise
        assert second["actions"].tobytes() == want[1].tobytes()
        assert not np.array_equal(first["actions"], second["actions"])
        timing = second["server_timing"]
        assert timing["prev_total_ms"] > timing["prev_pack_ms"] > 0 and timing["unpack_ms"] > 0
        reset = client.infer({"command": "reset"})
        assert (reset["command"], reset["frame"]) == ("reset", 0) and "actions" not in reset
        again = client.infer(msg)
        assert again["frame"] == 0 and again["actions"].tobytes() == want[0].tobytes()
    finally:
        assert server.stop(signal.SIGTERM) == 0, "\n".join(server.lines[-20:])
