"""OpenAI's Responses API on the chat path: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``.

Not a second front: a Responses request becomes the chat body it means
(``responses_items.to_chat``: the stored conversation of ``previous_response_id``, the
instructions, the input items), which the OpenAI front prepares and the pipeline serves as
any chat request (the tenant's key, class and tier, the kill switch and level, quota, gate,
deadline, breaker, fallback). The chat answer (its parser's reasoning, text and tool calls)
becomes Responses output items in a response object; a stream's chat pieces become the
Responses events (``responses_events.ResponseStream``).

Stored responses (``store``, absent or true as OpenAI's default) go to the batch store on
Redis (``batch/store_responses.py``), per tenant, bounded in count and bytes, expiring
(``responses.*``): the response object and the conversation the next turn continues. A
unary answer is stored before it is sent (a store that fails is a 503 and nothing is sent);
a stream's before its ``response.completed`` (else ``response.failed``). ``store: true``
without a store, or ``responses.store: false``, is a 400 naming ``store``; an absent
``store`` then answers ``store: false``. Another tenant's id, an unknown one and an expired
one are the same 404 (the tenant is part of the key).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ballast.batch.store import BatchStore
from ballast.errors import BallastError, NotFound
from ballast.router import openai_answers as answers
from ballast.router.answered import Stream
from ballast.router.api import StreamResponse, answer_headers, read_json
from ballast.router.openai import OpenAIFront, Prepared
from ballast.router.openai_api import BadRequest
from ballast.router.openai_logprobs import chat_logprobs
from ballast.router.pipeline import Caller, ModelRequest, Pipeline, tiered_claim
from ballast.router.responses_api import RESPONSE_ID, ResponsesRequest, parse_responses
from ballast.router.responses_events import ResponseStream
from ballast.router.responses_items import (
    AnswerParts,
    ResponseHead,
    conversation_after,
    input_messages,
    output_items,
    response_head,
    response_object,
    status_of,
    to_chat,
)


class ResponsesFront:
    """The Responses routes on the OpenAI front and the pipeline they hold; ``store``: the
    batch store (None: none configured)."""

    def __init__(self, pipeline: Pipeline, front: OpenAIFront, cfg: Any, store: BatchStore | None) -> None:
        self._pipeline = pipeline
        self._front = front
        self._cfg = cfg.responses
        self._limits = cfg.limits
        self._store = store if cfg.responses.store else None

    async def create(self, request: Request) -> Response:
        """``POST /v1/responses``."""
        caller = self._pipeline.identify(request)
        data = await read_json(request, self._limits, BadRequest)
        req = parse_responses(data, self._limits, self._cfg.max_input_items)
        store = self._storing(req)
        previous, depth = await self._previous(caller, req)
        p = self._front.prepare(to_chat(req, previous), True, caller)
        tier, claimed = tiered_claim(request, req.service_tier, req.criticality, BadRequest)
        served = await self._pipeline.serve(ModelRequest(caller, claimed, p.max_tokens, req.stream, p.call, tier))
        answer_id = self._front.identity(p, True, served.admission)
        head = response_head(req, answer_id.of(p.target.model).model)
        head = replace(head, echo={**head.echo, "store": store is not None})
        sent = input_messages(req)
        headers = self._front.headers(served.admission)
        if isinstance(served, Stream):
            events = self._events(served, p, head, answer_id, caller, store, previous, sent, depth)
            return StreamResponse(events, served, headers)
        body = self._front.answer_body(served, p, True, answer_id)
        (choice,) = body["choices"]
        output = output_items(AnswerParts.of_choice(choice))
        tier_served = body.get("service_tier")
        obj = response_object(
            replace(head, model=body["model"]),
            status_of(choice["finish_reason"]),
            output,
            body["usage"],
            None,
            tier_served,
        )
        if store is not None:
            await self._keep(store, caller, obj, conversation_after(previous, sent, output), depth)
        return JSONResponse(obj, headers={**headers, **answer_headers(served)})

    async def retrieve(self, request: Request, response_id: str) -> JSONResponse:
        """``GET /v1/responses/{id}``: the stored response, the caller's own only."""
        caller = self._pipeline.identify(request)
        record = await self._record(caller, response_id, "response_id")
        return JSONResponse(record["response"])

    async def delete(self, request: Request, response_id: str) -> JSONResponse:
        """``DELETE /v1/responses/{id}``: the caller's stored response gone."""
        caller = self._pipeline.identify(request)
        store = self._store
        if store is None or not RESPONSE_ID.fullmatch(response_id):
            raise _not_found(response_id)
        if not await store.delete_response(caller.tenant, response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # -- the steps ---------------------------------------------------------------------------
    def _storing(self, req: ResponsesRequest) -> BatchStore | None:
        """Where this response is kept: the store, when the request lets it be (``store``
        absent or true); ``store: true`` with none configured is a 400."""
        if req.store is True and self._store is None:
            raise BadRequest(
                "store: no response store here (batch.store_url, responses.store); send store: false", field="store"
            )
        return self._store if req.stored else None

    async def _previous(self, caller: Caller, req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, int]:
        """The conversation ``previous_response_id`` continues, and this response's depth in
        its chain; read before anything is admitted (a 404 costs the model nothing)."""
        if req.previous_response_id is None:
            return None, 1
        record = await self._record(caller, req.previous_response_id, "previous_response_id")
        depth = int(record["depth"]) + 1
        if depth > self._cfg.max_chain_depth:
            raise BadRequest(
                f"previous_response_id: a chain of at most {self._cfg.max_chain_depth} responses "
                "(responses.max_chain_depth)",
                field="previous_response_id",
            )
        return list(record["conversation"]), depth

    async def _record(self, caller: Caller, response_id: str, field: str) -> dict[str, Any]:
        store = self._store
        if store is None or not RESPONSE_ID.fullmatch(response_id):
            raise _not_found(response_id, field)
        stored = await store.get_response(caller.tenant, response_id)
        if stored is None:
            raise _not_found(response_id, field)
        record: dict[str, Any] = json.loads(stored.record)
        record["depth"] = stored.depth
        return record

    @staticmethod
    async def _keep(
        store: BatchStore, caller: Caller, obj: dict[str, Any], conversation: list[dict[str, Any]], depth: int
    ) -> None:
        record = json.dumps({"response": obj, "conversation": conversation}, separators=(",", ":"))
        await store.put_response(caller.tenant, obj["id"], record, float(obj["created_at"]), depth)

    async def _events(
        self,
        stream: Stream,
        p: Prepared,
        head: ResponseHead,
        answer_id: answers.Identity,
        caller: Caller,
        store: BatchStore | None,
        previous: list[dict[str, Any]] | None,
        sent: list[dict[str, Any]],
        depth: int,
    ) -> AsyncGenerator[bytes, None]:
        """The response's events as the model writes them: the chat stream's pieces
        (``OpenAIFront.pieces``) as chat chunk choices fed to ``ResponseStream``; the
        response kept before ``response.completed``."""
        events = ResponseStream(replace(head, model=answer_id.of(stream.model).model))
        top = p.chat_logprobs
        # The events one step makes go out as one write: each write is a hop from this
        # router through Serve's proxy. Four writes before the first text put the first
        # token's p99 at 1.12-1.14x chat's (400 of each, docs/benchmarks.md); one, at 1.02x.
        try:
            yield _sse_all(events.start())
            async for piece in self._front.pieces(stream, p):
                wire = chat_logprobs(piece.logprobs, top) if top is not None and piece.logprobs else None
                chunk = answers.delta_chunk(answer_id.of(stream.model), True, piece.delta, piece.finish, logprobs=wire)
                (choice,) = chunk.model_dump(mode="json", exclude_unset=True)["choices"]
                fed = _sse_all(events.feed(choice))
                if fed:
                    yield fed
            a = stream.admission
            usage = answers.Counts(a.prompt_tokens, stream.tokens, stream.cached_tokens).usage().model_dump()
            last = events.finish(usage, a.tier.value)
            if store is not None:
                obj = last[-1]["response"]
                await self._keep(store, caller, obj, conversation_after(previous, sent, events.output), depth)
            yield _sse_all(last)
        except BallastError as err:
            yield _sse_all(events.fail(err))
        finally:
            await stream.aclose()


def _sse_all(events: Iterable[dict[str, Any]]) -> bytes:
    """Several events as one write, in order."""
    return b"".join(_sse(e) for e in events)


def _sse(event: dict[str, Any]) -> bytes:
    """One Responses stream event: its type as the SSE event, the object as its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _not_found(response_id: str, field: str = "response_id") -> NotFound:
    """One answer for an id that is unknown, expired, or another tenant's."""
    return NotFound(f"{field}: no response {response_id[:80]!r} for this key")
