"""How many rows an engine that schedules itself runs usefully, from its own steps.

An engine such as vLLM batches every row it holds into each step. A step's time grows
with the rows in it, ``step(rows) = a + b x rows``: ``a`` is what a step costs whatever its
size (the weights read, the scheduler, the host's share of the CPU), ``b`` what each row
adds. Each step makes one token per row, so the engine's throughput is
``rows / (a + b x rows)``: it rises steeply while ``a`` dominates and flattens toward
``1 / b``. Past the knee, more rows buy almost no throughput and every row's tokens come
slower: the same answers per second, each one later.

``StepCurve`` fits that line to the steps the engine reports (rows running in the step and
the step's time), least squares with older steps weighing less (``horizon`` steps), and
``rows`` gives where throughput reaches ``gain`` of its asymptote:
``rows / (a + b x rows) = gain / b`` at ``rows = gain / (1 - gain) x a / b``; with the
default 0.85, 5.7 x a / b rows, where a step takes 6.7 x ``a``. The replica reports it; the
routers' gates take no more rows than that to the engine (``ballast.router.reporter``), and
what does not fit waits at the gate in order of criticality, where a deadline can still be
judged, instead of inside the engine, where every row slows every other.

A host that is slower makes ``a`` and ``b`` larger together: the knee stays where the
engine's shape puts it, not where a fixed latency threshold would. A fit is only given
once the steps have spread over rows (``MIN_SPREAD``) and weigh ``MIN_WEIGHT``; a line whose
rows cost nothing (``b <= 0``) gives no knee: more rows are free.
"""

from __future__ import annotations

import math
from typing import Optional

from ballast.policies.validation import check_int, check_positive, check_ratio

MIN_WEIGHT = 50.0  # steps (decayed) before a fit is given
MIN_SPREAD = 1.0  # variance of the steps' rows: a fit needs rows that vary
MIN_ROWS = 4  # the knee is never put below this (by default): a noisy fit must not close the engine


class StepCurve:
    """A decayed least-squares line through (rows, step time); bounded state (five sums)."""

    def __init__(
        self,
        horizon: int = 2000,
        gain: float = 0.85,
        min_weight: float = MIN_WEIGHT,
        min_rows: int = MIN_ROWS,
    ) -> None:
        check_int("horizon", horizon, minimum=2)
        check_ratio("gain", gain)
        if gain == 1:  # the asymptote itself is never reached
            raise ValueError("gain: must be in (0, 1), got 1")
        check_int("min_rows", min_rows, minimum=1)
        check_positive("min_weight", min_weight)
        self._keep = 1.0 - 1.0 / horizon
        self._gain = gain
        self._min_weight = min_weight
        self._min_rows = min_rows
        self._w = self._r = self._rr = self._t = self._rt = 0.0

    def observe(self, rows: float, step_s: float) -> None:
        """One step of ``rows`` rows (a mean, where it varied) took ``step_s`` seconds."""
        if not (rows > 0 and math.isfinite(rows) and step_s > 0 and math.isfinite(step_s)):
            return
        k = self._keep
        self._w = self._w * k + 1.0
        self._r = self._r * k + rows
        self._rr = self._rr * k + rows * rows
        self._t = self._t * k + step_s
        self._rt = self._rt * k + rows * step_s

    def fit(self) -> Optional[tuple[float, float]]:
        """``(a, b)`` in seconds and seconds per row; None until the steps say enough."""
        if self._w < self._min_weight:
            return None
        mean_r, mean_t = self._r / self._w, self._t / self._w
        var = self._rr / self._w - mean_r * mean_r
        if var < MIN_SPREAD:
            return None
        b = (self._rt / self._w - mean_r * mean_t) / var
        return mean_t - b * mean_r, b

    def rows(self) -> Optional[int]:
        """Rows at which throughput reaches ``gain`` of the asymptote (at least ``min_rows``);
        None without a fit, or where rows cost nothing."""
        got = self.fit()
        if got is None:
            return None
        a, b = got
        if b <= 0:
            return None
        knee = self._gain / (1.0 - self._gain) * max(a, 0.0) / b
        return max(self._min_rows, math.ceil(round(knee, 6))) if math.isfinite(knee) else None

    def snapshot(self) -> dict[str, Optional[float]]:
        got = self.fit()
        return {
            "step_base_ms": round(1000.0 * got[0], 3) if got else None,
            "step_per_row_ms": round(1000.0 * got[1], 4) if got else None,
            "rows": self.rows(),
        }
