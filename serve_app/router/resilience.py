"""The router's way to a model: bulkhead → breaker → attempt with timeout → retry → fallback.

``ResilientCaller`` holds one ``Backend`` per model deployment (primary, then the
optional fallback), each with its own circuit breaker and bulkhead, a shared
retry budget, and the optional response cache. It is the only layer that
retries: the model replicas never retry, and the Serve handle is given one
attempt at a time.

Chain for a unary request (DESIGN.md step 6–8):
  for each backend not taken out by a model kill switch:
      bulkhead full or breaker open → next backend
      attempt with timeout min(attempt_timeout_s, deadline left); on a retryable
      failure (replica died, backpressure, attempt timeout) retry with full-jitter
      backoff while the retry budget, the attempt limit and the deadline allow
      → success: the answer (and the cache is fed)
  then the cache (identical request, where enabled) → else 503 MODEL_UNAVAILABLE.

Streaming follows the same chain up to the first chunk; after that the stream
is committed to its backend and a failure ends it with an error event.

Everything here runs on the router's event loop thread; breakers, bulkheads and
the budget are touched only between awaits, never across one.

Time comes in through the constructor (STYLE 2): ``clock`` for deadlines and
durations, ``wall_clock`` for the instant the replica is given, ``sleep`` for the
backoff and ``wait_for`` for each attempt's timeout (asyncio's by default). The unit
tests pass fakes that move one fake clock, so a 15 s attempt timeout takes no time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from policies import killswitch
from policies.breaker import BreakerEvent, CircuitBreaker, Permit
from policies.deadline import MIN_ATTEMPT_S, attempt_timeout_s
from policies.retry import RetryBudget, backoff_s, should_retry

from serve_app.config import BallastConfig
from serve_app.errors import BallastError, DeadlineExceeded, KillSwitchActive, ModelUnavailable



class Bulkhead:
    """A concurrency limit without a queue: full means "try elsewhere", at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.rejected = 0

    def try_enter(self) -> bool:
        if self.in_flight >= self.limit:
            self.rejected += 1
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


class ResponseCache:
    """Answers to identical calls, bounded in count and age.

    Identical means the whole call: prompt, max_tokens, sampling (temperature, top_p,
    seed), stop strings, how the prompt is tokenized. A cached greedy answer is the
    answer; a cached sampled one is one fair sample, which is what a fallback can give."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._max, self._ttl_s, self._clock = max_entries, ttl_s, clock
        self._entries: "OrderedDict[tuple, tuple[float, dict[str, Any]]]" = OrderedDict()

    @staticmethod
    def key(call: dict[str, Any]) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in call.items()))

    def get(self, call: dict[str, Any]) -> Optional[dict[str, Any]]:
        key = self.key(call)
        hit = self._entries.get(key)
        if hit is None:
            return None
        if self._clock() - hit[0] > self._ttl_s:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return hit[1]

    def put(self, call: dict[str, Any], result: dict[str, Any]) -> None:
        key = self.key(call)
        self._entries[key] = (self._clock(), result)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _deadline_fields(left_s: float, now_wall_s: float) -> dict[str, float]:
    """The attempt's deadline for the replica: relative, and as a wall-clock instant.

    The instant lets the replica count the time the call spent in transit and in
    Serve's queues, so its own answer (``policies.deadline.REPLICA_LEAD_S`` before
    the deadline) still reaches the router before the router's timeout fires. Across
    nodes it relies on synchronized clocks (NTP: milliseconds against a 50 ms lead);
    the replica takes the stricter of the two.
    """
    return {"timeout_s": left_s, "deadline_at_s": now_wall_s + left_s}


def classify(exc: BaseException) -> str:
    """Map a failed attempt to the kinds ``policies.retry.should_retry`` knows."""
    if isinstance(exc, RayTaskError):
        # Raised inside the replica (Ray re-raises it as a subclass of the cause's type,
        # so this comes first: a TimeoutError *in the model* is not our attempt timeout).
        # Judge by the cause: a replica that died under the call is still a replica death.
        cause = exc.cause
        if isinstance(cause, DeadlineExceeded):
            return "deadline_exceeded"
        if isinstance(cause, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)):
            return "replica_died"
        return "model_error"
    if isinstance(exc, asyncio.TimeoutError):
        return "attempt_timeout"
    if isinstance(exc, BackPressureError):
        return "backpressure"
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, ReplicaUnavailableError, DeploymentUnavailableError)):
        return "replica_died"
    if isinstance(exc, DeadlineExceeded):
        return "deadline_exceeded"
    if isinstance(exc, RayActorError):
        return "replica_died"
    return "model_error"


# Failures that say the backend is unhealthy; backpressure is load, which the
# degradation level handles, so it neither trips nor heals a breaker.
BREAKER_FAILURES = {"attempt_timeout", "replica_died", "model_error"}


@dataclass
class Backend:
    role: str  # "primary" | "fallback"
    model_name: str
    handle: Any
    breaker: CircuitBreaker
    bulkhead: Bulkhead
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


@dataclass(frozen=True)
class CallHooks:
    """Metrics hooks; the defaults do nothing (STYLE 8)."""

    on_retry: Callable[[str, str], None] = lambda backend, kind: None
    on_fallback: Callable[[str], None] = lambda kind: None
    on_breaker_event: Callable[[BreakerEvent], None] = lambda e: None


class ResilientCaller:
    def __init__(
        self,
        cfg: BallastConfig,
        primary: Any,
        fallback: Any = None,
        hooks: CallHooks = CallHooks(),
        clock: Callable[[], float] = time.monotonic,
        rng: Optional[random.Random] = None,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        wait_for: Callable[[Awaitable[Any], float], Awaitable[Any]] = asyncio.wait_for,
    ):
        r = cfg.resilience
        self._cfg = cfg
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._wait_for = wait_for
        self._rng = rng or random.Random()
        self._hooks = hooks
        bcfg = r.breaker.breaker_config()
        self.retry_cfg = r.retry.retry_config()
        self.budget = RetryBudget(self.retry_cfg)
        self.backends = [
            Backend(
                "primary",
                cfg.model.name,
                primary,
                CircuitBreaker("primary", bcfg, clock=clock, rng=self._rng, on_event=hooks.on_breaker_event),
                Bulkhead(r.bulkhead.primary),
            )
        ]
        if fallback is not None and cfg.fallback is not None:
            self.backends.append(
                Backend(
                    "fallback",
                    cfg.fallback.model.name,
                    fallback,
                    CircuitBreaker("fallback", bcfg, clock=clock, rng=self._rng, on_event=hooks.on_breaker_event),
                    Bulkhead(r.bulkhead.fallback),
                )
            )
        self.cache = ResponseCache(r.cache.max_entries, r.cache.ttl_s, clock) if r.cache.enabled else None

    # -- helpers ---------------------------------------------------------------------
    @staticmethod
    def _enter(b: Backend, kill_switches: list, now_wall_s: float, skipped: list[tuple[str, Any]]) -> bool:
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
        waits = [b.breaker.retry_after_s() for b in self.backends if b.breaker.retry_after_s() > 0]
        reasons = ", ".join(f"{k}:{e}" for k, e in skipped if k != "kill_switch") or "no backend"
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

    def fallback_name(self, backend: Backend) -> Optional[str]:
        return None if backend.role == "primary" else "fallback_model"

    def can_fall_back(self, kill_switches: list, now_wall_s: float) -> bool:
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

    def _chain(self, fallback_only: bool) -> list[Backend]:
        return [b for b in self.backends if b.role == "fallback"] if fallback_only else self.backends

    # -- unary -----------------------------------------------------------------------
    async def unary(
        self, call: dict[str, Any], deadline_s: float, kill_switches: list, now_wall_s: float, fallback_only: bool = False
    ) -> tuple[dict[str, Any], Optional[str]]:
        """(result, fallback kind or None); raises a BallastError when nothing can answer.

        ``fallback_only``: the primary is not to be asked (the level or the gate refused
        this request there); only the fallback model may answer."""
        self.budget.on_request_start()
        skipped: list[tuple[str, Any]] = []
        try:
            for b in self._chain(fallback_only):
                if not self._enter(b, kill_switches, now_wall_s, skipped):
                    continue
                try:
                    result = await self._attempts(b, call, deadline_s)
                except _BackendFailed as f:
                    skipped.append((f.kind, b.role))
                    continue
                finally:
                    b.bulkhead.leave()
                if self.cache is not None:
                    self.cache.put(call, result)
                kind = self.fallback_name(b)
                if kind:
                    self._hooks.on_fallback(kind)
                return result, kind
            # The cache holds the models' earlier answers: a model an operator switched
            # off must not keep answering through it.
            if self.cache is not None and not any(kind == "kill_switch" for kind, _ in skipped):
                hit = self.cache.get(call)
                if hit is not None:
                    self._hooks.on_fallback("cache")
                    return hit, "cache"
            raise self._unavailable(skipped)
        finally:
            self.budget.on_request_end()

    async def _attempts(self, b: Backend, call: dict[str, Any], deadline_s: float) -> dict[str, Any]:
        attempt = 1
        retrying = False
        try:
            while True:
                permit = b.breaker.allow()
                if permit is None:
                    raise _BackendFailed("breaker_open", b.role)
                left = deadline_s - self._clock()
                if left <= MIN_ATTEMPT_S:
                    b.breaker.release(permit)
                    raise DeadlineExceeded("the request's deadline passed")
                t0 = self._clock()
                response = b.handle.generate.remote({**call, **_deadline_fields(left, self._wall_clock())})
                try:
                    result = await self._wait_for(response, self._attempt_timeout(left))
                except asyncio.CancelledError:
                    response.cancel()
                    b.breaker.release(permit)
                    raise
                except Exception as exc:
                    response.cancel()
                    kind = self._failed(b, permit, exc, t0)
                    if kind == "deadline_exceeded" or self._clock() >= deadline_s:
                        raise DeadlineExceeded("the request's deadline passed") from None
                    pause = backoff_s(attempt, self.retry_cfg, self._rng.random)
                    ok, _ = should_retry(
                        kind, attempt, deadline_s - self._clock(), pause, MIN_ATTEMPT_S, self.retry_cfg
                    )
                    if retrying:
                        self.budget.release_retry()
                        retrying = False
                    if not ok or not self.budget.try_acquire_retry():
                        raise _BackendFailed(kind, b.role) from None
                    retrying = True
                    self._hooks.on_retry(b.role, kind)
                    await self._sleep(pause)
                    attempt += 1
                    continue
                b.breaker.record(permit, True, self._clock() - t0)
                return result
        finally:
            if retrying:
                self.budget.release_retry()

    # -- streaming -------------------------------------------------------------------
    async def stream(
        self, call: dict[str, Any], deadline_s: float, kill_switches: list, now_wall_s: float, fallback_only: bool = False
    ) -> tuple[AsyncIterator[dict[str, Any]], Optional[str]]:
        """An iterator over chunks (the first already fetched) and the fallback kind.

        The chain applies until a backend yields its first chunk; from then on the
        stream belongs to that backend. ``fallback_only`` as for ``unary``.
        """
        skipped: list[tuple[str, Any]] = []
        for b in self._chain(fallback_only):
            if not self._enter(b, kill_switches, now_wall_s, skipped):
                continue
            permit = b.breaker.allow()
            if permit is None:
                b.bulkhead.leave()
                skipped.append(("breaker_open", b.role))
                continue
            left = deadline_s - self._clock()
            if left <= MIN_ATTEMPT_S:
                b.breaker.release(permit)
                b.bulkhead.leave()
                raise DeadlineExceeded("the request's deadline passed")
            t0 = self._clock()
            gen = b.stream_handle.generate_stream.remote({**call, **_deadline_fields(left, self._wall_clock())})
            try:
                first = await self._wait_for(gen.__anext__(), self._attempt_timeout(left))
            except asyncio.CancelledError:
                gen.cancel()
                b.breaker.release(permit)
                b.bulkhead.leave()
                raise
            except Exception as exc:
                gen.cancel()
                kind = self._failed(b, permit, exc, t0)
                b.bulkhead.leave()
                if kind == "deadline_exceeded":
                    raise DeadlineExceeded("the request's deadline passed") from None
                skipped.append((kind, b.role))
                continue
            kind = self.fallback_name(b)
            if kind:
                self._hooks.on_fallback(kind)
            return self._rest(b, permit, gen, first, t0, deadline_s), kind
        raise self._unavailable(skipped)

    async def _rest(self, b: Backend, permit: Permit, gen: Any, first: dict[str, Any], t0: float, deadline_s: float):
        outcome: Optional[bool] = None  # None: the client left, which says nothing about the backend
        try:
            yield first
            while True:
                try:
                    chunk = await self._wait_for(gen.__anext__(), max(0.001, deadline_s - self._clock()))
                except StopAsyncIteration:
                    break
                yield chunk
            outcome = True
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except asyncio.TimeoutError:
            outcome = False
            raise DeadlineExceeded("the request's deadline passed while streaming") from None
        except Exception as exc:
            kind = classify(exc)
            outcome = kind not in BREAKER_FAILURES
            if kind == "deadline_exceeded" or isinstance(exc, DeadlineExceeded):
                raise DeadlineExceeded("the request's deadline passed while streaming") from None
            raise ModelUnavailable(f"the model stream failed: {kind}", retry_after_s=1.0) from None
        finally:
            if outcome is not True:
                gen.cancel()
            if outcome is None:
                b.breaker.release(permit)
            else:
                b.breaker.record(permit, outcome, self._clock() - t0)
            b.bulkhead.leave()
