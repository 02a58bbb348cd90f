"""The client side of `bench serve`, run in worker processes (as robots would be):
only numpy and the pinned openpi-client are imported here, nothing of torch."""

from __future__ import annotations

import time

from openpi_client.websocket_client_policy import WebsocketClientPolicy


def requests(port: int, msg: dict, n: int) -> list[dict]:
    """n sequential infers -> per request: the round trip here, the engine's action
    latency, the server's own time from frame in to reply sent (openpi's
    server_timing.prev_total_ms, which arrives with the next reply) and the server's
    msgpack of the frame and of the reply as it timed them in place (unpack_ms;
    prev_pack_ms, with the next reply), all ms."""
    client = WebsocketClientPolicy("127.0.0.1", port)
    out = []
    for i in range(n + 1):  # one more: it carries the last one's server total
        t = time.perf_counter()
        reply = client.infer(msg)
        rtt = (time.perf_counter() - t) * 1e3
        timing = reply["server_timing"]
        if i:
            out[-1]["server_ms"] = timing["prev_total_ms"]
            out[-1]["server_msgpack_ms"] += timing["prev_pack_ms"]
        if i < n:
            out.append({"rtt_ms": rtt, "action_ms": reply["action_latency_ms"],
                        "server_msgpack_ms": timing["unpack_ms"]})  # fmt: skip
    client._ws.close()  # openpi-client 0.1.2 has no close()
    return out


def for_seconds(port: int, msg: dict, start_at: float, seconds: float) -> int:
    """Infer back to back from wall time `start_at` for `seconds` -> chunks received."""
    client = WebsocketClientPolicy("127.0.0.1", port)
    client.infer(msg)  # connected and warm before the clock starts
    time.sleep(max(0.0, start_at - time.time()))
    end, n = start_at + seconds, 0
    while time.time() < end:
        client.infer(msg)
        n += 1
    client._ws.close()  # openpi-client 0.1.2 has no close()
    return n
