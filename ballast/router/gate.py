"""A router's gate to one model (each model's lane has its own, lanes.py): the glue around
ballast/policies/gate.py.

At most ``limit.value`` requests from this router are at the model at once
(ballast/policies/limiter.py moves the limit). A request that finds it reached waits here,
most critical first; inside a class, the oldest request of the tenant with the lowest
virtual token counter (ballast/policies/fairness.py; without counters, the oldest
request), for as long as its deadline still leaves time
to be served, and never longer than ``max_wait_s``; past that it is refused with 503
OVERLOADED rather than sent to the model to miss its deadline there. The rules (the
reserve for critical traffic, the drain estimate, the refusals, displacement, the
service-time estimate, whether a miss cuts the limit) are ballast/policies/gate.py's; this
module holds the waiters' futures and applies what those rules decide.

A batch line (ballast/router/dispatcher.py) takes a slot with ``try_batch``: only when no
request waits and the limit has room for the least critical class, never by waiting, so
it never enters the line and never moves the limit's saturation signal; it holds its slot
as any request does (``BatchSlot``), and ``batch_in_flight`` counts those slots.
``arrivals`` counts the interactive requests that asked for a slot (the dispatcher's
arrival rate).

Waits go through an injected ``wait_for`` (``asyncio.wait_for`` by default) so that
tests advance a fake clock instead of sleeping.

Everything runs on the router's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from ballast.policies import gate as rules
from ballast.policies.criticality import Criticality
from ballast.policies.fairness import FairCharge, TenantCounters
from ballast.policies.gate import REFUSALS
from ballast.policies.limiter import AimdLimit
from ballast.policies.stats import nearest_rank
from ballast.policies.window import CountWindow

# ``asyncio.wait_for``'s shape: await ``aw`` for at most ``timeout`` seconds, else raise
# asyncio.TimeoutError.
WaitFor = Callable[[Awaitable[Any], float], Awaitable[Any]]


class GateRefused(Exception):
    """No slot in time: ``reason`` is one of ``REFUSALS``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Waiter:
    __slots__ = ("rank", "seq", "tenant", "deadline_s", "cost", "fut", "since_s")

    def __init__(
        self,
        rank: int,
        seq: int,
        tenant: str,
        deadline_s: float,
        cost: tuple[int, int],
        fut: asyncio.Future[FairCharge | None],
        since_s: float,
    ):
        self.rank, self.seq, self.tenant, self.deadline_s, self.cost, self.fut = (
            rank,
            seq,
            tenant,
            deadline_s,
            cost,
            fut,
        )
        self.since_s = since_s  # when it joined the line


LOWEST_RANK = max(c.rank for c in Criticality)  # a batch line asks for room as the least critical class
WAIT_SAMPLES = 128  # recent waits kept per class for the status' p90 and critical_plus's p99 (bounded)
PLUS_RANK = Criticality.CRITICAL_PLUS.rank
_CLASS_OF_RANK = {c.rank: c.value for c in Criticality}


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
        miss_service_factor: float | None = None,
        wait_for: WaitFor = asyncio.wait_for,
        fair: TenantCounters | None = None,
        plus: rules.PlusReserve | None = None,
    ):
        if miss_service_factor is not None and not miss_service_factor > 0:
            raise ValueError(f"miss_service_factor must be > 0 or None, got {miss_service_factor}")
        self.limit = limit
        self.miss_service_factor = miss_service_factor
        self.critical_rank = critical_rank
        self._reserve = rules.CriticalReserve(reserve_ratio, reserve_hold_s, clock)
        self.plus = plus  # critical_plus's own rows (ballast/policies/gate.py), None: none kept
        self.plus_in_flight = 0  # slots critical_plus holds
        self.plus_over_limit = 0  # critical_plus waiters let through above the limit at max_wait_s, ever
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._wait_for = wait_for
        self.fair = fair
        self.in_flight = 0  # every slot held, batch slots included
        self.batch_in_flight = 0  # slots held by batch lines (``try_batch``)
        self.arrivals = 0  # interactive requests that asked for a slot, ever
        self.answered = 0  # interactive answers with their tokens known, ever ...
        self.tokens_answered = 0  # ... and the tokens they generated (batch dispatch reads both)
        self.waiting = 0  # live waiters (the lines may also hold finished ones)
        # Invariant: every live waiter is one entry of ``_lines[rank][tenant]`` (oldest
        # first) whose future is not done, and is counted once in ``waiting``,
        # ``_waiting_by_rank`` and ``_waiting_by_tenant``; whoever finishes a future (grant,
        # displacement, expiry, cancel) takes it off those counts (``_add_waiting``).
        self._lines: dict[int, dict[str, deque[_Waiter]]] = {}
        self._entries = 0  # entries in the lines, finished ones included (bounded by compaction)
        self._seq = itertools.count()
        self._service = rules.ServiceTime()
        self.stalls = rules.StallSpans()  # spans the model answered nothing in while it held requests
        self._waiting_by_rank: dict[int, int] = {}
        self._waiting_by_tenant: dict[str, int] = {}
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.saturations = 0  # requests that found the limit reached, ever
        self.misses_counted = 0  # deadlines missed at the model that cut the limit, ever
        self.misses_not_congestion = 0  # missed in about the usual service time: the wait's doing
        self._waits: dict[int, CountWindow[float]] = {}  # rank -> its admitted requests' recent waits

    @property
    def served(self) -> int:
        """Slots given back with a service time (model work done), ever."""
        return self._service.served

    @property
    def expected_service_s(self) -> float:
        """EWMA of time from slot to answer."""
        return self._service.mean_s

    async def acquire(
        self, rank: int, deadline_s: float, tenant: str = "", cost: tuple[int, int] = (0, 0)
    ) -> FairCharge | None:
        """Hold a slot on return, or raise GateRefused. ``rank`` 0 is the most critical.

        ``cost`` is (prompt tokens, max_tokens): with tenant counters, what the slot
        charges ``tenant``; the charge is returned, to settle when the request ends."""
        limit = self.limit.value
        self.arrivals += 1
        self._reserve.note_arrival(rank, self.critical_rank, self.in_flight, limit, self._waiting_at_most(rank))
        if self.plus is not None and rank == PLUS_RANK:
            self.plus.arrived(self.plus_in_flight + self._waiting_by_rank.get(PLUS_RANK, 0) + 1)
        if self.waiting == 0 and self.in_flight < self._room(rank, limit):
            self._take(rank)
            self._waited(rank, 0.0)
            return self._charge(tenant, cost)
        # Held back by the limit, or by the reserve (whose share of the limit grows with it):
        # either way there may be room to grow. Counting only the limit let the reserve
        # pin it: with sheddable traffic held at limit - reserve and critical traffic
        # using little of its reserve, in_flight never reached the limit, the limit never
        # grew, and sheddable requests expired in line beside idle capacity.
        self.limit.saturated()
        self.saturations += 1
        wait_s = rules.wait_budget_s(
            deadline_s, self._clock(), self._service.needed_s(rank, self.critical_rank), self.max_wait_s
        )
        drain = rules.drain_s(self._waiting_at_most(rank), self._service.mean_s, self._room(rank, self.limit.value))
        decision = rules.line_decision(wait_s, drain, self.waiting, self.max_waiting)
        if decision == rules.DISPLACE and not self._displace(rank):
            decision = "queue_full"
        if decision not in (rules.WAIT, rules.DISPLACE):
            self._refuse(decision)
        fut: asyncio.Future[FairCharge | None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(rank, next(self._seq), tenant, deadline_s, cost, fut, self._clock())
        self._lines.setdefault(rank, {}).setdefault(tenant, deque()).append(waiter)
        self._entries += 1
        self._add_waiting(waiter, 1)
        self._grant()
        try:
            await self._wait(waiter, wait_s)
        except asyncio.TimeoutError:
            if not fut.done():
                fut.cancel()
                self._add_waiting(waiter, -1)
            if fut.cancelled():
                self._refuse("expired")
            error = fut.exception()
            if error is not None:
                raise error from None  # displaced, or yielded its turn (expired)
            return fut.result()  # granted in the same instant the wait ran out: the slot is ours
        except asyncio.CancelledError:  # the client left while waiting
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(rank=rank)  # a slot was granted but will never be used
                charge = fut.result()
                if self.fair is not None and charge is not None:
                    self.fair.refund(charge)
            elif not fut.done():
                fut.cancel()
                self._add_waiting(waiter, -1)
            raise
        return fut.result()

    async def _wait(self, waiter: _Waiter, wait_s: float) -> None:
        """Wait for ``waiter``'s turn for at most ``wait_s`` (asyncio.TimeoutError past it).
        A critical_plus waiter still in line at the reserve's ``max_wait_s`` is let through
        above the limit, by at most the reserve's bound (``PlusReserve``)."""
        plus, fut = self.plus, waiter.fut
        if plus is None or waiter.rank != PLUS_RANK or wait_s <= plus.max_wait_s:
            await self._wait_for(asyncio.shield(fut), wait_s)
            return
        try:
            await self._wait_for(asyncio.shield(fut), plus.max_wait_s)
            return
        except asyncio.TimeoutError:
            if not fut.done() and self.in_flight < self.limit.value + plus.bound(self.limit.value):
                self._add_waiting(waiter, -1)
                self._take(PLUS_RANK)
                self.plus_over_limit += 1
                self._waited(PLUS_RANK, self._clock() - waiter.since_s)
                fut.set_result(self._charge(waiter.tenant, waiter.cost))
                return
        await self._wait_for(asyncio.shield(fut), wait_s - plus.max_wait_s)

    def _take(self, rank: int) -> None:
        """A slot taken by a request of ``rank``."""
        if self.in_flight == 0:
            self.stalls.busy(self._clock())
        self.in_flight += 1
        self.limit.rows_in_flight(self.in_flight)
        if rank == PLUS_RANK:
            self.plus_in_flight += 1
            if self.plus is not None:
                self.plus.note(self.plus_in_flight + self._waiting_by_rank.get(PLUS_RANK, 0))

    def try_batch(self) -> BatchSlot | None:
        """A slot for a batch line now, or None: only while nothing waits and the limit has
        room for the least critical class (the critical reserve kept). Never waits, never
        counts as a saturation, never takes the tenant counters' share."""
        if self.waiting or self.in_flight >= self._room(LOWEST_RANK, self.limit.value):
            return None
        self._take(LOWEST_RANK)
        self.batch_in_flight += 1
        return BatchSlot(self)

    def _waited(self, rank: int, wait_s: float) -> None:
        """A request of ``rank`` got its slot after ``wait_s`` in line (0: at once)."""
        window = self._waits.get(rank)
        if window is None:
            window = self._waits[rank] = CountWindow(WAIT_SAMPLES)
        window.add(wait_s)

    def _charge(self, tenant: str, cost: tuple[int, int]) -> FairCharge | None:
        if self.fair is None or not tenant:
            return None
        return self.fair.charge(tenant, *cost)

    def settle(self, charge: FairCharge | None, generated: int | None) -> None:
        """A request that held a slot ended with ``generated`` output tokens (None: unknown)."""
        if self.fair is not None and charge is not None:
            self.fair.settle(charge, generated)

    def _add_waiting(self, waiter: _Waiter, n: int) -> None:
        self.waiting += n
        self._waiting_by_rank[waiter.rank] = self._waiting_by_rank.get(waiter.rank, 0) + n
        before = self._waiting_by_tenant.get(waiter.tenant, 0)
        after = before + n
        if after:
            self._waiting_by_tenant[waiter.tenant] = after
        else:
            self._waiting_by_tenant.pop(waiter.tenant, None)
        if self.fair is not None and waiter.tenant:
            if before == 0 and after > 0:
                self.fair.backlogged(waiter.tenant)
            elif after == 0:
                self.fair.drained(waiter.tenant)

    def _waiting_at_most(self, rank: int) -> int:
        """Waiters as critical as ``rank`` or more."""
        return sum(n for r, n in self._waiting_by_rank.items() if r <= rank)

    def _room(self, rank: int, limit: int) -> int:
        """The slots ``rank`` may fill: the critical reserve kept from the sheddable classes,
        and critical_plus's free reserved rows from every other class."""
        room = self._reserve.room(rank, self.critical_rank, limit)
        if self.plus is not None and rank != PLUS_RANK:
            room = min(room, limit - self.plus.free_rows(limit, self.plus_in_flight))
        return room

    def reserving(self) -> bool:
        return self._reserve.active()

    def _refuse(self, reason: str) -> NoReturn:
        self.refused[reason] += 1
        raise GateRefused(reason)

    def _displace(self, rank: int) -> bool:
        """Make room for a waiter of ``rank`` by refusing the one ballast/policies/gate.py picks."""
        live = {
            (w.rank, w.seq): w for line in self._lines.values() for q in line.values() for w in q if not w.fut.done()
        }
        victim = rules.displaced(live, rank)
        if victim is None:
            return False
        waiter = live[victim]
        waiter.fut.set_exception(GateRefused("displaced"))
        self.refused["displaced"] += 1
        self._add_waiting(waiter, -1)
        return True

    def release(self, service_s: float | None = None, rank: int | None = None) -> None:
        """Give a slot back (one a request of ``rank`` took; None: not critical_plus);
        ``service_s`` (slot to answer) feeds the service-time estimate, less any stall in it."""
        now = self._clock()
        if service_s is not None:
            known = self._service.served >= rules.SERVICE_SAMPLES // 4  # a p90 worth judging by
            self.stalls.answered(now, self.in_flight, self._service.p90_s if known else 0.0)
            service_s = self.stalls.not_stalled_s(now - service_s, now)
        self.in_flight -= 1
        self.limit.rows_in_flight(self.in_flight)
        if rank == PLUS_RANK:
            self.plus_in_flight -= 1
            if self.plus is not None:
                self.plus.note(self.plus_in_flight + self._waiting_by_rank.get(PLUS_RANK, 0))
        if service_s is not None:
            self._service.add(service_s)
        self._grant()

    def tick(self) -> None:
        """The router's report tick: rows a reserve kept and no longer keeps (critical_plus
        idle for its ``idle_s``, critical pressure past its hold) go to the line now, not at
        the next release."""
        self._grant()

    def not_stalled_ms(self, ms: float) -> float:
        """A wait (or hold) of ``ms`` that ended now, less the stalls in it: what the model's
        load made it, the host's or the engine's stall taken out."""
        now = self._clock()
        return 1000.0 * self.stalls.not_stalled_s(now - ms / 1000.0, now)

    def observe_wait(self, wait_ms: float) -> None:
        """A wait at the model (stalls already taken out: ``not_stalled_ms``) for the limit."""
        self.limit.observe(wait_ms)
        self._grant()  # the limit may have grown

    def observe_service(self, service_s: float, budget_s: float, tokens: int = 0) -> None:
        """An answered request held its slot ``service_s`` of its ``budget_s`` (arrival to
        deadline) and generated ``tokens`` (0: not known)."""
        if tokens > 0:
            self.answered += 1
            self.tokens_answered += tokens
        if budget_s > 0:
            self.limit.observe_service(service_s / budget_s, service_s / tokens if tokens > 0 else None)

    def observe_miss(self, held_ms: float) -> None:
        """An admitted request ran out of time at the model after ``held_ms``: the limit goes
        down if ballast/policies/gate.py's ``miss_is_congestion`` says so (a stall in it is not
        the model's: taken out). It still counts as a wait."""
        held_ms = self.not_stalled_ms(held_ms)
        if rules.miss_is_congestion(held_ms, self.miss_service_factor, self._service.served, self._service.p90_s):
            self.limit.missed()
            self.misses_counted += 1
        else:
            self.misses_not_congestion += 1
        self.observe_wait(held_ms)

    def _grant(self) -> None:
        limit = self.limit.value
        while self.waiting:
            rank = min(r for r, n in self._waiting_by_rank.items() if n > 0)
            if self.in_flight >= self._room(rank, limit):
                break  # the most critical class cannot go: no class behind it can
            waiter = self._next(rank)
            behind = self._waiting_by_rank.get(rank, 0) - 1
            if rules.yields_slot(waiter.deadline_s - self._clock(), self._service.p90_s, behind):
                waiter.fut.set_exception(GateRefused("expired"))
                self.refused["expired"] += 1
                self._add_waiting(waiter, -1)
                continue
            self._add_waiting(waiter, -1)  # first: a tenant leaving the backlog is not lifted by its own charge
            self._take(rank)
            self._waited(rank, self._clock() - waiter.since_s)
            waiter.fut.set_result(self._charge(waiter.tenant, waiter.cost))
        # Finished entries at the heads of the lines were dropped in _next; the rest are
        # compacted now and then.
        if self._entries > 4 * max(1, self.max_waiting):
            self._compact()

    def _next(self, rank: int) -> _Waiter:
        """Take the next live waiter of ``rank``: the oldest of the tenant the counters pick
        (without counters, the oldest). There is one: ``_waiting_by_rank[rank] > 0``."""
        heads: dict[str, _Waiter] = {}
        line = self._lines[rank]
        for tenant, q in list(line.items()):
            while q and q[0].fut.done():
                q.popleft()
                self._entries -= 1
            if q:
                heads[tenant] = q[0]
            else:
                del line[tenant]
        oldest_first = sorted(heads, key=lambda t: heads[t].seq)
        picked = self.fair.pick(oldest_first) if self.fair is not None else None
        tenant = picked if picked is not None else oldest_first[0]
        self._entries -= 1
        return line[tenant].popleft()

    def _compact(self) -> None:
        for rank, line in list(self._lines.items()):
            for tenant, q in list(line.items()):
                live = deque(w for w in q if not w.fut.done())
                if live:
                    line[tenant] = live
                else:
                    del line[tenant]
            if not line:
                del self._lines[rank]
        self._entries = sum(len(q) for line in self._lines.values() for q in line.values())

    def _plus_view(self) -> dict[str, object]:
        """critical_plus's reserve now, what it holds, its wait's p99 against the bound."""
        plus, limit = self.plus, self.limit.value
        assert plus is not None
        waits = self._waits.get(PLUS_RANK)
        return {
            "rows": plus.rows(limit),
            "free": plus.free_rows(limit, self.plus_in_flight),
            "held": self.plus_in_flight,
            "wait_p99_ms": round(1000.0 * (nearest_rank(waits, 0.99) or 0.0), 1) if waits else 0.0,
            "max_wait_ms": round(1000.0 * plus.max_wait_s, 1),
            "over_limit": self.plus_over_limit,
        }

    def snapshot(self) -> dict[str, object]:
        return {
            **self.limit.snapshot(),
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "expected_service_ms": round(self._service.mean_s * 1000.0, 1),
            "service_p90_ms": round(self._service.p90_s * 1000.0, 1),
            # The p90 of the last WAIT_SAMPLES waits of each class's admitted requests.
            "wait_p90_ms": {
                _CLASS_OF_RANK.get(rank, str(rank)): round(1000.0 * (nearest_rank(w, 0.9) or 0.0), 1)
                for rank, w in sorted(self._waits.items())
            },
            "reserving": self.reserving(),
            **({"plus_reserve": self._plus_view()} if self.plus is not None else {}),
            "refused": dict(self.refused),
            "misses": {"congestion": self.misses_counted, "late_admission": self.misses_not_congestion},
            "stalled_s": round(self.stalls.stalled_s, 3),
            **({"fairness": self.fair.view()} if self.fair is not None else {}),
        }


class GateSlot:
    """One held slot (or none: ``GateSlot(None)``), given back exactly once by ``release``."""

    __slots__ = ("_gate", "_share", "_rank")

    def __init__(self, gate: PriorityGate | None, share: FairCharge | None = None, rank: int | None = None):
        self._gate = gate
        self._share = share  # what the slot charged its tenant's counter, if anything
        self._rank = rank  # the class that took it (critical_plus's slots are counted apart)

    def release(self, service_s: float | None = None, generated: int | None = None) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.settle(self._share, generated)
            gate.release(service_s, self._rank)


class BatchSlot:
    """A batch line's slot (``PriorityGate.try_batch``), given back exactly once by ``release``
    (a ``GateSlot``'s face, so a ticket holds either)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: PriorityGate):
        self._gate: PriorityGate | None = gate

    def release(self, service_s: float | None = None, generated: int | None = None) -> None:
        """The slot back; an answered line's service per token is a point of the gate's rows
        curve (what batch dispatch bounds its rows by), never a verdict of the slow rule."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.batch_in_flight -= 1
            if service_s is not None and generated:
                gate.limit.observe_tokens(service_s / generated)
            gate.release(service_s)
