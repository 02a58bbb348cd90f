"""The next frame's flow noise, drawn while the robot waits instead of on the action path.

Each frame's noise is `VLA.make_noise(seed + frame)`: a CPU generator seeded per frame,
[H, A] fp32, then copied to the device. Drawing it at the start of the denoise cost a
host draw and a blocking copy from pageable memory on every action. Here the values of
frame f + 1 are drawn right after frame f's chunk reached the host, into one static
host buffer (pinned on CUDA), and copied without blocking into one static device buffer,
stream-ordered after frame f's denoise that read the previous values.

    draw(seed)      fill the buffers for `seed` (after a chunk is on the host)
    take(seed)      the device buffer when it holds `seed`, else drawn now (a reset, a
                    skipped frame): the same values either way

The values are `make_noise`'s bytes: the same generator, seed and draw (`torch.randn`
into the buffer consumes the generator as a fresh tensor does; test_frame_loop checks).
A returned buffer is overwritten by the next `draw`: callers use it within the cycle.
"""

from __future__ import annotations

import torch


class NoiseAhead:
    def __init__(self, horizon: int, action_dim: int, device: str | torch.device):
        device = torch.device(device)
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.empty(horizon, action_dim, pin_memory=pin)  # [H, A] fp32
        self.dev = self.host if device.type == "cpu" else torch.empty_like(self.host, device=device)
        self.seed: int | None = None  # what the buffers hold
        self._gen = torch.Generator()  # reseeded per draw: a fresh generator's state
        self.hits = 0  # takes served from a draw ahead
        self.misses = 0  # takes drawn on the action path

    def draw(self, seed: int) -> None:
        """Draw `seed`'s noise into the buffers. The host buffer is rewritten here: call it
        only after the previous copy out of it is done (after the chunk's host read)."""
        torch.randn(self.host.shape, generator=self._gen.manual_seed(seed), out=self.host)
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
        self.seed = seed

    def take(self, seed: int) -> torch.Tensor:
        """The noise of `seed` [H, A] fp32 on the device (a static buffer)."""
        if self.seed == seed:
            self.hits += 1
        else:
            self.misses += 1
            self.draw(seed)
        return self.dev
