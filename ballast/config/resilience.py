"""``resilience``: the deadline, and per backend the breaker, retries, bulkheads, the gate,
the answer cache and the Idempotency-Key stores."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from ballast.config.base import Strict, frozen_config, ordered
from ballast.policies.breaker import BreakerConfig
from ballast.policies.engines import capabilities
from ballast.policies.hedge import HedgeConfig
from ballast.policies.limiter import LimiterConfig
from ballast.policies.retry import RetryConfig


class BreakerSettings(Strict):
    """Defaults: 50 % failures over 100 calls / 60 s, at least 10 calls, open 30 s, 5 probes."""

    window_kind: Literal["count", "time"] = "count"
    window_size: PositiveInt = 100
    window_s: PositiveFloat = 60.0
    min_calls: PositiveInt = 10
    failure_rate_threshold: float = Field(default=0.5, gt=0, le=1)
    slow_call_duration_s: PositiveFloat = 10.0
    slow_call_rate_threshold: float = Field(default=1.0, gt=0, le=1)
    open_duration_s: PositiveFloat = 30.0
    open_jitter_ratio: float = Field(default=0.1, ge=0, lt=1)
    half_open_max_probes: PositiveInt = 5
    half_open_success_threshold: float = Field(default=0.8, gt=0, le=1)
    # Once a half-open period has handed out its first probe it must decide within
    # this long, else back to open: a lost probe cannot wedge the breaker half-open.
    # At least resilience.max_deadline_s, so no probe that could still answer is cut.
    half_open_max_wait_s: PositiveFloat = 120.0

    def breaker_config(self) -> BreakerConfig:
        return BreakerConfig(**self.model_dump())


class RetrySettings(Strict):
    max_attempts: int = Field(default=3, ge=1, le=10)
    base_backoff_s: float = Field(default=0.05, ge=0)
    max_backoff_s: float = Field(default=1.0, ge=0)
    budget_ratio: float = Field(default=0.2, ge=0, le=1)
    budget_min_concurrent: int = Field(default=3, ge=0)

    def retry_config(self) -> RetryConfig:
        return RetryConfig(**self.model_dump())


class HedgeSettings(Strict):
    """Hedged attempts (ballast/policies/hedge.py): an attempt with no progress after the
    model's recent p95 wait × ``factor`` goes to another replica as well; the first answer
    wins and the other is aborted. Sent only while the model's level sheds nothing, and
    within a budget of the requests in flight."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=0)
    min_delay_s: float = Field(default=0.5, ge=0)
    max_delay_s: PositiveFloat = 10.0
    min_samples: PositiveInt = 20
    window: PositiveInt = 200
    budget_ratio: float = Field(default=0.1, ge=0, le=1)
    budget_min_concurrent: int = Field(default=1, ge=0)
    # A replica whose heartbeat (the stamp of its routing stats, as Serve hands them to the
    # routers) has not moved for this long, while another replica's has, is silent: routers
    # send it nothing new, and an attempt that timed out on it is lost capacity, not a
    # model error (it moves neither the breaker nor the level's error rate).
    silent_after_s: PositiveFloat = 4.0

    @model_validator(mode="after")
    def _delays(self) -> HedgeSettings:
        ordered(self, "min_delay_s", "max_delay_s")
        if self.window < self.min_samples:
            raise ValueError(f"window ({self.window}) must be >= min_samples ({self.min_samples})")
        return self

    def hedge_config(self) -> HedgeConfig:
        return HedgeConfig(**self.model_dump(exclude={"silent_after_s"}))


class BulkheadSettings(Strict):
    # Concurrent calls per backend from one router: a hung fallback cannot starve the primary.
    primary: PositiveInt = 256
    fallback: PositiveInt = 64
    # Concurrent requests per tenant in one router (429 CONCURRENCY_LIMIT beyond it).
    per_tenant: PositiveInt = 128


class GateSettings(Strict):
    """Per router and model: an adaptive limit on requests at the model, and a priority
    wait line for the rest (ballast/router/gate.py, ballast/policies/limiter.py)."""

    enabled: bool = True
    # A slow start: the limit climbs from here (one per window while reached), so the
    # first burst after a quiet spell meets a batch the model can answer in time.
    initial_limit: PositiveInt = 16
    min_limit: PositiveInt = 4
    max_limit: PositiveInt = 256
    # The wait for the model (router to compute start: Serve's queue and the batch queue)
    # the limit steers to, as the p90 of a window. Below degradation's second queue-wait
    # threshold, so that the gate, not a whole criticality class, takes the overflow.
    target_wait_ms: PositiveFloat = 300.0
    # Back off when the p90 answered request spent more than this share of its own time
    # budget (arrival to deadline) at the model: before its deadlines are missed. null: off.
    # 0.4: past the model's knee a bigger batch is only slower, and the wait line, where
    # criticality orders requests, keeps the rest of the budget.
    target_service_ratio: float | None = Field(default=0.4, gt=0, le=1)
    # A slow cut is a trial: the window after next, the median service time per generated
    # token must have fallen by this share of the cut's share of rows (0.8: a 10 % cut, 8 %
    # faster; then the cut cost at most 2 % of throughput), else the cut is undone and the
    # slow rule rests (an engine whose step time is the host's, a burst of long prompts).
    # null: every slow cut stands.
    slow_cut_min_gain: float | None = Field(default=0.8, gt=0, le=1)
    # For an engine that schedules itself (backend vllm) the slow rule is off: the limit
    # follows the rows curve instead, capped where the answers' service per token against
    # the rows at the model says throughput reaches this share of its asymptote (0.85: past
    # it, more rows make every answer slower and few more of them). null: vLLM takes the
    # slow rule, as Ballast's own engines do.
    rows_curve_gain: float | None = Field(default=0.85, gt=0, lt=1)
    adjust_interval_s: PositiveFloat = 0.5
    decrease_factor: float = Field(default=0.9, gt=0, lt=1)  # gentle: each cut below the knee costs throughput
    # The wait line: bounded in count; each waiter by its deadline (less the expected
    # service time) and by this.
    max_waiting: PositiveInt = 512
    max_wait_s: PositiveFloat = 30.0
    # Slots kept for critical traffic: while critical requests lately needed the top of
    # the limit (within the last hold), sheddable classes fill at most limit - ceil(ratio x limit).
    critical_reserve_ratio: float = Field(default=0.25, ge=0, lt=1)
    critical_reserve_hold_s: PositiveFloat = 1.0
    # Rows kept for critical_plus alone (no other class, critical included, takes them): its
    # peak of rows over plus_reserve_window_s plus one, at most plus_reserve_max_ratio of the
    # limit, lent back once it has not arrived for plus_reserve_idle_s (a control tick). A
    # critical_plus request still waiting after plus_max_wait_ms goes above the limit (by
    # at most the reserve's bound). plus_reserve_max_ratio 0: no reserve, no bound.
    plus_reserve_max_ratio: float = Field(default=0.25, ge=0, lt=1)
    plus_reserve_window_s: PositiveFloat = 5.0
    plus_reserve_idle_s: PositiveFloat = 0.5
    plus_max_wait_ms: PositiveFloat = 250.0
    # A deadline missed at the model cuts the limit only when the model held the request
    # longer than this x the recent p90 service time; one admitted near its deadline and
    # served in the usual time missed because it waited. null: every miss cuts the limit.
    miss_service_factor: PositiveFloat | None = 1.5

    @model_validator(mode="after")
    def _bounds(self) -> GateSettings:
        self.limiter_config()  # the policy's own checks, with their message
        return self

    def limiter_config(self, backend: str = "builtin") -> LimiterConfig:
        """The limit for a model on ``backend``: an engine that schedules itself (vLLM)
        takes the rows curve where ``rows_curve_gain`` is set, and then not the slow rule."""
        by_curve = capabilities(backend).self_scheduling and self.rows_curve_gain is not None
        rule: dict[str, Any] = {"target_service_ratio": None} if by_curve else {"rows_curve_gain": None}
        return frozen_config(LimiterConfig, self, initial=self.initial_limit, interval_s=self.adjust_interval_s, **rule)


class CacheSettings(Strict):
    """Bounded cache of answers to identical requests: the last fallback before a 503.
    Keyed by tenant: a tenant gets only its own earlier answers."""

    enabled: bool = False
    max_entries: PositiveInt = 1024
    # A tenant past it loses its own least recently used answers, never another's
    # (max_entries stays the bound over all tenants).
    max_entries_per_tenant: PositiveInt = 256
    ttl_s: PositiveFloat = 300.0


class IdempotencySettings(Strict):
    """The Idempotency-Key stores (each router's, and the key table they share)."""

    ttl_s: PositiveFloat = 600.0
    # The backstop over all tenants.
    max_entries: PositiveInt = 10000
    # Per tenant: keys held (a tenant at the bound loses its own oldest answers; with
    # all of them still running, a new key is refused 429), and bytes of answers kept.
    # 1000 keys cover a tenant sending 1.6 keyed requests/s over the default ttl_s; 8 MiB
    # keeps about 1000 answers of 2000 tokens' text, and ten such tenants fill the
    # backstop, so a tenant's flood of new keys ages out only its own.
    max_entries_per_tenant: PositiveInt = 1000
    max_answer_bytes_per_tenant: PositiveInt = 8 * 1024 * 1024
    max_key_chars: PositiveInt = 200


class ResilienceConfig(Strict):
    # Overall deadline per request; a client may lower it with X-Request-Timeout-Ms,
    # never raise it past max_deadline_s.
    deadline_s: PositiveFloat = 30.0
    max_deadline_s: PositiveFloat = 120.0
    # Each attempt's own timeout (bounded by what is left of the deadline).
    attempt_timeout_s: PositiveFloat = 15.0
    # Times a request whose replica or node went away is sent again (unary) or carried on
    # elsewhere from the tokens already delivered (streams), within its deadline.
    migration_limit: int = Field(default=3, ge=0, le=10)
    breaker: BreakerSettings = BreakerSettings()
    retry: RetrySettings = RetrySettings()
    hedge: HedgeSettings = HedgeSettings()
    bulkhead: BulkheadSettings = BulkheadSettings()
    gate: GateSettings = GateSettings()
    cache: CacheSettings = CacheSettings()
    idempotency: IdempotencySettings = IdempotencySettings()

    @model_validator(mode="after")
    def _deadlines(self) -> ResilienceConfig:
        ordered(self, "deadline_s", "max_deadline_s")
        return self
