"""The router's way to a model: bulkhead → breaker → attempt with timeout → retry → fallback.

``ResilientCaller`` holds one ``Backend`` per model deployment (primary, then the
optional fallback), each with its own circuit breaker and bulkhead, a shared
retry budget, and the optional response cache. It is the only layer that
retries: the model replicas never retry, and the Serve handle is given one
attempt at a time.

Chain for a unary request:
  for each backend not taken out by a model kill switch:
      bulkhead full or breaker open → next backend
      attempt with timeout min(attempt_timeout_s, deadline left); on a retryable
      failure (backpressure, attempt timeout) retry with full-jitter backoff while
      the retry budget, the attempt limit and the deadline allow; on a lost replica
      (its actor or node gone) send it again at once, within the migration limit,
      the retry budget and the deadline (ballast/policies/migration.py)
      → success: the answer (and the cache is fed)
  then the cache (the same tenant's identical call, where enabled) → else 503 MODEL_UNAVAILABLE
  (503 REPLICA_LOST when what failed was lost capacity).

Streaming follows the same chain up to the first chunk; after that the stream
is committed to its backend. A lost replica mid-stream is a migration: the prompt
and the token ids already delivered go to another replica of the same backend,
which prefills them and continues (``ModelCall.resumed``: the first ``text_chars``
characters of its text are the client's already, so it sends only what follows); the client sees
one stream. Any other failure, or a migration past the limit or the deadline, ends
the stream with an error event.

A lost replica is capacity that is gone, not a sick model: its attempts neither
trip the breaker nor count toward the level's error rate (``on_lost_capacity``
counts them on their own). So is a silent one: an attempt that timed out on a replica
whose heartbeat stopped as well (``hedging.ServeReplicas``) is sent again at once,
passing that replica over, as a dead replica's would be.

Hedges (``ballast.policies.hedge``): an attempt with no answer (unary), no first chunk or
no next chunk (streams) after the model's learned delay goes to another replica as well,
within the hedge budget and only while the router says the call may be hedged (its
model's level sheds nothing); the first answer wins and the other is cancelled, reaching
its engine as any cancellation does. A stream's hedge carries it on from the tokens
already delivered, as a migration does. The request is still one request: its
idempotency key, quota and gate slot are the router's, above this layer.

Everything here runs on the router's event loop thread; breakers, bulkheads and
the budget are touched only between awaits, never across one.

Time comes in through the constructor (STYLE 2): ``clock`` for deadlines and
durations, ``wall_clock`` for the instant the replica is given, ``sleep`` for the
backoff and ``racer`` for the attempts' waits (asyncio's by default). The unit tests
pass fakes that move one fake clock, so a 15 s attempt timeout takes no time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ballast.config import BallastConfig
from ballast.errors import (
    BallastError,
    DeadlineExceeded,
    KillSwitchActive,
    ModelUnavailable,
    ReplicaLost,
)
from ballast.model.protocol import ModelCall, ModelChunk, ModelResult, Resume
from ballast.policies import hedge, killswitch, migration
from ballast.policies.breaker import CircuitBreaker, Permit
from ballast.policies.deadline import MIN_ATTEMPT_S, attempt_timeout_s
from ballast.policies.engines import honours
from ballast.policies.retry import NO_SLOT, RetryBudget, RetrySlot, backoff_s, should_retry
from ballast.router.calls import CACHE, FALLBACK_MODEL, NO_HOOKS, CallHooks, CallSpec, Opened, Reply
from ballast.router.hedging import AllFailed, Racer, Replicas, ReplicaSilent, ServeReplicas, Try, worst
from ballast.router.resilience_parts import (
    BREAKER_FAILURES,
    Bulkhead,
    ResponseCache,
    classify,
    refused_by_engine,
    uncached,
)

# An attempt that timed out on a replica whose heartbeat had stopped too: capacity lost
# (sent again elsewhere, as a dead replica's), counted apart in ``Backend.failed``.
SILENT = "replica_silent"


@dataclass
class Backend:
    role: str  # "primary" | "fallback"
    model_name: str
    handle: Any
    breaker: CircuitBreaker
    bulkhead: Bulkhead
    engine: str = "builtin"  # its model.backend: what it honours of a call (ballast.policies.engines)
    stream_handle: Any = field(init=False)
    # Failed attempts by kind since start (keys: classify()'s few kinds): what a breaker
    # counted, and what it was spared, for /v1/status.
    failed: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.stream_handle = self.handle.options(stream=True)


class _BackendFailed(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail


class ResilientCaller:
    def __init__(
        self,
        cfg: BallastConfig,
        primary: Any,
        fallback: Any = None,
        hooks: CallHooks = NO_HOOKS,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        model: str | None = None,
        racer: Any = None,
        replicas: Replicas | None = None,
    ):
        """The caller to model ``model`` (None: the config's first) and its fallback.
        ``racer`` races attempts (``hedging.Racer``: asyncio's); ``replicas`` says where an
        attempt went and whether that replica went silent (``hedging.ServeReplicas``)."""
        r = cfg.resilience
        served = cfg.served_model(model) if model is not None else cfg.models[0]
        fallback_cfg = cfg.fallback_of(served.name)
        self._cfg = cfg
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._racer = racer if racer is not None else Racer()
        self._replicas: Replicas = replicas or ServeReplicas(r.hedge.silent_after_s)
        self._silent_after_s = r.hedge.silent_after_s
        self._rng = rng or random.Random()
        self._hooks = hooks
        bcfg = r.breaker.breaker_config()
        self.retry_cfg = r.retry.retry_config()
        self.budget = RetryBudget(self.retry_cfg)
        hedge_cfg = r.hedge.hedge_config()
        self.hedge_delay = hedge.HedgeDelay(hedge_cfg)  # the primary's and the fallback's waits alike
        self.hedges = hedge.HedgeBudget(hedge_cfg)
        self.migration_cfg = migration.MigrationConfig(limit=r.migration_limit)
        # Attempts lost with their replica since start: sent again or carried on elsewhere
        # ("migrated"; "streams_carried_on" of them continued a stream mid-way), or not
        # (the limit, the deadline or the retry budget said no: the fallback, else 503).
        self.lost = {"migrated": 0, "not_migrated": 0, "streams_carried_on": 0}
        self.backends = [
            Backend(
                "primary",
                served.name,
                primary,
                CircuitBreaker("primary", bcfg, clock=clock, rng=self._rng, on_event=hooks.on_breaker_event),
                Bulkhead(r.bulkhead.primary),
                served.backend,
            )
        ]
        if fallback is not None and fallback_cfg is not None:
            self.backends.append(
                Backend(
                    "fallback",
                    fallback_cfg.model.name,
                    fallback,
                    CircuitBreaker("fallback", bcfg, clock=clock, rng=self._rng, on_event=hooks.on_breaker_event),
                    Bulkhead(r.bulkhead.fallback),
                    fallback_cfg.model.backend,
                )
            )
        self.cache = (
            ResponseCache(r.cache.max_entries, r.cache.ttl_s, clock, r.cache.max_entries_per_tenant)
            if r.cache.enabled
            else None
        )

    # -- helpers ---------------------------------------------------------------------
    @staticmethod
    def _enter(
        b: Backend, kill_switches: list[killswitch.KillSwitchEntry], now_wall_s: float, skipped: list[tuple[str, Any]]
    ) -> bool:
        """May this request use ``b``? Not if a model kill switch covers it or its bulkhead is
        full (then ``skipped`` says why); True means a bulkhead slot is now held."""
        entry = killswitch.model_blocked(kill_switches, now_wall_s, b.model_name)
        if entry is not None:
            skipped.append(("kill_switch", entry))
            return False
        if not b.bulkhead.try_enter():
            skipped.append(("bulkhead_full", b.role))
            return False
        return True

    def _unavailable(self, skipped: list[tuple[str, Any]]) -> BallastError:
        kills = [e for kind, e in skipped if kind == "kill_switch"]
        if kills and len(kills) == len(self.backends):
            return KillSwitchActive(f"model '{kills[0].value}' is switched off: {kills[0].reason}")
        reasons = ", ".join(f"{k}:{e}" for k, e in skipped if k != "kill_switch") or "no backend"
        kinds = {k for k, _ in skipped}
        if migration.LOST_CAPACITY in kinds and not kinds & BREAKER_FAILURES:
            # Capacity that went away, not a model that failed: the level does not count it.
            return ReplicaLost(
                f"the replica holding the request went away and no other could take it ({reasons})", retry_after_s=1.0
            )
        waits = [b.breaker.retry_after_s() for b in self.backends if b.breaker.retry_after_s() > 0]
        return ModelUnavailable(f"no model backend could answer ({reasons})", retry_after_s=min(waits, default=1.0))

    def _failed(self, b: Backend, permit: Permit, exc: BaseException, t0: float) -> str:
        """Tell the breaker about a failed attempt (health failures count, load does not)."""
        kind = classify(exc)
        b.failed[kind] = b.failed.get(kind, 0) + 1
        if kind in BREAKER_FAILURES:
            b.breaker.record(permit, False, self._clock() - t0)
        else:
            b.breaker.release(permit)
        return kind

    def _attempt_timeout(self, left_s: float) -> float:
        return attempt_timeout_s(left_s, self._cfg.resilience.attempt_timeout_s)

    def can_fall_back(self, kill_switches: list[killswitch.KillSwitchEntry], now_wall_s: float) -> bool:
        """A fallback model that could take a call now: configured, not switched off, its
        breaker not open and its bulkhead not full. What lets the router send a
        critical_plus request that the primary cannot take to the fallback alone."""
        for b in self.backends:
            if b.role == "fallback":
                return (
                    killswitch.model_blocked(kill_switches, now_wall_s, b.model_name) is None
                    and b.breaker.retry_after_s() <= 0
                    and b.bulkhead.in_flight < b.bulkhead.limit
                )
        return False

    def _chain(self, spec: CallSpec) -> list[Backend]:
        """The backends this call may try, in order: none whose engine would ignore part of
        it (a fallback model never answers a JSON-schema request with free text)."""
        call, fallback_only = spec.call, spec.fallback_only
        # A client's resume (its ids are the primary model's tokens), or a call only the primary may answer.
        if call.resume is not None or spec.primary_only:
            chain = [] if fallback_only else [b for b in self.backends if b.role == "primary"]
        else:
            chain = [b for b in self.backends if b.role == "fallback"] if fallback_only else self.backends
        return [b for b in chain if honours(b.engine, call.asks)]

    async def _first_backend(
        self, spec: CallSpec, start: Callable[[Backend], Awaitable[Any]], hold: bool
    ) -> tuple[tuple[Backend, Any] | None, list[tuple[str, Any]]]:
        """(the first backend of the call's chain whose ``start(b)`` answers, with that
        answer, or None; why each backend before it was passed over). Each backend is
        entered first (kill switch, breaker, bulkhead); its bulkhead slot is left when it
        fails, and when it answers unless ``hold`` (a stream keeps it until it ends). The
        walk counts as one active request in the retry budget."""
        skipped: list[tuple[str, Any]] = []
        self.budget.on_request_start()
        try:
            for b in self._chain(spec):
                if not self._enter(b, spec.kill_switches, spec.now_wall_s, skipped):
                    continue
                try:
                    answer = await start(b)
                except _BackendFailed as f:
                    b.bulkhead.leave()
                    skipped.append((f.kind, b.role))
                    continue
                except BaseException:
                    b.bulkhead.leave()
                    raise
                if not hold:
                    b.bulkhead.leave()
                return (b, answer), skipped
            return None, skipped
        finally:
            self.budget.on_request_end()

    def _answered_by(self, b: Backend) -> tuple[str | None, str]:
        """(the fallback kind of an answer from ``b``: None for the primary, reported; the
        model that answered)."""
        if b.role == "primary":
            return None, b.model_name
        self._hooks.on_fallback(FALLBACK_MODEL)
        return FALLBACK_MODEL, b.model_name

    # -- unary -----------------------------------------------------------------------
    async def unary(self, spec: CallSpec) -> Reply:
        """The answer and who gave it; raises a BallastError when nothing can answer."""
        found, skipped = await self._first_backend(spec, lambda b: self._attempts(b, spec), hold=False)
        if found is not None:
            b, result = found
            if self.cache is not None and spec.tenant is not None and not uncached(spec.call):
                self.cache.put(spec.tenant, spec.call, result)
            return Reply(result, *self._answered_by(b))
        # The cache holds the models' earlier answers: a model an operator switched
        # off must not keep answering through it.
        if (
            self.cache is not None
            and spec.tenant is not None
            and not spec.primary_only
            and not any(kind == "kill_switch" for kind, _ in skipped)
        ):
            hit = self.cache.get(spec.tenant, spec.call)
            if hit is not None:
                self._hooks.on_fallback(CACHE)
                return Reply(hit, CACHE, self.backends[0].model_name)
        raise self._unavailable(skipped)

    async def _attempts(self, b: Backend, spec: CallSpec) -> ModelResult:
        def send(left_s: float, avoid: tuple[str, ...]) -> tuple[Any, Any]:
            response = b.handle.generate.remote(spec.call.for_attempt(left_s, self._wall_clock()).avoiding(avoid))
            return response, response

        _, answer, permit, t0 = await self._first_answer(b, spec, send, unary=True)
        b.breaker.record(permit, True, self._clock() - t0)
        result: ModelResult = answer  # the replica's generate answers a ModelResult (Any across Ray)
        return result

    async def _first_answer(
        self,
        b: Backend,
        spec: CallSpec,
        send: Callable[[float, tuple[str, ...]], tuple[Any, Any]],
        unary: bool,
    ) -> tuple[Any, Any, Permit, float]:
        """Attempts on ``b`` until one answers: (its call, its first answer, its breaker
        permit, its start). ``send(left_s, avoid)`` starts an attempt (passing over the
        replicas ``avoid`` names) and returns (the call, which can be cancelled; what to await
        for its first answer). Each attempt may be hedged (``_race``). What follows a failed
        attempt is ``_next_try``'s; a call sent again after its replica went away waits for
        its answer up to its deadline, not one attempt's timeout: the replica left to take
        it may be the one Serve is starting, and a timeout then is capacity gone."""
        attempt = 1
        slot = NO_SLOT  # a retry's slot in the budget, while one is held
        avoid: tuple[str, ...] = ()  # replicas found silent: the next attempts pass them over
        try:
            while True:
                permit = b.breaker.allow()
                if permit is None:
                    raise _BackendFailed("breaker_open", b.role)
                left = spec.deadline_s - self._clock()
                if left <= MIN_ATTEMPT_S:
                    b.breaker.release(permit)
                    raise DeadlineExceeded("the request's deadline passed")
                first = self._try(send, left, avoid, permit)
                timeout_s = left if spec.record.migrations else self._attempt_timeout(left)
                try:
                    won = await self._race(b, spec, first, timeout_s, send, hedge.UNARY if unary else hedge.FIRST_CHUNK)
                    return won.handle, won.value, won.permit, won.t0
                except AllFailed as failed:
                    avoid += failed.silent
                    slot.release()
                    # A re-send after a silent attempt, which was cancelled, adds no load: no
                    # retry slot for it (a dead replica's unary re-send takes one, as before).
                    pause, attempt, slot = self._next_try(b, failed.kind, attempt, spec, unary and not failed.silent)
                    await self._sleep(pause)
        finally:
            slot.release()

    def _try(
        self,
        send: Callable[[float, tuple[str, ...]], tuple[Any, Any]],
        left_s: float,
        avoid: tuple[str, ...],
        permit: Permit,
        is_hedge: bool = False,
    ) -> Try:
        t0 = self._clock()
        handle, answer = send(left_s, avoid)
        return Try(handle, self._racer.start(answer), permit, t0, is_hedge)

    async def _race(
        self,
        b: Backend,
        spec: CallSpec,
        first: Try,
        timeout_s: float,
        send: Callable[[float, tuple[str, ...]], tuple[Any, Any]],
        wait: str,
    ) -> Try:
        """``first`` and, when it shows nothing for the model's hedge delay, a hedge on another
        replica: the first to answer wins and the other is cancelled (its permit given back:
        neither a success nor a failure). Each ends at its own attempt timeout; every
        quarter of ``silent_after_s`` the wait looks whether an attempt's replica went silent, and gives
        that one up then as lost capacity (a short deadline leaves no time to wait out the
        attempt's timeout before sending it again). Raises AllFailed when every attempt failed,
        an engine's refusal as it is."""
        tries, ends = [first], [first.t0 + timeout_s]
        delay = self._hedge_delay(spec, wait)
        hedge_at = first.t0 + delay if delay is not None and delay < timeout_s else None
        kinds: list[str] = []
        silent: list[str] = []
        hedged = False
        try:
            while tries:
                now, end = self._clock(), max(ends)
                until = min(end, now + self._silent_after_s / 4, hedge_at if hedge_at is not None else end)
                i = await self._racer.first([t.pending for t in tries], until - now)
                if i is None and self._clock() < end:
                    if hedge_at is not None and self._clock() >= hedge_at:
                        hedge_at = None
                        h = self._hedge(b, spec, send, first.handle)
                        if h is not None:
                            hedged = True
                            tries.append(h)
                            ends.append(h.t0 + self._attempt_timeout(spec.deadline_s - h.t0))
                    for t in [t for t in tries if self._gone_silent(b, t, elsewhere=True)]:
                        ends.pop(tries.index(t))
                        tries.remove(t)
                        kinds.append(migration.LOST_CAPACITY)
                        silent.append(self._lost_silent(b, t))
                    continue
                if i is None:
                    while tries:
                        t = tries.pop()
                        ends.pop()
                        kind, replica = self._timed_out(b, t)
                        kinds.append(kind)
                        silent += [replica] if replica is not None else []
                    break
                t = tries.pop(i)
                ends.pop(i)
                try:
                    t.value = self._racer.outcome(t.pending)
                except asyncio.CancelledError:
                    tries.append(t)  # settled with the rest below
                    raise
                except Exception as exc:
                    t.handle.cancel()
                    refused = refused_by_engine(exc)
                    if refused is not None:  # this request as sent: no retry, no fallback, not a health failure
                        b.breaker.release(t.permit)
                        raise refused from None
                    kinds.append(self._failed(b, t.permit, exc, t.t0))
                    continue
                self.hedge_delay.observe(wait, self._clock() - t.t0, spec.call.max_tokens)
                self.hedges.won += t.hedge
                return t
        finally:
            for t in tries:  # the losers; every attempt when the caller went away
                t.handle.cancel()
                self._racer.drop(t.pending)
                b.breaker.release(t.permit)
            if hedged:
                self.hedges.release()
        raise AllFailed(worst(kinds), tuple(silent))

    def _hedge_delay(self, spec: CallSpec, wait: str) -> float | None:
        """How long an attempt of ``spec`` waits for progress before it is hedged; None: not
        hedged (the call may not be, or the model's waits are not learned yet)."""
        return self.hedge_delay.delay_s(wait, spec.call.max_tokens) if spec.hedge else None

    def _hedge(
        self, b: Backend, spec: CallSpec, send: Callable[[float, tuple[str, ...]], tuple[Any, Any]], of: Any
    ) -> Try | None:
        """A hedge of the attempt ``of`` (its call) sent by ``send``, passing over the replica
        that attempt went to, if another replica is heard from, the budget and the breaker
        allow one and time is left for it; None otherwise (a hedge on the same replica would
        only double its work)."""
        left = spec.deadline_s - self._clock()
        replica = self._replicas.placed(of)
        if replica is None or not self._replicas.others(b.model_name, replica):
            return None
        if left <= MIN_ATTEMPT_S or not self.hedges.try_acquire(self.budget.active):
            return None
        permit = b.breaker.allow()
        if permit is None:
            self.hedges.release()
            return None
        self._hooks.on_hedge(b.role)
        return self._try(send, left, (replica,), permit, is_hedge=True)

    def _gone_silent(self, b: Backend, t: Try, elsewhere: bool = False) -> bool:
        """Whether the replica attempt ``t`` went to has gone silent (or Serve dropped it);
        ``elsewhere``: and another replica is heard from (giving up an attempt on a model's
        only replica would send it back there, its progress lost)."""
        replica = self._replicas.placed(t.handle)
        if replica is None or not self._replicas.silent(b.model_name, replica):
            return False
        return not elsewhere or self._replicas.others(b.model_name, replica) > 0

    def _lost_silent(self, b: Backend, t: Try) -> str:
        """Attempt ``t`` given up on its silent replica: cancelled, its permit given back (lost
        capacity, not a failure), counted as ``replica_silent``; returns the replica."""
        t.handle.cancel()
        self._racer.drop(t.pending)
        b.failed[SILENT] = b.failed.get(SILENT, 0) + 1
        b.breaker.release(t.permit)
        replica = self._replicas.placed(t.handle)
        assert replica is not None
        return replica

    def _timed_out(self, b: Backend, t: Try) -> tuple[str, str | None]:
        """An attempt that reached its timeout: cancelled, and counted as lost capacity when its
        replica went silent (its heartbeat stopped too: (LOST_CAPACITY, the replica)), else as
        the timeout it is."""
        if self._gone_silent(b, t):
            return migration.LOST_CAPACITY, self._lost_silent(b, t)
        t.handle.cancel()
        self._racer.drop(t.pending)
        return self._failed(b, t.permit, asyncio.TimeoutError(), t.t0), None

    def _next_try(
        self, b: Backend, kind: str, attempt: int, spec: CallSpec, budgeted: bool
    ) -> tuple[float, int, RetrySlot]:
        """After an attempt that failed with ``kind``: (the pause, the next attempt's number,
        the retry slot now held, if any). A lost replica is sent again elsewhere without
        using up an attempt (``budgeted``: inside the retry budget, as a dead replica's unary
        re-send is; a stream's within its migration limit); anything else is an ordinary
        retry. Raises DeadlineExceeded past the deadline, _BackendFailed when no attempt may
        follow."""
        if kind == "deadline_exceeded" or self._clock() >= spec.deadline_s:
            raise DeadlineExceeded("the request's deadline passed") from None
        if kind == migration.LOST_CAPACITY:
            pause, slot = self._migration_pause(b, spec, budget=budgeted)
            return pause, attempt, slot
        pause, slot = self._retry_pause(b, kind, attempt, spec.deadline_s)
        return pause, attempt + 1, slot

    def _retry_pause(self, b: Backend, kind: str, attempt: int, deadline_s: float) -> tuple[float, RetrySlot]:
        """The backoff before an ordinary retry of attempt ``attempt`` that failed with
        ``kind``, and the retry slot it holds (the caller releases it); raises _BackendFailed
        when the retry policy, the deadline or the retry budget says no."""
        pause = backoff_s(attempt, self.retry_cfg, self._rng.random)
        ok, _ = should_retry(kind, attempt, deadline_s - self._clock(), pause, MIN_ATTEMPT_S, self.retry_cfg)
        slot = self.budget.retry_slot() if ok else None
        if slot is None:
            raise _BackendFailed(kind, b.role)
        self._hooks.on_retry(b.role, kind)
        return pause, slot

    def _migration_pause(self, b: Backend, spec: CallSpec, budget: bool) -> tuple[float, RetrySlot]:
        """The pause before migrating a call that lost its replica, and the retry slot it
        holds (``budget``: a unary re-send takes one; the caller releases it); raises
        _BackendFailed when the limit, the deadline or the retry budget says no."""
        record = spec.record
        pause = migration.pause_s(record.migrations + 1, self._rng.random())
        ok, _ = migration.should_migrate(
            record.migrations, self.migration_cfg, spec.deadline_s - self._clock(), pause, MIN_ATTEMPT_S
        )
        slot = (self.budget.retry_slot() if budget else NO_SLOT) if ok else None
        if slot is None:
            self.lost["not_migrated"] += 1
            self._hooks.on_lost_capacity(b.role, "not_migrated")
            raise _BackendFailed(migration.LOST_CAPACITY, b.role)
        record.migrations += 1
        self.lost["migrated"] += 1
        self._hooks.on_lost_capacity(b.role, "migrated")
        return pause, slot

    # -- streaming -------------------------------------------------------------------
    async def stream(self, spec: CallSpec) -> Opened:
        """The stream's chunks (the first already fetched) and who gives them.

        The chain applies until a backend yields its first chunk; from then on the
        stream belongs to that backend, whose replicas may carry it on (migrations,
        counted in ``spec.record``).
        """
        # An active request in the retry budget until the stream is open.
        found, skipped = await self._first_backend(spec, lambda b: self._open(b, spec, spec.call), hold=True)
        if found is None:
            raise self._unavailable(skipped)
        b, opened = found
        return Opened(self._rest(b, opened, spec), *self._answered_by(b))

    async def _open(self, b: Backend, spec: CallSpec, call: ModelCall) -> _Open:
        """A stream of ``call`` on ``b`` with its first chunk. A lost replica is tried again
        elsewhere (a migration); an attempt that failed otherwise (its first chunk timed out
        on a replica cut off from this router, say) is retried as a unary attempt is, inside
        the retry budget."""
        gen, first, permit, t0 = await self._first_answer(b, spec, self._stream_sender(b, call), unary=False)
        if call is not spec.call:
            first = first.without_wait()  # a migrated stream's: not a new request's wait
        return _Open(gen, permit, first, t0)

    def _stream_sender(self, b: Backend, call: ModelCall) -> Callable[[float, tuple[str, ...]], tuple[Any, Any]]:
        """What starts a stream attempt of ``call`` on ``b``: (its generator; its first chunk)."""

        def send(left_s: float, avoid: tuple[str, ...]) -> tuple[Any, Any]:
            gen = b.stream_handle.generate_stream.remote(call.for_attempt(left_s, self._wall_clock()).avoiding(avoid))
            return gen, gen.__anext__()

        return send

    async def _carry_on(
        self, b: Backend, spec: CallSpec, ids: list[int], chars: int, avoid: tuple[str, ...] = ()
    ) -> _Open:
        """The stream opened again, after the migration pause, from the ``ids`` and ``chars``
        it delivered, passing over the replicas ``avoid`` names; one that cannot go on ends
        the stream (``_StreamEnded``)."""
        try:
            await self._sleep(self._migration_pause(b, spec, budget=False)[0])
            return await self._open(b, spec, spec.call.resumed(Resume(tuple(ids), chars)).avoiding(avoid))
        except _BackendFailed as f:
            raise _StreamEnded(
                ReplicaLost(
                    f"the stream's replica went away and it could not be carried on ({f.kind})", retry_after_s=1.0
                )
            ) from None
        except DeadlineExceeded:
            raise _StreamEnded(DeadlineExceeded("the request's deadline passed while streaming")) from None

    async def _rest(self, b: Backend, opened: _Open, spec: CallSpec) -> AsyncGenerator[ModelChunk, None]:
        gen, chunk, t0 = opened.gen, opened.first, opened.t0
        permit: Permit | None = opened.permit  # None once given back (a migration's lost attempt)
        # The stream's token ids and characters so far (a client's resume brings its own):
        # what a migration prefills and does not send again.
        resume = spec.call.resume
        delivered_ids: list[int] = list(resume.ids) if resume is not None else []
        delivered_chars = resume.text_chars if resume is not None else 0
        outcome: bool | None = None  # None: the client left, which says nothing about the backend
        try:
            while True:
                delivered_ids.extend(chunk.ids)
                delivered_chars += len(chunk.text)
                yield chunk
                try:
                    chunk, opened = await self._next_chunk(b, spec, opened, delivered_ids, delivered_chars)
                    gen, permit, t0 = opened.gen, opened.permit, opened.t0
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise
                except Exception as exc:
                    silent = exc.replica if isinstance(exc, ReplicaSilent) else None
                    if silent is None and classify(exc) != migration.LOST_CAPACITY:
                        raise
                    gen.cancel()
                    lost = SILENT if silent is not None else migration.LOST_CAPACITY
                    b.failed[lost] = b.failed.get(lost, 0) + 1
                    b.breaker.release(opened.permit)  # the permit held: ``permit`` is opened's
                    permit = None
                    if spec.call.n > 1:  # a resume carries one choice's ids: several cannot go on
                        raise _StreamEnded(
                            ReplicaLost("the stream's replica went away; a stream of several choices is not carried on")
                        ) from None
                    avoid = (silent,) if silent is not None else ()
                    opened = await self._carry_on(b, spec, delivered_ids, delivered_chars, avoid)
                    gen, permit, chunk, t0 = opened.gen, opened.permit, opened.first, opened.t0
                    self.lost["streams_carried_on"] += 1
            outcome = True
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except asyncio.TimeoutError:
            outcome = False
            raise DeadlineExceeded("the request's deadline passed while streaming") from None
        except _StreamEnded as end:  # a migration that could not go on: its attempts are settled
            raise end.error from None
        except Exception as exc:
            kind = classify(exc)
            outcome = kind not in BREAKER_FAILURES
            if kind == "deadline_exceeded" or isinstance(exc, DeadlineExceeded):
                raise DeadlineExceeded("the request's deadline passed while streaming") from None
            raise ModelUnavailable(f"the model stream failed: {kind}", retry_after_s=1.0) from None
        finally:
            if outcome is not True:
                gen.cancel()
            if permit is not None:
                if outcome is None:
                    b.breaker.release(permit)
                else:
                    b.breaker.record(permit, outcome, self._clock() - t0)
            b.bulkhead.leave()

    async def _next_chunk(
        self, b: Backend, spec: CallSpec, cur: _Open, ids: list[int], chars: int
    ) -> tuple[ModelChunk, _Open]:
        """``cur``'s next chunk. When none comes within the model's hedge delay, a hedge carries
        the stream on from ``ids`` and ``chars`` on another replica, and the first to answer
        wins (the other cancelled, its permit given back). Returns the chunk and the stream it
        came from (a hedge's: a new ``_Open``). Raises what ``cur``'s next raises
        (StopAsyncIteration at its end), asyncio.TimeoutError at the deadline, ReplicaSilent
        when ``cur``'s replica went silent with no hedge under way."""
        t_wait = self._clock()
        pending: Any = self._racer.start(cur.gen.__anext__())
        h: Try | None = None
        hedged = False
        i: int | None = None  # which of ``pending`` and the hedge's ended first; None: not yet
        try:
            delay = self._hedge_delay(spec, hedge.NEXT_CHUNK)
            if delay is not None and t_wait + delay < spec.deadline_s:
                i = await self._racer.first([pending], delay)
                if i is None:
                    h = self._hedge_stream(b, spec, cur, ids, chars)
                    hedged = h is not None
            while True:
                if i is None:
                    racing = [pending] if h is None else [pending, h.pending]
                    wait_s = spec.deadline_s - self._clock()
                    # Unhedged, the wait is looked at every quarter of silent_after_s: a replica
                    # gone silent mid-stream is lost capacity, carried on elsewhere (``ReplicaSilent``).
                    look_s = self._silent_after_s / 4
                    i = await self._racer.first(racing, wait_s if h is not None else min(wait_s, look_s))
                if i is None:
                    if self._clock() >= spec.deadline_s:
                        raise asyncio.TimeoutError()
                    replica = self._replicas.placed(cur.gen) if h is None else None
                    if (
                        replica is not None
                        and self._replicas.silent(b.model_name, replica)
                        and self._replicas.others(b.model_name, replica)
                    ):
                        raise ReplicaSilent(replica)
                    continue
                if i == 0:
                    done, pending = pending, None
                    chunk: ModelChunk = self._racer.outcome(done)
                    self.hedge_delay.observe(hedge.NEXT_CHUNK, self._clock() - t_wait)
                    return chunk, cur
                assert h is not None
                try:
                    first: ModelChunk = self._racer.outcome(h.pending)
                except Exception as exc:  # the hedge failed: the stream waits for ``cur`` alone
                    h.handle.cancel()
                    self._failed(b, h.permit, exc, h.t0)
                    h, i = None, None
                    continue
                cur.gen.cancel()
                self._racer.drop(pending)
                pending = None
                b.breaker.release(cur.permit)  # neither a success nor a failure: it lost the race
                won, h = _Open(h.handle, h.permit, first.without_wait(), h.t0), None
                self.hedges.won += 1
                return won.first, won
        finally:
            if pending is not None:
                self._racer.drop(pending)
            if h is not None:
                h.handle.cancel()
                self._racer.drop(h.pending)
                b.breaker.release(h.permit)
            if hedged:
                self.hedges.release()

    def _hedge_stream(self, b: Backend, spec: CallSpec, cur: _Open, ids: list[int], chars: int) -> Try | None:
        """A hedge of a stream that stalled: carried on from ``ids`` and ``chars`` on another
        replica, if the budget and the breaker allow and time is left; None otherwise (and
        for a stream of several choices, which a resume cannot carry)."""
        if spec.call.n > 1:
            return None
        return self._hedge(b, spec, self._stream_sender(b, spec.call.resumed(Resume(tuple(ids), chars))), cur.gen)


class _StreamEnded(Exception):
    """A stream's migration ended it with ``error`` (its breaker permit already given back)."""

    def __init__(self, error: BallastError):
        super().__init__(error)
        self.error = error


@dataclass
class _Open:
    """A stream on a backend: its generator, breaker permit, first chunk and start time."""

    gen: Any
    permit: Permit
    first: ModelChunk
    t0: float
