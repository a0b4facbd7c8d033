"""The OpenAI-compatible front on the shared request pipeline.

``POST /v1/chat/completions``, ``POST /v1/completions`` (unary, or server-sent events
``data: {chunk}`` … ``data: [DONE]``) and ``GET /v1/models``, so that the official
``openai`` SDK, LangChain, LiteLLM and every other OpenAI client can use Ballast. The
protocol itself is ``openai_api.py`` (bodies, fields refused by name, the chat template,
stop strings) and ``openai_answers.py`` (the answers' shapes, the SSE framing, errors in
OpenAI's shape); this module reads the request, hands it to ``pipeline.Pipeline`` and
formats what comes back.

* Identity: the tenant is the API key (``Authorization: Bearer``), as on every route.
* Class: the ``X-Ballast-Criticality`` header or a ``criticality`` body field (the SDK
  sends it with ``extra_body``); default ``critical``. A claim above the tenant's cap
  is lowered; ``X-Ballast-Criticality`` on the answer says what was granted and
  ``X-Ballast-Degraded`` why the answer is smaller than asked (level, cap, context).
* Tier: OpenAI's ``service_tier`` (ballast/policies/flex.py): ``priority`` is the
  tenant's cap, ``flex`` sheddable held for spare capacity instead of refused (the
  pipeline's flex hold), ``default``/``auto`` the claim; the answer's ``service_tier``
  field (every chunk of a stream too) and ``X-Ballast-Service-Tier`` say which served it.
* Which model answered: the answer's ``model`` field and ``X-Ballast-Fallback``.
* Sampling fields (temperature, top_p, seed) are passed to the model; the built-in
  byte model decodes greedily whatever they say (documented in the README).
* Errors: ``{"error": {"message", "type", "param", "code"}}`` with Ballast's stable code
  in ``code`` and Retry-After on 429/503, so the SDK raises its typed errors and its
  own retries wait as told (``api.py`` picks the shape by route).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ballast.errors import BallastError, PayloadTooLarge, SchemaTooComplex
from ballast.model.protocol import ChoiceResult, ModelCall, TokenLogprob
from ballast.policies.catalog import Target
from ballast.policies.criticality import Criticality
from ballast.policies.flex import TIER_HEADER
from ballast.router import openai_answers as answers
from ballast.router import openai_api as oa
from ballast.router.answered import Admission, Answer, Stream
from ballast.router.api import StreamResponse, answer_headers, read_json
from ballast.router.chat_parsing import ParsedChat, StreamedChat
from ballast.router.gate import BatchSlot, GateSlot
from ballast.router.lanes import Lane
from ballast.router.openai_logprobs import chat_logprobs, completion_logprobs
from ballast.router.pipeline import Caller, ModelRequest, Pipeline, tiered_claim
from ballast.router.tokens import ModelText
from ballast.router.tool_calls import ToolPlan, ToolRequestError, ToolSchemaTooComplex, plan
from ballast.stops import StopScanner, cut_at_stop

NO_TOOLS = ToolPlan("none")


Parsed = oa.ChatCompletionRequest | oa.CompletionRequest


@dataclass(frozen=True)
class Prepared:
    """A body checked as the online call checks it, and what it asks of the model: the
    parsed request, what its model name means, its tools' parser (vLLM), its model call and
    its length fitted to the context."""

    req: Parsed
    target: Target
    parsed: ParsedChat | None
    call: ModelCall
    max_tokens: int
    # Each choice's own parser (the first is ``parsed``): a parser reads one answer.
    parsers: tuple[ParsedChat | None, ...] = (None,)

    @property
    def chat_logprobs(self) -> int | None:
        """A chat request's top_logprobs when it asks for log-probabilities (None: not)."""
        req = self.req
        return (req.top_logprobs or 0) if isinstance(req, oa.ChatCompletionRequest) and req.logprobs else None

    @property
    def echo(self) -> bool:
        return isinstance(self.req, oa.CompletionRequest) and self.req.echo


class OpenAIFront:
    """The OpenAI-compatible routes on the pipeline it holds."""

    def __init__(self, pipeline: Pipeline, cfg: Any, created_s: int) -> None:
        self._pipeline = pipeline
        self._cfg = cfg
        self._limits = cfg.limits
        self._created_s = created_s  # /v1/models' "created"

    def models(self, request: Request) -> JSONResponse:
        """Every model and adapter the caller's key may use (an adapter with its ``parent``)."""
        caller = self._pipeline.identify(request)  # a key is needed here as on every model route
        listed = self._pipeline.catalog.listed_for(caller.tenant)
        return JSONResponse(answers.models_list([(e.id, e.parent) for e in listed], self._created_s))

    async def complete(self, request: Request, chat: bool) -> Response:
        """``POST /v1/chat/completions`` (``chat``) or ``POST /v1/completions``."""
        caller = self._pipeline.identify(request)
        p = self.prepare(await read_json(request, self._limits, oa.BadRequest), chat, caller)
        req = p.req
        tier, claimed = tiered_claim(request, req.service_tier, req.criticality, oa.BadRequest)
        served = await self._pipeline.serve(ModelRequest(caller, claimed, p.max_tokens, req.stream, p.call, tier))
        answer_id = self.identity(p, chat, served.admission)
        opts = oa.Streaming.of(req)
        headers = self.headers(served.admission)
        if isinstance(served, Stream):
            return StreamResponse(self._events(served, p, chat, answer_id, opts), served, headers)
        return self._answer(served, p, chat, answer_id, opts if req.stream else None, headers)

    def prepare(self, data: dict[str, Any], chat: bool, caller: Caller) -> Prepared:
        """A body (an online request's, or a batch line's) checked as the online call checks
        it, and its model call: the parse and its limits, the model the caller may use, what
        the engine cannot honour, the tools, the prompt's size and its fit in the context
        (``_parse``); every refusal a 4xx naming the field."""
        req, lane, target = self._parse(data, chat, caller)
        text = lane.text
        parsed: ParsedChat | None = None
        if isinstance(req, oa.ChatCompletionRequest):
            parsed = self._parsed(req, text)
            tools = parsed.tools if parsed is not None else NO_TOOLS
            prompt = text.render_chat(req.messages, tools.template_tools(), req.template_kwargs)
        else:
            prompt = req.prompt_text if req.prompt_ids is None else text.decode(self._prompt_ids(req, text))
        if len(prompt.encode("utf-8")) > self._limits.max_prompt_bytes:
            raise PayloadTooLarge(f"prompt exceeds {self._limits.max_prompt_bytes} bytes")
        call = self.to_call(req, prompt, chat, parsed, text, target)
        parsers: list[ParsedChat | None] = [parsed]
        if parsed is not None and isinstance(req, oa.ChatCompletionRequest):
            parsers += [self._parsed(req, text) for _ in range(call.n - 1)]
        for each in parsers:
            if each is not None:
                each.rendered(call.prompt_ids)
        parsers += [None] * (call.n - len(parsers))
        fitted = text.fit(len(call.prompt_ids), oa.max_tokens_of(req))
        return Prepared(req, target, parsed, call, fitted, tuple(parsers))

    async def batch_line(self, caller: Caller, body: dict[str, Any], chat: bool, slot: GateSlot | BatchSlot) -> Any:
        """A batch line's answer body, as the online call would have answered it (200), run on
        ``slot`` (the dispatcher's; given back whatever happens): ``prepare``, then the
        pipeline's ``serve_batch``. A refusal or failure raises its BallastError."""
        try:
            p = self.prepare(body, chat, caller)
        except BaseException:
            slot.release()
            raise
        served = await self._pipeline.serve_batch(
            ModelRequest(caller, Criticality.SHEDDABLE, p.max_tokens, False, p.call), slot
        )
        answer_id = self.identity(p, chat, served.admission)
        response = self._answer(served, p, chat, answer_id, None, {})
        return json.loads(bytes(response.body))

    @staticmethod
    def identity(p: Prepared, chat: bool, admission: Admission) -> answers.Identity:
        """The answer's id and names: what was asked (an adapter as the request named it), or the fallback."""
        return answers.Identity(
            answers.new_id("chatcmpl" if chat else "cmpl"),
            int(time.time()),
            asked=(p.target.model, p.req.model),
            service_tier=admission.tier.value,
        )

    def _parse(self, data: dict[str, Any], chat: bool, caller: Caller) -> tuple[Parsed, Lane, Target]:
        """The body, the lane of the model it names and what the name means (404
        model_not_found for one the caller may not use), checked against that model."""
        req: Parsed = oa.parse_chat(data, self._limits) if chat else oa.parse_completion(data, self._limits)
        lane, target = self._pipeline.target(caller, req.model)
        lane.serves("generate", req.model, oa.BadRequest)
        oa.refuse_unhonoured(req, lane.backend)
        asked = oa.max_tokens_of(req)
        if asked is not None and asked > self._limits.max_tokens_limit:
            field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise oa.BadRequest(f"{field}: must be <= {self._limits.max_tokens_limit}", field=field)
        vocab = lane.text.vocab_size
        if req.top_k is not None and req.top_k > vocab:  # more is every token: a mistake
            raise oa.BadRequest(f"top_k: must be <= the model's vocabulary size {vocab}", field="top_k")
        beyond = [
            k for k in req.logit_bias or {} if not (k.isascii() and k.isdigit() and len(k) < 10) or int(k) >= vocab
        ]
        if beyond:
            raise oa.BadRequest(
                f"logit_bias: {beyond[0]!r} is not a token id of this model (0 to {vocab - 1})", field="logit_bias"
            )
        return req, lane, target

    @staticmethod
    def _prompt_ids(req: oa.CompletionRequest, text: ModelText) -> list[int]:
        """A prompt sent as token ids: each must be the model's (below its vocabulary)."""
        return oa.model_token_ids(req.prompt_ids or [], text.vocab_size, "prompt")

    def _parsed(self, req: oa.ChatCompletionRequest, text: ModelText) -> ParsedChat | None:
        """What the request asks of tools (``ballast.router.tool_calls``), and on the vLLM
        engine its parser (``ballast.router.chat_parsing``); 400 naming the field where it
        cannot be served."""
        parsing = text.parsing
        try:
            tools = plan(req.tools, req.tool_choice, req.parallel_tool_calls, parsing is not None and parsing.auto)
            if parsing is None or not (tools.tools or parsing.reasoning_parser):
                return None  # the other engines refused tools already (refuse_unhonoured)
            parsed = parsing.start(tools, req.template_kwargs)
            parsed.check(self._limits.schema_bounds())
        except ToolSchemaTooComplex as e:
            raise SchemaTooComplex(str(e), field=e.field) from None
        except ToolRequestError as e:
            raise oa.BadRequest(str(e), field=e.field) from None
        if parsed.forced and req.response_format is not None:
            raise oa.BadRequest(
                "response_format: a forced tool call's answer is the call; leave response_format out",
                field="response_format",
            )
        return parsed

    @staticmethod
    def to_call(
        req: Parsed, prompt: str, chat: bool, parsed: ParsedChat | None, text: ModelText, target: Target
    ) -> ModelCall:
        """The model call for the request: the prompt tokenized once by the model's text (a
        chat prompt holds its template's special tokens already; a raw prompt gets them),
        its stop strings (the model ends the row there; the front cuts too), its sampling;
        what vLLM's parser asks for the tools (the grammar of a call, the special tokens
        its markers are); the model and adapter it names."""
        schema, tag = parsed.guided() if parsed is not None else (None, None)
        keep = parsed.keep_special_tokens if parsed is not None else False
        sampling = oa.sampling_of(req, schema, keep_special_tokens=keep, structural_tag=tag)
        logprobs, prompt_logprobs = oa.logprobs_of(req)
        if oa.max_tokens_of(req) == 0:  # echo alone: the prompt is prefilled, for its log-probabilities
            prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else 0
        fields: dict[str, Any] = {
            "sampling": sampling,
            "stops": oa.stops_of(req),
            "model": target.model,
            "adapter": target.adapter,
            "n": req.n or 1,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        ids = req.prompt_ids if isinstance(req, oa.CompletionRequest) else None
        if ids is not None:
            return text.call_ids(ids, **fields)
        return text.call(prompt, add_special_tokens=not chat, **fields)

    @staticmethod
    def headers(admission: Admission) -> dict[str, str]:
        """What an answer's headers say of its admission: the class granted, the level, the
        tier that served it, and why it is less than asked."""
        headers = {
            "X-Ballast-Criticality": admission.criticality.value,
            "X-Ballast-Level": str(admission.level),
            TIER_HEADER: admission.tier.value,
        }
        if admission.degraded_reasons:
            headers["X-Ballast-Degraded"] = ",".join(admission.degraded_reasons)
        return headers

    @classmethod
    def _answer(
        cls,
        answer: Answer,
        p: Prepared,
        chat: bool,
        answer_id: answers.Identity,
        stream: oa.Streaming | None,
        headers: dict[str, str],
    ) -> Response:
        """A unary answer; or, asked as a stream at a level that does not stream, the
        whole answer as one stream event per choice."""
        headers = {**headers, **answer_headers(answer)}
        if stream is None:
            return JSONResponse(cls.answer_body(answer, p, chat, answer_id), headers=headers)
        ident, wholes, counts = cls._wholes(answer, p, chat, answer_id)
        events = answers.whole_stream(ident, chat, wholes, counts, stream)
        return Response(events, media_type="text/event-stream", headers=headers)

    @classmethod
    def answer_body(cls, answer: Answer, p: Prepared, chat: bool, answer_id: answers.Identity) -> dict[str, Any]:
        """A unary answer's body (chat's or completions' shape)."""
        ident, wholes, counts = cls._wholes(answer, p, chat, answer_id)
        return answers.chat_answer(ident, wholes, counts) if chat else answers.completion_answer(ident, wholes, counts)

    @classmethod
    def _wholes(
        cls, answer: Answer, p: Prepared, chat: bool, answer_id: answers.Identity
    ) -> tuple[answers.Ident, list[answers.Whole], answers.Counts]:
        settled = answer.settled
        a = answer.admission
        one = ChoiceResult(0, settled.text, settled.tokens, settled.finish_reason, settled.logprobs)
        wholes = [cls._whole(c, p, chat, a.max_tokens, settled.prompt_logprobs) for c in settled.choices or (one,)]
        counts = answers.Counts(a.prompt_tokens, settled.tokens, settled.cached_tokens)
        return answer_id.of(settled.model), wholes, counts

    @staticmethod
    def _whole(
        c: ChoiceResult, p: Prepared, chat: bool, max_tokens: int, prompt: tuple[TokenLogprob, ...] | None
    ) -> answers.Whole:
        """One choice of a unary answer: its text cut at a stop string, why it ended, what
        its parser reads in it (a chat answer's reasoning and tool calls, vLLM), its
        log-probabilities in the endpoint's shape; a completion with echo starts with the prompt."""
        text, stopped = cut_at_stop(c.text, p.call.stops)
        ended = answers.finish_reason(c.tokens, max_tokens, stopped or c.finish_reason == "stop")
        if chat:
            top = p.chat_logprobs
            logprobs = chat_logprobs(c.logprobs, top) if top is not None else None
            parsed = p.parsers[c.index]
            if parsed is None:
                return answers.Whole(c.index, text, ended, logprobs=logprobs)
            reasoning, content, calls, finish = parsed.answer(text, ended)
            return answers.Whole(c.index, content, finish, calls, reasoning, logprobs)
        k = p.req.logprobs
        echoed = prompt if p.echo else None
        wire = completion_logprobs(c.logprobs, k, 0, echoed).wire if k is not None else None
        return answers.Whole(c.index, p.call.prompt + text if p.echo else text, ended, logprobs=wire)

    async def _events(
        self, stream: Stream, p: Prepared, chat: bool, answer_id: answers.Identity, opts: oa.Streaming
    ) -> AsyncGenerator[bytes, None]:
        """The answer's events as the model writes them (``pieces``), each piece one event of
        its choice: its delta, its log-probabilities in the endpoint's shape (a completion's
        text offsets continued per choice), its finish; the usage last when asked, [DONE]."""
        a = stream.admission
        offsets = [0] * p.call.n

        def usage() -> answers.Counts:
            return answers.Counts(a.prompt_tokens, stream.tokens, stream.cached_tokens)

        try:
            if chat:
                for i in range(p.call.n):
                    chunk = answers.delta_chunk(
                        answer_id.of(stream.model),
                        chat,
                        {"content": ""},
                        role=True,
                        index=i,
                        usage=usage() if opts.running_usage else None,
                    )
                    yield answers.sse_data(chunk)
            async for piece in self.pieces(stream, p):
                wire: dict[str, Any] | None = None
                if p.chat_logprobs is not None and piece.logprobs:
                    wire = chat_logprobs(piece.logprobs, p.chat_logprobs)
                elif isinstance(p.req, oa.CompletionRequest) and p.req.logprobs is not None:
                    if piece.logprobs or piece.prompt_logprobs is not None:
                        wire, offsets[piece.index] = completion_logprobs(
                            piece.logprobs, p.req.logprobs, offsets[piece.index], piece.prompt_logprobs
                        )
                chunk = answers.delta_chunk(
                    answer_id.of(stream.model),
                    chat,
                    piece.delta,
                    piece.finish,
                    usage=usage() if opts.running_usage else None,
                    index=piece.index,
                    logprobs=wire,
                )
                yield answers.sse_data(chunk)
            if opts.final_usage:
                yield answers.sse_data(answers.usage_chunk(answer_id.of(stream.model), chat, usage()))
        except BallastError as err:
            yield answers.sse_data(answers.openai_error_body(err))
        finally:
            await stream.aclose()  # a client that left mid-stream: the model stops within a step
        yield answers.SSE_DONE

    async def pieces(self, stream: Stream, p: Prepared) -> AsyncGenerator[Piece, None]:
        """What the model writes, read as the answer's pieces: each choice apart (its stop
        strings; its parser when the request has one, vLLM's, reading content, reasoning and
        tool calls; its log-probabilities with the piece that brought them; an echo's prompt
        first), each choice ending with a piece of its finish (``delta`` None). The stream
        settles as answered once read to its end, or once a stop string completed every
        choice (the model is stopped then). Chat's and completions' events and the Responses
        API's are made from these."""
        a = stream.admission
        choices = [_StreamedChoice(StopScanner(p.call.stops), r.stream() if r and r.reads else None) for r in p.parsers]

        def ended(i: int) -> list[Piece]:
            c = choices[i]
            c.done = True
            out = []
            delta = c.read(c.scanner.finish(), (), True)
            if delta:
                out.append(Piece(i, delta))
            finish = answers.finish_reason(c.tokens, a.max_tokens, c.scanner.stopped or c.finish == "stop")
            out.append(Piece(i, None, c.reader.finish(finish) if c.reader is not None else finish))
            return out

        async for part in stream:
            c = choices[part.index]
            if c.done:  # a stop string ended it; the model stops it at its next step
                continue
            c.tokens += part.tokens
            c.finish = part.finish_reason or c.finish
            delta = c.read(c.scanner.feed(part.text), part.ids, False)
            prompt = part.prompt_logprobs if p.echo and not c.echoed else None
            if p.echo and not c.echoed:
                c.echoed = True
                delta = {"content": p.call.prompt + (delta or {}).get("content", "")}
            if delta or part.logprobs or prompt is not None:
                yield Piece(part.index, delta or {}, None, part.logprobs, prompt)
            if c.scanner.stopped or part.finish_reason is not None:
                for piece in ended(part.index):
                    yield piece
            if all(ch.done for ch in choices) and any(ch.scanner.stopped for ch in choices):
                stream.enough()  # a stop string completed the answer: the model stops now
                await stream.aclose()
                return
        for i, c in enumerate(choices):
            if not c.done:
                for piece in ended(i):
                    yield piece


@dataclass(frozen=True)
class Piece:
    """One piece of a streamed answer (``OpenAIFront.pieces``): choice ``index``'s ``delta``
    (chat's delta fields: content, reasoning_content, tool_calls; None: the choice's last
    piece, with its ``finish``), the log-probabilities of the tokens that brought it, and an
    echoed prompt's (its choice's first piece)."""

    index: int
    delta: dict[str, Any] | None
    finish: answers.FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class _StreamedChoice:
    """What a stream knows of one of its choices: its stop strings, its parser's reading,
    its tokens and the model's finish, whether it ended, its echo sent."""

    scanner: StopScanner
    reader: StreamedChat | None
    tokens: int = 0
    finish: str | None = None
    done: bool = False
    echoed: bool = False

    def read(self, text: str, ids: Sequence[int], last: bool) -> dict[str, Any] | None:
        if self.reader is None:
            return {"content": text} if text else None
        return self.reader.feed(text, ids, last)
