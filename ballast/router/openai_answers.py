"""The OpenAI protocol's answers: what Ballast's OpenAI-compatible front sends back.

The response models (the ones ``/openapi.json`` publishes), built and dumped with
``exclude_unset`` so that what is sent is what the contract publishes; the events of a
streamed answer and their SSE framing (``data: {chunk}`` ... ``data: [DONE]``); and
every refusal in OpenAI's error shape, Ballast's stable code as ``code``. It runs
nothing: ``ballast.router.openai`` builds its answers here from what the pipeline
returns; the requests' side of the protocol is ``openai_api``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field

from ballast.errors import BallastError, InvalidRequest
from ballast.router.openai_api import Streaming
from ballast.router.tool_calls import FunctionDelta, ToolCall, ToolCallDelta

SSE_DONE = b"data: [DONE]\n\n"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="Prompt tokens the engine took from its prefix cache: only ever what the "
        "caller's own cache group sent before."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="The text; null when the answer only calls tools.")
    reasoning_content: str | None = Field(
        None, description="The model's thinking (model.reasoning_parser), apart from its answer."
    )
    refusal: None = None
    tool_calls: list[ToolCall] | None = Field(None, description="The tools the model calls, when it calls any.")


#: Why an answer ended: a stop string or the end of sequence, max_tokens, or (chat) its tool calls.
FinishReason = Literal["stop", "length", "tool_calls"]
#: Why a completion ended: it calls no tools.
TextFinish = Literal["stop", "length"]
#: The tier that served an answer (``ballast.policies.flex.ServiceTier.served``), as OpenAI says it.
ServedTier = Literal["default", "flex", "priority"]
_TIER_FIELD = "The service tier that served the request: default, flex or priority."


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="Natural log; -9999.0 for a token the model rules out.")
    bytes: list[int] | None = Field(None, description="The token's UTF-8 bytes.")


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float = Field(description="Natural log; -9999.0 for a token the model rules out.")
    bytes: list[int] | None = Field(None, description="The token's UTF-8 bytes.")
    top_logprobs: list[TopLogprob] = Field(description="The likeliest tokens at this position (top_logprobs of them).")


class ChatLogprobs(BaseModel):
    """A chat choice's log-probabilities (``logprobs: true``), one per answer token."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's log-probabilities (``logprobs``: k), one entry per token, the
    echoed prompt's first (its first token's logprob null)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    """A unary answer of ``POST /v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"]
    created: int = Field(description="Unix time, seconds.")
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: ServedTier | None = Field(None, description=_TIER_FIELD)


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat answer; the last one, with include_usage, has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    service_tier: ServedTier | None = Field(None, description=_TIER_FIELD)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: TextFinish | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """An answer of ``POST /v1/completions``, unary or one streamed chunk (the same shape)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: ServedTier | None = Field(None, description=_TIER_FIELD)


class ModelCard(BaseModel):
    """One model or adapter, as vLLM lists them: ``root`` is the model itself (an
    adapter's: its own name), ``parent`` an adapter's base model (None for a model)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None


class ModelList(BaseModel):
    """The answer of ``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="OpenAI's error type, from the status.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str = Field(description="Ballast's stable error code, e.g. QUOTA_EXCEEDED.")


class ErrorResponse(BaseModel):
    """Every refusal of the OpenAI front; Retry-After, when there is one, is a header."""

    error: ErrorDetail


def new_id(prefix: str) -> str:
    """A fresh answer id, e.g. ``chatcmpl-`` and 24 hex digits."""
    return f"{prefix}-{secrets.token_hex(12)}"


def finish_reason(completion_tokens: int, max_tokens: int, stopped: bool) -> TextFinish:
    """ "length" when the answer used all of max_tokens without a stop string, else "stop"."""
    return "length" if not stopped and completion_tokens >= max_tokens else "stop"


# The answers below are the models above, built and dumped with ``exclude_unset``: a
# field is in the JSON when the answer sets it (``usage`` only where it is given), so
# what is sent is what the contract publishes and nothing can drift from it.


class Ident(NamedTuple):
    """What every event of one answer repeats: its id, its creation time, the model, and
    the tier that served it (None: not said)."""

    id: str
    created: int
    model: str
    service_tier: str | None = None

    def fields(self) -> dict[str, Any]:
        """The answer's fields it sets (``service_tier`` only when said)."""
        return {k: v for k, v in self._asdict().items() if v is not None}


class Identity(NamedTuple):
    """An answer's id and creation time, before the model that answers is known;
    ``asked``: (the model asked, the name the request gave it), so that an answer of that
    model carries the request's name (an adapter's: ``sql`` or ``llama:sql``, as vLLM
    answers), and a fallback's answer its own; ``service_tier``: the tier that served it."""

    id: str
    created: int
    asked: tuple[str, str] | None = None
    service_tier: str | None = None

    def of(self, model: str) -> Ident:
        if self.asked is not None and model == self.asked[0]:
            model = self.asked[1]
        return Ident(self.id, self.created, model, self.service_tier)


class Counts(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, from the engine's prefix cache

    def usage(self) -> Usage:
        p, c = self.prompt_tokens, self.completion_tokens
        details = PromptTokensDetails(cached_tokens=min(self.cached_tokens, p))
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, prompt_tokens_details=details)


@dataclass(frozen=True)
class Whole:
    """One choice of a whole answer: its text (a chat answer's content), why it ended, a
    chat answer's tool calls and reasoning, its log-probabilities (the wire object, None:
    not asked)."""

    index: int
    text: str | None
    finish: FinishReason
    calls: Sequence[ToolCall] = ()
    reasoning: str | None = None
    logprobs: dict[str, Any] | None = None


def chat_choice(whole: Whole) -> ChatChoice:
    extra: dict[str, Any] = {"tool_calls": list(whole.calls)} if whole.calls else {}
    if whole.reasoning is not None:
        extra["reasoning_content"] = whole.reasoning
    message = AssistantMessage(role="assistant", content=whole.text, refusal=None, **extra)
    logprobs = ChatLogprobs.model_validate(whole.logprobs) if whole.logprobs is not None else None
    return ChatChoice(index=whole.index, message=message, finish_reason=whole.finish, logprobs=logprobs)


def completion_choice(whole: Whole) -> CompletionChoice:
    logprobs = CompletionLogprobs.model_validate(whole.logprobs) if whole.logprobs is not None else None
    return CompletionChoice(
        index=whole.index, text=whole.text or "", finish_reason=_text_finish(whole.finish), logprobs=logprobs
    )


def chat_completion(
    ident: Ident,
    text: str | None,
    finish: FinishReason,
    counts: Counts,
    calls: Sequence[ToolCall] = (),
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A unary chat answer of one choice (``chat_answer`` for several)."""
    return chat_answer(ident, [Whole(0, text, finish, calls, reasoning)], counts)


def chat_answer(ident: Ident, choices: Sequence[Whole], counts: Counts) -> dict[str, Any]:
    body = ChatCompletion(
        **ident.fields(), object="chat.completion", choices=[chat_choice(w) for w in choices], usage=counts.usage()
    )
    return _dump(body)


def completion(ident: Ident, text: str, finish: TextFinish, counts: Counts) -> dict[str, Any]:
    """A unary completion of one choice (``completion_answer`` for several)."""
    return completion_answer(ident, [Whole(0, text, finish)], counts)


def completion_answer(ident: Ident, choices: Sequence[Whole], counts: Counts) -> dict[str, Any]:
    body = Completion(
        **ident.fields(),
        object="text_completion",
        choices=[completion_choice(w) for w in choices],
        usage=counts.usage(),
    )
    return _dump(body)


def stream_chunk(
    ident: Ident,
    chat: bool,
    piece: str | None,
    finish: FinishReason | None = None,
    role: bool = False,
    usage: Counts | None = None,
) -> ChatCompletionChunk | Completion:
    """One streamed event: a piece of text (None: the last event, with ``finish``)."""
    return delta_chunk(ident, chat, None if piece is None else {"content": piece}, finish, role, usage)


def delta_chunk(
    ident: Ident,
    chat: bool,
    delta: dict[str, Any] | None,
    finish: FinishReason | None = None,
    role: bool = False,
    usage: Counts | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> ChatCompletionChunk | Completion:
    """One streamed event of choice ``index``: ``delta`` (``ChunkDelta``'s fields: content,
    reasoning_content, tool_calls; None: the last event, with ``finish``), and the
    log-probabilities of the tokens it carries (the wire object; None: not asked).

    Chat deltas: ``{"role": "assistant", "content": ""}`` first (``role``), then the
    pieces, and ``{}`` with the finish reason last; a completion's text is the content.
    ``usage``: the usage so far, on every event when the client asked for it."""
    fields: dict[str, Any] = {} if usage is None else {"usage": usage.usage()}
    if chat:
        d = ChunkDelta.model_validate({**(delta or {}), **({"role": "assistant"} if role else {})})
        lp = ChatLogprobs.model_validate(logprobs) if logprobs is not None else None
        choice = ChunkChoice(index=index, delta=d, finish_reason=finish, logprobs=lp)
        return ChatCompletionChunk(**ident.fields(), object="chat.completion.chunk", choices=[choice], **fields)
    text = (delta or {}).get("content") or ""
    clp = CompletionLogprobs.model_validate(logprobs) if logprobs is not None else None
    text_choice = CompletionChoice(index=index, text=text, finish_reason=_text_finish(finish), logprobs=clp)
    return Completion(**ident.fields(), object="text_completion", choices=[text_choice], **fields)


def _text_finish(finish: FinishReason | None) -> TextFinish | None:
    """A completion's finish reason: never "tool_calls" (a completion calls no tools)."""
    if finish == "tool_calls":
        raise ValueError("finish_reason: a completion calls no tools")
    return finish


def usage_chunk(ident: Ident, chat: bool, counts: Counts) -> ChatCompletionChunk | Completion:
    """The last event when ``stream_options.include_usage``: no choices, the usage."""
    if chat:
        return ChatCompletionChunk(**ident.fields(), object="chat.completion.chunk", choices=[], usage=counts.usage())
    return Completion(**ident.fields(), object="text_completion", choices=[], usage=counts.usage())


def tool_calls_chunk(
    ident: Ident, calls: Sequence[ToolCall], usage: Counts | None = None, index: int = 0
) -> ChatCompletionChunk:
    """A streamed chat event carrying the answer's tool calls, each whole."""
    deltas = [
        ToolCallDelta(
            index=i, id=c.id, type=c.type, function=FunctionDelta(name=c.function.name, arguments=c.function.arguments)
        )
        for i, c in enumerate(calls)
    ]
    choice = ChunkChoice(index=index, delta=ChunkDelta(tool_calls=deltas), finish_reason=None, logprobs=None)
    fields: dict[str, Any] = {} if usage is None else {"usage": usage.usage()}
    return ChatCompletionChunk(**ident.fields(), object="chat.completion.chunk", choices=[choice], **fields)


def one_event_stream(
    ident: Ident,
    chat: bool,
    text: str | None,
    finish: FinishReason,
    counts: Counts,
    opts: Streaming,
    calls: Sequence[ToolCall] = (),
    reasoning: str | None = None,
) -> bytes:
    """A whole answer of one choice as a stream (``whole_stream`` for several)."""
    return whole_stream(ident, chat, [Whole(0, text, finish, calls, reasoning)], counts, opts)


def whole_stream(ident: Ident, chat: bool, choices: Sequence[Whole], counts: Counts, opts: Streaming) -> bytes:
    """A whole answer as a stream: for each choice its reasoning, text and log-probabilities
    in one event, its tool calls in the next (when it calls any), its finish; then the usage
    (when asked for), [DONE]."""
    running = counts if opts.running_usage else None
    events: list[BaseModel] = []
    for w in choices:
        first: dict[str, Any] = {"content": w.text or ""}
        if w.reasoning is not None:
            first["reasoning_content"] = w.reasoning
        events.append(delta_chunk(ident, chat, first, role=True, usage=running, index=w.index, logprobs=w.logprobs))
        if w.calls:
            events.append(tool_calls_chunk(ident, w.calls, running, w.index))
        events.append(delta_chunk(ident, chat, None, w.finish, usage=running, index=w.index))
    if opts.final_usage:
        events.append(usage_chunk(ident, chat, counts))
    return b"".join(sse_data(e) for e in events) + SSE_DONE


def _dump(answer: BaseModel) -> dict[str, Any]:
    return answer.model_dump(mode="json", exclude_unset=True)


def sse_data(event: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event as OpenAI sends it: a data line, no event name."""
    if isinstance(event, BaseModel):
        return b"data: " + event.model_dump_json(exclude_unset=True).encode() + b"\n\n"
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def models_list(listed: Sequence[tuple[str, str | None]], created: int) -> dict[str, Any]:
    """``GET /v1/models``: each (id, parent) the caller may use."""
    cards = [
        ModelCard(id=name, object="model", created=created, owned_by="ballast", root=name, parent=parent)
        for name, parent in listed
    ]
    return _dump(ModelList(object="list", data=cards))


# ------------------------------------------------------------------------------- errors


def openai_error_body(err: BallastError) -> dict[str, Any]:
    """``err`` in OpenAI's shape: its four keys exactly, Ballast's code as ``code``."""
    param = (err.field or None) if isinstance(err, InvalidRequest) else None
    return {"error": {"message": err.message, "type": _error_type(err), "param": param, "code": err.code}}


def _error_type(err: BallastError) -> str:
    if err.status == 503:
        return "overloaded_error" if err.code == "OVERLOADED" else "service_unavailable_error"
    return _ERROR_TYPES.get(err.status, "api_error")
