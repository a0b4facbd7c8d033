"""How much of each class HAProxy refuses before Python runs (ballast/router/edge.py).

- A class the degradation level does not admit: all of it (``ALL``, 1000 per mille).
- A class the level admits but the model cannot take all of (the gate refuses part of
  it, most often the lowest admitted class when the level sits between two tables): the
  share the gate would refuse anyway. This is the adaptive throttling of Google's SRE
  book (chapter 21, "Handling Overload"), run at the edge instead of in each client:
  over a sliding window, per class,

      drop = max(0, (requests - K * accepts) / (requests + 1))

  where ``requests`` counts every arrival, the ones the edge refused too, and
  ``accepts`` the ones the gate let through to the model. ``K`` > 1 lets a little more
  through than is accepted, so the gate's line stays full (it still picks by class and
  deadline) and the drop falls as soon as the model takes more.
- The window's accepts are held down by what the edge lets through: once the model
  can take more, the formula alone would open the class by only a factor K per window.
  So when the gate took every request of
  a class that reached it since the last record, with a free slot and no one waiting
  (``room``), the class's window starts afresh from what the gate took (not from what
  the edge refused): nothing is refused until it holds ``min_requests`` again, measured
  at what the model takes now.
- Never more than ``max_drop`` of an admitted class, so some of it always reaches the
  router and the accepts can grow back; never any critical_plus (the router decides
  it: it may go to the fallback at any level).

The window is a ``ballast.policies.window.TimeWindow`` of ``window_s`` one-second buckets per
class (bounded; short, so that a class the model took whole stops reaching the router
soon after the load rises); time comes in as an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ballast.policies.criticality import Criticality
from ballast.policies.throttle import reject_probability
from ballast.policies.validation import check_fields, check_positive
from ballast.policies.window import TimeWindow

ALL = 1000  # per mille: the whole class


@dataclass(frozen=True)
class EdgeThrottleConfig:
    # Short: a class the model took whole a moment ago reaches the router (and is refused
    # there, in Python) until the window forgets those seconds; the router sees hundreds of
    # requests a second, enough to judge in 3.
    window_s: int = 3
    k: float = 1.1
    max_drop: float = 0.95
    # Below this many requests in the window a class is not throttled (too few to judge).
    min_requests: int = 20

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "window_s")
        if not self.k >= 1.0:
            raise ValueError(f"k: must be >= 1, got {self.k!r}")
        if not 0.0 <= self.max_drop < 1.0:
            raise ValueError(f"max_drop: must be in [0, 1), got {self.max_drop!r}")


class EdgeThrottle:
    """Per class: requests and accepts per second over the last ``window_s`` seconds."""

    def __init__(self, cfg: EdgeThrottleConfig = EdgeThrottleConfig()) -> None:
        self.cfg = cfg
        # class -> (requests, accepts) in one-second buckets, ceil(window_s) of them at
        # most; keys: the four classes (anything else is ignored).
        self._counts: dict[str, TimeWindow] = {
            c.value: TimeWindow(1.0, math.ceil(cfg.window_s), fields=2) for c in Criticality
        }

    def record(self, now_s: float, criticality: str, requests: int, accepts: int, room: bool = False) -> None:
        """``requests`` arrivals of ``criticality`` since the last record (the edge's refusals
        too), ``accepts`` of them let through by the gate; ``room``: the gate took all of
        the class that reached it and has room to spare (the window starts afresh)."""
        if room:  # the edge's refusals since the last record say nothing of what the model takes
            self.forget(criticality)
            requests = accepts
        window = self._counts.get(criticality)
        if window is None or (requests <= 0 and accepts <= 0):
            return
        window.add((max(0, requests), max(0, accepts)), now_s)

    def forget(self, criticality: str) -> None:
        """Start ``criticality``'s window afresh (the level refused it whole meanwhile)."""
        if criticality in self._counts:
            self._counts[criticality].clear()

    def window(self, now_s: float, criticality: str) -> tuple[int, int]:
        """(requests, accepts) of ``criticality`` over the window ending at ``now_s``."""
        window = self._counts.get(criticality)
        if window is None:
            return 0, 0
        requests, accepts = window.totals(now_s)
        return requests, accepts

    def drop_per_mille(self, now_s: float, criticality: str) -> int:
        """The share of ``criticality`` the edge should refuse now, in per mille (0..max_drop)."""
        if criticality == Criticality.CRITICAL_PLUS.value:
            return 0
        requests, accepts = self.window(now_s, criticality)
        if requests < self.cfg.min_requests:
            return 0
        drop = reject_probability(requests, accepts, self.cfg.k)  # the client throttle's formula
        return int(min(drop, self.cfg.max_drop) * ALL)


class EdgeCeiling:
    """What HAProxy lets through per second of one model before Python sees it (the
    controller keeps one per model and publishes it in the snapshot).

    A crowd of ten times the model's capacity reaches the routers' Python at once, before
    any report has seen it; refusing it there costs the cores the reports, the level and
    the model need, and the level's own rules then see it late. So HAProxy refuses, per
    class, what passes ``ratio`` × this model's capacity counting the classes above it
    (``haproxy_edge.cfg``: the last second's arrivals of the class and every class more
    critical), and the level takes over on the next reports.

    The capacity: the highest answer rate the model's gates measured while full
    (``LoadSignals.capacity_rps``) per serving replica, within ``memory_s`` (an older
    peak is kept until the next measurement replaces it: a capacity once measured bounds
    better than none), times the replicas serving now (a replica added raises it at
    once); never below what the routers answer now (a model that answers more than it
    was measured at, e.g. shorter requests, moves its ceiling with it). None until the
    model was measured full once: no ceiling.
    """

    def __init__(self, ratio: float | None, memory_s: float, kept: EdgeCeiling | None = None) -> None:
        self.ratio = ratio
        self.memory_s = memory_s
        # The peak per serving replica and when it was measured (``kept``'s across a redeploy).
        self._per_replica: float | None = kept._per_replica if kept is not None else None
        self._at_s: float | None = kept._at_s if kept is not None else None

    def observe(self, now_s: float, capacity_rps: float | None, served_rps: float, serving: int | None) -> float | None:
        """This tick's ceiling in requests per second (None: no ceiling). ``capacity_rps``:
        measured this tick (None: no gate was full); ``served_rps``: the routers' answer
        rate now; ``serving``: the model's replicas taking traffic (None: unknown, 1)."""
        if self.ratio is None:
            return None
        replicas = max(1, serving or 1)
        if capacity_rps is not None and capacity_rps > 0:
            per = capacity_rps / replicas
            old, at = self._per_replica, self._at_s
            if old is None or at is None or now_s < at or now_s - at > self.memory_s or per >= old:
                self._per_replica, self._at_s = per, now_s
        if self._per_replica is None:
            return None
        return self.ratio * max(self._per_replica * replicas, served_rps)
