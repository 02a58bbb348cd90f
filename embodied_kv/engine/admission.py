"""Admission of a frame's language tasks into KV slots: the whole prompt or not at all.

A request decodes only over its frame's complete prefix plus its complete prompt. It
is admitted when a slot is free for it while one slot stays free for the next
frame's prefill (the action deadline outranks language); a waiting question or plan
may end the oldest running narration early to get one (someone waits for it, nobody
waits for a narration). A required task without room is deferred, in order, to a
later frame; an optional narration without room is skipped and counted; a task whose
prompt cannot fit the slot is refused with the reason. Every task that leaves
without a request gets its final event here (done, with its status).

    slots:  [frame t | req | req | ... | free]   <- at least one free after admission
"""

from __future__ import annotations

from embodied_kv.engine.events import TextEvent
from embodied_kv.engine.policy import LanguagePolicy, TaskSpec
from embodied_kv.kv.manager import FramePrefix, KVCacheManager, Status, TaskKind


def admit(
    manager: KVCacheManager, policy: LanguagePolicy, fp: FramePrefix, tokenizer, planner=None
) -> list[TextEvent]:
    """Create this frame's requests; -> final events of tasks refused here. A `planner`
    (engine/plan_memory.py) may prefill a plan's memory from cached KV."""
    arena = manager.arena
    preemptible = [r for r in manager.live() if r.kind is TaskKind.NARRATION and r.slot is not None]
    capacity = arena.num_free + len(preemptible)  # with the frame slot still held
    tasks = policy.tasks_for(fp.frame, capacity)
    events: list[TextEvent] = []
    for i, task in enumerate(tasks):
        try:
            if not _room(manager, fp, task):
                if task.optional:
                    manager.counters.narrations_skipped += 1
                    continue
                policy.defer([t for t in tasks[i:] if not t.optional])
                break
            suffix = tokenizer.encode(task.suffix, bos=False) if task.suffix else None
            prefill = None
            if planner is not None and task.kind is TaskKind.PLAN:
                prefill = planner.prefill_for(manager.arena, task.suffix)
            req = manager.create(
                fp, task.request_id, task.kind, task.max_new_tokens, suffix, prefill=prefill
            )
            assert req is not None  # _room made sure of a slot
        except ValueError as e:  # prompt does not fit, id collision: this task alone
            manager.counters.refused += 1
            events.append(final_event(task, fp.frame, Status.REFUSED, str(e)))
        except BaseException:
            policy.defer(tasks[i:])  # nothing is lost; the engine recovers the cycle
            raise
    manager.counters.deferred += len(policy.pending())  # each waits one more frame
    return events


def _room(manager: KVCacheManager, fp: FramePrefix, task: TaskSpec) -> bool:
    """A slot for `task` with one left over for the next frame, ending the oldest
    narration early if a required task needs it."""
    needed = 2 if fp.adopted else 1  # a byte copy takes a free slot; adoption takes none
    while manager.arena.num_free < needed and not task.optional:
        victim = next(
            (
                r
                for r in manager.live()
                if r.kind is TaskKind.NARRATION and r.slot is not None and r.frame != fp.frame
            ),
            None,
        )
        if victim is None:
            break
        manager.truncate(victim, f"slot given to {task.request_id}")
    return manager.arena.num_free >= needed


def final_event(task: TaskSpec, frame: int, status: Status, reason: str) -> TextEvent:
    """The one (done) event of a task that never decoded."""
    return TextEvent(task.request_id, task.kind, frame, "", "", True, False, status, reason)


def fit_problem(prefix_max: int, prompt: int, budget: int, max_len: int) -> str:
    """Why a prompt of `prompt` tokens cannot be admitted ('' if it can): the longest
    frame prefix, the whole prompt and the whole token budget must fit one slot."""
    if prefix_max + prompt + budget < max_len:
        return ""
    return (
        f"prompt of {prompt} tokens does not fit: prefix up to {prefix_max} + prompt "
        f"{prompt} + {budget} new tokens >= slot of {max_len} rows"
    )
