"""The router deployment: Ballast's HTTP ingress (FastAPI under Ray Serve).

Request path for ``POST /v1/generate`` (DESIGN.md "The request path"):

1. authenticate: ``Authorization: Bearer <key>`` → tenant (401); the tenant is what
   the key says, never a header the client picks
2. body bounded (413) and validated (422, naming the field)
3. kill switch (global / tenant / criticality scope: 503 KILL_SWITCH with the reason)
4. admission: current degradation level × criticality (503 OVERLOADED + Retry-After)
5. per-tenant concurrency bulkhead (429 CONCURRENCY_LIMIT)
6. clamp to the level's constraints (max_tokens, streaming) and say so in the answer
7. Idempotency-Key: a repeat gets the first answer (``idempotency.IdempotencyStore``)
8. ``resilience.ResilientCaller``: per-backend bulkhead and breaker, attempts with
   timeouts inside the overall deadline (504), retries within a budget, the
   fallback chain (fallback model → cache → 503 MODEL_UNAVAILABLE)

Everything before step 5 is in-process and I/O-free: the level comes from the
``SnapshotCache`` that a background ``SnapshotExchange`` keeps fresh, so the
controller is never on the request path and a dead controller fails nothing.
"""


import asyncio
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncGenerator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from policies import killswitch
from policies import request as request_policy
from policies.admission import admit, clamp_max_tokens
from policies.breaker import BreakerEvent
from policies.criticality import DEFAULT_CRITICALITY, Criticality
from policies.limiter import AimdLimit
from policies.quota import Lease, TokenBucket, lease_rate
from policies.stats import nearest_rank

from serve_app.config import load_config
from serve_app.router.auth import KeyStore
from serve_app.control.link import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT, connect
from serve_app.errors import (
    BallastError,
    ChaosDisabled,
    ConcurrencyLimited,
    QuotaExceeded,
    ControllerUnavailable,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    KillSwitchActive,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthenticated,
)
from policies.gate import DemandWindow
from serve_app.router.gate import GateRefused, GateSlot, PriorityGate
from serve_app.router.idempotency import IdempotencyStore
from serve_app.router.ingress import running_fast_path, running_ingress
from serve_app.router.resilience import DEADLINE_LEAD_S, CallHooks, ResilientCaller
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


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    max_tokens: int = Field(64, ge=1)
    criticality: Criticality = DEFAULT_CRITICALITY
    stream: bool = False


class KillSwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: str
    value: Optional[str] = Field(None, max_length=200)
    reason: str = Field(min_length=1, max_length=killswitch.MAX_REASON_CHARS)
    expires_in_s: int = Field(gt=0, le=killswitch.MAX_EXPIRES_IN_S)


class ChaosRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(pattern="^(primary|fallback)$")
    error_ratio: float = Field(0.0, ge=0, le=1)
    latency_ms: int = Field(0, ge=0, le=600_000)
    hang: bool = False
    stall: bool = False
    leak_mb_per_s: float = Field(0.0, ge=0, le=1024)
    vram_leak_mb_per_s: float = Field(0.0, ge=0, le=1024)  # a GPU replica's device memory; nothing on CPU


class RecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replica_id: Optional[str] = Field(None, min_length=1, max_length=200)
    deployment: Optional[str] = Field(None, pattern="^(BallastModel|BallastFallbackModel)$")
    all: bool = False  # every replica of the deployment (or of both), in turn


def _validate(model: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object", field="body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequest(f"{field}: {first['msg']}", field=field) from None


def error_response(err: BallastError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _bearer(request: Request) -> Optional[str]:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


app = FastAPI(title="Ballast", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(BallastError)
async def _ballast_error(_: Request, exc: BallastError) -> JSONResponse:
    return error_response(exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return error_response(NotFound("no such route"))
    err = BallastError(str(exc.detail))
    err.status, err.code = exc.status_code, "METHOD_NOT_ALLOWED" if exc.status_code == 405 else "HTTP_ERROR"
    return error_response(err)


class _Stats:
    """Per-router accounting between two reports (bounded)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.requests = 0
        self.errors = 0
        self.shed = 0
        self.waits_ms: list[float] = []

    def add_wait(self, ms: float) -> None:
        if len(self.waits_ms) < MAX_WAIT_SAMPLES:
            self.waits_ms.append(ms)

    def drain(self) -> dict[str, Any]:
        p95 = nearest_rank(self.waits_ms, 0.95)  # None with no samples
        out = {
            "inflight": self.inflight,
            "requests": self.requests,
            "errors": self.errors,
            "shed": self.shed,
            "queue_wait_p95_ms": p95,
        }
        self.requests = self.errors = self.shed = 0
        self.waits_ms = []
        return out


@serve.ingress(app)
class Router:
    def __init__(self, model: Any, cfg: dict[str, Any], fallback: Any = None):
        self._cfg = load_config(cfg)
        self._keys = KeyStore.from_config(self._cfg)
        self._model = model
        self._stats = _Stats()
        self._router_id = f"router-{uuid.uuid4().hex[:8]}"
        self._link, self._cache, self._exchange = connect(
            self._cfg, "report_router", self._report, on_snapshot=self._on_snapshot, on_reply=self._on_reply
        )
        self._kill_switches: list[killswitch.KillSwitchEntry] = []
        self._tenant_inflight: dict[str, int] = {}  # keys: configured tenants only (bounded)
        # Token quotas: one bucket per tenant with a rate, its rate from the controller's
        # lease for this router, or the safe share (1/N) when the lease has lapsed.
        n = self._cfg.deployments.router.num_replicas  # the safe share until a lease arrives
        self._buckets = {
            name: TokenBucket(t.rate_tokens_per_s / n, t.burst / n)
            for name, t in self._cfg.tenants.items()
            if t.rate_tokens_per_s is not None
        }
        self._leases: dict[str, Lease] = {}
        self._demand_tokens: dict[str, float] = {}
        self._demand_since = time.monotonic()
        r = self._cfg.resilience
        self._idem = IdempotencyStore(r.idempotency.ttl_s, r.idempotency.max_entries)
        self._model_max_tokens = self._cfg.model.architecture.max_seq_len - 1
        self._limits = self._cfg.limits
        g = r.gate
        self._gate = PriorityGate(
            AimdLimit(g.limiter_config()), g.max_waiting, g.max_wait_s,
            reserve_ratio=g.critical_reserve_ratio, reserve_hold_s=g.critical_reserve_hold_s,
            miss_service_factor=g.miss_service_factor,
        ) if g.enabled else None
        # Demand by criticality (turned away by the level, or within quota) and the gate's
        # answer rate: the controller sheds a whole class only when the others fill the model.
        self._offered: dict[str, int] = {}  # keys: the four criticalities (bounded)
        self._demand = DemandWindow(self._cfg.degradation.demand_window_s)
        self._gate_seen = (0, 0)  # the gate's (served, saturations) at the last report

        from ray.serve import metrics  # created once, here (STYLE 8)

        self._m_requests = metrics.Counter(
            "ballast_requests_total", "Generate requests by outcome.", tag_keys=("tenant", "criticality", "code")
        )
        self._m_latency = metrics.Histogram(
            "ballast_request_latency_ms",
            "Generate latency as the router sees it.",
            boundaries=[5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000],
            tag_keys=("criticality",),
        )
        self._m_level = metrics.Gauge("ballast_router_level", "Degradation level this router acts on.")
        self._m_breaker = metrics.Gauge(
            "ballast_breaker_state", "Circuit breaker state: 0 closed, 1 open, 2 half-open.", tag_keys=("backend",)
        )
        self._m_trips = metrics.Counter("ballast_breaker_trips_total", "Breaker openings.", tag_keys=("backend",))
        self._m_fallbacks = metrics.Counter("ballast_fallbacks_total", "Answers served by a fallback.", tag_keys=("kind",))
        self._m_retries = metrics.Counter("ballast_retries_total", "Retried attempts.", tag_keys=("backend", "kind"))
        self._m_deadline = metrics.Counter("ballast_deadline_exceeded_total", "Requests past their deadline.")
        self._m_replays = metrics.Counter("ballast_idempotent_replays_total", "Answers replayed for an Idempotency-Key.")
        self._m_kill = metrics.Gauge("ballast_kill_switch_active", "Active kill switch entries.")
        self._m_gate = metrics.Gauge(
            "ballast_gate", "This router's gate to the model: limit, in_flight, waiting.", tag_keys=("kind",)
        )
        self._m_gate_refused = metrics.Counter(
            "ballast_gate_refused_total", "Requests refused at the gate (503 OVERLOADED).", tag_keys=("reason", "criticality")
        )
        self._m_snapshot_age = metrics.Gauge(
            "ballast_snapshot_age_s", "Age of the controller snapshot this router acts on (-1: none yet)."
        )
        self._m_tenant_tokens = metrics.Counter(
            "ballast_tenant_tokens_total", "Tokens charged to a tenant (prompt + generated).", tag_keys=("tenant",)
        )
        self._m_tenant_rate = metrics.Gauge(
            "ballast_tenant_rate_tokens_per_s", "A tenant's token rate at this router (its share).", tag_keys=("tenant",)
        )
        self._caller = ResilientCaller(
            self._cfg,
            model,
            fallback,
            hooks=CallHooks(
                on_retry=lambda backend, kind: self._m_retries.inc(tags={"backend": backend, "kind": kind}),
                on_fallback=lambda kind: self._m_fallbacks.inc(tags={"kind": kind}),
                on_breaker_event=self._on_breaker_event,
            ),
        )

    def _on_breaker_event(self, event: BreakerEvent) -> None:
        self._m_breaker.set(int(event.to_state), tags={"backend": event.backend})
        if int(event.to_state) == 1:
            self._m_trips.inc(tags={"backend": event.backend})
        log.warning("breaker %s: %s -> %s (%s)", event.backend, event.from_state.name, event.to_state.name, event.reason)

    def _on_reply(self, raw: dict[str, Any]) -> None:
        """Leases for this router; stamped on this router's clock (monotonic clocks differ)."""
        expires = time.monotonic() + self._cfg.quota.lease_ttl_s
        for tenant, lease in (raw.get("leases") or {}).items():
            if tenant in self._buckets:
                self._leases[tenant] = Lease(
                    tenant, float(lease["rate_tokens_per_s"]), max(1.0, float(lease["burst_tokens"])), expires
                )

    def _report(self) -> dict[str, Any]:
        """Called once per report interval, whether or not the controller answers."""
        age = self._cache.age_s()
        self._m_snapshot_age.set(age if age is not None else -1.0)
        # Gauges are re-set every interval, not only on change: a series Ray has not seen
        # updated for a while may stop being exported.
        for b in self._caller.backends:
            self._m_breaker.set(int(b.breaker.state), tags={"backend": b.role})
        self._m_kill.set(len(self._kill_switches))
        self._m_level.set(self._cache.effective().level)
        if self._gate is not None:
            self._m_gate.set(self._gate.limit.value, tags={"kind": "limit"})
            self._m_gate.set(self._gate.in_flight, tags={"kind": "in_flight"})
            self._m_gate.set(self._gate.waiting, tags={"kind": "waiting"})
        report = self._stats.drain()
        if self._gate is not None:
            # Waiters at the gate are demand the autoscaler counts; the level does not count
            # them as queue (the gate refuses each by its deadline, most critical served
            # first): it sheds whole classes by demand against capacity instead.
            report["gate_waiting"] = self._gate.waiting
            served, saturations = self._gate.served, self._gate.saturations
            self._demand.add(self._offered, served - self._gate_seen[0], saturations > self._gate_seen[1])
            self._gate_seen, self._offered = (served, saturations), {}
            report.update(self._demand.rates())
        return {"router_id": self._router_id, **report, **self._drain_demand()}

    def _drain_demand(self) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = max(1e-3, now - self._demand_since)
        rates = {t: tokens / elapsed for t, tokens in self._demand_tokens.items()}
        self._demand_tokens, self._demand_since = {}, now
        return {"demand_tokens_per_s": rates}

    def _bucket(self, tenant: str) -> Optional[TokenBucket]:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return None
        t = self._cfg.tenants[tenant]
        snap = self._cache.snapshot
        n_routers = (snap.running_replicas.get(ROUTER_DEPLOYMENT) if snap else None) or self._cfg.deployments.router.num_replicas
        rate, burst, _ = lease_rate(self._leases.get(tenant), time.monotonic(), t.rate_tokens_per_s, t.burst, n_routers)
        if rate != bucket.rate_tokens_per_s or burst != bucket.burst_tokens:
            bucket.set_rate(rate, burst)
            self._m_tenant_rate.set(rate, tags={"tenant": tenant})
        return bucket

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
        self._m_kill.set(len(entries))

    async def check_health(self) -> None:
        self._exchange.start()

    # -- helpers ---------------------------------------------------------------------
    def _tenant(self, request: Request) -> str:
        token = _bearer(request)
        if token is None:
            raise Unauthenticated("missing 'Authorization: Bearer <key>' header")
        tenant = self._keys.tenant_for(token)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant

    def _require_admin(self, request: Request) -> None:
        token = _bearer(request)
        if token is None:
            raise Unauthenticated("missing 'Authorization: Bearer <admin token>' header")
        if not self._keys.is_admin(token):
            raise Forbidden("this route needs the admin token")

    async def _read_body(self, request: Request) -> bytes:
        limit = self._limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"body is {declared} bytes; the limit is {limit}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise PayloadTooLarge(f"body exceeds {limit} bytes")
        return bytes(body)

    def _parse(self, body: bytes) -> GenerateRequest:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("body must be a JSON object", field="body") from None
        req = _validate(GenerateRequest, data)
        if req.max_tokens > self._limits.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens: must be <= {self._limits.max_tokens_limit}", field="max_tokens"
            )
        if len(req.prompt.encode("utf-8")) > self._limits.max_prompt_bytes:
            raise PayloadTooLarge(f"prompt exceeds {self._limits.max_prompt_bytes} bytes")
        return req

    def _deadline_s(self, request: Request) -> float:
        """Seconds this request may take: the route default, or less/more on the client's
        X-Request-Timeout-Ms, never past resilience.max_deadline_s."""
        r = self._cfg.resilience
        raw = request.headers.get("x-request-timeout-ms")
        if raw is None:
            return r.deadline_s
        if not raw.strip().isdigit() or int(raw) <= 0:
            raise InvalidRequest("X-Request-Timeout-Ms: must be a positive integer", field="X-Request-Timeout-Ms")
        return min(int(raw) / 1000.0, r.max_deadline_s)

    async def _read_json(self, request: Request) -> Any:
        try:
            return json.loads(await self._read_body(request))
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("body must be a JSON object", field="body") from None

    async def _controller(self, method: str, *args: Any) -> Any:
        """An admin call to the controller (never on the generate path)."""
        try:
            return await asyncio.wait_for(self._link.call(method, *args), timeout=5.0)
        except ValueError as e:  # the controller refused the input
            msg = str(e.args[0] if e.args else e)
            raise InvalidRequest(msg, field=msg.split(":", 1)[0]) from None
        except Exception as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                msg = str(cause.args[0] if cause.args else cause)
                raise InvalidRequest(msg, field=msg.split(":", 1)[0]) from None
            raise ControllerUnavailable(f"controller unreachable: {type(e).__name__}", retry_after_s=2.0) from None

    def _count(self, tenant: str, criticality: str, code: str) -> None:
        self._m_requests.inc(tags={"tenant": tenant, "criticality": criticality, "code": code})

    # -- routes ----------------------------------------------------------------------
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

    @app.get("/v1/status")
    async def status(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        eff = self._cache.effective()
        snap = self._cache.snapshot
        return {
            "level": eff.level,
            "source": eff.source,
            "constraints": eff.constraints.to_dict(),
            "snapshot": None
            if snap is None
            else {
                "epoch": snap.epoch,
                "version": snap.version,
                "age_s": round(self._cache.age_s() or 0.0, 3),
                "target_level": snap.target_level,
                "reason": snap.reason,
                "inputs": snap.inputs,
            },
            "replicas": {
                dep: {
                    "desired": (snap.desired_replicas.get(dep) if snap else None),
                    "running": (snap.running_replicas.get(dep) if snap else None),
                    **({"autoscale": snap.autoscale[dep]} if snap and dep in snap.autoscale else {}),
                }
                for dep in sorted(set(snap.desired_replicas) | set(snap.running_replicas) if snap else ())
            },
            "router_id": self._router_id,
            "ingress": running_ingress(),
            "fast_path": running_fast_path(),
            "breakers": {b.role: {**b.breaker.snapshot(), "failed_attempts": dict(b.failed)} for b in self._caller.backends},
            "retry_budget": self._caller.budget.snapshot(),
            "kill_switches": [e.to_dict() for e in self._kill_switches],
            "quotas": {
                t: {"rate_tokens_per_s": b.rate_tokens_per_s, "burst_tokens": b.burst_tokens, "tokens": round(b.tokens, 1),
                    "lease": t in self._leases and self._leases[t].expires_at_s > time.monotonic()}
                for t, b in self._buckets.items()
            },
            "chaos": snap.chaos if snap else {},
            "recycle": snap.recycle if snap else {},
            "gate": self._gate.snapshot() if self._gate is not None else None,
        }

    @app.post("/v1/generate")
    async def generate(self, request: Request):
        self._exchange.start()
        started = time.monotonic()
        tenant = self._tenant(request)
        deadline_s = started + self._deadline_s(request)
        req = self._parse(await self._read_body(request))
        tenant_cfg = self._cfg.tenants[tenant]
        granted, lowered = request_policy.lower_criticality(req.criticality, tenant_cfg.max_criticality)
        if lowered:  # the answer says so (degraded_reasons)
            req = req.model_copy(update={"criticality": granted})
        crit = req.criticality.value
        now_wall = time.time()
        blocked = killswitch.blocking(self._kill_switches, now_wall, tenant, crit)
        if blocked is not None:
            self._count(tenant, crit, "KILL_SWITCH")
            raise KillSwitchActive(
                f"kill switch {blocked.id} ({blocked.scope}): {blocked.reason}",
                retry_after_s=max(1.0, blocked.expires_at_s - now_wall),
            )
        eff = self._cache.effective()
        self._m_level.set(eff.level)
        decision = admit(req.criticality, eff.level, eff.constraints)
        if not decision.admitted:
            self._offered[crit] = self._offered.get(crit, 0) + 1  # demand the level turned away
            self._stats.shed += 1
            self._count(tenant, crit, "OVERLOADED")
            raise Overloaded(
                f"degradation level {eff.level} does not admit criticality '{crit}'", decision.retry_after_s
            )
        cap = tenant_cfg.max_concurrent or self._cfg.resilience.bulkhead.per_tenant
        if self._tenant_inflight.get(tenant, 0) >= cap:
            self._count(tenant, crit, "CONCURRENCY_LIMIT")
            raise ConcurrencyLimited(f"tenant '{tenant}' has {cap} requests in flight", retry_after_s=1.0)
        max_tokens, _ = clamp_max_tokens(req.max_tokens, eff.constraints, self._model_max_tokens)
        # Quota: charge the estimate (prompt + max_tokens) now, settle at the end.
        prompt_tokens = request_policy.prompt_tokens(req.prompt, self._model_max_tokens)
        cost = request_policy.token_cost(prompt_tokens, max_tokens)
        bucket = self._bucket(tenant)
        if bucket is not None:
            self._demand_tokens[tenant] = self._demand_tokens.get(tenant, 0.0) + cost
            if not bucket.try_charge(cost):
                self._count(tenant, crit, "QUOTA_EXCEEDED")
                raise QuotaExceeded(
                    f"tenant '{tenant}' is over its quota of {self._cfg.tenants[tenant].rate_tokens_per_s:g} tokens/s",
                    retry_after_s=request_policy.quota_retry_after_s(bucket.retry_after_s(cost)),
                )
        # Demand within quota: a tenant over its quota must not degrade everyone else.
        self._offered[crit] = self._offered.get(crit, 0) + 1
        reasons = request_policy.degraded_reasons(
            requested_max_tokens=req.max_tokens,
            level_max_tokens=eff.constraints.max_tokens,
            model_max_tokens=self._model_max_tokens,
            lowered=lowered,
            stream_requested=req.stream,
            streaming_allowed=eff.constraints.streaming,
        )
        meta = {
            "model": self._cfg.model.name,
            "criticality": crit,
            "degradation_level": eff.level,
            "degraded": bool(reasons),
            "degraded_reasons": reasons,
            "max_tokens": max_tokens,
        }
        call = {"prompt": req.prompt, "max_tokens": max_tokens}
        settle = self._settlement(tenant, bucket, cost, prompt_tokens)
        slot = await self._enter_gate(req.criticality, tenant, deadline_s, settle)
        if req.stream and eff.constraints.streaming:
            return StreamingResponse(
                self._stream(call, meta, tenant, crit, started, deadline_s, settle, slot),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        key = request.headers.get("idempotency-key")
        if key is not None and not (0 < len(key) <= self._cfg.resilience.idempotency.max_key_chars):
            slot.release()
            settle(None)
            raise InvalidRequest("Idempotency-Key: 1 to 200 characters", field="Idempotency-Key")
        async def work() -> dict[str, Any]:
            result, fallback = await self._call_unary(call, tenant, crit, started, deadline_s)
            body = {"text": result["text"], "tokens_generated": result["tokens"], **meta, "fallback": fallback}
            if fallback == "fallback_model" and self._cfg.fallback is not None:
                body["model"] = self._cfg.fallback.model.name
            return body

        self._tenant_inflight[tenant] = self._tenant_inflight.get(tenant, 0) + 1
        generated: Optional[int] = None
        timed_out = False
        slot_t0 = time.monotonic()
        try:
            if key is None:
                body, replayed = await work(), False
            else:  # a repeat gets the first answer, whole: text, level, fallback and all
                body, replayed = await self._idem.run(tenant, key, work)
                if replayed:
                    self._m_replays.inc()
            if not replayed:  # a replay did no model work: it costs nothing
                generated = body["tokens_generated"]
        except DeadlineExceeded:
            timed_out = True
            raise
        finally:
            held_s = time.monotonic() - slot_t0
            if timed_out and self._gate is not None:
                # The model could not answer in time: at least that long a wait. Counting
                # only answered requests hid the overload from the gate (the ones that
                # finished had, by selection, waited briefly): it kept admitting requests
                # with too little time left, and at 2x capacity most missed their deadline.
                self._gate.observe_miss(held_s * 1000.0)
            elif generated is not None and self._gate is not None:
                self._gate.observe_service(held_s, deadline_s - DEADLINE_LEAD_S - started)
            slot.release(held_s if generated is not None or timed_out else None)
            self._tenant_inflight[tenant] -= 1
            settle(generated)
        fallback = body["fallback"]
        headers = {"X-Ballast-Fallback": fallback or "none"}
        if replayed:
            headers["X-Ballast-Idempotent-Replay"] = "true"
        if req.stream:  # streaming is off at this level: one token event, then done
            done = {k: v for k, v in body.items() if k != "text"}
            events = _sse("token", {"text": body["text"], "tokens": body["tokens_generated"]}) + _sse("done", done)
            return Response(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    async def _enter_gate(self, criticality: Criticality, tenant: str, deadline_s: float, settle: Any) -> GateSlot:
        """A slot at the model, or 503 OVERLOADED now (and the quota charge refunded)."""
        if self._gate is None:
            return GateSlot(None)
        try:
            await self._gate.acquire(criticality.rank, deadline_s - DEADLINE_LEAD_S)
        except GateRefused as g:
            settle(None)
            self._stats.shed += 1
            self._count(tenant, criticality.value, "OVERLOADED")
            self._m_gate_refused.inc(tags={"reason": g.reason, "criticality": criticality.value})
            raise Overloaded(
                f"no model capacity for '{criticality.value}' within the request's deadline ({g.reason})",
                retry_after_s=1.0,
            ) from None
        except asyncio.CancelledError:
            settle(None)
            raise
        return GateSlot(self._gate)

    def _settlement(self, tenant: str, bucket: Optional[TokenBucket], cost: int, prompt_tokens: int):
        """The quota's end of a request: refund what was charged but not used."""

        def settle(generated_tokens: Optional[int]) -> None:
            # None: no model work was done for this request (failed, or an idempotent replay).
            actual_tokens = 0 if generated_tokens is None else prompt_tokens + generated_tokens
            if bucket is not None and actual_tokens < cost:
                bucket.refund(cost - actual_tokens)
            elif bucket is not None and actual_tokens > cost:
                bucket.charge_extra(actual_tokens - cost)
            if actual_tokens:
                self._m_tenant_tokens.inc(actual_tokens, tags={"tenant": tenant})

        return settle

    # -- admin: kill switch and chaos ------------------------------------------------
    def _operator(self, request: Request) -> str:
        return (request.headers.get("x-ballast-operator") or "admin")[:64]

    @app.post("/admin/kill-switch", status_code=201)
    async def set_kill_switch(self, request: Request) -> JSONResponse:
        self._require_admin(request)
        body = _validate(KillSwitchRequest, await self._read_json(request))
        entry = await self._controller(
            "set_kill_switch", body.scope, body.value, body.reason, body.expires_in_s, self._operator(request)
        )
        await self._exchange.exchange_once()  # this router enforces it at once
        return JSONResponse(entry, status_code=201)

    @app.get("/admin/kill-switch")
    async def list_kill_switches(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        return await self._controller("kill_switches")

    @app.delete("/admin/kill-switch/{entry_id}")
    async def delete_kill_switch(self, entry_id: str, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if not await self._controller("delete_kill_switch", entry_id, self._operator(request)):
            raise NotFound(f"no active kill switch {entry_id!r}")
        await self._exchange.exchange_once()
        return {"deleted": entry_id}

    @app.post("/admin/chaos")
    async def set_chaos(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if not self._cfg.chaos.enabled:
            raise ChaosDisabled("chaos hooks are disabled in this deployment's config (chaos.enabled)")
        body = _validate(ChaosRequest, await self._read_json(request))
        settings = body.model_dump(exclude={"target"})
        chaos = await self._controller("set_chaos", body.target, settings, self._operator(request))
        return {"chaos": chaos}

    @app.post("/admin/recycle", status_code=202)
    async def recycle(self, request: Request) -> JSONResponse:
        """Ask for replicas to be recycled: they go in turn, under the planner's rules."""
        self._require_admin(request)
        body = _validate(RecycleRequest, await self._read_json(request))
        if body.replica_id is None and not body.all:
            raise InvalidRequest("name a replica_id, or set all: true", field="replica_id")
        marked = await self._controller("request_recycle", body.replica_id, body.deployment, body.all, self._operator(request))
        return JSONResponse({"accepted": marked}, status_code=202)

    @app.get("/admin/replicas")
    async def replicas(self, request: Request) -> dict[str, Any]:
        """Every replica as its watchdog sees it, plus recycles in flight and recent events."""
        self._require_admin(request)
        return await self._controller("replica_status")

    @app.delete("/admin/chaos")
    async def clear_chaos(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if not self._cfg.chaos.enabled:
            raise ChaosDisabled("chaos hooks are disabled in this deployment's config (chaos.enabled)")
        await self._controller("clear_chaos", self._operator(request))
        return {"chaos": {}}

    # -- model calls -----------------------------------------------------------------
    def _finish(self, tenant: str, crit: str, code: str, started: float, error: bool) -> None:
        """``error``: whether the outcome counts for the level (policies/request.py's
        ``counts_as_error``)."""
        self._stats.requests += 1
        if code == "DEADLINE_EXCEEDED":
            self._m_deadline.inc()
        if error:
            self._stats.errors += 1
        self._count(tenant, crit, code)
        self._m_latency.observe((time.monotonic() - started) * 1000.0, tags={"criticality": crit})

    def _add_wait(self, wait_ms: float, fallback: Optional[str]) -> None:
        """A wait for the model: for the controller's report, and (primary only) the gate's limit."""
        self._stats.add_wait(wait_ms)
        if self._gate is not None and fallback is None:
            self._gate.observe_wait(wait_ms)

    async def _call_unary(
        self, call: dict[str, Any], tenant: str, crit: str, started: float, deadline_s: float
    ) -> tuple[dict[str, Any], Optional[str]]:
        self._stats.inflight += 1
        sent = time.monotonic()
        try:
            result, fallback = await asyncio.wait_for(
                self._caller.unary(call, deadline_s, self._kill_switches, time.time()),
                timeout=max(0.001, deadline_s - sent),
            )
        except asyncio.CancelledError:  # client went away
            self._finish(tenant, crit, "CANCELLED", started, error=False)
            raise
        except asyncio.TimeoutError:
            err = DeadlineExceeded(f"no answer within {deadline_s - started:.3f}s")
            self._finish(tenant, crit, err.code, started, error=request_policy.counts_as_error(err.code, err.status))
            raise err from None
        except BallastError as err:
            self._finish(tenant, crit, err.code, started, error=request_policy.counts_as_error(err.code, err.status))
            raise
        finally:
            self._stats.inflight -= 1
        # Everything but the replica's compute time was waiting: handle queue + batch queue.
        elapsed_ms = (time.monotonic() - sent) * 1000.0
        wait_ms = max(0.0, elapsed_ms - float(result.get("compute_ms", 0.0)))
        self._add_wait(wait_ms, fallback)
        self._finish(tenant, crit, "OK", started, error=False)
        return result, fallback

    async def _stream(
        self,
        call: dict[str, Any],
        meta: dict[str, Any],
        tenant: str,
        crit: str,
        started: float,
        deadline_s: float,
        settle: Any,
        slot: GateSlot,
    ) -> AsyncGenerator[bytes, None]:
        self._stats.inflight += 1
        self._tenant_inflight[tenant] = self._tenant_inflight.get(tenant, 0) + 1
        sent = time.monotonic()
        tokens = 0
        code, error = "OK", False
        try:
            chunks, fallback = await self._caller.stream(call, deadline_s, self._kill_switches, time.time())
            done = {**meta, "fallback": fallback}
            if fallback == "fallback_model" and self._cfg.fallback is not None:
                done["model"] = self._cfg.fallback.model.name
            async for chunk in chunks:
                if "queue_wait_ms" in chunk:
                    self._add_wait((time.monotonic() - sent) * 1000.0, fallback)
                tokens += chunk["tokens"]
                yield _sse("token", {"text": chunk["text"], "tokens": chunk["tokens"]})
            yield _sse("done", {"tokens_generated": tokens, **done})
        except asyncio.CancelledError:  # client went away
            code = "CANCELLED"
            raise
        except BallastError as err:
            # A KILL_SWITCH mid-stream counts as an error here, unlike on the unary path:
            # kept as it was (issue 16 moves the rule, it does not change it).
            code, error = err.code, request_policy.counts_as_error(err.code, err.status, kill_switch_counts=True)
            yield _sse("error", err.body())
        finally:
            slot.release()  # a stream's length is the client's reading too: no service-time sample
            self._stats.inflight -= 1
            self._tenant_inflight[tenant] -= 1
            settle(tokens if tokens else None)
            self._finish(tenant, crit, code, started, error=error)


def router_deployment(cfg):
    r = cfg.deployments.router
    return serve.deployment(
        Router,
        name=ROUTER_DEPLOYMENT,
        num_replicas=r.num_replicas,
        max_ongoing_requests=r.max_ongoing_requests,
        max_queued_requests=r.max_queued_requests,
        ray_actor_options={"num_cpus": r.num_cpus},
        logging_config={"enable_access_log": cfg.http.access_log},
    )
