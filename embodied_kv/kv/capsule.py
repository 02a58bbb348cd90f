"""Execution-state capsules (FlashRT): a named, immutable byte copy of a whole boundary.

A capsule holds, as tensors and JSON:

    kv.k.<slot>, kv.v.<slot>   [L, n, Hkv, D]  rows [0, n) of every slot in use
    arena                       lengths per layer, next_pos, the free list
    manager                     every live request's generation state and counters
    gen.<request id>            [bytes] uint8 sampler RNG state of a request
    <extra>.*                   sections of engine-level objects (action queue, loop)

plus a digest over the weights, the config and the token prefix. Capture and
restore are copies into and out of the arena's fixed buffers: nothing is
allocated in the arena and nothing is recomputed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Protocol

import torch

from embodied_kv.kv.arena import KVArena
from embodied_kv.kv.manager import KVCacheManager, ManagerCounters, Request, TaskKind

FORMAT = "embodied_kv.capsule/1"


class Stateful(Protocol):
    """An engine-level object whose state a capsule carries (action queue, loop)."""

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def state_meta(self) -> dict: ...

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
    digest: str
    nbytes: int
    tier: str = "gpu"
    pinned: bool = False
    last_used: int = 0  # store clock, for LRU

    @property
    def identity(self) -> Identity:
        return Identity(self.meta["identity"]["weights"], self.meta["identity"]["config"])


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
    digest = capsule_digest(meta)
    meta["digest"] = digest
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Capsule(name, tensors, meta, digest, nbytes)


def restore(
    capsule: Capsule,
    arena: KVArena,
    manager: KVCacheManager | None,
    identity: Identity,
    extras: dict[str, Stateful] | None = None,
    kv_only: bool = False,
) -> None:
    """Copy a capsule back into the live arena and objects (same slots, same buffers).

    `kv_only` restores the KV rows alone: an ablation that shows the rest matters."""
    check_identity(capsule, identity)
    a = capsule.meta["arena"]
    slots = a["slots"]
    if any(not 0 <= s < arena.spec.num_slots for s in slots):
        raise ValueError(f"capsule {capsule.name!r} uses slots {slots} outside this arena")
    arena.length.zero_()
    arena.next_pos.zero_()
    for s in slots:
        load_slot(capsule, arena, s, s)
    arena.set_free_slots(a["free"])
    if kv_only:
        return
    if manager is not None and "manager" in capsule.meta:
        load_manager(manager, capsule.meta["manager"], capsule.tensors)
    for key, obj in (extras or {}).items():
        if key not in capsule.meta["extras"]:
            raise ValueError(f"capsule {capsule.name!r} has no {key!r} section")
        prefix = f"{key}."
        ts = {k[len(prefix) :]: v for k, v in capsule.tensors.items() if k.startswith(prefix)}
        obj.load_state(ts, capsule.meta["extras"][key])


def load_slot(capsule: Capsule, arena: KVArena, src: int, dst: int) -> None:
    """Copy the capsule's rows and metadata of slot `src` into arena slot `dst`."""
    a = capsule.meta["arena"]
    k = capsule.tensors[f"kv.k.{src}"]
    n = k.shape[1]
    arena.k[:, dst, :n].copy_(k, non_blocking=True)
    arena.v[:, dst, :n].copy_(capsule.tensors[f"kv.v.{src}"], non_blocking=True)
    arena.length[:, dst] = torch.tensor(a["length"][str(src)])
    arena.next_pos[dst] = a["next_pos"][str(src)]


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


def capsule_digest(meta: dict) -> str:
    """sha256 of identity, token prefix (every request's tokens), arena layout, context."""
    h = hashlib.sha256()
    part = {k: meta[k] for k in ("identity", "arena", "context", "manager") if k in meta}
    h.update(json.dumps(part, sort_keys=True).encode())
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
                "temperature": r.temperature,
                "sampled": r.generator is not None,
            }
        )
    return {"requests": reqs, "counters": vars(manager.counters).copy()}


def load_manager(manager: KVCacheManager, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    manager.requests.clear()
    for d in meta["requests"]:
        gen = None
        if d["sampled"]:
            gen = torch.Generator()
            gen.set_state(tensors[f"gen.{d['request_id']}"].cpu())
        req = Request(
            d["request_id"],
            TaskKind(d["kind"]),
            d["frame"],
            d["slot"],
            d["max_new_tokens"],
            list(d["pending"]),
            list(d["tokens"]),
            d["emitted"],
            d["done"],
            d["truncated"],
            gen,
            d["temperature"],
        )
        manager.requests[req.request_id] = req
    manager.counters = ManagerCounters(**meta["counters"])
