import pytest
import torch

from embodied_kv.kernels.packed_attention import bucket
from embodied_kv.storage.arena import ArenaSpec, KVArena
from embodied_kv.storage.step import Segment, commit_step, plan_step, to_device_as_one, unpack


def make_arena(num_slots=3, max_len=128, layers=2):
    return KVArena(ArenaSpec(layers, num_slots, max_len, kv_heads=1, head_dim=8))


def test_allocate_lowest_free_then_none_when_full():
    a = make_arena(num_slots=3)
    assert [a.allocate(), a.allocate(), a.allocate()] == [0, 1, 2]
    assert a.allocate() is None
    a.release(1)
    assert a.allocate() == 1
    assert a.in_use() == [0, 1, 2]


def test_release_twice_and_unknown_slot_are_errors():
    a = make_arena()
    s = a.allocate()
    a.release(s)
    with pytest.raises(ValueError, match="released twice"):
        a.release(s)
    with pytest.raises(ValueError, match="outside"):
        a.release(3)  # the scratch slot is never handed out


def test_spec_validation_and_bytes():
    with pytest.raises(ValueError, match="multiple of 64"):
        ArenaSpec(1, 1, 100, 1, 8)
    spec = ArenaSpec(2, 3, 128, 1, 8)
    # K and V, (slots + scratch) rows, fp32
    assert spec.bytes == 2 * 2 * 4 * 128 * 1 * 8 * 4
    a = KVArena(spec)
    assert a.k.is_contiguous() and a.k.shape == (2, 4, 128, 1, 8)
    assert a.k.numel() * 4 * 2 == spec.bytes


def test_allocate_clears_lengths_but_keeps_buffers():
    a = make_arena()
    s = a.allocate()
    ptr = a.k.data_ptr()
    plan = plan_step(a, [Segment(s, 5)])
    commit_step(a, plan)
    assert a.slot_len(s) == 5 and int(a.next_pos[s]) == 5
    a.release(s)
    assert a.allocate() == s and a.slot_len(s) == 0
    assert a.k.data_ptr() == ptr


def test_plan_layout_rows_kv_len_and_padding():
    a = make_arena(num_slots=3)
    s0, s1 = a.allocate(), a.allocate()
    commit_step(a, plan_step(a, [Segment(s1, 7)]))
    plan = plan_step(a, [Segment(s0, 3, causal=False), Segment(s1, 2, causal=True)])
    assert plan.n_real == 5 and plan.n_padded == bucket(5)  # the next multiple of ROW_BUCKET
    assert plan.slot[:5].tolist() == [s0] * 3 + [s1] * 2
    assert plan.row[0, :5].tolist() == [0, 1, 2, 7, 8]
    assert plan.kv_len[0, :5].tolist() == [3, 3, 3, 8, 9]  # bidirectional, then causal
    assert plan.position[:5].tolist() == [0, 1, 2, 7, 8]
    assert set(plan.slot[5:].tolist()) == {a.scratch_slot}
    assert plan.last == [2, 4]


def test_plan_rejects_overflow_repeats_and_bad_slots():
    a = make_arena(num_slots=2, max_len=64)
    s = a.allocate()
    with pytest.raises(ValueError, match="exceed max_len"):
        plan_step(a, [Segment(s, 65)])
    with pytest.raises(ValueError, match="distinct"):
        plan_step(a, [Segment(s, 1), Segment(s, 1)])
    with pytest.raises(ValueError, match="bad segment"):
        plan_step(a, [Segment(a.scratch_slot, 1)])
    with pytest.raises(ValueError):
        plan_step(a, [])


def test_copy_and_truncate_slot():
    a = make_arena()
    s, d = a.allocate(), a.allocate()
    a.k[:, s, :4] = torch.randn(2, 4, 1, 8)
    commit_step(a, plan_step(a, [Segment(s, 4)]))
    a.copy_slot(s, d)
    assert torch.equal(a.k[:, d, :4], a.k[:, s, :4]) and a.slot_len(d) == 4
    a.truncate(d, 2)
    assert a.slot_len(d) == 2 and int(a.next_pos[d]) == 2
    with pytest.raises(ValueError):
        a.truncate(d, 3)


def test_a_plan_travels_to_the_device_as_one_copy():
    """plan_step's five tensors go to a GPU as one pinned copy (storage/step.py): the views of
    the one tensor are the parts, in order and shape; on the host nothing is copied."""
    a = make_arena(num_slots=3)
    s0, s1 = a.allocate(), a.allocate()
    plan = plan_step(a, [Segment(s0, 5, causal=False), Segment(s1, 2)])
    parts = [plan.slot, plan.position, plan.row, plan.kv_len, plan.last_index]
    assert to_device_as_one(parts, torch.device("cpu")) is parts
    flat = torch.cat([p.reshape(-1) for p in parts])
    views = unpack(flat, parts)
    assert all(v.shape == p.shape and torch.equal(v, p) for v, p in zip(views, parts, strict=True))
    assert all(v.untyped_storage().data_ptr() == flat.data_ptr() for v in views)
    on_meta = to_device_as_one(parts, torch.device("meta"))  # the device path, shapes only
    assert [t.shape for t in on_meta] == [p.shape for p in parts]
