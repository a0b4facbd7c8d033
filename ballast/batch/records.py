"""What the batch store holds, as frozen records: files, batches and their counts and token
usage, queued lines, deliveries and dead letters.

Each record's ``to_dict()`` uses OpenAI's field names where OpenAI has one (a File's ``bytes``,
a Batch's ``request_counts``, ``in_progress_at``...), so that ``ballast.batch.shapes`` turns it
into OpenAI's object without renaming; fields OpenAI has no name for (``tenant``) keep Ballast's.
Times are Unix seconds: whole seconds where OpenAI shows them (``created_at``...), as OpenAI
does; a queued line's ``not_before`` and ``queued_at`` keep the fraction (they order retries).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

# OpenAI's batch statuses. A batch is "in flight" (it counts against the tenant's
# ``max_batches_in_flight``) until it reaches a terminal one.
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
STATUSES: tuple[BatchStatus, ...] = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
TERMINAL: frozenset[BatchStatus] = frozenset({"failed", "completed", "expired", "cancelled"})

# The field stamped with the time a batch enters each status (OpenAI's names); validating's is created_at.
STATUS_TIME_FIELD: dict[BatchStatus, str] = {s: f"{s}_at" for s in STATUSES if s != "validating"}

LineKind = Literal["output", "error"]


def new_file_id() -> str:
    """A fresh file id in OpenAI's form, ``file-`` and 24 hex digits."""
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    """A fresh batch id in OpenAI's form, ``batch_`` and 24 hex digits."""
    return f"batch_{secrets.token_hex(12)}"


def new_dlq_id() -> str:
    """A fresh dead letter's id, ``dlq_`` and 24 hex digits."""
    return f"dlq_{secrets.token_hex(12)}"


def result_file_id(batch_id: str, kind: LineKind) -> str:
    """The id of ``batch_id``'s output or error file: derived from the batch, so that a
    finalization run again (its router died midway) rewrites the same file, never a second one."""
    return f"file-{hashlib.sha256(f'{batch_id}:{kind}'.encode()).hexdigest()[:24]}"


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    size_bytes: int
    created_at: int
    expires_at: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "bytes": self.size_bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "tenant": self.tenant,
        }


@dataclass(frozen=True)
class RequestCounts:
    """A batch's lines: all of them, those answered (output file) and those failed (error file)."""

    total: int = 0
    completed: int = 0
    failed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


#: A line's token count past this is no engine's (a context window is far smaller): counted as 0,
#: so a batch's sums stay below Redis' 64-bit integers whatever its lines say.
MAX_LINE_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class TokenUsage:
    """The tokens a batch's answered lines used, summed: OpenAI's batch ``usage`` (input,
    of which cached; output, of which reasoning). Counted by the store as each line's answer
    is recorded, once per line (``BatchStore.record``)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.input_tokens, self.cached_tokens, self.output_tokens, self.reasoning_tokens) < 0:
            raise ValueError(f"token counts are >= 0: {self}")

    @classmethod
    def of_output_line(cls, line_json: str) -> TokenUsage:
        """The usage an output-file line's answer reports (``response.body.usage``, in the
        chat and completions answers' names: ``prompt_tokens``, ``completion_tokens``,
        ``prompt_tokens_details.cached_tokens``, ``completion_tokens_details.reasoning_tokens``).
        A count that is absent, not an int, or outside 0 to ``MAX_LINE_TOKENS`` counts 0: the
        line's answer is kept whatever its usage says."""
        try:
            line = json.loads(line_json)
        except ValueError:
            return cls()
        response = line.get("response") if isinstance(line, dict) else None
        body = response.get("body") if isinstance(response, dict) else None
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return cls()
        return cls(
            input_tokens=_tokens(usage, "prompt_tokens"),
            cached_tokens=_tokens(usage.get("prompt_tokens_details"), "cached_tokens"),
            output_tokens=_tokens(usage, "completion_tokens"),
            reasoning_tokens=_tokens(usage.get("completion_tokens_details"), "reasoning_tokens"),
        )

    def counts(self) -> tuple[int, int, int, int]:
        """(input, cached, output, reasoning): the order the store's counters take them."""
        return (self.input_tokens, self.cached_tokens, self.output_tokens, self.reasoning_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def _tokens(fields: Any, name: str) -> int:
    value = fields.get(name) if isinstance(fields, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LINE_TOKENS:
        return 0
    return value


@dataclass(frozen=True)
class BatchRecord:
    """A batch as stored. ``errors`` are OpenAI's ``errors.data`` entries (code, message,
    param, line) of a batch whose file failed validation; ``metadata`` its key-value pairs;
    ``usage`` the tokens of its lines answered so far (a finished batch's, as it ended)."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus = "validating"
    model: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    errors: tuple[dict[str, Any], ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    usage: TokenUsage | None = TokenUsage()  # None: a record kept from before usage was counted

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is none of OpenAI's: {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "model": self.model,
            "metadata": dict(self.metadata) if self.metadata else None,
            "errors": {"object": "list", "data": [dict(e) for e in self.errors]} if self.errors else None,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "in_progress_at": self.in_progress_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": self.request_counts.to_dict(),
            "usage": None if self.usage is None else self.usage.to_dict(),
        }


@dataclass(frozen=True)
class QueuedLine:
    """One input line on its model's queue: the request ``body_json`` (JSON text) and what
    the dispatcher needs around it. ``attempts``: the attempts already made; ``not_before``:
    the dispatcher does not send it before this time (a retry's backoff); ``queued_at``: when
    the line first joined the queue (its age in the metrics)."""

    batch_id: str
    line: int
    custom_id: str
    model: str
    tenant: str
    body_json: str
    attempts: int = 0
    not_before: float = 0.0
    queued_at: float = 0.0

    def __post_init__(self) -> None:
        if self.line < 1 or self.attempts < 0:
            raise ValueError(f"line {self.line} (1-based) and attempts {self.attempts} (>= 0)")

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.body_json)
        return body

    def fields(self) -> dict[str, str]:
        """The line as its stream entry's fields."""
        return {
            "batch": self.batch_id,
            "line": str(self.line),
            "custom_id": self.custom_id,
            "model": self.model,
            "tenant": self.tenant,
            "body": self.body_json,
            "attempts": str(self.attempts),
            "not_before": repr(self.not_before),
            "queued_at": repr(self.queued_at),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> QueuedLine:
        return cls(
            batch_id=fields["batch"],
            line=int(fields["line"]),
            custom_id=fields["custom_id"],
            model=fields["model"],
            tenant=fields["tenant"],
            body_json=fields["body"],
            attempts=int(fields["attempts"]),
            not_before=float(fields["not_before"]),
            queued_at=float(fields["queued_at"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "line": self.line,
            "custom_id": self.custom_id,
            "model": self.model,
            "tenant": self.tenant,
            "body": self.body(),
            "attempts": self.attempts,
            "not_before": self.not_before,
            "queued_at": self.queued_at,
        }


@dataclass(frozen=True)
class FailedLine:
    """A line refused when its batch was created (bad JSON, a wrong url, a body the online
    call would refuse): its 1-based number, its custom_id when it has a usable one, and its
    line of the error file (JSON text)."""

    line: int
    custom_id: str | None
    line_json: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "custom_id": self.custom_id, "line_json": self.line_json}


@dataclass(frozen=True)
class Delivery:
    """A line handed to ``consumer`` (a router's dispatcher): its stream entry (to ack,
    requeue or dead-letter) and the line."""

    model: str
    entry_id: str
    consumer: str
    line: QueuedLine

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "entry_id": self.entry_id, "consumer": self.consumer, "line": self.line.to_dict()}


@dataclass(frozen=True)
class DeadLetter:
    """A line that failed ``attempts`` times, retryably, on the model's dead-letter queue since
    ``since``; what the admin API lists (the request body stays in the store: it is the tenant's)."""

    id: str
    model: str
    line: QueuedLine
    last_error: str
    since: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "batch_id": self.line.batch_id,
            "line": self.line.line,
            "custom_id": self.line.custom_id,
            "tenant": self.line.tenant,
            "model": self.model,
            "attempts": self.line.attempts,
            "last_error": self.last_error,
            "since": self.since,
        }


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list, newest first unless the list says otherwise; ``has_more``: a next
    page exists (ask again with ``after`` = the last item's id)."""

    items: tuple[T, ...]
    has_more: bool
