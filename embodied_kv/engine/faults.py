"""Failure isolation of the control cycle: count, report, and stop failing forever.

A cycle that raises is undone by the engine (slots it took are released, tasks it
took go back to the queue) and counted here. `limit` failures in a row put the
engine in its safe state: the last action is held, language is paused, and the
reason is reported (an ERROR on /diagnostics) until a restore (reset / rollback)
gives it a state to run from. These counters describe the process: a restore never
rolls them back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CycleFaults:
    limit: int  # failures in a row that enter the safe state
    failures: int = 0  # every failed cycle of this process
    consecutive: int = 0
    last_error: str = ""
    safe_reason: str = ""  # non-empty: in the safe state (why)
    safe_entries: int = 0

    @property
    def safe(self) -> bool:
        return bool(self.safe_reason)

    def failed(self, error: BaseException, frame: int) -> bool:
        """Count a failed cycle -> True when this failure entered the safe state."""
        self.failures += 1
        self.consecutive += 1
        self.last_error = f"frame {frame}: {type(error).__name__}: {error}"
        if self.consecutive >= self.limit and not self.safe:
            self.safe_reason = (
                f"{self.consecutive} engine cycles failed in a row (last: {self.last_error}); "
                "holding the last action, language paused until reset or rollback"
            )
            self.safe_entries += 1
            return True
        return False

    def succeeded(self) -> None:
        self.consecutive = 0

    def clear(self) -> None:
        """A restore gave the engine a known state: leave the safe state."""
        self.consecutive = 0
        self.safe_reason = ""
