"""The router's gate to the primary model: an adaptive limit and a priority wait line.

At most ``limit.value`` requests from this router are at the model at once
(policies/limiter.py moves the limit). A request that finds it reached waits here,
most critical first, then oldest first, for as long as its deadline still leaves time
to be served, and never longer than ``max_wait_s``; past that it is refused with 503
OVERLOADED rather than sent to the model to miss its deadline there. "Time to be
served" is the p90 of recent service times for sheddable classes and their mean for
the critical ones (rank <= ``critical_rank``): refusing a critical request early is a
certain failure and letting it try at the mean a likely success, while a sheddable
one let through late takes a slot a critical one may need. A newcomer is refused at
once, without waiting, when the waiters already ahead of it (as critical or more)
would take longer to drain than it can wait: at ``limit`` slots and the mean service
time, the line moves ``limit / mean`` requests per second. The line is bounded (``max_waiting``): when
it is full, a newcomer displaces the least critical, youngest waiter if it is more
critical than that one, else it is refused.

**Slots kept for critical traffic.** While critical requests have lately needed the
top of the limit (one took a slot within its top ``reserve_ratio``, or had to wait,
within the last ``reserve_hold_s``), sheddable classes may fill only
``limit - ceil(reserve_ratio * limit)`` slots. The line already lets critical waiters
go first, but a slot, once given, is held for a whole service time: without the
reserve, sheddable requests that took the slots freed in a lull hold them when the
next critical burst comes, and the burst is refused. The model's throughput barely
depends on the last few slots (a batch of 12 answers about as many per second as a
batch of 16 on this CPU), so the reserve costs sheddable traffic little and gives
critical traffic the headroom that seed 001 asks a service to keep for it. With no
recent critical pressure, sheddable traffic may use every slot.

Everything runs on the router's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from typing import Callable, Optional

from policies.criticality import Criticality
from policies.limiter import AimdLimit, p90

SERVICE_EWMA_ALPHA = 0.2
SERVICE_SAMPLES = 64  # recent service times kept for the p90 (bounded)
# Why a request got no slot: its deadline left no time to be served at all (no_time);
# the line ahead of it could not drain in its time (drain); it waited and its time ran
# out (expired); the line was full (queue_full), or a more critical newcomer took its
# place in a full line (displaced).
REFUSALS = ("no_time", "drain", "expired", "queue_full", "displaced")


class GateRefused(Exception):
    """No slot in time: ``reason`` is one of ``REFUSALS``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class PriorityGate:
    def __init__(
        self,
        limit: AimdLimit,
        max_waiting: int,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        critical_rank: int = Criticality.CRITICAL.rank,
        reserve_ratio: float = 0.0,
        reserve_hold_s: float = 1.0,
        miss_service_factor: Optional[float] = None,
    ):
        if not 0.0 <= reserve_ratio < 1.0 or reserve_hold_s < 0:
            raise ValueError(f"need 0 <= reserve_ratio < 1 and reserve_hold_s >= 0, got {reserve_ratio}, {reserve_hold_s}")
        if miss_service_factor is not None and not miss_service_factor > 0:
            raise ValueError(f"miss_service_factor must be > 0 or None, got {miss_service_factor}")
        self.limit = limit
        self.miss_service_factor = miss_service_factor
        self.critical_rank = critical_rank
        self.reserve_ratio = reserve_ratio
        self.reserve_hold_s = reserve_hold_s
        self._pressed_at = -math.inf  # when critical traffic last needed the reserved slots
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._clock = clock
        self.in_flight = 0
        self.waiting = 0  # live waiters (the heap may also hold finished ones)
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self.expected_service_s = 0.0  # EWMA of time from slot to answer
        self._service: deque[float] = deque(maxlen=SERVICE_SAMPLES)
        self._service_p90_s = 0.0
        self._waiting_by_rank: dict[int, int] = {}
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.served = 0  # slots given back with a service time (model work done), ever
        self.saturations = 0  # requests that found the limit reached, ever
        self.misses_counted = 0  # deadlines missed at the model that cut the limit, ever
        self.misses_not_congestion = 0  # missed in about the usual service time: the wait's doing

    async def acquire(self, rank: int, deadline_s: float) -> None:
        """Hold a slot on return, or raise GateRefused. ``rank`` 0 is the most critical."""
        limit = self.limit.value
        if rank <= self.critical_rank and (self.in_flight >= limit - self._reserved(limit) or self._waiting_at_most(rank)):
            self._pressed_at = self._clock()
        if self.waiting == 0 and self.in_flight < self._room(rank, limit):
            self.in_flight += 1
            return
        if self.in_flight >= limit:
            self.limit.saturated()  # held back by the limit, not by the reserve: there may be room to grow
        self.saturations += 1
        service_s = self.expected_service_s if rank <= self.critical_rank else self._service_p90_s
        wait_s = min(self.max_wait_s, deadline_s - self._clock() - service_s)
        if wait_s <= 0:
            return self._refuse("no_time")
        if self._drain_s(rank) > wait_s:
            return self._refuse("drain")
        if self.waiting >= self.max_waiting and not self._displace(rank):
            return self._refuse("queue_full")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (rank, next(self._seq), fut))
        self._add_waiting(rank, 1)
        self._grant()
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait_s)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                return  # granted in the same instant the wait ran out: the slot is ours
            if not fut.done():
                fut.cancel()
                self._add_waiting(rank, -1)
            if fut.cancelled():
                return self._refuse("expired")
            raise fut.exception() from None  # displaced
        except asyncio.CancelledError:  # the client left while waiting
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # a slot was granted but will never be used
            elif not fut.done():
                fut.cancel()
                self._add_waiting(rank, -1)
            raise

    def _add_waiting(self, rank: int, n: int) -> None:
        self.waiting += n
        self._waiting_by_rank[rank] = self._waiting_by_rank.get(rank, 0) + n

    def _waiting_at_most(self, rank: int) -> int:
        """Waiters as critical as ``rank`` or more."""
        return sum(n for r, n in self._waiting_by_rank.items() if r <= rank)

    def _reserved(self, limit: int) -> int:
        return min(limit - 1, math.ceil(self.reserve_ratio * limit))

    def _room(self, rank: int, limit: int) -> int:
        """The slots ``rank`` may fill: all of them, less the reserve for sheddable classes
        while critical traffic has lately needed it."""
        if rank <= self.critical_rank or self._clock() - self._pressed_at > self.reserve_hold_s:
            return limit
        return limit - self._reserved(limit)

    def reserving(self) -> bool:
        return self.reserve_ratio > 0 and self._clock() - self._pressed_at <= self.reserve_hold_s

    def _drain_s(self, rank: int) -> float:
        """How long the waiters ahead of a newcomer of ``rank`` take to be let through."""
        ahead = self._waiting_at_most(rank)
        if ahead == 0 or self.expected_service_s <= 0:
            return 0.0
        return (ahead + 1) * self.expected_service_s / max(1, self._room(rank, self.limit.value))

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        raise GateRefused(reason)

    def _displace(self, rank: int) -> bool:
        """Make room for a waiter of ``rank`` by refusing the least critical, youngest one."""
        live = [e for e in self._heap if not e[2].done()]
        if not live:
            return False
        worst = max(live, key=lambda e: (e[0], e[1]))
        if worst[0] <= rank:
            return False
        worst[2].set_exception(GateRefused("displaced"))
        self.refused["displaced"] += 1
        self._add_waiting(worst[0], -1)
        return True

    def release(self, service_s: Optional[float] = None) -> None:
        """Give a slot back; ``service_s`` (slot to answer) feeds the service-time estimate."""
        self.in_flight -= 1
        if service_s is not None:
            self.served += 1
            if self.served == 1:  # the first sample is the estimate, not a fifth of it
                self.expected_service_s = service_s
            self.expected_service_s += SERVICE_EWMA_ALPHA * (service_s - self.expected_service_s)
            self._service.append(service_s)
            self._service_p90_s = p90(self._service)
        self._grant()

    def observe_wait(self, wait_ms: float) -> None:
        self.limit.observe(wait_ms)
        self._grant()  # the limit may have grown

    def observe_service(self, service_s: float, budget_s: float) -> None:
        """An answered request held its slot ``service_s`` of its ``budget_s`` (arrival to deadline)."""
        if budget_s > 0:
            self.limit.observe_service(service_s / budget_s)

    def observe_miss(self, held_ms: float) -> None:
        """An admitted request ran out of time at the model after ``held_ms``.

        Congestion when the model held it longer than ``miss_service_factor`` x the
        recent p90 service time (or always, with no factor or no answer yet): the
        limit goes down. A request that the line let go near its deadline (a sheddable
        one waits until only the p90 is left) and that the model then served in its
        usual time missed because of its wait, not because the model slowed. Cutting
        the limit for it lowers throughput exactly when the line is longest: on a GPU,
        where a wider batch costs next to nothing, such misses held the limit at 8-16
        and the gate answered 0.72 of the rate it could. It still counts as a wait.
        """
        if self.miss_service_factor is None or self.served == 0 or (
            held_ms > self.miss_service_factor * self._service_p90_s * 1000.0
        ):
            self.limit.missed()
            self.misses_counted += 1
        else:
            self.misses_not_congestion += 1
        self.observe_wait(held_ms)

    def _grant(self) -> None:
        limit = self.limit.value
        while self._heap:
            rank, _, fut = self._heap[0]
            if fut.done():
                heapq.heappop(self._heap)
                continue
            if self.in_flight >= self._room(rank, limit):
                break  # the most critical waiter cannot go: nobody behind it can
            heapq.heappop(self._heap)
            fut.set_result(True)
            self._add_waiting(rank, -1)
            self.in_flight += 1
        # Finished entries at the top were dropped above; the rest are compacted now and then.
        if len(self._heap) > 4 * max(1, self.max_waiting):
            self._heap = [e for e in self._heap if not e[2].done()]
            heapq.heapify(self._heap)

    def snapshot(self) -> dict[str, object]:
        return {
            **self.limit.snapshot(),
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "expected_service_ms": round(self.expected_service_s * 1000.0, 1),
            "service_p90_ms": round(self._service_p90_s * 1000.0, 1),
            "reserving": self.reserving(),
            "refused": dict(self.refused),
            "misses": {"congestion": self.misses_counted, "late_admission": self.misses_not_congestion},
        }


class GateSlot:
    """One held slot, given back exactly once: by ``release`` or, for a response that was
    never iterated (a stream whose client left before it began), when it is collected."""

    __slots__ = ("_gate",)

    def __init__(self, gate: Optional[PriorityGate]):
        self._gate = gate

    def release(self, service_s: Optional[float] = None) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release(service_s)

    def __del__(self) -> None:
        self.release()


class DemandWindow:
    """What was offered per criticality, and what the gate let through, over ``window_s``.

    Fed once per router report with the counts since the previous one (so it holds one
    entry per report, bounded by ``max_entries``). ``served_rps`` is the gate's answer
    rate; it measures capacity only when ``gate_full`` (the gate was full for at least
    ``min_saturated`` of the window): an answer rate the gate did not push against
    says what was asked, not what the model can do.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 512, min_saturated: float = 0.5) -> None:
        self.window_s = window_s
        self.min_saturated = min_saturated
        self._clock = clock
        self._last = clock()
        self._entries: deque[tuple[float, float, dict[str, int], int, bool]] = deque(maxlen=max_entries)

    def add(self, offered: dict[str, int], served: int, saturated: bool) -> None:
        now = self._clock()
        self._entries.append((self._last, now, dict(offered), served, saturated))
        self._last = now

    def rates(self) -> dict[str, object]:
        now = self._clock()
        while self._entries and self._entries[0][1] <= now - self.window_s:
            self._entries.popleft()
        if not self._entries:
            return {"demand_rps": {}, "served_rps": 0.0, "gate_full": False}
        span = max(1e-3, self._entries[-1][1] - self._entries[0][0])
        demand: dict[str, float] = {}
        for _, _, offered, _, _ in self._entries:
            for crit, n in offered.items():
                demand[crit] = demand.get(crit, 0.0) + n
        full = sum(e[1] - e[0] for e in self._entries if e[4])
        served = sum(e[3] for e in self._entries)
        return {
            "demand_rps": {c: round(n / span, 3) for c, n in demand.items()},
            "served_rps": round(served / span, 3),
            "gate_full": full >= self.min_saturated * span,
        }
