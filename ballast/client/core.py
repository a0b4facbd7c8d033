"""The shared core of the sync and async clients: every decision, no I/O (sans-I/O).

``ClientCore`` lives across calls (config, retry budget, throttles, injected clock and
rand); ``Call`` is one call's attempts; ``ClientBase`` is the surface both clients share.
``BallastClient`` (sync.py) and ``AsyncBallastClient`` (aio.py) only send, read and sleep.

* Retried: 429 and 503 with Retry-After, but not 503 ``KILL_SWITCH`` (an operator's
  decision); ``ConnectError``/``ConnectTimeout`` (the server never saw it);
  ``RemoteProtocolError`` before a complete answer (a stale pooled connection, which
  httpx discards). A stream, only until its 200 head.
* Retried only with an ``idempotency_key``: ``ReadTimeout``, ``ReadError``,
  ``WriteTimeout``, ``WriteError`` (the server may have started; it would run twice).
* A stream cut after its 200 is resumed: the next attempt carries ``resume`` (the token
  ids and characters the caller has), so no text is read twice; not after a token event
  without ids (the fallback's). A resume counts as an attempt and a retry.
* Never retried: 4xx validation/auth, 504, other 5xx, an ``error`` event in a stream.
* Wait = max(Retry-After, ``ballast.policies.retry.backoff_s``'s full jitter). No retry when the
  wait ends at or past the deadline or exceeds ``max_retry_wait_s``, at
  ``max_attempts``, or when the budget or the throttle says no: the call then raises the
  last answer's typed error. Retry-After is the body's ``retry_after_s``, else the
  header's delta-seconds (not an HTTP-date: the client's clock is monotonic).

Retry budget (``RetryBudgetWindow``): retries ≤ ``retry_budget_ratio`` of the last
``retry_budget_window`` calls (not attempts), and at least ``retry_budget_min_retries``;
count-based, so bounded and without a clock. Adaptive throttle (SRE book,
``ballast.policies.throttle``): ``should_send()`` before each attempt, False on the first raising
``ThrottledLocally`` (nothing left the process); ``record_accept()`` after every answer
but an overload refusal (429 ``QUOTA_EXCEEDED``/``CONCURRENCY_LIMIT``, 503
``OVERLOADED``/``MODEL_UNAVAILABLE``), never after a transport error; a stream is judged
by its first event. Deadline: each attempt sends the time left of ``request_timeout_ms``
as ``X-Request-Timeout-Ms`` and clamps its httpx timeouts to it; a read timeout past the
deadline raises ``DeadlineExceeded`` with ``status=None``.

One lock in ``ClientCore`` guards budget and throttles (threads may share a sync client;
the async client never awaits holding it). ``client.last_done`` is for a single caller;
concurrent streams read ``TokenStream.done``. Not tenacity: the decisions between
attempts need the injected clock and rand, so they would be hooks around it anyway.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from ballast.client.budget import EPSILON, RetryBudgetWindow
from ballast.client.config import ClientConfig
from ballast.client.errors import (
    BallastClientError,
    ConnectionFailed,
    DeadlineExceeded,
    ServerError,
    ThrottledLocally,
    error_from_answer,
    error_from_payload,
    is_overload_refusal,
    is_retryable_answer,
)
from ballast.client.protocol import USER_AGENT, Generation, SSEDecoder, build_payload
from ballast.policies.retry import backoff_s
from ballast.policies.throttle import AdaptiveThrottle

MAX_THROTTLES = 8  # per client: the four criticalities and a little room


class ClientCore:
    """What both clients share across calls: config, budget, throttle, injected time.

    ``_lock`` guards the budget and the throttle: both are read-modify-write and a
    sync client may be used from several threads. Nothing blocks or awaits while
    it is held.
    """

    def __init__(self, cfg: ClientConfig, clock: Callable[[], float], rand: Callable[[], float]) -> None:
        if not isinstance(cfg, ClientConfig):
            raise ValueError(f"cfg: must be a ClientConfig, got {cfg!r}")
        self.cfg = cfg
        self.clock = clock
        self.rand = rand
        self.retry_cfg = cfg.retry_config()
        self.budget = RetryBudgetWindow(cfg.retry_budget_ratio, cfg.retry_budget_window, cfg.retry_budget_min_retries)
        # Keyed by criticality (bounded: the server's four classes, plus whatever a caller
        # misspells, which the server then refuses); one shared entry when not per class.
        self._throttles: dict[str, AdaptiveThrottle] = {}
        self._lock = threading.Lock()

    def _throttle_locked(self, criticality: str) -> AdaptiveThrottle | None:
        """Callers hold ``_lock`` (it may add an entry)."""
        if self.cfg.throttle is None:
            return None
        key = criticality if self.cfg.throttle_per_criticality else "*"
        t = self._throttles.get(key)
        if t is None:
            if len(self._throttles) >= MAX_THROTTLES:
                key = "*"  # past the bound, odd names share one throttle
                t = self._throttles.get(key)
            if t is None:
                t = self._throttles[key] = AdaptiveThrottle(self.cfg.throttle, self.clock, self.rand)
        return t

    def throttle_for(self, criticality: str = "critical") -> AdaptiveThrottle | None:
        with self._lock:
            return self._throttle_locked(criticality)

    def on_request(self) -> None:
        with self._lock:
            self.budget.on_request()

    def try_acquire_retry(self) -> bool:
        with self._lock:
            return self.budget.try_acquire_retry()

    def should_send(self, criticality: str = "critical") -> bool:
        with self._lock:
            t = self._throttle_locked(criticality)
            return True if t is None else t.should_send()

    def reject_probability(self, criticality: str = "critical") -> float:
        with self._lock:
            t = self._throttle_locked(criticality)
            return 0.0 if t is None else t.probability()

    def record_accept(self, criticality: str = "critical") -> None:
        with self._lock:
            t = self._throttle_locked(criticality)
            if t is not None:
                t.record_accept()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api_key}", "User-Agent": USER_AGENT}


#: Transport errors after which the request surely never reached the server, or the server
#: dropped the connection before answering: retried for any request.
_SAFE_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
#: The request may have been processed: retried only when an Idempotency-Key makes a repeat safe.
_UNSAFE_TRANSPORT_ERRORS = (httpx.ReadTimeout, httpx.ReadError, httpx.WriteTimeout, httpx.WriteError)


class Call:
    """One call's attempts; all decisions, no I/O. Both clients drive it the same way::

        call = Call(core, idempotency_key)
        while True:
            headers, timeout = call.begin_attempt()        # may raise (throttle, deadline)
            try:   answer = send(headers, timeout)
            except httpx.TransportError as e:
                sleep(call.on_transport_error(e)); continue  # raises when not retried
            if answer is not 2xx:
                sleep(call.on_error_answer(...)); continue   # raises when not retried
            call.on_success(); return parse(answer)

    ``attempts`` counts attempts that were sent. ``last_error`` is the typed error
    of the previous attempt: a retry refused by the throttle re-raises it.
    """

    def __init__(
        self,
        core: ClientCore,
        idempotency_key: str | None = None,
        criticality: str = "critical",
        stream: bool = False,
    ) -> None:
        self._core = core
        self._stream = stream
        self._key = idempotency_key
        self._crit = criticality
        self.attempts = 0
        self.last_error: BallastClientError | None = None
        # Set by the first begin_attempt: a stream sends nothing until it is iterated.
        self._deadline_s: float | None = None
        # stream state
        self._sse = SSEDecoder()
        self._texts: list[str] = []
        self._ids: list[int] = []  # the token ids the caller has (bounded by max_tokens)
        self._resumable = True  # every token event so far carried its ids
        self._stream_counted = False
        self.done: Generation | None = None
        self.resumes = 0  # times a cut stream was resumed

    # -- before an attempt ------------------------------------------------------------
    def _time_left_s(self) -> float | None:
        return None if self._deadline_s is None else self._deadline_s - self._core.clock()

    def begin_attempt(self) -> tuple[dict[str, str], httpx.Timeout]:
        """Headers and timeouts for the next attempt; raises when it must not go out."""
        ms = self._core.cfg.request_timeout_ms
        if self.attempts == 0 and ms is not None:
            self._deadline_s = self._core.clock() + ms / 1000.0
        left_s = self._time_left_s()
        if left_s is not None and left_s <= 0:  # only after a wait; _plan_retry keeps waits inside it
            raise self.last_error or DeadlineExceeded("client deadline spent before sending", None)
        if not self._core.should_send(self._crit):
            if self.last_error is not None:
                raise self.last_error
            raise ThrottledLocally(
                "adaptive throttle refused locally "
                f"(reject probability {self._core.reject_probability(self._crit):.3f})"
            )
        if self.attempts == 0:  # the budget counts calls that went out, not local refusals
            self._core.on_request()
        self.attempts += 1
        # The class in the header too: HAProxy refuses a class the level sheds from it,
        # before the router's Python runs (ballast/router/edge.py).
        headers: dict[str, str] = {"X-Ballast-Criticality": self._crit}
        if self._key is not None:
            headers["Idempotency-Key"] = self._key  # the same key on every attempt of this call
        if self._stream:
            headers["Accept"] = "text/event-stream"
        cfg = self._core.cfg
        connect_s, read_s = cfg.connect_timeout_s, cfg.read_timeout_s
        if left_s is not None:
            headers["X-Request-Timeout-Ms"] = str(max(1, math.ceil(left_s * 1000.0 - EPSILON)))
            connect_s, read_s = min(connect_s, left_s), min(read_s, left_s)
        return headers, httpx.Timeout(connect=connect_s, read=read_s, write=read_s, pool=connect_s)

    # -- after an attempt -------------------------------------------------------------
    def _plan_retry(self, err: BallastClientError) -> float | None:
        """The wait before the next attempt, or None when there is none."""
        if self.attempts >= self._core.cfg.max_attempts:
            return None
        wait_s = backoff_s(self.attempts, self._core.retry_cfg, self._core.rand)
        if err.retry_after_s is not None:
            wait_s = max(wait_s, err.retry_after_s)
        if wait_s > self._core.cfg.max_retry_wait_s:
            return None
        left_s = self._time_left_s()
        if left_s is not None and wait_s >= left_s:
            return None
        # Checked last, so that retries_denied counts only retries that were wanted.
        if not self._core.try_acquire_retry():
            return None
        return wait_s

    def on_error_answer(self, status: int, headers: Mapping[str, str], body: bytes) -> float:
        """A non-2xx answer: the wait before retrying, or raises its typed error."""
        err = error_from_answer(status, headers, body)
        if not is_overload_refusal(err):
            self._core.record_accept(self._crit)
        self.last_error = err
        wait_s = self._plan_retry(err) if is_retryable_answer(err) else None
        if wait_s is None:
            raise err
        return wait_s

    def _transport_error(self, exc: httpx.TransportError) -> BallastClientError:
        left_s = self._time_left_s()
        if isinstance(exc, httpx.TimeoutException) and left_s is not None and left_s <= 0:
            return DeadlineExceeded(f"no answer within the client deadline ({type(exc).__name__})", None)
        detail = str(exc)
        return ConnectionFailed(f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)

    def on_transport_error(self, exc: httpx.TransportError) -> float:
        """No answer (no throttle accept): the wait before retrying, or raises."""
        err = self._transport_error(exc)
        err.__cause__ = exc  # kept when a later refused retry re-raises it
        self.last_error = err
        retryable = isinstance(exc, _SAFE_TRANSPORT_ERRORS) or (
            self._key is not None and isinstance(exc, _UNSAFE_TRANSPORT_ERRORS)
        )
        wait_s = self._plan_retry(err) if retryable and not isinstance(err, DeadlineExceeded) else None
        if wait_s is None:
            raise err from exc
        return wait_s

    def on_success(self, body: bytes) -> Generation:
        self._core.record_accept(self._crit)
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ServerError("answer is not JSON", 200, "MALFORMED_RESPONSE") from None
        return Generation.from_payload(payload)

    # -- a stream that answered 200 -----------------------------------------------------
    def on_stream_line(self, line: str) -> str | None:
        """One SSE line: a token batch's text, None, or raises the ``error`` event's typed error."""
        event = self._sse.feed(line)
        if event is None:
            return None
        name, data = event
        try:
            payload = json.loads(data) if data else {}
        except ValueError:
            raise ServerError(f"malformed {name!r} event", 200, "MALFORMED_RESPONSE") from None
        err = error_from_payload(payload) if name == "error" else None
        if not self._stream_counted:
            self._stream_counted = True
            if err is None or not is_overload_refusal(err):
                self._core.record_accept(self._crit)
        if err is not None:
            raise err
        if name == "token":
            text = payload.get("text") if isinstance(payload, dict) else None
            if not isinstance(text, str):
                raise ServerError("token event without text", 200, "MALFORMED_RESPONSE")
            ids = payload.get("ids")
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                self._ids.extend(ids)
            else:
                self._resumable = False
            self._texts.append(text)
            return text
        if name == "done":
            self.done = Generation.from_payload(payload, text="".join(self._texts))
        return None  # unknown events are ignored

    def stream_payload(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The body of the next stream attempt: the request, with ``resume`` once text reached the caller."""
        if not self._texts:
            return payload
        return {**payload, "resume": {"ids": list(self._ids), "text_chars": sum(len(t) for t in self._texts)}}

    def on_stream_cut(self, exc: httpx.TransportError | None) -> float:
        """A stream that answered 200 and ended without ``done`` (``exc``: how it broke;
        None: the body just ended): the wait before resuming it, or raises."""
        if exc is None:
            err: BallastClientError = ConnectionFailed("stream ended without a done event")
        else:
            err = self._transport_error(exc)
            err.__cause__ = exc
        self.last_error = err
        resumable = self._resumable and not (self._texts and not self._ids)
        wait_s = self._plan_retry(err) if resumable and not isinstance(err, DeadlineExceeded) else None
        if wait_s is None:
            raise err
        if self._texts:
            self.resumes += 1
        return wait_s

    def finish_stream(self) -> Generation:
        if self.done is None:
            raise ConnectionFailed("stream ended without a done event")
        return self.done


class StreamState:
    """What a token stream (sync or async) shows of its call besides its texts."""

    def __init__(self, call: Call) -> None:
        self._call = call

    @property
    def done(self) -> Generation | None:
        """The ``done`` payload as a ``Generation`` once the stream ended (its ``text`` the whole text)."""
        return self._call.done

    @property
    def resumes(self) -> int:
        """Times the stream was cut and resumed (the caller read it as one)."""
        return self._call.resumes


class ClientBase:
    """The surface both clients share; subclasses add only their I/O (send, read, sleep)."""

    def __init__(self, cfg: ClientConfig, clock: Callable[[], float], rand: Callable[[], float]) -> None:
        self._core = ClientCore(cfg, clock, rand)
        #: The last completed stream's ``done`` (single-caller convenience; see TokenStream.done).
        self.last_done: Generation | None = None

    @property
    def config(self) -> ClientConfig:
        return self._core.cfg

    @property
    def throttle(self) -> AdaptiveThrottle | None:
        """The default criticality's throttle (``critical``); see ``throttle_for``."""
        return self._core.throttle_for("critical")

    def throttle_for(self, criticality: str) -> AdaptiveThrottle | None:
        """The adaptive throttle this client keeps for ``criticality`` (None when disabled)."""
        return self._core.throttle_for(criticality)

    @property
    def retry_budget(self) -> RetryBudgetWindow:
        return self._core.budget

    def _unary_call(
        self, prompt: str, max_tokens: int, criticality: str, idempotency_key: str | None
    ) -> tuple[Call, dict[str, Any]]:
        return Call(self._core, idempotency_key, criticality), build_payload(prompt, max_tokens, criticality, False)

    def _stream_call(self, prompt: str, max_tokens: int, criticality: str) -> tuple[Call, dict[str, Any]]:
        # No Idempotency-Key for streams: nothing after the 200 head is retried anyway.
        return Call(self._core, None, criticality, stream=True), build_payload(prompt, max_tokens, criticality, True)
