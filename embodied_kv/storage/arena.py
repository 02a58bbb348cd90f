"""The static KV arena: every layer's K and V for every slot, allocated once.

    k, v      [L, S + 1, T, Hkv, D]   one contiguous tensor each; layer l is the view k[l]
    length    [L, S + 1] int64 (host) valid rows per layer and slot (may differ by layer)
    next_pos  [S + 1]    int64 (host) the RoPE position the slot's next token gets

Slot S (the last one) is the scratch slot: padding tokens of a packed step write
there, so real slots never see them. K is stored after RoPE. Nothing here allocates
after construction; `allocate` returns None when every slot is in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kernels.packed_attention import KEY_BLOCK, row_bucket

# Headroom kept free on a CUDA device after the arena (activations, graphs, cuBLAS workspace).
CUDA_HEADROOM_BYTES = 2 << 30


@dataclass(frozen=True)
class ArenaSpec:
    num_layers: int  # backbone depth (pi0.5: 18)
    num_slots: int  # sequences held at once (frames in flight + language requests)
    max_len: int  # rows per slot, a multiple of KEY_BLOCK
    kv_heads: int  # pi0.5: 1 (MQA)
    head_dim: int  # pi0.5: 256
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if min(self.num_layers, self.num_slots, self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"arena dimensions must be positive: {self}")
        if self.max_len < KEY_BLOCK or self.max_len % KEY_BLOCK:
            raise ValueError(f"max_len={self.max_len} must be a positive multiple of {KEY_BLOCK}")

    @property
    def bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        rows = self.num_layers * (self.num_slots + 1) * self.max_len
        return 2 * rows * self.kv_heads * self.head_dim * elem


class KVArena:
    def __init__(self, spec: ArenaSpec, device: torch.device | str = "cpu"):
        device = torch.device(device)
        check_fits(spec, device)
        self.spec = spec
        self.device = device
        shape = (spec.num_layers, spec.num_slots + 1, spec.max_len, spec.kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.length = torch.zeros(spec.num_layers, spec.num_slots + 1, dtype=torch.int64)
        self.next_pos = torch.zeros(spec.num_slots + 1, dtype=torch.int64)
        self._free = list(range(spec.num_slots))
        assert row_bucket(device) <= spec.max_len

    @property
    def scratch_slot(self) -> int:
        return self.spec.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def in_use(self) -> list[int]:
        free = set(self._free)
        return [s for s in range(self.spec.num_slots) if s not in free]

    def free_slots(self) -> list[int]:
        return sorted(self._free)

    def set_free_slots(self, slots: list[int]) -> None:
        """Replace the free list (capsule restore); every other slot counts as in use."""
        if len(set(slots)) != len(slots) or any(not 0 <= s < self.spec.num_slots for s in slots):
            raise ValueError(f"bad free list {slots} for {self.spec.num_slots} slots")
        self._free = sorted(slots)

    def allocate(self) -> int | None:
        """Take the lowest free slot, emptied; None when all are in use."""
        if not self._free:
            return None
        self._free.sort()
        slot = self._free.pop(0)
        self.clear(slot)
        return slot

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        if slot in self._free:
            raise ValueError(f"slot {slot} released twice")
        self._free.append(slot)

    def clear(self, slot: int) -> None:
        """Forget a slot's rows (the bytes stay; lengths say they are invalid)."""
        self.length[:, slot] = 0
        self.next_pos[slot] = 0

    def truncate(self, slot: int, n_rows: int) -> None:
        """Keep the first n_rows rows in every layer (positions follow)."""
        self._check_slot(slot)
        if n_rows < 0 or n_rows > int(self.length[:, slot].min()):
            raise ValueError(
                f"cannot truncate slot {slot} of length {self.length[:, slot].tolist()} to {n_rows}"
            )
        self.length[:, slot] = n_rows
        self.next_pos[slot] = n_rows

    def slot_len(self, slot: int) -> int:
        """Rows valid in every layer (the common length before any compression)."""
        return int(self.length[:, slot].max())

    def copy_slot(self, src: int, dst: int) -> None:
        """Byte copy of a slot's valid rows and metadata (fork / share a prefix)."""
        n = self.slot_len(src)
        self.k[:, dst, :n].copy_(self.k[:, src, :n])
        self.v[:, dst, :n].copy_(self.v[:, src, :n])
        self.length[:, dst] = self.length[:, src]
        self.next_pos[dst] = self.next_pos[src]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.spec.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.spec.num_slots - 1}")


def check_fits(spec: ArenaSpec, device: torch.device) -> None:
    """Fail at configure time with the numbers, not with an OOM in the first step."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    # blocks torch's caching allocator keeps after frees are taken by no tensor: the
    # arena's allocation reuses them, though the driver counts them as used
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if spec.bytes + CUDA_HEADROOM_BYTES > free:
        raise RuntimeError(
            f"KV arena needs {spec.bytes / 2**30:.2f} GiB (+{CUDA_HEADROOM_BYTES / 2**30:.0f} GiB "
            f"headroom) but {device} has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free; "
            f"lower num_slots ({spec.num_slots}) or max_len ({spec.max_len})"
        )
