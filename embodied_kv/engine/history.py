"""The engine's own capsule names, and rollback by steps: the automatic capsule after
every engine cycle of the current timeline (one step = one cycle = replan_every
control ticks). `episode_start` (what `reset` restores) and `auto-*` are out of
clients' reach: check_client_name refuses them.

Names are `auto-<process nonce>-<n>`, engine-owned (clients cannot write `auto-*`).
Only the current timeline is kept: a reset or a rollback by name clears it, so a
rollback by steps never walks into a discarded episode; a rollback by steps drops
the boundaries after its target.
"""

from __future__ import annotations

from collections.abc import Callable

from embodied_kv.kv.capsule_store import check_name

EPISODE_START = "episode_start"
AUTO_PREFIX = "auto-"


def check_client_name(name: str) -> None:
    """A capsule name a client may write: valid, and not one of the engine's own."""
    check_name(name)
    if name == EPISODE_START or name.startswith(AUTO_PREFIX):
        raise ValueError(
            f"capsule name {name!r} is reserved ({EPISODE_START!r} and {AUTO_PREFIX}* belong "
            "to the engine); choose another"
        )


class StepHistory:
    def __init__(self, delete: Callable[[str], None], keep: int):
        self._delete, self.keep = delete, keep  # delete(name): from the store, if there
        self.names: list[str] = []  # oldest first
        self._n = 0

    def __len__(self) -> int:
        return len(self.names)

    def record(self, nonce: str, take: Callable[[str], None]) -> None:
        """Snapshot this boundary with `take(name)`; drop the oldest beyond `keep`."""
        name = f"{AUTO_PREFIX}{nonce}-{self._n}"
        self._n += 1
        take(name)
        self.names.append(name)
        while len(self.names) > self.keep:
            self._delete(self.names.pop(0))

    def target(self, steps_back: int) -> str:
        """The boundary `steps_back` steps before the last; ValueError if not kept."""
        if not 0 <= steps_back < len(self.names):
            raise ValueError(
                f"steps_back={steps_back}: {len(self.names)} boundaries kept in this "
                "timeline (history; a reset or a rollback by name starts a new one)"
            )
        return self.names[-1 - steps_back]

    def drop_after(self, steps_back: int) -> None:
        """After a rollback by `steps_back`: the boundaries past the target go."""
        if steps_back:
            for name in self.names[-steps_back:]:
                self._delete(name)
            del self.names[-steps_back:]

    def clear(self) -> None:
        for name in self.names:
            self._delete(name)
        self.names.clear()
