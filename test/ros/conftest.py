"""Fixtures for tests over real rclpy and real DDS (no mocks).

`ros` hands out participants: each is its own rclpy Context (its own DDS
participant) with a MultiThreadedExecutor spinning on a thread, so a test can put
the two ends of a topic or service in different participants. Teardown shuts
every executor down and joins its thread before destroying the nodes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

try:
    import rclpy
    from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
    from rclpy.node import Node
except ModuleNotFoundError:  # the test modules skip themselves; see ROS_SKIP_REASON there
    rclpy = None

TIMEOUT_S = 10.0  # discovery + one round trip on a loaded 2-core machine takes < 1 s
EXECUTOR_JOIN_TIMEOUT_S = 5.0
_test_ids = itertools.count()


class Participant:
    """One rclpy Context with its executor spinning on a background thread."""

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)  # non-default context: no signal handlers
        self.executor = MultiThreadedExecutor(context=self.context)
        self.nodes: list[Node] = []
        self._thread = threading.Thread(target=self._spin, name="test-executor", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def add(self, node: Node) -> Node:
        self.executor.add_node(node)
        self.nodes.append(node)
        return node

    def node(self, name: str, namespace: str = "") -> Node:
        return self.add(rclpy.create_node(name, namespace=namespace, context=self.context))

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=EXECUTOR_JOIN_TIMEOUT_S)
        self._thread.join(EXECUTOR_JOIN_TIMEOUT_S)
        assert not self._thread.is_alive(), "executor thread did not stop"
        for node in self.nodes:
            node.destroy_node()
        self.context.try_shutdown()


class RosHarness:
    """Participants plus waiting helpers for one test.

    `namespace` is unique per test: a client must never match a server of the same
    name left over from an earlier test (its discovery data can outlive it), or a
    request can go to a dead server while the new one is not matched yet.
    """

    def __init__(self) -> None:
        self._participants: list[Participant] = []
        self.namespace = f"/test_{next(_test_ids)}"

    def participant(self) -> Participant:
        participant = Participant()
        self._participants.append(participant)
        return participant

    @staticmethod
    def wait_until(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.005)

    def call(self, client, request, timeout: float = TIMEOUT_S):
        """Call a service from a spinning participant; the response, or AssertionError.

        `wait_for_service` says the *client* has discovered the server. Fast DDS also needs
        the server to have matched the client's response reader: a response to a reader
        not matched within 100 ms is dropped ("failed to send response (timeout)",
        rmw_fastrtps's max_blocking_time), and the call then waits forever. So the call
        also waits until the serving participants of this harness see the client."""
        assert client.wait_for_service(timeout_sec=timeout), f"{client.srv_name} not available"
        self.wait_until(lambda: self._servers_see(client),
                        f"the server of {client.srv_name} to discover its client", timeout)
        future = client.call_async(request)
        self.wait_until(future.done, f"a response from {client.srv_name}", timeout)
        return future.result()

    def _servers_see(self, client) -> bool:
        """Every other participant of this harness that sees the service sees a client of
        it (its graph counts the response readers); servers in other processes: True."""
        name = client.srv_name
        nodes = [n for p in self._participants if p.context is not client.context
                 for n in p.nodes[:1] if n.count_services(name) > 0]  # fmt: skip
        return all(n.count_clients(name) > 0 for n in nodes)

    def close(self) -> None:
        for participant in reversed(self._participants):
            participant.close()


@pytest.fixture
def ros():
    if rclpy is None:
        pytest.skip("rclpy is not importable")
    harness = RosHarness()
    yield harness
    harness.close()


# -- compressed camera frames as image_transport publishes them (test_image, robot tests) --


def encode_image(rgb, fmt: str, **kwargs) -> bytes:
    """jpeg / png bytes of an [H, W, 3] or [H, W] uint8 array (Pillow)."""
    import io

    import PIL.Image

    out = io.BytesIO()
    PIL.Image.fromarray(rgb).save(out, format=fmt.upper(), **kwargs)
    return out.getvalue()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR says w x h (8-bit RGB) but whose pixel data stops within the first
    row (a cut zlib stream, no IEND): decoding it fails, reading its header does not."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" + bytes(3 * w))[:-3]
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)


@pytest.fixture(scope="session")
def image_files():
    """(encode_image, png_header_only): test modules cannot import a conftest."""
    return encode_image, png_header_only
