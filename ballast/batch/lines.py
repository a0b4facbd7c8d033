"""A batch's input file (JSONL) read and checked line by line, as OpenAI's Batch API reads it.

Each line is one request: ``{"custom_id", "method": "POST", "url", "body"}``. Lines are
numbered from 1, as OpenAI's ``errors.data[].line``; a blank line asks for nothing and is
skipped (it keeps its number); a UTF-8 byte order mark before the first line is dropped.

Procedure (``parse_batch_file``), one line at a time, holding one line's text and parse at
once, and the lines kept (each body as compact JSON, about its size in the file):

1. The file: empty, or past ``max_lines`` requests (stopped there), fails as a whole.
2. Framing: the line is UTF-8, nested at most ``max_depth`` deep (measured before the parse,
   whose C parser recurses once per level), one JSON object without NaN or Infinity; its
   ``custom_id`` is a non-empty string of at most ``MAX_CUSTOM_ID_CHARS`` characters (Unicode
   text: no lone surrogate from a ``\\ud800`` escape), unique in the file.
3. The request: ``method`` is "POST", ``url`` the batch's endpoint, ``body`` an object
   without ``stream: true``, Unicode text, at most ``max_body_bytes`` as compact JSON.
4. ``check_body(body)``: the router's online validation (the tenant's grants, the model,
   the sizes its front checks); it returns the model the line targets, or raises a
   ``BallastError``. A refusal under 500 is this line's error (its code, message and
   status); 500 and over is not the line's fault and propagates: the batch is not created.
5. One model: every good line targets the model of the first one.

Which errors fail the file and which only the line. The answers and errors of a batch are
keyed by ``custom_id`` (first write wins), so a line whose ``custom_id`` cannot be read, or
is repeated, cannot be answered once and only once: it fails the whole file, as OpenAI
fails the batch (``invalid_json_line``, ``duplicate_custom_id``), and so do an empty file
(``empty_file``), too many requests (``too_many_tasks``) and lines for several models
(``mismatched_model``: OpenAI's batch, and its ``model``, is one model). Those raise
``BatchFileInvalid`` carrying every such line's ``errors.data`` entry (at most
``MAX_FILE_ERRORS``; once the file has failed, ``check_body`` is not called again).
Everything else fails only its line, which goes to the batch's error file with its number:
OpenAI fails the whole batch for those too, at validation; Ballast runs the good lines
(the issue's contract: a bad line goes to the error file).

Codes: ``invalid_json_line``, ``duplicate_custom_id``, ``mismatched_model``, ``empty_file``,
``too_many_tasks`` are OpenAI's; so is the message of a URL that is not the endpoint
("does not match the batch endpoint"), whose code OpenAI does not document: ``invalid_url``
here. ``invalid_custom_id``, ``invalid_method``, ``invalid_body``, ``stream_not_supported``
are Ballast's. A line refused by ``check_body`` carries that error's own code.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ballast.errors import BallastError, BatchFileInvalid, InvalidRequest, PayloadTooLarge
from ballast.policies.json_bounds import json_nesting
from ballast.policies.validation import check_int

#: The endpoints a batch may name; every line's ``url`` must be the batch's.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID_CHARS = 512
#: ``errors.data`` entries a failed file reports, at most; the scan stops there.
MAX_FILE_ERRORS = 100
#: The online defaults (``limits.max_json_depth``, ``limits.max_body_bytes``); the router passes its own.
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class GoodLine:
    """A line that passed every check: its number, ``custom_id``, model, and its body as
    compact JSON (``body()`` decodes it again)."""

    line: int
    custom_id: str
    model: str
    body_json: str

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.body_json)
        return body


@dataclass(frozen=True)
class LineError:
    """A line refused on its own: it goes to the batch's error file with ``status`` (the HTTP
    status the online call would have had), ``code`` and ``message``."""

    line: int
    custom_id: str
    code: str
    message: str
    param: str | None = None
    status: int = 400


@dataclass(frozen=True)
class ParsedFile:
    """A file that can run: its good lines and its refused lines, in file order; ``model`` the
    one model its good lines target (None when no line is good)."""

    lines: list[GoodLine]
    errors: list[LineError]
    model: str | None


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One of OpenAI's ``errors.data`` entries."""
    return {"code": code, "message": message, "param": param, "line": line}


class _Fatal(Exception):
    """A line that fails the whole file (internal: gathered into ``BatchFileInvalid``)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(code, message, param)
        self.code, self.message, self.param = code, message, param


class _Refused(Exception):
    """A line refused on its own (internal: becomes a ``LineError``)."""

    def __init__(self, code: str, message: str, param: str | None = None, status: int = 400):
        super().__init__(code, message, param, status)
        self.code, self.message, self.param, self.status = code, message, param, status


def parse_batch_file(
    data: bytes,
    endpoint: str,
    max_lines: int,
    check_body: Callable[[dict[str, Any]], str],
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> ParsedFile:
    """The file's good lines and refused lines, or ``BatchFileInvalid`` for a file that cannot
    run (procedure and the choice of which errors are fatal: the module docstring)."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
    check_int("max_lines", max_lines, minimum=1)
    check_int("max_depth", max_depth, minimum=1)
    check_int("max_body_bytes", max_body_bytes, minimum=1)
    good: list[GoodLine] = []
    refused: list[LineError] = []
    fatal: list[dict[str, Any]] = []
    seen: set[str] = set()
    model: str | None = None
    requests = 0
    for number, raw in _lines(data):
        if not raw.strip():
            continue
        requests += 1
        if requests > max_lines:
            msg = f"The batch input file has more than {max_lines} requests; the limit is {max_lines}."
            fatal.append(batch_error("too_many_tasks", msg, number))
            break
        try:
            obj, custom_id = _frame(raw, max_depth, seen)
            if fatal:  # the file has failed: only its framing is still checked, no line costs more
                continue
            body_json, line_model = _request(obj, endpoint, max_body_bytes, check_body)
            model = model or line_model
            if line_model != model:
                raise _Fatal("mismatched_model", _mismatched(line_model), "model")
            good.append(GoodLine(number, custom_id, line_model, body_json))
        except _Refused as e:
            refused.append(LineError(number, custom_id, e.code, e.message, e.param, e.status))
        except _Fatal as e:
            fatal.append(batch_error(e.code, e.message, number, e.param))
            if len(fatal) >= MAX_FILE_ERRORS:
                break
    if not fatal and requests == 0:
        fatal.append(batch_error("empty_file", "The batch input file is empty."))
    if fatal:
        first = fatal[0]
        where = f" (line {first['line']})" if first["line"] is not None else ""
        raise BatchFileInvalid(f"the batch input file is invalid: {first['message']}{where}", fatal)
    return ParsedFile(good, refused, model)


def _mismatched(model: str) -> str:
    return (
        f"The model '{model}' for this request does not match the rest of the batch. "
        "Each batch must contain requests for a single model."
    )


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each line, one slice at a time; a final newline ends the last line."""
    start = 0
    number = 0
    if data.startswith(codecs.BOM_UTF8):
        start = len(codecs.BOM_UTF8)
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            end = len(data)
        number += 1
        yield number, data[start:end]
        start = end + 1


_LONE_SURROGATE = "a lone UTF-16 surrogate is not Unicode text"
MAX_SHOWN_CHARS = 64  # of a client's value echoed in an error message


def _shown(value: Any) -> str:
    """``value`` as an error message quotes it, cut to ``MAX_SHOWN_CHARS``."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def _is_unicode(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate, from a JSON escape, does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _frame(raw: bytes, max_depth: int, seen: set[str]) -> tuple[dict[str, Any], str]:
    """The line as a JSON object and its ``custom_id`` (noted in ``seen``), or ``_Fatal``."""
    not_json = "This line is not parseable as valid JSON."
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Fatal("invalid_json_line", f"{not_json} It is not UTF-8 (byte {e.start}).") from None
    depth = json_nesting(text)
    if depth > max_depth:
        raise _Fatal("invalid_json_line", f"{not_json} It nests {depth} deep; the limit is {max_depth}.")
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # RecursionError: not reachable past the depth check; a floor
        raise _Fatal("invalid_json_line", not_json) from None
    if not isinstance(obj, dict):
        raise _Fatal("invalid_json_line", "This line is not a JSON object.")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        msg = f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters."
        raise _Fatal("invalid_custom_id", msg, "custom_id")
    if not _is_unicode(custom_id):
        raise _Fatal("invalid_custom_id", f"custom_id: {_LONE_SURROGATE}.", "custom_id")
    if custom_id in seen:
        msg = (
            f"The custom_id '{custom_id}' for this request is a duplicate of another request. "
            "The custom_id parameter must be unique for each request in a batch."
        )
        raise _Fatal("duplicate_custom_id", msg, "custom_id")
    seen.add(custom_id)
    return obj, custom_id


def _request(
    obj: dict[str, Any], endpoint: str, max_body_bytes: int, check_body: Callable[[dict[str, Any]], str]
) -> tuple[str, str]:
    """(the body as compact JSON, the model it targets) of a framed line, or ``_Refused``."""
    if obj.get("method") != "POST":
        raise _Refused("invalid_method", f"method must be 'POST', got {_shown(obj.get('method'))}.", "method")
    url = obj.get("url")
    if url != endpoint:
        msg = f"The URL provided for this request ({_shown(url)}) does not match the batch endpoint ({endpoint})."
        raise _Refused("invalid_url", msg, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Refused("invalid_body", "body must be a JSON object.", "body")
    if body.get("stream") is True:
        raise _Refused("stream_not_supported", "Streaming is not supported in a batch: drop body.stream.", "stream")
    body_json = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    if not _is_unicode(body_json):  # from a \ud800 escape: the online parse refuses it too
        raise _Refused(InvalidRequest.code, f"body: {_LONE_SURROGATE}", "body")
    size = len(body_json.encode("utf-8"))
    if size > max_body_bytes:
        msg = f"body: {size} bytes as compact JSON; the limit is {max_body_bytes}"
        raise _Refused(PayloadTooLarge.code, msg, "body", PayloadTooLarge.status)
    try:
        model = check_body(body)
    except BallastError as e:
        if e.status >= 500:  # not the line's fault (capacity, an internal error): the caller answers it
            raise
        raise _Refused(e.code, e.message, getattr(e, "field", None) or None, e.status) from None
    if not isinstance(model, str) or not model:
        raise TypeError(f"check_body must return the model's name, got {model!r}")
    return body_json, model
