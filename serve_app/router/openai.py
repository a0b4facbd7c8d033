"""The OpenAI-compatible front on the shared request pipeline.

``POST /v1/chat/completions``, ``POST /v1/completions`` (unary, or server-sent events
``data: {chunk}`` … ``data: [DONE]``) and ``GET /v1/models``, so that the official
``openai`` SDK, LangChain, LiteLLM and every other OpenAI client can use Ballast. The
protocol itself (bodies, fields refused by name, the chat template, stop strings, the
answers' shapes, errors in OpenAI's shape) is ``openai_api.py``; this module reads
the request, hands it to ``pipeline.Pipeline`` and formats what comes back.

* Identity: the tenant is the API key (``Authorization: Bearer``), as on every route.
* Class: the ``X-Ballast-Criticality`` header or a ``criticality`` body field (the SDK
  sends it with ``extra_body``); default ``critical``. A claim above the tenant's cap
  is lowered; ``X-Ballast-Criticality`` on the answer says what was granted and
  ``X-Ballast-Degraded`` why the answer is smaller than asked (level, cap, context).
* Which model answered: the answer's ``model`` field and ``X-Ballast-Fallback``.
* Sampling fields (temperature, top_p, seed) are passed to the model; the built-in
  byte model decodes greedily whatever they say (documented in the README).
* Errors: ``{"error": {"message", "type", "param", "code"}}`` with Ballast's stable code
  in ``code`` and Retry-After on 429/503, so the SDK raises its typed errors and its
  own retries wait as told (``api.py`` picks the shape by route).

``OpenAIRoutes`` is a part of the Router deployment (app.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncGenerator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve_app.errors import BallastError, PayloadTooLarge
from serve_app.router import openai_api as oa
from serve_app.stops import StopScanner, cut_at_stop
from serve_app.router.api import app, claimed_criticality, migrated_header, read_body
from serve_app.router.pipeline import Admitted, StreamEnd


Parsed = Union[oa.ChatCompletionRequest, oa.CompletionRequest]


class OpenAIRoutes:
    """The OpenAI-compatible routes (a part of ``Router``)."""

    @app.get("/v1/models")
    async def list_models(self, request: Request):
        self._tenant(request)  # a key is needed here as on every model route
        return JSONResponse(oa.models_list(self._served_models(), self._created_s))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, chat=False)

    # -- the shared part of both ----------------------------------------------------------
    def _served_models(self) -> list[str]:
        names = [self._cfg.model.name]
        if self._cfg.fallback is not None and self._cfg.fallback.model.name not in names:
            names.append(self._cfg.fallback.model.name)
        return names

    async def _openai(self, request: Request, chat: bool) -> Response:
        self._exchange.start()
        started = time.monotonic()
        tenant = self._tenant(request)
        deadline = self._deadline(request, started)
        raw = await read_body(request, self._limits.max_body_bytes)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise oa.BadRequest("body must be a JSON object", field="body") from None
        req: Parsed = oa.parse_chat(data) if chat else oa.parse_completion(data)
        if req.model != self._cfg.model.name:
            raise oa.unknown_model(req.model, [self._cfg.model.name])
        prompt = self._text.render_chat(req.messages) if chat else req.prompt
        if len(prompt.encode("utf-8")) > self._limits.max_prompt_bytes:
            raise PayloadTooLarge(f"prompt exceeds {self._limits.max_prompt_bytes} bytes")
        asked = oa.max_tokens_of(req)
        if asked is not None and asked > self._limits.max_tokens_limit:
            field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise oa.BadRequest(f"{field}: must be <= {self._limits.max_tokens_limit}", field=field)
        claimed = claimed_criticality(request, req.criticality, oa.BadRequest)
        key = self._idempotency_key(request)
        # A chat prompt holds its template's special tokens already; a raw prompt gets them.
        prompt_tokens = self._text.count(prompt, add_special_tokens=not chat)
        max_tokens = self._text.fit(prompt_tokens, asked)
        admitted = await self._admit(tenant, claimed, prompt_tokens, max_tokens, req.stream, deadline)
        stops = oa.stops_of(req)
        call: dict[str, Any] = {"prompt": prompt, "max_tokens": admitted.max_tokens}
        if chat:
            call["add_special_tokens"] = False
        if stops:
            call["stop"] = list(stops)  # the model ends the row there; the front cuts too
        for name in ("temperature", "top_p", "seed"):
            if getattr(req, name) is not None:
                call[name] = getattr(req, name)
        ids = (oa.new_id("chatcmpl" if chat else "cmpl"), int(time.time()))
        headers = self._openai_headers(admitted)
        if req.stream and admitted.streaming:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._openai_stream(admitted, call, chat, ids, stops, usage),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        answer, replayed = await self._answer_unary(admitted, call, key)
        text, stopped = cut_at_stop(answer["text"], stops)
        usage = (admitted.ticket.prompt_tokens, int(answer["tokens"]))
        finish = oa.finish_reason(usage[1], admitted.max_tokens, stopped or answer.get("finish_reason") == "stop")
        headers["X-Ballast-Fallback"] = answer["fallback"] or "none"
        headers.update(migrated_header(answer))
        if replayed:
            headers["X-Ballast-Idempotent-Replay"] = "true"
        build = oa.chat_completion if chat else oa.completion
        body = build(ids[0], ids[1], answer["model"], text, finish, usage[0], usage[1])
        if not req.stream:
            return JSONResponse(body, headers=headers)
        # Streaming is off at this level: the whole answer as one stream event, then [DONE].
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return Response(self._one_event_stream(body, chat, usage), media_type="text/event-stream", headers=headers)

    @staticmethod
    def _openai_headers(admitted: Admitted) -> dict[str, str]:
        headers = {"X-Ballast-Criticality": admitted.criticality.value, "X-Ballast-Level": str(admitted.level)}
        if admitted.degraded_reasons:
            headers["X-Ballast-Degraded"] = ",".join(admitted.degraded_reasons)
        return headers

    async def _openai_stream(
        self, admitted: Admitted, call: dict[str, Any], chat: bool, ids: tuple[str, int], stops: tuple[str, ...], usage: bool
    ) -> AsyncGenerator[bytes, None]:
        end = StreamEnd()
        scanner = StopScanner(stops)
        chunk = oa.chat_chunk if chat else oa.completion_chunk
        model = self._cfg.model.name
        parts = self._answer_stream(admitted, call, end)
        try:
            if chat:
                yield oa.sse_data(chunk(ids[0], ids[1], model, {"role": "assistant", "content": ""}, None))
            async for part in parts:
                model = self._answered_by(end.fallback)
                text = scanner.feed(part["text"])
                if text:
                    yield oa.sse_data(chunk(ids[0], ids[1], model, {"content": text} if chat else text, None))
                if scanner.stopped:  # a stop string: the answer is complete, the model stops now
                    end.enough = True
                    await parts.aclose()
                    break
            rest = scanner.finish()
            if rest:
                yield oa.sse_data(chunk(ids[0], ids[1], model, {"content": rest} if chat else rest, None))
            finish = oa.finish_reason(end.tokens, admitted.max_tokens, scanner.stopped or end.finish == "stop")
            yield oa.sse_data(chunk(ids[0], ids[1], model, {} if chat else "", finish))
            if usage:
                usage_chunk = oa.chat_usage_chunk if chat else oa.completion_usage_chunk
                yield oa.sse_data(usage_chunk(ids[0], ids[1], model, admitted.ticket.prompt_tokens, end.tokens))
        except BallastError as err:
            yield oa.sse_data(oa.openai_error_body(err))
        finally:
            await parts.aclose()  # a client that left mid-stream: the model stops within a step
        yield oa.SSE_DONE

    @staticmethod
    def _one_event_stream(body: dict[str, Any], chat: bool, usage: bool) -> bytes:
        """A unary answer as a stream: its text in one event, the finish, the usage, [DONE]."""
        choice = body["choices"][0]
        ids = (body["id"], body["created"], body["model"])
        if chat:
            events = [
                oa.chat_chunk(*ids, {"role": "assistant", "content": choice["message"]["content"]}),
                oa.chat_chunk(*ids, {}, choice["finish_reason"]),
            ]
        else:
            events = [oa.completion_chunk(*ids, choice["text"]), oa.completion_chunk(*ids, "", choice["finish_reason"])]
        if usage:
            u = body["usage"]
            usage_chunk = oa.chat_usage_chunk if chat else oa.completion_usage_chunk
            events.append(usage_chunk(*ids, u["prompt_tokens"], u["completion_tokens"]))
        return b"".join(oa.sse_data(e) for e in events) + oa.SSE_DONE
