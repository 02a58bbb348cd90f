"""A degraded capsule folder never stops a start (issue 35, 2): leftover temporary files on
a read-only folder are skipped with a warning; a capsule that fails verification is
reported with the verification's reason (not a cleanup's OSError) and quarantined, so no
later start adopts it. On a real read-only bind mount (`read_only`, test/kv/conftest.py),
and with the failing OS call injected where no mount can be made."""

import errno
import os
from pathlib import Path

import pytest

from embodied_kv.kv.capsule_disk import DiskTier
from embodied_kv.kv.capsule_store import CapsuleStore, StoreConfig

from .test_capsule_store import make_capsule

LEFTOVERS = (".big1.json.abc123.tmp", ".big1.safetensors.x1b2c3.tmp")  # a crash mid-write


def store_on(folder):
    return CapsuleStore(StoreConfig(disk_dir=str(folder)))


def files(folder):
    return sorted(p.name for p in Path(folder).iterdir())


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in the last tensor's data
    path.write_bytes(bytes(data))


def test_leftover_temp_files_on_a_read_only_folder_are_skipped_with_a_warning(read_only):
    rw, ro = read_only
    store_on(rw).put(make_capsule("good", 1), "disk")
    for name in LEFTOVERS:
        (rw / name).write_bytes(b"half a write")
    (rw / "orphan.safetensors").write_bytes((rw / "good.safetensors").read_bytes())
    before = files(rw)

    store = store_on(ro)  # configure: never an OSError from a cleanup
    assert store.names() == ["good"] and store.counters.adopted == 1
    assert store.counters.left == 3 and store.counters.removed == 0
    warned = "\n".join(store.warnings)
    assert all(name in warned for name in LEFTOVERS) and "Read-only file system" in warned
    assert files(rw) == before  # nothing could go, nothing went
    assert store.load("good").tensors.keys() == make_capsule("good", 1).tensors.keys()
    with pytest.raises(ValueError, match="cannot be written \\(read-only\\)"):
        store.put(make_capsule("new", 2), "disk")
    store.put(make_capsule("new", 2), "host")  # the other tiers work as before


def test_corrupted_capsule_on_a_read_only_folder_is_reported_and_never_adopted_again(read_only):
    rw, ro = read_only
    writer = store_on(rw)
    writer.put(make_capsule("good", 1), "disk")
    writer.put(make_capsule("bad", 2), "disk")
    store = store_on(ro)
    assert store.names() == ["bad", "good"]  # both verified at adoption: intact then
    corrupt(rw / "bad.safetensors")  # the payload changes under the running robot

    with pytest.raises(ValueError, match="truncated or corrupted") as err:
        store.load("bad")
    assert "quarantined" in str(err.value) and "Errno" not in str(err.value).split(";")[0]
    assert store.names() == ["good"] and store.counters.corrupted == 1
    assert store.counters.quarantined == 1
    assert (rw / "bad.json").is_file() and (rw / "bad.safetensors").is_file()  # could not go
    with pytest.raises(ValueError, match="'bad' is quarantined: .*truncated or corrupted"):
        store.load("bad")  # asked again: the same reason

    restarted = store_on(ro)  # the next start: verified before adoption, not adopted
    assert restarted.names() == ["good"] and restarted.counters.quarantined == 1
    assert any("'bad'" in w and "not adopted" in w for w in restarted.warnings)
    with pytest.raises(ValueError, match="'bad' is quarantined: .*truncated or corrupted"):
        restarted.load("bad")
    restarted.load("good")


def test_engine_configures_on_a_read_only_folder_and_restores_report_corruption(
    tiny_model, read_only
):
    from embodied_kv.engine.engine import Engine, EngineConfig

    rw, ro = read_only
    cfg = EngineConfig(control_hz=0.01, store=StoreConfig(disk_dir=str(rw)))
    first = Engine(cfg, model=tiny_model)
    first.begin_episode()
    first.snapshot("kept", "disk")
    first.snapshot("big1", "disk")
    for name in LEFTOVERS:
        (rw / name).write_bytes(b"half a write")

    on_ro = EngineConfig(control_hz=0.01, store=StoreConfig(disk_dir=str(ro)))
    engine = Engine(on_ro, model=tiny_model)  # the robot configures
    engine.begin_episode()  # its pinned episode_start goes to the GPU tier, not the disk
    corrupt(rw / "big1.safetensors")
    with pytest.raises(ValueError, match="truncated or corrupted"):
        engine.restore("big1")
    engine.restore("kept")
    assert Engine(on_ro, model=tiny_model).store.names() == ["kept"]


@pytest.fixture
def tiny_model():
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.vla import build_model

    return build_model(get_preset("tiny"))


# -- the same logic where no read-only mount can be made: the OS call fails on purpose ------


@pytest.fixture
def failing_folder(tmp_path, monkeypatch):
    """tmp_path as a read-only folder would behave: every unlink in it fails with EROFS and
    the folder reports itself unwritable (the two OS boundaries the disk tier uses)."""
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.parent == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, missing_ok=missing_ok)

    def failing():
        monkeypatch.setattr(Path, "unlink", unlink)
        monkeypatch.setattr(DiskTier, "writable", lambda self: False)

    return failing


def test_injected_read_only_failures_give_the_same_outcome(tmp_path, failing_folder):
    writer = store_on(tmp_path)
    writer.put(make_capsule("good", 1), "disk")
    writer.put(make_capsule("bad", 2), "disk")
    for name in LEFTOVERS:
        (tmp_path / name).write_bytes(b"half a write")
    failing_folder()
    store = store_on(tmp_path)
    assert store.names() == ["bad", "good"] and store.counters.left == 2
    corrupt(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="truncated or corrupted.*quarantined"):
        store.load("bad")
    assert (tmp_path / "bad.json").is_file()
    restarted = store_on(tmp_path)
    assert restarted.names() == ["good"]
    with pytest.raises(ValueError, match="'bad' is quarantined"):
        restarted.load("bad")
