"""The world samples of each training step, made in this process or by worker processes.

Sample i of step s is `make_sample(data_at(s), data_seed(seed, s, i, batch))` either way, so a
run's weights do not depend on the number of workers. With workers, the samples of step s + 1
are made while step s trains (on a GPU the step waited ~50 ms for 32 samples rendered on one
core: 5.4 steps/s on an H100 for the world model)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor

from embodied_kv.world.dataset import DataConfig, Sample, make_sample

AHEAD = 2  # steps whose samples are being made while the current one trains


class StepSamples:
    def __init__(
        self, data_of: Callable[[int], DataConfig], seed_of: Callable[[int, int], int],
        batch: int, workers: int = 0,
    ):  # fmt: skip
        """data_of(step) -> its DataConfig; seed_of(step, i) -> sample i's seed. Each step's
        seeds are cut into `workers` chunks, one task each."""
        if workers < 0:
            raise ValueError(f"data workers {workers} must be >= 0")
        self.data_of, self.seed_of, self.batch, self.workers = data_of, seed_of, batch, workers
        self.pool = ProcessPoolExecutor(workers) if workers else None
        self._pending: dict[int, list[Future]] = {}

    def get(self, step: int) -> list[Sample]:
        """The samples of `step`, in seed order; with workers, the next AHEAD steps' start."""
        if self.pool is None:
            return _make_all(self.data_of(step), self._seeds(step))
        for s in range(step, step + AHEAD + 1):
            if s not in self._pending:
                self._pending[s] = self._submit(s)
        for s in [s for s in self._pending if s < step]:  # a skipped step: not needed
            for f in self._pending.pop(s):
                f.cancel()
        return [x for f in self._pending.pop(step) for x in f.result()]

    def _submit(self, step: int) -> list[Future]:
        data, seeds = self.data_of(step), self._seeds(step)
        size = -(-len(seeds) // self.workers)
        return [
            self.pool.submit(_make_all, data, seeds[i : i + size])
            for i in range(0, len(seeds), size)
        ]

    def _seeds(self, step: int) -> list[int]:
        return [self.seed_of(step, i) for i in range(self.batch)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _make_all(data: DataConfig, seeds: list[int]) -> list[Sample]:
    return [make_sample(data, s) for s in seeds]
