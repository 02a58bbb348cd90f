"""Bad input never kills a node nor stops the action stream: each gets a logged reason
(topics) or success=False with the reason (services)."""

from __future__ import annotations

import time

import numpy as np
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from embodied_kv.msg import MemoryUpdate
from embodied_kv.srv import Reset, Rollback, Snapshot

RATE_HZ = 50.0

BAD_TOPIC_INPUT = [  # (publisher key, message, what the robot's log must say)
    ("front", Image(height=4, width=4, encoding="yuv422", step=8, data=bytes(32)),
     "encoding 'yuv422' is not supported"),
    ("front", Image(height=0, width=0, encoding="rgb8", step=0, data=b""), "zero-size image"),
    ("front", Image(height=8, width=8, encoding="rgb8", step=24, data=bytes(100)),
     "needs 192 bytes, got 100"),
    ("front", Image(height=8, width=8, encoding="bgra8", step=16, data=bytes(128)),
     "step 16 < width 8 x 4 bytes per pixel"),
    # oversized: refused from the header, before the data is even looked at
    ("front", Image(height=8000, width=8000, encoding="rgb8", step=24000, data=bytes(24)),
     "camera front: 8000x8000 image exceeds the limits"),
    ("wrist", CompressedImage(format="jpeg", data=bytes(30_001)),
     "30001 bytes of image data > max_bytes 30000"),
    ("wrist", CompressedImage(format="jpeg", data=b"not an image"), "not a readable jpeg or png"),
    ("instruction", String(data="   "), "empty instruction"),
    ("instruction", String(data="x" * 5000), "instruction of 5000 chars > max_instruction_chars"),
    ("memory", MemoryUpdate(segment_id="a", operation=9, text="t"), "unknown operation 9"),
    ("memory", MemoryUpdate(segment_id="", operation=MemoryUpdate.OP_ADD, text="t"),
     "add without a segment_id"),
    ("memory", MemoryUpdate(segment_id="ghost", operation=MemoryUpdate.OP_REMOVE),
     "remove of unknown segment 'ghost'"),
    ("memory", MemoryUpdate(segment_id="big", operation=MemoryUpdate.OP_ADD, text="y" * 999),
     "text of 999 chars"),
    ("question", String(data=""), "empty question ignored"),
]  # fmt: skip

BAD_SERVICE_CALLS = [  # (service, request, words the refusal must contain)
    ("reset", Reset.Request(name="no_such_capsule"), "unknown capsule 'no_such_capsule'"),
    ("reset", Reset.Request(name="foreign"), "another config"),
    ("rollback", Rollback.Request(name="episode_start", steps_back=2), "exactly one"),
    ("rollback", Rollback.Request(), "exactly one"),
    ("rollback", Rollback.Request(steps_back=10_000), "boundaries kept"),
    ("snapshot", Snapshot.Request(name="../escape", tier=0), "bad capsule name"),
    ("snapshot", Snapshot.Request(name="ok", tier=7), "tier 7 unknown"),
]


def compressed_bad_input(image_files) -> list:
    """A corrupt jpeg (a real one cut in half) and a real png header of 8000 x 8000."""
    encode, png_header_only = image_files
    rgb = np.random.default_rng(5).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    jpeg = encode(rgb, "jpeg", quality=90)
    return [
        ("wrist", CompressedImage(format="jpeg", data=jpeg[: len(jpeg) // 2]),
         "camera wrist: corrupt jpeg (40x24)"),
        ("wrist", CompressedImage(format="png", data=png_header_only(8000, 8000)),
         "camera wrist: 8000x8000 image exceeds the limits"),
    ]  # fmt: skip


def test_bad_input_is_rejected_with_a_reason_and_actions_keep_flowing(robot, image_files):
    robot.wait_for_actions()
    bad_topic_input = BAD_TOPIC_INPUT + compressed_bad_input(image_files)
    start = time.monotonic()
    for key, msg, reason in bad_topic_input:
        robot.publish(key, msg)
        if isinstance(msg, CompressedImage):
            # The converter keeps only the newest frame per camera (ros/image_worker.py): a
            # compressed frame still queued when the next one arrives is replaced, by design.
            # So each one is judged before the next is sent.
            robot.wait_until(lambda r=reason: r in robot.robot.log(), f"logged: {reason!r}")
    refusals = []
    for service, request, words in BAD_SERVICE_CALLS:
        response = robot.call(service, request)
        assert not response.success, f"{service}({request}) should be refused"
        assert words in response.message, response.message
        refusals.append(response.message)
    for _, _, reason in bad_topic_input:
        robot.wait_until(lambda r=reason: r in robot.robot.log(), f"a logged reason: {reason!r}")
    time.sleep(max(0.0, start + 3.0 - time.monotonic()))
    end = time.monotonic()

    summary = robot.actions.summary(since=start, until=end)
    assert summary is not None and summary.rate_hz > 0.9 * RATE_HZ, summary
    assert robot.robot.alive()
    assert robot.all_active()
    robot.wait_for_actions()  # and still flowing
    robot.wait_until(lambda: robot.diagnostics is not None, "/diagnostics")
    inputs = next(s for s in robot.diagnostics.status if s.name == "embodied_kv: inputs")
    assert int(inputs.message.split()[0]) >= len(bad_topic_input)
