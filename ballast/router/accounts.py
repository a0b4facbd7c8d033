"""What a router counts of the requests it settles: one object, held by every ticket.

``Accounts.settled(ticket, outcome)`` is the one place a request's outcome is counted,
exactly once per ticket (``Ticket.finish`` calls it, before the gate slot is freed so
that the gate learns from the sample first):

* the gate's service sample: a timed-out call is a miss of at least its wait (counting
  only answered requests would hide the overload from the gate); an answered one is a
  service time against the request's budget; a call the fallback alone answered is
  neither (the gate guards the primary);
* the tokens used (prompt + generated) and the fair-share service, by tenant;
* the request under its code, its latency, and the level's tally (requests, errors).

Refusals before a ticket exists (``refused``) and waits for the model (``waited``) are
counted here too, so the metrics and the tally have one writer on the request path.

A ticket holds its request's ``Accounts``; what ``settled`` reads of the ticket is
:class:`Admitted`, and how it ended is an :class:`Outcome`, both defined here, so this
module does not import the ticket's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ballast.policies.deadline import Deadline
from ballast.router.metrics import RouterMetrics
from ballast.router.tally import Tally

if TYPE_CHECKING:
    from ballast.router.gate import PriorityGate


@dataclass(frozen=True)
class Outcome:
    """How a ticket ends.

    ``code``: "OK", "CANCELLED" or a Ballast error code. ``error``: the outcome counts
    for the level. ``generated``: tokens produced (None: no model work, e.g. a replay).
    ``service_s``: the time the gate slot was held, as a service sample (None: none).
    ``timed_out``: the model could not answer in time (a gate miss).
    """

    code: str
    error: bool = False
    generated: int | None = None
    service_s: float | None = None
    timed_out: bool = False


class Admitted(Protocol):
    """What ``Accounts.settled`` reads of an admitted request (``ticket.Ticket``)."""

    @property
    def tenant(self) -> str: ...

    @property
    def criticality(self) -> str: ...

    @property
    def deadline(self) -> Deadline: ...

    @property
    def fallback_only(self) -> bool:
        """Only the fallback may answer it: its service is no sample for the gate."""
        ...

    @property
    def prompt_tokens(self) -> int: ...


class Accounts:
    """The request path's counters: metrics, the level's tally, the gate's samples."""

    def __init__(
        self,
        cfg: Any,
        gate: PriorityGate | None,
        metrics: RouterMetrics,
        tally: Tally,
        clock: Callable[[], float] = time.monotonic,
        model: str | None = None,
    ) -> None:
        """The counters of the requests to model ``model`` (None: the config's first)."""
        self.model = model if model is not None else cfg.models[0].name
        self._tenants = cfg.tenants
        self._fair_cost = cfg.fairness.policy_config()  # the counters' cost rule, for the served metric
        self._gate = gate
        self.metrics = metrics
        self.tally = tally
        self._clock = clock

    def settled(self, ticket: Admitted, outcome: Outcome) -> None:
        """A ticket's outcome, once: the gate's service sample, tokens and the request counted."""
        if self._gate is not None and not ticket.fallback_only and outcome.service_s is not None:
            if outcome.timed_out:
                self._gate.observe_miss(outcome.service_s * 1000.0)
            elif outcome.generated is not None:
                self._gate.observe_service(outcome.service_s, ticket.deadline.gate_budget_s, outcome.generated)
        if outcome.generated is not None:
            self._tokens(ticket.tenant, ticket.prompt_tokens, outcome.generated)
        self.tally.requests += 1
        if outcome.code == "DEADLINE_EXCEEDED":
            self.metrics.deadline.inc()
        if outcome.error:
            self.tally.errors += 1
        self.answered(ticket.tenant, ticket.criticality, outcome.code, ticket.deadline.started_s)

    def _tokens(self, tenant: str, prompt_tokens: int, generated: int) -> None:
        used = prompt_tokens + generated
        if used:
            self.metrics.tenant_tokens.inc(used, tags={"tenant": tenant, "model": self.model})
        served = self._fair_cost.cost(prompt_tokens, generated, self._tenants[tenant].weight)
        if served:
            self.metrics.fair_served.inc(served, tags={"tenant": tenant})

    def answered(self, tenant: str, criticality: str, code: str, started_s: float) -> None:
        """A request that ends here under ``code`` (a ticket's, or an Idempotency-Key's
        repeat that took none), with its latency from ``started_s``."""
        self.refused(tenant, criticality, code)
        self.metrics.latency.observe(
            (self._clock() - started_s) * 1000.0, tags={"criticality": criticality, "model": self.model}
        )

    def refused(self, tenant: str, criticality: str, code: str) -> None:
        """A request counted under ``code`` (a refusal before any ticket: no latency)."""
        self.metrics.requests.inc(
            tags={"tenant": tenant, "criticality": criticality, "code": code, "model": self.model}
        )

    def waited(self, wait_ms: float, primary: bool) -> None:
        """A wait for the model: for the controller's report, and (primary only) the gate's
        limit; a stall of the host or the engine in it (the gate's ``stalls``) taken out."""
        if self._gate is not None:
            wait_ms = self._gate.not_stalled_ms(wait_ms)
        self.tally.add_wait(wait_ms)
        if self._gate is not None and primary:
            self._gate.observe_wait(wait_ms)
