"""The admission ticket: everything one admitted request holds, given back exactly once.

A request that passes admission holds three things, taken in this order by
``Pipeline.acquire`` (pipeline.py): one of its tenant's in-flight places
(``TenantPlaces``: the tenant's concurrency cap), a charge on its tenant's token
bucket (``Charge``: the estimate, prompt + max_tokens) and a slot at the gate
(``GateSlot``). The acquisition returns a whole ``Ticket`` or a refusal; a refusal
part way gives back what was already taken before it is raised, so no ticket is ever
half built.

``Ticket.finish`` settles all three exactly once; a second call does nothing. The
caller settles it in a ``finally`` (a unary answer) or in the stream's ``aclose``
(pipeline.py's ``Stream``, closed by the response whether it was sent whole, cut, or
never begun); nothing waits for garbage collection. (The model is Netflix
concurrency-limits' ``Limiter.acquire`` returning a ``Listener``: onSuccess / onIgnore
/ onDropped, exactly one of them, exactly once.)

Settling means: the tenant's place back, the quota settled for the tokens actually
used (a refund of the estimate, or an extra charge past it), the outcome counted (the
gate learns its service sample there), then the gate slot back.

The tenant's place is taken *before* the gate wait, so a tenant cannot pass its cap
with requests that are still waiting in the gate's line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ballast.policies.deadline import Deadline
from ballast.policies.quota import TokenBucket
from ballast.router.accounts import Accounts, Outcome
from ballast.router.gate import BatchSlot, GateSlot


class TenantPlaces:
    """Each tenant's admitted requests at this router (waiting at the gate or at the
    model), under a cap per tenant. Keys: configured tenants only (bounded)."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def take(self, tenant: str, cap: int) -> bool:
        """One place for ``tenant``; False (nothing taken) when it holds ``cap`` already."""
        n = self.held.get(tenant, 0)
        if n >= cap:
            return False
        self.held[tenant] = n + 1
        return True

    def give_back(self, tenant: str) -> None:
        self.held[tenant] = max(0, self.held.get(tenant, 0) - 1)


@dataclass
class Charge:
    """The estimate charged on a tenant's bucket (None: the tenant has no rate)."""

    bucket: TokenBucket | None
    cost: float
    prompt_tokens: int
    per_token: float = 1.0  # what one of the model's tokens costs (``cost_per_token``)

    def settle(self, generated: int | None) -> None:
        """Back to the tokens used: the prompt and ``generated`` (None: nothing used), at
        the model's cost per token."""
        if self.bucket is None:
            return
        used = 0.0 if generated is None else (self.prompt_tokens + generated) * self.per_token
        if used < self.cost:
            self.bucket.refund(self.cost - used)
        elif used > self.cost:
            self.bucket.charge_extra(used - self.cost)


class Ticket:
    """One admitted request's tenant place, quota charge and gate slot, built whole."""

    def __init__(
        self,
        tenant: str,
        criticality: str,
        deadline: Deadline,
        places: TenantPlaces,
        charge: Charge,
        slot: GateSlot | BatchSlot,
        fallback_only: bool,
        accounts: Accounts,
    ) -> None:
        self.tenant = tenant
        self.criticality = criticality
        self.deadline = deadline
        self.charge = charge
        self.slot = slot
        self.fallback_only = fallback_only  # only the fallback may answer (the level or the gate refused the primary)
        self.outcome: Outcome | None = None
        self._places = places
        self._accounts = accounts

    @property
    def prompt_tokens(self) -> int:
        return self.charge.prompt_tokens

    def finish(self, outcome: Outcome) -> bool:
        """Settle everything the ticket holds; True the first time, False (nothing done) after."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self._places.give_back(self.tenant)
        self.charge.settle(outcome.generated)
        self._accounts.settled(self, outcome)  # first: the gate learns from the sample before the slot frees
        self.slot.release(outcome.service_s, outcome.generated)
        return True

    def __repr__(self) -> str:
        state: Any = self.outcome.code if self.outcome else "open"
        return f"Ticket({self.tenant}, {self.criticality}, {state})"
