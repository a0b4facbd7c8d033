"""The router's FastAPI app and what every route shares: the error mapping (each
BallastError to its status, code and Retry-After, once), body reading and validation,
the bearer token, SSE framing, and the streaming response that settles its stream.

Every JSON body is read by ``read_json``: at most ``limits.max_body_bytes`` (413), UTF-8,
nested at most ``limits.max_json_depth`` deep (checked by a linear scan before the
parse, which recurses once per level), one JSON object whose keys are unique, whose
numbers are finite and within int64, and whose strings are Unicode (no lone UTF-16
surrogate). Anything else is the route's 4xx naming the field; no body reaches a
handler that could make it a 500.

The routes are declared on ``app`` by the Router deployment (app.py, under
``serve.ingress(app)``); each hands its request to a front (generate.py, openai.py,
admin.py).
"""

import json
import math
import re
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ballast.errors import BallastError, InvalidRequest, NotFound, PayloadTooLarge
from ballast.policies.criticality import CRITICALITY_HEADER, ClaimError, Criticality, claimed
from ballast.policies.json_bounds import json_nesting
from ballast.policies.sampling import INT64_MAX, INT64_MIN
from ballast.router.openai_answers import openai_error_body

Body = TypeVar("Body", bound=BaseModel)


def validate_body(model: type[Body], data: Any) -> Body:
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object", field="body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequest(f"{field}: {first['msg']}", field=field) from None


def error_response(err: BallastError, openai: bool = False) -> JSONResponse:
    """The error's status and body (Ballast's shape, or OpenAI's on the OpenAI routes),
    with Retry-After when the error says when to come back."""
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    if openai:
        return JSONResponse(openai_error_body(err), status_code=err.status, headers=headers)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class StreamResponse(StreamingResponse):
    """Server-sent events from ``body``, then ``stream.aclose()``, however the response
    ends: sent whole, cut by the client, or never begun (the client left before the
    first event). It is awaited as soon as the route returns it, so its ``finally``
    always runs: a stream's ticket never waits for garbage collection."""

    def __init__(self, body: AsyncGenerator[bytes, None], stream: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**(headers or {}), "Cache-Control": "no-cache"})
        self._body = body  # starlette's body_iterator, typed as the generator it is
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self._stream.aclose()


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request's body, refused with 413 past ``limit_bytes`` (declared or streamed).
    A declared length that is not ASCII digits is left to the streamed count; one of
    more digits than any int64 is past every limit (``int`` refuses 4300 digits)."""
    limit = limit_bytes
    declared = request.headers.get("content-length")
    if (
        declared is not None
        and declared.isascii()
        and declared.isdigit()
        and (len(declared) > 19 or int(declared) > limit)
    ):
        size = declared if len(declared) <= 19 else f"a {len(declared)}-digit number of"
        raise PayloadTooLarge(f"body is {size} bytes; the limit is {limit}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise PayloadTooLarge(f"body exceeds {limit} bytes")
    return bytes(body)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a pair is decoded to one code point: what is left is alone
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _Duplicated(dict[str, Any]):
    """An object in which ``key`` was given more than once."""

    def __init__(self, pairs: list[tuple[str, Any]], key: str) -> None:
        super().__init__(pairs)
        self.key = key


class _Hooks:
    """The parser's hooks: each object as a dict, each number as Python's, and whether
    any value was seen that ``_value_fault`` refuses (a repeated key, NaN or Infinity, a
    float that overflowed, an int past int64). Only then are the values walked for its
    path: a body without one costs a hook per object and per number, no walk."""

    def __init__(self) -> None:
        self.faulty = False

    def objects(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) == len(pairs):
            return out
        self.faulty = True
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                return _Duplicated(pairs, key)
            seen.add(key)
        raise AssertionError("unreachable: fewer keys than pairs means a key repeats")

    def integer(self, text: str) -> int:
        # Longer than any int64 (sign, 19 digits): not converted (Python refuses past 4300
        # digits, and its conversion is quadratic below that).
        value = int(text) if len(text) <= 20 else INT64_MAX + 1
        if not INT64_MIN <= value <= INT64_MAX:
            self.faulty = True
        return value

    def number(self, text: str) -> float:
        value = float(text)  # 1e999 is inf
        if not math.isfinite(value):
            self.faulty = True
        return value

    def constant(self, text: str) -> float:  # NaN, Infinity, -Infinity: Python's, not JSON
        self.faulty = True
        return float(text)


def _value_fault(node: Any) -> tuple[list[str], str] | None:
    """(the path, what is wrong) of the first value JSON cannot mean or the model cannot
    take; None when there is none. Recursion is bounded by the nesting, checked before."""
    if isinstance(node, str):
        return ([], "a lone UTF-16 surrogate is not Unicode text") if _LONE_SURROGATE.search(node) else None
    if isinstance(node, float):
        return None if math.isfinite(node) else ([], "numbers must be finite (no NaN, Infinity or overflow)")
    if isinstance(node, int) and not isinstance(node, bool):
        return None if INT64_MIN <= node <= INT64_MAX else ([], "integers must be within int64")
    if isinstance(node, dict):
        if isinstance(node, _Duplicated):
            return [node.key], "the key is given twice"
        for key, value in node.items():
            if _LONE_SURROGATE.search(key):  # named by its escape: the answer is UTF-8
                return [key.encode("utf-8", "backslashreplace").decode()], "a lone UTF-16 surrogate is not Unicode text"
            fault = _value_fault(value)
            if fault is not None:
                return [key, *fault[0]], fault[1]
    elif isinstance(node, list):
        for i, value in enumerate(node):
            fault = _value_fault(value)
            if fault is not None:
                return [str(i), *fault[0]], fault[1]
    return None


def parse_json_object(raw: bytes, max_depth: int, error: type[InvalidRequest] = InvalidRequest) -> dict[str, Any]:
    """``raw`` as one JSON object (procedure in the module docstring), or ``error`` naming
    the field at fault ("body" when it is the whole)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"body: not UTF-8 (byte {e.start})", field="body") from None
    depth = json_nesting(text)
    if depth > max_depth:
        raise error(f"body: nested {depth} deep; the limit is {max_depth}", field="body")
    hooks = _Hooks()
    try:  # a value refused below by its path is read first (NaN, Infinity, 1e999 as floats)
        data = json.loads(
            text,
            object_pairs_hook=hooks.objects,
            parse_int=hooks.integer,
            parse_float=hooks.number,
            parse_constant=hooks.constant,
        )
    except json.JSONDecodeError as e:
        raise error(f"body: not JSON ({e.msg} at line {e.lineno} column {e.colno})", field="body") from None
    except (ValueError, RecursionError):  # neither is reachable past the checks above; kept as a floor
        raise error("body: not JSON", field="body") from None
    if not isinstance(data, dict):
        raise error("body: must be a JSON object", field="body")
    # A lone surrogate comes only from an escape (strict UTF-8 has none); a pair's escapes
    # are found too, and the walk tells them apart.
    faulty = hooks.faulty or ("\\u" in text and _SURROGATE_ESCAPE.search(text) is not None)
    fault = _value_fault(data) if faulty else None
    if fault is not None:
        field = ".".join(fault[0])
        raise error(f"{field}: {fault[1]}", field=field)
    return data


async def read_json(request: Request, limits: Any, error: type[InvalidRequest] = InvalidRequest) -> dict[str, Any]:
    """The request's body as one JSON object, within ``limits`` (``parse_json_object``)."""
    return parse_json_object(await read_body(request, limits.max_body_bytes), limits.max_json_depth, error)


app = FastAPI(title="Ballast", docs_url=None, redoc_url=None, openapi_url=None)

#: Routes whose errors take OpenAI's shape (ballast/router/openai.py, embeddings.py), and the
#: prefixes of the Batch API's (ballast/router/batches.py) and the Responses API's (responses.py).
OPENAI_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"})
OPENAI_PREFIXES = ("/v1/files", "/v1/batches", "/v1/responses")


def is_openai_route(path: str) -> bool:
    return path in OPENAI_ROUTES or path.startswith(OPENAI_PREFIXES)


@app.exception_handler(BallastError)
async def _ballast_error(request: Request, exc: BallastError) -> JSONResponse:
    return error_response(exc, openai=is_openai_route(request.url.path))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    openai = is_openai_route(request.url.path)
    if exc.status_code == 404:
        return error_response(NotFound("no such route"), openai)
    err = BallastError(str(exc.detail))
    err.status, err.code = exc.status_code, "METHOD_NOT_ALLOWED" if exc.status_code == 405 else "HTTP_ERROR"
    return error_response(err, openai)


#: On a unary answer that was sent again after its replica or node went away: how many times.
MIGRATIONS_HEADER = "X-Ballast-Migrations"


def answer_headers(answer: Any) -> dict[str, str]:
    """What every unary answer (``pipeline.Answer``) says in its headers: who answered,
    whether it was sent again after its replica went away, whether it is a replay of an
    Idempotency-Key."""
    settled = answer.settled
    headers = {"X-Ballast-Fallback": settled.fallback or "none"}
    if settled.migrations:
        headers[MIGRATIONS_HEADER] = str(settled.migrations)
    if answer.replayed:
        headers["X-Ballast-Idempotent-Replay"] = "true"
    return headers


def claimed_criticality(request: Request, from_body: Criticality | None, error: type = InvalidRequest) -> Criticality:
    """The class the request claims (``ballast.policies.criticality.claimed``); a bad claim is
    ``error`` (the native front's 422, the OpenAI front's 400) naming the field."""
    try:
        return claimed(request.headers.get(CRITICALITY_HEADER), from_body)
    except ClaimError as e:
        raise error(str(e), field=e.field) from None
