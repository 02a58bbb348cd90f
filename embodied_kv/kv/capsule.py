"""Execution-state capsules (FlashRT): a named, immutable byte copy of a whole boundary.

A capsule holds, as tensors and JSON:

    kv.k.<slot>, kv.v.<slot>   [L, n, Hkv, D]  rows [0, n) of every slot in use
    arena                       lengths per layer, next_pos, the free list
    manager                     every live request's generation state
    gen.<request id>            [bytes] uint8 sampler RNG state of a request
    <extra>.*                   sections of engine-level objects (action queue, policy,
                                memory, the engine's frame and observation)

plus a digest over the weights, the config, the metadata and every tensor's bytes.
Counters that describe the process (diagnostics) are not in it: they only grow.

Restore is two phases (docs/capsules.md): `stage` checks everything a restore needs (the
identity, every slot's tensors and shapes, every section's metadata) and builds the
new objects without touching the live state; `Staged.apply` then only copies into
the arena's fixed buffers and swaps Python objects. A capsule that fails staging
changes nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Protocol

import torch

from embodied_kv.kv.manager import KVCacheManager, Request, TaskKind
from embodied_kv.storage.arena import KVArena

FORMAT = "embodied_kv.capsule/2"


class Stateful(Protocol):
    """An engine-level object whose state a capsule carries (action queue, policy, ...).
    `check_state` raises ValueError for anything `load_state` could not load, so that
    `load_state` after a passing check cannot fail."""

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def state_meta(self) -> dict: ...

    def check_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None: ...

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None: ...


@dataclass(frozen=True)
class Identity:
    """What a capsule must match to be restored: the weights and the config."""

    weights: str  # model.weights.weights_identity: what the weights are (files or seed)
    config: str  # sha256 of the model config JSON and the arena spec


@dataclass
class Capsule:
    name: str
    tensors: dict[str, torch.Tensor]
    meta: dict  # JSON-able
    nbytes: int
    tier: str = "gpu"
    pinned: bool = False
    last_used: int = 0  # store clock, for LRU
    known_digest: str = field(default="", repr=False)  # computed once, on first use

    @property
    def identity(self) -> Identity:
        return Identity(self.meta["identity"]["weights"], self.meta["identity"]["config"])

    @property
    def digest(self) -> str:
        """sha256 of the metadata and every tensor's bytes; computed when first asked
        for (a snapshot reply, a listing, a disk write), never on the control path."""
        if not self.known_digest:
            self.known_digest = capsule_digest(self.meta, self.tensors)
        return self.known_digest


def capture(
    name: str,
    arena: KVArena,
    manager: KVCacheManager | None,
    identity: Identity,
    extras: dict[str, Stateful] | None = None,
    context: dict | None = None,
) -> Capsule:
    """Copy every slot in use (only its valid rows) and all state into a new capsule."""
    tensors: dict[str, torch.Tensor] = {}
    slots = arena.in_use()
    for s in slots:
        n = arena.slot_len(s)
        tensors[f"kv.k.{s}"] = arena.k[:, s, :n].clone()
        tensors[f"kv.v.{s}"] = arena.v[:, s, :n].clone()
    meta = {
        "format": FORMAT,
        "name": name,
        "identity": {"weights": identity.weights, "config": identity.config},
        "arena": {
            "slots": slots,
            "length": {str(s): arena.length[:, s].tolist() for s in slots},
            "next_pos": {str(s): int(arena.next_pos[s]) for s in slots},
            "free": arena.free_slots(),
        },
        "context": context or {},
        "extras": {},
    }
    if manager is not None:
        meta["manager"] = manager_meta(manager)
        for rid, req in manager.requests.items():
            if req.generator is not None:
                tensors[f"gen.{rid}"] = req.generator.get_state().clone()
    for key, obj in (extras or {}).items():
        meta["extras"][key] = obj.state_meta()
        for tname, t in obj.state_tensors().items():
            tensors[f"{key}.{tname}"] = t.detach().clone()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Capsule(name, tensors, meta, nbytes)


@dataclass
class Staged:
    """A checked capsule, ready to replace the live state (`apply` cannot fail on it)."""

    capsule: Capsule
    arena: KVArena
    manager: KVCacheManager | None
    requests: dict[str, Request] | None
    sections: list[tuple[Stateful, dict[str, torch.Tensor], dict]]

    def apply(self) -> None:
        cap, arena = self.capsule, self.arena
        a = cap.meta["arena"]
        arena.length.zero_()
        arena.next_pos.zero_()
        for s in a["slots"]:
            load_slot(cap, arena, s, s)
        arena.set_free_slots(a["free"])
        if self.requests is not None:
            self.manager.requests = self.requests
        for obj, tensors, meta in self.sections:
            obj.load_state(tensors, meta)


def stage(
    capsule: Capsule,
    arena: KVArena,
    manager: KVCacheManager | None,
    identity: Identity,
    extras: dict[str, Stateful] | None = None,
    kv_only: bool = False,
) -> Staged:
    """Check a capsule against this arena and these objects; build what a restore swaps
    in. ValueError naming the first problem; nothing live is touched.

    `kv_only` restores the KV rows alone: an ablation that shows the rest matters."""
    check_identity(capsule, identity)
    name, meta = capsule.name, capsule.meta
    try:
        a = meta["arena"]
        slots, free = [int(s) for s in a["slots"]], [int(s) for s in a["free"]]
        n_slots = arena.spec.num_slots
        if sorted(slots + free) != list(range(n_slots)):
            raise ValueError(f"slots {slots} and free list {free} do not partition {n_slots}")
        for s in slots:
            check_slot(capsule, arena, s)
        requests = sections = None
        if not kv_only:
            requests = None
            if manager is not None and "manager" in meta:
                requests = parse_requests(meta["manager"], capsule.tensors, set(slots))
            sections = []
            for key, obj in (extras or {}).items():
                if key not in meta["extras"]:
                    raise ValueError(f"no {key!r} section")
                ts = section_tensors(capsule, key)
                obj.check_state(ts, meta["extras"][key])
                sections.append((obj, ts, meta["extras"][key]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"capsule {name!r} cannot be restored: {type(e).__name__}: {e}") from e
    return Staged(capsule, arena, manager, requests, sections or [])


def restore(*args, **kwargs) -> None:
    """stage(...).apply() in one call (same arguments as stage): a capsule back into
    the live arena and objects, same slots, same buffers."""
    stage(*args, **kwargs).apply()


def section_tensors(capsule: Capsule, key: str) -> dict[str, torch.Tensor]:
    prefix = f"{key}."
    return {k[len(prefix) :]: v for k, v in capsule.tensors.items() if k.startswith(prefix)}


def check_slot(capsule: Capsule, arena: KVArena, s: int) -> None:
    """Slot `s` of the capsule fits slot `s` of this arena (tensors, lengths, positions)."""
    spec, a = arena.spec, capsule.meta["arena"]
    if not 0 <= s < spec.num_slots:
        raise ValueError(f"slot {s} outside this arena's {spec.num_slots}")
    k, v = capsule.tensors[f"kv.k.{s}"], capsule.tensors[f"kv.v.{s}"]
    n = k.shape[1] if k.dim() == 4 else -1
    want = (spec.num_layers, n, spec.kv_heads, spec.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or not 0 <= n <= spec.max_len:
        raise ValueError(f"slot {s}: K {tuple(k.shape)} / V {tuple(v.shape)}, expected {want}")
    if k.dtype != spec.dtype or v.dtype != spec.dtype:
        raise ValueError(f"slot {s}: dtype {k.dtype}/{v.dtype}, the arena holds {spec.dtype}")
    length = [int(x) for x in a["length"][str(s)]]
    if len(length) != spec.num_layers or any(not 0 <= x <= n for x in length):
        raise ValueError(f"slot {s}: lengths {length} do not match {n} rows")
    if not 0 <= int(a["next_pos"][str(s)]):
        raise ValueError(f"slot {s}: negative next_pos")


def load_slot(capsule: Capsule, arena: KVArena, src: int, dst: int) -> None:
    """Copy the capsule's rows and metadata of slot `src` into arena slot `dst`."""
    a = capsule.meta["arena"]
    k = capsule.tensors[f"kv.k.{src}"]
    n = k.shape[1]
    arena.k[:, dst, :n].copy_(k, non_blocking=True)
    arena.v[:, dst, :n].copy_(capsule.tensors[f"kv.v.{src}"], non_blocking=True)
    arena.length[:, dst] = torch.tensor(a["length"][str(src)])
    arena.next_pos[dst] = a["next_pos"][str(src)]


def fork_slots(capsule: Capsule, arena: KVArena, n: int) -> list[list[int]]:
    """n copies of the capsule's slots into free slots -> the slot ids of each branch."""
    slots = capsule.meta["arena"]["slots"]
    if n < 1 or n * len(slots) > arena.num_free:
        raise ValueError(
            f"fork of {capsule.name!r} x{n} needs {n * len(slots)} free slots, "
            f"{arena.num_free} are free"
        )
    branches = []
    for _ in range(n):
        branch = []
        for s in slots:
            d = arena.allocate()
            load_slot(capsule, arena, s, d)
            branch.append(d)
        branches.append(branch)
    return branches


def check_identity(capsule: Capsule, identity: Identity) -> None:
    mine = capsule.identity
    if mine.weights != identity.weights:
        raise ValueError(
            f"capsule {capsule.name!r} was taken with other weights "
            f"(weights digest {mine.weights[:12]} != running {identity.weights[:12]})"
        )
    if mine.config != identity.config:
        raise ValueError(
            f"capsule {capsule.name!r} was taken with another config "
            f"(config digest {mine.config[:12]} != running {identity.config[:12]})"
        )


def capsule_digest(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the metadata (identity, layout, generation state, sections) and of each
    tensor's name, dtype, shape and bytes: a payload swapped under a manifest fails it."""
    h = hashlib.sha256()
    h.update(json.dumps(meta, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().cpu()
        h.update(f"\n{key}:{t.dtype}:{list(t.shape)}\n".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy
    return h.hexdigest()


def identity_of(model, arena: KVArena) -> Identity:
    from embodied_kv.model.weights import config_json, weights_identity

    cfg = config_json(model.cfg) + repr(arena.spec)
    return Identity(weights_identity(model), hashlib.sha256(cfg.encode()).hexdigest())


def manager_meta(manager: KVCacheManager) -> dict:
    reqs = []
    for r in manager.requests.values():
        reqs.append(
            {
                "request_id": r.request_id,
                "kind": r.kind.value,
                "frame": r.frame,
                "slot": r.slot,
                "max_new_tokens": r.max_new_tokens,
                "pending": list(r.pending),
                "tokens": list(r.tokens),
                "emitted": r.emitted,
                "done": r.done,
                "truncated": r.truncated,
                "reason": r.reason,
                "temperature": r.temperature,
                "sampled": r.generator is not None,
            }
        )
    return {"requests": reqs}


def parse_requests(
    meta: dict, tensors: dict[str, torch.Tensor], slots: set[int]
) -> dict[str, Request]:
    """The requests of a capsule, each holding a slot of the capsule or none."""
    requests: dict[str, Request] = {}
    for d in meta["requests"]:
        gen = None
        if d["sampled"]:
            gen = torch.Generator()
            gen.set_state(tensors[f"gen.{d['request_id']}"].cpu())
        slot = d["slot"]
        if slot is not None and slot not in slots:
            raise ValueError(f"request {d['request_id']!r} holds slot {slot}, not in the capsule")
        req = Request(
            str(d["request_id"]),
            TaskKind(d["kind"]),
            int(d["frame"]),
            slot,
            int(d["max_new_tokens"]),
            [int(t) for t in d["pending"]],
            [int(t) for t in d["tokens"]],
            int(d["emitted"]),
            bool(d["done"]),
            bool(d["truncated"]),
            str(d.get("reason", "")),
            gen,
            float(d["temperature"]),
        )
        if req.request_id in requests:
            raise ValueError(f"request id {req.request_id!r} twice")
        requests[req.request_id] = req
    return requests
