"""The websocket server: openpi's protocol, every connection its own session.

As openpi's WebsocketPolicyServer (src/openpi/serving/websocket_policy_server.py): the
metadata map on connect, then one response per request frame, "server_timing" in it,
compression off, GET /healthz answered. Unlike it, inference never blocks another
connection's I/O (openpi #717): websockets' synchronous server gives every connection
its own thread (and websockets a reader thread per connection), which receives a frame
and unpacks it, takes the engine's turn (one lock: the engine is single-threaded) for
ServePolicy.handle (the layout's checks and the engine cycle, whose prefill converts the
frame's images on the model's device: model/camera_frames.py), then packs and sends the
reply itself, and only then draws the session's next noise (ServePolicy.after_reply). No
event loop and no hop to an engine thread and back: torch releases the GIL while it
computes, so the other connections' threads keep reading, unpacking, sending, answering
errors and accepting meanwhile.

server_timing: infer_ms (ServePolicy.handle), queue_ms (the wait for the engine's
turn), unpack_ms (msgpack of this frame), prev_total_ms (the previous request of this
connection: frame in hand -> reply sent, openpi's) and prev_pack_ms (msgpack of that
reply): what the server spends beyond the engine, serialisation apart, is
prev_total_ms - prev_pack_ms - the previous unpack_ms - its action_latency_ms.

A bad frame gets an error text frame (openpi's client raises RuntimeError with it)
and the connection stays open; a frame over max_frame_bytes closes that connection
(1009); a closed connection's session leaves the engine's store.
SIGINT or SIGTERM (or `stop`): stop accepting, close every connection (1001), wait for
every connection's thread (the frame in flight finishes), return.
"""

from __future__ import annotations

import http
import signal
import threading
import time
from collections.abc import Callable

import websockets
from websockets.sync.server import ServerConnection, serve

from embodied_kv.serve import wire
from embodied_kv.serve.config import ServeConfig
from embodied_kv.serve.policy import ServePolicy
from embodied_kv.serve.session import Session

ERROR_PREFIX = "embodied-kv serve: "
POLL_S = 0.1  # how often run() looks at its stop flags


class PolicyServer:
    def __init__(self, policy: ServePolicy, cfg: ServeConfig, log: Callable[[str], None]):
        self.policy, self.cfg, self._log = policy, cfg, log
        self._turn = threading.Lock()  # the engine's: one frame's engine work at a time
        self._count = threading.Lock()
        self._metadata = wire.pack(policy.metadata())
        self.connections = 0

    def run(
        self, ready: Callable[[int], None] = lambda port: None, stop: threading.Event | None = None
    ) -> None:
        """Serve until `stop` is set, or without one until SIGINT / SIGTERM (main thread
        only); `ready(port)` once listening (port 0: any). OSError: cannot listen."""
        signalled: list[int] = []
        previous = {}
        if stop is None:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # only a flag: no lock in a handler
                previous[sig] = signal.signal(sig, lambda signum, _: signalled.append(signum))
        try:
            with serve(self._handler, self.cfg.host, self.cfg.port, compression=None,
                       max_size=self.cfg.max_frame_bytes,
                       process_request=_health_check) as server:  # fmt: skip
                accept = threading.Thread(target=server.serve_forever, name="accept")
                accept.start()
                try:
                    ready(server.socket.getsockname()[1])
                    while not signalled and not stop.wait(POLL_S):
                        pass
                    self._log("stopping: closing connections")
                finally:
                    server.shutdown()  # 1001 to each; waits for every connection's thread
                    accept.join()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handler(self, ws: ServerConnection) -> None:
        """One connection, on its own thread: frame in -> reply out, until it closes."""
        session = Session()
        with self._count:
            self.connections += 1
        self._log(f"session {session.id}: {ws.remote_address} connected")
        prev: dict[str, float] = {}
        try:
            ws.send(self._metadata)
            for frame in ws:
                t0 = time.perf_counter()
                try:
                    response, timing = self._answer(session, frame)
                except ValueError as e:
                    ws.send(f"{ERROR_PREFIX}bad request: {e}")
                    continue
                except Exception as e:  # the engine failed this frame; the others go on
                    ws.send(f"{ERROR_PREFIX}{type(e).__name__}: {e}")
                    continue
                # openpi: prev_total_ms is the previous reply's, its send included
                response["server_timing"] = timing | prev
                t_pack = time.perf_counter()
                reply = wire.pack(response)
                packed = time.perf_counter()
                ws.send(reply)
                prev = {"prev_total_ms": (time.perf_counter() - t0) * 1e3,
                        "prev_pack_ms": (packed - t_pack) * 1e3}  # fmt: skip
                self.policy.after_reply(session)  # the session's next frame's noise
        except websockets.ConnectionClosed:
            pass
        finally:
            with self._count:
                self.connections -= 1
            self._log(f"session {session.id}: closed ({ws.close_code}: {ws.close_reason})")
            self.policy.forget(session)

    def _answer(self, session: Session, frame: bytes | str) -> tuple[dict, dict]:
        """One frame -> (response, timing); ValueError: the caller's mistake."""
        t0 = time.perf_counter()
        msg = wire.unpack(frame)
        t = time.perf_counter()
        with self._turn:  # the conversion too (module docstring)
            turn = time.perf_counter()
            response = self.policy.handle(session, msg)
        done = time.perf_counter()
        return response, {"infer_ms": (done - turn) * 1e3, "queue_ms": (turn - t) * 1e3,
                          "unpack_ms": (t - t0) * 1e3}  # fmt: skip


def _health_check(connection: ServerConnection, request):
    if request.path == "/healthz":
        return connection.respond(http.HTTPStatus.OK, "OK\n")
    return None
