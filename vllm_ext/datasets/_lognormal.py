"""Bounded lognormal distribution, parameterised like aiperf's ``LognormalParams``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAX_REJECTION_ROUNDS = 100


@dataclass(frozen=True)
class Lognormal:
    """Lognormal with log-space ``mu``/``sigma`` and optional hard bounds.

    ``mean``/``median`` are the real-space targets the parameters were fitted
    to. Out-of-bounds draws are re-drawn (rejection sampling), as in aiperf.
    """

    mu: float
    sigma: float
    mean: float
    median: float
    min: float | None = None
    max: float | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Lognormal:
        """Build from ``{mean, median[, mu, sigma, min, max]}``; mu/sigma derived if absent."""
        mean, median = float(params["mean"]), float(params["median"])
        if median <= 0 or mean < median:
            raise ValueError(f"need 0 < median <= mean, got mean={mean} median={median}")
        mu, sigma = params.get("mu"), params.get("sigma")
        if mu is None or sigma is None:
            mu = math.log(median)
            sigma = math.sqrt(2.0 * math.log(mean / median))
        lo, hi = params.get("min"), params.get("max")
        if lo is not None and hi is not None and float(lo) > float(hi):
            raise ValueError(f"min ({lo}) > max ({hi})")
        return cls(
            float(mu),
            float(sigma),
            mean,
            median,
            None if lo is None else float(lo),
            None if hi is None else float(hi),
        )

    def biased(self, bias: float) -> Lognormal:
        """Shift the distribution by a multiplicative ``bias`` (aiperf's truncation fix)."""
        if bias == 1.0:
            return self
        if bias <= 0:
            raise ValueError(f"bias must be > 0, got {bias}")
        return Lognormal(
            self.mu + math.log(bias),
            self.sigma,
            self.mean * bias,
            self.median * bias,
            self.min,
            self.max,
        )

    def sample(
        self, rng: np.random.Generator, size: int = 1, *, clip_min: float | None = None
    ) -> np.ndarray:
        """Draw ``size`` values; bounds by rejection, then clipping as a last resort."""
        out = rng.lognormal(self.mu, self.sigma, size=size)
        if self.min is not None or self.max is not None:
            lo = -math.inf if self.min is None else self.min
            hi = math.inf if self.max is None else self.max
            for _ in range(_MAX_REJECTION_ROUNDS):
                bad = (out < lo) | (out > hi)
                if not bad.any():
                    break
                out[bad] = rng.lognormal(self.mu, self.sigma, size=int(bad.sum()))
            out = np.clip(out, lo, hi)
        if clip_min is not None:
            out = np.maximum(out, clip_min)
        return out
