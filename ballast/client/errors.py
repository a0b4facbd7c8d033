"""The client's typed errors and the one mapping from an answer to them (sans-I/O).

Code first (a known server code picks its class), status second (only for an
answer without a code, e.g. from a proxy in front of Ballast), else
``ServerError``. Every error passes its arguments to ``super().__init__`` so it
pickles (crosses process boundaries).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

#: Marks "use the class's status" so that an explicit None (an error made on the client,
#: no HTTP status) survives pickling as None.
_CLASS_STATUS: Any = object()


class BallastClientError(Exception):
    """Base of every error the client raises.

    ``status`` is the HTTP status of the answer (None when no answer was involved:
    a transport failure, a local throttle, a client-side deadline); ``code`` the
    server's error code (or the client's own, e.g. ``CONNECTION_FAILED``);
    ``retry_after_s`` what the server suggested, when it did. All arguments go to
    ``super().__init__`` so the error pickles (crosses process boundaries).
    """

    default_status: int | None = None
    default_code: str = "CLIENT_ERROR"

    def __init__(
        self,
        message: str,
        status: int | None = _CLASS_STATUS,
        code: str | None = None,
        retry_after_s: float | None = None,
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


class Unauthenticated(BallastClientError):
    default_status, default_code = 401, "UNAUTHENTICATED"


class Forbidden(BallastClientError):
    default_status, default_code = 403, "FORBIDDEN"


class InvalidRequest(BallastClientError):
    """422: the body was refused; ``field`` names the offending field."""

    default_status, default_code = 422, "INVALID_REQUEST"

    def __init__(self, *args: Any, field: str = "", **kwargs: Any) -> None:
        """The base's arguments, and ``field``: kept out of ``args`` (which rebuild the error
        when it is unpickled) and restored with the rest of its attributes."""
        super().__init__(*args, **kwargs)
        self.field = field


class PayloadTooLarge(BallastClientError):
    default_status, default_code = 413, "PAYLOAD_TOO_LARGE"


class QuotaExceeded(BallastClientError):
    default_status, default_code = 429, "QUOTA_EXCEEDED"


class ConcurrencyLimited(BallastClientError):
    default_status, default_code = 429, "CONCURRENCY_LIMIT"


class Overloaded(BallastClientError):
    default_status, default_code = 503, "OVERLOADED"


class KillSwitchActive(BallastClientError):
    default_status, default_code = 503, "KILL_SWITCH"


class ModelUnavailable(BallastClientError):
    default_status, default_code = 503, "MODEL_UNAVAILABLE"


class ReplicaLost(BallastClientError):
    """The replica holding the call went away and the server could not carry it on elsewhere."""

    default_status, default_code = 503, "REPLICA_LOST"


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


#: The server's codes (ballast/errors.py and the README table), mapped once.
_BY_CODE: dict[str, type[BallastClientError]] = {
    "UNAUTHENTICATED": Unauthenticated,
    "FORBIDDEN": Forbidden,
    "INVALID_REQUEST": InvalidRequest,
    "CONTEXT_LENGTH_EXCEEDED": InvalidRequest,
    "ENGINE_REFUSED": InvalidRequest,
    "SCHEMA_TOO_COMPLEX": InvalidRequest,
    "PAYLOAD_TOO_LARGE": PayloadTooLarge,
    "QUOTA_EXCEEDED": QuotaExceeded,
    "CONCURRENCY_LIMIT": ConcurrencyLimited,
    "OVERLOADED": Overloaded,
    "KILL_SWITCH": KillSwitchActive,
    "MODEL_UNAVAILABLE": ModelUnavailable,
    "REPLICA_LOST": ReplicaLost,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}
#: Only for answers without an error code (e.g. a proxy in front of Ballast):
#: a bare 429 is a rate limit, a bare 503 is backpressure (Serve's proxy answers so).
_BY_STATUS: dict[int, type[BallastClientError]] = {
    401: Unauthenticated,
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


def _number_or_none(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def parse_retry_after_header(value: str | None) -> float | None:
    """``Retry-After`` as delta-seconds; None when absent, negative or an HTTP-date."""
    if value is None:
        return None
    try:
        return _number_or_none(float(value.strip()))
    except ValueError:
        return None


def error_from_payload(
    payload: object,
    status: int | None = _CLASS_STATUS,
    retry_after_header: str | None = None,
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
        field = err.get("field")
        return InvalidRequest(message, status, code, retry_after_s, field=field if isinstance(field, str) else "")
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
    return err.status in _RETRYABLE_STATUSES and err.retry_after_s is not None and not isinstance(err, KillSwitchActive)


# The SDK's first names for two of these, kept for callers written against it; the
# names above are the server's (ballast.errors).
Unauthorized = Unauthenticated
KillSwitched = KillSwitchActive
