"""Numpy rasterisation of a scene from fixed cameras: filled shapes in depth order.

    top   : looking down; column = x, row = -y (far at the top)
    front : looking from the near edge; column = x, row from height, far things drawn
            first and smaller (painter's order), the arm's height visible
Output per camera: [S, S, 3] uint8; `observation_images` stacks them as the model's
[num_cameras, 3, S, S] float input in [-1, 1] (PI05_FACTS: (x/255 - 0.5)/0.5).
"""

from __future__ import annotations

import numpy as np

from embodied_kv.world.scene import CONTAINER_SIZE, MOVABLE_SIZE, Scene, Thing

CAMERAS = ("top", "front")
RGB = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
}
TABLE_RGB = (110, 90, 70)
SKY_RGB = (30, 30, 40)
ARM_OPEN_RGB = (245, 245, 245)
ARM_CLOSED_RGB = (0, 0, 0)


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres in camera units [-1, 1]: u right, v up; each [S, S]."""
    c = (np.arange(size) + 0.5) / size * 2 - 1
    return c[None, :].repeat(size, 0), -c[:, None].repeat(size, 1)


def _shape_mask(u, v, shape: str, cx: float, cy: float, r: float) -> np.ndarray:
    du, dv = u - cx, v - cy
    if shape == "ball":
        return du * du + dv * dv <= r * r
    if shape == "block":
        return (np.abs(du) <= r) & (np.abs(dv) <= r)
    if shape == "key":
        return (np.abs(du) <= r) & (np.abs(dv) <= 0.45 * r)
    if shape == "bowl":
        d2 = du * du + dv * dv
        return (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)
    if shape == "box":
        outer = (np.abs(du) <= r) & (np.abs(dv) <= r)
        return outer & ~((np.abs(du) <= 0.6 * r) & (np.abs(dv) <= 0.6 * r))
    raise ValueError(f"unknown shape {shape!r}")


def _draw_order(scene: Scene, key) -> list[Thing]:
    """Containers under their contents; free movables over both; held last."""
    held = scene.arm.holding

    def layer(t: Thing) -> tuple:
        return (0 if t.is_container else 1 if t.inside else 2 if t.name != held else 3, key(t))

    return sorted(scene.things, key=layer)


def render(scene: Scene, camera: str, size: int) -> np.ndarray:
    """One camera's view -> [size, size, 3] uint8."""
    if camera not in CAMERAS:
        raise ValueError(f"unknown camera {camera!r}; known {CAMERAS}")
    if size < 8:
        raise ValueError(f"image size {size} < 8 pixels")
    u, v = _grid(size)
    img = np.empty((size, size, 3), np.uint8)
    arm = scene.arm
    if camera == "top":
        img[:] = TABLE_RGB
        for t in _draw_order(scene, key=lambda t: 0):
            r = CONTAINER_SIZE if t.is_container else MOVABLE_SIZE * (0.8 if t.inside else 1.0)
            img[_shape_mask(u, v, t.shape, t.x, t.y, r)] = RGB[t.colour]
        # the gripper: a ring whose size shows its height, filled when closed
        r = 0.08 + 0.05 * (arm.z + 1)
        d2 = (u - arm.x) ** 2 + (v - arm.y) ** 2
        ring = (d2 <= r * r) & (d2 >= (0.5 * r) ** 2)
        img[d2 <= r * r if arm.closed else ring] = ARM_CLOSED_RGB if arm.closed else ARM_OPEN_RGB
        return img
    img[:] = SKY_RGB
    img[v < -0.1] = TABLE_RGB
    # front: far (large y) first; depth shrinks a thing and lifts it towards the horizon
    for t in _draw_order(scene, key=lambda t: -t.y):
        depth = 1.0 - 0.35 * (t.y + 1) / 2
        r = (CONTAINER_SIZE if t.is_container else MOVABLE_SIZE) * depth
        base = -0.1 - 0.8 * depth + 0.55
        lift = 0.9 * (arm.z + 1) / 2 if t.name == arm.holding else 0.0
        img[_shape_mask(u, v, t.shape, t.x, base + lift, r)] = RGB[t.colour]
    depth = 1.0 - 0.35 * (arm.y + 1) / 2
    top = -0.1 - 0.8 * depth + 0.55 + 0.9 * (arm.z + 1) / 2 + 0.1
    stem = (np.abs(u - arm.x) <= 0.05) & (v >= top)
    claw = (np.abs(u - arm.x) <= 0.12) & (np.abs(v - top) <= 0.05)
    img[stem | claw] = ARM_CLOSED_RGB if arm.closed else ARM_OPEN_RGB
    return img


def observation_images(scene: Scene, size: int, cameras: tuple[str, ...] = CAMERAS) -> np.ndarray:
    """All cameras -> [len(cameras), 3, size, size] float32 in [-1, 1]."""
    imgs = np.stack([render(scene, c, size) for c in cameras]).astype(np.float32)
    return ((imgs / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).copy()
