"""``POST /v1/generate``: Ballast's native front on the shared request pipeline.

The front reads and bounds its body (413, 422 naming the field), then hands the
request to ``pipeline.Pipeline`` (identity, kill switch, admission, the ticket, the
gate, the resilient call; its docstring walks the path) and formats the answer: one
JSON object, or server-sent events ``token`` … ``done`` (or ``error``). At a level
that does not allow streaming, a stream request gets one ``token`` event with the
whole text, then ``done``.

A stream cut on its way to the client (its router's node lost: no router can carry it
on, only the client can) is resumed by sending the same request again with
``resume``: the token ids the ``token`` events carried and the characters the client
got. The model prefills the prompt and those ids and goes on; the client gets only
the text it does not have, and ``done`` counts the whole generation.

``GenerateRoutes`` is a part of the Router deployment (app.py).
"""

import json
import time
from typing import Annotated, Any, AsyncGenerator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from policies.criticality import Criticality

from serve_app.errors import BallastError, InvalidRequest, PayloadTooLarge
from serve_app.router.api import app, claimed_criticality, migrated_header, read_body, sse_event, validate_body
from serve_app.router.pipeline import Admitted, StreamEnd


class Resume(BaseModel):
    """Where a cut stream's client stands: the ids of the tokens it got, and its text's
    length in characters (Unicode code points)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    text_chars: int = Field(ge=0)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    max_tokens: int = Field(64, ge=1)
    # Or the X-Ballast-Criticality header (which HAProxy reads: edge.py); both must agree.
    criticality: Optional[Criticality] = None
    stream: bool = False
    resume: Optional[Resume] = None  # a cut stream sent again (the module's docstring)


class GenerateRoutes:
    """The native generate route (a part of ``Router``)."""

    @app.post("/v1/generate")
    async def generate(self, request: Request):
        self._exchange.start()
        started = time.monotonic()
        tenant = self._tenant(request)
        deadline = self._deadline(request, started)
        req = self._parse(await read_body(request, self._limits.max_body_bytes))
        key = self._idempotency_key(request)
        resumed = self._resume_fields(req, key)
        prompt_tokens = self._text.count(req.prompt)
        max_tokens = self._text.fit(prompt_tokens, req.max_tokens)
        # A resumed stream prefills the ids it brings beside its prompt.
        kv_prompt = prompt_tokens + len(resumed.get("continue_ids", ()))
        admitted = await self._admit(tenant, claimed_criticality(request, req.criticality), kv_prompt, max_tokens, req.stream, deadline)
        meta = admitted.meta(self._cfg.model.name)
        call = {"prompt": req.prompt, "max_tokens": admitted.max_tokens, **resumed}
        if req.stream and admitted.streaming:
            return StreamingResponse(
                self._native_stream(admitted, call, meta), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        answer, replayed = await self._answer_unary(admitted, call, key)
        generated = answer["tokens"] + len(resumed.get("continue_ids", ()))
        body = {"text": answer["text"], "tokens_generated": generated, **meta, "fallback": answer["fallback"], "model": answer["model"]}
        headers = {"X-Ballast-Fallback": answer["fallback"] or "none", **migrated_header(answer)}
        if replayed:
            headers["X-Ballast-Idempotent-Replay"] = "true"
        if req.stream:  # streaming is off at this level: one token event, then done
            done = {k: v for k, v in body.items() if k != "text"}
            events = sse_event("token", {"text": body["text"], "tokens": body["tokens_generated"]}) + sse_event("done", done)
            return Response(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    async def _native_stream(self, admitted: Admitted, call: dict[str, Any], meta: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        end = StreamEnd()
        chunks = self._answer_stream(admitted, call, end)
        try:
            async for chunk in chunks:
                event = {"text": chunk["text"], "tokens": chunk["tokens"]}
                if end.fallback is None:  # the primary's ids: the client resumes a cut stream with them
                    event["ids"] = chunk.get("ids", [])
                yield sse_event("token", event)
            resumed = len(call.get("continue_ids", ()))
            yield sse_event("done", {"tokens_generated": resumed + end.tokens, **meta, "fallback": end.fallback,
                                     "model": self._answered_by(end.fallback), "migrations": end.migrations,
                                     **({"resumed_tokens": resumed} if resumed else {})})
        except BallastError as err:
            yield sse_event("error", err.body())
        finally:
            await chunks.aclose()  # a client that left mid-stream: settled now, not when collected

    def _resume_fields(self, req: GenerateRequest, key: Optional[str]) -> dict[str, Any]:
        """The call's continuation fields for a resumed stream (checked here: a bad id
        would otherwise fail in the model as the model's error); {} for a new request."""
        if req.resume is None:
            return {}
        if not req.stream:
            raise InvalidRequest("resume: only a stream is resumed (a unary answer comes whole or not at all)", field="resume")
        if key is not None:
            raise InvalidRequest("resume: a resumed stream takes no Idempotency-Key", field="Idempotency-Key")
        ids = req.resume.ids
        if len(ids) > req.max_tokens:
            raise InvalidRequest(f"resume.ids: {len(ids)} ids, more than max_tokens {req.max_tokens}", field="resume.ids")
        if max(ids) >= self._text.vocab_size:
            raise InvalidRequest(f"resume.ids: token ids must be below the model's vocabulary size {self._text.vocab_size}",
                                 field="resume.ids")
        return {"continue_ids": list(ids), "continue_text_chars": req.resume.text_chars}

    def _parse(self, body: bytes) -> GenerateRequest:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("body must be a JSON object", field="body") from None
        req = validate_body(GenerateRequest, data)
        if req.max_tokens > self._limits.max_tokens_limit:
            raise InvalidRequest(f"max_tokens: must be <= {self._limits.max_tokens_limit}", field="max_tokens")
        if len(req.prompt.encode("utf-8")) > self._limits.max_prompt_bytes:
            raise PayloadTooLarge(f"prompt exceeds {self._limits.max_prompt_bytes} bytes")
        return req
