"""The engine verbs one request frame asks for, run on the thread of the frame's
connection while it holds the engine's turn (server.py: one frame at a time).

A frame is openpi's observation dict, optionally with fields an unmodified client
never sends (docs/serve.md):

    command   "reset" | "snapshot" | "restore", done before the frame's observation
    name      the snapshot's name (snapshot, restore), this connection's own namespace
    question  text: answered from the frame's prefix -> "answer" in the response

The response: "actions" [H, action_dim] in robot units (float64, the engine's chunk),
"action_latency_ms" (the engine's own: prefill start -> chunk), "frame" and
"noise_seed" (seed + frame, the chunk's noise), "answer" when asked; server.py adds
"server_timing". A frame with only a command is answered without actions.
"""

from __future__ import annotations

from embodied_kv.engine.engine import Engine
from embodied_kv.engine.events import TextEvent
from embodied_kv.kv.manager import Status
from embodied_kv.model.vla import Observation
from embodied_kv.serve.config import ServeConfig
from embodied_kv.serve.layouts import get_layout, has_observation, observation
from embodied_kv.serve.session import Session

COMMANDS = ("reset", "snapshot", "restore")
NO_FINAL_EVENT = "not answered in this frame (no free slot); ask again"


class ServePolicy:
    def __init__(self, engine: Engine, cfg: ServeConfig):
        self.engine, self.cfg = engine, cfg
        self.layout = get_layout(cfg.layout)
        c = engine.model.cfg
        self._shape = (c.num_cameras, c.vision.image_size, engine.robot.state_dim)
        engine.loop.draw_ahead = False  # after the reply is sent instead (after_reply)

    def metadata(self) -> dict:
        e, c = self.engine, self.engine.model.cfg
        return {
            "server": "embodied-kv",
            "layout": self.layout.name,
            "cameras": self.layout.camera_names(c.num_cameras),
            "image_size": c.vision.image_size,
            "state_dim": e.robot.state_dim,
            "action_dim": e.robot.action_dim,
            "action_horizon": c.action_horizon,
            "preset": e.cfg.preset,
            "weights": e.source.label if e.source is not None else "",
            "robot": e.robot.describe(),
            "noise_seed": f"{e.cfg.seed} + frame",
            "fields": {
                "command": list(COMMANDS),
                "name": "snapshot name",
                "question": "text -> answer",
            },  # fmt: skip
        }

    def handle(self, session: Session, msg: dict) -> dict:
        """One frame -> the response map. ValueError: the caller's mistake, nothing changed."""
        command = msg.get("command")
        infer = has_observation(self.layout, msg)
        if command is None and not infer:
            keys = ", ".join("/".join(p) for p in self.layout.cameras + self.layout.state)
            raise ValueError(f"no {self.layout.name} observation ({keys}) and no command")
        if not infer and "question" in msg:
            raise ValueError("a question needs an observation to answer from")
        obs = self.observation(msg) if infer else None  # a bad frame changes nothing
        question = msg.get("question")
        if question is not None and (not isinstance(question, str) or not question
                                     or len(question) > self.cfg.max_prompt_chars):  # fmt: skip
            raise ValueError(f"question must be text of 1..{self.cfg.max_prompt_chars} characters")
        out = {} if command is None else self._command(session, command, msg.get("name"))
        if obs is not None:
            out.update(self._infer(session, obs, question))
        return out

    def observation(self, msg: dict) -> Observation:
        """The frame's observation in robot units, its images CameraFrames (converted by
        the model inside the cycle); ValueError naming what is wrong."""
        num_cameras, size, state_dim = self._shape
        return observation(self.layout, msg, num_cameras, size, state_dim,
                           self.cfg.max_prompt_chars)  # fmt: skip

    def _command(self, session: Session, command: object, name: object) -> dict:
        engine = self.engine
        if command == "reset":
            session.frame = 0
        elif command == "snapshot":
            capsule = session.capsule(name)
            with engine.lock:
                engine.frame = session.frame
                _, ms = engine.snapshot(capsule)
            session.capsules[name] = capsule
            return {"command": command, "name": name, "frame": session.frame, "ms": ms}
        elif command == "restore":
            if name not in session.capsules:
                raise ValueError(f"no snapshot {name!r} in this session; "
                                 f"have {sorted(session.capsules)}")  # fmt: skip
            with engine.lock:
                ms = engine.restore(session.capsules[name])
                session.frame = engine.frame
            return {"command": command, "name": name, "frame": session.frame, "ms": ms}
        else:
            raise ValueError(f"command {command!r}: use one of {list(COMMANDS)}")
        return {"command": command, "frame": session.frame}

    def _infer(self, session: Session, obs, question: str | None) -> dict:
        engine = self.engine
        with engine.lock:
            engine.frame = session.frame
            engine.observe(obs)
            request_id, refused = engine.ask(question) if question else (None, None)
            try:
                result = engine.cycle(session.frame)
                if result is None or result.chunk is None:
                    raise RuntimeError("the engine made no chunk (held or in its safe state)")
                events = list(result.events)
                if request_id is not None and refused is None:
                    events += engine.loop.finish_all()  # the answer in this response
            except Exception:
                self._drop_open_work()
                raise
            answer = None if request_id is None else _answer(request_id, refused, events)
            if answer is not None and answer["reason"] == NO_FINAL_EVENT:
                self._drop_open_work()  # never admitted: it must not run in another's cycle
            session.frame = engine.frame
        out = {
            "actions": result.chunk,  # [H, action_dim] robot units
            "action_latency_ms": result.action_s * 1e3,
            "frame": result.frame,
            "noise_seed": engine.cfg.seed + result.frame,
        }
        if answer is not None:
            out["answer"] = answer
        return out

    def after_reply(self, session: Session) -> None:
        """A reply is on its way: draw the noise of this session's next frame now, not
        between its chunk and its reply (a hit when its next frame comes first; after a
        command-only frame too: a reset's next frame is 0). Nothing when already drawn."""
        self.engine.draw_noise_ahead(session.frame)

    def _drop_open_work(self) -> None:
        """Back to `episode_start` after a failed frame: a request it queued or admitted
        ends (and is not decoded in another connection's cycle), and the engine leaves
        its safe state (max_cycle_failures in a row), so one client's failures never hold
        the others. Sessions keep their own frames, so nothing else is lost."""
        self.engine.restore()
        self.engine.take_events()  # the dropped request's CANCELLED event: nobody's

    def forget(self, session: Session) -> None:
        """A connection closed: its capsules leave the store."""
        with self.engine.lock:
            for capsule in session.capsules.values():
                if capsule in self.engine.store:
                    self.engine.store.delete(capsule)
        session.capsules.clear()


def _answer(request_id: str, refused: TextEvent | None, events: list[TextEvent]) -> dict:
    final = refused or next((e for e in events if e.request_id == request_id and e.done), None)
    if final is None:
        return {"text": "", "status": Status.CANCELLED.value, "reason": NO_FINAL_EVENT}
    return {"text": final.text, "status": final.status.value, "reason": final.reason}
