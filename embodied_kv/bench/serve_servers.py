"""The servers `bench serve` compares, each run by a thread of its own (ServerThread).

    ours        serve/server.py PolicyServer: websockets' synchronous server, a thread
                per connection that unpacks, takes the engine's turn (the layout's
                checks and the engine cycle), packs and sends; other connections'
                threads do their I/O meanwhile
    openpi      openpi's WebsocketPolicyServer design (src/openpi/serving/
                websocket_policy_server.py) over the same ServePolicy: the handler calls
                the policy on the event loop, so while one frame is computed no other
                connection is read or written (openpi #717); one model per server

Both answer the same frames with the same bytes (the same ServePolicy code); only where
the engine runs differs.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

import websockets
from websockets.asyncio.server import serve

from embodied_kv.serve import wire
from embodied_kv.serve.config import ServeConfig
from embodied_kv.serve.policy import ServePolicy
from embodied_kv.serve.server import PolicyServer
from embodied_kv.serve.session import Session


class OpenpiDesignServer:
    """openpi's handler loop, written over ServePolicy: blocking inference on the loop."""

    def __init__(self, policy: ServePolicy, cfg: ServeConfig):
        self.policy, self.cfg = policy, cfg

    async def run(self, ready, stop: asyncio.Event) -> None:
        async with serve(self._handler, self.cfg.host, self.cfg.port, compression=None,
                         max_size=None) as server:  # fmt: skip
            ready(server.sockets[0].getsockname()[1])
            await stop.wait()

    async def _handler(self, ws) -> None:
        session = Session()
        await ws.send(wire.pack(self.policy.metadata()))
        prev: dict[str, float] = {}
        try:
            while True:
                frame = await ws.recv()
                # openpi starts this clock before recv (its prev_total_ms holds the wait for
                # the client's next frame); from the frame's arrival here, as ours measures
                start = time.monotonic()
                obs = wire.unpack(frame)
                t = time.monotonic()
                action = self.policy.handle(session, obs)  # the event loop waits here
                action["server_timing"] = {"infer_ms": (time.monotonic() - t) * 1e3,
                                           "unpack_ms": (t - start) * 1e3} | prev  # fmt: skip
                t_pack = time.monotonic()
                reply = wire.pack(action)
                packed = time.monotonic()
                await ws.send(reply)
                prev = {"prev_total_ms": (time.monotonic() - start) * 1e3,
                        "prev_pack_ms": (packed - t_pack) * 1e3}  # fmt: skip
                self.policy.after_reply(session)  # as ours: the same engine code
        except websockets.ConnectionClosed:
            pass
        finally:
            self.policy.forget(session)


class ServerThread:
    """A server's `run(ready, stop)` in a daemon thread: ours (synchronous, a
    threading.Event stops it) directly, openpi's design (a coroutine) on a new event
    loop of that thread (an asyncio.Event stops it)."""

    def __init__(self, server: PolicyServer | OpenpiDesignServer, name: str):
        self.server = server
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | threading.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(f"{name} did not start listening")

    def _main(self) -> None:
        if not inspect.iscoroutinefunction(self.server.run):
            self._stop = threading.Event()
            self.server.run(self._listening, self._stop)
            return
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)

        async def body():
            self._stop = asyncio.Event()
            await self.server.run(self._listening, self._stop)

        self._loop.run_until_complete(body())

    def _listening(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def stop(self) -> None:
        if self._loop is None:
            self._stop.set()
        else:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
