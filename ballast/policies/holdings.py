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
last answer).

Plain data: the caller passes the time. Not thread-safe: one owner, on the replica's
event loop. The demand count is a ``CountWindow`` of adapter names.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from ballast.policies.validation import check_int, check_positive, is_finite, is_int
from ballast.policies.window import CountWindow

#: The most adapters a report may list or count: a report past it is refused (fail closed).
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
    def of(cls, stats: object) -> Optional["AdapterReport"]:
        """The report in a replica's routing stats entry; None when absent or malformed."""
        if not isinstance(stats, Mapping):
            return None
        held, slots, demand, at_s = (stats.get(k) for k in ("held", "slots", "demand", "at_s"))
        if not (isinstance(held, list) and all(isinstance(a, str) for a in held)):
            return None
        if not (is_int(slots) and 0 <= slots <= MAX_REPORTED and len(held) <= slots and is_finite(at_s)):
            return None
        if not (isinstance(demand, Mapping) and len(demand) <= MAX_REPORTED):
            return None
        if not all(isinstance(a, str) and is_int(n) and n >= 0 for a, n in demand.items()):
            return None
        return cls(tuple(held), slots, dict(demand), float(at_s))

    def is_fresh(self, now_s: float, max_age_s: float) -> bool:
        return now_s - self.at_s <= max_age_s


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
