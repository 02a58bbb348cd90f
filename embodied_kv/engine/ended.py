"""Requests that have ended, so that no restore ever brings one back (docs/requests.md).

A request ends once: when its final event (done=True, whatever the status) leaves the
engine. A capsule taken while it was live still holds it (its generation state, or its
place in the policy's queue), so restoring that capsule later would run it again and
send a second final event. The engine records here every ended id that a capsule in
the store still holds (the record shrinks as those capsules go) and drops those ids
from whatever a restore swaps in.

Across processes the record lives beside the disk tier: `ended-requests.json` in the
capsule folder lists the ended ids that disk capsules hold. It is rewritten (atomically)
when such an id ends and when a capsule that holds ended ids reaches the disk tier; a
new process reads it when the store adopts the folder. A folder that cannot be written
(read-only) keeps the record in this process only: `last_error` and `write_failures`
say so (/diagnostics).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from embodied_kv.kv.capsule_store import CapsuleStore
from embodied_kv.model.weights import atomic_path

LEDGER = "ended-requests.json"
FORMAT = "embodied_kv.ended/1"


def held_ids(meta: dict) -> set[str]:
    """Every request id a capsule's state holds: the manager's requests (live, or done and
    not yet reported) and the requests waiting in the policy's queue."""
    try:
        ids = {str(d["request_id"]) for d in meta.get("manager", {}).get("requests", [])}
        pending = meta.get("extras", {}).get("policy", {}).get("pending", [])
        return ids | {str(d["request_id"]) for d in pending}
    except (AttributeError, KeyError, TypeError):  # a malformed capsule fails its restore
        return set()


class EndedRequests:
    def __init__(self, store: CapsuleStore):
        self.store = store
        self.path: Path | None = store.disk_dir / LEDGER if store.disk_dir else None
        self.last_error = ""
        self.write_failures = 0
        self.ids: set[str] = self._read()
        self._saved = frozenset(self.ids)
        self.ids &= self._held()[0]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids

    def of(self, meta: dict) -> set[str]:
        """The ids a capsule holds that have ended: a restore of it drops them."""
        return held_ids(meta) & self.ids

    def add(self, ids: Iterable[str]) -> None:
        """The final events of these ids left the engine (ids no capsule holds are not
        kept: nothing can bring them back)."""
        new = set(ids) - self.ids
        if new:
            self.ids |= new
            self.sync()  # drops those no capsule holds

    def sync(self) -> None:
        """Forget ids no capsule holds any more; write the ledger if the ended ids that
        disk capsules hold changed (after a snapshot or a promotion moved capsules)."""
        held, on_disk = self._held()
        self.ids &= held
        if self.path is None:
            return
        want = frozenset(self.ids & on_disk)
        if want == self._saved:
            return
        try:
            self._write(want)
        except OSError as e:  # read-only or full disk: this process still knows
            self.write_failures += 1
            self.last_error = f"{self.path}: {type(e).__name__}: {e}"
        self._saved = want  # tried: the next write comes with the next change

    def _held(self) -> tuple[set[str], set[str]]:
        """The ids every capsule in the store holds, and those the disk capsules hold (one
        pass over the store's metas)."""
        held: set[str] = set()
        on_disk: set[str] = set()
        for _, tier, meta in self.store.metas():
            ids = held_ids(meta)
            held |= ids
            if tier == "disk":
                on_disk |= ids
        return held, on_disk

    def _read(self) -> set[str]:
        if self.path is None or not self.path.is_file():
            return set()
        try:
            doc = json.loads(self.path.read_text())
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            return {str(i) for i in doc["ids"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.last_error = f"{self.path}: unreadable, ignored ({type(e).__name__}: {e})"
            return set()

    def _write(self, ids: frozenset[str]) -> None:
        with atomic_path(self.path) as tmp:  # a name the disk tier's start-up scan knows
            Path(tmp).write_text(json.dumps({"format": FORMAT, "ids": sorted(ids)}))
