"""Python client SDK for Ballast's ``POST /v1/generate``: typed errors, retries, client-side throttling.

Two clients with one surface, ``BallastClient`` (``httpx.Client``) and
``AsyncBallastClient`` (``httpx.AsyncClient``)::

    with BallastClient(ClientConfig("http://127.0.0.1:8000", "dev-key-gold")) as client:
        gen = client.generate("Hello", max_tokens=32)            # -> Generation
        with client.stream("Hello") as tokens:                    # -> TokenStream
            for text in tokens:
                print(text, end="")
        print(tokens.done.degradation_level)                      # the `done` payload

All decisions live in plain, I/O-free pieces shared by both clients (sans-I/O):
``error_from_answer`` / ``error_from_payload`` (the server's error body → typed
error), ``is_retryable_answer`` / ``is_overload_refusal``, ``RetryBudgetWindow``,
``SSEDecoder`` and ``_Call`` (one call's attempts: throttle check, deadline,
retry decision, throttle bookkeeping). The two client classes only do the I/O:
send, sleep, loop.

Retry rules (why each):

* Retried: 429 and 503 answers that carry Retry-After (the server says "later
  works"), except 503 ``KILL_SWITCH`` (an operator's decision; retrying it is
  pressure on a switch someone pulled on purpose); ``ConnectError`` /
  ``ConnectTimeout`` (the request never reached the server) and
  ``RemoteProtocolError`` before a complete answer (the server dropped the
  connection without answering, typically a stale pooled connection; httpx
  discards it, so the retry goes out on a fresh one). For a stream only until
  the 200 head arrived.
* Retried only with an ``idempotency_key``: a read timeout or a broken read/write
  (``ReadTimeout``, ``ReadError``, ``WriteTimeout``, ``WriteError``) — the
  server may have started generating; without a key a retry runs it twice.
* Never retried: 4xx validation/auth answers, 504, other 5xx, and anything
  after a stream answered 200 (tokens may already be with the caller).
* Wait = max(Retry-After, full-jitter backoff (``policies.retry.backoff_s``)).
  No retry when that wait ends at or past the call's deadline
  (``request_timeout_ms``) or exceeds ``max_retry_wait_s``, when
  ``max_attempts`` is reached, or when the retry budget says no. A retry that is
  refused ends the call with the typed error of the last answer.
* Retry-After is read from the body's ``retry_after_s`` (Ballast's precise value)
  and, when absent, from the ``Retry-After`` header (delta-seconds; the HTTP-date
  form is ignored: the client's clock is monotonic, not wall time).

Retry budget (``RetryBudgetWindow``): retries are at most ``retry_budget_ratio``
of the requests (calls, not attempts) counted over the last
``retry_budget_window`` requests (1000 by default), with a floor of
``retry_budget_min_retries`` (1) so a fresh client, which has seen fewer than 10
requests, can still retry once. Count-based, not time-based: the structure is
bounded (an int and a deque of at most the limit's stamps) and needs no clock.

Adaptive throttling (SRE book, "Handling Overload"): ``policies.throttle``
holds the math. Before each attempt ``should_send()``; False on the first
attempt raises ``ThrottledLocally`` — nothing left the process, guaranteed —
and False on a retry ends the call with the last answer's error (as a budget
denial does). After an answer ``record_accept()`` unless it was an overload
refusal (429 ``QUOTA_EXCEEDED`` / ``CONCURRENCY_LIMIT``, 503 ``OVERLOADED`` /
``MODEL_UNAVAILABLE``) or there was no answer (transport error). A stream is
counted when its first event arrives: an ``error`` event with an overload code
is a refusal, any other event is an accept.

Deadline: with ``request_timeout_ms`` the call has a deadline on the injected
clock; each attempt sends the time *left* as ``X-Request-Timeout-Ms`` and clamps
its httpx timeouts to it. A read timeout after the deadline is spent raises
``DeadlineExceeded`` with ``status=None`` (made by the client, not the server).

Thread and task safety: one lock in ``_Core`` guards the budget and the throttle
(a sync client may be shared by threads; the async client never awaits while
holding it). ``client.last_done`` is a convenience for single-caller use; with
concurrent streams read ``TokenStream.done`` instead.

Written by hand rather than with tenacity (which STYLE prefers for retry loops):
the loop itself is six lines per client; what matters is the decision between
attempts (answer-based retryability, Retry-After floor, deadline, a budget shared
across calls, the throttle consulted per attempt, a refused retry re-raising the
previous answer), all of which needs the injected clock and rand and would be
hooks around tenacity anyway; tenacity is also not among the installed packages.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from policies.retry import RetryConfig, backoff_s
from policies.throttle import AdaptiveThrottle, ThrottleConfig

MAX_THROTTLES = 8  # per client: the four criticalities and a little room

GENERATE_PATH = "/v1/generate"
USER_AGENT = "ballast-client/0.1"
CRITICALITIES = ("critical_plus", "critical", "sheddable_plus", "sheddable")

# floor(ratio × requests) landing a hair below an integer (0.1 × 30 = 3.0000000000000004
# is fine, 0.29 × 100 = 28.999999999999996 is not) would lose a whole retry.
_EPSILON = 1e-9
#: Marks "use the class's status" so that an explicit None (an error made on the client,
#: no HTTP status) survives pickling as None.
_CLASS_STATUS: Any = object()


# =========================================================================== errors


class BallastClientError(Exception):
    """Base of every error the client raises.

    ``status`` is the HTTP status of the answer (None when no answer was involved:
    a transport failure, a local throttle, a client-side deadline); ``code`` the
    server's error code (or the client's own, e.g. ``CONNECTION_FAILED``);
    ``retry_after_s`` what the server suggested, when it did. All arguments go to
    ``super().__init__`` so the error pickles (crosses process boundaries).
    """

    default_status: Optional[int] = None
    default_code: str = "CLIENT_ERROR"

    def __init__(
        self,
        message: str,
        status: Optional[int] = _CLASS_STATUS,
        code: Optional[str] = None,
        retry_after_s: Optional[float] = None,
    ) -> None:
        if status is _CLASS_STATUS:
            status = self.default_status
        code = code or self.default_code
        super().__init__(message, status, code, retry_after_s)
        self.message = message
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        where = f"{self.status} " if self.status is not None else ""
        return f"{where}{self.code}: {self.message}"


class Unauthorized(BallastClientError):
    default_status, default_code = 401, "UNAUTHENTICATED"


class Forbidden(BallastClientError):
    default_status, default_code = 403, "FORBIDDEN"


class InvalidRequest(BallastClientError):
    """422: the body was refused; ``field`` names the offending field."""

    default_status, default_code = 422, "INVALID_REQUEST"

    def __init__(
        self,
        message: str,
        status: Optional[int] = _CLASS_STATUS,
        code: Optional[str] = None,
        retry_after_s: Optional[float] = None,
        field: str = "",
    ) -> None:
        super().__init__(message, status, code, retry_after_s)
        self.args = (message, self.status, self.code, retry_after_s, field)
        self.field = field


class PayloadTooLarge(BallastClientError):
    default_status, default_code = 413, "PAYLOAD_TOO_LARGE"


class QuotaExceeded(BallastClientError):
    default_status, default_code = 429, "QUOTA_EXCEEDED"


class ConcurrencyLimited(BallastClientError):
    default_status, default_code = 429, "CONCURRENCY_LIMIT"


class Overloaded(BallastClientError):
    default_status, default_code = 503, "OVERLOADED"


class KillSwitched(BallastClientError):
    default_status, default_code = 503, "KILL_SWITCH"


class ModelUnavailable(BallastClientError):
    default_status, default_code = 503, "MODEL_UNAVAILABLE"


class DeadlineExceeded(BallastClientError):
    default_status, default_code = 504, "DEADLINE_EXCEEDED"


class ServerError(BallastClientError):
    """Any other 5xx, an unknown error code, or a malformed answer."""

    default_status, default_code = 500, "SERVER_ERROR"


class ConnectionFailed(BallastClientError):
    """No (complete) answer: a transport error, after the retries it was allowed."""

    default_status, default_code = None, "CONNECTION_FAILED"


class ThrottledLocally(BallastClientError):
    """The adaptive throttle refused the call's first attempt: no request left the process."""

    default_status, default_code = None, "THROTTLED_LOCALLY"


#: The server's codes (serve_app/errors.py and the README table), mapped once.
_BY_CODE: dict[str, type[BallastClientError]] = {
    "UNAUTHENTICATED": Unauthorized,
    "FORBIDDEN": Forbidden,
    "INVALID_REQUEST": InvalidRequest,
    "PAYLOAD_TOO_LARGE": PayloadTooLarge,
    "QUOTA_EXCEEDED": QuotaExceeded,
    "CONCURRENCY_LIMIT": ConcurrencyLimited,
    "OVERLOADED": Overloaded,
    "KILL_SWITCH": KillSwitched,
    "MODEL_UNAVAILABLE": ModelUnavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}
#: Only for answers without an error code (e.g. a proxy in front of Ballast):
#: a bare 429 is a rate limit, a bare 503 is backpressure (Serve's proxy answers so).
_BY_STATUS: dict[int, type[BallastClientError]] = {
    401: Unauthorized,
    403: Forbidden,
    413: PayloadTooLarge,
    422: InvalidRequest,
    429: QuotaExceeded,
    503: Overloaded,
    504: DeadlineExceeded,
}
_OVERLOAD_REFUSALS = (QuotaExceeded, ConcurrencyLimited, Overloaded, ModelUnavailable)
_RETRYABLE_STATUSES = frozenset({429, 503})
_MAX_MESSAGE_CHARS = 500


def _number_or_none(value: object) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def parse_retry_after_header(value: Optional[str]) -> Optional[float]:
    """``Retry-After`` as delta-seconds; None when absent, negative or an HTTP-date."""
    if value is None:
        return None
    try:
        return _number_or_none(float(value.strip()))
    except ValueError:
        return None


def error_from_payload(
    payload: object,
    status: Optional[int] = _CLASS_STATUS,
    retry_after_header: Optional[str] = None,
    fallback_message: str = "",
) -> BallastClientError:
    """A typed error from ``{"error": {"code", "message", "retry_after_s"?, "field"?}}``.

    Code first (a known code picks its class), status second (only when the body
    has no code), else ``ServerError``. ``status`` is the answer's HTTP status;
    leave it out for an SSE ``error`` event (the class's status is used).
    """
    err = payload.get("error") if isinstance(payload, dict) else None
    err = err if isinstance(err, dict) else {}
    code = err.get("code") if isinstance(err.get("code"), str) and err.get("code") else None
    message = err.get("message") if isinstance(err.get("message"), str) else ""
    message = (message or fallback_message or "no message")[:_MAX_MESSAGE_CHARS]
    retry_after_s = _number_or_none(err.get("retry_after_s"))
    if retry_after_s is None:
        retry_after_s = parse_retry_after_header(retry_after_header)

    if code is not None:
        cls = _BY_CODE.get(code, ServerError)
    elif isinstance(status, int):
        cls = _BY_STATUS.get(status, ServerError)
    else:
        cls = ServerError
    if cls is InvalidRequest:
        field_name = err.get("field") if isinstance(err.get("field"), str) else ""
        return InvalidRequest(message, status, code, retry_after_s, field_name)
    return cls(message, status, code, retry_after_s)


def error_from_answer(status: int, headers: Mapping[str, str], body: bytes) -> BallastClientError:
    """A typed error from a non-2xx HTTP answer (its body need not be JSON)."""
    try:
        payload: object = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        payload = None
    text = body[:_MAX_MESSAGE_CHARS].decode("utf-8", "replace").strip() if payload is None else ""
    return error_from_payload(payload, status, headers.get("retry-after"), text or f"HTTP {status}")


def is_overload_refusal(err: BallastClientError) -> bool:
    """The server refused for load: counts against the adaptive throttle (no accept)."""
    return isinstance(err, _OVERLOAD_REFUSALS)


def is_retryable_answer(err: BallastClientError) -> bool:
    """429/503 with a Retry-After, except a kill switch (an operator's decision)."""
    return err.status in _RETRYABLE_STATUSES and err.retry_after_s is not None and not isinstance(err, KillSwitched)


# =========================================================================== config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: object) -> None:
    if not _is_number(value) or not 0 < value < math.inf:  # type: ignore[operator]
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


def _check_non_negative(name: str, value: object) -> None:
    if not _is_number(value) or not 0 <= value < math.inf:  # type: ignore[operator]
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    #: Sent as ``Authorization: Bearer <api_key>``; kept out of repr.
    api_key: str = field(repr=False)
    connect_timeout_s: float = 2.0
    #: Per read (for a stream: between two chunks), not per call.
    read_timeout_s: float = 60.0
    #: Attempts per call, the first included.
    max_attempts: int = 3
    #: Full-jitter backoff cap before the first retry; doubles per retry up to max_backoff_s.
    base_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    #: Retries at most this fraction of the requests seen in the window …
    retry_budget_ratio: float = 0.1
    #: … over the last this many requests (calls) …
    retry_budget_window: int = 1000
    #: … but at least this many retries per window (a fresh client can retry once).
    retry_budget_min_retries: int = 1
    #: A Retry-After (or backoff) longer than this ends the call instead of blocking it.
    max_retry_wait_s: float = 30.0
    #: Adaptive client-side throttling; None disables it.
    throttle: Optional[ThrottleConfig] = field(default_factory=ThrottleConfig)
    #: One throttle per criticality: refusals of sheddable calls (the first the server
    #: sheds) then throttle sheddable calls only, never the critical ones beside them.
    throttle_per_criticality: bool = True
    #: The call's deadline; each attempt sends the time left as X-Request-Timeout-Ms.
    request_timeout_ms: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: must be an http(s) URL, got {self.base_url!r}")
        if not isinstance(self.api_key, str) or not self.api_key.strip() or any(c in self.api_key for c in "\r\n "):
            raise ValueError("api_key: must be a non-empty string without spaces or newlines")
        _check_positive("connect_timeout_s", self.connect_timeout_s)
        _check_positive("read_timeout_s", self.read_timeout_s)
        _check_int("max_attempts", self.max_attempts, 1)
        _check_non_negative("base_backoff_s", self.base_backoff_s)
        _check_non_negative("max_backoff_s", self.max_backoff_s)
        if self.max_backoff_s < self.base_backoff_s:
            raise ValueError(f"max_backoff_s: must be >= base_backoff_s ({self.base_backoff_s}), got {self.max_backoff_s!r}")
        if not _is_number(self.retry_budget_ratio) or not 0 <= self.retry_budget_ratio <= 1:
            raise ValueError(f"retry_budget_ratio: must be in [0, 1], got {self.retry_budget_ratio!r}")
        _check_int("retry_budget_window", self.retry_budget_window, 1)
        _check_int("retry_budget_min_retries", self.retry_budget_min_retries, 0)
        _check_positive("max_retry_wait_s", self.max_retry_wait_s)
        if self.throttle is not None and not isinstance(self.throttle, ThrottleConfig):
            raise ValueError(f"throttle: must be a ThrottleConfig or None, got {self.throttle!r}")
        if self.request_timeout_ms is not None:
            _check_int("request_timeout_ms", self.request_timeout_ms, 1)

    def retry_config(self) -> RetryConfig:
        """The backoff math's config (``policies.retry``); its budget fields are unused here."""
        return RetryConfig(
            max_attempts=self.max_attempts, base_backoff_s=self.base_backoff_s, max_backoff_s=self.max_backoff_s
        )


# =========================================================================== answer


@dataclass(frozen=True)
class Generation:
    text: str
    tokens_generated: int
    model: str
    degradation_level: int
    degraded: bool
    degraded_reasons: tuple[str, ...]
    #: None when the primary model answered, else "fallback_model" or "cache".
    fallback: Optional[str]
    #: The answer (or, for a stream, the ``done`` payload) as the server sent it.
    raw: dict[str, Any] = field(compare=False)

    @classmethod
    def from_payload(cls, payload: object, text: Optional[str] = None) -> Generation:
        """From the JSON answer, or from a ``done`` event plus the streamed ``text``."""
        try:
            if not isinstance(payload, dict):
                raise TypeError("not an object")
            body_text = payload["text"] if text is None else text
            reasons = payload["degraded_reasons"]
            fallback = payload["fallback"]
            gen = cls(
                text=body_text,
                tokens_generated=int(payload["tokens_generated"]),
                model=str(payload["model"]),
                degradation_level=int(payload["degradation_level"]),
                degraded=bool(payload["degraded"]),
                degraded_reasons=tuple(str(r) for r in reasons),
                fallback=None if fallback is None else str(fallback),
                raw=payload,
            )
            if not isinstance(gen.text, str):
                raise TypeError("text is not a string")
            return gen
        except (KeyError, TypeError, ValueError) as e:
            raise ServerError(f"malformed answer: {type(e).__name__}: {e}", 200, "MALFORMED_RESPONSE") from None


# =========================================================================== retry budget


class RetryBudgetWindow:
    """Retries at most ``ratio`` × requests over the last ``window`` requests, at least ``min_retries``.

    Requests are counted by sequence number; each granted retry is stamped with
    the sequence number current when it was granted and ages out once ``window``
    newer requests were seen. (With calls in flight concurrently the stamp is the
    newest call's number, not necessarily the retried call's; the error is at
    most the number of calls in flight.) Bounded: the deque never holds more
    stamps than the limit, which is at most ``max(min_retries, ratio × window)``.
    Not locked itself: ``_Core`` holds the lock around it.
    """

    def __init__(self, ratio: float, window: int, min_retries: int) -> None:
        if not _is_number(ratio) or not 0 <= ratio <= 1:
            raise ValueError(f"ratio: must be in [0, 1], got {ratio!r}")
        _check_int("window", window, 1)
        _check_int("min_retries", min_retries, 0)
        self._ratio = ratio
        self._window = window
        self._min_retries = min_retries
        self._requests_total = 0
        self._retry_stamps: deque[int] = deque()
        #: Monotonic counters for metrics.
        self.retries_granted = 0
        self.retries_denied = 0

    def _expire(self) -> None:
        oldest_kept = self._requests_total - self._window  # stamps <= this are out of the window
        while self._retry_stamps and self._retry_stamps[0] <= oldest_kept:
            self._retry_stamps.popleft()

    def on_request(self) -> None:
        self._requests_total += 1
        self._expire()

    def requests_in_window(self) -> int:
        return min(self._requests_total, self._window)

    def retries_in_window(self) -> int:
        self._expire()
        return len(self._retry_stamps)

    def limit(self) -> int:
        return max(self._min_retries, math.floor(self._ratio * self.requests_in_window() + _EPSILON))

    def try_acquire_retry(self) -> bool:
        if self.retries_in_window() < self.limit():
            self._retry_stamps.append(self._requests_total)
            self.retries_granted += 1
            return True
        self.retries_denied += 1
        return False

    def snapshot(self) -> dict[str, int]:
        return {
            "requests_in_window": self.requests_in_window(),
            "retries_in_window": self.retries_in_window(),
            "retry_limit": self.limit(),
            "retries_granted": self.retries_granted,
            "retries_denied": self.retries_denied,
        }


# =========================================================================== SSE


class SSEDecoder:
    """Server-sent events, fed one line at a time (line endings stripped).

    ``feed`` returns ``(event, data)`` when a blank line completes an event, else
    None. Comments (``:``) and ``id``/``retry`` fields are ignored; several
    ``data`` lines are joined with newlines, as the SSE spec says.
    """

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> Optional[tuple[str, str]]:
        if line == "":
            if not self._data and not self._event:
                return None
            out = (self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


# =========================================================================== shared core


class _Core:
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

    def throttle_for(self, criticality: str = "critical") -> Optional[AdaptiveThrottle]:
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

    @property
    def throttle(self) -> Optional[AdaptiveThrottle]:
        """The throttle of the default criticality (``critical``)."""
        with self._lock:
            return self.throttle_for("critical")

    def on_request(self) -> None:
        with self._lock:
            self.budget.on_request()

    def try_acquire_retry(self) -> bool:
        with self._lock:
            return self.budget.try_acquire_retry()

    def should_send(self, criticality: str = "critical") -> bool:
        with self._lock:
            t = self.throttle_for(criticality)
            return True if t is None else t.should_send()

    def reject_probability(self, criticality: str = "critical") -> float:
        with self._lock:
            t = self.throttle_for(criticality)
            return 0.0 if t is None else t.probability()

    def record_accept(self, criticality: str = "critical") -> None:
        with self._lock:
            t = self.throttle_for(criticality)
            if t is not None:
                t.record_accept()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api_key}", "User-Agent": USER_AGENT}


def _payload(prompt: str, max_tokens: int, criticality: str, stream: bool) -> dict[str, Any]:
    # Bounds and allowed values are the server's to enforce (422 INVALID_REQUEST names the
    # field); the client does not keep a second copy of them.
    return {"prompt": prompt, "max_tokens": max_tokens, "criticality": criticality, "stream": stream}


#: Transport errors after which the request surely never reached the server, or the server
#: dropped the connection before answering: retried for any request.
_SAFE_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
#: The request may have been processed: retried only when an Idempotency-Key makes a repeat safe.
_UNSAFE_TRANSPORT_ERRORS = (httpx.ReadTimeout, httpx.ReadError, httpx.WriteTimeout, httpx.WriteError)


class _Call:
    """One call's attempts; all decisions, no I/O. Both clients drive it the same way::

        call = _Call(core, idempotency_key)
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

    def __init__(self, core: _Core, idempotency_key: Optional[str] = None, criticality: str = "critical") -> None:
        self._core = core
        self._key = idempotency_key
        self._crit = criticality
        self.attempts = 0
        self.last_error: Optional[BallastClientError] = None
        # Set by the first begin_attempt: a stream sends nothing until it is iterated.
        self._deadline_s: Optional[float] = None
        # stream state
        self._sse = SSEDecoder()
        self._texts: list[str] = []
        self._stream_counted = False
        self.done: Optional[Generation] = None

    # -- before an attempt ------------------------------------------------------------
    def _time_left_s(self) -> Optional[float]:
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
                f"adaptive throttle refused locally (reject probability {self._core.reject_probability(self._crit):.3f})"
            )
        if self.attempts == 0:  # the budget counts calls that went out, not local refusals
            self._core.on_request()
        self.attempts += 1
        headers: dict[str, str] = {}
        if self._key is not None:
            headers["Idempotency-Key"] = self._key  # the same key on every attempt of this call
        cfg = self._core.cfg
        connect_s, read_s = cfg.connect_timeout_s, cfg.read_timeout_s
        if left_s is not None:
            headers["X-Request-Timeout-Ms"] = str(max(1, math.ceil(left_s * 1000.0 - _EPSILON)))
            connect_s, read_s = min(connect_s, left_s), min(read_s, left_s)
        return headers, httpx.Timeout(connect=connect_s, read=read_s, write=read_s, pool=connect_s)

    # -- after an attempt -------------------------------------------------------------
    def _plan_retry(self, err: BallastClientError) -> Optional[float]:
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
    def on_stream_line(self, line: str) -> Optional[str]:
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
            self._texts.append(text)
            return text
        if name == "done":
            self.done = Generation.from_payload(payload, text="".join(self._texts))
        return None  # unknown events are ignored

    def on_stream_broken(self, exc: httpx.TransportError) -> BallastClientError:
        """A transport error after the stream began: never retried (tokens may be out)."""
        return self._transport_error(exc)

    def finish_stream(self) -> Generation:
        if self.done is None:
            raise ConnectionFailed("stream ended without a done event")
        return self.done


# =========================================================================== streams


class TokenStream:
    """Iterates the token-batch texts of one streamed call (sync).

    Nothing is sent until the first ``next()``. After the iteration ends, ``done``
    holds the ``done`` payload as a ``Generation`` (its ``text`` the concatenated
    tokens). An ``error`` event raises its typed error from ``next()``. Use it as a
    context manager (or call ``close()``) to release the connection when stopping
    early.
    """

    def __init__(self, gen: Iterator[str], call: _Call) -> None:
        self._gen = gen
        self._call = call

    @property
    def done(self) -> Optional[Generation]:
        return self._call.done

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()  # type: ignore[attr-defined]

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTokenStream:
    """``TokenStream`` for the async client: ``async for``, ``aclose()``, ``async with``."""

    def __init__(self, gen: AsyncIterator[str], call: _Call) -> None:
        self._gen = gen
        self._call = call

    @property
    def done(self) -> Optional[Generation]:
        return self._call.done

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# =========================================================================== clients


class BallastClient:
    """Sync client. ``transport`` replaces httpx's (tests: ``httpx.MockTransport``);
    ``clock`` (monotonic seconds), ``rand`` (u in [0, 1)) and ``sleep`` are injected
    for tests and shared by backoff, budget and throttle."""

    def __init__(
        self,
        cfg: ClientConfig,
        *,
        transport: Optional[httpx.BaseTransport] = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._core = _Core(cfg, clock, rand)
        self._sleep = sleep
        self._http = httpx.Client(base_url=cfg.base_url, headers=self._core.headers(), transport=transport)
        #: The last completed stream's ``done`` (single-caller convenience; see TokenStream.done).
        self.last_done: Optional[Generation] = None

    @property
    def config(self) -> ClientConfig:
        return self._core.cfg

    @property
    def throttle(self) -> Optional[AdaptiveThrottle]:
        """The default criticality's throttle (``critical``); see ``throttle_for``."""
        return self._core.throttle

    def throttle_for(self, criticality: str) -> Optional[AdaptiveThrottle]:
        """The adaptive throttle this client keeps for ``criticality`` (None when disabled)."""
        with self._core._lock:
            return self._core.throttle_for(criticality)

    @property
    def retry_budget(self) -> RetryBudgetWindow:
        return self._core.budget

    def generate(
        self,
        prompt: str,
        max_tokens: int = 64,
        criticality: str = "critical",
        idempotency_key: Optional[str] = None,
    ) -> Generation:
        call = _Call(self._core, idempotency_key, criticality)
        payload = _payload(prompt, max_tokens, criticality, stream=False)
        while True:
            headers, timeout = call.begin_attempt()
            try:
                resp = self._http.post(GENERATE_PATH, json=payload, headers=headers, timeout=timeout)
            except httpx.TransportError as e:
                self._sleep(call.on_transport_error(e))
                continue
            if not resp.is_success:
                self._sleep(call.on_error_answer(resp.status_code, resp.headers, resp.content))
                continue
            return call.on_success(resp.content)

    def stream(self, prompt: str, max_tokens: int = 64, criticality: str = "critical") -> TokenStream:
        call = _Call(self._core, None, criticality)
        return TokenStream(self._stream(call, _payload(prompt, max_tokens, criticality, stream=True)), call)

    def _stream(self, call: _Call, payload: dict[str, Any]) -> Iterator[str]:
        while True:
            headers, timeout = call.begin_attempt()
            headers["Accept"] = "text/event-stream"
            try:
                with self._http.stream("POST", GENERATE_PATH, json=payload, headers=headers, timeout=timeout) as resp:
                    if not resp.is_success:
                        resp.read()
                        wait_s = call.on_error_answer(resp.status_code, resp.headers, resp.content)
                    else:
                        yield from self._events(call, resp)
                        self.last_done = call.finish_stream()
                        return
            except httpx.TransportError as e:
                wait_s = call.on_transport_error(e)
            self._sleep(wait_s)

    @staticmethod
    def _events(call: _Call, resp: httpx.Response) -> Iterator[str]:
        try:
            for line in resp.iter_lines():
                text = call.on_stream_line(line)
                if text is not None:
                    yield text
                if call.done is not None:
                    return
        except httpx.TransportError as e:  # converted: the retry loop must not see it
            raise call.on_stream_broken(e) from e

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BallastClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBallastClient:
    """Async twin of ``BallastClient``; ``sleep`` is an async callable (``asyncio.sleep``)."""

    def __init__(
        self,
        cfg: ClientConfig,
        *,
        transport: Optional[httpx.AsyncBaseTransport] = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._core = _Core(cfg, clock, rand)
        self._sleep = sleep
        self._http = httpx.AsyncClient(base_url=cfg.base_url, headers=self._core.headers(), transport=transport)
        #: The last completed stream's ``done`` (single-caller convenience; see AsyncTokenStream.done).
        self.last_done: Optional[Generation] = None

    @property
    def config(self) -> ClientConfig:
        return self._core.cfg

    @property
    def throttle(self) -> Optional[AdaptiveThrottle]:
        """The default criticality's throttle (``critical``); see ``throttle_for``."""
        return self._core.throttle

    def throttle_for(self, criticality: str) -> Optional[AdaptiveThrottle]:
        """The adaptive throttle this client keeps for ``criticality`` (None when disabled)."""
        with self._core._lock:
            return self._core.throttle_for(criticality)

    @property
    def retry_budget(self) -> RetryBudgetWindow:
        return self._core.budget

    async def generate(
        self,
        prompt: str,
        max_tokens: int = 64,
        criticality: str = "critical",
        idempotency_key: Optional[str] = None,
    ) -> Generation:
        call = _Call(self._core, idempotency_key, criticality)
        payload = _payload(prompt, max_tokens, criticality, stream=False)
        while True:
            headers, timeout = call.begin_attempt()
            try:
                resp = await self._http.post(GENERATE_PATH, json=payload, headers=headers, timeout=timeout)
            except httpx.TransportError as e:
                await self._sleep(call.on_transport_error(e))
                continue
            if not resp.is_success:
                await self._sleep(call.on_error_answer(resp.status_code, resp.headers, resp.content))
                continue
            return call.on_success(resp.content)

    def stream(self, prompt: str, max_tokens: int = 64, criticality: str = "critical") -> AsyncTokenStream:
        call = _Call(self._core, None, criticality)
        return AsyncTokenStream(self._stream(call, _payload(prompt, max_tokens, criticality, stream=True)), call)

    async def _stream(self, call: _Call, payload: dict[str, Any]) -> AsyncIterator[str]:
        while True:
            headers, timeout = call.begin_attempt()
            headers["Accept"] = "text/event-stream"
            try:
                async with self._http.stream(
                    "POST", GENERATE_PATH, json=payload, headers=headers, timeout=timeout
                ) as resp:
                    if not resp.is_success:
                        await resp.aread()
                        wait_s = call.on_error_answer(resp.status_code, resp.headers, resp.content)
                    else:
                        try:
                            async for line in resp.aiter_lines():
                                text = call.on_stream_line(line)
                                if text is not None:
                                    yield text
                                if call.done is not None:
                                    break
                        except httpx.TransportError as e:  # converted: the retry loop must not see it
                            raise call.on_stream_broken(e) from e
                        self.last_done = call.finish_stream()
                        return
            except httpx.TransportError as e:
                wait_s = call.on_transport_error(e)
            await self._sleep(wait_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def close(self) -> None:
        await self.aclose()

    async def __aenter__(self) -> AsyncBallastClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
