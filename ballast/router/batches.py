"""OpenAI's Batch API on the router: ``/v1/files`` and ``/v1/batches``, as the official
``openai`` client calls them (``files.create/retrieve/list/delete/content``,
``batches.create/retrieve/list/cancel``), on the durable store (ballast/batch/store.py).

Procedure of ``POST /v1/batches`` (``create_batch``):

1. the caller is its API key's tenant (401), as on every route;
2. the body: ``input_file_id``, ``endpoint`` (``/v1/chat/completions``, ``/v1/completions`` or
   ``/v1/embeddings``),
   ``completion_window`` (one of ``batch.completion_windows``), ``metadata`` (at most 16
   pairs, OpenAI's bounds); anything else is a 400 naming the field;
3. the input file: the caller's own (another tenant's is 404, as one that does not exist),
   of purpose ``batch``;
4. every line checked by the online call's rules (ballast/batch/lines.py's
   ``parse_batch_file`` with the endpoint's front's ``prepare`` as the check, ``OpenAIFront``'s
   or ``EmbeddingsFront``'s: the parse and its limits, the tenant's models through
   ``Pipeline.target`` and their kind, what the engine cannot honour, max_tokens bounds, the
   prompt's (the inputs') size and context), in a worker thread (the tokenizer's
   work stays off the event loop). A file that cannot run as a whole makes a ``failed``
   batch carrying OpenAI's ``errors.data``; a line refused alone goes to the error file
   with its number at once, the others onto their model's queue;
5. the batch stored ``in_progress`` with its lines, in one transaction (the store refuses
   past the tenant's batches in flight, lines queued, files: 429). Validation runs inside
   the call, so a client sees ``in_progress`` (or ``failed``) first, never ``validating``.

The dispatcher (router/dispatcher.py) runs the lines (``run_line``: the endpoint's front's
``batch_line``) and finalizes the batch.

Ownership: a file or batch is its tenant's; every route looks it up and answers 404 for
another tenant's, with the message it gives for one that does not exist. ``GET
/admin/batches`` (admin.py) lists every tenant's. Ids longer than ``MAX_ID_CHARS`` name
nothing (404, no store call).

Uploads are read as they stream (``ballast.batch.upload.read_upload``) within
``batch.max_file_bytes`` and ``batch.max_file_lines``; every file expires (its
``expires_after``, else ``batch.file_expiry_s``). With no store configured, or batch off,
every route here answers 503 STORE_UNAVAILABLE; the online routes never touch the store.
Errors take OpenAI's shape (api.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ballast.batch import shapes
from ballast.batch.lines import ParsedFile, parse_batch_file
from ballast.batch.records import BatchRecord, FailedLine, QueuedLine, new_batch_id
from ballast.batch.store import BatchStore
from ballast.batch.upload import read_upload
from ballast.errors import BatchFileInvalid, BatchNotCancellable, InvalidRequest, NotFound, StoreUnavailable
from ballast.router import openai_api as oa
from ballast.router.api import read_json
from ballast.router.embeddings import EmbeddingsFront
from ballast.router.gate import BatchSlot, GateSlot
from ballast.router.metadata import MAX_METADATA_PAIRS, metadata_fault
from ballast.router.openai import OpenAIFront
from ballast.router.pipeline import Caller, Pipeline

#: The endpoints a batch may run here (OpenAI's list has more).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
EMBEDDINGS = "/v1/embeddings"
MAX_ID_CHARS = 64  # file-<24 hex> and batch_<24 hex> are 29 and 30


class BatchCreate(BaseModel):
    """``POST /v1/batches``'s body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: str = Field(min_length=1, max_length=8)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_PAIRS)


def _checked_create(data: dict[str, Any]) -> BatchCreate:
    try:
        body = BatchCreate.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise oa.BadRequest(f"{field}: {first['msg']}", field=field) from None
    fault = metadata_fault(body.metadata or {})
    if fault is not None:
        raise oa.BadRequest(fault, field="metadata")
    return body


def expired_line(custom_id: str) -> str:
    """The error-file line of a line its batch's window closed on (OpenAI's ``batch_expired``)."""
    line = shapes.error_line(
        shapes.new_line_id(),
        custom_id,
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    )
    return json.dumps(line, separators=(",", ":"))


class BatchFront:
    """The Batch API's routes on the pipeline (identity, the tenant's models), the fronts
    that check and run each line (OpenAI's text routes, embeddings) and the store (None: no
    store here, 503)."""

    def __init__(
        self,
        pipeline: Pipeline,
        front: OpenAIFront,
        embeddings: EmbeddingsFront,
        cfg: Any,
        store: BatchStore | None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pipeline = pipeline
        self._front = front
        self._embeddings = embeddings
        self._cfg = cfg
        self._store = store
        self._wall = wall  # Unix seconds: what the records show (OpenAI's times)

    def store(self) -> BatchStore:
        """The store, or 503 STORE_UNAVAILABLE saying why there is none."""
        if not self._cfg.batch.enabled:
            raise StoreUnavailable("the Batch API is off in this deployment (batch.enabled)")
        if self._store is None:
            raise StoreUnavailable("no batch store is configured here (batch.store_url)")
        return self._store

    # -- files ---------------------------------------------------------------------------
    async def upload_file(self, request: Request) -> JSONResponse:
        """``POST /v1/files``: the multipart upload read as it streams, within its caps."""
        caller = self._pipeline.identify(request)
        store = self.store()
        b = self._cfg.batch
        upload = await read_upload(
            request.stream(), request.headers.get("content-type"), b.max_file_bytes, b.max_file_lines
        )
        now = self._wall()
        expires_at = None if upload.expires_after is None else now + upload.expires_after.seconds
        rec = await store.put_file(caller.tenant, upload.filename, upload.purpose, upload.data, expires_at, now)
        return JSONResponse(shapes.file_object(rec.to_dict()))

    async def list_files(self, request: Request) -> dict[str, Any]:
        caller = self._pipeline.identify(request)
        limit, after = _paging(request)
        purpose = request.query_params.get("purpose")
        if purpose is not None and purpose not in shapes.FILE_PURPOSES:
            raise oa.BadRequest(f"purpose: one of {', '.join(shapes.FILE_PURPOSES)}", field="purpose")
        page = await _as_bad_request(self.store().list_files(caller.tenant, purpose, limit, after))
        return shapes.list_page([shapes.file_object(f.to_dict()) for f in page.items], page.has_more)

    async def get_file(self, file_id: str, request: Request) -> dict[str, Any]:
        caller = self._pipeline.identify(request)
        return shapes.file_object((await self._own_file(caller, file_id)).to_dict())

    async def delete_file(self, file_id: str, request: Request) -> dict[str, Any]:
        caller = self._pipeline.identify(request)
        await self._own_file(caller, file_id)
        if not await self.store().delete_file(file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_content(self, file_id: str, request: Request) -> Response:
        caller = self._pipeline.identify(request)
        await self._own_file(caller, file_id)
        data = await self.store().file_data(file_id)
        if data is None:
            raise _no_file(file_id)
        return Response(data, media_type="application/octet-stream")

    async def _own_file(self, caller: Caller, file_id: str) -> Any:
        """The caller's file, else 404 (another tenant's reads as one that does not exist)."""
        store = self.store()
        rec = await store.file(file_id) if len(file_id) <= MAX_ID_CHARS else None
        if rec is None or rec.tenant != caller.tenant:
            raise _no_file(file_id)
        return rec

    # -- batches -------------------------------------------------------------------------
    async def create_batch(self, request: Request) -> dict[str, Any]:
        """``POST /v1/batches`` (procedure: the module docstring)."""
        caller = self._pipeline.identify(request)
        store = self.store()
        body = _checked_create(await read_json(request, self._cfg.limits, oa.BadRequest))
        try:
            window_s = self._cfg.batch.window_s(body.completion_window)
        except ValueError as e:
            raise oa.BadRequest(str(e), field="completion_window") from None
        file = await self._own_file(caller, body.input_file_id)
        if file.purpose != "batch":
            raise oa.BadRequest(
                f"input_file_id: {body.input_file_id} has purpose {file.purpose!r}, not 'batch'", field="input_file_id"
            )
        data = await store.file_data(file.id)
        if data is None:
            raise _no_file(file.id)
        now = self._wall()
        rec = BatchRecord(
            id=new_batch_id(),
            tenant=caller.tenant,
            endpoint=body.endpoint,
            input_file_id=file.id,
            completion_window=body.completion_window,
            created_at=int(now),
            expires_at=int(now + window_s),
            metadata=tuple(sorted((body.metadata or {}).items())),
        )
        try:
            parsed = await asyncio.to_thread(self._parse, data, body.endpoint, caller)
        except BatchFileInvalid as e:
            failed = replace(rec, status="failed", failed_at=int(now), errors=tuple(e.errors))
            await store.create_batch(failed, [])
            return shapes.batch_object(failed.to_dict())
        rec = replace(rec, status="in_progress", in_progress_at=int(now), model=parsed.model)
        lines = [
            QueuedLine(rec.id, g.line, g.custom_id, g.model, caller.tenant, g.body_json, queued_at=now)
            for g in parsed.lines
        ]
        refused = [
            FailedLine(e.line, e.custom_id, json.dumps(shapes.refused_line(shapes.new_line_id(), e)))
            for e in parsed.errors
        ]
        await store.create_batch(rec, lines, refused)
        return shapes.batch_object((await self._own_batch(caller, rec.id)).to_dict())

    def _parse(self, data: bytes, endpoint: str, caller: Caller) -> ParsedFile:
        """Every line checked as the online call would be (runs in a worker thread)."""
        limits = self._cfg.limits
        return parse_batch_file(
            data,
            endpoint,
            self._cfg.batch.max_file_lines,
            lambda line: self.check_line(line, endpoint, caller),
            max_depth=limits.max_json_depth,
            max_body_bytes=limits.max_body_bytes,
        )

    def check_line(self, body: dict[str, Any], endpoint: str, caller: Caller) -> str:
        """The model a batch line of ``endpoint`` runs on, its body checked as the online
        call's (the endpoint's front's ``prepare``); a refusal raises its BallastError."""
        if endpoint == EMBEDDINGS:
            return self._embeddings.prepare(body, caller).target.model
        return self._front.prepare(body, endpoint == "/v1/chat/completions", caller).target.model

    async def run_line(self, caller: Caller, body: dict[str, Any], endpoint: str, slot: GateSlot | BatchSlot) -> Any:
        """A batch line of ``endpoint`` run on ``slot`` (the dispatcher's; given back whatever
        happens) by the endpoint's front (``batch_line``): the answer's body, as online."""
        if endpoint == EMBEDDINGS:
            return await self._embeddings.batch_line(caller, body, slot)
        return await self._front.batch_line(caller, body, endpoint == "/v1/chat/completions", slot)

    async def get_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        caller = self._pipeline.identify(request)
        return shapes.batch_object((await self._own_batch(caller, batch_id)).to_dict())

    async def list_batches(self, request: Request) -> dict[str, Any]:
        caller = self._pipeline.identify(request)
        limit, after = _paging(request)
        page = await _as_bad_request(self.store().list_batches(caller.tenant, limit, after))
        return shapes.list_page([shapes.batch_object(b.to_dict()) for b in page.items], page.has_more)

    async def cancel_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        """``validating``/``in_progress`` -> ``cancelling`` (the dispatcher's finalizer makes it
        ``cancelled`` with what was answered); asked again while cancelling, the batch as it
        is; an ended batch is 409."""
        caller = self._pipeline.identify(request)
        rec = await self._own_batch(caller, batch_id)
        if not await self.store().cancel(batch_id, self._wall()):
            rec = await self._own_batch(caller, batch_id)
            if rec.status not in ("cancelling", "cancelled"):
                raise BatchNotCancellable(f"batch {batch_id} is {rec.status}: it cannot be cancelled")
            return shapes.batch_object(rec.to_dict())
        return shapes.batch_object((await self._own_batch(caller, rec.id)).to_dict())

    async def _own_batch(self, caller: Caller, batch_id: str) -> BatchRecord:
        rec = await self.store().batch(batch_id) if len(batch_id) <= MAX_ID_CHARS else None
        if rec is None or rec.tenant != caller.tenant:
            raise NotFound(f"No batch found with id '{batch_id[:MAX_ID_CHARS]}'.")
        return rec


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id[:MAX_ID_CHARS]}")


def _paging(request: Request) -> tuple[int, str | None]:
    """A list's ``limit`` (1 to 100, default 20) and ``after`` cursor; ``order`` desc only
    (the store lists newest first)."""
    q = request.query_params
    raw = q.get("limit", "20")
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw[:4]) <= 100 and len(raw) <= 3):
        raise oa.BadRequest("limit: an integer from 1 to 100", field="limit")
    if q.get("order", "desc") != "desc":
        raise oa.BadRequest("order: only 'desc' (newest first) is served", field="order")
    after = q.get("after")
    if after is not None and not 0 < len(after) <= MAX_ID_CHARS:
        raise oa.BadRequest(f"after: an id of 1 to {MAX_ID_CHARS} characters", field="after")
    return int(raw), after


async def _as_bad_request(call: Any) -> Any:
    """A store list call; its refusal of a cursor (422) as OpenAI's 400."""
    try:
        return await call
    except InvalidRequest as e:
        raise oa.BadRequest(e.message, field=e.field) from None
