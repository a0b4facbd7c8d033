"""The fleet's replicas and the requests waiting for them, as aggregates.

**Replicas** live in fixed-size numpy arrays, one slot per replica (bounded by
``capacity``), so a tick is a handful of vectorized operations whatever the
fleet size. A replica is STARTING (cold start: allocated and paid for, serving
nothing), READY, or DRAINING (a recycle drained it: it finishes what it runs
and is gone at the next tick). Each draws at creation, from the arm's own
seeded generator: its cold-start time, a hard-failure time (exponential,
``mtbf_h``), and whether it leaks; a leaking replica's memory grows linearly
from ``base`` after it is ready and it is OOM-killed when it reaches the limit.
What Serve does on its own is modelled here too: a dead replica is gone at
once and ``scale_to`` starts another while the fleet is below its target;
going down, it stops starting replicas first, then the youngest ready ones.

**Requests** wait in one FIFO (``RequestQueue``) of per-tick cohorts: the
routers spread work evenly (Serve's power-of-two choices), so the fleet is
one pool of batch slots. A cohort holds integer counts per criticality, its
arrivals spread evenly over its tick, and is served, timed out or kept in
part, split by class in proportion. ``serve`` is a fluid FIFO: the queue's
i-th request starts at ``t + i / μ`` (μ the fleet's rate at full batches)
or when it arrives, whichever is later, so its wait is linear across a chunk
and the share of a chunk within the SLO is exact for that fluid.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

FREE, STARTING, READY, DRAINING = 0, 1, 2, 3


class FleetCapacityError(Exception):
    """More replicas than slots: a sizing bug in the simulator, never a simulated outcome."""

    def __init__(self, capacity: int, wanted: int) -> None:
        super().__init__(capacity, wanted)
        self.capacity = capacity
        self.wanted = wanted

    def __str__(self) -> str:
        return f"capacity: {self.wanted} replica slots wanted, the fleet has {self.capacity}"


def split(m: int, counts: list[int]) -> list[int]:
    """``m`` of the requests in ``counts`` (per class), in proportion; largest remainder, ties by rank."""
    n = sum(counts)
    if m >= n:
        return list(counts)
    if m <= 0:
        return [0] * len(counts)
    out = [c * m // n for c in counts]
    short = m - sum(out)
    if short:
        # floor(c·m/n) + 1 <= c whenever the remainder is non-zero (m < n), so no class goes negative.
        order = sorted(range(len(counts)), key=lambda i: (-(counts[i] * m % n), i))
        for i in order[:short]:
            out[i] += 1
    return out


@dataclass
class Served:
    """One tick's service: counts per class, how many of them met the SLO, and the waits."""

    counts: list[int]
    in_slo: list[float]
    #: (members, first wait s, last wait s) per chunk, for the wait percentile.
    chunks: list[tuple[int, float, float]]

    def wait_quantile_s(self, q: float) -> float | None:
        """The ``q`` quantile of the waits, each chunk's waits spread evenly between its ends."""
        total = sum(m for m, _, _ in self.chunks)
        if total == 0:
            return None
        want = q * total
        lo, hi = 0.0, max(max(a, b) for _, a, b in self.chunks)
        for _ in range(40):
            mid = (lo + hi) / 2
            below = 0.0
            for m, a, b in self.chunks:
                x, y = (a, b) if a <= b else (b, a)
                if mid >= y:
                    below += m
                elif mid > x:
                    below += m * (mid - x) / (y - x)
            if below >= want:
                hi = mid
            else:
                lo = mid
        return hi


class RequestQueue:
    """FIFO of cohorts ``[n, counts(list of 4), first_arrival_s, spacing_s]``; bounded by timeout/tick + 1."""

    def __init__(self) -> None:
        self._cohorts: deque[list] = deque()
        self.total = 0

    def __len__(self) -> int:
        return self.total

    def per_class(self) -> list[int]:
        out = [0, 0, 0, 0]
        for c in self._cohorts:
            for i, x in enumerate(c[1]):
                out[i] += x
        return out

    def push(self, counts: list[int], t0_s: float, span_s: float) -> None:
        n = sum(counts)
        if n:
            self._cohorts.append([n, list(counts), t0_s, span_s / n])
            self.total += n

    def head_wait_s(self, now_s: float) -> float:
        return max(0.0, now_s - self._cohorts[0][2]) if self._cohorts else 0.0

    def head_arrival_s(self) -> float:
        """When the oldest request waiting arrived (inf when none waits)."""
        return self._cohorts[0][2] if self._cohorts else math.inf

    def startable(self, capacity: int) -> int:
        """How many ``serve(…, capacity, …)`` would start now."""
        return min(self.total, capacity)

    def expire(self, cutoff_s: float) -> list[int]:
        """Drop requests that arrived before ``cutoff_s``; their per-class counts."""
        out = [0, 0, 0, 0]
        while self._cohorts:
            c = self._cohorts[0]
            n, counts, a0, dt = c
            k = min(n, max(0, math.ceil((cutoff_s - a0) / dt)))
            if k == 0:
                break
            gone = split(k, counts)
            for i in range(4):
                out[i] += gone[i]
            self.total -= k
            if k == n:
                self._cohorts.popleft()
                continue
            c[0] = n - k
            c[1] = [x - g for x, g in zip(counts, gone)]
            c[2] = a0 + k * dt
            break
        return out

    def serve(self, now_s: float, capacity: int, rate_per_s: float, wait_budget_s: float, start: int = 0) -> Served:
        """Start up to ``capacity`` requests in FIFO order in the tick beginning at ``now_s``.

        ``rate_per_s`` is the start rate while there is a backlog; ``start`` is how many
        starts of the tick at that rate came before these (another line's), so the first
        one here starts at ``now_s + start / rate_per_s``. A request meets the SLO when
        its wait is at most ``wait_budget_s`` (SLO − service time).
        """
        counts = [0, 0, 0, 0]
        in_slo = [0.0, 0.0, 0.0, 0.0]
        chunks: list[tuple[int, float, float]] = []
        pos = 0
        inv_mu = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        while self._cohorts and pos < capacity:
            c = self._cohorts[0]
            n, cc, a0, dt = c
            m = min(n, capacity - pos)
            # Member i starts at max(arrival_i, now + (start+pos+i)/mu): its wait is linear in i.
            w0 = now_s + (start + pos) * inv_mu - a0
            slope = inv_mu - dt
            ok = _count_at_most(w0, slope, m, wait_budget_s)
            take = split(m, cc)
            frac = ok / m
            for i in range(4):
                counts[i] += take[i]
                in_slo[i] += take[i] * frac
            chunks.append((m, max(0.0, w0), max(0.0, w0 + (m - 1) * slope)))
            pos += m
            self.total -= m
            if m == n:
                self._cohorts.popleft()
            else:
                c[0] = n - m
                c[1] = [x - t for x, t in zip(cc, take)]
                c[2] = a0 + m * dt
        return Served(counts, in_slo, chunks)


def _count_at_most(w0: float, slope: float, m: int, budget: float) -> int:
    """How many of ``w0 + i·slope`` (i = 0 … m−1) are <= ``budget``."""
    if budget < 0:
        return 0
    if slope == 0:
        return m if w0 <= budget else 0
    x = (budget - w0) / slope
    if slope > 0:  # increasing: i <= x
        return 0 if x < 0 else min(m, math.floor(x) + 1)
    # decreasing: i >= x
    return m if x <= 0 else max(0, m - math.ceil(x))


class Fleet:
    """Replica slots and what happens to them; see the module docstring."""

    def __init__(self, capacity: int, rng: np.random.Generator, cfg) -> None:
        self.capacity = capacity
        self.rng = rng
        self.cfg = cfg
        self.state = np.zeros(capacity, dtype=np.int8)
        self.born = np.zeros(capacity)
        self.up_at = np.zeros(capacity)
        self.leak_rate = np.zeros(capacity)  # bytes/s after ready; 0: no leak
        self.oom_at = np.full(capacity, np.inf)
        self.fail_at = np.full(capacity, np.inf)
        self.intake = np.ones(capacity, dtype=bool)  # the watchdog's "ready": routers send it work
        self.serial = np.zeros(capacity, dtype=np.int64)
        self._next_serial = 0
        self._headroom = cfg.mem_limit_bytes * (1.0 - cfg.mem_base_ratio)
        self.base_bytes = cfg.mem_limit_bytes * cfg.mem_base_ratio

    # ---- counts
    def live_mask(self) -> np.ndarray:
        return (self.state == STARTING) | (self.state == READY)

    def count(self, state: int) -> int:
        return int(np.count_nonzero(self.state == state))

    def serving_mask(self) -> np.ndarray:
        return (self.state == READY) & self.intake

    # ---- life and death
    def start(self, k: int, now_s: float, age_s: np.ndarray | None = None) -> np.ndarray:
        """Start ``k`` replicas (STARTING; READY at once with ``age_s`` for the initial fleet)."""
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        free = np.flatnonzero(self.state == FREE)[:k]
        if len(free) < k:
            raise FleetCapacityError(self.capacity, self.capacity - int(np.count_nonzero(self.state == FREE)) + k)
        cfg = self.cfg
        u = self.rng.random((k, 3))
        z = self.rng.standard_normal(k)
        lo, hi = cfg.cold_start_s
        cold = lo + (hi - lo) * u[:, 0]
        leaky = u[:, 1] < cfg.leak_fraction
        tto_s = cfg.leak_tto_median_h * 3600.0 * np.exp(cfg.leak_tto_sigma * z)
        life_s = -np.log1p(-u[:, 2]) * cfg.mtbf_h * 3600.0
        if age_s is None:
            born = np.full(k, now_s)
            up = born + cold
            self.state[free] = STARTING
        else:
            # A running fleet: a leaking replica older than its time to OOM has
            # already been OOM-killed and restarted, so its process age wraps.
            age_s = np.where(leaky, np.mod(age_s, tto_s), age_s)
            up = now_s - age_s
            born = up - cold
            self.state[free] = READY
        self.born[free] = born
        self.up_at[free] = up
        self.leak_rate[free] = np.where(leaky, self._headroom / tto_s, 0.0)
        self.oom_at[free] = np.where(leaky, up + tto_s, np.inf)
        self.fail_at[free] = np.maximum(born, now_s) + life_s
        self.intake[free] = True
        self.serial[free] = np.arange(self._next_serial, self._next_serial + k)
        self._next_serial += k
        return free

    def promote(self, now_s: float) -> None:
        ready = (self.state == STARTING) & (self.up_at <= now_s)
        self.state[ready] = READY

    def reap(self, now_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Replicas that died by ``now_s``: (slots, was_oom, was_serving). Their slots are freed."""
        live = self.live_mask()
        oom = live & (self.oom_at <= now_s) & (self.oom_at <= self.fail_at)
        dead = live & ((self.oom_at <= now_s) | (self.fail_at <= now_s))
        slots = np.flatnonzero(dead)
        was_oom = oom[slots]
        was_serving = (self.state[slots] == READY) & self.intake[slots]
        self.free(slots)
        return slots, was_oom, was_serving

    def free(self, slots: np.ndarray) -> None:
        self.state[slots] = FREE
        self.oom_at[slots] = np.inf
        self.fail_at[slots] = np.inf
        self.leak_rate[slots] = 0.0
        self.intake[slots] = True

    def drained(self) -> np.ndarray:
        """Draining replicas have finished their work by the next tick: free them."""
        slots = np.flatnonzero(self.state == DRAINING)
        self.free(slots)
        return slots

    def drain(self, slot: int) -> None:
        self.state[slot] = DRAINING

    def scale_to(self, target: int, now_s: float) -> tuple[int, np.ndarray]:
        """Serve's reconciliation: (started, stopped slots). Draining replicas are not counted."""
        live = self.live_mask()
        n = int(np.count_nonzero(live))
        if n < target:
            self.start(target - n, now_s)
            return target - n, np.zeros(0, dtype=np.int64)
        if n > target:
            slots = np.flatnonzero(live)
            # Starting before ready, then youngest first (newest serial first: unique, deterministic).
            order = np.lexsort((-self.serial[slots], self.state[slots] != STARTING))
            victims = slots[order[: n - target]]
            self.free(victims)
            return 0, victims
        return 0, np.zeros(0, dtype=np.int64)

    # ---- memory
    def mem_bytes(self, slots: np.ndarray, now_s: float) -> np.ndarray:
        return self.base_bytes + self.leak_rate[slots] * np.maximum(0.0, now_s - self.up_at[slots])
