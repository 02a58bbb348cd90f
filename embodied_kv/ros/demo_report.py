"""What `make demo` prints at the end: the figures of docs/ros.md, readable."""

from __future__ import annotations

from dataclasses import dataclass, field

from embodied_kv.msg import TextChunk
from embodied_kv.ros.rate_probe import RateSummary
from embodied_kv.world.memory import names_place
from embodied_kv.world.sim import EpisodeResult

TEXT_WIDTH = 72
KINDS = {TextChunk.TASK_NARRATION: "narration", TextChunk.TASK_ANSWER: "answer",
         TextChunk.TASK_PLAN: "plan"}  # fmt: skip
ENDINGS = {TextChunk.STATUS_TRUNCATED: "truncated", TextChunk.STATUS_REFUSED: "refused",
           TextChunk.STATUS_CANCELLED: "cancelled"}  # fmt: skip
SHOWN_EPISODES = 12  # the last episodes listed one by one


@dataclass(frozen=True)
class Asked:
    """A question or memory query the demo sent, with the world's true answer."""

    text: str
    truth: str


@dataclass
class Report:
    target_hz: float
    seconds: float
    actions: RateSummary | None = None
    chunks: int = 0
    text: dict = field(default_factory=dict)  # request id -> last TextChunk
    pieces: dict = field(default_factory=dict)  # request id -> chunks received
    questions: list[Asked] = field(default_factory=list)  # in the order sent
    goals: list[Asked] = field(default_factory=list)  # memory queries, in the order sent
    episodes: list[EpisodeResult] = field(default_factory=list)  # ended, in order
    episode_steps: int = 0  # actions applied in the episode still running
    rejected_actions: int = 0  # action messages the simulated robot could not apply
    diagnostics: object | None = None  # the last DiagnosticArray
    peak_tokens_per_s: float = 0.0  # highest tokens/s /diagnostics reported (30 cycles)
    snapshot: str = ""
    reset: object | None = None  # Reset.Response
    reset_rtt_ms: float = 0.0
    reset_at: float | None = None
    after_reset: int = 0  # actions received after the reset answered
    after_reset_s: float = 0.0
    capsules: object | None = None  # ListCapsules.Response
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.actions is not None and not self.problems

    def diag(self, section: str) -> dict[str, str]:
        if self.diagnostics is None:
            return {}
        for status in self.diagnostics.status:
            if status.name == f"embodied_kv: {section}":
                return {kv.key: kv.value for kv in status.values}
        return {}

    def render(self, robot_status: int) -> str:
        engine, output = self.diag("engine"), self.diag("action output")
        lines = [
            "",
            f"== embodied_kv demo: preset {engine.get('preset', '?')} on "
            f"{engine.get('device', '?')}, {self.seconds:g} s ==",
            "actions (measured by a subscriber in this process, the robot is another one):",
            "  " + (self.actions.line(self.target_hz) if self.actions else "none received"),
            f"  {self.chunks} action chunks on action_chunk; deadline misses (ticks without a "
            f"fresh action) {output.get('deadline_misses', '?')}, chunks after their deadline "
            f"{engine.get('chunks_after_deadline', '?')}, cycle overruns "
            f"{engine.get('cycle_overruns', '?')}",
            f"weights: {engine.get('weights', '?')}",
            *self._joins(engine),
            *self._episodes(),
            f"language: {engine.get('tokens', '?')} tokens in {engine.get('cycles', '?')} engine "
            f"cycles, {_tokens_per_s(engine, self.seconds)} tokens/s over the run, "
            f"{self.peak_tokens_per_s:.0f} tokens/s at the busiest"
            + (" (random weights: the text is noise):" if engine.get("weights") == "random"
               else ":"),
        ]  # fmt: skip
        lines += self._texts()
        lines.append(f"snapshot: {self.snapshot or 'not taken'}")
        if self.reset is not None:
            r = self.reset
            lines.append(
                f"reset: round trip {self.reset_rtt_ms:.1f} ms, restore {r.restore_ms:.2f} ms"
                f" ({r.message}); then {self.after_reset} actions in {self.after_reset_s:.1f} s"
                if r.success
                else f"reset: refused: {r.message}"
            )
        if self.capsules is not None and self.capsules.success:
            lines.append(f"capsules: {_capsules(self.capsules)}")
        lines += [f"problem: {p}" for p in self.problems]
        lines.append(f"robot process exited with status {robot_status}")
        return "\n".join(lines)

    @staticmethod
    def _joins(engine: dict[str, str]) -> list[str]:
        """How chunks joined (/diagnostics, engine section; docs/rtc.md): switches, the
        largest jump, the measured delay and observation age, and RTC when it is on."""
        if "chunk_switches" not in engine:
            return []
        get = engine.get
        line = (f"chunk joins: {engine['chunk_switches']} switches, largest jump "
                f"{get('boundary_jump_max', '?')} (last {get('boundary_jump_last', '?')}); "
                f"chunk lands {get('inference_delay_ticks', '?')} ticks after its "
                f"observation, which was {get('observation_age_ticks', '?')} ticks old "
                "at the cycle's start")  # fmt: skip
        if get("rtc_enabled") == "True":
            line += (f"; real-time chunking: {get('rtc_guided_chunks', '?')} chunks "
                     f"guided, d = {get('rtc_delay_ticks', '?')}")  # fmt: skip
            if get("rtc_stale_observations", "0") != "0":
                line += (f", {get('rtc_stale_observations')} chunks from a scene older than "
                         "their instruction not held to")  # fmt: skip
        return [line]

    def _texts(self) -> list[str]:
        out = []
        by_kind: dict[int, list[TextChunk]] = {}
        for chunk in self.text.values():
            by_kind.setdefault(chunk.task, []).append(chunk)
        prompts = {TextChunk.TASK_ANSWER: self.questions, TextChunk.TASK_PLAN: self.goals}
        for task in (TextChunk.TASK_ANSWER, TextChunk.TASK_PLAN, TextChunk.TASK_NARRATION):
            chunks = sorted(by_kind.get(task, []), key=lambda c: _order(c.request_id))
            if task == TextChunk.TASK_NARRATION:
                out.append(f"  {len(chunks)} narrations streamed; the last:")
                chunks = chunks[-1:]
            asked = prompts.get(task, [])
            right = 0
            for i, c in enumerate(chunks):
                prompt = f" {asked[i].text!r} ->" if i < len(asked) else ""
                state = "done" if c.done else "still streaming"
                if c.done and c.status != TextChunk.STATUS_OK:
                    ending = ENDINGS.get(c.status, f"status {c.status}")
                    why = c.reason if c.reason.startswith(ending) else f"{ending}: {c.reason}"
                    state += f", {why}"
                truth = ""
                if i < len(asked):
                    ok = c.done and _right(task, c.text_so_far.strip(), asked[i].truth)
                    right += ok
                    verdict = ("right" if ok else "wrong") if c.done else "not finished"
                    truth = f" [true: {asked[i].truth!r}, {verdict}]"
                out.append(
                    f"  [{c.request_id.split('@')[0]}]{prompt} {_short(c.text_so_far)}{truth} "
                    f"({self.pieces.get(c.request_id, 0)} chunks, {state})"
                )
            if asked:
                kind = "answers" if task == TextChunk.TASK_ANSWER else "plans"
                out.append(f"  {kind} right: {right} of {len(asked)} asked")
        return out

    def _episodes(self) -> list[str]:
        """The simulated arm's tasks: how many ended, how many succeeded, at which stage
        the failed ones were stuck, the last few one by one."""
        n, wins = len(self.episodes), sum(e.success for e in self.episodes)
        rate = f" ({wins / n:.0%})" if n else ""
        stuck: dict[str, int] = {}
        for e in self.episodes:
            if not e.success:
                stuck[e.stage or "?"] = stuck.get(e.stage or "?", 0) + 1
        lines = [
            f"task success: {wins} of {n} episodes{rate}; one more running "
            f"({self.episode_steps} actions in)"
            + (f"; {self.rejected_actions} action messages not applicable"
               if self.rejected_actions else "")
            + ("; step limit at " + ", ".join(f"{k} {v}" for k, v in stuck.items())
               if stuck else "")
        ]  # fmt: skip
        for e in self.episodes[-SHOWN_EPISODES:]:
            verdict = "done" if e.success else f"step limit, stuck at {e.stage or '?'}"
            lines.append(f"  episode {e.index + 1} {e.instruction!r}: {verdict} "
                         f"after {e.steps} actions")  # fmt: skip
        return lines


def _right(task: int, got: str, truth: str) -> bool:
    """A plan names the place alone or as a path ending there ('in the red box on the
    shelf', how `--two-hop-answer path` trains two-hop answers; eval world counts it the
    same way); a scene answer must be the word itself."""
    return names_place(got, truth) if task == TextChunk.TASK_PLAN else got == truth


def _order(request_id: str) -> tuple[str, int]:
    name, _, n = request_id.split("@")[0].rpartition("-")  # kind-<n>@<epoch>
    return (name, int(n)) if n.isdigit() else (request_id, 0)


def _short(text: str) -> str:
    r = repr(text)
    return r if len(r) <= TEXT_WIDTH else r[: TEXT_WIDTH - 4] + "...'"


def _tokens_per_s(engine: dict[str, str], seconds: float) -> str:
    try:
        return f"{float(engine['tokens']) / seconds:.0f}"
    except (KeyError, ValueError):
        return "?"


def _capsules(listing) -> str:
    """Named capsules one by one; the per-cycle rollback boundaries (auto-N) as a count."""
    tiers = ("gpu", "host", "disk")
    rows = zip(listing.names, listing.tiers, listing.bytes, listing.pinned, strict=True)
    named, auto = [], []
    for name, tier, size, pinned in rows:
        if name.startswith("auto-"):
            auto.append(size)
        else:
            named.append(f"{name} ({tiers[tier]}, {size} B{', pinned' if pinned else ''})")
    if auto:
        named.append(f"{len(auto)} per-cycle rollback boundaries ({sum(auto)} B)")
    return ", ".join(named)
