"""What a replica holds, as the request routers see it: the adapters in its engine's slots.

A replica counts the adapter calls it ran (``AdapterHoldings.ran``) and reports, in the
routing stats Serve polls, an ``AdapterReport``: the adapters it ran most recently, most
recent first, as many as its engine has slots; the slot count; each adapter's calls
among its last ``demand_window`` adapter calls; and the time of the report. Every
router reads the same reports (one view), sums the demands into the fleet's recent mix
and hands them to ``ballast.policies.affinity``.

**Why a mirror of the calls.** vLLM keeps ``max_loras`` adapters in its batch slots,
least recently used out, and moves an adapter to the front on each step that runs it;
its slot table lives in the engine-core process, out of the replica's reach. The
adapters of the last calls, as many as the slots, are that same LRU as long as the
calls reach the engine in the order they ran here (a call joins the batch at its first
step). Calls that ran concurrently may reach the slots in another order; the mirror
can be wrong by the order of a few, never by what ran.

**Staleness.** The report carries ``at_s``, the replica's wall clock floored to
``stamp_s``: a report that has not changed still changes every ``stamp_s`` (so Serve
rebroadcasts it at most that often), and a router takes a report older than its
``max_age_s`` as stale (a replica that stopped answering its stats poll; Serve keeps its
last answer). A stamp ahead of the router's clock (a replica whose clock runs ahead, or a
bad stamp) is clamped to the router's clock when the router first sees it
(``SeenStamps``): the same stamp seen again keeps that value, so a report that stops
changing goes stale ``max_age_s`` after it arrived, however far ahead it was stamped.

**Bounds.** What a router reads is bounded before it is walked (``AdapterReport.problem``):
at most ``MAX_REPORTED`` slots (``held`` no more than ``slots``) and ``demand`` names, each
name 1-``MAX_NAME_CHARS`` characters, as the catalog names adapters. A report past one is
refused whole (the router then routes by load and says so once).

Plain data: the caller passes the time. Not thread-safe: one owner, on the replica's
event loop. The demand count is a ``CountWindow`` of adapter names.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ballast.policies.catalog import MAX_NAME_CHARS
from ballast.policies.validation import check_int, check_positive, is_finite, is_int
from ballast.policies.window import CountWindow

#: The most slots and demand names a report may carry: a report past it is refused (fail closed).
MAX_REPORTED = 1024


@dataclass(frozen=True)
class AdapterReport:
    """One replica's adapters as it reports them (``as_stats``) and a router reads them (``of``)."""

    held: tuple[str, ...]  # most recently used first, at most ``slots``
    slots: int
    demand: Mapping[str, int] = field(default_factory=dict)
    at_s: float = 0.0

    def as_stats(self) -> dict[str, Any]:
        return {"held": list(self.held), "slots": self.slots, "demand": dict(self.demand), "at_s": self.at_s}

    @classmethod
    def of(cls, stats: object) -> AdapterReport | None:
        """The report in a replica's routing stats entry; None when absent or refused (``problem``)."""
        if cls.problem(stats) is not None or not isinstance(stats, Mapping):
            return None
        return cls(tuple(stats["held"]), stats["slots"], dict(stats["demand"]), float(stats["at_s"]))

    @staticmethod
    def problem(stats: object) -> str | None:
        """Why ``stats`` is no report (a field malformed or past its bound), None when it is one.

        Each size is checked before its items are walked, so the work is bounded whatever
        the entry holds."""
        if not isinstance(stats, Mapping):
            return "not a mapping"
        held, slots, demand, at_s = (stats.get(k) for k in ("held", "slots", "demand", "at_s"))
        if not (is_int(slots) and 0 <= slots <= MAX_REPORTED):
            return f"slots: must be an int in [0, {MAX_REPORTED}]"
        if not (isinstance(held, list) and len(held) <= slots and all(_is_name(a) for a in held)):
            return f"held: must be a list of at most slots ({slots}) names of 1-{MAX_NAME_CHARS} characters"
        if not (isinstance(demand, Mapping) and len(demand) <= MAX_REPORTED):
            return f"demand: must be a mapping of at most {MAX_REPORTED} names"
        if not all(_is_name(a) and is_int(n) and n >= 0 for a, n in demand.items()):
            return f"demand: must map names of 1-{MAX_NAME_CHARS} characters to ints >= 0"
        if not is_finite(at_s):
            return "at_s: must be a finite number"
        return None

    def is_fresh(self, now_s: float, max_age_s: float) -> bool:
        """At most ``max_age_s`` old: a router passes the report with its stamp clamped
        (``SeenStamps``), so one stamped ahead of its clock ages from when it arrived."""
        return now_s - self.at_s <= max_age_s


def _is_name(name: object) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS


class AdapterHoldings:
    """One replica's mirror of its engine's adapter slots and its recent adapter demand."""

    def __init__(self, slots: int, demand_window: int = 256, stamp_s: float = 5.0) -> None:
        check_int("slots", slots, minimum=0, maximum=MAX_REPORTED)
        check_positive("stamp_s", stamp_s)
        self.slots = slots
        self._stamp_s = float(stamp_s)
        self._held: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._calls: CountWindow[str] = CountWindow(demand_window)

    def ran(self, adapter: str) -> None:
        """A call with ``adapter`` ran: it is the most recently used, the LRU one out past ``slots``."""
        self._calls.add(adapter)
        if self.slots == 0:
            return
        self._held[adapter] = None
        self._held.move_to_end(adapter)
        while len(self._held) > self.slots:
            self._held.popitem(last=False)

    @property
    def held(self) -> tuple[str, ...]:
        """Most recently used first."""
        return tuple(reversed(self._held))

    def report(self, now_s: float) -> AdapterReport:
        at_s = math.floor(now_s / self._stamp_s) * self._stamp_s
        return AdapterReport(self.held, self.slots, dict(Counter(self._calls)), at_s)


def fleet_demand(reports: Mapping[str, AdapterReport]) -> dict[str, int]:
    """Each adapter's recent calls summed over the replicas' reports."""
    total: Counter[str] = Counter()
    for r in reports.values():
        total.update(r.demand)
    return dict(total)


class SeenStamps:
    """Each replica's report stamp as a reader takes it: clamped to the reader's clock when
    the reader first sees that stamp, and kept while the stamp stays the same.

    Procedure: ``taken(key, at_s, now_s)`` answers the value kept for ``key`` if its stamp is
    still ``at_s``; otherwise it keeps and answers ``min(at_s, now_s)``. A stamp at or behind
    the reader's clock is taken as it is; one ahead of it is taken as "now", once, so a
    report that stops changing ages from its arrival and never stays fresh on a stamp in the
    future.

    Bounded: at most ``capacity`` keys (replicas); a new key past it starts the map over (the
    replicas that left are forgotten; a stamp still ahead is clamped again, to a later "now").
    Plain data: the caller passes the time; not thread-safe (one owner).
    """

    def __init__(self, capacity: int = MAX_REPORTED) -> None:
        check_int("capacity", capacity, minimum=1)
        self._capacity = capacity
        self._seen: dict[str, tuple[float, float]] = {}  # key -> (its stamp, that stamp as taken)

    def __len__(self) -> int:
        return len(self._seen)

    def taken(self, key: str, at_s: float, now_s: float) -> float:
        seen = self._seen.get(key)
        if seen is not None and seen[0] == at_s:
            return seen[1]
        if seen is None and len(self._seen) >= self._capacity:
            self._seen.clear()
        kept = min(at_s, now_s)
        self._seen[key] = (at_s, kept)
        return kept
