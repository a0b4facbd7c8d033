"""The router deployment: Ballast's HTTP ingress (FastAPI under Ray Serve).

Where things are:

- pipeline.py: the request path every front shares, where a request is authenticated,
  admitted, gated and sent to the model (its docstring walks it);
- generate.py and openai.py: the native and OpenAI fronts on that pipeline;
- admin.py: ``/v1/status`` and ``/admin/*``;
- api.py: the FastAPI app, the error mapping, body and token helpers;
- metrics.py: the router's metrics;
- this module: the ``Router`` deployment that puts those routes together, its state
  (built once, here), its lifecycle (health routes, snapshot and lease updates from the
  controller) and its reports to the controller.

Decisions are policies/'s: admission, quota, the gate (policies/gate.py) and the
per-request rules (policies/request.py); this package gathers inputs and applies them.
"""


import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Optional

from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse
from ray import serve

from policies import killswitch
from policies import request as request_policy
from policies.breaker import BreakerEvent
from policies.criticality import Criticality
from policies.edge import EdgeThrottle
from policies.gate import DemandWindow
from policies.limiter import AimdLimit
from policies.quota import RateLease, TokenBucket
from policies.reports import RouterReport
from policies.stats import nearest_rank

from serve_app.config import load_config
from serve_app.errors import NotFound
from serve_app.router.auth import KeyStore
from serve_app.router.contract import openapi_document
from serve_app.router.edge import Edge, shed_entries
from serve_app.control.link import connect
from serve_app.control.names import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT
from serve_app.router.admin import AdminRoutes
from serve_app.router.api import app
from serve_app.router.gate import PriorityGate
from serve_app.router.generate import GenerateRoutes
from serve_app.router.idempotency import IdempotencyStore, SharedKeys
from serve_app.router.metrics import RouterMetrics
from serve_app.router.openai import OpenAIRoutes
from serve_app.router.pipeline import Pipeline
from serve_app.router.resilience import CallHooks, ResilientCaller
from serve_app.router.tokens import model_text
from serve_app.control.snapshot import Snapshot

log = logging.getLogger("ballast.router")

MAX_WAIT_SAMPLES = 4096  # queue-wait samples kept between two reports


def model_ceiling(cfg: Any, snap: Snapshot) -> Optional[int]:
    """The gate's ceiling from a snapshot: policies/request.py's ``model_ceiling``."""
    return request_policy.model_ceiling(
        snap.running_replicas.get(MODEL_DEPLOYMENT, 0),
        snap.running_replicas.get(ROUTER_DEPLOYMENT, 0),
        cfg.deployments.model.max_ongoing_requests,
    )


def tenant_buckets(cfg: Any) -> dict[str, TokenBucket]:
    """A token bucket per tenant with a rate, at the safe share (1/N of the routers) until a lease arrives."""
    n = cfg.deployments.router.num_replicas
    return {name: TokenBucket(t.rate_tokens_per_s / n, t.burst / n)
            for name, t in cfg.tenants.items() if t.rate_tokens_per_s is not None}


def priority_gate(g: Any) -> Optional[PriorityGate]:
    """The gate to the model ``resilience.gate`` describes; None when it is off."""
    if not g.enabled:
        return None
    return PriorityGate(AimdLimit(g.limiter_config()), g.max_waiting, g.max_wait_s,
                        reserve_ratio=g.critical_reserve_ratio, reserve_hold_s=g.critical_reserve_hold_s,
                        miss_service_factor=g.miss_service_factor)


class _Stats:
    """Per-router accounting between two reports (bounded)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.requests = 0
        self.errors = 0
        self.shed = 0
        # Attempts lost with their replica or node: capacity gone, not model errors.
        self.lost_capacity = 0
        self.waits_ms: list[float] = []

    def add_wait(self, ms: float) -> None:
        if len(self.waits_ms) < MAX_WAIT_SAMPLES:
            self.waits_ms.append(ms)

    def drain(self, router_id: str) -> RouterReport:
        """The report of what was counted since the last one; the counts start again."""
        out = RouterReport(
            router_id=router_id,
            inflight=self.inflight,
            requests=self.requests,
            errors=self.errors,
            shed=self.shed,
            lost_capacity=self.lost_capacity,
            queue_wait_p95_ms=nearest_rank(self.waits_ms, 0.95),  # None with no samples
        )
        self.requests = self.errors = self.shed = self.lost_capacity = 0
        self.waits_ms = []
        return out


@serve.ingress(app)
class Router(GenerateRoutes, OpenAIRoutes, AdminRoutes, Pipeline):
    """One router replica: the routes of generate.py and admin.py, and the state they share."""

    def __init__(self, model: Any, cfg: dict[str, Any], fallback: Any = None):
        self._cfg = load_config(cfg)
        self._keys = KeyStore.from_config(self._cfg)
        self._model = model
        self._stats = _Stats()
        self._router_id = f"router-{uuid.uuid4().hex[:8]}"
        self._key_table: Any = None  # the shared idempotency key table's handle, once needed
        self._created_s = int(time.time())  # /v1/models' "created"
        self._openapi: Optional[dict[str, Any]] = None  # built at the first GET /openapi.json
        self._link, self._cache, self._exchange = connect(
            self._cfg, "report_router", self._report, on_snapshot=self._on_snapshot, on_reply=self._on_reply
        )
        self._kill_switches: list[killswitch.KillSwitchEntry] = []
        self._tenant_inflight: dict[str, int] = {}  # keys: configured tenants only (bounded)
        # Token quotas: one bucket per tenant with a rate, its rate from the controller's
        # lease for this router, or the safe share (1/N) when the lease has lapsed.
        self._buckets = tenant_buckets(self._cfg)
        self._leases: dict[str, RateLease] = {}
        self._demand_tokens: dict[str, float] = {}
        self._demand_since = time.monotonic()
        r = self._cfg.resilience
        # Keys shared by every router (a retry through another node's endpoint gets the
        # first answer); the actor is looked up or created at the first keyed request.
        self._idem = IdempotencyStore(
            r.idempotency.ttl_s, r.idempotency.max_entries, shared=SharedKeys(self._keys_handle, self._router_id)
        )
        self._text = model_text(self._cfg.model)  # the model's tokenizer, template and context
        self._model_max_tokens = self._text.context - 1
        self._limits = self._cfg.limits
        self._gate = priority_gate(r.gate)
        # Demand by criticality (turned away by the level, or within quota) and the gate's
        # answer rate: the controller sheds a whole class only when the others fill the model.
        self._offered: dict[str, int] = {}  # keys: the four criticalities (bounded)
        self._demand = DemandWindow(self._cfg.degradation.demand_window_s)
        self._gate_seen = (0, 0)  # the gate's (served, saturations) at the last report
        # HAProxy refuses the classes the level sheds (edge.py), when it runs the edge's rules.
        self._edge = Edge.from_env() if self._cfg.http.edge else None
        # Per class since the last report: [decided at the gate, let through] (keys: the four
        # classes), and the edge's share to refuse of the classes the level admits.
        self._gate_seen_by_class: dict[str, list[int]] = {}
        self._edge_throttle = EdgeThrottle()

        self._metrics = RouterMetrics()
        self._caller = ResilientCaller(
            self._cfg,
            model,
            fallback,
            hooks=CallHooks(
                on_retry=lambda backend, kind: self._metrics.retries.inc(tags={"backend": backend, "kind": kind}),
                on_fallback=lambda kind: self._metrics.fallbacks.inc(tags={"kind": kind}),
                on_breaker_event=self._on_breaker_event,
                on_lost_capacity=self._on_lost_capacity,
            ),
        )

    def _keys_handle(self) -> Any:
        if self._key_table is None:
            import ray

            from serve_app.control.keys import keys_actor

            if not ray.is_initialized():  # a router object outside Ray (tests): keys stay per router
                raise RuntimeError("no Ray: the shared key table is unreachable")

            self._key_table = keys_actor(self._cfg)
        return self._key_table

    def _on_lost_capacity(self, backend: str, outcome: str) -> None:
        self._stats.lost_capacity += 1
        self._metrics.lost.inc(tags={"backend": backend, "outcome": outcome})

    def _on_breaker_event(self, event: BreakerEvent) -> None:
        self._metrics.breaker.set(int(event.to_state), tags={"backend": event.backend})
        if int(event.to_state) == 1:
            self._metrics.trips.inc(tags={"backend": event.backend})
        log.warning("breaker %s: %s -> %s (%s)", event.backend, event.from_state.name, event.to_state.name, event.reason)

    def _on_reply(self, raw: dict[str, Any]) -> None:
        """Leases for this router; stamped on this router's clock (monotonic clocks differ)."""
        expires = time.monotonic() + self._cfg.quota.lease_ttl_s
        for tenant, lease in (raw.get("leases") or {}).items():
            if tenant in self._buckets:
                self._leases[tenant] = RateLease(
                    tenant, float(lease["rate_tokens_per_s"]), max(1.0, float(lease["burst_tokens"])), expires
                )

    def _report(self) -> RouterReport:
        """This router's report to the controller: called once per report interval, whether or not it answers."""
        age = self._cache.age_s()
        self._metrics.snapshot_age.set(age if age is not None else -1.0)
        # Gauges are re-set every interval, not only on change: a series Ray has not seen
        # updated for a while may stop being exported.
        for b in self._caller.backends:
            self._metrics.breaker.set(int(b.breaker.state), tags={"backend": b.role})
        self._metrics.kill.set(len(self._kill_switches))
        self._metrics.level.set(self._cache.effective().level)
        if self._gate is not None:
            self._metrics.gate.set(self._gate.limit.value, tags={"kind": "limit"})
            self._metrics.gate.set(self._gate.in_flight, tags={"kind": "in_flight"})
            self._metrics.gate.set(self._gate.waiting, tags={"kind": "waiting"})
        self._sync_edge()
        report = self._stats.drain(self._router_id)
        if self._gate is not None:
            # Waiters at the gate are demand the autoscaler counts; the level does not count
            # them as queue (the gate refuses each by its deadline, most critical served
            # first): it sheds whole classes by demand against capacity instead.
            served, saturations = self._gate.served, self._gate.saturations
            self._demand.add(self._offered, served - self._gate_seen[0], saturations > self._gate_seen[1])
            self._gate_seen, self._offered = (served, saturations), {}
            report = replace(report, gate_waiting=self._gate.waiting, **self._demand.rates())
        return replace(report, demand_tokens_per_s=self._drain_demand())

    def _sync_edge(self) -> None:
        """The edge's map follows the level this router acts on (a snapshot, or fail-static);
        its refusals since the last report count as demand the level turned away."""
        seen, self._gate_seen_by_class = self._gate_seen_by_class, {}
        if self._edge is None:
            return
        now = time.monotonic()
        refused = self._edge.drain()
        for crit, n in refused.items():
            self._offered[crit] = self._offered.get(crit, 0) + n
            self._stats.shed += n
            self._metrics.edge.inc(n, tags={"criticality": crit})
        admitted = {c.value for c in self._cache.effective().constraints.admitted}
        for c in Criticality:
            if c.value not in admitted:  # the level refuses it whole: nothing to learn, and a
                self._edge_throttle.forget(c.value)  # class admitted again starts afresh
                continue
            decided, through = seen.get(c.value, (0, 0))
            room = decided > 0 and through >= decided and self._gate_has_room()
            self._edge_throttle.record(now, c.value, decided + refused.get(c.value, 0), through, room)
        self._apply_edge(now)

    def _gate_has_room(self) -> bool:
        g = self._gate
        return g is None or (g.waiting == 0 and g.in_flight < g.limit.value)

    def _apply_edge(self, now: float) -> None:
        eff = self._cache.effective()
        drops = {c.value: self._edge_throttle.drop_per_mille(now, c.value) for c in Criticality}
        self._edge.apply(shed_entries(eff.level, eff.constraints, drops))

    def _drain_demand(self) -> dict[str, float]:
        """Tokens per second asked for by each tenant since the last report (the quota leases' input)."""
        now = time.monotonic()
        elapsed = max(1e-3, now - self._demand_since)
        rates = {t: tokens / elapsed for t, tokens in self._demand_tokens.items()}
        self._demand_tokens, self._demand_since = {}, now
        return rates

    def _on_snapshot(self, snap: Snapshot) -> None:
        if self._gate is not None:
            self._gate.limit.set_ceiling(model_ceiling(self._cfg, snap))
        entries = []
        for raw in snap.kill_switches:
            try:
                entries.append(killswitch.KillSwitchEntry.from_dict(raw))
            except (TypeError, ValueError):
                log.warning("ignoring a malformed kill switch entry: %r", raw)
        self._kill_switches = entries
        self._metrics.kill.set(len(entries))
        if self._edge is not None:  # at once, not at the next report: the level may have changed
            self._apply_edge(time.monotonic())

    async def check_health(self) -> None:
        self._exchange.start()

    # -- lifecycle -------------------------------------------------------------------
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        if self._openapi is None:
            self._openapi = openapi_document(app.routes)
        return JSONResponse(self._openapi)

    @app.get("/docs", include_in_schema=False)
    async def docs(self):
        if not self._cfg.http.docs_page:
            raise NotFound("the docs page is off here (http.docs_page); the contract is at /openapi.json")
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Ballast API")

    @app.get("/healthz/live")
    async def live(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/healthz/ready")
    async def ready(self) -> JSONResponse:
        self._exchange.start()
        problems = []
        try:
            await asyncio.wait_for(self._model.ping.remote(), timeout=2.0)
        except Exception as e:
            problems.append(f"model deployment unreachable: {type(e).__name__}")
        if not self._cache.is_fresh():
            age = self._cache.age_s()
            problems.append("controller snapshot " + ("missing" if age is None else f"stale ({age:.1f}s old)"))
        if problems:
            return JSONResponse(
                {"error": {"code": "NOT_READY", "message": "; ".join(problems)}}, status_code=503
            )
        return JSONResponse({"status": "ready", "level": self._cache.effective().level})

    def _count(self, tenant: str, criticality: str, code: str) -> None:
        self._metrics.requests.inc(tags={"tenant": tenant, "criticality": criticality, "code": code})


def router_deployment(cfg):
    r = cfg.deployments.router
    spread = {} if r.max_replicas_per_node is None else {"max_replicas_per_node": r.max_replicas_per_node}
    return serve.deployment(Router, **r.serve_options(ROUTER_DEPLOYMENT, cfg.http.access_log,
                                                      num_replicas=r.num_replicas, **spread))
