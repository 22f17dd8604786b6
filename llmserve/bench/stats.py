"""Summary statistics of benchmark samples, computed as vLLM's benchmark scripts do (numpy's
default linear-interpolation percentile), so figures compare across engines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Of one metric over a run, in the unit of the samples it was made from."""

    mean: float
    p50: float
    p90: float
    p99: float


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), interpolating linearly between the two nearest ranks
    (numpy.percentile's default): position (n - 1) * q / 100 in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> Summary | None:
    """Mean and p50/p90/p99 of `values` times `scale` (1000 turns seconds into ms); None if empty."""
    if not values:
        return None
    scaled = [v * scale for v in values]
    return Summary(mean=sum(scaled) / len(scaled), p50=percentile(scaled, 50), p90=percentile(scaled, 90),
                   p99=percentile(scaled, 99))
