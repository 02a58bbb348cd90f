"""The websocket server: openpi's protocol, every connection its own session.

As openpi's WebsocketPolicyServer (src/openpi/serving/websocket_policy_server.py): the
metadata map on connect, then one response per request frame, "server_timing" in it,
compression off, GET /healthz answered. Unlike it, inference never runs on the event
loop (openpi #717): frames are read, unpacked and answered on the loop while the engine
works on its own thread, one frame at a time in arrival order (one executor worker),
so every connection keeps its I/O while another's chunk is computed. A bad frame gets
an error text frame (openpi's client raises RuntimeError with it) and the connection
stays open; a frame over max_frame_bytes closes that connection (1009). SIGINT or
SIGTERM: stop accepting, finish the frame in flight, close every connection, return.
"""

from __future__ import annotations

import asyncio
import http
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import websockets
from websockets.asyncio.server import ServerConnection, serve

from embodied_kv.serve import wire
from embodied_kv.serve.config import ServeConfig
from embodied_kv.serve.policy import ServePolicy
from embodied_kv.serve.session import Session

ERROR_PREFIX = "embodied-kv serve: "


class PolicyServer:
    def __init__(self, policy: ServePolicy, cfg: ServeConfig, log: Callable[[str], None]):
        self.policy, self.cfg, self._log = policy, cfg, log
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._metadata = wire.pack(policy.metadata())
        self.connections = 0

    async def run(
        self, ready: Callable[[int], None] = lambda port: None, stop: asyncio.Event | None = None
    ) -> None:
        """Serve until `stop` is set, or without one until SIGINT / SIGTERM (main thread
        only); `ready(port)` once listening (port 0: any)."""
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            async with serve(self._handler, self.cfg.host, self.cfg.port, compression=None,
                             max_size=self.cfg.max_frame_bytes,
                             process_request=_health_check) as server:  # fmt: skip
                ready(server.sockets[0].getsockname()[1])
                await stop.wait()
                self._log("stopping: closing connections")
        finally:
            self._engine_thread.shutdown(wait=True, cancel_futures=True)

    async def _handler(self, ws: ServerConnection) -> None:
        loop = asyncio.get_running_loop()
        session = Session()
        self.connections += 1
        self._log(f"session {session.id}: {ws.remote_address} connected")
        prev_total_ms = None
        try:
            await ws.send(self._metadata)
            async for frame in ws:
                t0 = time.perf_counter()
                try:
                    msg = wire.unpack(frame)
                    response, timing = await self._on_engine(loop, session, msg)
                except ValueError as e:
                    await ws.send(f"{ERROR_PREFIX}bad request: {e}")
                    continue
                except Exception as e:  # the engine failed this frame; the others go on
                    await ws.send(f"{ERROR_PREFIX}{type(e).__name__}: {e}")
                    continue
                if prev_total_ms is not None:  # openpi: the previous one, its send included
                    timing["prev_total_ms"] = prev_total_ms
                response["server_timing"] = timing
                await ws.send(wire.pack(response))
                prev_total_ms = (time.perf_counter() - t0) * 1e3
        except websockets.ConnectionClosed:
            pass
        finally:
            self.connections -= 1
            self._log(f"session {session.id}: closed ({ws.close_code}: {ws.close_reason})")
            try:
                await loop.run_in_executor(self._engine_thread, self.policy.forget, session)
            except RuntimeError:  # shutting down: the engine thread is gone, so is the store
                pass

    def _on_engine(self, loop: asyncio.AbstractEventLoop, session: Session, msg: dict):
        """The frame's job on the engine thread -> a loop future, resolved by one
        call_soon_threadsafe (run_in_executor chains a concurrent future to it instead)."""
        fut = loop.create_future()

        def job(submitted: float) -> None:
            try:
                result = self._job(session, msg, submitted)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        queued = self._engine_thread.submit(job, time.perf_counter())
        queued.add_done_callback(  # cancelled unrun (shutdown): the awaiting handler ends
            lambda q: q.cancelled() and loop.call_soon_threadsafe(fut.cancel)
        )
        return fut

    def _job(self, session: Session, msg: dict, submitted: float) -> tuple[dict, dict]:
        """On the engine thread: one frame -> (response, timing)."""
        t = time.perf_counter()
        response = self.policy.handle(session, msg)
        done = time.perf_counter()
        return response, {"infer_ms": (done - t) * 1e3, "queue_ms": (t - submitted) * 1e3}


def _settle(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if fut.cancelled():  # the connection's handler was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _health_check(connection: ServerConnection, request):
    if request.path == "/healthz":
        return connection.respond(http.HTTPStatus.OK, "OK\n")
    return None
