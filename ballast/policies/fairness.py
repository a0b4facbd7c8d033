"""Fair shares inside a criticality class: virtual token counters (VTC).

Quotas cap what each tenant may spend; under overload the tenants within their quotas
still compete for the model. Among requests of the same class waiting at a router's
gate, the one to go next is the oldest request of the tenant with the lowest counter
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). Strict class
order stays above it: the gate only picks among waiters of the most critical class
that has any.

The procedure, per tenant ``t`` with ``weight[t]`` (its config's ``weight``):

- **Charge.** When a request of ``t`` gets its slot, ``counter[t]`` grows by its cost,
  ``(input_weight x prompt tokens + output_weight x max_tokens) / weight[t]``. When it
  ends, the output part is corrected to the tokens really generated (``settle``). The
  upfront output charge keeps a tenant whose long answers are still running from
  looking served-for-free meanwhile.
- **Lift.** When ``t`` becomes backlogged (its first waiter, none before), its counter
  is raised to the lowest counter among the tenants backlogged then; with none, to the
  counter of the last tenant to leave the backlog. Time spent idle earns no credit, so
  a tenant that returns after a quiet hour does not take the model until it has caught
  up.
- **Pick.** ``pick(candidates)``: the candidate with the lowest counter; ties to the
  first given (the gate passes them oldest first).

Work-conserving by construction: the counters only order waiters, so a lone tenant
still gets every free slot.

**Shared across routers.** A counter here is ``base[t] + local[t]``: ``base`` is the
cluster-wide counter the controller last handed back, ``local`` what this router
charged since. ``take_report()`` gives what was charged since the last report and
``adopt(cluster)`` takes the controller's merged counters, which include every
reported charge; only what was charged after the report was taken stays local. With no
cluster counters (the controller is away), base stays as it was and every router
orders by its own view: fail-static. A report lost on the way loses its interval's
charges from the cluster view; a tenant lifted at two routers at once is lifted twice
for one report interval.

Ordering a router's own line cannot share the model among tenants that wait at
different routers: with skewed ingress each router sees one tenant, and an even split
of the model's slots among routers is a split among those tenants whatever their
weights. So the controller also apportions the slots (``router_shares``): each router
gets a share in proportion to the fair weight of the tenants waiting at it,
``weight[t] x exp(-(counter[t] - lowest counter waiting) / lag_tokens)``. A tenant ahead
of the others loses share smoothly until its counter grows no faster than theirs, per
unit of weight; that is the fair split, whatever its requests cost.

**Served per second.** What each tenant was served (its settled charges, weighted as
the counters weigh them) over the last ``SERVED_WINDOW_S``, for ``ballast tenants``.

Bounded: one entry per configured tenant (``weights``); an unknown tenant is refused;
the served window holds ``SERVED_WINDOW_S`` one-second buckets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ballast.policies.validation import check_finite
from ballast.policies.window import TimeWindow

SERVED_WINDOW_S = 30  # one-second buckets


@dataclass(frozen=True)
class FairnessConfig:
    enabled: bool = True
    input_weight: float = 1.0
    output_weight: float = 2.0  # an output token costs a decode step; VTC's own default

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight"):
            value = getattr(self, name)
            check_finite(name, value)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("input_weight and output_weight cannot both be 0")

    def cost(self, prompt_tokens: int, output_tokens: int, weight: float) -> float:
        """What serving these tokens adds to a counter of ``weight``."""
        return (self.input_weight * max(0, prompt_tokens) + self.output_weight * max(0, output_tokens)) / weight


@dataclass(frozen=True)
class FairCharge:
    """What one admitted request added to its tenant's counter (to correct at its end)."""

    tenant: str
    amount: float  # what was added to the counter
    output_tokens: int  # the output tokens in it (max_tokens), to correct at the end


class TenantCounters:
    """Virtual token counters for a fixed set of tenants (see the module docstring)."""

    def __init__(
        self,
        weights: Mapping[str, float],
        cfg: FairnessConfig = FairnessConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for tenant, w in weights.items():
            check_finite(f"weight of {tenant!r}", w)
            if w <= 0:
                raise ValueError(f"weight of {tenant!r} must be > 0, got {w!r}")
        self.cfg = cfg
        self._weights = dict(weights)
        self._base: dict[str, float] = dict.fromkeys(weights, 0.0)
        self._local: dict[str, float] = dict.fromkeys(weights, 0.0)
        self._unreported: dict[str, float] = dict.fromkeys(weights, 0.0)
        self._backlogged: set[str] = set()
        self._last_left = 0.0  # counter of the last tenant to leave the backlog
        self.shared = False  # whether base came from cluster counters (else: this router's own view)
        self._clock = clock
        self._order = list(self._weights)  # the served window's fields
        self._served = TimeWindow(1.0, SERVED_WINDOW_S, max(1, len(self._order)))

    # -- reading -------------------------------------------------------------------------
    def counter(self, tenant: str) -> float:
        self._check(tenant)
        return self._base[tenant] + self._local[tenant]

    def counters(self) -> dict[str, float]:
        return {t: self._base[t] + self._local[t] for t in self._weights}

    def view(self) -> dict[str, object]:
        """For status: whose counters order the line, each tenant's counter, who waits."""
        return {
            "view": "cluster" if self.shared else "router",
            "counters": {t: round(v, 1) for t, v in self.counters().items()},
            "served_per_s": {t: round(v, 1) for t, v in self.served_per_s().items()},
            "backlogged": sorted(self._backlogged),
        }

    def pick(self, candidates: Iterable[str]) -> str | None:
        """The candidate with the lowest counter; the first given among equals."""
        best, best_c = None, 0.0
        for t in candidates:
            c = self.counter(t)
            if best is None or c < best_c:
                best, best_c = t, c
        return best

    # -- the backlog ---------------------------------------------------------------------
    def backlogged(self, tenant: str) -> None:
        """``tenant`` has a waiter and had none: lift its counter (no credit for idling)."""
        self._check(tenant)
        if tenant in self._backlogged:
            return
        floor = min((self.counter(t) for t in self._backlogged), default=self._last_left)
        lift = floor - self.counter(tenant)
        if lift > 0:
            self._add(tenant, lift)
        self._backlogged.add(tenant)

    def drained(self, tenant: str) -> None:
        """``tenant``'s last waiter left the line (granted, refused or gone)."""
        if tenant in self._backlogged:
            self._backlogged.discard(tenant)
            self._last_left = self.counter(tenant)

    def is_backlogged(self, tenant: str) -> bool:
        return tenant in self._backlogged

    def backlog(self) -> tuple[str, ...]:
        """The tenants waiting now, sorted."""
        return tuple(sorted(self._backlogged))

    # -- charging ------------------------------------------------------------------------
    def charge(self, tenant: str, prompt_tokens: int, max_tokens: int) -> FairCharge:
        """A request of ``tenant`` got its slot: its prompt and its max_tokens, weighted."""
        self._check(tenant)
        amount = self.cfg.cost(prompt_tokens, max_tokens, self._weights[tenant])
        self._add(tenant, amount)
        return FairCharge(tenant, amount, max(0, max_tokens))

    def settle(self, charge: FairCharge, generated: int | None) -> None:
        """The request ended with ``generated`` output tokens (None: unknown, keep the charge)."""
        served = charge.amount
        if generated is not None:
            unused = charge.output_tokens - max(0, generated)
            if unused:
                refund = self.cfg.cost(0, unused, self._weights[charge.tenant])
                self._add(charge.tenant, -refund)
                served -= refund
        sample = [0.0] * len(self._order)
        sample[self._order.index(charge.tenant)] = served
        self._served.add(tuple(sample), self._clock())

    def served_per_s(self) -> dict[str, float]:
        """Each tenant's settled service per second over the last ``SERVED_WINDOW_S``."""
        totals = self._served.totals(self._clock()) if self._order else ()
        return {t: v / SERVED_WINDOW_S for t, v in zip(self._order, totals)}

    def refund(self, charge: FairCharge) -> None:
        """The slot was never used (its client left as it was granted): no service given."""
        self._add(charge.tenant, -charge.amount)

    # -- sharing -------------------------------------------------------------------------
    def take_report(self) -> dict[str, float]:
        """What this router charged since the last report (lifts included), per tenant; reset."""
        out = {t: v for t, v in self._unreported.items() if v}
        self._unreported = dict.fromkeys(self._weights, 0.0)
        return out

    def adopt(self, cluster: Mapping[str, float] | None) -> None:
        """The controller's merged counters, which hold every report up to this router's
        last one. None (the controller is away): keep ordering by this router's view."""
        if cluster is None:
            self.shared = False
            return
        for t in self._weights:
            self._base[t] = float(cluster.get(t, 0.0))
            self._local[t] = self._unreported[t]  # charged since the report the cluster holds
        self.shared = True

    # -- internals -----------------------------------------------------------------------
    def _add(self, tenant: str, amount: float) -> None:
        self._local[tenant] += amount
        self._unreported[tenant] += amount

    def _check(self, tenant: str) -> None:
        if tenant not in self._weights:
            raise KeyError(f"unknown tenant {tenant!r}")


def router_shares(
    backlogs: Mapping[str, Iterable[str]],
    counters: Mapping[str, float],
    weights: Mapping[str, float],
    lag_tokens: float,
    floor_ratio: float,
) -> dict[str, float]:
    """Each router's share of the model's slots (summing to 1), by the tenants waiting at it.

    ``backlogs``: router -> tenants waiting at its gate. Every router gets
    ``floor_ratio / n`` (so one with nobody waiting can still admit an arrival); the rest
    goes by the fair weight of the tenants waiting at each router (see the module
    docstring), a tenant waiting at several routers split evenly among them. With nobody
    waiting anywhere, {}: the caller keeps its even split.
    """
    check_finite("lag_tokens", lag_tokens)
    if lag_tokens <= 0:
        raise ValueError(f"lag_tokens must be > 0, got {lag_tokens!r}")
    if not 0 <= floor_ratio < 1:
        raise ValueError(f"floor_ratio must be in [0, 1), got {floor_ratio!r}")
    where: dict[str, list[str]] = {}
    for router, tenants in backlogs.items():
        for t in set(tenants):
            if t in weights:
                where.setdefault(t, []).append(router)
    if not where or not backlogs:
        return {}
    lowest = min(counters.get(t, 0.0) for t in where)
    fair = {router: 0.0 for router in backlogs}
    for t, routers in where.items():
        lead = max(0.0, counters.get(t, 0.0) - lowest)
        phi = weights[t] * math.exp(-min(lead / lag_tokens, 50.0))
        for router in routers:
            fair[router] += phi / len(routers)
    total = sum(fair.values())
    n = len(backlogs)
    return {router: floor_ratio / n + (1.0 - floor_ratio) * fair[router] / total for router in backlogs}


def merge_reports(counters: Mapping[str, float], reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Cluster counters: ``counters`` plus every router's reported charges."""
    out = dict(counters)
    for report in reports:
        for t, v in report.items():
            out[t] = out.get(t, 0.0) + float(v)
    return out


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index of ``values`` (1.0: all equal; 1/n: one takes all); 1.0 when empty."""
    xs = [float(v) for v in values]
    if not xs:
        return 1.0
    total, squares = sum(xs), sum(x * x for x in xs)
    return 1.0 if squares == 0 else total * total / (len(xs) * squares)
