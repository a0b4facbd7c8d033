"""ResilientCaller (ballast/router/resilience.py) walked on a fake clock.

The Serve handles are the boundary, so they are fakes here: each call to
``generate.remote`` / ``generate_stream.remote`` takes the next scripted response,
which says how long it takes and how it ends. ``FakeTimer`` stands in for
asyncio's ``wait_for`` and ``sleep``: it moves the fake clock by the time the
response takes (or by the timeout, raising ``asyncio.TimeoutError``, when it takes
longer), so a 4 s attempt timeout costs no real time and every step is asserted
on the clock.

Settings used throughout: attempt timeout 4 s, backoff cap 2 s doubling (the
injected rng draws 0.5, so the pauses are 1 s then 2 s), 3 attempts, a breaker
that opens at 60 % failures over its last 3 calls (so one failure in three does not
open it, two do) for 10 s with one probe.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace
from typing import Any

import pytest
from fakes import FakeClock
from ray.exceptions import ActorDiedError, RayTaskError

from ballast.config import load_config
from ballast.errors import DeadlineExceeded, EngineRefused, ModelUnavailable, ReplicaLost
from ballast.model.protocol import AttemptDeadline, ModelCall, ModelChunk, ModelResult, Resume, RowSampling
from ballast.policies.killswitch import KillSwitchEntry
from ballast.router.calls import CallHooks, CallRecord, CallSpec, Reply
from ballast.router.resilience import ResilientCaller
from ballast.router.resilience_parts import ResponseCache

HANG = math.inf  # a response that never comes
WALL_S = 1_000_000  # the fake wall clock (the replica's deadline instant is stamped with it)
CALL = ModelCall("hello", max_tokens=8)
PRIMARY, FALLBACK = "tiny-decoder", "tiny-decoder-small"  # the config's default model names


class FakeResponse:
    """One scripted reply: it takes ``takes_s`` of fake time, then returns ``result`` (a
    ``ModelResult`` for a unary call, a ``ModelChunk`` for a stream's piece) or raises ``error``."""

    def __init__(
        self, takes_s: float = 1, result: Any = None, error: BaseException | None = None, replica: str | None = None
    ) -> None:
        self.takes_s, self.result, self.error, self.replica = takes_s, result, error, replica
        self.cancelled = False
        self.started_s = 0.0

    def cancel(self) -> None:
        self.cancelled = True

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.result
        yield  # a generator, so that this is awaitable


class FakeStream:
    """A scripted stream: each ``__anext__`` is the next FakeResponse, then StopAsyncIteration."""

    def __init__(self, *steps: FakeResponse, replica: str | None = None) -> None:
        self.steps = list(steps)
        self.cancelled = False
        self.replica = replica

    def __anext__(self) -> FakeResponse:
        return self.steps.pop(0) if self.steps else FakeResponse(0, error=StopAsyncIteration())

    def cancel(self) -> None:
        self.cancelled = True


class FakeMethod:
    def __init__(self, script: list) -> None:
        self.script = script
        self.calls: list[ModelCall] = []

    def remote(self, call: ModelCall) -> Any:
        assert isinstance(call, ModelCall), call
        assert self.script, f"unexpected call {call}"
        self.calls.append(call)
        return self.script.pop(0)


class FakeHandle:
    """A Serve deployment handle: ``generate`` for unary calls, ``generate_stream`` for streams."""

    def __init__(self, *unary: FakeResponse, streams: tuple = ()) -> None:
        self.generate = FakeMethod(list(unary))
        self.generate_stream = FakeMethod(list(streams))

    def options(self, stream: bool = False) -> FakeHandle:
        return self


class FakeReplicas:
    """Where each attempt went (a response's ``replica``, None: not known) and which replicas
    went silent: what the request routers' heartbeats say in the real caller (NAMED FAKE:
    the heartbeats come through Serve, which the unit tests do not run)."""

    def __init__(
        self, *silent: str, clock: FakeClock | None = None, silent_from: dict[str, float] | None = None
    ) -> None:
        self.silent_ones = set(silent)
        self.clock, self.silent_from = clock, silent_from or {}  # replica -> when it is found silent
        self.other_replicas = 1  # replicas heard from besides an attempt's: where a hedge can go

    def placed(self, response: Any) -> str | None:
        return getattr(response, "replica", None)

    def others(self, model: str, besides: str) -> int:
        return self.other_replicas

    def silent(self, model: str, replica: str) -> bool:
        at = self.silent_from.get(replica)
        return replica in self.silent_ones or (at is not None and self.clock is not None and self.clock() >= at)


class FakeTimer:
    """asyncio's wait_for and sleep, and the caller's racer (``hedging.Racer``), on the fake
    clock; records each pause. A started response ends ``takes_s`` after it was started."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.slept_s: list[float] = []
        self.started: list[FakeResponse] = []

    def start(self, response: FakeResponse) -> FakeResponse:
        response.started_s = self.clock.now_s
        self.started.append(response)
        return response

    async def first(self, pending: list[FakeResponse], timeout_s: float) -> int | None:
        ends = [r.started_s + r.takes_s for r in pending]
        i = min(range(len(pending)), key=ends.__getitem__)
        if ends[i] > self.clock.now_s + timeout_s:
            self.clock.now_s += max(0, timeout_s)
            return None
        self.clock.now_s = max(self.clock.now_s, ends[i])
        return i

    def outcome(self, response: FakeResponse) -> Any:
        if response.error is not None:
            raise response.error
        return response.result

    def drop(self, response: FakeResponse) -> None:
        response.cancel()

    async def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.clock.now_s += seconds

    async def wait_for(self, response: FakeResponse, timeout_s: float) -> Any:
        if response.takes_s > timeout_s:
            self.clock.now_s += timeout_s
            raise asyncio.TimeoutError()
        self.clock.now_s += response.takes_s
        return await response


class FixedRandom(random.Random):
    def random(self) -> float:
        return 0.5


def result(text: str) -> ModelResult:
    return ModelResult(text, len(text), "stop")


def ok(text: str, takes_s: float = 1) -> FakeResponse:
    """A unary answer of ``text``."""
    return FakeResponse(takes_s, result=result(text))


def chunk(text: str, takes_s: float = 1) -> FakeResponse:
    """A stream's piece of ``text`` (no ids)."""
    return FakeResponse(takes_s, result=ModelChunk(text))


def answered(text: str, fallback: str | None = None) -> Reply:
    """The reply of a unary call answered with ``text`` by the primary (None), the fallback
    model or the cache (the primary's earlier answer)."""
    return Reply(result(text), fallback, FALLBACK if fallback == "fallback_model" else PRIMARY)


def fails(error: BaseException, takes_s: float = 1) -> FakeResponse:
    return FakeResponse(takes_s, error=error)


def make(
    primary: FakeHandle,
    fallback: FakeHandle | None = None,
    retry: dict | None = None,
    cache: bool = False,
    bulkhead: dict | None = None,
    model: dict | None = None,
    hedge: dict | None = None,
    replicas: FakeReplicas | None = None,
) -> tuple[ResilientCaller, FakeClock, FakeTimer, list]:
    cfg = load_config(
        {
            "model": model or {},
            "resilience": {
                "attempt_timeout_s": 4,
                "retry": {"max_attempts": 3, "base_backoff_s": 2, "max_backoff_s": 8, **(retry or {})},
                "breaker": {
                    "window_size": 3,
                    "min_calls": 3,
                    "failure_rate_threshold": 0.6,
                    "open_duration_s": 10,
                    "open_jitter_ratio": 0,
                    "half_open_max_probes": 1,
                },
                "cache": {"enabled": cache},
                "bulkhead": bulkhead or {},
                "hedge": hedge or {},
            },
            "fallback": {} if fallback is not None else None,
        }
    )
    clock = FakeClock(100)
    timer = FakeTimer(clock)
    events: list = []
    hooks = CallHooks(
        on_retry=lambda backend, kind: events.append(("retry", backend, kind)),
        on_fallback=lambda kind: events.append(("fallback", kind)),
        on_lost_capacity=lambda backend, outcome: events.append(("lost", backend, outcome)),
        on_hedge=lambda backend: events.append(("hedge", backend)),
    )
    caller = ResilientCaller(
        cfg,
        primary,
        fallback,
        hooks=hooks,
        clock=clock,
        rng=FixedRandom(),
        wall_clock=lambda: WALL_S,
        sleep=timer.sleep,
        racer=timer,
        replicas=replicas or FakeReplicas(),
    )
    return caller, clock, timer, events


async def unary(
    caller: ResilientCaller,
    clock: FakeClock,
    deadline_in_s: float = 30,
    call: ModelCall = CALL,
    tenant: str | None = "acme",
) -> Reply:
    return await caller.unary(CallSpec(call, clock() + deadline_in_s, [], WALL_S, tenant=tenant))


def breaker_of(caller: ResilientCaller, role: str) -> dict[str, Any]:
    return next(b.breaker.snapshot() for b in caller.backends if b.role == role)


# -- unary ------------------------------------------------------------------------------


async def test_unary_success_answers_from_the_primary_with_the_deadline_passed_on() -> None:
    primary = FakeHandle(ok("hi", takes_s=2))
    caller, clock, timer, events = make(primary)
    assert await unary(caller, clock, deadline_in_s=30) == answered("hi")
    assert clock() == 102  # the one attempt's 2 s
    (sent,) = primary.generate.calls
    assert sent == replace(CALL, deadline=AttemptDeadline(budget_s=30, at_wall_s=WALL_S + 30))
    assert (timer.slept_s, events) == ([], [])
    assert breaker_of(caller, "primary")["calls"] == 1 and breaker_of(caller, "primary")["failures"] == 0
    assert caller.budget.snapshot()["active"] == 0  # the request ended


async def test_attempt_timeout_then_a_retry_that_succeeds() -> None:
    hung = FakeResponse(HANG)
    primary = FakeHandle(hung, ok("second"))
    caller, clock, timer, events = make(primary)
    assert await unary(caller, clock, deadline_in_s=30) == answered("second")
    # t=100 attempt 1 … t=104 its 4 s timeout, 1 s backoff, t=105 attempt 2 answers at t=106
    assert clock() == 106
    assert hung.cancelled
    assert timer.slept_s == [1.0]
    assert [c.deadline.budget_s for c in primary.generate.calls] == [30, 25]
    assert events == [("retry", "primary", "attempt_timeout")]
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (2, 1)  # the timeout counted against the backend
    assert caller.budget.snapshot()["retries_in_flight"] == 0  # the retry slot was given back


async def test_attempts_exhausted_on_the_primary_go_to_the_fallback() -> None:
    primary = FakeHandle(FakeResponse(HANG), FakeResponse(HANG), FakeResponse(HANG))
    fallback = FakeHandle(ok("small"))
    caller, clock, timer, events = make(primary, fallback)
    assert await unary(caller, clock, deadline_in_s=30) == answered("small", "fallback_model")
    assert len(primary.generate.calls) == 3  # max_attempts, not one more
    assert timer.slept_s == [1.0, 2.0]  # full-jitter caps 2 s then 4 s, drawn at 0.5
    assert clock() == 100 + 4 + 1 + 4 + 2 + 4 + 1
    assert events == [
        ("retry", "primary", "attempt_timeout"),
        ("retry", "primary", "attempt_timeout"),
        ("fallback", "fallback_model"),
    ]


async def test_an_exhausted_retry_budget_sends_a_retryable_failure_to_the_fallback() -> None:
    primary = FakeHandle(fails(ActorDiedError()))
    fallback = FakeHandle(ok("small"))
    caller, clock, timer, events = make(primary, fallback, retry={"budget_ratio": 0, "budget_min_concurrent": 0})
    assert await unary(caller, clock) == answered("small", "fallback_model")
    assert len(primary.generate.calls) == 1
    assert timer.slept_s == []
    snap = caller.budget.snapshot()
    assert (snap["retries_granted"], snap["retries_denied"], snap["retries_in_flight"]) == (0, 1, 0)


async def test_a_lost_replica_is_sent_again_without_using_an_attempt_or_the_breaker() -> None:
    primary = FakeHandle(fails(ActorDiedError()), fails(ActorDiedError()), ok("answered"))
    caller, clock, timer, events = make(primary, retry={"max_attempts": 1})
    record = CallRecord()
    result = await caller.unary(CallSpec(CALL, clock() + 30, [], WALL_S, record=record))
    assert result == answered("answered")
    assert record.migrations == 2 and len(primary.generate.calls) == 3
    assert timer.slept_s == [0.025, 0.025]
    assert events == [("lost", "primary", "migrated")] * 2
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)
    assert caller.budget.snapshot()["retries_in_flight"] == 0  # each re-send's slot given back


async def test_lost_replicas_past_the_limit_go_to_the_fallback_then_replica_lost() -> None:
    primary = FakeHandle(*(fails(ActorDiedError()) for _ in range(4)))
    caller, clock, _, events = make(primary, FakeHandle(ok("small")))
    assert await unary(caller, clock) == answered("small", "fallback_model")
    assert len(primary.generate.calls) == 4 and events[-2:] == [
        ("lost", "primary", "not_migrated"),
        ("fallback", "fallback_model"),
    ]
    primary = FakeHandle(*(fails(ActorDiedError()) for _ in range(4)))
    caller, clock, _, _ = make(primary)
    with pytest.raises(ReplicaLost) as info:
        await unary(caller, clock)
    assert (info.value.status, info.value.code, info.value.retry_after_s) == (503, "REPLICA_LOST", 1.0)


async def test_a_primary_only_call_gets_neither_the_fallback_nor_the_cache() -> None:
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary = FakeHandle(ok("cached"), fails(error), fails(error))
    fallback = FakeHandle(ok("small"))
    caller, clock, _, events = make(primary, fallback, cache=True)
    assert await unary(caller, clock) == answered("cached")  # the cache now holds this call's answer
    spec = CallSpec(CALL, clock() + 30, [], WALL_S, tenant="acme", primary_only=True)
    with pytest.raises(ModelUnavailable, match="model_error:primary"):
        await caller.unary(spec)
    assert fallback.generate.calls == [] and not any(kind == "fallback" for kind, *_ in events)
    assert await unary(caller, clock) == answered("small", "fallback_model")  # an online call still falls back


async def test_a_model_error_is_not_retried_and_without_a_fallback_is_503() -> None:
    primary = FakeHandle(fails(RayTaskError("generate", "traceback", RuntimeError("bad input"))))
    caller, clock, timer, events = make(primary)
    with pytest.raises(ModelUnavailable, match="model_error:primary") as info:
        await unary(caller, clock)
    assert info.value.status == 503
    assert len(primary.generate.calls) == 1
    assert (timer.slept_s, events) == ([], [])
    assert caller.budget.snapshot()["retries_denied"] == 0  # not wanted, so not denied either


async def test_an_open_breaker_skips_the_primary_until_its_open_period_ends() -> None:
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary = FakeHandle(*(fails(error, takes_s=0) for _ in range(3)), ok("back", takes_s=0))
    fallback = FakeHandle(*(ok(f"small{i}", takes_s=0) for i in range(5)))
    caller, clock, _, _ = make(primary, fallback)
    for i in range(3):  # three failures in a window of three: the breaker opens at t=100
        assert breaker_of(caller, "primary")["state"] == "closed", i
        assert await unary(caller, clock) == answered(f"small{i}", "fallback_model")
    assert breaker_of(caller, "primary")["state"] == "open"
    for t in (100, 109):  # open for 10 s: the primary is not called, the fallback answers
        clock.now_s = t
        reply = await unary(caller, clock)
        assert reply.fallback == "fallback_model", t
        assert len(primary.generate.calls) == 3, t
    clock.now_s = 110  # half-open: one probe reaches the primary, and it answers
    assert await unary(caller, clock) == answered("back")
    assert breaker_of(caller, "primary")["state"] == "closed"


async def test_fallback_failing_too_answers_from_the_cache_then_503_for_an_unseen_prompt() -> None:
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary = FakeHandle(ok("cached"), fails(error), fails(error))
    fallback = FakeHandle(fails(error), fails(error))
    caller, clock, _, events = make(primary, fallback, cache=True)
    assert await unary(caller, clock) == answered("cached")
    assert await unary(caller, clock) == answered("cached", "cache")
    assert events[-1] == ("fallback", "cache")
    with pytest.raises(ModelUnavailable, match="model_error:primary, model_error:fallback"):
        await unary(caller, clock, call=ModelCall("never seen", max_tokens=8))


async def test_the_cache_answers_a_tenant_only_with_its_own_earlier_answers() -> None:
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary = FakeHandle(ok("for acme"), fails(error), fails(error), fails(error), fails(error))
    caller, clock, _, events = make(primary, cache=True)
    assert await unary(caller, clock, tenant="acme") == answered("for acme")
    with pytest.raises(ModelUnavailable):  # the same call from another tenant: no answer of acme's
        await unary(caller, clock, tenant="globex")
    assert ("fallback", "cache") not in events
    assert await unary(caller, clock, tenant="acme") == answered("for acme", "cache")


async def test_a_call_without_a_tenant_is_neither_cached_nor_answered_from_the_cache() -> None:
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary = FakeHandle(ok("anonymous"), fails(error), fails(error))
    caller, clock, _, _ = make(primary, cache=True)
    await unary(caller, clock, tenant=None)
    assert len(caller.cache) == 0
    with pytest.raises(ModelUnavailable):
        await unary(caller, clock, tenant=None)


def test_a_tenants_flood_of_calls_evicts_only_its_own_cached_answers() -> None:
    clock = FakeClock()
    cache = ResponseCache(max_entries=1024, ttl_s=300, clock=clock, max_entries_per_tenant=4)
    cache.put("quiet", CALL, result("mine"))
    for i in range(1000):
        cache.put("loud", replace(CALL, prompt=f"p{i}"), result(str(i)))
    assert len(cache) == 5 and cache.get("quiet", CALL) == result("mine")
    assert cache.get("loud", replace(CALL, prompt="p999")) == result("999")


async def test_the_deadline_running_out_mid_retry_is_504_and_the_fallback_is_not_tried() -> None:
    # Deadline 7 s: attempt 1 times out at 4 s, 1 s backoff, and attempt 2's replica
    # gives up on its own deadline 1 s later.
    late = RayTaskError("generate", "traceback", DeadlineExceeded("late"))
    primary = FakeHandle(FakeResponse(HANG), fails(late))
    fallback = FakeHandle(ok("small"))
    caller, clock, timer, _ = make(primary, fallback)
    with pytest.raises(DeadlineExceeded) as info:
        await unary(caller, clock, deadline_in_s=7)
    assert info.value.status == 504
    assert clock() == 106
    assert [c.deadline.budget_s for c in primary.generate.calls] == [7, 2]
    assert fallback.generate.calls == []
    assert breaker_of(caller, "primary")["failures"] == 1  # the client's deadline is not the backend's fault


async def test_an_attempt_cut_short_by_the_deadline_leaves_no_time_for_the_fallback() -> None:
    # Deadline 6 s: attempt 1 times out at t=104, 1 s pause, attempt 2's timeout is cut
    # to the deadline less its 0.02 s margin (t=105.98). A third would need a 2 s pause,
    # so no retry; the fallback finds less than a useful attempt left: 504.
    primary = FakeHandle(FakeResponse(HANG), FakeResponse(HANG))
    fallback = FakeHandle(ok("small"))
    caller, clock, timer, _ = make(primary, fallback)
    with pytest.raises(DeadlineExceeded):
        await unary(caller, clock, deadline_in_s=6)
    assert timer.slept_s == [1.0]
    assert len(primary.generate.calls) == 2
    assert clock() == pytest.approx(105.98)
    assert fallback.generate.calls == []


async def test_a_cancelled_request_counts_nothing_against_the_backend_and_frees_its_slots() -> None:
    response = FakeResponse(1, error=asyncio.CancelledError())
    primary = FakeHandle(response)
    caller, clock, _, _ = make(primary)
    with pytest.raises(asyncio.CancelledError):
        await unary(caller, clock)
    assert response.cancelled
    assert breaker_of(caller, "primary")["calls"] == 0
    assert caller.backends[0].bulkhead.in_flight == 0
    assert caller.budget.snapshot()["active"] == 0


# -- streams ----------------------------------------------------------------------------


async def collect(it) -> list:
    return [chunk async for chunk in it]


async def test_a_stream_yields_the_first_chunk_then_the_rest_and_counts_one_success() -> None:
    stream = FakeStream(chunk("a"), chunk("b"), chunk("c"))
    primary = FakeHandle(streams=(stream,))
    caller, clock, _, _ = make(primary)
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert (opened.fallback, opened.model) == (None, PRIMARY)
    assert clock() == 101  # only the first chunk is fetched before the stream is handed back
    assert caller.backends[0].bulkhead.in_flight == 1  # held for the stream's life
    assert await collect(opened.chunks) == [ModelChunk("a"), ModelChunk("b"), ModelChunk("c")]
    assert clock() == 103
    assert not stream.cancelled
    assert caller.backends[0].bulkhead.in_flight == 0
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)


async def test_a_stream_failing_before_its_first_chunk_falls_back_without_a_retry() -> None:
    dead = FakeStream(fails(RayTaskError("generate_stream", "traceback", RuntimeError("cuda error"))))
    primary = FakeHandle(streams=(dead,))
    fallback = FakeHandle(streams=(FakeStream(chunk("x"), chunk("y")),))
    caller, clock, timer, events = make(primary, fallback)
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert (opened.fallback, opened.model) == ("fallback_model", FALLBACK)
    assert await collect(opened.chunks) == [ModelChunk("x"), ModelChunk("y")]
    assert len(primary.generate_stream.calls) == 1  # a model error is not retried on a backend
    assert dead.cancelled
    assert timer.slept_s == []
    assert ("fallback", "fallback_model") in events


async def test_a_request_its_engine_refuses_fails_alone_with_the_refusal() -> None:
    # vLLM's own validation in the replica: the client's request as sent, not the model's
    # health: no retry, no fallback, nothing on the breaker, the bulkhead and budget freed.
    refusal = EngineRefused("response_format: vLLM refuses it: bad schema", field="response_format")
    primary = FakeHandle(
        fails(RayTaskError("generate", "traceback", refusal)),
        streams=(FakeStream(fails(RayTaskError("generate_stream", "traceback", refusal))),),
    )
    fallback = FakeHandle(ok("never"), streams=(FakeStream(chunk("never")),))
    caller, clock, timer, events = make(primary, fallback)
    with pytest.raises(EngineRefused) as unary_refusal:
        await unary(caller, clock)
    with pytest.raises(EngineRefused) as stream_refusal:
        await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    for e in (unary_refusal.value, stream_refusal.value):
        assert (e.status, e.code, e.field) == (400, "ENGINE_REFUSED", "response_format")
    assert (len(primary.generate.calls), len(primary.generate_stream.calls)) == (1, 1)
    assert (fallback.generate.calls, fallback.generate_stream.calls, timer.slept_s, events) == ([], [], [], [])
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (0, 0)
    assert caller.backends[0].bulkhead.in_flight == 0 and caller.budget.snapshot()["active"] == 0


async def test_a_call_the_fallbacks_engine_would_not_honour_never_goes_to_it() -> None:
    # A JSON-schema request on a vLLM primary: the built-in fallback would answer it with
    # free text, so a primary that cannot answer is a 503, not a wrong answer.
    vllm = {"backend": "vllm", "path": "/models/m"}
    schema_call = replace(CALL, sampling=RowSampling(json_schema='{"type":"object"}'))
    dead = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary, fallback = FakeHandle(fails(dead)), FakeHandle()
    caller, clock, _, events = make(primary, fallback, model=vllm)
    with pytest.raises(ModelUnavailable):
        await unary(caller, clock, call=schema_call)
    assert fallback.generate.calls == [] and ("fallback", "fallback_model") not in events
    with pytest.raises(ModelUnavailable):  # the level sent it to the fallback alone: nothing may take it
        await caller.unary(CallSpec(schema_call, clock() + 30, [], WALL_S, fallback_only=True))
    # The same request without the schema falls back as usual.
    primary, fallback = FakeHandle(fails(dead)), FakeHandle(ok("small"))
    caller, clock, _, _ = make(primary, fallback, model=vllm)
    assert await unary(caller, clock) == answered("small", "fallback_model")


async def test_a_stream_whose_replica_died_before_its_first_chunk_goes_to_another_replica() -> None:
    dead = FakeStream(fails(ActorDiedError()))
    primary = FakeHandle(streams=(dead, FakeStream(chunk("a"), chunk("b"))))
    fallback = FakeHandle(streams=(FakeStream(chunk("x")),))
    caller, clock, timer, events = make(primary, fallback)
    record = CallRecord()
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S, record=record))
    assert opened.fallback is None and await collect(opened.chunks) == [ModelChunk("a"), ModelChunk("b")]
    assert dead.cancelled and record.migrations == 1
    assert primary.generate_stream.calls[1].resume is None  # nothing was delivered: a plain re-send
    assert timer.slept_s == [0.025]  # half of MAX_PAUSE_S (the rng draws 0.5)
    assert events == [("lost", "primary", "migrated")]
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)  # the lost attempt is not the backend's failure


async def test_a_stream_whose_first_chunk_times_out_is_retried_like_a_unary_attempt() -> None:
    # A replica cut off from this router (a partition) answers nothing until Ray calls its
    # node dead: the first chunk's attempt timeout sends the stream to another replica.
    hung = FakeStream(FakeResponse(HANG))
    primary = FakeHandle(streams=(hung, FakeStream(chunk("a"), chunk("b"))))
    fallback = FakeHandle(streams=(FakeStream(chunk("x")),))
    caller, clock, timer, events = make(primary, fallback)
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert clock() == 100 + 4 + 1 + 1  # the 4 s attempt timeout, a 1 s backoff, the first chunk
    assert opened.fallback is None and await collect(opened.chunks) == [ModelChunk("a"), ModelChunk("b")]
    assert hung.cancelled
    assert events == [("retry", "primary", "attempt_timeout")]
    assert breaker_of(caller, "primary")["failures"] == 1  # a timeout is the backend's failure
    assert caller.budget.retries_in_flight == 0 and caller.budget.active == 0


async def test_a_stream_whose_first_chunk_times_out_on_every_attempt_falls_back() -> None:
    primary = FakeHandle(streams=tuple(FakeStream(FakeResponse(HANG)) for _ in range(3)))
    fallback = FakeHandle(streams=(FakeStream(chunk("x")),))
    caller, clock, _, events = make(primary, fallback, retry={"max_attempts": 2})
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert (opened.fallback, opened.model) == ("fallback_model", FALLBACK)
    assert len(primary.generate_stream.calls) == 2  # max_attempts
    assert clock() == 100 + 4 + 1 + 4 + 1  # two attempt timeouts, a backoff, the fallback's chunk
    assert await collect(opened.chunks) == [ModelChunk("x")]
    assert events == [("retry", "primary", "attempt_timeout"), ("fallback", "fallback_model")]


async def test_a_stream_with_no_backend_left_is_503() -> None:
    primary = FakeHandle(streams=(FakeStream(fails(RayTaskError("g", "tb", RuntimeError("bad")))),))
    caller, clock, _, _ = make(primary)
    with pytest.raises(ModelUnavailable, match="model_error:primary"):
        await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert caller.backends[0].bulkhead.in_flight == 0


async def test_a_stream_whose_replicas_keep_dying_is_replica_lost_after_the_migration_limit() -> None:
    primary = FakeHandle(streams=tuple(FakeStream(fails(ActorDiedError())) for _ in range(4)))
    caller, clock, _, events = make(primary)
    with pytest.raises(ReplicaLost, match="replica_died:primary") as info:
        await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert (info.value.status, info.value.code) == (503, "REPLICA_LOST")
    assert len(primary.generate_stream.calls) == 4  # the first and three migrations (the limit)
    assert events == [("lost", "primary", "migrated")] * 3 + [("lost", "primary", "not_migrated")]
    assert caller.backends[0].bulkhead.in_flight == 0
    assert breaker_of(caller, "primary")["failures"] == 0


async def test_a_model_error_after_its_first_chunk_ends_the_stream_with_503_and_no_fallback() -> None:
    stream = FakeStream(chunk("a"), fails(RayTaskError("generate_stream", "traceback", RuntimeError("cuda error"))))
    primary = FakeHandle(streams=(stream,))
    fallback = FakeHandle(streams=(FakeStream(chunk("x")),))
    caller, clock, _, _ = make(primary, fallback)
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert opened.fallback is None
    assert await opened.chunks.__anext__() == ModelChunk("a")
    with pytest.raises(ModelUnavailable, match="model_error"):
        await opened.chunks.__anext__()
    assert stream.cancelled
    assert fallback.generate_stream.calls == []  # committed to its backend after the first chunk
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 1)
    assert caller.backends[0].bulkhead.in_flight == 0


def piece(text: str, ids: list[int], takes_s: float = 1) -> FakeResponse:
    return FakeResponse(takes_s, result=ModelChunk(text, tuple(ids)))


async def test_a_stream_whose_replica_dies_mid_way_carries_on_from_what_was_delivered() -> None:
    cut = FakeStream(piece("he", [104, 101]), piece("llo", [108, 108, 111]), fails(ActorDiedError()))
    resumed = FakeStream(
        FakeResponse(1, result=ModelChunk(" wo", (32, 119, 111), queue_wait_ms=5.0)),
        piece("rld", [114, 108, 100]),
    )
    primary = FakeHandle(streams=(cut, resumed))
    fallback = FakeHandle(streams=(FakeStream(chunk("x")),))
    caller, clock, timer, events = make(primary, fallback)
    record = CallRecord()
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S, record=record))
    chunks = await collect(opened.chunks)
    assert opened.fallback is None and "".join(c.text for c in chunks) == "hello world"
    assert sum(c.tokens for c in chunks) == 11
    assert all(c.queue_wait_ms is None for c in chunks[2:])  # a continuation is not a new request's wait
    first, second = primary.generate_stream.calls
    assert first.resume is None
    # t=100 open, 101 "he", 102 "llo", 103 the replica dies, 0.025 s pause, 104.025 " wo"
    assert replace(second, deadline=None) == replace(CALL, resume=Resume((104, 101, 108, 108, 111), text_chars=5))
    assert (second.deadline.budget_s, second.deadline.at_wall_s) == (
        pytest.approx(30 - 3.025),
        pytest.approx(WALL_S + 30 - 3.025),
    )
    assert cut.cancelled and not resumed.cancelled
    assert record.migrations == 1 and events == [("lost", "primary", "migrated")]
    assert caller.lost == {"migrated": 1, "not_migrated": 0, "streams_carried_on": 1}
    assert fallback.generate_stream.calls == []
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)  # the cut attempt was released, the resumed one succeeded
    assert caller.backends[0].bulkhead.in_flight == 0


async def test_a_stream_cut_once_more_than_the_limit_ends_with_replica_lost() -> None:
    streams = [FakeStream(piece("a", [97]), fails(ActorDiedError())) for _ in range(4)]
    primary = FakeHandle(streams=tuple(streams))
    caller, clock, _, events = make(primary)
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    got = []
    with pytest.raises(ReplicaLost):
        async for chunk in opened.chunks:
            got.append(chunk.text)
    assert got == ["a"] * 4  # each migration delivered its piece before its replica went too
    assert [len(c.resumed_ids) for c in primary.generate_stream.calls] == [0, 1, 2, 3]
    assert events[-1] == ("lost", "primary", "not_migrated")
    assert caller.backends[0].bulkhead.in_flight == 0


async def test_a_stream_cut_with_no_room_left_before_its_deadline_is_not_migrated() -> None:
    # Deadline 3.04 s: the replica dies at t=103, leaving 0.04 s; a pause and a useful
    # attempt (0.05 s) do not fit.
    primary = FakeHandle(
        streams=(
            FakeStream(piece("a", [97], takes_s=1), fails(ActorDiedError(), takes_s=2)),
            FakeStream(chunk("never")),
        )
    )
    caller, clock, _, events = make(primary)
    opened = await caller.stream(CallSpec(CALL, clock() + 3.04, [], WALL_S))
    assert (await opened.chunks.__anext__()).text == "a"
    with pytest.raises(ReplicaLost):
        await opened.chunks.__anext__()
    assert len(primary.generate_stream.calls) == 1
    assert events == [("lost", "primary", "not_migrated")]


async def test_a_stream_stalling_past_the_deadline_ends_with_504() -> None:
    stream = FakeStream(chunk("a"), FakeResponse(HANG))
    primary = FakeHandle(streams=(stream,))
    caller, clock, _, _ = make(primary)
    opened = await caller.stream(CallSpec(CALL, clock() + 10, [], WALL_S))
    assert await opened.chunks.__anext__() == ModelChunk("a")
    with pytest.raises(DeadlineExceeded):
        await opened.chunks.__anext__()
    assert clock() == 110  # waited exactly what was left of the deadline
    assert stream.cancelled


async def test_a_client_leaving_mid_stream_counts_nothing_against_the_backend() -> None:
    stream = FakeStream(chunk("a"), chunk("b"))
    primary = FakeHandle(streams=(stream,))
    caller, clock, _, _ = make(primary)
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))
    assert await opened.chunks.__anext__() == ModelChunk("a")
    await opened.chunks.aclose()
    assert stream.cancelled
    assert breaker_of(caller, "primary")["calls"] == 0
    assert caller.backends[0].bulkhead.in_flight == 0


async def test_a_full_primary_bulkhead_sends_the_next_request_to_the_fallback() -> None:
    primary = FakeHandle(streams=(FakeStream(chunk("a"), chunk("b")),))
    fallback = FakeHandle(ok("small"))
    caller, clock, _, _ = make(primary, fallback, bulkhead={"primary": 1})
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S))  # holds the primary's one slot
    assert await unary(caller, clock) == answered("small", "fallback_model")
    assert primary.generate.calls == []
    assert await collect(opened.chunks) == [ModelChunk("a"), ModelChunk("b")]


# -- fallback only (critical_plus the primary will not take) -------------------------------


async def test_fallback_only_never_calls_the_primary() -> None:
    primary = FakeHandle()
    fallback = FakeHandle(ok("small"), streams=(FakeStream(chunk("s")),))
    caller, clock, _, events = make(primary, fallback)
    assert caller.can_fall_back([], WALL_S)
    assert await caller.unary(CallSpec(CALL, clock() + 30, [], WALL_S, fallback_only=True)) == answered(
        "small", "fallback_model"
    )
    opened = await caller.stream(CallSpec(CALL, clock() + 30, [], WALL_S, fallback_only=True))
    assert opened.fallback == "fallback_model" and await collect(opened.chunks) == [ModelChunk("s")]
    assert primary.generate.calls == [] and primary.generate_stream.calls == []
    assert events == [("fallback", "fallback_model"), ("fallback", "fallback_model")]


async def test_fallback_only_with_the_fallback_failing_is_503_not_a_primary_call() -> None:
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    primary = FakeHandle()
    fallback = FakeHandle(fails(error))
    caller, clock, _, _ = make(primary, fallback)
    with pytest.raises(ModelUnavailable, match="model_error:fallback"):
        await caller.unary(CallSpec(CALL, clock() + 30, [], WALL_S, fallback_only=True))
    assert primary.generate.calls == []


async def test_can_fall_back_needs_a_fallback_that_could_answer_now() -> None:
    caller, _, _, _ = make(FakeHandle())
    assert not caller.can_fall_back([], WALL_S)  # none configured
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    fallback = FakeHandle(*(fails(error, takes_s=0) for _ in range(3)))
    caller, clock, _, _ = make(FakeHandle(), fallback, bulkhead={"fallback": 1})
    assert caller.can_fall_back([], WALL_S)
    # Switched off by a model kill switch: not an answer.
    off = KillSwitchEntry(
        id="k1",
        scope="model",
        value=caller.backends[1].model_name,
        reason="bad weights",
        set_by="ops",
        created_at_s=WALL_S - 1,
        expires_at_s=WALL_S + 60,
    )
    assert not caller.can_fall_back([off], WALL_S)
    # Its bulkhead full: not now.
    assert caller.backends[1].bulkhead.try_enter()
    assert not caller.can_fall_back([], WALL_S)
    caller.backends[1].bulkhead.leave()
    # Its breaker open: not until it half-opens.
    for _ in range(3):
        with pytest.raises(ModelUnavailable):
            await caller.unary(CallSpec(CALL, clock() + 30, [], WALL_S, fallback_only=True))
    assert breaker_of(caller, "fallback")["state"] == "open"
    assert not caller.can_fall_back([], WALL_S)
    clock.now_s += 10
    assert caller.can_fall_back([], WALL_S)


async def test_a_unary_call_sent_again_after_its_replica_died_waits_up_to_its_deadline() -> None:
    # The replica left to take it is the one Serve is starting: no answer within the
    # deadline is capacity gone (504, which no level counts), not a sick model (503).
    primary = FakeHandle(FakeResponse(1, error=ActorDiedError()), FakeResponse(HANG))
    caller, clock, timer, events = make(primary)
    record = CallRecord()
    with pytest.raises(DeadlineExceeded):
        await caller.unary(CallSpec(CALL, clock() + 10, [], WALL_S, record=record))
    assert record.migrations == 1 and len(primary.generate.calls) == 2
    assert clock() == pytest.approx(100 + 10)  # the second attempt waited to the deadline, not 4 s
    assert events == [("lost", "primary", "migrated")]
    assert caller.budget.retries_in_flight == 0
