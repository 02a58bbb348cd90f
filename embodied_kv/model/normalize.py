"""Per-feature normalisation of state and actions, with each reference's own formula.

A checkpoint declares how its state and actions were normalised when it was trained;
the model sees [-1, 1]-ish values and its actions come out in the same units. Two
references write the formulas slightly differently, and we follow the one whose
statistics we read (both cited at the function that applies them):

    LeRobot  `_NormalizationMixin._apply_transform` (processor/normalize_processor.py),
             float32, eps from the saved step config (1e-8):
      MEAN_STD    (x - mean) / (std + eps)            inverse  x * std + mean
      MIN_MAX     2 (x - min) / d - 1, d = max - min   inverse  (x + 1) / 2 * d + min
      QUANTILES   2 (x - q01) / d - 1, d = q99 - q01   inverse  (x + 1) * d / 2 + q01
      QUANTILE10  as QUANTILES with q10 / q90          (d == 0 is replaced by eps)
    openpi   `transforms.Normalize` / `Unnormalize` (transforms.py), float64, eps 1e-6:
      mean_std    (x - mean) / (std + eps)            inverse  x * (std + eps) + mean
      quantiles   (x - q01) / (q99 - q01 + eps) * 2 - 1
                                                      inverse  (x + 1) / 2 * (q99 - q01 + eps) + q01
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class NormMode(enum.Enum):
    """LeRobot `NormalizationMode` values (openpi: quantiles = use_quantiles=True)."""

    IDENTITY = "IDENTITY"
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    QUANTILE10 = "QUANTILE10"


# The statistics each mode reads (names as LeRobot and openpi store them).
NEEDS: dict[NormMode, tuple[str, str]] = {
    NormMode.MEAN_STD: ("mean", "std"),
    NormMode.MIN_MAX: ("min", "max"),
    NormMode.QUANTILES: ("q01", "q99"),
    NormMode.QUANTILE10: ("q10", "q90"),
}
CONVENTIONS = {"lerobot": np.float32, "openpi": np.float64}
OPENPI_EPS = 1e-6  # openpi transforms.Normalize / Unnormalize
LEROBOT_EPS = 1e-8  # LeRobot _NormalizationMixin default (the saved config says)


@dataclass(frozen=True, eq=False)
class FeatureNorm:
    """How one feature (state or actions) maps between robot units and model units."""

    mode: NormMode
    stats: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [D]
    convention: str = "lerobot"  # whose formulas: "lerobot" | "openpi"
    eps: float = LEROBOT_EPS
    source: str = ""  # the file (and key) the statistics came from, for messages

    def __post_init__(self):
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention {self.convention!r}: use {sorted(CONVENTIONS)}")
        if self.convention == "openpi" and self.mode not in (
            NormMode.IDENTITY,
            NormMode.MEAN_STD,
            NormMode.QUANTILES,
        ):
            raise ValueError(f"openpi normalises by mean_std or quantiles, not {self.mode.value}")
        if self.mode is NormMode.IDENTITY:
            return
        dtype = CONVENTIONS[self.convention]
        missing = [s for s in NEEDS[self.mode] if s not in self.stats]
        if missing:
            raise ValueError(
                f"{self.source}: {self.mode.value} normalisation needs {missing}, "
                f"the statistics have {sorted(self.stats)}"
            )
        arrays = {k: np.asarray(v, dtype=dtype).reshape(-1) for k, v in self.stats.items()}
        shapes = {k: arrays[k].shape for k in NEEDS[self.mode]}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"{self.source}: statistics of different lengths {shapes}")
        if not all(np.isfinite(arrays[k]).all() for k in NEEDS[self.mode]):
            raise ValueError(f"{self.source}: non-finite {self.mode.value} statistics")
        object.__setattr__(self, "stats", arrays)

    @property
    def dim(self) -> int | None:
        """Length of the statistics; None for identity (any length)."""
        if self.mode is NormMode.IDENTITY:
            return None
        return int(self.stats[NEEDS[self.mode][0]].shape[0])

    def first(self, n: int) -> FeatureNorm:
        """The statistics of the first n dimensions (openpi slices longer statistics so)."""
        if self.mode is NormMode.IDENTITY or n == self.dim:
            return self
        if n > self.dim:
            raise ValueError(f"{self.source}: statistics cover {self.dim} dims, {n} are needed")
        stats = {k: v[:n] for k, v in self.stats.items()}
        return FeatureNorm(self.mode, stats, self.convention, self.eps, self.source)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Robot units -> model units; x [..., D] with D == dim."""
        return self._apply(x, inverse=False)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        """Model units -> robot units; x [..., D] with D == dim."""
        return self._apply(x, inverse=True)

    def _apply(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        if self.mode is NormMode.IDENTITY:
            return np.asarray(x, dtype=np.float64)
        x = np.asarray(x, dtype=CONVENTIONS[self.convention])
        if x.shape[-1] != self.dim:
            raise ValueError(f"{self.source}: {x.shape[-1]} values, statistics of {self.dim}")
        a, b = (self.stats[k] for k in NEEDS[self.mode])
        if self.convention == "openpi":
            return _openpi(self.mode, x, a, b, inverse)
        return _lerobot(self.mode, x, a, b, x.dtype.type(self.eps), inverse)


def _lerobot(mode: NormMode, x, a, b, eps, inverse: bool) -> np.ndarray:
    """LeRobot `_NormalizationMixin._apply_transform`, op for op."""
    if mode is NormMode.MEAN_STD:  # a = mean, b = std
        return x * b + a if inverse else (x - a) / (b + eps)
    d = b - a  # max - min, q99 - q01 or q90 - q10
    d = np.where(d == 0, eps, d).astype(x.dtype)
    if mode is NormMode.MIN_MAX:
        return (x + 1) / 2 * d + a if inverse else 2 * (x - a) / d - 1
    return (x + 1.0) * d / 2.0 + a if inverse else 2.0 * (x - a) / d - 1.0


def _openpi(mode: NormMode, x, a, b, inverse: bool) -> np.ndarray:
    """openpi `Normalize._normalize[_quantile]` / `Unnormalize._unnormalize[_quantile]`."""
    if mode is NormMode.MEAN_STD:  # a = mean, b = std
        return x * (b + OPENPI_EPS) + a if inverse else (x - a) / (b + OPENPI_EPS)
    if inverse:
        return (x + 1.0) / 2.0 * (b - a + OPENPI_EPS) + a
    return (x - a) / (b - a + OPENPI_EPS) * 2.0 - 1.0


IDENTITY = FeatureNorm(NormMode.IDENTITY, source="identity")
