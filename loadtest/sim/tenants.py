"""Tenants in the simulated fleet: routers' gates in fair-share order, on the production policy.

With ``SimConfig.tenancy`` set, the fleet's one FIFO gives way to ``TenantLines``: one
line per (router, class, tenant), each a ``fleet.RequestQueue``, ordered by
``ballast.policies.fairness`` itself (``TenantCounters`` per router; ``merge_reports``
and ``router_shares`` for the controller), not a copy of it. A tick:

1. **Arrivals.** Each class's admitted requests are drawn among the (tenant, router)
   pairs, a tenant's share split evenly among its routers (one multinomial per tick,
   from a generator seeded apart from the arrivals). A tenant with no waiter at a router
   that now has one becomes backlogged there (``TenantCounters.backlogged``).
2. **Router budgets.** What the fleet can start this tick is split among the routers:
   by the shares the controller computed at the last control tick when the counters are
   shared and someone waits, evenly otherwise. A router's budget is its ceiling: what it
   leaves unused is not lent to another router, as a gate's ceiling is not
   (``ballast.policies.engines.model_ceiling``).
3. **Grants.** Each router grants in quanta of ``ceil(budget / grants_per_router)``:
   the most critical class with waiters (class order stays above tenant order); in it,
   the tenant ``TenantCounters.pick`` chooses among those waiting, passed oldest head
   first (fairness off: the oldest head). The quantum starts at the position the
   router's tick has reached, at the router's share of the fleet's rate
   (``RequestQueue.serve(start=…)``), so waits and the SLO share stay the fluid's. A
   line emptied takes its tenant out of the backlog before the charge, as the gate does.
4. **Control tick** (``control``), counters shared: every router's ``take_report`` is
   merged into the cluster counters (``merge_reports``), every router ``adopt``s them,
   and the next tick's router shares come from ``router_shares`` over who waits where.
   Not shared: each router orders by its own counters and takes an even split.

**Model, and what it leaves out:**

* a request's service time does not depend on its tokens (``model.ServiceModel`` is
  per request), so the fleet starts as many requests whichever tenant sends them; the
  counters charge tokens, so the split they make is one of weighted tokens;
* every request generates exactly its tenant's ``output_tokens`` (its max_tokens), so
  ``settle`` corrects nothing: it is called at once, and only feeds the served window;
* the order is exact to one quantum a tick: a tenant may be granted up to one quantum
  more than the counters would give it request by request;
* the gate's own refusals (expired, displaced, a full line) are not modelled: a waiter
  leaves when it starts or when its client gives up (``SimConfig.timeout_s``);
* the controller hears every router at each control tick, all at once: no report is
  lost or late, and each router adopts the same merged counters;
* admission (shedding by class) comes before the draw among tenants, and a crash's lost
  requests are taken back per class (``engine``): a tenant's counts are what it was
  admitted and what started.

Bounded: routers × 4 × tenants lines, each bounded as a ``RequestQueue``; a router makes
at most ``grants_per_router`` grants a tick plus one per line it empties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ballast.policies.fairness import TenantCounters, merge_reports, router_shares

from .config import TenancyConfig, TenantSpec
from .fleet import RequestQueue, Served


@dataclass(frozen=True)
class TenantStats:
    tenant: str
    weight: float
    admitted: int
    served: int
    served_in_slo: float
    timed_out: int
    queued: int
    prompt_tokens: int
    output_tokens: int
    #: Served as the counters weigh it: ``FairnessConfig.cost`` of its tokens, over its weight.
    service: float
    #: Ticks it ended with a waiter at some router.
    backlogged_ticks: int


def apportion(n: int, shares: Sequence[float]) -> list[int]:
    """``n`` split in proportion to ``shares`` (> 0 in sum); largest remainder, ties by index."""
    total = sum(shares)
    ideal = [n * s / total for s in shares]
    out = [int(x) for x in ideal]
    order = sorted(range(len(shares)), key=lambda i: (out[i] - ideal[i], i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


@dataclass
class _Tally:
    admitted: int = 0
    served: int = 0
    served_in_slo: float = 0.0
    timed_out: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    service: float = 0.0
    backlogged_ticks: int = 0


class TenantLines:
    """The routers' lines and counters; see the module docstring. The engine uses it as it
    uses the one FIFO (``push``, ``expire``, ``startable``, ``serve``), plus ``control``."""

    def __init__(self, ten: TenancyConfig, lag_tokens: float, seed: int) -> None:
        self.spec = ten
        self.lag_tokens = lag_tokens
        self._tenants: dict[str, TenantSpec] = {t.name: t for t in ten.tenants}
        self.weights = {t.name: t.weight for t in ten.tenants}
        self._streams = [(t.name, r) for t in ten.tenants for r in t.routers]
        total = sum(t.arrival_share for t in ten.tenants)
        self._p = [t.arrival_share / total / len(t.routers) for t in ten.tenants for _ in t.routers]
        self._rng = np.random.default_rng([seed, 2])
        self._now_s = 0.0
        self.counters: list[TenantCounters] | None = None
        if ten.enabled:
            self.counters = [
                TenantCounters(self.weights, ten.fairness, clock=lambda: self._now_s) for _ in range(ten.routers)
            ]
        self._lines = [[{t: RequestQueue() for t in self._tenants} for _ in range(4)] for _ in range(ten.routers)]
        self._waiting = [dict.fromkeys(self._tenants, 0) for _ in range(ten.routers)]
        self.total = 0
        self.cluster = dict.fromkeys(self._tenants, 0.0)  # the controller's merged counters
        self.shares: list[float] | None = None  # per router, from the last control tick
        self._tally = {t: _Tally() for t in self._tenants}

    def __len__(self) -> int:
        return self.total

    # -- the one FIFO's face --------------------------------------------------------------
    def push(self, counts: list[int], t0_s: float, span_s: float) -> None:
        """1. The tick's admitted requests, per class, drawn among (tenant, router)."""
        if not sum(counts):
            return
        drawn = self._rng.multinomial(counts, self._p).tolist()  # [class][stream]
        for rank, row in enumerate(drawn):
            for (tenant, r), n in zip(self._streams, row):
                if n:
                    self.arrive(tenant, r, rank, n, t0_s, span_s)

    def arrive(self, tenant: str, router: int, rank: int, n: int, t0_s: float, span_s: float) -> None:
        """``n`` requests of ``tenant`` in class ``rank`` join their line at ``router``."""
        one = [0, 0, 0, 0]
        one[rank] = n
        self._lines[router][rank][tenant].push(one, t0_s, span_s)
        self._tally[tenant].admitted += n
        self._add_waiting(router, tenant, n)

    def expire(self, cutoff_s: float) -> list[int]:
        """Drop requests that arrived before ``cutoff_s``; their per-class counts."""
        out = [0, 0, 0, 0]
        for r, ranks in enumerate(self._lines):
            for rank, line in enumerate(ranks):
                for tenant, q in line.items():
                    gone = q.expire(cutoff_s)[rank] if q.total else 0
                    if gone:
                        out[rank] += gone
                        self._tally[tenant].timed_out += gone
                        self._add_waiting(r, tenant, -gone)
        return out

    def startable(self, capacity: int) -> int:
        """How many ``serve(…, capacity, …)`` would start now: each router's budget or its waiters."""
        return sum(min(b, sum(w.values())) for b, w in zip(self._budgets(capacity), self._waiting))

    def serve(self, now_s: float, capacity: int, rate_per_s: float, wait_budget_s: float) -> Served:
        """2–3. Split ``capacity`` among the routers; each grants its budget in fair order."""
        self._now_s = now_s
        out = Served([0, 0, 0, 0], [0.0, 0.0, 0.0, 0.0], [])
        for r, budget in enumerate(self._budgets(capacity)):
            if budget > 0:
                self._serve_router(r, now_s, budget, rate_per_s * budget / capacity, wait_budget_s, out)
        for tenant, tally in self._tally.items():
            if any(w[tenant] for w in self._waiting):
                tally.backlogged_ticks += 1
        return out

    def per_class(self) -> list[int]:
        out = [0, 0, 0, 0]
        for ranks in self._lines:
            for rank, line in enumerate(ranks):
                out[rank] += sum(q.total for q in line.values())
        return out

    def head_wait_s(self, now_s: float) -> float:
        return max(q.head_wait_s(now_s) for ranks in self._lines for line in ranks for q in line.values())

    # -- the controller -------------------------------------------------------------------
    def control(self) -> None:
        """4. Shared counters: merge every router's report, hand the sum back, apportion."""
        if self.counters is None or not self.spec.shared:
            return
        self.cluster = merge_reports(self.cluster, [c.take_report() for c in self.counters])
        for c in self.counters:
            c.adopt(self.cluster)
        backlogs = {str(r): c.backlog() for r, c in enumerate(self.counters)}
        shares = router_shares(backlogs, self.cluster, self.weights, self.lag_tokens, self.spec.router_floor_ratio)
        self.shares = [shares[str(r)] for r in range(self.spec.routers)] if shares else None

    def stats(self) -> tuple[TenantStats, ...]:
        queued = {t: sum(w[t] for w in self._waiting) for t in self._tenants}
        return tuple(
            TenantStats(tenant=t, weight=spec.weight, queued=queued[t], **vars(self._tally[t]))
            for t, spec in self._tenants.items()
        )

    # -- internals ------------------------------------------------------------------------
    def _budgets(self, capacity: int) -> list[int]:
        n = self.spec.routers
        return apportion(capacity, self.shares if self.shares is not None else [1.0] * n)

    def _serve_router(
        self, r: int, now_s: float, budget: int, rate_per_s: float, wait_budget_s: float, out: Served
    ) -> None:
        quantum = math.ceil(budget / self.spec.grants_per_router)
        pos = 0  # starts this router made this tick
        while pos < budget:
            nxt = self._next(r)
            if nxt is None:
                break
            rank, tenant = nxt
            got = self._lines[r][rank][tenant].serve(
                now_s, min(quantum, budget - pos), rate_per_s, wait_budget_s, start=pos
            )
            n = sum(got.counts)
            pos += n
            self._add_waiting(r, tenant, -n)  # first: a tenant leaving the backlog is not lifted by its own charge
            self._account(r, tenant, n, got, out)

    def _next(self, r: int) -> tuple[int, str] | None:
        """(class, tenant) of router ``r``'s next grant: the most critical class with waiters,
        the tenant the counters pick among those waiting in it (off: the oldest head)."""
        for rank, line in enumerate(self._lines[r]):
            heads = sorted((q.head_arrival_s(), i, t) for i, (t, q) in enumerate(line.items()) if q.total)
            if heads:
                oldest_first = [t for _, _, t in heads]
                return rank, oldest_first[0] if self.counters is None else self.counters[r].pick(oldest_first)
        return None

    def _account(self, r: int, tenant: str, n: int, got: Served, out: Served) -> None:
        spec = self._tenants[tenant]
        prompt, output = n * spec.prompt_tokens, n * spec.output_tokens
        if self.counters is not None:
            c = self.counters[r]
            # The cost is linear in the tokens, so one charge of n x a request's tokens adds
            # exactly what n charges would; every request generates its max_tokens.
            c.settle(c.charge(tenant, prompt, output), output)
        tally = self._tally[tenant]
        tally.served += n
        tally.served_in_slo += sum(got.in_slo)
        tally.prompt_tokens += prompt
        tally.output_tokens += output
        tally.service += self.spec.fairness.cost(prompt, output, spec.weight)
        for i in range(4):
            out.counts[i] += got.counts[i]
            out.in_slo[i] += got.in_slo[i]
        out.chunks.extend(got.chunks)

    def _add_waiting(self, r: int, tenant: str, n: int) -> None:
        before = self._waiting[r][tenant]
        after = self._waiting[r][tenant] = before + n
        self.total += n
        if self.counters is not None:
            if before == 0 < after:
                self.counters[r].backlogged(tenant)
            elif after == 0 < before:
                self.counters[r].drained(tenant)
