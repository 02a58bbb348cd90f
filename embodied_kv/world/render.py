"""Numpy rasterisation of a scene from fixed cameras: filled shapes in depth order.

    top   : looking down; column = x, row = -y (far at the top)
    front : looking from the near edge; column = x, row from height, far things drawn
            first and smaller (painter's order), the arm's height visible
Output per camera: [S, S, 3] uint8; `observation_images` stacks them as the model's
[num_cameras, 3, S, S] float input in [-1, 1] (pi0.5's (x/255 - 0.5)/0.5).
"""

from __future__ import annotations

import numpy as np

from embodied_kv.world.scene import CONTAINER_SIZE, MOVABLE_SIZE, Scene, Thing
from embodied_kv.world.vocab import CONTAINERS, MOVABLES

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
SHAPES = (*MOVABLES, *CONTAINERS)
# patch classes: background, the open / closed gripper, then every colour x shape
LABELS = ("background", "arm open", "arm closed", *[f"{c} {s}" for c in RGB for s in SHAPES])


def label_of(colour: str, shape: str) -> int:
    return 3 + list(RGB).index(colour) * len(SHAPES) + SHAPES.index(shape)


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
    rgb = {"table": TABLE_RGB, "sky": SKY_RGB, "open": ARM_OPEN_RGB, "closed": ARM_CLOSED_RGB}
    return _paint(scene, camera, size, 3, np.uint8, lambda t: RGB[t.colour], rgb)


def label_map(scene: Scene, camera: str, size: int) -> np.ndarray:
    """The same view as `render` painted with class ids (`LABELS`) -> [size, size] int64:
    what each pixel shows, the dense target of the vision tower's auxiliary loss."""
    ids = {"table": 0, "sky": 0, "open": 1, "closed": 2}
    out = _paint(scene, camera, size, 1, np.int64, lambda t: label_of(t.colour, t.shape), ids)
    return out[..., 0]


def patch_labels(scene: Scene, size: int, patch: int, cameras=CAMERAS) -> np.ndarray:
    """Per camera and patch (row-major, as the vision tower's tokens) the class covering
    most of the patch, background unless an object covers >= 1/8 of it
    -> [len(cameras), (size // patch) ** 2] int64."""
    if size % patch:
        raise ValueError(f"image size {size} not a multiple of patch {patch}")
    n = size // patch
    out = np.zeros((len(cameras), n * n), np.int64)
    for c, cam in enumerate(cameras):
        m = label_map(scene, cam, size).reshape(n, patch, n, patch).transpose(0, 2, 1, 3)
        m = m.reshape(n * n, patch * patch)
        counts = np.stack([(m == k).sum(1) for k in range(len(LABELS))], 1)  # [P, K]
        counts[:, 0] = 0
        best = counts.argmax(1)
        out[c] = np.where(counts.max(1) * 8 >= patch * patch, best, 0)
    return out


def _paint(scene, camera, size, channels, dtype, fill_of, fixed) -> np.ndarray:
    """Rasterise `scene` from `camera`: things filled with fill_of(thing), the table, sky
    and arm with fixed[...] -> [size, size, channels] of dtype."""
    if camera not in CAMERAS:
        raise ValueError(f"unknown camera {camera!r}; known {CAMERAS}")
    if size < 8:
        raise ValueError(f"image size {size} < 8 pixels")
    u, v = _grid(size)
    img = np.empty((size, size, channels), dtype)
    arm = scene.arm
    arm_fill = fixed["closed"] if arm.closed else fixed["open"]
    if camera == "top":
        img[:] = fixed["table"]
        for t in _draw_order(scene, key=lambda t: 0):
            r = CONTAINER_SIZE if t.is_container else MOVABLE_SIZE * (0.8 if t.inside else 1.0)
            img[_shape_mask(u, v, t.shape, t.x, t.y, r)] = fill_of(t)
        # the gripper: a ring whose size shows its height, filled when closed
        r = 0.08 + 0.05 * (arm.z + 1)
        d2 = (u - arm.x) ** 2 + (v - arm.y) ** 2
        ring = (d2 <= r * r) & (d2 >= (0.5 * r) ** 2)
        img[d2 <= r * r if arm.closed else ring] = arm_fill
        return img
    img[:] = fixed["sky"]
    img[v < -0.1] = fixed["table"]
    # front: far (large y) first; depth shrinks a thing and lifts it towards the horizon
    for t in _draw_order(scene, key=lambda t: -t.y):
        depth = 1.0 - 0.35 * (t.y + 1) / 2
        r = (CONTAINER_SIZE if t.is_container else MOVABLE_SIZE) * depth
        base = -0.1 - 0.8 * depth + 0.55
        lift = 0.9 * (arm.z + 1) / 2 if t.name == arm.holding else 0.0
        img[_shape_mask(u, v, t.shape, t.x, base + lift, r)] = fill_of(t)
    depth = 1.0 - 0.35 * (arm.y + 1) / 2
    top = -0.1 - 0.8 * depth + 0.55 + 0.9 * (arm.z + 1) / 2 + 0.1
    stem = (np.abs(u - arm.x) <= 0.05) & (v >= top)
    claw = (np.abs(u - arm.x) <= 0.12) & (np.abs(v - top) <= 0.05)
    img[stem | claw] = arm_fill
    return img


def observation_images(scene: Scene, size: int, cameras: tuple[str, ...] = CAMERAS) -> np.ndarray:
    """All cameras -> [len(cameras), 3, size, size] float32 in [-1, 1]."""
    imgs = np.stack([render(scene, c, size) for c in cameras]).astype(np.float32)
    return ((imgs / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).copy()
