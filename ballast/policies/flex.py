"""Service tiers on the online routes, and the flex hold: work that waits instead of failing.

A request names its tier with OpenAI's ``service_tier`` (``ServiceTier``), which sets its
class (``tier_class``):

* ``default`` (and ``auto``, and none): the class the request claims, lowered to its
  tenant's cap, as without a tier;
* ``priority`` (OpenAI's ``fast`` too): the tenant's cap (``max_criticality``);
* ``flex``: ``sheddable``, *held* where that class would be refused: while its model's level
  does not admit ``sheddable``, or its gate has no free slot, the request waits in a
  ``FlexQueue`` (one per model and router) until both hold again, and goes then, earliest
  deadline first. One whose last instant to start (``start_by_s``: its deadline less the
  service time it needs) passes while held is dropped; the router answers 504.

A flex request's deadline is the client's (``X-Request-Timeout-Ms``) or, without one, the
flex maximum (``flex_budget_s``): the online deadline's cap does not apply, the flex
maximum does. While held it holds nothing (no tenant place, quota or gate slot) and is no
demand: the level does not count what spare capacity may serve.

``FlexQueue`` is the bookkeeping and the decision of one hold, pure (an injected clock; no
asyncio): ``push`` (refused past the hold's bound, past the tenant's, or with no time
left to start), ``leave``, and ``step(room)``: the entries whose time ran out (removed) and
the ``room`` entries whose turn it is (earliest ``start_by_s`` first; they stay until they
``leave``: a turn taken by another in the meantime is not lost). The router's side (the
waiters' futures, the tick on the snapshot interval, what "room" is) is
``ballast/router/flex.py``.

Written by hand: ``heapq`` orders by deadline but neither removes an entry that leaves
(a client that went away) nor bounds the entries per tenant; a sorted list of at most
``max_held`` entries does both in plain sight.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from ballast.policies.criticality import ClaimError, Criticality, lower_criticality
from ballast.policies.validation import check_int, check_positive

#: The answer's header naming the tier that served it (as its ``service_tier`` field does).
TIER_HEADER = "X-Ballast-Service-Tier"
#: A flex request's deadline when the client sends none (``batch.flex_max_wait_s``'s default).
DEFAULT_FLEX_MAX_WAIT_S = 600.0

#: Why ``push`` refuses: the hold is full, the tenant holds its share, no time left to start.
QUEUE_FULL, TENANT_FULL, NO_TIME = "queue_full", "tenant_full", "no_time"
REFUSALS = (QUEUE_FULL, TENANT_FULL, NO_TIME)


class ServiceTier(str, enum.Enum):
    """OpenAI's ``service_tier`` as a request names it (``fast`` is parsed as ``priority``,
    as OpenAI answers it)."""

    AUTO = "auto"
    DEFAULT = "default"
    FLEX = "flex"
    PRIORITY = "priority"

    @classmethod
    def parse(cls, value: str | None) -> ServiceTier:
        """The tier a request names (None: ``auto``); ValueError for another value."""
        if value is None:
            return cls.AUTO
        if value == "fast":
            return cls.PRIORITY
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join([*(t.value for t in cls), "fast"])
            raise ValueError(f"service_tier: {value!r} is not one of {allowed}") from None

    @property
    def served(self) -> ServiceTier:
        """The tier an answer says served it: ``auto`` is served as ``default``."""
        return ServiceTier.DEFAULT if self is ServiceTier.AUTO else self

    @property
    def sets_class(self) -> bool:
        """Whether the tier, not a claim, decides the class (``flex``, ``priority``)."""
        return self in (ServiceTier.FLEX, ServiceTier.PRIORITY)


def tier_class(tier: ServiceTier, claimed: Criticality, cap: Criticality) -> tuple[Criticality, bool]:
    """(class granted, lowered): ``flex`` is ``sheddable``; ``priority`` the tenant's
    ``cap``; otherwise the claim, lowered to ``cap`` when above it (``lower_criticality``)."""
    if tier is ServiceTier.FLEX:
        return Criticality.SHEDDABLE, False
    if tier is ServiceTier.PRIORITY:
        return cap, False
    return lower_criticality(claimed, cap)


def refuse_claim_beside(tier: ServiceTier, header: str | None, from_body: Criticality | None) -> None:
    """ClaimError naming ``service_tier`` when a tier that sets the class (``flex``,
    ``priority``) comes with a class claim (the ``X-Ballast-Criticality`` header or the
    body's ``criticality``): which of the two would hold is not for the router to guess."""
    if tier.sets_class and (header is not None or from_body is not None):
        raise ClaimError(
            f"service_tier: {tier.value!r} sets the class itself; leave out criticality and X-Ballast-Criticality",
            "service_tier",
        )


def flex_budget_s(client_timeout_s: float | None, max_wait_s: float) -> float:
    """A flex request's time from its arrival to its answer: the client's timeout, at most
    ``max_wait_s``; ``max_wait_s`` without one."""
    check_positive("max_wait_s", max_wait_s)
    if client_timeout_s is None:
        return max_wait_s
    check_positive("client_timeout_s", client_timeout_s)
    return min(client_timeout_s, max_wait_s)


class FlexRefused(Exception):
    """``push`` refused: ``reason`` is one of ``REFUSALS``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, order=True)
class Held:
    """One held request, ordered by the last instant it may start, then by arrival."""

    start_by_s: float
    seq: int
    tenant: str = field(compare=False)
    since_s: float = field(compare=False)  # when it was held


@dataclass(frozen=True)
class FlexStep:
    """What one tick decides: ``expired`` (taken out: their time to start ran out) and
    ``ready`` (their turn now, earliest first; still held until they leave)."""

    expired: tuple[Held, ...]
    ready: tuple[Held, ...]


class FlexQueue:
    """The requests one hold keeps, earliest ``start_by_s`` first.

    Invariants: ``_held`` is sorted and holds at most ``max_held`` entries;
    ``_by_tenant[t]`` is the number of ``t``'s entries in it, and a tenant with none has no
    key (so the map is bounded by the entries)."""

    def __init__(self, max_held: int, clock: Callable[[], float] = time.monotonic) -> None:
        check_int("max_held", max_held, minimum=1)
        self.max_held = max_held
        self._clock = clock
        self._held: list[Held] = []
        self._by_tenant: dict[str, int] = {}
        self._seq = itertools.count()
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)  # ever, by reason

    def __len__(self) -> int:
        return len(self._held)

    def held_by(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def push(self, tenant: str, start_by_s: float, tenant_cap: int) -> Held:
        """Hold a request of ``tenant`` that must start by ``start_by_s``; FlexRefused when
        that instant has passed (``no_time``), the hold is full (``queue_full``) or the
        tenant holds ``tenant_cap`` already (``tenant_full``)."""
        now = self._clock()
        if start_by_s <= now:
            self._refuse(NO_TIME)
        if len(self._held) >= self.max_held:
            self._refuse(QUEUE_FULL)
        if self.held_by(tenant) >= tenant_cap:
            self._refuse(TENANT_FULL)
        held = Held(start_by_s, next(self._seq), tenant, now)
        bisect.insort(self._held, held)
        self._by_tenant[tenant] = self.held_by(tenant) + 1
        return held

    def leave(self, held: Held) -> bool:
        """Take ``held`` out (it goes, or its client left); False when it is not held (any
        more: a step took it out as expired)."""
        i = bisect.bisect_left(self._held, held)
        if i == len(self._held) or self._held[i] != held:
            return False
        del self._held[i]
        left = self._by_tenant[held.tenant] - 1
        if left:
            self._by_tenant[held.tenant] = left
        else:
            del self._by_tenant[held.tenant]
        return True

    def step(self, room: int) -> FlexStep:
        """Take out the entries whose time to start has come (``start_by_s`` <= now: a
        prefix, the list being sorted), then name the first ``room`` of the rest (0 when
        the level does not admit the class or the model has no free slot)."""
        now = self._clock()
        cut = bisect.bisect_right(self._held, now, key=lambda h: h.start_by_s)
        expired = tuple(self._held[:cut])
        for held in expired:
            self.leave(held)
        return FlexStep(expired, tuple(self._held[: max(0, room)]))

    def view(self) -> dict[str, object]:
        """What ``/v1/status`` shows of the hold."""
        now = self._clock()
        oldest = min((h.since_s for h in self._held), default=None)
        return {
            "held": len(self._held),
            "max_held": self.max_held,
            "oldest_held_s": None if oldest is None else round(now - oldest, 3),
            "refused": dict(self.refused),
        }

    def _refuse(self, reason: str) -> NoReturn:
        self.refused[reason] += 1
        raise FlexRefused(reason)
