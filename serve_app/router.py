"""The router deployment: Ballast's HTTP ingress (FastAPI under Ray Serve).

Request path for ``POST /v1/generate`` (DESIGN.md "The request path"):

1. authenticate: ``Authorization: Bearer <key>`` → tenant (401); the tenant is what
   the key says, never a header the client picks
2. body bounded (413) and validated (422, naming the field)
3. admission: current degradation level × criticality (503 OVERLOADED + Retry-After)
4. clamp to the level's constraints (max_tokens, streaming) and say so in the answer
5. call the model deployment with a deadline (504), map its refusals (503)

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
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from policies.admission import admit, clamp_max_tokens
from policies.criticality import DEFAULT_CRITICALITY, Criticality

from .config import KeyStore, load_config
from .controller import ROUTER_DEPLOYMENT, ControllerLink
from .errors import (
    BallastError,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    ModelUnavailable,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthenticated,
)
from .snapshot import SnapshotCache, SnapshotExchange

log = logging.getLogger("ballast.router")

MAX_WAIT_SAMPLES = 4096  # queue-wait samples kept between two reports


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    max_tokens: int = Field(64, ge=1)
    criticality: Criticality = DEFAULT_CRITICALITY
    stream: bool = False


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
        waits = sorted(self.waits_ms)
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else None
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
    def __init__(self, model: Any, cfg: dict[str, Any]):
        self._cfg = load_config(cfg)
        self._keys = KeyStore.from_config(self._cfg)
        self._model = model
        self._stream_model = model.options(stream=True)
        c = self._cfg.controller
        self._cache = SnapshotCache(
            self._cfg.degradation_config(), c.snapshot_stale_s, c.snapshot_max_stale_s, c.fail_static_level
        )
        self._stats = _Stats()
        self._router_id = f"router-{uuid.uuid4().hex[:8]}"
        self._link = ControllerLink(self._cfg)
        self._exchange = SnapshotExchange(
            self._cache,
            call=lambda report: self._link.call("report_router", report),
            make_report=lambda: {"router_id": self._router_id, **self._stats.drain()},
            interval_s=c.report_interval_s,
            timeout_s=c.call_timeout_s,
        )
        self._model_max_tokens = self._cfg.model.architecture.max_seq_len - 1
        self._limits = self._cfg.limits

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
        if not isinstance(data, dict):
            raise InvalidRequest("body must be a JSON object", field="body")
        try:
            req = GenerateRequest.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "body"
            raise InvalidRequest(f"{field}: {first['msg']}", field=field) from None
        if req.max_tokens > self._limits.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens: must be <= {self._limits.max_tokens_limit}", field="max_tokens"
            )
        if len(req.prompt.encode("utf-8")) > self._limits.max_prompt_bytes:
            raise PayloadTooLarge(f"prompt exceeds {self._limits.max_prompt_bytes} bytes")
        return req

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
        }

    @app.post("/v1/generate")
    async def generate(self, request: Request):
        self._exchange.start()
        started = time.monotonic()
        tenant = self._tenant(request)
        req = self._parse(await self._read_body(request))
        crit = req.criticality.value
        eff = self._cache.effective()
        self._m_level.set(eff.level)
        decision = admit(req.criticality, eff.level, eff.constraints)
        if not decision.admitted:
            self._stats.shed += 1
            self._count(tenant, crit, "OVERLOADED")
            raise Overloaded(
                f"degradation level {eff.level} does not admit criticality '{crit}'", decision.retry_after_s
            )
        max_tokens, _ = clamp_max_tokens(req.max_tokens, eff.constraints, self._model_max_tokens)
        # Clamped by the level is degradation; clamped by the model's context is not.
        reasons = ["max_tokens_clamped"] if eff.constraints.max_tokens < min(req.max_tokens, self._model_max_tokens) else []
        if req.stream and not eff.constraints.streaming:
            reasons.append("streaming_disabled")
        meta = {
            "model": self._cfg.model.name,
            "degradation_level": eff.level,
            "degraded": bool(reasons),
            "degraded_reasons": reasons,
            "max_tokens": max_tokens,
        }
        call = {"prompt": req.prompt, "max_tokens": max_tokens}
        if req.stream:
            return StreamingResponse(
                self._stream(call, meta, tenant, crit, started, as_one_event=not eff.constraints.streaming),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        result = await self._call_unary(call, tenant, crit, started)
        return {"text": result["text"], "tokens_generated": result["tokens"], **meta}

    # -- model calls -----------------------------------------------------------------
    def _map_error(self, exc: BaseException) -> BallastError:
        if isinstance(exc, BallastError):
            return exc
        if isinstance(exc, asyncio.TimeoutError):
            return DeadlineExceeded(f"no answer within {self._limits.request_timeout_s:g}s")
        if isinstance(exc, BackPressureError):
            return ModelUnavailable("model queue is full", retry_after_s=1.0)
        if isinstance(exc, (DeploymentUnavailableError, ReplicaUnavailableError)):
            return ModelUnavailable("model deployment unavailable", retry_after_s=2.0)
        log.warning("model call failed: %r", exc)
        return ModelUnavailable(f"model call failed: {type(exc).__name__}", retry_after_s=1.0)

    def _finish(self, tenant: str, crit: str, code: str, started: float, error: bool) -> None:
        self._stats.requests += 1
        if error:
            self._stats.errors += 1
        self._count(tenant, crit, code)
        self._m_latency.observe((time.monotonic() - started) * 1000.0, tags={"criticality": crit})

    async def _call_unary(self, call: dict[str, Any], tenant: str, crit: str, started: float) -> dict[str, Any]:
        self._stats.inflight += 1
        sent = time.monotonic()
        response = self._model.generate.remote(call)
        try:
            result = await asyncio.wait_for(response, timeout=self._limits.request_timeout_s)
        except asyncio.CancelledError:  # client went away
            response.cancel()
            self._finish(tenant, crit, "CANCELLED", started, error=False)
            raise
        except Exception as exc:
            response.cancel()
            err = self._map_error(exc)
            # A full queue is the model refusing, not failing: it does not count as an error.
            self._finish(tenant, crit, err.code, started, error=not isinstance(exc, BackPressureError))
            raise err from None
        finally:
            self._stats.inflight -= 1
        # Everything but the replica's compute time was waiting: handle queue + batch queue.
        elapsed_ms = (time.monotonic() - sent) * 1000.0
        self._stats.add_wait(max(0.0, elapsed_ms - float(result.get("compute_ms", 0.0))))
        self._finish(tenant, crit, "OK", started, error=False)
        return result

    async def _stream(
        self, call: dict[str, Any], meta: dict[str, Any], tenant: str, crit: str, started: float, as_one_event: bool
    ) -> AsyncGenerator[bytes, None]:
        if as_one_event:  # streaming disabled at this level: one token event, then done
            try:
                result = await self._call_unary(call, tenant, crit, started)
            except BallastError as err:
                yield _sse("error", err.body())
                return
            yield _sse("token", {"text": result["text"], "tokens": result["tokens"]})
            yield _sse("done", {"tokens_generated": result["tokens"], **meta})
            return
        self._stats.inflight += 1
        sent = time.monotonic()
        gen = self._stream_model.generate_stream.remote(call)
        deadline = sent + self._limits.request_timeout_s
        tokens = 0
        code, error = "OK", False
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(gen.__anext__(), timeout=max(0.001, deadline - time.monotonic()))
                except StopAsyncIteration:
                    break
                if "queue_wait_ms" in chunk:
                    self._stats.add_wait((time.monotonic() - sent) * 1000.0)
                tokens += chunk["tokens"]
                yield _sse("token", {"text": chunk["text"], "tokens": chunk["tokens"]})
            yield _sse("done", {"tokens_generated": tokens, **meta})
        except asyncio.CancelledError:  # client went away
            gen.cancel()
            code = "CANCELLED"
            raise
        except Exception as exc:
            gen.cancel()
            err = self._map_error(exc)
            code, error = err.code, not isinstance(exc, BackPressureError)
            yield _sse("error", err.body())
        finally:
            self._stats.inflight -= 1
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
    )
