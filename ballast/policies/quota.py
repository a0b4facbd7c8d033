"""Tenant quotas in tokens: the limit math, and the bucket that counts against it.

Costs are in *tokens*, a resource unit, not in requests: a request costs its
prompt tokens plus the tokens it generates. "Queries per second" is the pitfall
the SRE book warns about — one 4,000-token generation costs a GPU a hundred
times what a 40-token one does, so a per-tenant limit in requests would let one
tenant starve the others while staying "within quota".

Five pieces, split as STYLE 4 asks (the limit math apart from the counting):

* ``TenantQuota`` — a tenant's configured rate, burst, concurrency cap, weight
  and whether it is sheddable.
* ``effective_rates`` — pure: each tenant's *global* rate for this control
  tick, after shrinking sheddable tenants by the degradation level and lending
  idle rate to tenants that want more.
* ``apportion`` — pure: one tenant's global rate split among routers by the
  demand each router saw, so a tenant whose traffic lands on one router is not
  held to 1/N of its quota there.
* ``RateLease`` / ``lease_rate`` — what a router enforces: the controller's share
  while its lease is fresh, else the safe share 1/N of the tenant's own rate
  (fail-static: a dead controller can never let a tenant exceed its quota in
  total, only under-use it).
* ``TokenBucket`` — the accounting on the router's hot path.

**Overcommit.** The sum of the tenants' own rates may exceed what the GPUs can
serve (the SRE book's 10,000 CPUs sold as 13,500): not every tenant is at its
limit at once. Quotas protect tenants from each other; the degradation level
protects the service from the sum.

Written by hand rather than with a rate-limit library: the usual ones
(``limits``, ``pyrate-limiter``, ``aiolimiter``) count requests against a
wall clock or a storage backend; none takes an injected clock, a cost known
only after the fact (``refund``/``charge_extra``), a rate that changes every
control tick without losing the bucket's level, or lends idle rate by weight.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from ballast.policies.validation import (
    check_fields,
    check_finite,
    check_int,
    check_name,
    check_non_negative,
    check_positive,
    is_int,
    is_number,
)

# Token counts are floats refilled by ``elapsed × rate``; a bucket that the
# arithmetic leaves a hair short of a cost it should now afford (retry_after_s
# says "wait 0.3 s", the caller waits 0.3 s, the refill lands at 99.99999999)
# would refuse once more for nothing. Relative so it scales with token counts.
_EPSILON = 1e-9

DEFAULT_LEVEL_FACTORS: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25, 0.0)
DEFAULT_LEND_AT_LEVELS: frozenset[int] = frozenset({0})

LEASE_SOURCE = "lease"
SAFE_SHARE_SOURCE = "safe-share"


def _tolerance(amount: float) -> float:
    return _EPSILON * max(1.0, abs(amount))


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's quota. Rates and bursts are in tokens (prompt + generated)."""

    #: Sustained rate the tenant is sold.
    rate_tokens_per_s: float
    #: Bucket depth: how much may be spent at once after an idle spell. A single
    #: request larger than this is still possible (see ``TokenBucket``).
    burst_tokens: float
    #: Requests of this tenant in flight at once (router-wide cap).
    max_concurrent: int
    #: Share of the idle-rate pool this tenant gets when it borrows.
    weight: float = 1.0
    #: A sheddable tenant's rate shrinks with the degradation level
    #: (``effective_rates``' ``level_factors``); others keep their rate.
    sheddable: bool = False

    def __post_init__(self) -> None:
        # A zero rate would be a disabled tenant; that is the kill switch's job,
        # with its own error code, not a quota that silently refuses everything.
        check_fields(self, check_positive, "rate_tokens_per_s", "burst_tokens")
        check_fields(self, check_int, "max_concurrent", minimum=1)
        check_fields(self, check_positive, "weight")
        if not isinstance(self.sheddable, bool):
            raise ValueError(f"sheddable: must be a bool, got {self.sheddable!r}")


# --------------------------------------------------------------------------- accounting


class TokenBucket:
    """A token bucket on an injected clock: ``rate_tokens_per_s`` refill, ``burst_tokens`` depth.

    Refill is lazy: every call first adds ``elapsed × rate`` (capped at the
    burst) for the time since the last call. A clock that steps backwards adds
    nothing and does not move the refill mark back, so the same interval is
    never credited twice.

    **Costs above the burst.** A request may cost more than the bucket can ever
    hold (a long generation on a small burst). Refusing it forever would make
    the quota a size limit, which it is not. Instead ``try_charge`` passes such
    a request once the bucket is *full*, and the balance goes negative: the
    tenant then waits ``(cost − burst) / rate`` longer before anything else
    passes, so big requests are possible but still paid for at the rate.
    In general a charge passes when ``tokens >= min(cost, burst)``.

    **Estimates.** The true cost of a generation is known only at its end. The
    router charges an estimate up front and settles afterwards: ``refund`` the
    difference when it cost less (never above the burst), ``charge_extra`` when
    it cost more (may go negative: the debt is repaid by waiting).

    Not thread-safe: the router calls it from its single event-loop thread and
    no method awaits, so each call completes before another starts.
    """

    __slots__ = ("_rate_tokens_per_s", "_burst_tokens", "_tokens", "_clock", "_last_s")

    def __init__(
        self,
        rate_tokens_per_s: float,
        burst_tokens: float,
        clock: Callable[[], float] = time.monotonic,
        initial_tokens: float | None = None,
    ) -> None:
        check_non_negative("rate_tokens_per_s", rate_tokens_per_s)
        check_positive("burst_tokens", burst_tokens)
        if initial_tokens is None:
            initial_tokens = burst_tokens
        check_non_negative("initial_tokens", initial_tokens)
        if initial_tokens > burst_tokens:
            raise ValueError(f"initial_tokens: must be <= burst_tokens ({burst_tokens}), got {initial_tokens!r}")
        self._rate_tokens_per_s = float(rate_tokens_per_s)
        self._burst_tokens = float(burst_tokens)
        self._tokens = float(initial_tokens)
        self._clock = clock
        self._last_s = clock()

    # ---- state

    @property
    def rate_tokens_per_s(self) -> float:
        return self._rate_tokens_per_s

    @property
    def burst_tokens(self) -> float:
        return self._burst_tokens

    @property
    def tokens(self) -> float:
        """Tokens available now (after refill); negative while a debt is repaid."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now_s = self._clock()
        elapsed_s = now_s - self._last_s
        if elapsed_s > 0:
            # A bucket already at or above the burst stays where it is; one in
            # debt climbs back through zero at the same rate.
            if self._tokens < self._burst_tokens:
                self._tokens = min(self._burst_tokens, self._tokens + elapsed_s * self._rate_tokens_per_s)
            self._last_s = now_s

    def _needed(self, cost: float) -> float:
        # Above the burst, a full bucket is enough (see the class docstring).
        return min(cost, self._burst_tokens)

    # ---- changes

    def set_rate(self, rate_tokens_per_s: float, burst_tokens: float) -> None:
        """Switch to a new rate and burst (a new lease or share) without losing the level.

        Time up to now is credited at the *old* rate first — that is the rate
        that was in force — then the new one applies from now on. Tokens above
        the new burst are cut; a debt is kept.
        """
        check_non_negative("rate_tokens_per_s", rate_tokens_per_s)
        check_positive("burst_tokens", burst_tokens)
        self._refill()
        self._rate_tokens_per_s = float(rate_tokens_per_s)
        self._burst_tokens = float(burst_tokens)
        self._tokens = min(self._tokens, self._burst_tokens)

    def try_charge(self, cost: float) -> bool:
        """Charge ``cost`` and return True if it fits now; otherwise charge nothing."""
        check_non_negative("cost", cost)
        self._refill()
        if self._tokens < self._needed(cost) - _tolerance(cost):
            return False
        self._tokens -= cost
        return True

    def refund(self, tokens: float) -> None:
        """Give back ``tokens`` (the request cost less than charged); never above the burst."""
        check_non_negative("tokens", tokens)
        self._refill()
        self._tokens = min(self._burst_tokens, self._tokens + tokens)

    def charge_extra(self, tokens: float) -> None:
        """Take ``tokens`` more (the request cost more than charged); may go negative."""
        check_non_negative("tokens", tokens)
        self._refill()
        self._tokens -= tokens

    def retry_after_s(self, cost: float) -> float:
        """Seconds until ``try_charge(cost)`` would pass at the current rate.

        Waiting exactly this long always suffices, at any clock value (see
        ``_ready_at_s``); it exceeds the exact ``missing / rate`` by at most a
        few float spacings of the clock. 0.0 if it would pass now; ``math.inf`` if it cannot pass now and the
        rate is 0 (nothing refills until a new rate is set).
        """
        check_non_negative("cost", cost)
        now_s = self._clock()
        self._refill()
        missing = self._needed(cost) - self._tokens
        if missing <= _tolerance(cost):
            return 0.0
        if self._rate_tokens_per_s == 0:
            return math.inf
        return self._wait_until_s(self._ready_at_s(cost), now_s)

    def _ready_at_s(self, cost: float) -> float:
        """The first clock value at which ``try_charge(cost)`` passes, as floats compute it.

        Why not just ``missing / rate``: the caller adds that wait to a clock
        value, and at a large one (30 days of monotonic uptime is 2.6e6 s, where
        floats are 4.7e-10 s apart) the sum rounds, down as often as up. The
        refill then sees a shorter elapsed time than advertised and, at a high
        rate, comes up short by more than the tolerance: the client that waited
        exactly as told is refused again. The error grows with the clock value,
        not with the cost, so no tolerance on tokens fixes it.

        Instead find the clock value itself: start at ``last + missing / rate``
        and step to the next float until the refill the bucket will compute
        (``tokens + (t - last) × rate``, the same expression as ``_refill``)
        covers the cost. Each step adds one float spacing of ``t``, and the
        rounding lost at most one, so this ends in a step or two.
        """
        last_s = self._last_s
        rate = self._rate_tokens_per_s
        floor = self._needed(cost) - _tolerance(cost)
        t_s = last_s + (self._needed(cost) - self._tokens) / rate
        while self._tokens + (t_s - last_s) * rate < floor:
            t_s = math.nextafter(t_s, math.inf)
        return t_s

    @staticmethod
    def _wait_until_s(ready_at_s: float, now_s: float) -> float:
        # The wait such that ``now_s + wait`` (the caller's own sum) is not
        # below ``ready_at_s``; also covers a clock that stepped back since the
        # last refill (``now_s < last``: the wait counts from now, not from last).
        wait_s = ready_at_s - now_s
        while now_s + wait_s < ready_at_s:
            wait_s = math.nextafter(wait_s, math.inf)
        return wait_s

    def __repr__(self) -> str:
        return (
            f"TokenBucket(rate_tokens_per_s={self._rate_tokens_per_s!r}, "
            f"burst_tokens={self._burst_tokens!r}, tokens={self._tokens!r})"
        )


# --------------------------------------------------------------------------- limit math


def apportion(tenant_rate: float, demands: Mapping[str, float], min_share_ratio: float = 0.1) -> dict[str, float]:
    """Split one tenant's rate among routers by the demand each saw (tokens/s).

    Every router listed gets a floor of ``min_share_ratio × rate / n``, so a
    router that saw none of this tenant's traffic last tick (the load balancer
    may send it the next request) can still admit one; the remaining
    ``(1 − min_share_ratio) × rate`` goes in proportion to demand. With no
    demand anywhere every router gets ``rate / n``. The shares sum to
    ``tenant_rate`` up to float rounding. No router listed → ``{}``.

    Rates are continuous, so unlike concurrency partitions nothing is rounded.
    """
    check_non_negative("tenant_rate", tenant_rate)
    if not is_number(min_share_ratio) or not 0 <= min_share_ratio <= 1:
        raise ValueError(f"min_share_ratio: must be in [0, 1], got {min_share_ratio!r}")
    for router, demand in demands.items():
        check_non_negative(f"demands[{router!r}]", demand)
    n = len(demands)
    if n == 0:
        return {}
    total_demand = sum(demands.values())
    if total_demand <= 0:
        return {router: tenant_rate / n for router in demands}
    floor = min_share_ratio * tenant_rate / n
    by_demand = tenant_rate - floor * n
    return {router: floor + by_demand * demand / total_demand for router, demand in demands.items()}


def _water_fill(pool: float, needs: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Split ``pool`` by weight, nobody getting more than its need; what a capped
    borrower leaves goes to the others by weight.

    Progressive filling: each round, every borrower whose need fits within its
    weighted share of what is left is given exactly its need and leaves the
    round. Removing them only raises the others' per-weight share, so a
    borrower capped in one round stays capped: at most ``len(needs)`` rounds,
    and the result is exact, not an approximation.
    """
    given = dict.fromkeys(needs, 0.0)
    active = {name for name, need in needs.items() if need > 0}
    left = pool
    while active and left > 0:
        total_weight = sum(weights[name] for name in active)
        capped = {name for name in active if needs[name] <= left * weights[name] / total_weight}
        if not capped:
            for name in active:
                given[name] = left * weights[name] / total_weight
            break
        for name in capped:
            given[name] = needs[name]
            left -= needs[name]
        active -= capped
    return given


def effective_rates(
    quotas: Mapping[str, TenantQuota],
    demand_tokens_per_s: Mapping[str, float],
    level: int,
    level_factors: tuple[float, ...] = DEFAULT_LEVEL_FACTORS,
    lend_at_levels: Set[int] = DEFAULT_LEND_AT_LEVELS,
) -> dict[str, float]:
    """Each tenant's effective global rate (tokens/s) for this control tick.

    1. **Base.** A tenant's own rate; a sheddable tenant's × ``level_factors[level]``
       (non-sheddable tenants keep theirs: shedding them is admission's call,
       by criticality, not the quota's).
    2. **Borrowing**, only when ``level in lend_at_levels``. Each tenant's unused
       rate (base − demand, where positive) goes into a pool; tenants whose
       demand exceeds their base borrow from it in proportion to their
       weights, each capped at what it needs (water-filling, see
       ``_water_fill``). Under degradation nothing is lent: the service is
       already short, and idle rate is then better left unspent.
    3. **Lenders give up what was lent.** A lender's rate drops by its part of
       what was actually lent (pro rata to what it put in), never below its
       own demand. That is what keeps the invariant: **borrowing never pushes
       the sum of effective rates above the sum of base rates** (hence of own
       rates), so lending adds no overcommit beyond what the quotas already
       sell. An idle lender may thus get 0 this tick; it still admits a
       first request from the burst its routers' buckets hold (``set_rate``
       keeps the level), and the next tick sees its demand and gives its own
       rate back — lent rate is always reclaimable.

    ``demand_tokens_per_s`` is each tenant's demand summed over routers
    (attempted, refused included, or a borrower could never show it needs
    more). A tenant missing from it has demand 0; entries for tenants not in
    ``quotas`` (e.g. removed by a config reload, still in the window) are
    ignored. The sum of own rates may exceed capacity (overcommit, see the
    module docstring). Pure.
    """
    _check_rate_inputs(quotas, demand_tokens_per_s, level, level_factors)
    factor = level_factors[level]
    base = {name: q.rate_tokens_per_s * (factor if q.sheddable else 1.0) for name, q in quotas.items()}
    if level not in lend_at_levels:
        return base
    return _lend(quotas, base, {name: float(demand_tokens_per_s.get(name, 0.0)) for name in quotas})


def _check_rate_inputs(
    quotas: Mapping[str, TenantQuota],
    demand_tokens_per_s: Mapping[str, float],
    level: int,
    level_factors: tuple[float, ...],
) -> None:
    if not isinstance(level_factors, tuple) or not level_factors:
        raise ValueError(f"level_factors: must be a non-empty tuple, got {level_factors!r}")
    for i, factor in enumerate(level_factors):
        if not is_number(factor) or not 0 <= factor <= 1:
            raise ValueError(f"level_factors: entry {i} must be in [0, 1], got {factor!r}")
    if not is_int(level) or not 0 <= level < len(level_factors):
        raise ValueError(f"level: must be an int in [0, {len(level_factors) - 1}], got {level!r}")
    for name, quota in quotas.items():
        if not isinstance(quota, TenantQuota):
            raise ValueError(f"quotas: entry {name!r} must be a TenantQuota, got {quota!r}")
    for name, demand in demand_tokens_per_s.items():
        check_non_negative(f"demand_tokens_per_s[{name!r}]", demand)


def _lend(quotas: Mapping[str, TenantQuota], base: dict[str, float], demand: dict[str, float]) -> dict[str, float]:
    """Steps 2 and 3 of ``effective_rates``: unused base rate lent to those short of it, by weight."""
    unused = {name: max(0.0, base[name] - demand[name]) for name in quotas}
    needs = {name: max(0.0, demand[name] - base[name]) for name in quotas}
    pool = sum(unused.values())
    if pool <= 0 or not any(needs.values()):
        return base
    borrowed = _water_fill(pool, needs, {name: q.weight for name, q in quotas.items()})
    lent = min(pool, sum(borrowed.values()))
    rates: dict[str, float] = {}
    for name in quotas:
        if unused[name] > 0:
            # All lent: exactly the demand (no float residue from lent/pool).
            rates[name] = demand[name] if lent >= pool else base[name] - unused[name] * (lent / pool)
        else:
            rates[name] = base[name] + borrowed[name]
    return rates


# --------------------------------------------------------------------------- leases


@dataclass(frozen=True)
class RateLease:
    """A router's share of one tenant's rate, granted by the controller until ``expires_at_s``.

    ``expires_at_s`` is on the *router's* clock: monotonic clocks of different
    processes are unrelated, so the router stamps it on receipt
    (its now + the lease TTL), never copies the controller's time.
    """

    tenant: str
    rate_tokens_per_s: float
    burst_tokens: float
    expires_at_s: float

    def __post_init__(self) -> None:
        check_fields(self, check_name, "tenant")
        check_fields(self, check_non_negative, "rate_tokens_per_s")
        check_fields(self, check_positive, "burst_tokens")
        check_fields(self, check_finite, "expires_at_s")


def lease_rate(
    lease: RateLease | None,
    now_s: float,
    tenant_rate: float,
    tenant_burst: float,
    n_routers: int,
) -> tuple[float, float, str]:
    """(rate_tokens_per_s, burst_tokens, source) a router should enforce for one tenant.

    The lease while ``now_s < expires_at_s`` (source ``"lease"``); from the
    expiry instant on, or with no lease, the *safe share*: 1/N of the tenant's
    own rate and burst (source ``"safe-share"``). N routers each at 1/N can
    never admit more than the tenant's quota in total, whatever the
    controller is doing; the cost is that a tenant concentrated on one router
    is held to 1/N there until a lease arrives. ``n_routers < 1`` (not yet
    known) counts as 1.
    """
    check_finite("now_s", now_s)
    check_non_negative("tenant_rate", tenant_rate)
    check_positive("tenant_burst", tenant_burst)
    if not is_int(n_routers):
        raise ValueError(f"n_routers: must be an int, got {n_routers!r}")
    if lease is not None and now_s < lease.expires_at_s:
        return lease.rate_tokens_per_s, lease.burst_tokens, LEASE_SOURCE
    n = max(1, n_routers)
    return tenant_rate / n, tenant_burst / n, SAFE_SHARE_SOURCE
