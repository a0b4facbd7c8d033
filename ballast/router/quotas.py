"""Token quotas at one router: a bucket per tenant with a rate, at the rate the controller
leases to this router, or at the safe share (1/N of the tenant's own rate, N routers)
while no lease is fresh; and the demand each tenant asked for, reported to the
controller, which apportions the leases from it (ballast/policies/quota.py decides both)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ballast.errors import QuotaExceeded
from ballast.policies import tokens as token_policy
from ballast.policies.quota import RateLease, TokenBucket, lease_rate
from ballast.router.ticket import Charge


class Quotas:
    """The tenants' buckets, their leases and their demand since the last report.

    ``routers``: how many routers share a tenant's rate now (the safe share's N).
    ``on_rate``: called with (tenant, rate) when a bucket's rate changes (a metric)."""

    def __init__(
        self,
        cfg: Any,
        routers: Callable[[], int],
        on_rate: Callable[[str, float], None] = lambda tenant, rate: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._routers = routers
        self._on_rate = on_rate
        self._clock = clock
        n = cfg.deployments.router.num_replicas
        self.buckets = {
            name: TokenBucket(t.rate_tokens_per_s / n, t.burst / n)
            for name, t in cfg.tenants.items()
            if t.rate_tokens_per_s is not None
        }
        self._leases: dict[str, RateLease] = {}
        self._demand: dict[str, float] = {}
        self._demand_since = clock()

    def charge(self, tenant: str, prompt_tokens: int, max_tokens: int, per_token: float = 1.0) -> Charge:
        """The estimate (prompt + max_tokens, each token at the model's ``per_token`` cost)
        from the tenant's bucket, counted as demand either way; 429 QUOTA_EXCEEDED (nothing
        charged) when the bucket cannot pay it now. One bucket per tenant across models."""
        cost = token_policy.token_cost(prompt_tokens, max_tokens) * per_token
        bucket = self._bucket(tenant)
        if bucket is None:
            return Charge(None, cost, prompt_tokens, per_token)
        self._demand[tenant] = self._demand.get(tenant, 0.0) + cost
        if not bucket.try_charge(cost):
            raise QuotaExceeded(
                f"tenant '{tenant}' is over its quota of {self._cfg.tenants[tenant].rate_tokens_per_s:g} tokens/s",
                retry_after_s=token_policy.quota_retry_after_s(bucket.retry_after_s(cost)),
            )
        return Charge(bucket, cost, prompt_tokens, per_token)

    def _bucket(self, tenant: str) -> TokenBucket | None:
        bucket = self.buckets.get(tenant)
        if bucket is None:
            return None
        t = self._cfg.tenants[tenant]
        rate, burst, _ = lease_rate(
            self._leases.get(tenant), self._clock(), t.rate_tokens_per_s, t.burst, self._routers()
        )
        if rate != bucket.rate_tokens_per_s or burst != bucket.burst_tokens:
            bucket.set_rate(rate, burst)
            self._on_rate(tenant, rate)
        return bucket

    def on_leases(self, leases: Mapping[str, Mapping[str, Any]]) -> None:
        """The controller's leases for this router, stamped on this router's clock
        (monotonic clocks differ between processes)."""
        expires = self._clock() + self._cfg.quota.lease_ttl_s
        for tenant, lease in leases.items():
            if tenant in self.buckets:
                self._leases[tenant] = RateLease(
                    tenant, float(lease["rate_tokens_per_s"]), max(1.0, float(lease["burst_tokens"])), expires
                )

    def drain_demand(self) -> dict[str, float]:
        """Tokens per second each tenant asked for since the last call (the leases' input)."""
        now = self._clock()
        elapsed = max(1e-3, now - self._demand_since)
        rates = {t: tokens / elapsed for t, tokens in self._demand.items()}
        self._demand, self._demand_since = {}, now
        return rates

    def status(self) -> dict[str, Any]:
        now = self._clock()
        return {
            t: {
                "rate_tokens_per_s": b.rate_tokens_per_s,
                "burst_tokens": b.burst_tokens,
                "tokens": round(b.tokens, 1),
                "lease": t in self._leases and self._leases[t].expires_at_s > now,
            }
            for t, b in self.buckets.items()
        }
