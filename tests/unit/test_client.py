"""Client SDK: typed errors, retries and their budget, adaptive throttling, SSE streams.

Every test talks to ``scripted_server`` through ``httpx.MockTransport``: it stands
in for the HTTP server in these unit tests only (the real stack is exercised by
the integration tests). Time is a fake clock advanced in whole seconds; the
fake sleep records each wait and advances that clock; ``rand`` is a constant so
backoffs are exact (full jitter with u = 0.5 is half the cap).
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fakes import FakeClock

from ballast.client import (
    AsyncBallastClient,
    BallastClient,
    BallastClientError,
    ClientConfig,
    ConcurrencyLimited,
    ConnectionFailed,
    DeadlineExceeded,
    Forbidden,
    Generation,
    InvalidRequest,
    KillSwitchActive,
    ModelUnavailable,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    RetryBudgetWindow,
    ServerError,
    SSEDecoder,
    ThrottledLocally,
    Unauthenticated,
    error_from_answer,
)
from ballast.policies.throttle import ThrottleConfig

BASE_URL = "http://ballast.test"
API_KEY = "test-key"
HALF = 0.5  # the injected rand: backoff = half its cap, throttle draws 0.5

ANSWER = {
    "text": "hello world",
    "tokens_generated": 11,
    "model": "ballast-tiny",
    "degradation_level": 1,
    "degraded": True,
    "degraded_reasons": ["max_tokens_clamped"],
    "max_tokens": 32,
    "fallback": None,
}


# ============================================================================ fakes


class FakeSleep:
    """Records each wait and advances the clock by it; never really sleeps."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits_s: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits_s.append(seconds)
        self.clock.advance(seconds)


class AsyncFakeSleep(FakeSleep):
    async def __call__(self, seconds: float) -> None:  # type: ignore[override]
        super().__call__(seconds)


Answer = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class ScriptedServer:
    """Answers each request with the next scripted answer (the last one repeats)."""

    def __init__(self, answers: list[Answer]) -> None:
        assert answers
        self.answers = answers
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        if callable(answer) and not isinstance(answer, httpx.Response):
            return answer(request)
        return answer

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def header(self, name: str) -> list[str | None]:
        return [r.headers.get(name) for r in self.requests]


def scripted_server(*answers: Answer) -> ScriptedServer:
    return ScriptedServer(list(answers))


def ok(**over: Any) -> httpx.Response:
    body = {**ANSWER, **over}
    return httpx.Response(200, json=body, headers={"X-Ballast-Fallback": body["fallback"] or "none"})


def error(
    status: int,
    code: str | None,
    message: str = "refused",
    retry_after_s: float | None = None,
    field: str | None = None,
) -> httpx.Response:
    """An error answer shaped like the router's ``error_response``."""
    err: dict[str, Any] = {"message": message}
    if code is not None:
        err["code"] = code
    headers = {}
    if retry_after_s is not None:
        err["retry_after_s"] = retry_after_s
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if field is not None:
        err["field"] = field
    return httpx.Response(status, json={"error": err}, headers=headers)


def sse(*events: tuple[str, dict[str, Any]]) -> httpx.Response:
    body = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)
    return httpx.Response(200, content=body.encode(), headers={"Content-Type": "text/event-stream"})


DONE = {k: v for k, v in ANSWER.items() if k != "text"}


def overloaded(retry_after_s: float | None = 1.0) -> httpx.Response:
    return error(503, "OVERLOADED", "level 2 does not admit 'sheddable'", retry_after_s)


class Harness:
    def __init__(self, server: ScriptedServer, *, is_async: bool = False, **cfg: Any) -> None:
        cfg.setdefault("throttle", None)  # on only where a test is about it
        self.server = server
        self.clock = FakeClock()
        self.sleep = AsyncFakeSleep(self.clock) if is_async else FakeSleep(self.clock)
        self.cfg = ClientConfig(BASE_URL, API_KEY, **cfg)
        transport = httpx.MockTransport(server)
        kwargs = dict(transport=transport, clock=self.clock, rand=lambda: HALF, sleep=self.sleep)
        self.client: Any = AsyncBallastClient(self.cfg, **kwargs) if is_async else BallastClient(self.cfg, **kwargs)


def harness(*answers: Answer, **cfg: Any) -> Harness:
    return Harness(scripted_server(*answers), **cfg)


# ============================================================================ config


def test_config_defaults() -> None:
    cfg = ClientConfig(BASE_URL, API_KEY)
    assert (cfg.connect_timeout_s, cfg.read_timeout_s, cfg.max_attempts) == (2.0, 60.0, 3)
    assert (cfg.base_backoff_s, cfg.max_backoff_s, cfg.retry_budget_ratio) == (0.1, 5.0, 0.1)
    assert (cfg.retry_budget_window, cfg.retry_budget_min_retries) == (1000, 1)
    assert cfg.throttle == ThrottleConfig(k=2.0, window_s=120.0, bucket_s=1.0)
    assert cfg.request_timeout_ms is None
    assert API_KEY not in repr(cfg)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("base_url", "ballast.test"),
        ("api_key", ""),
        ("api_key", "two words"),
        ("connect_timeout_s", 0),
        ("read_timeout_s", float("inf")),
        ("max_attempts", 0),
        ("max_attempts", 2.0),
        ("base_backoff_s", -0.1),
        ("max_backoff_s", 0.05),  # below base_backoff_s
        ("retry_budget_ratio", 1.5),
        ("retry_budget_window", 0),
        ("retry_budget_min_retries", -1),
        ("max_retry_wait_s", 0),
        ("throttle", {"k": 2.0}),
        ("request_timeout_ms", 0),
        ("request_timeout_ms", True),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"base_url": BASE_URL, "api_key": API_KEY, field: value}
    with pytest.raises(ValueError, match=field):
        ClientConfig(**kwargs)


# ============================================================================ success


def test_generate_parses_the_answer_and_sends_the_request() -> None:
    h = harness(ok())
    gen = h.client.generate("Hello", max_tokens=32, criticality="sheddable_plus")

    assert gen == Generation(
        text="hello world",
        tokens_generated=11,
        model="ballast-tiny",
        degradation_level=1,
        degraded=True,
        degraded_reasons=("max_tokens_clamped",),
        fallback=None,
        raw=ANSWER,
    )
    assert gen.raw == ANSWER
    (req,) = h.server.requests
    assert req.method == "POST" and req.url == f"{BASE_URL}/v1/generate"
    assert req.headers["Authorization"] == f"Bearer {API_KEY}"
    assert json.loads(req.content) == {
        "prompt": "Hello",
        "max_tokens": 32,
        "criticality": "sheddable_plus",
        "stream": False,
    }
    assert "Idempotency-Key" not in req.headers
    assert "X-Request-Timeout-Ms" not in req.headers
    assert h.sleep.waits_s == []


def test_generate_reports_the_fallback() -> None:
    h = harness(ok(fallback="cache", degraded=False, degraded_reasons=[]))
    gen = h.client.generate("Hello")
    assert (gen.fallback, gen.degraded, gen.degraded_reasons) == ("cache", False, ())
    assert h.server.bodies()[0]["criticality"] == "critical"  # the default


def test_a_malformed_answer_is_a_server_error() -> None:
    h = harness(httpx.Response(200, json={"text": "no other fields"}))
    with pytest.raises(ServerError) as info:
        h.client.generate("Hello")
    assert (info.value.status, info.value.code) == (200, "MALFORMED_RESPONSE")


# ============================================================================ error mapping


@pytest.mark.parametrize(
    ("answer", "cls", "status", "code", "retry_after_s"),
    [
        (error(401, "UNAUTHENTICATED"), Unauthenticated, 401, "UNAUTHENTICATED", None),
        (error(403, "FORBIDDEN"), Forbidden, 403, "FORBIDDEN", None),
        (error(413, "PAYLOAD_TOO_LARGE"), PayloadTooLarge, 413, "PAYLOAD_TOO_LARGE", None),
        (error(429, "QUOTA_EXCEEDED", retry_after_s=2.5), QuotaExceeded, 429, "QUOTA_EXCEEDED", 2.5),
        (error(429, "CONCURRENCY_LIMIT", retry_after_s=1.0), ConcurrencyLimited, 429, "CONCURRENCY_LIMIT", 1.0),
        (error(503, "OVERLOADED", retry_after_s=4.0), Overloaded, 503, "OVERLOADED", 4.0),
        (error(503, "KILL_SWITCH", retry_after_s=600.0), KillSwitchActive, 503, "KILL_SWITCH", 600.0),
        (error(503, "MODEL_UNAVAILABLE", retry_after_s=3.0), ModelUnavailable, 503, "MODEL_UNAVAILABLE", 3.0),
        (error(504, "DEADLINE_EXCEEDED"), DeadlineExceeded, 504, "DEADLINE_EXCEEDED", None),
        (error(500, "INTERNAL"), ServerError, 500, "INTERNAL", None),
        # an unknown code wins over the status: a 503 that is not one of the known refusals
        (error(503, "CONTROLLER_UNAVAILABLE", retry_after_s=2.0), ServerError, 503, "CONTROLLER_UNAVAILABLE", 2.0),
        # no Ballast body (a proxy in front): the status decides
        (httpx.Response(502, text="Bad Gateway"), ServerError, 502, "SERVER_ERROR", None),
        (httpx.Response(503, text="Back pressure"), Overloaded, 503, "OVERLOADED", None),
        (httpx.Response(429, headers={"Retry-After": "7"}), QuotaExceeded, 429, "QUOTA_EXCEEDED", 7.0),
    ],
)
def test_each_error_answer_maps_to_its_typed_error(
    answer: httpx.Response, cls: type[BallastClientError], status: int, code: str, retry_after_s: float | None
) -> None:
    h = harness(answer, max_attempts=1)
    with pytest.raises(BallastClientError) as info:
        h.client.generate("Hello")
    err = info.value
    assert type(err) is cls
    assert (err.status, err.code, err.retry_after_s) == (status, code, retry_after_s)
    assert err.message  # the server's message, or the body's text, or "HTTP <status>"
    assert len(h.server.requests) == 1


def test_invalid_request_carries_the_field_and_the_message() -> None:
    h = harness(error(422, "INVALID_REQUEST", "max_tokens: must be > 0", field="max_tokens"))
    with pytest.raises(InvalidRequest) as info:
        h.client.generate("Hello", max_tokens=0)
    assert (info.value.status, info.value.field, info.value.message) == (422, "max_tokens", "max_tokens: must be > 0")
    assert str(info.value) == "422 INVALID_REQUEST: max_tokens: must be > 0"


def test_the_body_retry_after_wins_over_the_rounded_header() -> None:
    err = error_from_answer(503, {"retry-after": "2"}, b'{"error": {"code": "OVERLOADED", "retry_after_s": 1.25}}')
    assert err.retry_after_s == 1.25
    err = error_from_answer(503, {"retry-after": "2"}, b'{"error": {"code": "OVERLOADED"}}')
    assert err.retry_after_s == 2.0
    err = error_from_answer(503, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, b"")
    assert err.retry_after_s is None  # HTTP-date: ignored (no wall clock here)


@pytest.mark.parametrize(
    "err",
    [
        Unauthenticated("no key", 401, "UNAUTHENTICATED"),
        InvalidRequest("bad", 422, "INVALID_REQUEST", None, field="prompt"),
        Overloaded("busy", 503, "OVERLOADED", 1.5),
        KillSwitchActive("off"),
        ConnectionFailed("ConnectError: refused"),
        ThrottledLocally("p=0.9"),
        DeadlineExceeded("client deadline", None),
    ],
)
def test_errors_pickle_with_their_fields(err: BallastClientError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.message, back.status, back.code, back.retry_after_s) == (
        err.message,
        err.status,
        err.code,
        err.retry_after_s,
    )
    assert getattr(back, "field", None) == getattr(err, "field", None)


def test_errors_made_on_the_client_have_no_status() -> None:
    assert ConnectionFailed("x").status is None
    assert ThrottledLocally("x").status is None
    assert DeadlineExceeded("x", None).status is None
    assert DeadlineExceeded("x").status == 504  # the server's mapping, e.g. for an SSE error event


# ============================================================================ retries


def test_retries_503_overloaded_after_retry_after_then_succeeds() -> None:
    h = harness(overloaded(retry_after_s=1.5), ok())
    gen = h.client.generate("Hello")

    assert gen.text == "hello world"
    assert len(h.server.requests) == 2
    # max(Retry-After 1.5, full jitter 0.5 × 0.1) — the body's precise value, not the header's 2
    assert h.sleep.waits_s == [1.5]
    # the budget counts calls, not attempts: one request, one retry
    assert h.client.retry_budget.snapshot()["requests_in_window"] == 1
    assert h.client.retry_budget.retries_granted == 1


def test_the_backoff_wins_when_it_is_longer_than_retry_after() -> None:
    h = harness(error(429, "CONCURRENCY_LIMIT", retry_after_s=1.0), ok(), base_backoff_s=4.0, max_backoff_s=8.0)
    h.client.generate("Hello")
    assert h.sleep.waits_s == [2.0]  # 0.5 × 4.0 > 1.0


def test_a_503_without_retry_after_is_not_retried() -> None:
    h = harness(overloaded(retry_after_s=None), ok())
    with pytest.raises(Overloaded):
        h.client.generate("Hello")
    assert len(h.server.requests) == 1 and h.sleep.waits_s == []


@pytest.mark.parametrize(
    ("answer", "cls"),
    [
        (error(422, "INVALID_REQUEST", field="prompt"), InvalidRequest),
        (error(401, "UNAUTHENTICATED"), Unauthenticated),
        (error(503, "KILL_SWITCH", "tenant free: abuse", retry_after_s=5.0), KillSwitchActive),
        (error(504, "DEADLINE_EXCEEDED"), DeadlineExceeded),
        (error(500, "INTERNAL", retry_after_s=1.0), ServerError),
    ],
)
def test_answers_that_are_never_retried(answer: httpx.Response, cls: type[BallastClientError]) -> None:
    h = harness(answer, ok(), retry_budget_min_retries=10)
    with pytest.raises(cls):
        h.client.generate("Hello")
    assert len(h.server.requests) == 1
    assert h.sleep.waits_s == []
    assert h.client.retry_budget.retries_granted == 0


def test_attempts_are_capped_at_max_attempts() -> None:
    h = harness(overloaded(retry_after_s=1.0), max_attempts=3, retry_budget_min_retries=10)
    with pytest.raises(Overloaded) as info:
        h.client.generate("Hello")
    assert info.value.retry_after_s == 1.0  # the last answer's error
    assert len(h.server.requests) == 3
    assert h.sleep.waits_s == [1.0, 1.0]


def test_a_wait_past_the_deadline_ends_the_call_and_the_time_left_is_sent() -> None:
    h = harness(overloaded(retry_after_s=1.0), request_timeout_ms=2500, retry_budget_min_retries=10)
    with pytest.raises(Overloaded):
        h.client.generate("Hello")
    # t=0: 2500 ms left; wait 1 s; t=1: 1500 ms left; wait 1 s; t=2: 500 ms left (3rd attempt);
    # max_attempts reached. Each attempt carries the time *left*, not the original budget.
    assert h.server.header("X-Request-Timeout-Ms") == ["2500", "1500", "500"]
    assert h.sleep.waits_s == [1.0, 1.0]

    h = harness(overloaded(retry_after_s=3.0), ok(), request_timeout_ms=2500, retry_budget_min_retries=10)
    with pytest.raises(Overloaded):
        h.client.generate("Hello")  # a 3 s wait would end past the 2.5 s deadline
    assert len(h.server.requests) == 1 and h.sleep.waits_s == []


def test_a_retry_after_over_max_retry_wait_is_not_waited_out() -> None:
    h = harness(overloaded(retry_after_s=60.0), ok(), max_retry_wait_s=30.0)
    with pytest.raises(Overloaded) as info:
        h.client.generate("Hello")
    assert info.value.retry_after_s == 60.0
    assert len(h.server.requests) == 1 and h.sleep.waits_s == []


def test_idempotency_key_is_the_same_on_every_retry() -> None:
    h = harness(overloaded(), error(429, "QUOTA_EXCEEDED", retry_after_s=1.0), ok(), retry_budget_min_retries=10)
    h.client.generate("Hello", idempotency_key="order-42")
    assert h.server.header("Idempotency-Key") == ["order-42", "order-42", "order-42"]


# ============================================================================ retry budget


def test_budget_window_walks_tick_by_tick() -> None:
    budget = RetryBudgetWindow(ratio=0.1, window=20, min_retries=1)
    budget.on_request()
    assert budget.limit() == 1  # fresh: the floor lets one retry through
    assert budget.try_acquire_retry() is True
    assert budget.try_acquire_retry() is False  # 1 retry in a window of 1 request
    for _ in range(18):
        budget.on_request()
    assert (budget.requests_in_window(), budget.limit(), budget.retries_in_window()) == (19, 1, 1)
    assert budget.try_acquire_retry() is False
    budget.on_request()  # 20 requests: 10 % is 2
    assert budget.limit() == 2
    assert budget.try_acquire_retry() is True
    assert budget.try_acquire_retry() is False
    # The first retry was stamped at request 1: it leaves the window at request 21.
    budget.on_request()
    assert (budget.requests_in_window(), budget.retries_in_window()) == (20, 1)
    assert budget.try_acquire_retry() is True
    assert budget.snapshot() == {
        "requests_in_window": 20,
        "retries_in_window": 2,
        "retry_limit": 2,
        "retries_granted": 3,
        "retries_denied": 3,
    }


def test_budget_ratio_zero_with_no_floor_never_retries() -> None:
    budget = RetryBudgetWindow(ratio=0.0, window=10, min_retries=0)
    for _ in range(10):
        budget.on_request()
    assert budget.try_acquire_retry() is False


def test_retry_budget_denies_retries_over_ten_percent() -> None:
    h = harness(overloaded(), ok())  # 1: 503 then 200 — the fresh client's one retry
    h.client.generate("Hello")
    assert len(h.server.requests) == 2

    for _ in range(18):  # calls 2..19 succeed at once
        h.server.answers = [ok()]
        h.client.generate("Hello")
    assert len(h.server.requests) == 20

    h.server.answers = [overloaded(), ok()]  # call 20: 2 retries allowed in 20 calls, 1 used
    h.client.generate("Hello")
    assert len(h.server.requests) == 22

    h.server.answers = [overloaded(), ok()]  # call 21: 2 of 2 used — denied, the 503 is raised
    with pytest.raises(Overloaded):
        h.client.generate("Hello")
    assert len(h.server.requests) == 23
    assert (h.client.retry_budget.retries_granted, h.client.retry_budget.retries_denied) == (2, 1)


def test_a_locally_throttled_call_does_not_count_for_the_budget() -> None:
    h = harness(overloaded(retry_after_s=None), max_attempts=1, throttle=ThrottleConfig())
    sent = 0
    for _ in range(20):
        try:
            h.client.generate("Hello")
        except ThrottledLocally:
            pass
        except Overloaded:
            sent += 1
    assert h.client.retry_budget.requests_in_window() == sent == len(h.server.requests)


# ============================================================================ throttle


def test_throttle_rejects_locally_after_refusals_and_recovers_when_the_window_ages_out() -> None:
    h = harness(overloaded(retry_after_s=None), max_attempts=1, throttle=ThrottleConfig(k=2.0, window_s=120.0))
    throttled = refused = 0
    for _ in range(50):
        try:
            h.client.generate("Hello")
        except ThrottledLocally as e:
            throttled += 1
            assert e.status is None and e.code == "THROTTLED_LOCALLY"
        except Overloaded:
            refused += 1
    # With no accepts, p = requests / (requests + 1): 0, then 1/2 (u = 0.5 is not below it),
    # then 2/3 and on — every later call is rejected before it leaves the process.
    assert refused == len(h.server.requests) == 2
    assert throttled == 48
    throttle = h.client.throttle
    assert (throttle.requests, throttle.accepts) == (50, 0)

    # Everything was counted in the bucket of t=0; it is in the window through t=119.
    h.server.answers = [ok()]
    h.clock.advance(119)
    assert throttle.probability() == pytest.approx(50 / 51)
    h.clock.advance(1)
    assert throttle.probability() == 0.0
    assert h.client.generate("Hello").text == "hello world"
    assert len(h.server.requests) == 3
    assert (throttle.requests, throttle.accepts) == (1, 1)


def test_answers_that_are_not_overload_refusals_count_as_accepts() -> None:
    h = harness(error(422, "INVALID_REQUEST", field="prompt"), max_attempts=1, throttle=ThrottleConfig())
    for _ in range(30):
        with pytest.raises(InvalidRequest):
            h.client.generate("")
    assert len(h.server.requests) == 30  # the server answered: nothing throttled
    assert (h.client.throttle.requests, h.client.throttle.accepts) == (30, 30)


@pytest.mark.parametrize(
    ("answer", "accepted"),
    [
        (error(429, "QUOTA_EXCEEDED"), 0),
        (error(429, "CONCURRENCY_LIMIT"), 0),
        (error(503, "OVERLOADED"), 0),
        (error(503, "MODEL_UNAVAILABLE"), 0),
        (error(503, "KILL_SWITCH"), 1),  # an operator's refusal, not load
        (error(504, "DEADLINE_EXCEEDED"), 1),
        (error(401, "UNAUTHENTICATED"), 1),
        (httpx.ConnectError("refused"), 0),
        (ok(), 1),
    ],
)
def test_which_outcomes_record_an_accept(answer: Answer, accepted: int) -> None:
    h = harness(answer, max_attempts=1, throttle=ThrottleConfig())
    try:
        h.client.generate("Hello")
    except BallastClientError:
        pass
    assert (h.client.throttle.requests, h.client.throttle.accepts) == (1, accepted)


def test_a_retry_refused_by_the_throttle_raises_the_last_answer() -> None:
    h = harness(overloaded(retry_after_s=1.0), throttle=ThrottleConfig(), retry_budget_min_retries=10)
    with pytest.raises(Overloaded):  # not ThrottledLocally: requests did leave the process
        h.client.generate("Hello")
    # Attempt 1: p = 0. Attempt 2: p = 1/2, u = 0.5 sends. Attempt 3: p = 2/3, rejected.
    assert len(h.server.requests) == 2
    assert h.client.throttle.requests == 3


# ============================================================================ transport errors


def test_connection_error_is_retried_then_succeeds() -> None:
    h = harness(httpx.ConnectError("connection refused"), ok())
    assert h.client.generate("Hello").text == "hello world"
    assert len(h.server.requests) == 2
    assert h.sleep.waits_s == [0.05]  # no Retry-After: full jitter, 0.5 × 0.1


def test_connection_errors_end_in_connection_failed_after_the_attempts() -> None:
    h = harness(httpx.ConnectError("connection refused"), retry_budget_min_retries=10)
    with pytest.raises(ConnectionFailed) as info:
        h.client.generate("Hello")
    assert info.value.status is None and "ConnectError" in info.value.message
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert len(h.server.requests) == 3
    assert h.sleep.waits_s == [0.05, 0.1]  # caps 0.1, 0.2: doubling


def test_connection_failures_feed_the_throttle_and_a_refused_retry_keeps_the_cause() -> None:
    h = harness(httpx.ConnectError("connection refused"), retry_budget_min_retries=10, throttle=ThrottleConfig())
    with pytest.raises(ConnectionFailed) as info:
        h.client.generate("Hello")
    # No answer is no accept: attempt 3 (p = 2/3) is refused locally and the last failure is raised.
    assert len(h.server.requests) == 2
    assert (h.client.throttle.requests, h.client.throttle.accepts) == (3, 0)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


@pytest.mark.parametrize("exc", [httpx.ConnectTimeout("slow"), httpx.RemoteProtocolError("disconnected")])
def test_other_safe_transport_errors_are_retried(exc: Exception) -> None:
    h = harness(exc, ok())
    h.client.generate("Hello")
    assert len(h.server.requests) == 2


def test_read_timeout_is_retried_only_with_an_idempotency_key() -> None:
    h = harness(httpx.ReadTimeout("no answer"), ok())
    with pytest.raises(ConnectionFailed, match="ReadTimeout"):
        h.client.generate("Hello")
    assert len(h.server.requests) == 1

    h = harness(httpx.ReadTimeout("no answer"), ok())
    assert h.client.generate("Hello", idempotency_key="k-1").text == "hello world"
    assert h.server.header("Idempotency-Key") == ["k-1", "k-1"]


def test_a_read_timeout_past_the_client_deadline_is_deadline_exceeded() -> None:
    clock_holder: list[FakeClock] = []

    def hang(request: httpx.Request) -> httpx.Response:
        clock_holder[0].advance(3)  # the attempt used up the whole deadline
        raise httpx.ReadTimeout("no answer")

    h = harness(hang, ok(), request_timeout_ms=2000)
    clock_holder.append(h.clock)
    with pytest.raises(DeadlineExceeded) as info:
        h.client.generate("Hello", idempotency_key="k-1")
    assert info.value.status is None  # the client's deadline, not a 504
    assert len(h.server.requests) == 1


# ============================================================================ streaming


def test_stream_yields_token_texts_and_keeps_the_done_payload() -> None:
    h = harness(sse(("token", {"text": "hel", "tokens": 3}), ("token", {"text": "lo", "tokens": 2}), ("done", DONE)))
    stream = h.client.stream("Hello", max_tokens=5)
    assert h.server.requests == []  # nothing goes out before iteration
    assert list(stream) == ["hel", "lo"]

    done = stream.done
    assert done is not None and done is h.client.last_done
    assert done.text == "hello"  # the concatenated tokens; the done event carries no text
    assert (done.tokens_generated, done.degradation_level, done.degraded_reasons) == (11, 1, ("max_tokens_clamped",))
    assert done.raw == DONE
    (req,) = h.server.requests
    assert json.loads(req.content)["stream"] is True
    assert req.headers["Accept"] == "text/event-stream"


def test_stream_error_event_raises_its_typed_error_after_the_tokens_before_it() -> None:
    h = harness(
        sse(
            ("token", {"text": "par", "tokens": 3}),
            ("error", {"error": {"code": "DEADLINE_EXCEEDED", "message": "no answer within 2.000s"}}),
        ),
        throttle=ThrottleConfig(),
    )
    got: list[str] = []
    with pytest.raises(DeadlineExceeded) as info:
        for text in h.client.stream("Hello"):
            got.append(text)
    assert got == ["par"]
    assert (info.value.status, info.value.message) == (504, "no answer within 2.000s")  # the code's status
    assert h.client.last_done is None
    assert h.client.throttle.accepts == 1  # the first event was a token: accepted


def test_stream_overload_error_as_first_event_is_not_an_accept() -> None:
    h = harness(
        sse(("error", {"error": {"code": "MODEL_UNAVAILABLE", "message": "chain failed", "retry_after_s": 1.0}})),
        throttle=ThrottleConfig(),
    )
    with pytest.raises(ModelUnavailable) as info:
        list(h.client.stream("Hello"))
    assert (info.value.status, info.value.retry_after_s) == (503, 1.0)
    assert len(h.server.requests) == 1  # after a 200 nothing is retried
    assert (h.client.throttle.requests, h.client.throttle.accepts) == (1, 0)


def test_stream_is_retried_before_it_starts() -> None:
    h = harness(overloaded(retry_after_s=1.0), sse(("token", {"text": "ok", "tokens": 2}), ("done", DONE)))
    assert list(h.client.stream("Hello")) == ["ok"]
    assert len(h.server.requests) == 2 and h.sleep.waits_s == [1.0]


def test_stream_refused_before_it_starts_raises_the_typed_error() -> None:
    h = harness(error(401, "UNAUTHENTICATED", "unknown key"))
    with pytest.raises(Unauthenticated):
        list(h.client.stream("Hello"))


class RecordingByteStream(httpx.SyncByteStream):
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.closed = False

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield self.body

    def close(self) -> None:
        self.closed = True


def test_closing_a_stream_early_releases_the_connection() -> None:
    body = RecordingByteStream(b'event: token\ndata: {"text": "a", "tokens": 1}\n\n')
    h = harness(httpx.Response(200, stream=body, headers={"Content-Type": "text/event-stream"}))
    with h.client.stream("Hello") as stream:
        assert next(stream) == "a"
        assert body.closed is False
    assert body.closed is True
    assert stream.done is None


def test_stream_without_done_is_a_connection_failure() -> None:
    h = harness(sse(("token", {"text": "cut", "tokens": 3})))
    stream = h.client.stream("Hello")
    with pytest.raises(ConnectionFailed, match="without a done"):
        list(stream)
    assert stream.done is None


class BreakingByteStream(httpx.SyncByteStream):
    """A body that sends ``body`` and then breaks (the node holding the stream went away)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield self.body
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_a_stream_cut_after_its_tokens_is_resumed_with_the_ids_the_caller_has() -> None:
    cut = httpx.Response(
        200,
        stream=BreakingByteStream(b'event: token\ndata: {"text": "h\u00e9", "tokens": 3, "ids": [104, 195, 169]}\n\n'),
        headers={"Content-Type": "text/event-stream"},
    )
    rest = sse(("token", {"text": "llo", "tokens": 3, "ids": [108, 108, 111]}), ("done", {**DONE, "resumed_tokens": 3}))
    h = harness(cut, rest, request_timeout_ms=10_000)
    stream = h.client.stream("Hello", max_tokens=6)
    assert list(stream) == ["h\u00e9", "llo"]  # one stream to the caller, nothing twice
    assert stream.resumes == 1 and stream.done is not None and stream.done.text == "h\u00e9llo"
    first, second = h.server.bodies()
    assert "resume" not in first
    # Characters, not bytes: the server skips what the caller has by its text's length.
    assert second == {**first, "resume": {"ids": [104, 195, 169], "text_chars": 2}}
    assert len(h.sleep.waits_s) == 1  # the backoff before the resume, inside the deadline


def test_a_stream_whose_body_ended_without_done_is_resumed_and_attempts_still_bound_it() -> None:
    part = sse(("token", {"text": "a", "tokens": 1, "ids": [97]}))
    h = harness(part, sse(("token", {"text": "b", "tokens": 1, "ids": [98]})), max_attempts=2)
    got: list[str] = []
    with pytest.raises(ConnectionFailed, match="without a done"):
        for text in h.client.stream("Hello"):
            got.append(text)
    assert got == ["a", "b"]
    assert [b.get("resume") for b in h.server.bodies()] == [None, {"ids": [97], "text_chars": 1}]


def test_a_cut_stream_whose_tokens_came_without_ids_is_not_resumed() -> None:
    # The fallback model answered (no ids): its tokens are not the primary's to prefill.
    h = harness(sse(("token", {"text": "a", "tokens": 1})), sse(("done", DONE)))
    with pytest.raises(ConnectionFailed):
        list(h.client.stream("Hello"))
    assert len(h.server.requests) == 1


def test_sse_decoder_joins_data_lines_and_skips_comments() -> None:
    dec = SSEDecoder()
    lines = [": keep-alive", "event: token", 'data: {"text":', 'data: "a"}', "", "", "data: plain", ""]
    events = [e for e in (dec.feed(line) for line in lines) if e is not None]
    assert events == [("token", '{"text":\n"a"}'), ("message", "plain")]


# ============================================================================ async


async def test_async_generate_retries_then_succeeds() -> None:
    h = Harness(scripted_server(overloaded(retry_after_s=2.0), ok()), is_async=True)
    async with h.client as client:
        gen = await client.generate("Hello", idempotency_key="a-1")
    assert gen.text == "hello world"
    assert h.sleep.waits_s == [2.0]
    assert h.server.header("Idempotency-Key") == ["a-1", "a-1"]


async def test_async_generate_raises_typed_errors_and_connection_failed() -> None:
    h = Harness(scripted_server(error(403, "FORBIDDEN")), is_async=True)
    with pytest.raises(Forbidden):
        await h.client.generate("Hello")

    h = Harness(scripted_server(httpx.ConnectError("refused")), is_async=True, retry_budget_min_retries=10)
    with pytest.raises(ConnectionFailed):
        await h.client.generate("Hello")
    assert len(h.server.requests) == 3 and h.sleep.waits_s == [0.05, 0.1]
    await h.client.aclose()


async def test_async_throttle_rejects_locally() -> None:
    h = Harness(
        scripted_server(overloaded(retry_after_s=None)), is_async=True, max_attempts=1, throttle=ThrottleConfig()
    )
    outcomes = []
    for _ in range(10):
        try:
            await h.client.generate("Hello")
        except BallastClientError as e:
            outcomes.append(type(e))
    assert outcomes == [Overloaded, Overloaded] + [ThrottledLocally] * 8
    assert len(h.server.requests) == 2


async def test_async_stream_yields_tokens_and_done() -> None:
    h = Harness(
        scripted_server(
            sse(("token", {"text": "a", "tokens": 1}), ("token", {"text": "b", "tokens": 1}), ("done", DONE))
        ),
        is_async=True,
    )
    stream = h.client.stream("Hello")
    got = [text async for text in stream]
    assert got == ["a", "b"]
    assert stream.done is not None and stream.done.text == "ab"
    assert h.client.last_done is stream.done


async def test_async_stream_cut_is_resumed() -> None:
    part = sse(("token", {"text": "a", "tokens": 1, "ids": [97]}))
    rest = sse(("token", {"text": "b", "tokens": 1, "ids": [98]}), ("done", DONE))
    h = Harness(scripted_server(part, rest), is_async=True)
    stream = h.client.stream("Hello")
    assert [text async for text in stream] == ["a", "b"]
    assert stream.resumes == 1 and stream.done is not None and stream.done.text == "ab"
    assert h.server.bodies()[1]["resume"] == {"ids": [97], "text_chars": 1}


async def test_async_stream_error_event_raises() -> None:
    h = Harness(
        scripted_server(sse(("error", {"error": {"code": "KILL_SWITCH", "message": "model off"}}))),
        is_async=True,
    )
    with pytest.raises(KillSwitchActive, match="model off"):
        async with h.client.stream("Hello") as stream:
            async for _ in stream:
                pass


def test_throttles_are_per_criticality_so_shed_sheddable_calls_never_throttle_critical_ones() -> None:
    h = harness(overloaded(), max_attempts=1, throttle=ThrottleConfig())
    for _ in range(20):
        with pytest.raises((Overloaded, ThrottledLocally)):
            h.client.generate("Hello", criticality="sheddable")
    sent_sheddable = len(h.server.requests)
    assert sent_sheddable < 5  # the sheddable throttle closed after a few refusals
    # Critical calls have their own, untouched throttle: every one goes out.
    h.server.answers = [ok()] * 10
    for _ in range(10):
        assert h.client.generate("Hello", criticality="critical").text == "hello world"
    assert len(h.server.requests) == sent_sheddable + 10
    assert h.client.throttle.probability() == 0.0  # `throttle` is the default (critical) class's


def test_one_shared_throttle_when_not_per_criticality() -> None:
    h = harness(overloaded(), max_attempts=1, throttle=ThrottleConfig(), throttle_per_criticality=False)
    for _ in range(20):
        with pytest.raises((Overloaded, ThrottledLocally)):
            h.client.generate("Hello", criticality="sheddable")
    with pytest.raises(ThrottledLocally):  # the critical call is throttled by the sheddable refusals
        h.client.generate("Hello", criticality="critical")


# ============================================================================ sync/async parity


def _parity_script() -> list[Answer]:
    """A refusal with Retry-After, a dropped connection, then a unary answer; then a stream."""
    return [
        overloaded(retry_after_s=2.0),
        httpx.ConnectError("refused"),
        ok(),
        error(429, "QUOTA_EXCEEDED", retry_after_s=1.0),
        sse(("token", {"text": "he"}), ("token", {"text": "llo"}), ("done", DONE)),
        error(403, "FORBIDDEN"),
    ]


def _wire(h: Harness) -> list[tuple[str, str, dict[str, str], bytes]]:
    return [(r.method, r.url.path, dict(r.headers), r.content) for r in h.server.requests]


def test_sync_and_async_clients_send_the_same_requests_and_wait_the_same_times() -> None:
    """Both clients drive one shared core; only send/read/sleep differ, so the wire must match."""
    cfg = dict(request_timeout_ms=30_000, retry_budget_min_retries=10)
    sync_h = Harness(scripted_server(*_parity_script()), **cfg)
    async_h = Harness(scripted_server(*_parity_script()), is_async=True, **cfg)

    sync_out: list[Any] = [sync_h.client.generate("Hello", idempotency_key="k-1").text]
    with sync_h.client.stream("Hello", criticality="sheddable") as tokens:
        sync_out.append(list(tokens))
    with pytest.raises(Forbidden):
        sync_h.client.generate("Hello")

    async def run_async() -> list[Any]:
        out: list[Any] = [(await async_h.client.generate("Hello", idempotency_key="k-1")).text]
        async with async_h.client.stream("Hello", criticality="sheddable") as stream:
            out.append([text async for text in stream])
        with pytest.raises(Forbidden):
            await async_h.client.generate("Hello")
        return out

    async_out = asyncio.run(run_async())
    assert sync_out == async_out == ["hello world", ["he", "llo"]]
    assert sync_h.sleep.waits_s == async_h.sleep.waits_s == [2.0, 0.1, 1.0]
    sync_wire, async_wire = _wire(sync_h), _wire(async_h)
    assert len(sync_wire) == 6
    for (s_method, s_path, s_headers, s_body), (a_method, a_path, a_headers, a_body) in zip(sync_wire, async_wire):
        assert (s_method, s_path, s_body) == (a_method, a_path, a_body)
        assert s_headers == a_headers  # Idempotency-Key, X-Request-Timeout-Ms and User-Agent included
    assert sync_wire[4][2]["accept"] == "text/event-stream" and "idempotency-key" not in sync_wire[4][2]
    assert sync_h.client.retry_budget.snapshot() == async_h.client.retry_budget.snapshot()


def test_the_sdk_names_errors_as_the_server_does_and_keeps_its_first_names() -> None:
    import ballast.client as sdk
    from ballast import errors as server

    assert sdk.Unauthenticated.default_code == server.Unauthenticated.code
    assert sdk.KillSwitchActive.default_code == server.KillSwitchActive.code
    assert sdk.Unauthorized is sdk.Unauthenticated and sdk.KillSwitched is sdk.KillSwitchActive
