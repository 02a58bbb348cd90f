"""The capsule store's disk tier: its folder always equals its index, digests cover
tensor bytes, and a failed change leaves the store as it was."""

import json

import pytest
import torch

from embodied_kv.kv.capsule import Capsule
from embodied_kv.kv.capsule_store import CapsuleStore, StoreConfig


def make_capsule(name, seed, n=64):
    g = torch.Generator().manual_seed(seed)
    tensors = {"kv.k.0": torch.randn(2, n, 1, 8, generator=g), "queue.last": torch.zeros(3)}
    meta = {"name": name, "identity": {"weights": "w", "config": "c"}, "seed": seed}
    return Capsule(name, tensors, meta, sum(t.numel() * 4 for t in tensors.values()))


def disk_files(folder):
    return sorted(p.name for p in folder.iterdir())


def expected_files(store):
    return sorted(f"{i.name}.{ext}" for i in store.list() if i.tier == "disk"
                  for ext in ("json", "safetensors"))  # fmt: skip


def test_folder_equals_index_after_restart(tmp_path):
    store = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))
    for i in range(3):
        store.put(make_capsule(f"c{i}", i), "disk")
    store.put(make_capsule("c0", 10), "host")  # replaced: its files go
    store.delete("c1")
    store.used(store.load("c2"))  # restored: a disk capsule stays on disk
    assert store.info("c2").tier == "disk"
    assert disk_files(tmp_path) == expected_files(store) == ["c2.json", "c2.safetensors"]

    # what a crash or an older version leaves behind, and files of other programs
    (tmp_path / ".c3.safetensors.x1b2.tmp").write_bytes(b"half")
    (tmp_path / "orphan.safetensors").write_bytes((tmp_path / "c2.safetensors").read_bytes())
    doc = json.loads((tmp_path / "c2.json").read_text())
    (tmp_path / "nopayload.json").write_text(json.dumps({**doc, "name": "nopayload"}))
    (tmp_path / "old.json").write_text(json.dumps({**doc, "name": "old",
                                                   "format": "embodied_kv.capsule/1"}))  # fmt: skip
    (tmp_path / "old.safetensors").write_bytes(b"an older payload")
    foreign = {"notes.json": "{not ours", "weights.safetensors": "not ours either"}
    for name, text in foreign.items():
        (tmp_path / name).write_text(text)
    fresh = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))
    assert [i.name for i in fresh.list()] == ["c2"]
    assert fresh.counters.adopted == 1 and fresh.counters.removed == 5
    assert disk_files(tmp_path) == sorted(expected_files(fresh) + list(foreign))
    assert fresh.bytes_by_tier()["disk"] == store.info("c2").nbytes  # counted in the budget
    assert torch.equal(fresh.load("c2").tensors["kv.k.0"], make_capsule("c2", 2).tensors["kv.k.0"])


def test_adopted_capsules_beyond_the_disk_budget_are_evicted_oldest_first(tmp_path):
    store = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))
    for i in range(3):
        store.put(make_capsule(f"c{i}", i), "disk")
    size = store.info("c0").nbytes
    fresh = CapsuleStore(StoreConfig(disk_bytes=2 * size, disk_dir=str(tmp_path)))
    assert [i.name for i in fresh.list()] == ["c1", "c2"]
    assert disk_files(tmp_path) == expected_files(fresh)


def swap_payload(folder, victim, donor):
    """The donor's payload (a valid file, same names and shapes) under the victim's
    manifest: only a digest over the tensor bytes tells them apart."""
    (folder / f"{victim}.safetensors").write_bytes((folder / f"{donor}.safetensors").read_bytes())
    assert json.loads((folder / f"{victim}.json").read_text())["name"] == victim


def test_swapped_payload_is_refused_and_removed(tmp_path):
    store = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))
    store.put(make_capsule("a", 1), "disk")
    store.put(make_capsule("b", 2), "disk")
    swap_payload(tmp_path, "a", "b")
    with pytest.raises(ValueError, match="digest"):
        store.load("a")
    assert "a" not in store and not (tmp_path / "a.json").exists()
    store.put(make_capsule("a", 1), "disk")
    swap_payload(tmp_path, "a", "b")
    fresh = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))  # after a restart too
    with pytest.raises(ValueError, match="digest"):
        fresh.load("a")
    assert "a" not in fresh and disk_files(tmp_path) == expected_files(fresh)
    assert torch.equal(fresh.load("b").tensors["kv.k.0"], make_capsule("b", 2).tensors["kv.k.0"])


def test_failed_put_keeps_the_capsule_it_would_replace(tmp_path, monkeypatch):
    store = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))
    store.put(make_capsule("keep", 1), "disk")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    info = store.info("keep")

    def full_disk(*args, **kwargs):
        raise OSError("injected: no space left on device")

    monkeypatch.setattr("embodied_kv.kv.capsule_disk.save_file", full_disk)
    with pytest.raises(OSError, match="injected"):
        store.put(make_capsule("keep", 2), "disk")
    assert store.info("keep") == info
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_names_are_validated_whole(tmp_path):
    store = CapsuleStore(StoreConfig(disk_dir=str(tmp_path)))
    for bad in ("abc\n", "a\tb", "", ".hidden", "-dash", "../up", "x" * 129, "é"):
        with pytest.raises(ValueError, match="bad capsule name"):
            store.put(make_capsule(bad, 0), "gpu")
    assert store.list() == [] and disk_files(tmp_path) == []
