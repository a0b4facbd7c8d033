"""The gate's decisions: who gets a slot at the model, who waits, who is refused and why.

ballast/router/gate.py is the glue around these: it holds the asyncio futures of the
waiters and applies what is decided here. Everything here is pure, on numbers passed in
or an injected clock, so the fleet simulator and the unit tests run the same rules.

- **Service time** (``ServiceTime``): an EWMA of slot-to-answer times and the p90 of
  the last ``SERVICE_SAMPLES``. A critical request (rank <= critical_rank) needs the
  mean to be served, a sheddable one the p90: refusing a critical request early is a
  certain failure and letting it try at the mean a likely success, while a sheddable
  one let through late takes a slot a critical one may need.
- **Reserve** (``CriticalReserve``): while critical requests have lately needed the top
  ``reserve_ratio`` of the limit (took a slot there, or had to wait) within
  ``reserve_hold_s``, sheddable classes may fill only ``limit - reserved_slots``. A
  slot, once given, is held for a whole service time: without the reserve, sheddable
  requests that took the slots freed in a lull hold them when the next critical burst
  comes, and the burst is refused.
- **critical_plus's own reserve** (``PlusReserve``): while critical_plus has arrived within
  ``idle_s``, free rows below the limit are kept for it alone: its peak of rows (held and
  waiting) over ``window_s``, plus one for the next arrival, at most ``max_ratio`` of the
  limit, less what it holds already. No other class (critical included) takes them; once
  it has not arrived for ``idle_s`` (a control tick) they are lent back. A critical_plus
  waiter that has waited ``max_wait_s`` is let through above the limit, by at most the
  reserve's bound: the wait of the class that must never fail is bounded, not estimated.
- **Stalls are not service** (``StallSpans``): a span in which the model answered nothing
  while it held requests, longer than ``min_s`` (1 s: a long prefill between two decode
  steps is load, not a stall) and than ``factor`` (3) x the p90 service time (the oldest
  request held would have been answered within one p90 of its start), is a stall of the
  host or the engine, from one p90 after the last answer to the next. The time a stall
  covered is taken out of every service time and wait measured across it, so the
  estimates read the model's recent service, not one slow window: after a 3 s stall the
  p90 is still the model's, and waiters whose deadline it can meet are not refused for it.
  A request far longer than the p90, alone at the model, reads as a stall too: its own
  sample is shortened, one of 64.
- **Line entry** (``line_decision``): no time at all to be served (no_time), a line
  ahead that cannot drain in the time left (drain), a full line (displace the least
  critical, youngest waiter if the newcomer is more critical, else queue_full).
- **A marginal waiter yields** (``yields_slot``): a waiter whose turn comes with less than
  the p90 left gives the slot to a waiter of its own class behind it, and is refused
  (expired). That is a critical waiter that waited to the edge of the mean (a sheddable
  one stops waiting at the p90, unless the p90 grew meanwhile). The mean is for a critical
  request the slot would otherwise not serve at all; when its own class waits behind it,
  a slot spent on a likely miss is a slot taken from a likely answer.
- **Misses** (``miss_is_congestion``): whether an admitted request that ran out of
  time at the model should cut the limit.
- **DemandWindow**: what was offered per criticality and what the gate let through.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from ballast.policies.stats import nearest_rank
from ballast.policies.validation import check_int, check_positive
from ballast.policies.window import CountWindow

SERVICE_EWMA_ALPHA = 0.2
SERVICE_SAMPLES = 64  # recent service times kept for the p90 (bounded)
# Why a request got no slot: its deadline left no time to be served at all (no_time);
# the line ahead of it could not drain in its time (drain); it waited and its time ran
# out (expired); the line was full (queue_full), or a more critical newcomer took its
# place in a full line (displaced).
REFUSALS = ("no_time", "drain", "expired", "queue_full", "displaced")
# What a newcomer that found no free slot does: wait in line, make room by displacing
# a less critical waiter, or be refused now (one of REFUSALS).
WAIT = "wait"
DISPLACE = "displace"


class ServiceTime:
    """Slot-to-answer times: an EWMA (``mean_s``) and the p90 of the last ``max_samples``."""

    def __init__(self, alpha: float = SERVICE_EWMA_ALPHA, max_samples: int = SERVICE_SAMPLES) -> None:
        self.alpha = alpha
        self.mean_s = 0.0
        self.p90_s = 0.0
        self.served = 0  # samples ever added
        self._samples: CountWindow[float] = CountWindow(max_samples)

    def add(self, service_s: float) -> None:
        self.served += 1
        if self.served == 1:  # the first sample is the estimate, not a fifth of it
            self.mean_s = service_s
        self.mean_s += self.alpha * (service_s - self.mean_s)
        self._samples.add(service_s)
        p90 = nearest_rank(self._samples, 0.9)
        assert p90 is not None  # the window holds at least the one just added
        self.p90_s = p90

    def needed_s(self, rank: int, critical_rank: int) -> float:
        """The time ``rank`` must have left to be let through: the mean for critical, p90 else."""
        return self.mean_s if rank <= critical_rank else self.p90_s


def reserved_slots(limit: int, reserve_ratio: float) -> int:
    """Slots kept for critical traffic: ceil(ratio x limit), always leaving one to the rest."""
    return min(limit - 1, math.ceil(reserve_ratio * limit))


class CriticalReserve:
    """Whether critical traffic lately needed the reserved slots (on an injected clock)."""

    def __init__(
        self, reserve_ratio: float = 0.0, reserve_hold_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0.0 <= reserve_ratio < 1.0 or reserve_hold_s < 0:
            raise ValueError(
                f"need 0 <= reserve_ratio < 1 and reserve_hold_s >= 0, got {reserve_ratio}, {reserve_hold_s}"
            )
        self.reserve_ratio = reserve_ratio
        self.reserve_hold_s = reserve_hold_s
        self._clock = clock
        self._pressed_at_s = -math.inf  # when critical traffic last needed the reserved slots

    def note_arrival(self, rank: int, critical_rank: int, in_flight: int, limit: int, waiting_ahead: int) -> None:
        """A critical arrival presses the reserve when it would take a reserved slot or has to wait."""
        if rank <= critical_rank and (in_flight >= limit - reserved_slots(limit, self.reserve_ratio) or waiting_ahead):
            self._pressed_at_s = self._clock()

    def held(self) -> bool:
        return self._clock() - self._pressed_at_s <= self.reserve_hold_s

    def active(self) -> bool:
        """Whether sheddable traffic is kept out of the reserved slots now."""
        return self.reserve_ratio > 0 and self.held()

    def room(self, rank: int, critical_rank: int, limit: int) -> int:
        """The slots ``rank`` may fill: all of them, less the reserve for sheddable classes
        while critical traffic has lately needed it."""
        if rank <= critical_rank or not self.held():
            return limit
        return limit - reserved_slots(limit, self.reserve_ratio)


PLUS_SAMPLES = 256  # critical_plus row counts remembered for the reserve's peak (bounded)


class PlusReserve:
    """Rows below the limit kept for critical_plus alone (the module docstring), on an
    injected clock. ``note`` is told critical_plus's rows (held + waiting) whenever they
    change or one arrives; ``free_rows`` is what the other classes must leave free now."""

    def __init__(
        self,
        max_ratio: float = 0.25,
        window_s: float = 5.0,
        idle_s: float = 0.5,
        max_wait_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= max_ratio < 1.0:
            raise ValueError(f"max_ratio: must be in [0, 1), got {max_ratio!r}")
        check_positive("window_s", window_s)
        check_positive("idle_s", idle_s)
        check_positive("max_wait_s", max_wait_s)
        self.max_ratio = max_ratio
        self.window_s = window_s
        self.idle_s = idle_s
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._arrived_s = -math.inf  # critical_plus's last arrival
        self._rows: CountWindow[int] = CountWindow(PLUS_SAMPLES)  # its row counts, stamped

    def arrived(self, rows: int) -> None:
        """A critical_plus request arrived; with it, the class holds or waits for ``rows``."""
        self._arrived_s = self._clock()
        self.note(rows)

    def note(self, rows: int) -> None:
        self._rows.add(rows, self._clock())

    def bound(self, limit: int) -> int:
        """The most rows the reserve may be: ``max_ratio`` of the limit (at least one while
        the ratio is not 0), never the whole limit."""
        if self.max_ratio == 0 or limit < 2:
            return 0
        return min(limit - 1, max(1, math.floor(self.max_ratio * limit)))

    def active(self) -> bool:
        return self.max_ratio > 0 and self._clock() - self._arrived_s <= self.idle_s

    def rows(self, limit: int) -> int:
        """The reserve now: the class's peak over ``window_s`` plus one, within ``bound``; 0
        once critical_plus has not arrived for ``idle_s`` (lent back)."""
        if not self.active():
            return 0
        now = self._clock()
        self._rows.expire(now - self.window_s)
        peak = max(self._rows, default=0)
        return min(self.bound(limit), peak + 1)

    def free_rows(self, limit: int, plus_held: int) -> int:
        """The rows the other classes must leave free: the reserve less what critical_plus holds."""
        return max(0, self.rows(limit) - plus_held)


STALL_SPANS = 32  # stall spans remembered (bounded); older ones overlap no live request


class StallSpans:
    """Spans in which the model answered nothing while it held requests (the module
    docstring), and how much of any interval they cover. Fed with each answer
    (``answered``: the requests held just before it) and each start of holding (``busy``);
    time comes in as arguments."""

    def __init__(self, factor: float = 3.0, min_s: float = 1.0, max_spans: int = STALL_SPANS) -> None:
        check_positive("factor", factor)
        check_positive("min_s", min_s)
        check_int("max_spans", max_spans, minimum=1)
        self.factor = factor
        self.min_s = min_s
        self._last_s: float | None = None  # the last answer, or the start of holding
        self._spans: CountWindow[tuple[float, float]] = CountWindow(max_spans)
        self.stalled_s = 0.0  # stalled time seen, ever

    def __len__(self) -> int:
        """Spans held (at most ``max_spans``)."""
        return len(self._spans)

    def busy(self, now_s: float) -> None:
        """Requests are held from ``now_s`` on, after none were: an idle model is no stall."""
        self._last_s = now_s

    def answered(self, now_s: float, held: int, p90_s: float) -> float | None:
        """An answer at ``now_s``, ``held`` requests at the model just before it; ``p90_s``
        the service time's p90 (0: not known yet, and then no span is judged a stall).
        Returns the time since the last answer less the stall in it (None: none before)."""
        last = self._last_s
        self._last_s = now_s
        if last is None:
            return None
        if held > 0 and p90_s > 0 and now_s - last > max(self.min_s, self.factor * p90_s):
            # One p90 after the last answer was the model's to use: the rest was the stall.
            self._spans.add((last + p90_s, now_s), now_s)
            self.stalled_s += now_s - last - p90_s
        return self.not_stalled_s(last, now_s)

    def overlap_s(self, start_s: float, end_s: float) -> float:
        """How much of [start_s, end_s] the stalls cover."""
        return sum(max(0.0, min(end_s, b) - max(start_s, a)) for a, b in self._spans)

    def not_stalled_s(self, start_s: float, end_s: float) -> float:
        """[start_s, end_s]'s length less the stalls in it."""
        return max(0.0, end_s - start_s - self.overlap_s(start_s, end_s))


def yields_slot(time_left_s: float, p90_s: float, same_rank_behind: int) -> bool:
    """Whether the waiter whose turn it is gives its slot to one of its own class behind it:
    only when one waits there, and it has less than the p90 of service time left."""
    return same_rank_behind > 0 and time_left_s < p90_s


def drain_s(ahead: int, mean_service_s: float, room: int) -> float:
    """How long ``ahead`` waiters take to be let through, plus the newcomer's own turn:
    at ``room`` slots and the mean service time the line moves room / mean per second."""
    if ahead == 0 or mean_service_s <= 0:
        return 0.0
    return (ahead + 1) * mean_service_s / max(1, room)


def wait_budget_s(deadline_s: float, now_s: float, needed_s: float, max_wait_s: float) -> float:
    """How long a newcomer may wait: until only its service time is left, at most max_wait_s."""
    return min(max_wait_s, deadline_s - now_s - needed_s)


def line_decision(wait_s: float, drain_estimate_s: float, waiting: int, max_waiting: int) -> str:
    """For a newcomer that found no free slot: WAIT, DISPLACE (the line is full: try to
    make room), or a refusal reason (no_time, drain)."""
    if wait_s <= 0:
        return "no_time"
    if drain_estimate_s > wait_s:
        return "drain"
    if waiting >= max_waiting:
        return DISPLACE
    return WAIT


def displaced(waiters: Iterable[tuple[int, int]], rank: int) -> tuple[int, int] | None:
    """The (rank, seq) waiter a newcomer of ``rank`` displaces from a full line: the least
    critical, youngest one, if it is less critical than the newcomer; else None (queue_full)."""
    worst = max(waiters, default=None)
    if worst is None or worst[0] <= rank:
        return None
    return worst


def miss_is_congestion(held_ms: float, miss_service_factor: float | None, served: int, service_p90_s: float) -> bool:
    """Whether a deadline missed at the model after ``held_ms`` should cut the limit.

    Congestion when the model held it longer than ``miss_service_factor`` x the recent
    p90 service time (or always, with no factor or no answer yet). A request that the
    line let go near its deadline (a sheddable one waits until only the p90 is left)
    and that the model then served in its usual time missed because of its wait, not
    because the model slowed. Cutting the limit for it lowers throughput exactly when
    the line is longest: on a GPU, where a wider batch costs next to nothing, such
    misses held the limit at 8-16 and the gate answered 0.72 of the rate it could.
    """
    if miss_service_factor is None or served == 0:
        return True
    return held_ms > miss_service_factor * service_p90_s * 1000.0


class DemandWindow:
    """What was offered per criticality, and what the gate let through, over ``window_s``.

    Fed once per router report with the counts since the previous one: one entry per
    report in a ``CountWindow`` of ``max_entries``, stamped with the report's time; an
    entry leaves once its interval ended ``window_s`` or more ago. ``served_rps`` is the
    gate's answer rate; it measures capacity only when ``gate_full`` (the gate was full
    for at least ``min_saturated`` of the window): an answer rate the gate did not push
    against says what was asked, not what the model can do.

    **The last two reports**, for a step: the window's mean takes ``window_s`` to show a
    step whole (a crowd arriving at 10x reads 2.8x after half a second of a 5 s window),
    so the rates of the last two report intervals are given too, per criticality:
    ``demand_sustained_rps``, the lower of the two (what both reached: a crowd that
    arrived shows in both, a stall's catch-up, its seconds of requests sent at once after
    it, in one only), and ``demand_recent_max_rps``, the higher (a crowd that left shows
    in neither). Both empty until two reports are in the window.
    """

    def __init__(
        self,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 512,
        min_saturated: float = 0.5,
    ) -> None:
        check_positive("window_s", window_s)
        check_int("max_entries", max_entries, minimum=1)
        self.window_s = window_s
        self.min_saturated = min_saturated
        self._clock = clock
        self._last = clock()
        # Each entry: (start, end, offered, served, saturated), stamped with its end.
        self._entries: CountWindow[tuple[float, float, dict[str, int], int, bool]] = CountWindow(max_entries)

    def __len__(self) -> int:
        """Reports held (at most ``max_entries``)."""
        return len(self._entries)

    def add(self, offered: dict[str, int], served: int, saturated: bool) -> None:
        now = self._clock()
        self._entries.add((self._last, now, dict(offered), served, saturated), now)
        self._last = now

    def rates(self) -> dict[str, object]:
        self._entries.expire(self._clock() - self.window_s, inclusive=True)
        entries = list(self._entries)
        if not entries:
            return {
                "demand_rps": {},
                "served_rps": 0.0,
                "gate_full": False,
                "demand_sustained_rps": {},
                "demand_recent_max_rps": {},
            }
        span = max(1e-3, entries[-1][1] - entries[0][0])
        demand: dict[str, float] = {}
        for _, _, offered, _, _ in entries:
            for crit, n in offered.items():
                demand[crit] = demand.get(crit, 0.0) + n
        full = sum(e[1] - e[0] for e in entries if e[4])
        served = sum(e[3] for e in entries)
        low, high = last_two_rates([(e[0], e[1], e[2]) for e in entries[-2:]])
        return {
            "demand_rps": {c: round(n / span, 3) for c, n in demand.items()},
            "served_rps": round(served / span, 3),
            "gate_full": full >= self.min_saturated * span,
            "demand_sustained_rps": low,
            "demand_recent_max_rps": high,
        }


def last_two_rates(
    intervals: list[tuple[float, float, dict[str, int]]],
) -> tuple[dict[str, float], dict[str, float]]:
    """Per criticality, the lower and the higher of the offered rates of two report
    intervals (start, end, counts); a class absent from one offered nothing in it. Two
    empty mappings unless there are exactly two intervals."""
    if len(intervals) != 2:
        return {}, {}
    rates = [{c: n / max(1e-3, end - start) for c, n in offered.items()} for start, end, offered in intervals]
    classes = set(rates[0]) | set(rates[1])
    low = {c: round(min(r.get(c, 0.0) for r in rates), 3) for c in classes}
    high = {c: round(max(r.get(c, 0.0) for r in rates), 3) for c in classes}
    return low, high
