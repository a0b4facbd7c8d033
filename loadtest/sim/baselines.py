"""The baselines' autoscalers, with time passed in (``now_s``) like the policies.

Neither sheds: every request is queued without bound and waits until it is
served or its client gives up (``SimConfig.timeout_s``).

``RayServeDefault`` re-states Ray Serve's ``replica_queue_length_autoscaling_policy``
with its default wrapper (``ray/serve/autoscaling_policy.py``: ``_core_replica_
queue_length_policy``, ``_apply_scaling_factors``, ``_apply_delay_logic``) rather
than importing it: importing Ray costs seconds and ties the simulator to
private helpers. Each control loop: the total ongoing requests (running plus
queued at the handles) averaged over ``look_back_period_s``, desired =
``ceil(total / target_ongoing_requests)`` within [min, max]; a change is applied
only after the wish has pointed the same way for ``upscale_delay_s`` (30 s) or
``downscale_delay_s`` (600 s), and then in one step.

``HpaUtilization`` is the Kubernetes HPA's algorithm on a utilization metric:
every ``sync_s`` (15 s), ``desired = ceil(current × util / target)`` over the
ready pods' utilization (pods still starting count as 0 % when scaling up,
as the HPA does for pods without metrics), no change within ±``tolerance``
(10 %), scale-up limited to max(4 pods, 100 %) per sync, scale-down to the
highest recommendation of the last ``stabilization_s`` (300 s).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RayServeDefault:
    target_ongoing_requests: float
    min_replicas: int
    max_replicas: int
    upscale_delay_s: float
    downscale_delay_s: float
    look_back_s: float
    # Bounded by the look-back window.
    _samples: deque[tuple[float, float]] = field(default_factory=deque, init=False, repr=False)
    # >0 wants up, <0 wants down (Ray's decision_counter sign).
    _direction: int = field(default=0, init=False, repr=False)
    _since_s: float | None = field(default=None, init=False, repr=False)

    def decide(self, now_s: float, total_ongoing: float, target_replicas: int) -> int:
        self._samples.append((now_s, total_ongoing))
        while self._samples and self._samples[0][0] <= now_s - self.look_back_s:
            self._samples.popleft()
        avg = sum(v for _, v in self._samples) / len(self._samples)
        desired = min(max(math.ceil(avg / self.target_ongoing_requests - 1e-9), self.min_replicas), self.max_replicas)
        if desired > target_replicas:
            if self._direction <= 0:
                self._direction, self._since_s = 1, now_s
            if now_s - self._since_s + 1e-6 >= self.upscale_delay_s:
                self._direction, self._since_s = 0, None
                return desired
        elif desired < target_replicas:
            if self._direction >= 0:
                self._direction, self._since_s = -1, now_s
            if now_s - self._since_s + 1e-6 >= self.downscale_delay_s:
                self._direction, self._since_s = 0, None
                return max(1, desired)
        else:
            self._direction, self._since_s = 0, None
        return target_replicas


@dataclass
class HpaUtilization:
    target_util_pct: float
    min_replicas: int
    max_replicas: int
    sync_s: float
    stabilization_s: float
    tolerance: float
    metric_window_s: float
    # (t, util sum over ready, ready), windowed by metric_window_s.
    _util: deque[tuple[float, float, int]] = field(default_factory=deque, init=False, repr=False)
    # Windowed by stabilization_s.
    _recommendations: deque[tuple[float, int]] = field(default_factory=deque, init=False, repr=False)
    _next_sync_s: float | None = field(default=None, init=False, repr=False)

    def decide(self, now_s: float, util_sum_pct: float, ready: int, current: int) -> int:
        """``util_sum_pct``: the sum over ready replicas of their utilization (%)."""
        self._util.append((now_s, util_sum_pct, ready))
        while self._util and self._util[0][0] <= now_s - self.metric_window_s:
            self._util.popleft()
        if self._next_sync_s is None:
            self._next_sync_s = now_s
        if now_s + 1e-9 < self._next_sync_s:
            return current
        self._next_sync_s = now_s + self.sync_s
        n = len(self._util)
        sum_util = sum(u for _, u, _ in self._util) / n
        n_ready = sum(r for _, _, r in self._util) / n
        if current == 0 or n_ready <= 0:
            raw = current
        else:
            avg = sum_util / n_ready
            ratio = avg / self.target_util_pct
            if abs(ratio - 1.0) <= self.tolerance:
                raw = current
            elif ratio > 1.0:
                # Scaling up, pods without metrics (starting) count as 0 %: the ratio is
                # recomputed over all ``current`` pods and must still clear the tolerance.
                if sum_util / (current * self.target_util_pct) > 1.0 + self.tolerance:
                    raw = math.ceil(sum_util / self.target_util_pct - 1e-9)
                else:
                    raw = current
            else:
                raw = math.ceil(n_ready * ratio - 1e-9)
        raw = min(max(raw, self.min_replicas), self.max_replicas)
        # Scale-down stabilization: the highest recommendation of the window.
        self._recommendations.append((now_s, raw))
        while self._recommendations and self._recommendations[0][0] <= now_s - self.stabilization_s:
            self._recommendations.popleft()
        desired = raw
        if raw < current:
            desired = min(current, max(r for _, r in self._recommendations))
        # Default scale-up policy: at most max(4 pods, +100 %) per period.
        if desired > current:
            desired = min(desired, current + max(4, current))
        return min(max(desired, self.min_replicas), self.max_replicas)
