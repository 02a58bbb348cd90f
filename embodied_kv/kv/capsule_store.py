"""Where capsules live: GPU (the engine's device), host (pinned on CUDA) and disk.

Each tier has a byte budget. Putting a capsule into a full tier demotes the least
recently used unpinned capsules one tier down (gpu -> host -> disk); a full disk
tier deletes its least recently used unpinned capsules. Pinned capsules never move.
A capsule is in exactly one tier. A restore promotes a host capsule to the GPU tier
when it fits; a disk capsule stays on disk (read and verified at every restore), so
what was saved to survive the process does survive it.

Every change is planned first (which capsule goes to which tier), then prepared
(files written, tensors copied) and only then committed to the index: a failure while
preparing removes what it wrote and leaves the store as it was.

The disk format is kv/capsule_disk.py. On start the store reconciles the folder with
its index: valid capsules are adopted (and count in the disk budget), everything else
it wrote (orphan payloads, bad manifests, temporary files) is removed.

A degraded disk never stops a start (docs/requests.md): files that cannot be removed
are left with a warning (`warnings`). A disk capsule that fails verification is
reported with the verification's reason and leaves the index; if its files cannot be
removed it is quarantined: its name answers with that reason, and a start on a folder
it cannot write verifies every capsule before adopting it, so it is not adopted again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from embodied_kv.kv.capsule import Capsule
from embodied_kv.kv.capsule_disk import NAME, DiskTier, check_name

TIERS = ("gpu", "host", "disk")
__all__ = ["NAME", "TIERS", "CapsuleInfo", "CapsuleStore", "StoreConfig", "check_name"]


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


@dataclass
class DiskCounters:
    adopted: int = 0  # capsules found on disk at start and indexed
    removed: int = 0  # files removed at start (orphans, bad manifests, temporary files)
    corrupted: int = 0  # capsules whose payload failed its checks on load (files removed)
    quarantined: int = 0  # capsules that failed verification and whose files stay
    left: int = 0  # files the store had to remove and could not (read-only folder)
    evicted: int = 0  # capsules deleted from a full tier


class CapsuleStore:
    def __init__(self, cfg: StoreConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self._caps: dict[str, Capsule] = {}
        self._clock = 0
        self.counters = DiskCounters()
        self.disk = DiskTier(Path(cfg.disk_dir)) if cfg.disk_dir else None
        self.disk_dir = self.disk.folder if self.disk is not None else None
        self.quarantine: dict[str, str] = {}  # name -> why it failed verification
        if self.disk is not None:
            self._reconcile_disk()

    @property
    def warnings(self) -> list[str]:
        """The disk tier's newest warnings (files left in place, capsules quarantined)."""
        return list(self.disk.warnings) if self.disk is not None else []

    @property
    def evicted(self) -> int:
        return self.counters.evicted

    # -- verbs -----------------------------------------------------------------------

    def put(self, capsule: Capsule, tier: str = "gpu", pin: bool = False) -> None:
        """Store under capsule.name (replacing one of that name) in `tier`; on failure the
        store is unchanged (the old capsule of that name included). info() describes it."""
        check_name(capsule.name)
        self._check_tier(tier)
        if pin and capsule.nbytes > self._budget(tier):
            raise ValueError(
                f"pinned capsule {capsule.name!r} ({capsule.nbytes} B) exceeds the {tier} "
                f"budget ({self._budget(tier)} B)"
            )
        new = dataclasses.replace(capsule, tensors=dict(capsule.tensors), pinned=pin, tier=tier)
        self._clock += 1
        new.last_used = self._clock
        self._change(new, tier)
        self.quarantine.pop(capsule.name, None)

    def load(self, name: str) -> Capsule:
        """The capsule with its tensors (read and verified from disk for the disk tier),
        without changing the store. A disk capsule that fails its checks leaves the
        index, its files are removed (or, where they cannot be, it is quarantined) and
        ValueError gives the verification's reason: it can never be restored."""
        cap = self._lookup(name)
        if cap.tier != "disk":
            return cap
        try:
            tensors = self._read(cap)
        except ValueError as e:
            self._forget(name)
            self.counters.corrupted += 1
            if not self.disk.discard(name):
                self.quarantine[name] = str(e)
                self._count_disk()
                raise ValueError(
                    f"{e}; quarantined: its files stay ({self.disk.warnings[-1]}), it is not "
                    "adopted again (a start verifies the capsules of a folder it cannot write)"
                ) from e
            raise
        return dataclasses.replace(cap, tensors={k: to_host(v) for k, v in tensors.items()})

    def used(self, loaded: Capsule) -> bool:
        """After a restore from `loaded` (what load() returned): mark it recently used and
        promote a host capsule to the GPU tier if it fits. Best effort: False (store
        unchanged) when the promotion could not be done."""
        cap = self._caps.get(loaded.name)
        if cap is None:
            return False
        self._clock += 1
        cap.last_used = self._clock
        if cap.tier != "host" or cap.pinned or cap.nbytes > self.cfg.gpu_bytes:
            return True
        moved = dataclasses.replace(cap, tensors=dict(loaded.tensors))
        try:
            self._change(moved, "gpu")
        except (OSError, RuntimeError, ValueError):
            return False
        return True

    def get(self, name: str) -> Capsule:
        """load() then used(): the capsule with its tensors, promoted when it fits."""
        loaded = self.load(name)
        self.used(loaded)
        cap = self._caps.get(name)
        return cap if cap is not None and cap.tier != "disk" else loaded

    def delete(self, name: str) -> None:
        cap = self._lookup(name)
        self._forget(name)
        if cap.tier == "disk":
            self._unlink(name)

    # Readers (listing, diagnostics) may run beside the engine cycle's history
    # snapshots: they read a copy of the index, and a capsule's digest is set before
    # it can lose its tensors to the disk tier.

    def info(self, name: str) -> CapsuleInfo:
        return describe(self._lookup(name))

    def list(self) -> list[CapsuleInfo]:
        return [describe(c) for c in sorted(list(self._caps.values()), key=lambda c: c.name)]

    def names(self) -> list[str]:
        return sorted(list(self._caps))

    def metas(self) -> list[tuple[str, str, dict]]:
        """(name, tier, meta) of every capsule: the metadata is in memory for every tier."""
        return [(c.name, c.tier, c.meta) for c in list(self._caps.values())]

    def bytes_by_tier(self) -> dict[str, int]:
        used = dict.fromkeys(TIERS, 0)
        for c in list(self._caps.values()):
            used[c.tier] += c.nbytes
        return used

    def __contains__(self, name: str) -> bool:
        return name in self._caps

    # -- planned changes ---------------------------------------------------------------

    def _change(self, new: Capsule, tier: str) -> None:
        """Put `new` (replacing its name) into `tier`, demoting or evicting others as the
        budgets say: plan, prepare (may fail: undone), commit (cannot fail)."""
        caps = {n: c for n, c in self._caps.items() if n != new.name}
        caps[new.name] = new
        old = self._caps.get(new.name)
        current = {n: c.tier for n, c in caps.items()}
        current[new.name] = "new"  # always prepared: written or copied into its tier
        target = self._plan(caps, {**current, new.name: tier}, new)

        written: list[str] = []
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        # the new capsule last: once its files replace an old one's, nothing else can fail
        order = sorted(target, key=lambda n: n == new.name)
        try:
            for n in order:
                t = target[n]
                if t is None or t == current[n]:
                    continue
                if t == "disk":
                    self._write(caps[n])
                    written.append(n)
                else:
                    tensors[n] = self._convert(caps[n].tensors, t)
        except BaseException:
            for n in written:  # the new capsule's write is last: never among these
                self._unlink(n)
            raise

        # commit: index and files follow the plan
        if old is not None and old.tier == "disk" and target[new.name] != "disk":
            self._unlink(new.name)
        for n, t in target.items():
            cap = caps[n]
            if t is None:
                self._forget(n)
                if current[n] == "disk":
                    self._unlink(n)
                self.counters.evicted += 1
                continue
            was_disk = current[n] == "disk"
            if t == "disk":
                cap.tensors = {}
            elif n in tensors:
                cap.tensors = tensors[n]
            cap.tier = t
            self._caps[n] = cap
            if was_disk and t != "disk":
                self._unlink(n)

    def _plan(
        self, caps: dict[str, Capsule], tiers: dict[str, str], keep: Capsule
    ) -> dict[str, str | None]:
        """Final tier of every capsule (None: deleted) once every budget fits: the LRU
        unpinned capsule of a full tier moves one tier down (`keep` only if nothing
        else can); a full disk tier (or host without one) deletes."""
        tiers = dict(tiers)
        for tier in TIERS:
            while sum(caps[n].nbytes for n, t in tiers.items() if t == tier) > self._budget(tier):
                victims = [
                    caps[n]
                    for n, t in tiers.items()
                    if t == tier and not caps[n].pinned and n != keep.name
                ]
                if not victims and not keep.pinned and tiers[keep.name] == tier:
                    victims = [keep]
                if not victims:
                    break  # only pinned capsules left: the budget is advisory for them
                v = min(victims, key=lambda c: c.last_used)
                lower = TIERS[TIERS.index(tier) + 1] if tier != "disk" else None
                if lower == "disk" and self.disk_dir is None:
                    lower = None
                tiers[v.name] = lower
        return tiers

    def _convert(self, tensors: dict[str, torch.Tensor], tier: str) -> dict[str, torch.Tensor]:
        if tier == "gpu":
            return {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
        return {k: to_host(v) for k, v in tensors.items()}

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
        if tier == "disk" and not self.disk.writable():
            raise ValueError(
                f"the disk tier's folder {self.disk_dir} cannot be written (read-only): its "
                "capsules can be restored, no new one saved"
            )

    def _lookup(self, name: str) -> Capsule:
        if name not in self._caps and name in self.quarantine:
            raise ValueError(f"capsule {name!r} is quarantined: {self.quarantine[name]}")
        if name not in self._caps:
            known = ", ".join(sorted(self._caps)) or "none"
            raise ValueError(f"unknown capsule {name!r} (known: {known})")
        return self._caps[name]

    def _forget(self, name: str) -> None:
        self._caps.pop(name, None)

    # -- disk --------------------------------------------------------------------------

    def _write(self, cap: Capsule) -> None:
        self.disk.write(cap)

    def _read(self, cap: Capsule) -> dict[str, torch.Tensor]:
        return self.disk.read(cap.name, cap.digest)

    def _unlink(self, name: str) -> None:
        if self.disk is not None:
            self.disk.unlink(name)

    def _reconcile_disk(self) -> None:
        """Index the capsules a previous run left on disk (DiskTier.scan removed what
        cannot be one), oldest first for LRU; then the disk budget holds."""
        found, removed = self.disk.scan()
        self.counters.removed += removed
        self.quarantine.update(self.disk.quarantine)
        for cap in found:
            self._clock += 1
            cap.last_used = self._clock
            self._caps[cap.name] = cap
            self.counters.adopted += 1
        target = self._plan(self._caps, {n: c.tier for n, c in self._caps.items()}, _NOBODY)
        for name, tier in target.items():
            if tier is None:  # over the budget: not adopted, its files go where they can
                self._forget(name)
                self.disk.discard(name)
                self.counters.evicted += 1
        self._count_disk()

    def _count_disk(self) -> None:
        self.counters.quarantined = len(self.quarantine)
        self.counters.left = self.disk.left


_NOBODY = Capsule("", {}, {}, 0, pinned=True)  # a `keep` that keeps nothing


def describe(c: Capsule) -> CapsuleInfo:
    return CapsuleInfo(c.name, c.tier, c.nbytes, c.pinned, c.digest)


def to_host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    return t.pin_memory() if torch.cuda.is_available() else t
