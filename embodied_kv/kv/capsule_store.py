"""Where capsules live: GPU (the engine's device), host (pinned on CUDA) and disk.

Each tier has a byte budget. Putting a capsule into a full tier demotes the least
recently used unpinned capsules one tier down (gpu -> host -> disk); a full disk
tier deletes its least recently used unpinned capsules. Pinned capsules never move.
`get` promotes a capsule to the GPU tier when it fits.

Disk format, per capsule: `<name>.safetensors` (tensors; metadata holds nothing
executable) and `<name>.json` (format, digest, sha256 of the payload, meta). Both
are written to temporary files and renamed, the manifest last; loading checks the
format, the sha256 and the digest. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from embodied_kv.kv.capsule import FORMAT, Capsule, capsule_digest

TIERS = ("gpu", "host", "disk")
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class StoreConfig:
    gpu_bytes: int = 512 << 20  # device tier budget (B)
    host_bytes: int = 2 << 30  # host tier budget (B), pinned when CUDA is present
    disk_bytes: int = 16 << 30  # disk tier budget (B)
    disk_dir: str = ""  # required for the disk tier; "" = no disk tier

    def __post_init__(self):
        if min(self.gpu_bytes, self.host_bytes, self.disk_bytes) < 0:
            raise ValueError(f"tier budgets must be >= 0: {self}")


@dataclass(frozen=True)
class CapsuleInfo:
    name: str
    tier: str
    nbytes: int
    pinned: bool
    digest: str


class CapsuleStore:
    def __init__(self, cfg: StoreConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self._caps: dict[str, Capsule] = {}
        self._clock = 0
        self.evicted = 0  # capsules deleted from a full disk tier
        self.disk_dir = Path(cfg.disk_dir) if cfg.disk_dir else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk()

    # -- verbs -----------------------------------------------------------------------

    def put(self, capsule: Capsule, tier: str = "gpu", pin: bool = False) -> CapsuleInfo:
        """Store under capsule.name (replacing one of that name) in `tier`."""
        check_name(capsule.name)
        self._check_tier(tier)
        if pin and capsule.nbytes > self._budget(tier):
            raise ValueError(
                f"pinned capsule {capsule.name!r} ({capsule.nbytes} B) exceeds the {tier} "
                f"budget ({self._budget(tier)} B)"
            )
        if capsule.name in self._caps:
            self.delete(capsule.name)
        capsule = dataclasses.replace(capsule, tensors=dict(capsule.tensors), pinned=pin)
        self._touch(capsule)
        self._place(capsule, tier)
        return self.info(capsule.name)

    def get(self, name: str) -> Capsule:
        """The capsule with its tensors loaded, promoted to the GPU tier if it fits."""
        cap = self._lookup(name)
        self._touch(cap)
        if cap.tier == "disk":
            try:
                cap.tensors = self._read(name)
            except ValueError:
                self._forget(name)
                raise
            cap.tier = "host"
            cap.tensors = {k: to_host(v) for k, v in cap.tensors.items()}
            self._evict_to_fit("host", keep=cap)
        if cap.tier != "gpu" and not cap.pinned and cap.nbytes <= self.cfg.gpu_bytes:
            self._move(cap, "gpu")
            self._evict_to_fit("gpu", keep=cap)
        return cap

    def delete(self, name: str) -> None:
        cap = self._lookup(name)
        if cap.tier == "disk":
            self._unlink(name)
        self._forget(name)

    def info(self, name: str) -> CapsuleInfo:
        c = self._lookup(name)
        return CapsuleInfo(c.name, c.tier, c.nbytes, c.pinned, c.digest)

    def list(self) -> list[CapsuleInfo]:
        return [self.info(n) for n in sorted(self._caps)]

    def bytes_by_tier(self) -> dict[str, int]:
        used = dict.fromkeys(TIERS, 0)
        for c in self._caps.values():
            used[c.tier] += c.nbytes
        return used

    def __contains__(self, name: str) -> bool:
        return name in self._caps

    # -- tiers -----------------------------------------------------------------------

    def _place(self, cap: Capsule, tier: str) -> None:
        if tier == "disk":
            self._write(cap)
            cap.tensors, cap.tier = {}, "disk"
        else:
            self._move(cap, tier)
        self._caps[cap.name] = cap
        self._evict_to_fit(tier, keep=cap)

    def _move(self, cap: Capsule, tier: str) -> None:
        conv = (lambda t: t.to(self.device, non_blocking=True)) if tier == "gpu" else to_host
        cap.tensors = {k: conv(v) for k, v in cap.tensors.items()}
        cap.tier = tier

    def _evict_to_fit(self, tier: str, keep: Capsule) -> None:
        """Demote (or, on disk, delete) LRU unpinned capsules until `tier` fits."""
        while self.bytes_by_tier()[tier] > self._budget(tier):
            victims = [
                c for c in self._caps.values() if c.tier == tier and not c.pinned and c is not keep
            ]
            if not victims:
                victims = [keep] if not keep.pinned and keep.tier == tier else []
            if not victims:
                return  # only pinned capsules left: the budget is advisory for them
            v = min(victims, key=lambda c: c.last_used)
            if tier == "disk":
                self.delete(v.name)
                self.evicted += 1
            else:
                lower = TIERS[TIERS.index(tier) + 1]
                if lower == "disk" and self.disk_dir is None:
                    self.delete(v.name)
                    self.evicted += 1
                else:
                    self._caps.pop(v.name)
                    self._place(v, lower)

    def _budget(self, tier: str) -> int:
        return {
            "gpu": self.cfg.gpu_bytes,
            "host": self.cfg.host_bytes,
            "disk": self.cfg.disk_bytes,
        }[tier]

    def _check_tier(self, tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; use one of {TIERS}")
        if tier == "disk" and self.disk_dir is None:
            raise ValueError("the disk tier needs StoreConfig.disk_dir")

    def _lookup(self, name: str) -> Capsule:
        if name not in self._caps:
            known = ", ".join(sorted(self._caps)) or "none"
            raise ValueError(f"unknown capsule {name!r} (known: {known})")
        return self._caps[name]

    def _touch(self, cap: Capsule) -> None:
        self._clock += 1
        cap.last_used = self._clock

    def _forget(self, name: str) -> None:
        self._caps.pop(name, None)

    # -- disk ------------------------------------------------------------------------

    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.disk_dir / f"{name}.safetensors", self.disk_dir / f"{name}.json"

    def _write(self, cap: Capsule) -> None:
        payload, manifest = self._paths(cap.name)
        tensors = {k: v.detach().contiguous().cpu() for k, v in cap.tensors.items()}
        tmp = atomic_tmp(payload)
        save_file(tensors, tmp)
        sha = file_sha256(tmp)
        os.replace(tmp, payload)
        doc = {
            "format": FORMAT,
            "name": cap.name,
            "digest": cap.digest,
            "sha256": sha,
            "nbytes": cap.nbytes,
            "pinned": cap.pinned,
            "meta": cap.meta,
        }
        tmp = atomic_tmp(manifest)
        Path(tmp).write_text(json.dumps(doc, sort_keys=True))
        os.replace(tmp, manifest)

    def _read_manifest(self, name: str) -> dict:
        _, manifest = self._paths(name)
        try:
            doc = json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"capsule {name!r} on disk: unreadable manifest ({e})") from e
        if doc.get("format") != FORMAT or doc.get("name") != name:
            raise ValueError(f"capsule {name!r} on disk: format {doc.get('format')!r} != {FORMAT}")
        if capsule_digest(doc["meta"]) != doc["digest"]:
            raise ValueError(f"capsule {name!r} on disk: manifest digest does not match its meta")
        return doc

    def _read(self, name: str) -> dict[str, torch.Tensor]:
        doc = self._read_manifest(name)
        payload, _ = self._paths(name)
        if not payload.exists() or file_sha256(payload) != doc["sha256"]:
            raise ValueError(
                f"capsule {name!r} on disk is truncated or corrupted (sha256 mismatch)"
            )
        return load_file(str(payload))

    def _unlink(self, name: str) -> None:
        for p in self._paths(name):
            p.unlink(missing_ok=True)

    def _scan_disk(self) -> None:
        """Index capsules a previous run left on disk (manifests only; payloads on demand)."""
        for manifest in sorted(self.disk_dir.glob("*.json")):
            name = manifest.stem
            try:
                check_name(name)
                doc = self._read_manifest(name)
            except ValueError:
                continue
            self._caps[name] = Capsule(
                name, {}, doc["meta"], doc["digest"], doc["nbytes"], "disk", doc["pinned"]
            )


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"bad capsule name {name!r}: use 1-128 of [A-Za-z0-9_.-], not starting with '.'"
        )


def to_host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    return t.pin_memory() if torch.cuda.is_available() else t


def atomic_tmp(path: Path) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return tmp


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
