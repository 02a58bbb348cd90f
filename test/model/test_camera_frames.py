"""CameraFrames: the model converts camera pixels itself, inside the cycle.

The CPU path is rgbs_to_input (rgb_to_input_ref's bytes); the device path's chain
(uint8 up, then the reference's ops) gives the same bytes when run on the CPU, so what
CUDA runs is the reference's chain; an engine fed frames makes the chunks and capsules
of an engine fed the converted tensors, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.model.camera_frames import CameraFrames, device_input
from embodied_kv.model.image_input import rgb_to_input_ref
from embodied_kv.model.vla import Observation

GEOMETRIES = [(224, 224), (480, 640), (31, 45), (64, 64), (1, 1), (300, 200)]


def image(h: int, w: int, seed: int) -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    rgb.flags.writeable = False  # as the wire's arrays
    return rgb


@pytest.mark.parametrize("size", [32, 64, 224])
def test_both_paths_give_the_references_bytes(size):
    rgbs = [image(h, w, i) for i, (h, w) in enumerate(GEOMETRIES)]
    rgbs.append(image(224, 224, 99))  # two of one geometry: one group
    want = torch.stack([rgb_to_input_ref(rgb, size) for rgb in rgbs])
    frames = CameraFrames(rgbs, size)
    cameras = list(range(len(rgbs)))
    assert torch.equal(frames.to_input(cameras, "cpu"), want)
    assert torch.equal(device_input(rgbs, size, "cpu"), want)  # CUDA's chain, on the CPU
    assert torch.equal(frames.to_input([3, 0], "cpu"), want[[3, 0]])


def test_absent_cameras_are_zeros_in_the_capsule_tensor_and_never_converted():
    a = image(48, 64, 1)
    frames = CameraFrames([None, a, None], 32)
    assert len(frames) == 3 and frames.shape == (3, 3, 32, 32) and frames.present() == [1]
    t = frames.tensor()
    assert torch.equal(t[1], rgb_to_input_ref(a, 32))
    assert not t[0].any() and not t[2].any()
    t.zero_()  # a copy: the kept one is not the caller's
    assert torch.equal(frames.tensor()[1], rgb_to_input_ref(a, 32))
    with pytest.raises(ValueError, match="absent"):
        frames.to_input([0, 1], "cpu")


@pytest.mark.parametrize(
    "frame, error",
    [
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        ([[1, 2, 3]], "uint8"),
        (np.zeros((4, 4), np.uint8), "expected \\[H, W, 3\\]"),
        (np.zeros((4, 4, 4), np.uint8), "expected \\[H, W, 3\\]"),
        (np.zeros((0, 4, 3), np.uint8), "resize to nothing"),
        (np.zeros((1, 400, 3), np.uint8), "1 pixels resize to nothing at 32x32"),
    ],
)
def test_what_could_fail_inside_the_cycle_is_refused_when_built(frame, error):
    with pytest.raises(ValueError, match=error):
        CameraFrames([image(8, 8, 0), frame], 32)


def engine(model) -> Engine:
    e = Engine(EngineConfig(control_hz=0.01, narrate_every=0, replan_every=1000), model=model)
    e.begin_episode()
    return e


def test_an_engine_fed_frames_makes_the_chunks_and_capsules_of_converted_tensors(tiny_model):
    c = tiny_model.cfg
    size, n = c.vision.image_size, c.num_cameras
    frames = [[image(120, 160, 10 * f + k) for k in range(n)] for f in range(3)]
    as_frames, as_tensors = engine(tiny_model), engine(tiny_model)
    state = np.linspace(-0.5, 0.5, c.state_dim)
    for f, rgbs in enumerate(frames):
        as_frames.observe(Observation(CameraFrames(rgbs, size), state, "pick"))
        tensors = torch.stack([rgb_to_input_ref(rgb, size) for rgb in rgbs])
        as_tensors.observe(Observation(tensors, state, "pick"))
        a, b = as_frames.cycle(5 * f), as_tensors.cycle(5 * f)
        assert a.chunk.tobytes() == b.chunk.tobytes()
    saved = as_frames.state_tensors()
    assert torch.equal(saved["images"], as_tensors.state_tensors()["images"])
    as_frames.snapshot("s")
    after = as_frames.cycle(20).chunk
    as_frames.restore("s")  # the capsule's observation is the converted tensor
    assert as_frames.cycle(20).chunk.tobytes() == after.tobytes()


def test_frames_of_another_size_are_refused_by_the_model(tiny_model):
    c = tiny_model.cfg
    obs = Observation(CameraFrames([image(8, 8, k) for k in range(c.num_cameras)],
                                   c.vision.image_size * 2), np.zeros(2), "x")  # fmt: skip
    with pytest.raises(ValueError, match="camera frames for"):
        tiny_model.embed_prefix(obs)


CUDA_ATOL = 1e-5  # CUDA's bilinear and division against the CPU's bytes (values in [-1, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA half needs a GPU")
def test_cuda_conversion_is_the_references_within_rounding():
    rgbs = [image(h, w, i) for i, (h, w) in enumerate(GEOMETRIES)]
    for size in (32, 224):
        want = torch.stack([rgb_to_input_ref(rgb, size) for rgb in rgbs])
        got = CameraFrames(rgbs, size).to_input(range(len(rgbs)), "cuda")
        assert got.device.type == "cuda" and got.shape == want.shape
        assert (got.cpu() - want).abs().max().item() <= CUDA_ATOL


def test_a_conversion_is_kept_for_the_same_cameras_and_device():
    frames = CameraFrames([image(40, 50, 1), image(40, 50, 2)], 32)
    first = frames.to_input([0, 1], "cpu")
    assert frames.to_input((0, 1), "cpu") is first  # the prefill's, read by its capsule
    assert frames.to_input([1], "cpu") is not first
    assert torch.equal(frames.tensor(), first)
