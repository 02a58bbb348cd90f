"""The servers `bench serve` compares, each on an event loop of its own thread.

    ours        serve/server.py PolicyServer: engine work on its engine thread, the
                loop free for every connection's I/O
    openpi      openpi's WebsocketPolicyServer design (src/openpi/serving/
                websocket_policy_server.py) over the same ServePolicy: the handler calls
                the policy on the event loop, so while one frame is computed no other
                connection is read or written (openpi #717); one model per server

Both answer the same frames with the same bytes (the same ServePolicy code); only where
the engine runs differs.
"""

from __future__ import annotations

import asyncio
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
        prev_total = None
        try:
            while True:
                frame = await ws.recv()
                # openpi starts this clock before recv (its prev_total_ms holds the wait for
                # the client's next frame); from the frame's arrival here, as ours measures
                start = time.monotonic()
                obs = wire.unpack(frame)
                t = time.monotonic()
                action = self.policy.handle(session, obs)  # the event loop waits here
                action["server_timing"] = {"infer_ms": (time.monotonic() - t) * 1e3}
                if prev_total is not None:
                    action["server_timing"]["prev_total_ms"] = prev_total * 1e3
                await ws.send(wire.pack(action))
                prev_total = time.monotonic() - start
        except websockets.ConnectionClosed:
            pass
        finally:
            self.policy.forget(session)


class ServerThread:
    """A server's `run(ready, stop)` on a new event loop in a daemon thread."""

    def __init__(self, server: PolicyServer | OpenpiDesignServer, name: str):
        self.server = server
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(f"{name} did not start listening")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def body():
            self._stop = asyncio.Event()
            await self.server.run(self._listening, self._stop)

        self._loop.run_until_complete(body())

    def _listening(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
