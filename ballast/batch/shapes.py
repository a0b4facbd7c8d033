"""OpenAI's Batch API objects, built from a stored record's fields: a File, a Batch, a list
page, and the lines of a batch's output and error files.

Each function takes a plain ``Mapping`` whose keys are OpenAI's field names (a record's
``to_dict()``), so the shapes know nothing of how records are stored. What they return is
exactly what the official ``openai`` package parses (``openai.types.FileObject``,
``openai.types.Batch``, its cursor pages): every field it reads, timestamps as integer Unix
seconds, optional fields null rather than absent. A record missing a required field, or
holding a value of the wrong type, raises ``ValueError`` naming the field: a store bug is
found where the object is built, not by a client that cannot parse it.

Output and error lines follow OpenAI's batch output format, one JSON object per input line:
``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`` for an answer, and ``{"id", "custom_id", "response": null | {...},
"error": {"code", "message"}}`` for a line that has none (``response`` set where the line
was answered with an HTTP error, such as a refused request's 4xx).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ballast.batch.lines import LineError
from ballast.batch.records import STATUSES as BATCH_STATUSES  # OpenAI's batch statuses

#: A file's (deprecated in OpenAI's API, still required by its client).
FILE_STATUSES = ("uploaded", "processed", "error")
#: The purposes of the files a batch reads and writes.
FILE_PURPOSES = ("batch", "batch_output")
#: The moments a batch records, each null until it happens.
BATCH_TIMES = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
LINE_ID_PREFIX = "batch_req_"


def file_object(record: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's File object. ``status`` defaults to "processed": a file is stored once its
    upload has been read whole."""
    status = record.get("status") or "processed"
    return {
        "id": _text(record, "id"),
        "object": "file",
        "bytes": _count(record, "bytes"),
        "created_at": _time(record, "created_at"),
        "expires_at": _time(record, "expires_at", optional=True),
        "filename": _text(record, "filename"),
        "purpose": _one_of("purpose", _value(record, "purpose", False), FILE_PURPOSES),
        "status": _one_of("status", status, FILE_STATUSES),
        "status_details": None,
    }


def batch_object(record: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's Batch object. ``errors`` (the ``errors.data`` entries of a batch whose file
    failed), ``request_counts``, ``metadata``, ``model`` and ``usage`` may be absent or null."""
    out: dict[str, Any] = {
        "id": _text(record, "id"),
        "object": "batch",
        "endpoint": _text(record, "endpoint"),
        "errors": _errors(record.get("errors")),
        "input_file_id": _text(record, "input_file_id"),
        "completion_window": _text(record, "completion_window"),
        "status": _one_of("status", _value(record, "status", False), BATCH_STATUSES),
        "output_file_id": _text(record, "output_file_id", optional=True),
        "error_file_id": _text(record, "error_file_id", optional=True),
        "created_at": _time(record, "created_at"),
    }
    out.update({name: _time(record, name, optional=True) for name in BATCH_TIMES})
    out["request_counts"] = _request_counts(record.get("request_counts"))
    out["metadata"] = _metadata(record.get("metadata"))
    out["model"] = _text(record, "model", optional=True)
    out["usage"] = _usage(record.get("usage"))
    return out


def list_page(objects: Sequence[Mapping[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list envelope around one page of objects (in the order listed): the client
    asks for the next page ``after`` its ``last_id`` while ``has_more``."""
    return {
        "object": "list",
        "data": [dict(o) for o in objects],
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": bool(has_more),
    }


def new_line_id(token_hex: Callable[[int], str] = secrets.token_hex) -> str:
    """A fresh ``batch_req_<24 hex>`` id for an output or error line."""
    return LINE_ID_PREFIX + token_hex(12)


def output_line(line_id: str, custom_id: str, status_code: int, request_id: str, body: Any) -> dict[str, Any]:
    """A line of the output file: the answer the endpoint gave (its status and body)."""
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(
    line_id: str,
    custom_id: str,
    code: str,
    message: str,
    status_code: int | None = None,
    request_id: str | None = None,
    body: Any = None,
) -> dict[str, Any]:
    """A line of the error file: ``error`` says why the line has no answer; ``response`` is the
    HTTP error it got, if any (``status_code`` given), else null (expired, cancelled, dead-lettered)."""
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": {"code": code, "message": message}}


def refused_line(line_id: str, refused: LineError) -> dict[str, Any]:
    """The error-file line of an input line refused at create: the 4xx the online call would
    have had, its body in OpenAI's error shape."""
    body = {
        "error": {
            "message": refused.message,
            "type": "invalid_request_error",
            "param": refused.param,
            "code": refused.code,
        }
    }
    return error_line(line_id, refused.custom_id, refused.code, refused.message, refused.status, None, body)


# ---------------------------------------------------------------------------- fields


def _value(record: Mapping[str, Any], name: str, optional: bool) -> Any:
    if name not in record and not optional:
        raise ValueError(f"{name}: missing from the record")
    return record.get(name)


def _text(record: Mapping[str, Any], name: str, optional: bool = False) -> Any:
    value = _value(record, name, optional)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty str, got {value!r}")
    return value


def _one_of(name: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _count(record: Mapping[str, Any], name: str) -> int:
    value = _value(record, name, False)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
    return value


def _time(record: Mapping[str, Any], name: str, optional: bool = False) -> Any:
    """Integer Unix seconds (a float is floored: OpenAI's timestamps are whole seconds)."""
    value = _value(record, name, optional)
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: must be Unix seconds >= 0, got {value!r}")
    return int(value)


def _errors(errors: Any) -> dict[str, Any] | None:
    """OpenAI's ``errors`` list from the stored entries (a sequence, or the list envelope)."""
    if errors is None:
        return None
    entries = errors.get("data") if isinstance(errors, Mapping) else errors
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise ValueError(f"errors: must be a sequence of errors.data entries, got {errors!r}")
    data = [
        {"code": e.get("code"), "message": e.get("message"), "param": e.get("param"), "line": e.get("line")}
        for e in entries
    ]
    return {"object": "list", "data": data}


def _request_counts(counts: Any) -> dict[str, int]:
    if counts is None:
        return {"total": 0, "completed": 0, "failed": 0}
    if not isinstance(counts, Mapping):
        raise ValueError(f"request_counts: must be a mapping, got {counts!r}")
    return {name: _count(counts, name) for name in ("total", "completed", "failed")}


def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"metadata: must map str to str, got {metadata!r}")
    return {str(k): v for k, v in metadata.items()}


def _usage(usage: Any) -> dict[str, Any] | None:
    """OpenAI's batch ``usage`` from the tokens counted (``input_tokens``, ``output_tokens``,
    and optionally ``cached_tokens``, ``reasoning_tokens``, flat or in their details)."""
    if usage is None:
        return None
    if not isinstance(usage, Mapping):
        raise ValueError(f"usage: must be a mapping, got {usage!r}")
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", usage.get("cached_tokens", 0))
    reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens", usage.get("reasoning_tokens", 0))
    counts = {"input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens")}
    counts.update(cached_tokens=cached, reasoning_tokens=reasoning)
    checked = {name: _count(counts, name) for name in counts}
    return {
        "input_tokens": checked["input_tokens"],
        "input_tokens_details": {"cached_tokens": checked["cached_tokens"]},
        "output_tokens": checked["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": checked["reasoning_tokens"]},
        "total_tokens": checked["input_tokens"] + checked["output_tokens"],
    }
