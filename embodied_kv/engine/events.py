"""What the engine reports about a language request: one event per change, the last
one with done=True and the status the request ended with."""

from __future__ import annotations

from dataclasses import dataclass

from embodied_kv.kv.manager import KVCacheManager, Status, TaskKind


@dataclass(frozen=True)
class TextEvent:
    request_id: str
    kind: TaskKind
    frame: int  # the frame whose prefix the request continues
    text: str  # everything generated so far
    new_text: str  # since the previous event of this request
    done: bool
    truncated: bool
    status: Status = Status.OK  # how it ended (meaningful with done)
    reason: str = ""  # why, unless OK


OpenRequests = dict[str, tuple[TaskKind, int, str]]  # id -> (kind, frame, text so far)


def open_requests(manager: KVCacheManager, waiting: list, frame: int) -> OpenRequests:
    """Requests that have not ended yet: live ones and those still waiting (TaskSpecs,
    given `frame` as theirs)."""
    tok = manager.model.tokenizer
    out = {
        r.request_id: (r.kind, r.frame, tok.decode(r.tokens))
        for r in manager.requests.values()
        if not r.done
    }
    for t in waiting:
        out[t.request_id] = (t.kind, frame, "")
    return out


def cancellations(before: OpenRequests, after: OpenRequests, reason: str) -> list[TextEvent]:
    """The final CANCELLED event of every request open before and gone after."""
    return [
        TextEvent(rid, kind, frame, text, "", True, False, Status.CANCELLED, reason)
        for rid, (kind, frame, text) in before.items()
        if rid not in after
    ]
