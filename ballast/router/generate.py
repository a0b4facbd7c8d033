"""``POST /v1/generate``: Ballast's native front on the shared request pipeline.

``NativeFront`` reads and bounds its body (413, 422 naming the field), hands the
request to the ``Pipeline`` it holds (identity, kill switch, admission, the ticket,
the gate, the resilient call; pipeline.py's docstring walks the path) and formats
what comes back: one JSON object, or server-sent events ``token`` … ``done`` (or
``error``). At a level that does not allow streaming, a stream request gets one
``token`` event with the whole text, then ``done``.

A stream cut on its way to the client (its router's node lost: no router can carry it
on, only the client can) is resumed by sending the same request again with
``resume``: the token ids the ``token`` events carried and the characters the client
got. The model prefills the prompt and those ids and goes on; the client gets only
the text it does not have, and ``done`` counts the whole generation.
"""

from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ballast.errors import BallastError, InvalidRequest, PayloadTooLarge
from ballast.model.protocol import ModelCall, Resume
from ballast.policies.catalog import Target
from ballast.policies.criticality import Criticality
from ballast.policies.flex import TIER_HEADER
from ballast.router.answered import Answer, Stream
from ballast.router.api import StreamResponse, answer_headers, read_json, sse_event, validate_body
from ballast.router.pipeline import ModelRequest, Pipeline, tiered_claim
from ballast.router.tokens import ModelText


class ResumeBody(BaseModel):
    """Where a cut stream's client stands: the ids of the tokens it got, and its text's
    length in characters (Unicode code points)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    text_chars: int = Field(ge=0)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    # A model or adapter ("sql", "llama:sql") the caller's key may use; none: the first model.
    model: str | None = Field(None, min_length=1, max_length=256)
    max_tokens: int = Field(64, ge=1)
    # Or the X-Ballast-Criticality header (which HAProxy reads: edge.py); both must agree.
    criticality: Criticality | None = None
    # OpenAI's tiers (ballast/policies/flex.py): flex is sheddable held for spare capacity.
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = None
    stream: bool = False
    resume: ResumeBody | None = None  # a cut stream sent again (the module's docstring)


class Asked(NamedTuple):
    """The model a request asked for, and the name it gave (None: it named none)."""

    model: str
    name: str | None

    def shown(self, answered_by: str) -> str:
        """The ``model`` an answer shows: the name asked (an adapter as the request named
        it) when that model answered; the fallback's own name when it did."""
        return self.name if self.name is not None and answered_by == self.model else answered_by


class NativeFront:
    """``POST /v1/generate`` on the pipeline it holds."""

    def __init__(self, pipeline: Pipeline, limits: Any) -> None:
        self._pipeline = pipeline
        self._limits = limits

    async def generate(self, request: Request) -> Response:
        caller = self._pipeline.identify(request)
        req = self._parse(await read_json(request, self._limits))
        lane, target = self._pipeline.target(caller, req.model)
        lane.serves("generate", req.model or lane.name, InvalidRequest)
        call = self.to_call(req, caller.idempotency_key, lane.text, target)
        max_tokens = lane.text.fit(len(call.prompt_ids), req.max_tokens)
        tier, claimed = tiered_claim(request, req.service_tier, req.criticality, InvalidRequest)
        served = await self._pipeline.serve(ModelRequest(caller, claimed, max_tokens, req.stream, call, tier))
        resumed_tokens = len(call.resumed_ids)
        asked = Asked(target.model, req.model)
        if isinstance(served, Stream):
            headers = {TIER_HEADER: served.admission.tier.value}
            return StreamResponse(self._events(served, resumed_tokens, asked), served, headers)
        return self._answer(served, resumed_tokens, req.stream, asked)

    def _answer(self, answer: Answer, resumed_tokens: int, stream: bool, asked: "Asked") -> Response:
        settled = answer.settled
        meta = answer.admission.meta(asked.shown(settled.model))
        body = {
            "text": settled.text,
            "tokens_generated": settled.tokens + resumed_tokens,
            **meta,
            "fallback": settled.fallback,
        }
        headers = {**answer_headers(answer), TIER_HEADER: answer.admission.tier.value}
        if stream:  # streaming is off at this level: one token event, then done
            done = {k: v for k, v in body.items() if k != "text"}
            events = sse_event("token", {"text": body["text"], "tokens": body["tokens_generated"]}) + sse_event(
                "done", done
            )
            return Response(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    async def _events(self, stream: Stream, resumed_tokens: int, asked: "Asked") -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in stream:
                event: dict[str, Any] = {"text": chunk.text, "tokens": chunk.tokens}
                if stream.fallback is None:  # the primary's ids: the client resumes a cut stream with them
                    event["ids"] = list(chunk.ids)
                yield sse_event("token", event)
            yield sse_event(
                "done",
                {
                    "tokens_generated": resumed_tokens + stream.tokens,
                    **stream.admission.meta(asked.shown(stream.model)),
                    "fallback": stream.fallback,
                    "migrations": stream.migrations,
                    **({"resumed_tokens": resumed_tokens} if resumed_tokens else {}),
                },
            )
        except BallastError as err:
            yield sse_event("error", err.body())
        finally:
            await stream.aclose()  # a client that left mid-stream: settled now, not when collected

    @classmethod
    def to_call(cls, req: GenerateRequest, key: str | None, text: ModelText, target: Target) -> ModelCall:
        """The model call for the request, its prompt tokenized once by the model's text; a
        resumed stream's ids and characters (checked here: a bad id would otherwise fail in
        the model as the model's error) are prefilled after the prompt."""
        resume = cls._resume(req, key, text.vocab_size)
        return text.call(req.prompt, resume=resume, model=target.model, adapter=target.adapter)

    @staticmethod
    def _resume(req: GenerateRequest, key: str | None, vocab_size: int) -> Resume | None:
        if req.resume is None:
            return None
        if not req.stream:
            raise InvalidRequest(
                "resume: only a stream is resumed (a unary answer comes whole or not at all)", field="resume"
            )
        if key is not None:
            raise InvalidRequest("resume: a resumed stream takes no Idempotency-Key", field="Idempotency-Key")
        ids = req.resume.ids
        if len(ids) > req.max_tokens:
            raise InvalidRequest(
                f"resume.ids: {len(ids)} ids, more than max_tokens {req.max_tokens}", field="resume.ids"
            )
        if max(ids) >= vocab_size:
            raise InvalidRequest(
                f"resume.ids: token ids must be below the model's vocabulary size {vocab_size}",
                field="resume.ids",
            )
        return Resume(tuple(ids), req.resume.text_chars)

    def _parse(self, data: dict[str, Any]) -> GenerateRequest:
        req = validate_body(GenerateRequest, data)
        if req.max_tokens > self._limits.max_tokens_limit:
            raise InvalidRequest(f"max_tokens: must be <= {self._limits.max_tokens_limit}", field="max_tokens")
        if len(req.prompt.encode("utf-8")) > self._limits.max_prompt_bytes:
            raise PayloadTooLarge(f"prompt exceeds {self._limits.max_prompt_bytes} bytes")
        return req
