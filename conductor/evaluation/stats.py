"""Small statistics for the tables: the Wilson score interval for an accuracy."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion; (0, 1) when there is no observation.

    Wilson rather than the normal approximation: it stays inside [0, 1] and behaves at 0% and 100%,
    which small evaluation sets hit often.
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
