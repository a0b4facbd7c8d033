"""Order statistics the policies share: one nearest-rank percentile for the whole project."""

from __future__ import annotations

from collections.abc import Iterable


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The q-quantile by nearest rank: the value at index ⌊q·n⌋ of the sorted values.

    ``None`` for no values. ``q`` is in [0, 1]; q = 1 is the maximum.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q: must be in [0, 1], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
