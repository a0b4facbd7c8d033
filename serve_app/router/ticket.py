"""The admission ticket: everything one admitted request holds, given back exactly once.

A request that passes admission takes, in this order: one of its tenant's in-flight
places (the tenant's concurrency cap), a charge on its tenant's token bucket (the
estimate: prompt + max_tokens), and a slot at the gate. Each must be given back once
whatever happens next: an answer, a refusal further down the path, a deadline, an
error, a client that leaves mid-stream, or a streaming response whose generator
never starts. ``Ticket`` holds all three and settles them in ``finish``; a second
call does nothing, and a ticket collected unfinished settles as ``CANCELLED``.
(The model is Netflix concurrency-limits' ``Listener``: onSuccess / onIgnore /
onDropped, exactly one of them, exactly once.)

Settling means: the tenant's place back, the quota settled for the tokens actually
used (a refund of the estimate, or an extra charge past it), the gate slot back with
the service-time sample the gate learns from, and the outcome counted.

The tenant's place is taken *before* the gate wait, so a tenant cannot pass its cap
with requests that are still waiting in the gate's line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from policies.deadline import Deadline
from policies.quota import TokenBucket
from serve_app.router.gate import GateSlot


@dataclass(frozen=True)
class Outcome:
    """How a ticket ends.

    ``code``: "OK", "CANCELLED" or a Ballast error code. ``model_called``: the request
    reached the model path (its outcome counts in the router's request stats and
    latency); refusals before it do not. ``error``: the outcome counts for the level.
    ``generated``: tokens produced (None: no model work, e.g. a refusal or a replay).
    ``service_s``: the time the gate slot was held, as a service sample (None: none).
    ``timed_out``: the model could not answer in time (a gate miss).
    """

    code: str
    model_called: bool = True
    error: bool = False
    generated: Optional[int] = None
    service_s: Optional[float] = None
    timed_out: bool = False


class Ticket:
    """One admitted request's tenant place, quota charge and gate slot."""

    def __init__(
        self,
        tenant: str,
        criticality: str,
        deadline: Deadline,
        inflight: dict[str, int],
        on_finish: Callable[["Ticket", Outcome], None],
    ) -> None:
        self.tenant = tenant
        self.criticality = criticality
        self.deadline = deadline
        self.bucket: Optional[TokenBucket] = None
        self.cost = 0  # tokens charged on the bucket (the estimate)
        self.prompt_tokens = 0
        self.slot = GateSlot(None)
        self.fallback_only = False  # only the fallback model may answer (the level or gate refused the primary)
        self.outcome: Optional[Outcome] = None
        self._inflight = inflight
        self._on_finish = on_finish
        inflight[tenant] = inflight.get(tenant, 0) + 1

    def charge(self, bucket: Optional[TokenBucket], cost: int, prompt_tokens: int) -> bool:
        """Charge the estimate; False (nothing charged) when the bucket cannot cover it now."""
        self.prompt_tokens = prompt_tokens
        if bucket is None:
            return True
        if not bucket.try_charge(cost):
            return False
        self.bucket, self.cost = bucket, cost
        return True

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def finish(self, outcome: Outcome) -> bool:
        """Settle everything the ticket holds; True the first time, False (nothing done) after."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self._inflight[self.tenant] = max(0, self._inflight.get(self.tenant, 0) - 1)
        if self.bucket is not None:
            used = 0 if outcome.generated is None else self.prompt_tokens + outcome.generated
            if used < self.cost:
                self.bucket.refund(self.cost - used)
            elif used > self.cost:
                self.bucket.charge_extra(used - self.cost)
        self._on_finish(self, outcome)  # first: the gate learns from the sample before the slot frees
        self.slot.release(outcome.service_s)
        return True

    def refuse(self, code: str) -> None:
        """A refusal after the ticket was taken (quota, gate): everything back, nothing used."""
        self.finish(Outcome(code, model_called=False))

    def __del__(self) -> None:
        # A streaming response whose generator never started (the client left first)
        # still gives its place, quota and slot back.
        if getattr(self, "outcome", True) is None:
            self.finish(Outcome("CANCELLED"))

    def __repr__(self) -> str:
        state: Any = self.outcome.code if self.outcome else "open"
        return f"Ticket({self.tenant}, {self.criticality}, {state})"
