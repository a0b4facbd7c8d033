"""``tenants``, ``quota`` and ``fairness``: what each tenant may use, and how shares of the
model are split among tenants and routers."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from ballast.config.base import Strict, frozen_config
from ballast.policies.criticality import Criticality
from ballast.policies.fairness import FairnessConfig


class TenantConfig(Strict):
    """A tenant's quota, in tokens (prompt + generated): a resource unit, not requests.

    What is not written grants the least: a tenant's claims are capped at ``critical``
    unless ``max_criticality`` says more, and in production a tenant needs a rate, or
    ``unlimited: true`` to have no token quota at all (the concurrency cap still
    applies). Locally a tenant without a rate has no token quota. The sum of all
    tenants' rates may exceed what the model can do (overcommit).
    """

    description: str = ""
    rate_tokens_per_s: PositiveFloat | None = None
    burst_tokens: PositiveFloat | None = None  # default: 2 s of rate
    # No token quota, said explicitly (production refuses a tenant with neither this nor a rate).
    unlimited: bool = False
    max_concurrent: PositiveInt | None = None  # default: resilience.bulkhead.per_tenant
    # A higher claim is lowered to this; critical_plus (ahead of critical at the gate,
    # admitted at every level but 4) is granted only where written.
    max_criticality: Criticality = Criticality.CRITICAL
    # Share of idle capacity lent at level 0, of the model among tenants waiting in the
    # same class (fairness), and of a model's batch lines in flight.
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    sheddable: bool = False  # its rate shrinks with the degradation level
    # Its batch tokens count in its quota at this multiple of an online token's cost
    # (null: batch.cost).
    batch_cost: float | None = Field(default=None, gt=0, le=10)
    # The models and adapters this tenant may use (a model's name covers its adapters,
    # one added at run time included); null: any that the models' own tenants allow.
    models: list[str] | None = Field(default=None, min_length=1)
    # The prefix-cache group its prompts are cached in (ballast/policies/cache_groups.py):
    # null, the tenant alone; tenants naming one group share cached prefixes (and can tell,
    # by timing, what the others in it sent). Letters, digits, '-' or '_'.
    cache_group: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")

    @model_validator(mode="after")
    def _rate_or_unlimited(self) -> TenantConfig:
        if self.unlimited and (self.rate_tokens_per_s is not None or self.burst_tokens is not None):
            raise ValueError("unlimited: a tenant with no token quota takes no rate_tokens_per_s or burst_tokens")
        return self

    @property
    def burst(self) -> float | None:
        if self.rate_tokens_per_s is None:
            return None
        return self.burst_tokens if self.burst_tokens is not None else 2.0 * self.rate_tokens_per_s


class QuotaSettings(Strict):
    # A router's share of a tenant's rate, granted by the controller, lapses after this.
    lease_ttl_s: PositiveFloat = 3.0
    # Sheddable tenants' rate multiplier per degradation level 0..4.
    level_factors: tuple[float, float, float, float, float] = (1.0, 0.75, 0.5, 0.25, 0.0)
    # Levels at which idle tenants' unused rate is lent to busy ones, by weight ([] = never).
    lend_at_levels: list[int] = Field(default_factory=lambda: [0])
    # A tenant borrows at most this multiple of its own rate (so a small quota stays small).
    max_borrow_ratio: float = Field(default=1.0, ge=0)
    # Every router keeps at least this fraction of an equal share (so it can admit a first request).
    min_share_ratio: float = Field(default=0.1, ge=0, le=1)


class FairnessSettings(Strict):
    """Fair shares among tenants inside a criticality class (ballast/policies/fairness.py):
    at the gate, the tenant with the lowest virtual token counter goes first."""

    enabled: bool = True
    # A request's cost on its tenant's counter: these weights x its prompt and output
    # tokens, over the tenant's ``weight``.
    input_weight: float = Field(default=1.0, ge=0)
    output_weight: float = Field(default=2.0, ge=0)
    # Routers report what they charged each tenant and order by the controller's merged,
    # cluster-wide counters, and the model's slots are apportioned among routers by the
    # tenants waiting at each; false: each router orders by its own view and takes an
    # even split of the model.
    shared: bool = True
    # How far (weighted tokens) a waiting tenant's counter may lead the lowest waiting one
    # before its routers' share of the model falls by a factor e.
    lag_tokens: PositiveFloat = 2048.0
    # The share of the model every router keeps, split evenly, whoever waits where.
    router_floor_ratio: float = Field(default=0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _bounds(self) -> FairnessSettings:
        self.policy_config()  # the policy's own checks, with their message
        return self

    def policy_config(self) -> FairnessConfig:
        return frozen_config(FairnessConfig, self)
