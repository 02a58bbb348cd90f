"""Several clients on one `embodied-kv serve` (tiny preset: fast): each connection its
own session, named snapshots, questions, garbage from one client never disturbing
another, I/O served while the engine works, SIGINT / SIGTERM exiting 0."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import websockets
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.sync.client import connect

from embodied_kv.serve.process import ServeProcess

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(serve_helpers):
    return serve_helpers.reference_engine("tiny")


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--preset", "tiny")
    yield proc
    assert proc.stop(signal.SIGTERM) == 0, "\n".join(proc.lines[-20:])


@pytest.fixture(scope="module")
def expected(engine, serve_helpers):
    msg, obs = serve_helpers.request("libero", engine)
    return msg, serve_helpers.chunks(engine, obs, 4)


def raw_client(port: int):
    ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None)
    meta = msgpack_numpy.unpackb(ws.recv())
    assert meta["server"] == "embodied-kv"
    return ws


def ask(ws, frame: bytes | str):
    ws.send(frame)
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def test_two_clients_at_once_each_its_own_frames(server, expected):
    msg, want = expected
    got: dict[int, list[bytes]] = {}

    def run(i: int) -> None:
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        got[i] = [client.infer(msg)["actions"].tobytes() for _ in range(3)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got[0] == got[1] == [w.tobytes() for w in want[:3]]


def test_snapshot_restore_reset_and_question(server, expected):
    msg, want = expected
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    assert client.infer(msg)["actions"].tobytes() == want[0].tobytes()
    snap = client.infer({"command": "snapshot", "name": "after-one"})
    assert (snap["command"], snap["frame"]) == ("snapshot", 1)
    assert client.infer(msg)["actions"].tobytes() == want[1].tobytes()
    assert client.infer(msg)["actions"].tobytes() == want[2].tobytes()
    back = client.infer({"command": "restore", "name": "after-one"})
    assert back["frame"] == 1
    assert client.infer(msg)["actions"].tobytes() == want[1].tobytes()
    # command and observation in one frame: reset, then the chunk of frame 0
    both = client.infer({**msg, "command": "reset"})
    assert both["frame"] == 0 and both["actions"].tobytes() == want[0].tobytes()
    with pytest.raises(RuntimeError, match="no snapshot 'nope'"):
        client.infer({"command": "restore", "name": "nope"})
    with pytest.raises(RuntimeError, match="command 'jump'"):
        client.infer({"command": "jump"})
    answered = client.infer({**msg, "question": "what is on the table ?"})
    assert answered["answer"]["status"] in ("ok", "truncated")
    assert isinstance(answered["answer"]["text"], str)
    assert answered["actions"].tobytes() == want[1].tobytes()  # frame 1 after the reset


def bad_frames(msg: dict) -> list[tuple[bytes | str, str]]:
    nan_state = {**msg, "observation/state": np.full(8, np.nan)}
    flat_image = {**msg, "observation/image": np.zeros((224, 224), np.uint8)}
    short_state = {**msg, "observation/state": np.zeros(3)}
    return [
        (b"\xc1 not msgpack", "not a request frame"),
        ("a text frame", "text frame"),
        (msgpack.packb([1, 2, 3]), "msgpack map"),
        (msgpack_numpy.packb({"prompt": "no images"}), "no libero observation"),
        (msgpack_numpy.packb(nan_state), "NaN"),
        (msgpack_numpy.packb(flat_image), "shape (224, 224)"),
        (msgpack_numpy.packb(short_state), "state has 3 values"),
        (msgpack_numpy.packb({**msg, "prompt": 5}), "prompt must be text"),
    ]


def test_garbage_from_one_client_never_disturbs_another(server, expected):
    msg, want = expected
    good = WebsocketClientPolicy("127.0.0.1", server.port)
    good_chunks, stop = [], threading.Event()

    def keep_inferring() -> None:
        while not stop.is_set():
            good_chunks.append(good.infer(msg)["actions"].tobytes())

    worker = threading.Thread(target=keep_inferring)
    worker.start()
    try:
        bad = raw_client(server.port)
        for frame, error in bad_frames(msg):
            reply = ask(bad, frame)
            assert isinstance(reply, str) and error in reply, (error, reply)
        ok = ask(bad, msgpack_numpy.packb(msg))  # still served after all of it
        assert ok["actions"].tobytes() == want[0].tobytes()
        big = np.zeros(100 << 20, np.uint8)  # 100 MB > max_frame_bytes: disconnected
        with pytest.raises(websockets.ConnectionClosed) as closed:
            bad.send(msgpack_numpy.packb({**msg, "observation/image": big}))
            bad.recv()
        assert closed.value.rcvd is None or closed.value.rcvd.code == 1009
        bad.close()
    finally:
        stop.set()
        worker.join(60)
    assert len(good_chunks) >= 3
    assert good_chunks[:3] == [w.tobytes() for w in want[:3]]
    after = WebsocketClientPolicy("127.0.0.1", server.port).infer(msg)  # a new one too
    assert after["actions"].tobytes() == want[0].tobytes()


def test_io_is_served_while_the_engine_works(server, expected):
    """openpi #717: its loop blocks in inference. Here a client connects and gets its
    metadata while another client's pipelined frames are still being computed."""
    msg, _ = expected
    busy = raw_client(server.port)
    frame = msgpack_numpy.packb({**msg, "question": "what is on the table ?"})
    n = 12
    t0 = time.perf_counter()
    for _ in range(n):
        busy.send(frame)
    other = raw_client(server.port)  # metadata received: the loop was free
    t_other = time.perf_counter() - t0
    for _ in range(n):
        assert not isinstance(busy.recv(), str)
    t_busy = time.perf_counter() - t0
    other.close()
    busy.close()
    assert t_other < t_busy / 2, (t_other, t_busy)


def test_sigint_with_a_client_connected_exits_0(expected):
    msg, _ = expected
    proc = ServeProcess("--preset", "tiny", "--layout", "libero")
    client = WebsocketClientPolicy("127.0.0.1", proc.port)
    client.infer(msg)
    assert proc.stop(signal.SIGINT) == 0, "\n".join(proc.lines[-20:])
    assert any("stopped" in line for line in proc.lines)


def test_healthz_is_answered_over_http(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=30) as r:
        assert (r.status, r.read()) == (200, b"OK\n")
