"""The router's metrics: one object, built once per router replica, that the request
path and the router's reports update (Ray Serve's ``ray.serve.metrics``, exported as
``ray_ballast_*``)."""

from __future__ import annotations

from types import ModuleType


class RouterMetrics:
    """Every metric a router replica exports."""

    def __init__(self, model: str = "") -> None:
        """``model``: the ``model`` tag of a per-model metric recorded without one (the
        router records every per-model series with its model's tag; empty here)."""
        from ray.serve import metrics

        self._requests(metrics)
        self._protection(metrics)
        self._tenants(metrics)
        self._batch(metrics)
        for m in (
            self.requests,
            self.latency,
            self.level,
            self.breaker,
            self.trips,
            self.retries,
            self.lost,
            self.hedges,
        ):
            m.set_default_tags({"model": model})
        for m in (self.gate, self.gate_refused, self.tenant_tokens, self.flex_held, self.batch_lines):
            m.set_default_tags({"model": model})

    def _requests(self, metrics: ModuleType) -> None:
        """What became of each request, and how long it took."""
        self.requests = metrics.Counter(
            "ballast_requests_total",
            "Requests by outcome, every front.",
            tag_keys=("tenant", "criticality", "code", "model"),
        )
        self.latency = metrics.Histogram(
            "ballast_request_latency_ms",
            "Request latency as the router sees it, every front.",
            boundaries=[5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000],
            tag_keys=("criticality", "model"),
        )

    def _protection(self, metrics: ModuleType) -> None:
        """The level, breakers, fallbacks, retries, gate and edge this router acts through."""
        self.level = metrics.Gauge(
            "ballast_router_level", "Degradation level this router acts on, by model.", tag_keys=("model",)
        )
        self.breaker = metrics.Gauge(
            "ballast_breaker_state",
            "Circuit breaker state: 0 closed, 1 open, 2 half-open.",
            tag_keys=("backend", "model"),
        )
        self.trips = metrics.Counter("ballast_breaker_trips_total", "Breaker openings.", tag_keys=("backend", "model"))
        self.fallbacks = metrics.Counter("ballast_fallbacks_total", "Answers served by a fallback.", tag_keys=("kind",))
        self.retries = metrics.Counter(
            "ballast_retries_total", "Retried attempts.", tag_keys=("backend", "kind", "model")
        )
        self.lost = metrics.Counter(
            "ballast_requests_lost_capacity_total",
            "Attempts whose replica or node went away, by what became of the request: migrated "
            "(sent again or carried on elsewhere) or not_migrated (to the fallback, else 503 REPLICA_LOST). "
            "Not model errors.",
            tag_keys=("backend", "outcome", "model"),
        )
        self.hedges = metrics.Counter(
            "ballast_hedges_total",
            "Attempts hedged: sent to another replica as well after showing no progress for the "
            "model's hedge delay (the first answer wins, the other is cancelled).",
            tag_keys=("backend", "model"),
        )
        self.deadline = metrics.Counter("ballast_deadline_exceeded_total", "Requests past their deadline.")
        self.replays = metrics.Counter("ballast_idempotent_replays_total", "Answers replayed for an Idempotency-Key.")
        self.kill = metrics.Gauge("ballast_kill_switch_active", "Active kill switch entries.")
        self.gate = metrics.Gauge(
            "ballast_gate", "This router's gate to a model: limit, in_flight, waiting.", tag_keys=("kind", "model")
        )
        self.gate_refused = metrics.Counter(
            "ballast_gate_refused_total",
            "Requests refused at the gate (503 OVERLOADED).",
            tag_keys=("reason", "criticality", "model"),
        )
        self.edge = metrics.Counter(
            "ballast_edge_refused_total",
            "Requests HAProxy refused (503 OVERLOADED) for a class the level sheds, before the router.",
            tag_keys=("criticality",),
        )
        self.snapshot_age = metrics.Gauge(
            "ballast_snapshot_age_s", "Age of the controller snapshot this router acts on (-1: none yet)."
        )

    def _batch(self, metrics: ModuleType) -> None:
        """Batch lines, the per-model queues and dead letters (each router reads the same
        store: take the max over routers for the gauges), and flex requests held."""
        self.batch_lines = metrics.Counter(
            "ballast_batch_lines_total",
            "Batch lines this router took off a model's queue, by what became of them: completed, failed (to "
            "the error file), expired, retried, deferred (quota or kill switch), dead_lettered, skipped.",
            tag_keys=("model", "outcome"),
        )
        self.batch_queue_depth = metrics.Gauge(
            "ballast_batch_queue_depth", "Batch lines queued or running for a model.", tag_keys=("model",)
        )
        self.batch_queue_age = metrics.Gauge(
            "ballast_batch_queue_age_seconds",
            "How long the oldest line on a model's batch queue has waited.",
            tag_keys=("model",),
        )
        self.dlq_depth = metrics.Gauge(
            "ballast_dlq_depth", "Batch lines on a model's dead-letter queue.", tag_keys=("model",)
        )
        self.dlq_messages = metrics.Counter(
            "ballast_dlq_messages_total",
            "Batch lines moved to a model's dead-letter queue (their retryable attempts spent).",
            tag_keys=("model",),
        )
        self.dlq_reprocessed = metrics.Counter(
            "ballast_dlq_reprocessed_total",
            "Dead letters an operator put back on their model's queue (POST /admin/dlq/{id}/retry).",
            tag_keys=("model",),
        )
        self.flex_held = metrics.Gauge(
            "ballast_flex_held", "Flex requests held for spare capacity at this router.", tag_keys=("model",)
        )

    def batch_line(self, model: str, outcome: str) -> None:
        """A batch line's outcome (router/dispatcher.py's hook)."""
        self.batch_lines.inc(tags={"model": model, "outcome": outcome})
        if outcome == "dead_lettered":
            self.dlq_messages.inc(tags={"model": model})

    def batch_depths(self, model: str, queued: int, age_s: float, dlq: int) -> None:
        """A model's batch queue and dead-letter queue as last read (the finalizer's hook)."""
        tags = {"model": model}
        self.batch_queue_depth.set(queued, tags=tags)
        self.batch_queue_age.set(age_s, tags=tags)
        self.dlq_depth.set(dlq, tags=tags)

    def _tenants(self, metrics: ModuleType) -> None:
        """What each tenant was charged and served, and its fair-share counter."""
        self.tenant_tokens = metrics.Counter(
            "ballast_tenant_tokens_total",
            "Tokens charged to a tenant (prompt + generated), in the model's tokens.",
            tag_keys=("tenant", "model"),
        )
        self.fair_served = metrics.Counter(
            "ballast_fair_served_tokens_total",
            "Service a tenant got, as its fair-share counter weighs it: (input_weight x prompt + "
            "output_weight x generated tokens) / the tenant's weight.",
            tag_keys=("tenant",),
        )
        self.fair_counter = metrics.Gauge(
            "ballast_fair_counter",
            "A tenant's fair-share counter as this router orders its gate by it (cluster-wide when shared).",
            tag_keys=("tenant",),
        )
        self.fair_backlogged = metrics.Gauge(
            "ballast_fair_backlogged",
            "1 while a tenant has requests waiting at this router's gate.",
            tag_keys=("tenant",),
        )
        self.tenant_rate = metrics.Gauge(
            "ballast_tenant_rate_tokens_per_s",
            "A tenant's token rate at this router (its share).",
            tag_keys=("tenant",),
        )
