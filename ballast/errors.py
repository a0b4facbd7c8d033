"""Typed, picklable errors, each mapped once to an HTTP status and a stable code.

Every subclass passes its arguments to ``super().__init__`` so that it survives
the trip across a Ray process boundary (Ray re-raises the pickled instance).
The router turns any ``BallastError`` into ``{"error": {"code", "message",
"retry_after_s"?}}`` with ``status``; nothing else decides these mappings.
"""

from __future__ import annotations

from typing import Any


class BallastError(Exception):
    """Base of every error Ballast reports to a client."""

    status: int = 500
    code: str = "INTERNAL"

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message, retry_after_s)
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.retry_after_s is not None:
            err["retry_after_s"] = round(self.retry_after_s, 3)
        return {"error": err}


class Unauthenticated(BallastError):
    status, code = 401, "UNAUTHENTICATED"


class Forbidden(BallastError):
    status, code = 403, "FORBIDDEN"


class InvalidRequest(BallastError):
    status, code = 422, "INVALID_REQUEST"

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.args = (message, field)
        self.field = field

    def body(self) -> dict[str, Any]:
        out = super().body()
        if self.field:
            out["error"]["field"] = self.field
        return out


class ContextLengthExceeded(InvalidRequest):
    """The prompt and max_tokens together do not fit the model's context (or the prompt
    has no token): refused before any work, on every route."""

    status, code = 400, "CONTEXT_LENGTH_EXCEEDED"


class EngineRefused(InvalidRequest):
    """The model's engine refused the request as sent (vLLM's own validation, say of a
    ``response_format`` schema it cannot compile): refused before any work; no retry,
    no fallback, nothing counted against the model's health."""

    status, code = 400, "ENGINE_REFUSED"


class AdapterRefused(InvalidRequest):
    """A LoRA adapter the engine would not load (not a local directory, a name already
    taken, vLLM's own refusal: a rank above ``max_lora_rank``, missing weights), with the
    engine's reason, or one the catalog refuses at the admin API (an unknown or non-vLLM
    model, a name taken, tenants outside the model's grant), ``field`` naming what: refused
    when it is added, never on a request."""

    status, code = 400, "ADAPTER_REFUSED"

    def __init__(self, name: str, path: str, reason: str, field: str = "adapters"):
        super().__init__(f"adapter {name!r} ({path}): {reason}", field=field)
        self.args = (name, path, reason, field)
        self.name = name
        self.path = path
        self.reason = reason


class AdapterInConfig(BallastError):
    """An adapter the config declares, which the admin API cannot remove: it goes with the
    config (a redeploy without it)."""

    status, code = 409, "ADAPTER_IN_CONFIG"


class AdapterConflict(BallastError):
    """``POST /admin/adapters`` naming an adapter added at run time, or one whose add is in
    flight: refused until that one is deleted (or its add ends), so that two adds of one
    name never race to different replicas."""

    status, code = 409, "ADAPTER_CONFLICT"


class AdaptersDisabled(BallastError):
    """``POST /admin/adapters`` where the config sets no ``adapters_root``: no adapter may be
    added at run time."""

    status, code = 409, "ADAPTERS_DISABLED"


class SchemaTooComplex(InvalidRequest):
    """A ``response_format`` schema or the tools' schemas are past the bounds Ballast sets
    (depth, size, count), or their grammar did not compile within its time limit:
    refused for this request alone, before any model work, nothing counted against the
    model's health."""

    status, code = 400, "SCHEMA_TOO_COMPLEX"


class PayloadTooLarge(BallastError):
    status, code = 413, "PAYLOAD_TOO_LARGE"


class NotFound(BallastError):
    status, code = 404, "NOT_FOUND"


class ModelNotFound(NotFound):
    """A model or adapter this deployment does not serve, or that the caller's key may not
    use (one answer for both: a tenant learns nothing of what it was not granted). The code
    is OpenAI's own, which its clients test for."""

    code = "model_not_found"

    @classmethod
    def named(cls, name: str, usable: list[str]) -> ModelNotFound:
        """The refusal of ``name``, naming the models and adapters the caller may use."""
        return cls(f"model {name!r} does not exist or this key may not use it; yours: {', '.join(usable) or 'none'}")


class Overloaded(BallastError):
    """No capacity for this request now: the level does not admit its class (at the router
    or at the edge), or the gate cannot serve it within its deadline."""

    status, code = 503, "OVERLOADED"


class FlexQueueFull(BallastError):
    """A ``service_tier: "flex"`` request found its model's hold at this router full: it
    would have waited for spare capacity, and there is no room to wait."""

    status, code = 503, "FLEX_QUEUE_FULL"


class KillSwitchActive(BallastError):
    """An operator's kill switch refuses this request (global, tenant, model or criticality)."""

    status, code = 503, "KILL_SWITCH"


class QuotaExceeded(BallastError):
    """The tenant's token bucket cannot pay for this request now (Retry-After from the bucket)."""

    status, code = 429, "QUOTA_EXCEEDED"


class ConcurrencyLimited(BallastError):
    status, code = 429, "CONCURRENCY_LIMIT"


class ChaosDisabled(BallastError):
    status, code = 409, "CHAOS_DISABLED"


class ControllerUnavailable(BallastError):
    status, code = 503, "CONTROLLER_UNAVAILABLE"


class ModelUnavailable(BallastError):
    """The model deployment could not take or finish the request (queue full, replica gone)."""

    status, code = 503, "MODEL_UNAVAILABLE"


class ReplicaLost(BallastError):
    """The replica (or node) that held the request went away and it could not be carried
    on elsewhere within its migration limit and deadline: capacity that is gone, not a
    model error (the level and the breakers do not count it). Retrying later works."""

    status, code = 503, "REPLICA_LOST"


class DeadlineExceeded(BallastError):
    status, code = 504, "DEADLINE_EXCEEDED"


class StoreUnavailable(BallastError):
    """The Batch API's durable store (Redis or Valkey) did not answer within its timeout, or
    refused the call: nothing was changed that the caller must undo; retrying later works."""

    status, code = 503, "STORE_UNAVAILABLE"


class FileLimitExceeded(BallastError):
    """The tenant holds as many files, or as many stored bytes, as ``batch.max_files`` /
    ``batch.max_stored_bytes`` allow (a batch in flight holds room for its two result files):
    refused until the tenant deletes files or they expire."""

    status, code = 429, "FILE_LIMIT"


class BatchLimitExceeded(BallastError):
    """The tenant has ``batch.max_batches_in_flight`` batches not yet finished, or that many
    batches' worth of lines still queued: refused until one finishes."""

    status, code = 429, "BATCH_LIMIT"


class BatchNotCancellable(BallastError):
    """``POST /v1/batches/{id}/cancel`` on a batch that has ended (completed, failed, expired,
    cancelled): nothing to cancel."""

    status, code = 409, "BATCH_NOT_CANCELLABLE"


class ConfigError(ValueError):
    """A configuration that cannot be served; raised at build time, never per request."""

    def __init__(self, where: str, reason: str):
        super().__init__(where, reason)
        self.where = where
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class ModelLoadError(ValueError):
    """A checkpoint could not be turned into a runnable model.

    Both fields go to ``super().__init__`` so the error pickles intact across
    Ray process boundaries (a replica failing to load reports to the controller).
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot load model from {self.path!r}: {self.reason}"


class BatchFileInvalid(BallastError):
    """A batch's input file that cannot run as a whole (empty, over the line cap, a line that is
    not a JSON object or whose ``custom_id`` is missing or repeated, lines for several models):
    ``errors`` are OpenAI's ``errors.data`` entries (``code``, ``message``, ``param``, ``line``),
    which the failed batch reports."""

    status, code = 400, "INVALID_BATCH_FILE"

    def __init__(self, message: str, errors: list[dict[str, Any]]):
        super().__init__(message)
        self.args = (message, errors)
        self.errors = errors

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"]["data"] = self.errors
        return out


class FileTooLarge(PayloadTooLarge):
    """An uploaded file past the deployment's cap in ``unit`` ("bytes" or "lines"), refused as
    soon as the stream passes it."""

    code = "FILE_TOO_LARGE"

    def __init__(self, limit: int, unit: str):
        super().__init__(f"file: more than {limit} {unit}; the limit is {limit} {unit}")
        self.args = (limit, unit)
        self.limit = limit
        self.unit = unit
