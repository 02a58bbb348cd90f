"""Engine results -> ROS messages (standard types where one fits, docs/ros.md).

header.frame_id of `action_chunk` and `text` carries the engine frame (the index of
the observation the chunk or text continues from, 0 at the start of an episode);
joint space has no TF frame, so the field is otherwise unused there.
"""

from __future__ import annotations

import numpy as np
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from std_msgs.msg import Float64MultiArray, Header, MultiArrayDimension
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from embodied_kv.engine.events import TextEvent
from embodied_kv.kv.manager import Status, TaskKind
from embodied_kv.msg import TextChunk

TASKS = {
    TaskKind.NARRATION: TextChunk.TASK_NARRATION,
    TaskKind.ANSWER: TextChunk.TASK_ANSWER,
    TaskKind.PLAN: TextChunk.TASK_PLAN,
}
STATUSES = {
    Status.OK: TextChunk.STATUS_OK,
    Status.TRUNCATED: TextChunk.STATUS_TRUNCATED,
    Status.REFUSED: TextChunk.STATUS_REFUSED,
    Status.CANCELLED: TextChunk.STATUS_CANCELLED,
}
EXCERPT_CHARS = 60  # how much of a rejected text a log line quotes


def time_msg(ns: int) -> Time:
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def duration_msg(seconds: float) -> Duration:
    ns = round(seconds * 1e9)
    return Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def action_msg(joint_names: list[str]) -> Float64MultiArray:
    """An empty `action` message with its layout; the output thread fills .data per tick."""
    msg = Float64MultiArray()
    msg.layout.dim = [MultiArrayDimension(label="joints", size=len(joint_names), stride=1)]
    return msg


def chunk_msg(
    chunk: np.ndarray, joint_names: list[str], stamp_ns: int, period_s: float, frame: int
) -> JointTrajectory:
    """chunk [H, A]: positions of ticks t0 .. t0+H-1; stamp = the time of tick t0."""
    msg = JointTrajectory(header=Header(stamp=time_msg(stamp_ns), frame_id=str(frame)))
    msg.joint_names = list(joint_names)
    msg.points = [
        JointTrajectoryPoint(positions=row.tolist(), time_from_start=duration_msg(i * period_s))
        for i, row in enumerate(np.asarray(chunk, dtype=np.float64))
    ]
    return msg


def text_msg(event: TextEvent, stamp_ns: int) -> TextChunk:
    return TextChunk(
        header=Header(stamp=time_msg(stamp_ns), frame_id=str(event.frame)),
        request_id=event.request_id,
        task=TASKS[event.kind],
        text_so_far=event.text,
        new_text=event.new_text,
        done=event.done,
        status=STATUSES[event.status],
        reason=event.reason,
    )


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """A short, one-line quote of client text for a log line (never the whole of it)."""
    head = text[:limit].encode("unicode_escape").decode("ascii")[:limit]
    return repr(head + ("..." if len(text) > limit else ""))


def diagnostics_msg(
    stamp_ns: int, hardware_id: str, sections: dict[str, tuple[bytes, str, dict]]
) -> DiagnosticArray:
    """sections: name -> (DiagnosticStatus.OK | WARN | ERROR, message, {key: value})."""
    status = [
        DiagnosticStatus(
            level=level,
            name=f"embodied_kv: {name}",
            message=message,
            hardware_id=hardware_id,
            values=[KeyValue(key=k, value=_fmt(v)) for k, v in values.items()],
        )
        for name, (level, message, values) in sections.items()
    ]
    return DiagnosticArray(header=Header(stamp=time_msg(stamp_ns)), status=status)


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
