"""The request pipeline every front shares: from an authenticated tenant to an answer.

A front (``generate.py``'s ``/v1/generate``, ``openai.py``'s OpenAI routes) reads its
own body and formats its own answers; everything between is here, in this order:

1. ``_tenant``: ``Authorization: Bearer <key>`` → tenant (401); the tenant is what the
   key says, never a header the client picks. The front then parses and bounds its
   body (413, 422/400 naming the field) and validates the Idempotency-Key, all before
   anything is charged.
2. ``_admit``:
   a. the criticality claim is lowered to the tenant's cap (the answer says so);
   b. kill switch (global / tenant / criticality scope: 503 KILL_SWITCH with the reason);
   c. admission: degradation level × criticality (503 OVERLOADED + Retry-After);
      critical_plus that the level (or, in e., the gate) will not give the primary goes
      to the fallback model alone while that one can answer;
   d. the admission ticket (``ticket.Ticket``): a place in the tenant's concurrency cap
      (429 CONCURRENCY_LIMIT), then the clamp to the level's constraints and the
      tenant's token quota charged with the estimate (429 QUOTA_EXCEEDED);
   e. the gate (gate.py, policies/gate.py): a slot at the model or 503 OVERLOADED.
3. ``_answer_unary`` (with the Idempotency-Key: a repeat gets the first answer) or
   ``_answer_stream``: ``resilience.ResilientCaller`` — per-backend bulkhead and
   breaker, attempts with timeouts inside the deadline (504), retries within a
   budget, the fallback chain (fallback model → cache → 503 MODEL_UNAVAILABLE).

Every way out settles the ticket exactly once (``Ticket.finish``): the tenant's place,
the quota for the tokens used, the gate slot with its service sample, the outcome's
metrics. The deadline is one ``policies.deadline.Deadline`` that every layer reads.

Everything before step 3 is in-process and I/O-free: the level comes from the
``SnapshotCache`` that a background ``SnapshotExchange`` keeps fresh, so the
controller is never on the request path and a dead controller fails nothing.

``Pipeline`` is a part of the Router deployment (app.py): its methods use the state
that ``Router.__init__`` builds (config, caches, gate, quota buckets, metrics).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from policies import killswitch
from policies import request as request_policy
from policies.admission import admit, clamp_max_tokens
from policies.criticality import Criticality
from policies.deadline import Deadline
from policies.quota import TokenBucket, lease_rate

from serve_app.control.names import ROUTER_DEPLOYMENT
from serve_app.errors import (
    BallastError,
    ConcurrencyLimited,
    DeadlineExceeded,
    InvalidRequest,
    KillSwitchActive,
    Overloaded,
    QuotaExceeded,
    Unauthenticated,
)
from serve_app.router.api import bearer_token
from serve_app.router.gate import GateRefused, GateSlot
from serve_app.router.resilience import CallRecord
from serve_app.router.ticket import Outcome, Ticket


@dataclass
class Admitted:
    """An admitted request: its ticket and what the level made of it."""

    ticket: Ticket
    criticality: Criticality
    level: int
    max_tokens: int  # clamped
    streaming: bool  # the level allows streaming
    degraded_reasons: list[str] = field(default_factory=list)

    def meta(self, model: str) -> dict[str, Any]:
        """What every answer says about how it was admitted."""
        return {
            "model": model,
            "criticality": self.criticality.value,
            "degradation_level": self.level,
            "degraded": bool(self.degraded_reasons),
            "degraded_reasons": self.degraded_reasons,
            "max_tokens": self.max_tokens,
        }


@dataclass
class StreamEnd:
    """Filled in as a stream runs: which backend answered and how many tokens it gave.

    ``enough``: set by the front before it closes the stream early because it has all
    it wants (a stop string): that close is an answer, not a client that left."""

    fallback: Optional[str] = None
    tokens: int = 0
    enough: bool = False
    finish: Optional[str] = None  # the model's: "stop" (end of sequence, a stop string) or "length"
    call: CallRecord = field(default_factory=CallRecord)  # migrations: replicas lost mid-stream

    @property
    def migrations(self) -> int:
        return self.call.migrations


class Pipeline:
    """The shared request path (a part of ``Router``)."""

    # -- 1. identity, deadline, idempotency key ---------------------------------------
    def _tenant(self, request: Request) -> str:
        token = bearer_token(request)
        if token is None:
            raise Unauthenticated("missing 'Authorization: Bearer <key>' header")
        tenant = self._keys.tenant_for(token)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant

    def _deadline(self, request: Request, started: float) -> Deadline:
        """The route default, or less/more on the client's X-Request-Timeout-Ms, never past
        resilience.max_deadline_s."""
        r = self._cfg.resilience
        raw = request.headers.get("x-request-timeout-ms")
        if raw is None:
            return Deadline.starting(started, r.deadline_s)
        if not raw.strip().isdigit() or int(raw) <= 0:
            raise InvalidRequest("X-Request-Timeout-Ms: must be a positive integer", field="X-Request-Timeout-Ms")
        return Deadline.starting(started, min(int(raw) / 1000.0, r.max_deadline_s))

    def _idempotency_key(self, request: Request) -> Optional[str]:
        """The Idempotency-Key header, checked before anything is charged."""
        key = request.headers.get("idempotency-key")
        limit = self._cfg.resilience.idempotency.max_key_chars
        if key is not None and not (0 < len(key) <= limit):
            raise InvalidRequest(f"Idempotency-Key: 1 to {limit} characters", field="Idempotency-Key")
        return key

    # -- 2. admission -------------------------------------------------------------------
    async def _admit(
        self, tenant: str, claimed: Criticality, prompt_tokens: int, max_tokens: int, stream: bool, deadline: Deadline
    ) -> Admitted:
        """``prompt_tokens``: the prompt counted by the model's tokenizer (``tokens.ModelText``)."""
        tenant_cfg = self._cfg.tenants[tenant]
        criticality, lowered = request_policy.lower_criticality(claimed, tenant_cfg.max_criticality)
        crit = criticality.value
        now_wall = time.time()
        self._refuse_if_switched_off(tenant, crit, now_wall)
        eff = self._cache.effective()
        self._metrics.level.set(eff.level)
        fallback_only = self._level_admits(tenant, criticality, eff, now_wall)
        cap = tenant_cfg.max_concurrent or self._cfg.resilience.bulkhead.per_tenant
        if self._tenant_inflight.get(tenant, 0) >= cap:
            self._count(tenant, crit, "CONCURRENCY_LIMIT")
            raise ConcurrencyLimited(f"tenant '{tenant}' has {cap} requests in flight", retry_after_s=1.0)
        ticket = Ticket(tenant, crit, deadline, self._tenant_inflight, self._ticket_finished)
        ticket.fallback_only = fallback_only
        clamped, _ = clamp_max_tokens(max_tokens, eff.constraints, self._model_max_tokens)
        self._charge_quota(ticket, tenant_cfg.rate_tokens_per_s, prompt_tokens, clamped)
        # Demand within quota: a tenant over its quota must not degrade everyone else.
        self._offered[crit] = self._offered.get(crit, 0) + 1
        if not fallback_only:
            try:
                await self._enter_gate(ticket, criticality)
            except Overloaded:
                self._gate_decided(crit, through=False)
                raise
            self._gate_decided(crit, through=True)
        return Admitted(
            ticket=ticket,
            criticality=criticality,
            level=eff.level,
            max_tokens=clamped,
            streaming=eff.constraints.streaming,
            degraded_reasons=request_policy.degraded_reasons(
                requested_max_tokens=max_tokens,
                level_max_tokens=eff.constraints.max_tokens,
                model_max_tokens=self._model_max_tokens,
                lowered=lowered,
                stream_requested=stream,
                streaming_allowed=eff.constraints.streaming,
            ),
        )

    def _refuse_if_switched_off(self, tenant: str, crit: str, now_wall: float) -> None:
        blocked = killswitch.blocking(self._kill_switches, now_wall, tenant, crit)
        if blocked is not None:
            self._count(tenant, crit, "KILL_SWITCH")
            raise KillSwitchActive(
                f"kill switch {blocked.id} ({blocked.scope}): {blocked.reason}",
                retry_after_s=max(1.0, blocked.expires_at_s - now_wall),
            )

    def _level_admits(self, tenant: str, criticality: Criticality, eff: Any, now_wall: float) -> bool:
        """Whether the level admits the class: False when it does; True when only the
        fallback may answer it; refused (503 OVERLOADED, counted as demand turned away) else."""
        decision = admit(criticality, eff.level, eff.constraints)
        if decision.admitted:
            return False
        if self._fallback_may_answer(criticality, now_wall):
            return True
        crit = criticality.value
        self._offered[crit] = self._offered.get(crit, 0) + 1  # demand the level turned away
        self._stats.shed += 1
        self._count(tenant, crit, "OVERLOADED")
        raise Overloaded(f"degradation level {eff.level} does not admit criticality '{crit}'", decision.retry_after_s)

    def _charge_quota(self, ticket: Ticket, rate: Optional[float], prompt_tokens: int, max_tokens: int) -> None:
        """The request's tokens from its tenant's bucket (counted as demand either way); 429 when it cannot pay."""
        tenant = ticket.tenant
        cost = request_policy.token_cost(prompt_tokens, max_tokens)
        bucket = self._bucket(tenant)
        if bucket is not None:
            self._demand_tokens[tenant] = self._demand_tokens.get(tenant, 0.0) + cost
        if not ticket.charge(bucket, cost, prompt_tokens):
            ticket.refuse("QUOTA_EXCEEDED")
            raise QuotaExceeded(
                f"tenant '{tenant}' is over its quota of {rate:g} tokens/s",
                retry_after_s=request_policy.quota_retry_after_s(bucket.retry_after_s(cost)),
            )

    def _fallback_may_answer(self, criticality: Criticality, now_wall: float) -> bool:
        """critical_plus that the primary will not take goes to the fallback alone, if it can answer."""
        return criticality is Criticality.CRITICAL_PLUS and self._caller.can_fall_back(self._kill_switches, now_wall)

    def _gate_decided(self, crit: str, through: bool) -> None:
        """The gate decided one request of ``crit``: counted in the report interval it was
        decided in (a request still waiting is neither; counting it on arrival lost the
        admission of every one that waited across a report, which the edge's throttle
        read as a refusal and began to refuse a class the gate was taking whole)."""
        seen = self._gate_seen_by_class.setdefault(crit, [0, 0])  # [decided at the gate, let through]
        seen[0] += 1
        seen[1] += through

    async def _enter_gate(self, ticket: Ticket, criticality: Criticality) -> None:
        """A slot at the model on the ticket; or, refused, the fallback alone (critical_plus
        it can answer) or 503 OVERLOADED now (the ticket settled)."""
        if self._gate is None:
            return
        try:
            await self._gate.acquire(criticality.rank, ticket.deadline.gate_until_s)
        except GateRefused as g:
            self._metrics.gate_refused.inc(tags={"reason": g.reason, "criticality": criticality.value})
            if self._fallback_may_answer(criticality, time.time()):
                ticket.fallback_only = True
                return
            self._stats.shed += 1
            ticket.refuse("OVERLOADED")
            raise Overloaded(
                f"no model capacity for '{criticality.value}' within the request's deadline ({g.reason})",
                retry_after_s=1.0,
            ) from None
        except asyncio.CancelledError:
            ticket.refuse("CANCELLED")
            raise
        ticket.slot = GateSlot(self._gate)

    def _ticket_finished(self, ticket: Ticket, outcome: Outcome) -> None:
        """A ticket's outcome, once: the gate's service sample, tokens and the request counted."""
        if self._gate is not None and not ticket.fallback_only and outcome.service_s is not None:
            if outcome.timed_out:
                # The model could not answer in time: at least that long a wait. Counting
                # only answered requests hid the overload from the gate (the ones that
                # finished had, by selection, waited briefly): it kept admitting requests
                # with too little time left, and at 2x capacity most missed their deadline.
                self._gate.observe_miss(outcome.service_s * 1000.0)
            elif outcome.generated is not None:
                self._gate.observe_service(outcome.service_s, ticket.deadline.gate_budget_s)
        if outcome.generated is not None:
            used = ticket.prompt_tokens + outcome.generated
            if used:
                self._metrics.tenant_tokens.inc(used, tags={"tenant": ticket.tenant})
        if not outcome.model_called:
            self._count(ticket.tenant, ticket.criticality, outcome.code)
            return
        self._stats.requests += 1
        if outcome.code == "DEADLINE_EXCEEDED":
            self._metrics.deadline.inc()
        if outcome.error:
            self._stats.errors += 1
        self._count(ticket.tenant, ticket.criticality, outcome.code)
        self._metrics.latency.observe((time.monotonic() - ticket.deadline.started_s) * 1000.0, tags={"criticality": ticket.criticality})

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
            self._metrics.tenant_rate.set(rate, tags={"tenant": tenant})
        return bucket

    # -- 3. the model call ----------------------------------------------------------------
    def _answered_by(self, fallback: Optional[str]) -> str:
        if fallback == "fallback_model" and self._cfg.fallback is not None:
            return self._cfg.fallback.model.name
        return self._cfg.model.name

    async def _answer_unary(
        self, admitted: Admitted, call: dict[str, Any], key: Optional[str]
    ) -> tuple[dict[str, Any], bool]:
        """(the answer, whether it is a replay): ``text``, ``tokens``, ``fallback``, ``model``.

        With an Idempotency-Key a repeat gets the first answer whole; a replay did no
        model work, so it costs no quota."""
        ticket = admitted.ticket
        t0 = time.monotonic()

        async def work() -> dict[str, Any]:
            record = CallRecord()
            result, fallback = await self._call_unary(ticket, call, record)
            return {
                "text": result["text"],
                "tokens": result["tokens"],
                "finish_reason": result.get("finish_reason"),
                "fallback": fallback,
                "model": self._answered_by(fallback),
                "migrations": record.migrations,  # sent again after its replica went away
            }

        try:
            if key is None:
                answer, replayed = await work(), False
            else:
                left = ticket.deadline.at_s - time.monotonic()
                answer, replayed = await self._idem.run(ticket.tenant, key, work, within_s=left)
                if replayed:
                    self._metrics.replays.inc()
        except asyncio.CancelledError:  # the client went away
            ticket.finish(Outcome("CANCELLED"))
            raise
        except DeadlineExceeded as err:
            held = time.monotonic() - t0
            ticket.finish(Outcome(err.code, error=request_policy.counts_as_error(err.code, err.status), service_s=held, timed_out=True))
            raise
        except BallastError as err:
            ticket.finish(Outcome(err.code, error=request_policy.counts_as_error(err.code, err.status)))
            raise
        held = time.monotonic() - t0
        generated = None if replayed else int(answer["tokens"])
        ticket.finish(Outcome("OK", generated=generated, service_s=held if generated is not None else None))
        return answer, replayed

    async def _call_unary(
        self, ticket: Ticket, call: dict[str, Any], record: CallRecord
    ) -> tuple[dict[str, Any], Optional[str]]:
        self._stats.inflight += 1
        sent = time.monotonic()
        at = ticket.deadline.at_s
        try:
            result, fallback = await asyncio.wait_for(
                self._caller.unary(call, at, self._kill_switches, time.time(), ticket.fallback_only, record),
                timeout=max(0.001, at - sent),
            )
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no answer within {ticket.deadline.budget_s:.3f}s") from None
        finally:
            self._stats.inflight -= 1
        # Everything but the replica's compute time was waiting: handle queue + batch queue.
        elapsed_ms = (time.monotonic() - sent) * 1000.0
        self._add_wait(max(0.0, elapsed_ms - float(result.get("compute_ms", 0.0))), fallback)
        return result, fallback

    async def _answer_stream(self, admitted: Admitted, call: dict[str, Any], end: StreamEnd) -> AsyncIterator[dict[str, Any]]:
        """The model's chunks (``text``, ``tokens``); ``end`` says who answered and how much.

        A BallastError is raised to the front, which formats it; the ticket is settled
        here whatever happens, including a client that leaves mid-stream."""
        ticket = admitted.ticket
        self._stats.inflight += 1
        sent = time.monotonic()
        outcome = Outcome("OK")
        try:
            chunks, end.fallback = await self._caller.stream(
                call, ticket.deadline.at_s, self._kill_switches, time.time(), ticket.fallback_only, end.call
            )
            async for chunk in chunks:
                if "queue_wait_ms" in chunk:
                    self._add_wait((time.monotonic() - sent) * 1000.0, end.fallback)
                end.tokens += chunk["tokens"]
                end.finish = chunk.get("finish_reason", end.finish)
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the front has enough)
            outcome = Outcome("OK" if end.enough else "CANCELLED")
            raise
        except BallastError as err:
            outcome = Outcome(err.code, error=request_policy.counts_as_error(err.code, err.status))
            raise
        finally:
            self._stats.inflight -= 1
            # A stream's length is the client's reading too: no service-time sample.
            ticket.finish(Outcome(outcome.code, error=outcome.error, generated=end.tokens or None))

    def _add_wait(self, wait_ms: float, fallback: Optional[str]) -> None:
        """A wait for the model: for the controller's report, and (primary only) the gate's limit."""
        self._stats.add_wait(wait_ms)
        if self._gate is not None and fallback is None:
            self._gate.observe_wait(wait_ms)
