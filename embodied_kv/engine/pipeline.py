"""ActionFlow: autoregressive action decoding pipelined across frames, and its baselines.

An action of K tokens is K micro-requests: one prefill (its logits give token 1) and
K-1 decodes. ActionFlow runs them as a K-stage pipeline, one packed step per cycle:

    cycle c:  | prefill frame c (P tokens) | dec frame c-1 | dec frame c-2 | ... | dec c-K+1 |
    slot:     | ring[c % K]                | ring[(c-1)%K] | ...                             |

so K-1 memory-bound decode rows ride on one compute-bound prefill. The ring is K
arena slots reserved once; frame c takes ring[c % K] (a rotation of slot indices, no
memory moves): frame c-K left by then, having had its K tokens. A FAST frame leaves
earlier at its end token (`|` / EOS); a frame leaves at the cap K otherwise. A frame
that leaves is decoded into an action chunk stamped with the tick of its own
observation; its latency (observation -> action) is about K cycles while the rate is
one action per cycle: pipelining trades latency for rate.

Baselines behind the same `cycle` interface:
* `Sequential`: prefill, then K-1 decode steps, frame after frame (one slot).
* `NaivePipe`: ActionFlow's schedule, but each request keeps its own KV, gathered into
  a freshly allocated contiguous buffer every step and scattered back, with a host
  sync per request per step (the paper's ablation without the ring and packed state).

Decoding is constrained greedy: the argmax over the tokenizer's action ids (and end
ids), so every scheduler picks the same ids from the same logits bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from embodied_kv.kernels.packed_attention import KEY_BLOCK, bucket
from embodied_kv.model.action_tokens import ActionTokenizer
from embodied_kv.model.vla import VLA, Prefix, StepInput
from embodied_kv.storage.arena import KVArena
from embodied_kv.timing import device_clock


@dataclass
class Flight:
    """One frame in the pipeline."""

    frame: int
    tick: int  # control tick of its observation: its chunk starts there
    slot: int
    tokens: list[int] = field(default_factory=list)
    t_obs: float = 0.0  # clock when its observation entered (not state: timing only)
    state: list[float] | None = None  # its observation's robot state (delta actions)


@dataclass(frozen=True)
class Completed:
    frame: int
    tick: int
    tokens: list[int]
    chunk: np.ndarray  # [H, A] decoded (zeros when invalid)
    valid: bool
    latency_s: float  # observation entered -> action decoded
    state: np.ndarray | None = None  # [S] robot state of its observation (delta actions)


@dataclass
class PipeCounters:
    steps: int = 0
    frames: int = 0
    actions: int = 0
    invalid: int = 0
    capped: int = 0  # frames that left at the cap K, not complete


@dataclass(frozen=True)
class CycleOutput:
    done: list[Completed]  # frames that left in this cycle, oldest first
    prefix_logits: torch.Tensor | None  # [V] after the new frame's prefix (language tasks)
    extra_logits: torch.Tensor | None  # [len(extra), V] of the joined inputs


class ActionDecoder:
    """Constrained greedy picks and the end test of one action tokenizer."""

    def __init__(self, model: VLA, tokenizer: ActionTokenizer):
        self.model, self.tok = model, tokenizer
        self.ids = tokenizer.action_ids().to(model.device)  # [n] allowed ids

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] ids on the device (no host sync)."""
        return self.ids[logits.index_select(1, self.ids).argmax(dim=1)]

    def finish(self, f: Flight, now: float, counters: PipeCounters) -> Completed:
        chunk, valid = self.tok.decode(f.tokens)
        counters.actions += 1
        counters.invalid += int(not valid)
        counters.capped += int(
            len(f.tokens) >= self.tok.max_tokens and f.tokens[-1] not in self.tok.end_ids
        )
        state = None if f.state is None else np.asarray(f.state, dtype=np.float64)
        return Completed(f.frame, f.tick, list(f.tokens), chunk, valid, now - f.t_obs, state)


class Scheduler:
    """What the three schedulers share: a model, an arena, a decoder, a clock."""

    name = ""

    def __init__(self, model: VLA, arena: KVArena, tokenizer: ActionTokenizer):
        self.model, self.arena = model, arena
        self.dec = ActionDecoder(model, tokenizer)
        self.k = tokenizer.max_tokens
        self.clock = device_clock(model.device)
        self.counters = PipeCounters()

    def cycle(
        self,
        prefix: Prefix | None,  # the new frame's prefix embeddings; None: no new frame
        frame: int,
        tick: int,
        extra: list[StepInput] | None = None,  # more inputs for the same step (ActionFlow)
        state: np.ndarray | None = None,  # the new frame's robot state, returned with it
    ) -> CycleOutput:
        raise NotImplementedError

    def in_flight(self) -> int:
        return 0

    def drain(self) -> list[Completed]:
        """Cycles without a new frame until every frame in flight has left."""
        done = []
        while self.in_flight():
            done += self.cycle(None, -1, -1).done
        return done

    def close(self) -> None:
        """Give the scheduler's slots back to the arena."""


class ActionFlow(Scheduler):
    name = "actionflow"

    def __init__(self, model: VLA, arena: KVArena, tokenizer: ActionTokenizer):
        super().__init__(model, arena, tokenizer)
        if arena.num_free < self.k:
            raise ValueError(
                f"ActionFlow needs a ring of K={self.k} slots; the arena has {arena.num_free} "
                f"free of {arena.spec.num_slots}"
            )
        self.ring = [arena.allocate() for _ in range(self.k)]
        self.flights: list[Flight] = []  # oldest first
        self.rotation = 0  # frames that entered: the next takes ring[rotation % K]

    def in_flight(self) -> int:
        return len(self.flights)

    @property
    def next_slot(self) -> int:
        """The ring slot the next frame takes."""
        return self.ring[self.rotation % self.k]

    def cycle(self, prefix, frame, tick, extra=None, state=None) -> CycleOutput:
        """One packed step: [prefill of the new frame] + one decode of every frame in
        flight + `extra` (language decodes of the unified manager)."""
        t0 = self.clock()
        inputs = [StepInput(f.slot, ids=torch.tensor(f.tokens[-1:])) for f in self.flights]
        new = None
        if prefix is not None:
            slot = self.next_slot
            assert all(f.slot != slot for f in self.flights), "ring slot still in flight"
            self.arena.clear(slot)
            new = Flight(frame, tick, slot, [], t0, _state_list(state))
            inputs.append(StepInput(slot, embeds=prefix.embeds, causal=False))
        extra = extra or []
        logits = self.model.step(self.arena, inputs + extra)  # [n_in + n_extra, V]
        n_act = len(inputs)
        picks = self.dec.pick(logits[:n_act]).tolist()  # the one host sync of the step
        self.counters.steps += 1
        if new is not None:
            self.flights.append(new)
            self.rotation += 1
            self.counters.frames += 1
        for f, tok in zip(self.flights, picks, strict=True):
            f.tokens.append(tok)
        done, now = [], self.clock()
        for f in [f for f in self.flights if self.dec.tok.is_end(f.tokens)]:
            self.flights.remove(f)  # its rows stay until the slot's next frame clears them
            done.append(self.dec.finish(f, now, self.counters))
        return CycleOutput(
            done,
            logits[n_act - 1] if new is not None else None,
            logits[n_act:] if extra else None,
        )

    def close(self) -> None:
        for s in self.ring:
            self.arena.release(s)
        self.ring, self.flights = [], []

    def reserve(self) -> None:
        """Take the ring's slots out of the free list again (after an engine emptied the
        arena for a new episode); frames in flight are dropped."""
        self.arena.set_free_slots([s for s in self.arena.free_slots() if s not in self.ring])
        for s in self.ring:
            self.arena.clear(s)
        self.flights, self.rotation = [], 0

    # -- capsule section (kv.capsule.Stateful): the frames in flight are state ---------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict:
        return {
            "ring": list(self.ring),
            "rotation": self.rotation,
            "flights": [
                {
                    "frame": f.frame,
                    "tick": f.tick,
                    "slot": f.slot,
                    "tokens": list(f.tokens),
                    "state": f.state,
                }
                for f in self.flights
            ],
            "counters": vars(self.counters).copy(),
        }

    def check_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Everything load_state needs, checked first (a restore is staged, then swapped)."""
        if list(meta["ring"]) != self.ring:
            raise ValueError(f"capsule's ring {meta['ring']} != this pipeline's {self.ring}")
        int(meta["rotation"])
        for d in meta["flights"]:
            if d["slot"] not in self.ring:
                raise ValueError(f"a frame in flight in slot {d['slot']}, not in the ring")
            int(d["frame"]), int(d["tick"]), list(d["tokens"])

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        now = self.clock()
        self.flights = [
            Flight(d["frame"], d["tick"], d["slot"], list(d["tokens"]), now, d["state"])
            for d in meta["flights"]
        ]
        self.rotation = int(meta["rotation"])
        # counters describe the process (diagnostics): a restore never rolls them back


class Sequential(Scheduler):
    """Prefill, then K-1 single-token decode steps, before the next frame starts."""

    name = "sequential"

    def __init__(self, model: VLA, arena: KVArena, tokenizer: ActionTokenizer):
        super().__init__(model, arena, tokenizer)
        slot = arena.allocate()
        if slot is None:
            raise ValueError("the sequential baseline needs one free arena slot")
        self.slot = slot

    def cycle(self, prefix, frame, tick, extra=None, state=None) -> CycleOutput:
        if prefix is None:
            return CycleOutput([], None, None)
        t0 = self.clock()
        self.arena.clear(self.slot)
        f = Flight(frame, tick, self.slot, [], t0, _state_list(state))
        logits = self.model.step(self.arena, [StepInput(self.slot, embeds=prefix.embeds,
                                                        causal=False)])  # fmt: skip
        first = logits[0]
        f.tokens.append(int(self.dec.pick(logits)[0]))
        while not self.dec.tok.is_end(f.tokens):
            step = [StepInput(self.slot, ids=torch.tensor(f.tokens[-1:]))]
            logits = self.model.step(self.arena, step)
            f.tokens.append(int(self.dec.pick(logits)[0]))
        self.counters.steps += len(f.tokens)
        self.counters.frames += 1
        done = self.dec.finish(f, self.clock(), self.counters)
        self.arena.clear(self.slot)
        return CycleOutput([done], first, None)

    def close(self) -> None:
        self.arena.release(self.slot)


class NaivePipe(Scheduler):
    """ActionFlow's schedule without the ring: per-request KV gathered into a fresh
    buffer every step, new rows scattered back, one host sync per request."""

    name = "naive_pipe"

    def __init__(self, model: VLA, arena: KVArena, tokenizer: ActionTokenizer):
        super().__init__(model, arena, tokenizer)
        self.flights: list[Flight] = []
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(flight) -> [L, n, Hkv, D]

    def in_flight(self) -> int:
        return len(self.flights)

    def cycle(self, prefix, frame, tick, extra=None, state=None) -> CycleOutput:
        t0 = self.clock()
        members = list(self.flights)
        new = None
        if prefix is not None:
            new = Flight(frame, tick, -1, [], t0, _state_list(state))
            members.append(new)
        if not members:
            return CycleOutput([], None, None)
        # gather: a fresh arena with one slot per request, each filled with its own rows
        rows = [self._len(f) for f in members]
        p = prefix.embeds.shape[0] if prefix is not None else 0
        need = max(n + (p if f is new else 1) for f, n in zip(members, rows, strict=True))
        spec = self.model.arena_spec(len(members), bucket(need, KEY_BLOCK))
        tmp = KVArena(spec, self.arena.device)
        inputs = []
        for i, (f, n) in enumerate(zip(members, rows, strict=True)):
            tmp.allocate()
            if n:
                k, v = self.kv[id(f)]
                tmp.k[:, i, :n] = k
                tmp.v[:, i, :n] = v
                tmp.length[:, i] = n
                tmp.next_pos[i] = n
            if f is new:
                inputs.append(StepInput(i, embeds=prefix.embeds, causal=False))
            else:
                inputs.append(StepInput(i, ids=torch.tensor(f.tokens[-1:])))
        logits = self.model.step(tmp, inputs)
        self.counters.steps += 1
        # scatter the new rows back: a fresh contiguous tensor per request
        for i, (f, n) in enumerate(zip(members, rows, strict=True)):
            m = tmp.slot_len(i)
            k_new, v_new = tmp.k[:, i, n:m].clone(), tmp.v[:, i, n:m].clone()
            if n:
                k_old, v_old = self.kv[id(f)]
                k_new, v_new = torch.cat([k_old, k_new], 1), torch.cat([v_old, v_new], 1)
            self.kv[id(f)] = (k_new, v_new)
            f.tokens.append(int(self.dec.pick(logits[i : i + 1])[0]))  # host sync per request
        if new is not None:
            self.flights.append(new)
            self.counters.frames += 1
        done, now = [], self.clock()
        for f in [f for f in self.flights if self.dec.tok.is_end(f.tokens)]:
            self.flights.remove(f)
            del self.kv[id(f)]
            done.append(self.dec.finish(f, now, self.counters))
        return CycleOutput(done, logits[len(members) - 1] if new is not None else None, None)

    def _len(self, f: Flight) -> int:
        return int(self.kv[id(f)][0].shape[1]) if id(f) in self.kv else 0


def _state_list(state: np.ndarray | None) -> list[float] | None:
    # a plain list: it goes into a capsule's JSON with the frame
    return None if state is None else np.asarray(state, dtype=np.float64).reshape(-1).tolist()


SCHEDULERS = {s.name: s for s in (Sequential, NaivePipe, ActionFlow)}
