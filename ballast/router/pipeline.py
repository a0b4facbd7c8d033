"""The request pipeline every front shares: from an authenticated tenant to an answer.

A front (generate.py's ``/v1/generate``, openai.py's OpenAI routes) reads and bounds
its own body and formats its own answers; everything between is the ``Pipeline``,
which the router builds once (app.py) and the fronts hold. Its public face:

1. ``identify(request)``: ``Authorization: Bearer <key>`` → the tenant (401; the tenant
   is what the key says, never a header the client picks), the deadline (the route's
   default, or ``X-Request-Timeout-Ms`` up to ``resilience.max_deadline_s``) and the
   ``Idempotency-Key``, all checked before anything is charged.
2. ``serve(ModelRequest)``: an ``Answer``, a ``Stream``, or a ``BallastError`` raised.
   0. a ``flex`` request (``service_tier``, ballast/policies/flex.py) takes its own
      deadline (the client's timeout, else the flex maximum) and, unless the model has
      spare capacity now, waits in the model's flex hold (router/flex.py) for its turn,
      holding nothing and offered to no tally; a kill switch refuses it at once;
   a. the class: the criticality claim lowered to the tenant's cap (the answer says so),
      or the tier's (``flex``: sheddable; ``priority``: the tenant's cap);
   b. kill switch (global / tenant / criticality scope: 503 KILL_SWITCH with the reason);
   c. admission: degradation level × criticality (503 OVERLOADED + Retry-After);
      critical_plus that the level (or, in d., the gate) will not give the primary goes
      to the fallback model alone while that one can answer;
   d. ``acquire``: the whole ticket (ticket.py) or a refusal: a place in the tenant's
      concurrency cap (429 CONCURRENCY_LIMIT), the tenant's token quota charged with the
      estimate (429 QUOTA_EXCEEDED), a slot at the gate (gate.py, ballast/policies/gate.py;
      503 OVERLOADED). A refusal gives back what was taken before it.
   e. the model call: ``resilience.ResilientCaller`` (per-backend bulkhead and breaker,
      attempts with timeouts inside the deadline (504), retries within a budget, the
      fallback chain: fallback model → cache → 503 MODEL_UNAVAILABLE).

   A unary request with an Idempotency-Key looks its key up after c. and before d.
   (``router/idempotency.py``): the same key for another request is 422; a repeat of an
   answered key is replayed, of a running one (here or at another router) waits for it
   up to its own deadline (504); neither takes a place, quota or gate slot. Only the
   key's first attempt goes on to d. and e.; if it is refused there, the key is freed.

3. ``serve_batch(ModelRequest, slot)``: one line of a batch (the dispatcher's,
   router/dispatcher.py), at the class ``batch`` below every interactive one. The
   dispatcher decided it may run (level 0, the gate's room) and took its gate slot
   without waiting (``PriorityGate.try_batch``); here: the kill switch (its tenant, or
   the ``sheddable`` class, the lowest a switch names), the length clamped as any
   request's, the tenant's quota charged at ``batch.cost`` (the tenant's ``batch_cost``
   over it) times the model's token cost, then the model call, at the engine's lowest
   priority (``ModelCall.as_batch``: vLLM starts it after every interactive row waiting
   in the engine). It takes no tenant place (interactive requests of the tenant keep
   theirs), is offered to no level's tally and counted in none (its ticket's accounts
   hold a tally nobody reports: batch demand must not move the level), and feeds the
   gate's service samples as any slot does.

Every way out settles the ticket exactly once: the unary path in a ``finally``, a stream
in ``Stream.aclose`` (which the response calls however it ends, ``api.StreamResponse``).
The deadline is one ``ballast.policies.deadline.Deadline`` that every layer reads.

Everything before the model call is in-process and I/O-free: the level comes from the
``SnapshotCache`` that a background exchange keeps fresh, so the controller is never on
the request path and a dead controller fails nothing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from ballast.errors import (
    BallastError,
    ConcurrencyLimited,
    DeadlineExceeded,
    InvalidRequest,
    KillSwitchActive,
    ModelNotFound,
    Overloaded,
    Unauthenticated,
)
from ballast.model.protocol import ModelCall, ModelChunk
from ballast.policies import hedge, killswitch
from ballast.policies import outcome as outcome_policy
from ballast.policies.admission import admit, clamp_max_tokens
from ballast.policies.affinity import route_mode
from ballast.policies.catalog import Target
from ballast.policies.criticality import CRITICALITY_HEADER, ClaimError, Criticality
from ballast.policies.deadline import Deadline
from ballast.policies.flex import FlexQueue, ServiceTier, flex_budget_s, refuse_claim_beside, tier_class
from ballast.router.accounts import Accounts, Outcome
from ballast.router.answered import Admission, Answer, Settled, Stream, StreamState
from ballast.router.api import bearer_token, claimed_criticality
from ballast.router.auth import KeyStore, cache_salts
from ballast.router.calls import CallRecord, CallSpec, Reply
from ballast.router.flex import FlexHold, Sleep, WaitFor, flex_max_wait_s
from ballast.router.gate import BatchSlot, GateRefused, GateSlot
from ballast.router.idempotency import IdempotencyStore, request_fingerprint
from ballast.router.lanes import Lane
from ballast.router.metrics import RouterMetrics
from ballast.router.quotas import Quotas
from ballast.router.tally import Tally
from ballast.router.ticket import Charge, TenantPlaces, Ticket


def tiered_claim(
    request: Request, tier: str | None, from_body: Criticality | None, error: type[InvalidRequest]
) -> tuple[ServiceTier, Criticality]:
    """A front's request's ``service_tier`` (``ServiceTier.parse``) and the class it claims
    (``api.claimed_criticality``); a bad value, or a claim beside a tier that sets the class
    (``policies.flex.refuse_claim_beside``), is ``error`` naming the field."""
    try:
        parsed = ServiceTier.parse(tier)
        refuse_claim_beside(parsed, request.headers.get(CRITICALITY_HEADER), from_body)
    except ClaimError as e:
        raise error(str(e), field=e.field) from None
    except ValueError as e:
        raise error(str(e), field="service_tier") from None
    return parsed, claimed_criticality(request, from_body, error)


#: The class of a batch line in the request metrics: below every interactive class.
BATCH_CLASS = "batch"


@dataclass(frozen=True)
class Caller:
    """Who asks (the tenant its key names), until when, and under which Idempotency-Key;
    ``timeout_s``: the client's own ``X-Request-Timeout-Ms`` as sent (None: none), which a
    flex request's deadline is made from."""

    tenant: str
    deadline: Deadline
    idempotency_key: str | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class ModelRequest:
    """One request as every front hands it to the pipeline: who asks, the class it
    claims, the length it asks for (fitted to the model's context), whether it streams,
    the model call (``call.to_call`` of its front; the pipeline admits its length), and
    its service tier (``flex`` and ``priority`` set the class: the claim is not read)."""

    caller: Caller
    claimed: Criticality
    max_tokens: int
    stream: bool
    call: ModelCall
    tier: ServiceTier = ServiceTier.AUTO

    @property
    def prompt_tokens(self) -> int:
        """What the model prefills: the prompt's ids and a resumed stream's (an embeddings
        call's inputs)."""
        return self.call.input_tokens


class Pipeline:
    """The shared request path: ``identify``, then ``serve``."""

    def __init__(
        self,
        cfg: Any,
        keys: KeyStore,
        cache: Any,
        lanes: dict[str, Lane],
        quotas: Quotas,
        idempotency: IdempotencyStore,
        metrics: RouterMetrics,
        salts: Mapping[str, str] | None = None,
    ) -> None:
        self._cfg = cfg
        self._keys = keys
        # Each tenant's prefix-cache salt (its cache group's, ``policies.cache_groups``): every
        # call carries it, so no tenant's timing tells what another group's prompts hold.
        self._salts = dict(salts) if salts is not None else cache_salts(cfg)
        self.snapshots = cache  # the controller's snapshot (the levels), kept fresh off the request path
        self.lanes = lanes  # one per model, in the config's order (lanes.py)
        # The lane of a request that names no model: the config's first model (its default).
        self.default_lane = next(iter(lanes.values()))
        self.quotas = quotas
        self._idem = idempotency
        self.metrics = metrics
        # The models and adapters, and who may use which: the config's, and the adapters
        # added at run time (the snapshot's, applied by the reporter).
        self.base_catalog = self.catalog = cfg.catalog()
        self.places = TenantPlaces()
        self.kill_switches: list[killswitch.KillSwitchEntry] = []  # from the latest snapshot
        self.holds = {name: self.flex_hold(lane) for name, lane in lanes.items()}  # each model's flex hold
        # Batch lines: their own places (never the tenant's interactive ones) and accounts
        # whose tally no report reads (a batch line moves no level).
        self._batch_places = TenantPlaces()
        self._batch_accounts = {
            name: Accounts(cfg, lane.gate, metrics, Tally(), model=name) for name, lane in lanes.items()
        }

    # -- 1. identity, deadline, idempotency key ---------------------------------------
    def identify(self, request: Request) -> Caller:
        """The tenant, the deadline and the Idempotency-Key of ``request`` (401, 422)."""
        started = time.monotonic()
        token = bearer_token(request)
        if token is None:
            raise Unauthenticated("missing 'Authorization: Bearer <key>' header")
        tenant = self._keys.tenant_for(token)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        timeout_s = self._timeout_s(request)
        r = self._cfg.resilience
        budget_s = r.deadline_s if timeout_s is None else min(timeout_s, r.max_deadline_s)
        return Caller(tenant, Deadline.starting(started, budget_s), self._idempotency_key(request), timeout_s)

    @staticmethod
    def _timeout_s(request: Request) -> float | None:
        """The client's ``X-Request-Timeout-Ms`` in seconds (None: not sent); 422 when bad."""
        raw = request.headers.get("x-request-timeout-ms")
        if raw is None:
            return None
        # ASCII digits only: str.isdigit() also takes "²" and other digits int() refuses.
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 12) or int(raw) <= 0:
            raise InvalidRequest("X-Request-Timeout-Ms: must be a positive integer", field="X-Request-Timeout-Ms")
        return int(raw) / 1000.0

    def _idempotency_key(self, request: Request) -> str | None:
        key = request.headers.get("idempotency-key")
        limit = self._cfg.resilience.idempotency.max_key_chars
        if key is not None and not (0 < len(key) <= limit):
            raise InvalidRequest(f"Idempotency-Key: 1 to {limit} characters", field="Idempotency-Key")
        return key

    # -- 2. the model ----------------------------------------------------------------------
    def target(self, caller: Caller, name: str | None) -> tuple[Lane, Target]:
        """The lane and the model/adapter that ``name`` (a request's ``model`` field; None:
        the default model) means for the caller's tenant: 404 model_not_found when it names
        nothing served or nothing the tenant may use (alike, ``policies/catalog.py``)."""
        catalog, asked = self.catalog, name if name is not None else self.default_lane.name
        target = catalog.target_for(caller.tenant, asked)
        if target is None or target.model not in self.lanes:
            raise ModelNotFound.named(asked, [entry.id for entry in catalog.listed_for(caller.tenant)])
        return self.lanes[target.model], target

    def lane(self, call: ModelCall) -> Lane:
        """The lane of the model ``call`` names (the default lane when it names none)."""
        return self.lanes[call.model] if call.model is not None else self.default_lane

    # -- 3. admission ---------------------------------------------------------------------
    async def serve(self, req: ModelRequest) -> Answer | Stream:
        """The request admitted and sent: a ``Stream`` when it asked for one and the level
        allows streaming, else an ``Answer``; a refusal or failure as a BallastError. A
        unary request with an Idempotency-Key goes through ``_keyed``; a flex request
        waits for its turn first (``_flex_turn``)."""
        if req.tier is ServiceTier.FLEX:
            req = await self._flex_turn(req)
        key = req.caller.idempotency_key
        lane = self.lane(req.call)
        if key is not None and not (req.stream and self.snapshots.effective(lane.name).constraints.streaming):
            return await self._keyed(req, key)
        admission, ticket = await self.acquire(req)
        call = self._admitted(req, lane, admission)
        if req.stream and admission.streaming:
            state = StreamState(lane.name)
            return Stream(admission, ticket, self._stream_chunks(ticket, call, state), state)
        return Answer(admission, await self._settled_unary(ticket, call))

    def _admitted(self, req: ModelRequest, lane: Lane, admission: Admission) -> ModelCall:
        """The call as admitted: its length, how it may be routed, its tenant's cache salt, its tenant."""
        tenant = req.caller.tenant
        return req.call.admitted(admission.max_tokens, self._route(lane, admission), self._salts[tenant], tenant)

    def _route(self, lane: Lane, admission: Admission) -> str:
        """How the model's request router may place the call (``affinity.route_mode``)."""
        routing = self._cfg.served_model(lane.name).routing
        return route_mode(admission.criticality.value, admission.level, routing.balance_from_level)

    async def acquire(self, req: ModelRequest) -> tuple[Admission, Ticket]:
        """The admission and its whole ticket, or a refusal with nothing held."""
        admission, fallback_only = self._admit(req)
        return admission, await self._ticket(req, admission.criticality, admission.max_tokens, fallback_only)

    def _admit(self, req: ModelRequest) -> tuple[Admission, bool]:
        """What the level makes of the request (and whether only the fallback may answer
        it), or a refusal (kill switch, level), counted; nothing is held either way."""
        tenant, lane = req.caller.tenant, self.lane(req.call)
        tenant_cfg = self._cfg.tenants[tenant]
        criticality, lowered = tier_class(req.tier, req.claimed, tenant_cfg.max_criticality)
        crit = criticality.value
        now_wall = time.time()
        self._refuse_if_switched_off(lane, tenant, crit, now_wall, req.call.adapter)
        eff = self.snapshots.effective(lane.name)
        self.metrics.level.set(eff.level, tags={"model": lane.name})
        fallback_only = self._level_admits(lane, tenant, criticality, eff, now_wall)
        admission = self._admission(req, lane, eff, criticality, lowered, req.tier.served)
        return admission, fallback_only

    @staticmethod
    def _admission(
        req: ModelRequest,
        lane: Lane,
        eff: Any,
        criticality: Criticality,
        lowered: bool,
        tier: ServiceTier,
        batch: bool = False,
    ) -> Admission:
        """What the level ``eff`` makes of an admitted request: its length clamped, whether it
        may stream (a batch line never does), and why its answer is smaller than asked."""
        clamped, _ = clamp_max_tokens(req.max_tokens, eff.constraints, lane.max_tokens)
        reasons = outcome_policy.degraded_reasons(
            requested_max_tokens=req.max_tokens,
            level_max_tokens=eff.constraints.max_tokens,
            model_max_tokens=lane.max_tokens,
            lowered=lowered,
            stream_requested=req.stream and not batch,
            streaming_allowed=eff.constraints.streaming,
        )
        streaming = eff.constraints.streaming and not batch
        return Admission(criticality, eff.level, clamped, streaming, req.prompt_tokens, tuple(reasons), tier)

    async def _ticket(
        self, req: ModelRequest, criticality: Criticality, max_tokens: int, fallback_only: bool
    ) -> Ticket:
        """The tenant's place, the quota charge, the gate slot: all three, or a refusal
        that gives back what it had taken (counted under its code)."""
        tenant, crit, lane = req.caller.tenant, criticality.value, self.lane(req.call)
        cap = self._tenant_cap(tenant)
        if not self.places.take(tenant, cap):
            lane.accounts.refused(tenant, crit, "CONCURRENCY_LIMIT")
            raise ConcurrencyLimited(f"tenant '{tenant}' has {cap} requests in flight", retry_after_s=1.0)
        charge: Charge | None = None
        try:
            # Every choice may run to max_tokens: the charge and the fair share count them all.
            charge = self.quotas.charge(tenant, req.prompt_tokens, max_tokens * req.call.n, lane.cost_per_token)
            lane.tally.offer(crit)  # demand within quota: a tenant over its quota must not degrade everyone else
            slot = GateSlot(None)
            if not fallback_only:
                slot, fallback_only = await self._gate_slot(
                    lane, criticality, req.caller.deadline, tenant, (req.prompt_tokens, max_tokens * req.call.n)
                )
        except BaseException as err:
            self.places.give_back(tenant)
            if charge is not None:
                charge.settle(None)
            lane.accounts.refused(tenant, crit, err.code if isinstance(err, BallastError) else "CANCELLED")
            raise
        return Ticket(tenant, crit, req.caller.deadline, self.places, charge, slot, fallback_only, lane.accounts)

    def _tenant_cap(self, tenant: str) -> int:
        """The tenant's concurrency cap at this router (its places; its held flex requests)."""
        return int(self._cfg.tenants[tenant].max_concurrent or self._cfg.resilience.bulkhead.per_tenant)

    # -- 3. admission: the flex tier's hold ---------------------------------------------
    async def _flex_turn(self, req: ModelRequest) -> ModelRequest:
        """A flex request when its turn comes (at once when its model has spare capacity and
        nothing is held before it), with its flex deadline: the client's timeout, else
        ``flex_max_wait_s``, from its arrival. A kill switch refuses it at once, as any
        request. While held it takes nothing and is offered to no tally (spare-capacity
        work must not raise the level); a refusal here is counted in the request metrics
        alone. The class, the ticket and the gate's slot come after, as for any request,
        with no await between the turn's check of the room and the gate taking it (but for
        an Idempotency-Key's lookup, which may wait: then the gate decides as for any
        sheddable request)."""
        lane, tenant, crit = self.lane(req.call), req.caller.tenant, Criticality.SHEDDABLE.value
        self._refuse_if_switched_off(lane, tenant, crit, time.time(), req.call.adapter)
        caller = req.caller
        deadline = Deadline.starting(
            caller.deadline.started_s, flex_budget_s(caller.timeout_s, flex_max_wait_s(self._cfg))
        )
        # The last instant it may start: its time at the model still ahead of it.
        service_s = lane.gate.expected_service_s if lane.gate is not None else 0.0
        code = "CANCELLED"  # the client went away while held, unless something below says otherwise
        try:
            await self.holds[lane.name].turn(tenant, deadline.gate_until_s - service_s, self._tenant_cap(tenant))
            code = ""
        except BallastError as err:
            code = err.code
            raise
        finally:
            if code:
                lane.accounts.refused(tenant, crit, code)
        return replace(req, caller=replace(caller, deadline=deadline))

    def flex_hold(
        self,
        lane: Lane,
        clock: Callable[[], float] = time.monotonic,
        wait_for: WaitFor = asyncio.wait_for,
        sleep: Sleep = asyncio.sleep,
    ) -> FlexHold:
        """The flex hold of ``lane``'s model: bounded as its gate's wait line
        (``resilience.gate.max_waiting``), ticking on the snapshot interval, its room
        ``_flex_room``'s (tests pass a fake clock, timer and sleep)."""
        return FlexHold(
            FlexQueue(self._cfg.resilience.gate.max_waiting, clock),
            functools.partial(self._flex_room, lane),
            self._cfg.controller.report_interval_s,
            lane.name,
            clock,
            wait_for,
            sleep,
        )

    def _flex_room(self, lane: Lane) -> int:
        """The flex requests the model can start now: none while its level does not admit
        ``sheddable``, or its gate has a line, or keeps its reserve for critical traffic
        (it would not give sheddable a slot at once); else its free slots (without a gate:
        every held one and a newcomer)."""
        eff = self.snapshots.effective(lane.name)
        if not admit(Criticality.SHEDDABLE, eff.level, eff.constraints).admitted:
            return 0
        gate = lane.gate
        if gate is None:
            return len(self.holds[lane.name].queue) + 1
        if gate.waiting or gate.reserving():
            return 0
        return max(0, gate.limit.value - gate.in_flight)

    def _refuse_if_switched_off(self, lane: Lane, tenant: str, crit: str, now_wall: float, adapter: str | None) -> None:
        """503 KILL_SWITCH for a request a live entry refuses outright: global, its tenant,
        its class, or its adapter (a model's entry takes the model out of its fallback
        chain instead: resilience.py)."""
        blocked = killswitch.blocking(self.kill_switches, now_wall, tenant, crit)
        if blocked is None and adapter is not None:
            blocked = killswitch.model_blocked(self.kill_switches, now_wall, adapter)
        if blocked is not None:
            lane.accounts.refused(tenant, crit, "KILL_SWITCH")
            raise KillSwitchActive(
                f"kill switch {blocked.id} ({blocked.scope}): {blocked.reason}",
                retry_after_s=max(1.0, blocked.expires_at_s - now_wall),
            )

    def _level_admits(self, lane: Lane, tenant: str, criticality: Criticality, eff: Any, now_wall: float) -> bool:
        """Whether the model's level admits the class: False when it does; True when only
        the fallback may answer it; refused (503 OVERLOADED, counted as demand turned away) else."""
        decision = admit(criticality, eff.level, eff.constraints)
        if decision.admitted:
            return False
        if self._fallback_may_answer(lane, criticality, now_wall):
            return True
        crit = criticality.value
        lane.tally.offer(crit)  # demand the level turned away
        lane.tally.shed += 1
        lane.accounts.refused(tenant, crit, "OVERLOADED")
        # With one model, the words HAProxy's edge answers with too (edge.py).
        whose = f"model {lane.name!r}: " if len(self.lanes) > 1 else ""
        raise Overloaded(
            f"{whose}degradation level {eff.level} does not admit criticality '{crit}'", decision.retry_after_s
        )

    def _fallback_may_answer(self, lane: Lane, criticality: Criticality, now_wall: float) -> bool:
        """critical_plus that the model will not take goes to its fallback alone, if it can answer."""
        return criticality is Criticality.CRITICAL_PLUS and lane.caller.can_fall_back(self.kill_switches, now_wall)

    async def _gate_slot(
        self, lane: Lane, criticality: Criticality, deadline: Deadline, tenant: str, cost: tuple[int, int]
    ) -> tuple[GateSlot, bool]:
        """(a slot at the model, False); refused: (no slot, True) when the fallback alone
        may answer (critical_plus it can answer), else 503 OVERLOADED. Counted in the
        report interval the gate decided in. ``cost`` (prompt tokens, max_tokens) is what
        the slot charges the tenant's fair-share counter."""
        gate, tally = lane.gate, lane.tally
        if gate is None:
            return GateSlot(None), False
        try:
            share = await gate.acquire(criticality.rank, deadline.gate_until_s, tenant, cost)
        except GateRefused as g:
            self.metrics.gate_refused.inc(
                tags={"reason": g.reason, "criticality": criticality.value, "model": lane.name}
            )
            if self._fallback_may_answer(lane, criticality, time.time()):
                tally.decided(criticality.value, through=True)  # answered, by the fallback
                return GateSlot(None), True
            tally.decided(criticality.value, through=False)
            tally.shed += 1
            raise Overloaded(
                f"no capacity of model {lane.name!r} for '{criticality.value}' within the request's deadline "
                f"({g.reason})",
                retry_after_s=1.0,
            ) from None
        tally.decided(criticality.value, through=True)
        return GateSlot(gate, share, criticality.rank), False

    # -- 3. a batch line -------------------------------------------------------------------
    def batch_cost(self, tenant: str) -> float:
        """What a batch token costs ``tenant`` in its quota, as a multiple of an online one:
        its ``batch_cost``, else ``batch.cost``."""
        own = self._cfg.tenants[tenant].batch_cost
        return float(own if own is not None else self._cfg.batch.cost)

    async def serve_batch(self, req: ModelRequest, slot: BatchSlot | GateSlot) -> Answer:
        """One batch line run on ``slot`` (taken by the dispatcher; released here, whatever
        happens): the module docstring's step 3, its call at the engine's lowest priority
        (``ModelCall.as_batch``: after every interactive row waiting in a vLLM engine).
        Refusals raise as for any request (the kill switch's 503, the quota's 429), with the
        slot given back."""
        lane, tenant = self.lane(req.call), req.caller.tenant
        try:
            self._refuse_if_switched_off(lane, tenant, Criticality.SHEDDABLE.value, time.time(), req.call.adapter)
            eff = self.snapshots.effective(lane.name)
            admission = self._admission(req, lane, eff, Criticality.SHEDDABLE, False, ServiceTier.DEFAULT, batch=True)
            per_token = lane.cost_per_token * self.batch_cost(tenant)
            charge = self.quotas.charge(tenant, req.prompt_tokens, admission.max_tokens * req.call.n, per_token)
        except BaseException:
            slot.release()
            raise
        self._batch_places.take(tenant, 1 << 30)  # counted only, never capped: the dispatcher bounds the rows
        ticket = Ticket(
            tenant,
            BATCH_CLASS,
            req.caller.deadline,
            self._batch_places,
            charge,
            slot,
            False,
            self._batch_accounts[lane.name],
        )
        call = self._admitted(req, lane, admission).as_batch()
        return Answer(admission, await self._settled_unary(ticket, call, send=self._call_batch))

    async def _call_batch(self, ticket: Ticket, call: ModelCall, record: CallRecord) -> Reply:
        """A batch line's model call: the resilient caller alone (no tally, no wait sample), its
        own model only (no fallback, no cache: a failure is retried from the queue)."""
        # A batch line waits in its queue anyway: no hedge for it.
        spec = replace(self._spec(ticket, call, record), primary_only=True, hedge=False)
        return await self.lane(call).caller.unary(spec)

    # -- 3. the model call ----------------------------------------------------------------
    async def _keyed(self, req: ModelRequest, key: str) -> Answer:
        """A unary request with an Idempotency-Key: admitted by the level first (kill
        switch, class), then the key is looked up (``IdempotencyStore.run``) before anything
        is taken. Only the key's first attempt acquires a ticket and calls the model; a
        repeat holds no place, quota, gate slot or model capacity while it waits (up to its
        own deadline) and none when it is replayed. A repeat is counted in the request
        metrics under its outcome, not in the level's tally (it asked nothing of the model:
        neither its replays nor its waits may move the level)."""
        admission, fallback_only = self._admit(req)
        call = self._admitted(req, self.lane(req.call), admission)
        ran = False

        async def first_attempt() -> Settled:
            nonlocal ran
            ran = True  # counted from here on by the ticket (or its refusal)
            ticket = await self._ticket(req, admission.criticality, admission.max_tokens, fallback_only)
            return await self._settled_unary(ticket, call)

        started_s = time.monotonic()
        outcome = "CANCELLED"  # the client went away, unless something below says otherwise
        try:
            settled, replayed = await self._idem.run(
                req.caller.tenant,
                key,
                first_attempt,
                within_s=req.caller.deadline.left_s(started_s),
                fingerprint=request_fingerprint(req.call, req.max_tokens),
            )
            outcome = "OK"
        except BallastError as err:
            outcome = err.code
            raise
        finally:
            if not ran:
                self.lane(req.call).accounts.answered(
                    req.caller.tenant, admission.criticality.value, outcome, req.caller.deadline.started_s
                )
        if replayed:
            self.metrics.replays.inc()
        return Answer(admission, settled, replayed)

    async def _settled_unary(
        self, ticket: Ticket, call: ModelCall, send: Callable[[Ticket, ModelCall, CallRecord], Any] | None = None
    ) -> Settled:
        """The model's answer (``send``: the call, ``_call_unary`` unless said), the ticket
        settled here whatever happens."""
        t0 = time.monotonic()
        outcome = Outcome("CANCELLED")  # the client went away, unless something below says otherwise
        try:
            record = CallRecord()
            reply: Reply = await (send or self._call_unary)(ticket, call, record)
            r = reply.result
            outcome = Outcome("OK", generated=r.tokens, service_s=time.monotonic() - t0)
            return Settled(
                r.text,
                r.tokens,
                r.finish_reason,
                reply.fallback,
                reply.model,
                record.migrations,
                r.cached_tokens,
                r.logprobs,
                r.prompt_logprobs,
                r.choices,
                r.embeddings,
            )
        except DeadlineExceeded as err:
            outcome = Outcome(
                err.code,
                error=outcome_policy.counts_as_error(err.code, err.status),
                service_s=time.monotonic() - t0,
                timed_out=True,
            )
            raise
        except BallastError as err:
            outcome = Outcome(err.code, error=outcome_policy.counts_as_error(err.code, err.status))
            raise
        finally:
            ticket.finish(outcome)

    def _spec(self, ticket: Ticket, call: ModelCall, record: CallRecord) -> CallSpec:
        """The call as the resilient caller takes it: bounded by the request's one deadline
        (the caller bounds every attempt, backoff and migration by it: no timer here), and
        hedged only while its model's level sheds nothing (a hedge is load, which an
        overload must not get more of)."""
        eff = self.snapshots.effective(self.lane(call).name)
        sheds = not admit(Criticality.SHEDDABLE, eff.level, eff.constraints).admitted
        return CallSpec(
            call,
            ticket.deadline.at_s,
            self.kill_switches,
            time.time(),
            ticket.fallback_only,
            record,
            ticket.tenant,
            hedge=not sheds,
        )

    async def _call_unary(self, ticket: Ticket, call: ModelCall, record: CallRecord) -> Reply:
        lane = self.lane(call)
        lane.tally.inflight += 1
        sent = time.monotonic()
        try:
            reply = await lane.caller.unary(self._spec(ticket, call, record))
        finally:
            lane.tally.inflight -= 1
        # Everything but the replica's compute time was waiting: handle queue + batch queue.
        elapsed_ms = (time.monotonic() - sent) * 1000.0
        lane.accounts.waited(max(0.0, elapsed_ms - reply.result.compute_ms), primary=reply.fallback is None)
        return reply

    async def _stream_chunks(
        self, ticket: Ticket, call: ModelCall, state: StreamState
    ) -> AsyncGenerator[ModelChunk, None]:
        """The model's chunks; ``state`` says who answered and how much. The ticket is
        settled here once the stream has begun, however it ends."""
        lane = self.lane(call)
        lane.tally.inflight += 1
        sent = time.monotonic()
        outcome = Outcome("OK")
        try:
            opened = await lane.caller.stream(self._spec(ticket, call, state.call))
            state.fallback, state.model = opened.fallback, opened.model
            async for chunk in opened.chunks:
                if chunk.queue_wait_ms is not None:  # a new request's first chunk: it waited until now
                    lane.accounts.waited((time.monotonic() - sent) * 1000.0, primary=state.fallback is None)
                state.tokens += chunk.tokens
                state.finish = chunk.finish_reason or state.finish
                if state.cached_tokens is None:
                    state.cached_tokens = chunk.cached_tokens
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the front has enough)
            outcome = Outcome("OK" if state.enough else "CANCELLED")
            raise
        except BallastError as err:
            outcome = Outcome(err.code, error=outcome_policy.counts_as_error(err.code, err.status))
            raise
        finally:
            lane.tally.inflight -= 1
            # A stream's length is the client's reading too: no service-time sample.
            ticket.finish(Outcome(outcome.code, error=outcome.error, generated=state.tokens or None))

    # -- what /v1/status shows of the request path ------------------------------------------
    def status(self) -> dict[str, Any]:
        """Every model's part of the request path under ``models``, alike (``_lane_status``),
        and what the router shares across them."""
        return {
            "models": {name: self._lane_status(lane) for name, lane in self.lanes.items()},
            "kill_switches": [e.to_dict() for e in self.kill_switches],
            "quotas": self.quotas.status(),
            "tenant_inflight": dict(self.places.held),  # admitted, waiting at the gate or at the model
        }

    def _lane_status(self, lane: Lane) -> dict[str, Any]:
        """One model as this router acts on it: its level, where that comes from and its
        constraints (``SnapshotCache.effective``), its breakers, retry budget, lost capacity
        and gate."""
        caller = lane.caller
        eff = self.snapshots.effective(lane.name)
        return {
            "level": eff.level,
            "source": eff.source,  # snapshot, stale-snapshot or fail-static
            "constraints": eff.constraints.to_dict(),
            "breakers": {b.role: {**b.breaker.snapshot(), "failed_attempts": dict(b.failed)} for b in caller.backends},
            "retry_budget": caller.budget.snapshot(),
            # Hedges since this router started (in flight, limit, sent, denied, won) and the
            # delay each wait is hedged after now (seconds; a unary's for one token; None: not
            # learned yet).
            "hedges": {
                **caller.hedges.snapshot(caller.budget.active),
                "delay_s": {k: caller.hedge_delay.delay_s(k) for k in hedge.KINDS},
            },
            # Attempts whose replica or node went away, since this router started: carried on
            # elsewhere, or not (to the fallback, else 503 REPLICA_LOST). Not model errors:
            # no breaker or level counts them.
            "lost_capacity": dict(caller.lost),
            "gate": lane.gate.snapshot() if lane.gate is not None else None,
            "flex": self.holds[lane.name].view(),  # service_tier flex requests held for spare capacity
        }
