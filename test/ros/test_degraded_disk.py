"""Storage faults never keep the robot from starting (issue 35, 2), over real rclpy: a
capsule folder on a read-only mount, holding what a crash mid-write leaves and a capsule
that fails verification, still lets `kv_manager` configure; the leftovers are logged as
warnings, a restore of the corrupted capsule answers with the corruption (not an OSError),
and the intact capsule restores."""

from __future__ import annotations

import pytest

pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from embodied_kv.engine.engine import Engine, EngineConfig  # noqa: E402
from embodied_kv.kv.capsule_store import StoreConfig  # noqa: E402
from embodied_kv.ros.kv_manager import KvManagerNode  # noqa: E402
from embodied_kv.srv import Reset, Rollback  # noqa: E402

from ..kv.conftest import read_only  # noqa: E402, F401  (the read-only mount fixture)

LEFTOVERS = (".big1.json.abc123.tmp", ".big1.safetensors.x1b2c3.tmp")


def test_kv_manager_configures_on_a_read_only_folder_and_names_the_corruption(
    ros, read_only, capfd  # noqa: F811
):
    rw, ro = read_only
    writer = Engine(EngineConfig(store=StoreConfig(disk_dir=str(rw))))  # an earlier process
    writer.begin_episode()
    writer.snapshot("kept", "disk")
    writer.snapshot("big1", "disk")
    for name in LEFTOVERS:
        (rw / name).write_bytes(b"half a write")
    payload = rw / "big1.safetensors"
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0xFF
    payload.write_bytes(bytes(data))

    owner = ros.participant()
    params = [Parameter("capsules.disk_dir", value=str(ro)), Parameter("device", value="cpu")]
    node = owner.add(KvManagerNode(context=owner.context, namespace=ros.namespace,
                                   parameter_overrides=params))  # fmt: skip
    assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
    assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
    err = capfd.readouterr().err
    assert all(name in err for name in LEFTOVERS) and "Read-only file system" in err
    assert "capsule 'big1' on disk is truncated or corrupted" in err and "not adopted" in err
    assert node.engine.store.names() == ["episode_start", "kept"]

    client = ros.participant().node("client", ros.namespace)
    reset = client.create_client(Reset, "kv_manager/reset")
    refused = ros.call(reset, Reset.Request(name="big1"))
    assert not refused.success
    assert "quarantined" in refused.message and "truncated or corrupted" in refused.message
    assert "Errno" not in refused.message, refused.message
    rollback = client.create_client(Rollback, "kv_manager/rollback")
    done = ros.call(rollback, Rollback.Request(name="kept"))
    assert done.success, done.message
    assert node.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
    assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
