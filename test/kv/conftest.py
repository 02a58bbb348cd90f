import tempfile
from pathlib import Path

import pytest
import torch

from embodied_kv.kv.memory_kv import rerotate
from embodied_kv.model.trained import TOKENIZER_FILE, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer


@pytest.fixture(scope="session")
def world_model():
    """The `world` preset (word tokenizer) with random weights: structure, not skill."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)
        return build_model(world_config(), tokenizer_path=str(tok))


class PerSegmentLoader:
    """The loader before the packed image (the exactness reference): every copy is one
    segment of one layer, K and V apart, straight from its block; keys re-rotated in the
    slot before the layer computes. Takes LayerLoader's arguments."""

    def __init__(self, arena, slot, rope, sources, schedule, image=None, shift=None):
        self.arena, self.slot, self.rope = arena, slot, rope
        self.shift = shift or [0] * schedule.num_layers
        self.sources, self.schedule = sources, schedule
        self.pending: dict[int, list[int]] = {}  # layer -> units copied, not yet rotated

    def issue(self, i, active):
        for c in self.schedule.issue(i, active):
            s = self.sources[c.unit]
            row = s.slot_row + self.shift[c.layer]
            dst, src = slice(row, row + s.n), slice(s.block_row, s.block_row + s.n)
            self.arena.k[c.layer, self.slot, dst].copy_(s.block.k[c.layer, src])
            self.arena.v[c.layer, self.slot, dst].copy_(s.block.v[c.layer, src])
            self.pending.setdefault(c.layer, []).append(c.unit)

    def wait(self, i):
        k = self.arena.k[i, self.slot]  # [T, Hkv, D]
        for u in self.pending.pop(i, []):
            s = self.sources[u]
            rows = slice(s.slot_row + self.shift[i], s.slot_row + self.shift[i] + s.n)
            k[rows] = rerotate(self.rope, k[rows], torch.full((s.n,), s.delta))


# -- a real read-only folder (issue 35: degraded disks) ------------------------------------

NO_MOUNT = ("no read-only mount can be made here ({}); the same logic is proven by the tests "
            "that inject the failing OS call (test_capsule_store_readonly.py)")  # fmt: skip


@pytest.fixture
def read_only(tmp_path):
    """-> (rw, ro): one folder, writable at `rw` and mounted read-only at `ro` (a bind mount
    remounted ro: root writes through chmod, not through a read-only mount). The mount goes
    at teardown; without the privilege to mount, the test is skipped with the reason."""
    import os
    import subprocess

    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(rw), str(ro)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(NO_MOUNT.format(getattr(e, "stderr", b"") or e))
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True,
                       capture_output=True)  # fmt: skip
        assert os.statvfs(ro).f_flag & os.ST_RDONLY, "the mount is not read-only"
        yield rw, ro
    except subprocess.CalledProcessError as e:
        pytest.skip(NO_MOUNT.format(e.stderr))
    finally:  # a payload still mapped by a test's tensors keeps it busy: detach it lazily
        if subprocess.run(["umount", str(ro)], check=False, capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(ro)], check=False, capture_output=True)
