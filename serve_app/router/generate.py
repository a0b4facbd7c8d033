"""``POST /v1/generate``: where a native request is admitted, sent to the model and answered.

Request path (DESIGN.md "The request path"), in ``GenerateRoutes.generate``:

1. authenticate: ``Authorization: Bearer <key>`` → tenant (401); the tenant is what
   the key says, never a header the client picks
2. body bounded (413) and validated (422, naming the field); a criticality claim above
   the tenant's cap is lowered (policies/request.py)
3. kill switch (global / tenant / criticality scope: 503 KILL_SWITCH with the reason)
4. admission: current degradation level × criticality (503 OVERLOADED + Retry-After);
   critical_plus that the level or the gate (step 7) will not give the primary goes to
   the fallback model alone while that one can answer (``ResilientCaller.can_fall_back``)
5. per-tenant concurrency bulkhead (429 CONCURRENCY_LIMIT)
6. clamp to the level's constraints (max_tokens, streaming) and say so in the answer;
   the tenant's token quota charged with the estimate (429 QUOTA_EXCEEDED)
7. the gate (gate.py, policies/gate.py): a slot at the model or 503 OVERLOADED
8. Idempotency-Key: a repeat gets the first answer (``idempotency.IdempotencyStore``)
9. ``resilience.ResilientCaller``: per-backend bulkhead and breaker, attempts with
   timeouts inside the overall deadline (504), retries within a budget, the
   fallback chain (fallback model → cache → 503 MODEL_UNAVAILABLE)

Everything before step 7 is in-process and I/O-free: the level comes from the
``SnapshotCache`` that a background ``SnapshotExchange`` keeps fresh, so the
controller is never on the request path and a dead controller fails nothing.

``GenerateRoutes`` is a part of the Router deployment (app.py): its methods use the
state that ``Router.__init__`` builds (config, caches, gate, quota buckets, metrics).
"""

import asyncio
import json
import time
from typing import Any, AsyncGenerator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from policies import killswitch
from policies import request as request_policy
from policies.admission import admit, clamp_max_tokens
from policies.criticality import DEFAULT_CRITICALITY, Criticality
from policies.quota import TokenBucket, lease_rate

from serve_app.control.link import ROUTER_DEPLOYMENT
from serve_app.errors import (
    BallastError,
    ConcurrencyLimited,
    DeadlineExceeded,
    InvalidRequest,
    KillSwitchActive,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    Unauthenticated,
)
from serve_app.router.api import app, bearer_token, read_body, sse_event, validate_body
from serve_app.router.gate import GateRefused, GateSlot
from serve_app.router.resilience import DEADLINE_LEAD_S


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    max_tokens: int = Field(64, ge=1)
    criticality: Criticality = DEFAULT_CRITICALITY
    stream: bool = False


class GenerateRoutes:
    """The generate route and the model calls behind it (a part of ``Router``)."""

    @app.post("/v1/generate")
    async def generate(self, request: Request):
        self._exchange.start()
        started = time.monotonic()
        tenant = self._tenant(request)
        deadline_s = started + self._deadline_s(request)
        req = self._parse(await read_body(request, self._limits.max_body_bytes))
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
        # critical_plus is refused only when neither model can answer it: a level that
        # does not admit it at the primary still sends it to a healthy fallback.
        fallback_only = not decision.admitted and self._fallback_may_answer(req.criticality, now_wall)
        if not decision.admitted and not fallback_only:
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
        slot = GateSlot(None) if fallback_only else await self._enter_gate(req.criticality, tenant, deadline_s, settle)
        if slot is None:  # the gate refused it, the fallback may answer
            slot, fallback_only = GateSlot(None), True
        if req.stream and eff.constraints.streaming:
            return StreamingResponse(
                self._stream(call, meta, tenant, crit, started, deadline_s, settle, slot, fallback_only),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        key = request.headers.get("idempotency-key")
        if key is not None and not (0 < len(key) <= self._cfg.resilience.idempotency.max_key_chars):
            slot.release()
            settle(None)
            raise InvalidRequest("Idempotency-Key: 1 to 200 characters", field="Idempotency-Key")
        async def work() -> dict[str, Any]:
            result, fallback = await self._call_unary(call, tenant, crit, started, deadline_s, fallback_only)
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
            if fallback_only:  # the fallback's timing says nothing about the primary's gate
                pass
            elif timed_out and self._gate is not None:
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
            events = sse_event("token", {"text": body["text"], "tokens": body["tokens_generated"]}) + sse_event("done", done)
            return Response(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    def _fallback_may_answer(self, criticality: Criticality, now_wall: float) -> bool:
        """critical_plus that the primary will not take goes to the fallback alone, if it can answer."""
        return criticality is Criticality.CRITICAL_PLUS and self._caller.can_fall_back(self._kill_switches, now_wall)

    async def _enter_gate(
        self, criticality: Criticality, tenant: str, deadline_s: float, settle: Any
    ) -> Optional[GateSlot]:
        """A slot at the model; None when the gate refused a request the fallback may answer
        (critical_plus); else 503 OVERLOADED now (and the quota charge refunded)."""
        if self._gate is None:
            return GateSlot(None)
        try:
            await self._gate.acquire(criticality.rank, deadline_s - DEADLINE_LEAD_S)
        except GateRefused as g:
            if self._fallback_may_answer(criticality, time.time()):
                self._m_gate_refused.inc(tags={"reason": g.reason, "criticality": criticality.value})
                return None
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

    def _tenant(self, request: Request) -> str:
        token = bearer_token(request)
        if token is None:
            raise Unauthenticated("missing 'Authorization: Bearer <key>' header")
        tenant = self._keys.tenant_for(token)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant

    def _parse(self, body: bytes) -> GenerateRequest:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("body must be a JSON object", field="body") from None
        req = validate_body(GenerateRequest, data)
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
        self, call: dict[str, Any], tenant: str, crit: str, started: float, deadline_s: float, fallback_only: bool = False
    ) -> tuple[dict[str, Any], Optional[str]]:
        self._stats.inflight += 1
        sent = time.monotonic()
        try:
            result, fallback = await asyncio.wait_for(
                self._caller.unary(call, deadline_s, self._kill_switches, time.time(), fallback_only),
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
        fallback_only: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        self._stats.inflight += 1
        self._tenant_inflight[tenant] = self._tenant_inflight.get(tenant, 0) + 1
        sent = time.monotonic()
        tokens = 0
        code, error = "OK", False
        try:
            chunks, fallback = await self._caller.stream(call, deadline_s, self._kill_switches, time.time(), fallback_only)
            done = {**meta, "fallback": fallback}
            if fallback == "fallback_model" and self._cfg.fallback is not None:
                done["model"] = self._cfg.fallback.model.name
            async for chunk in chunks:
                if "queue_wait_ms" in chunk:
                    self._add_wait((time.monotonic() - sent) * 1000.0, fallback)
                tokens += chunk["tokens"]
                yield sse_event("token", {"text": chunk["text"], "tokens": chunk["tokens"]})
            yield sse_event("done", {"tokens_generated": tokens, **done})
        except asyncio.CancelledError:  # client went away
            code = "CANCELLED"
            raise
        except BallastError as err:
            code, error = err.code, request_policy.counts_as_error(err.code, err.status)
            yield sse_event("error", err.body())
        finally:
            slot.release()  # a stream's length is the client's reading too: no service-time sample
            self._stats.inflight -= 1
            self._tenant_inflight[tenant] -= 1
            settle(tokens if tokens else None)
            self._finish(tenant, crit, code, started, error=error)
