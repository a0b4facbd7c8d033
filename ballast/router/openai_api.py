"""The OpenAI protocol's requests: the bodies Ballast's OpenAI-compatible front accepts.

``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` speak
the OpenAI API so that every OpenAI client works against Ballast unchanged. The
protocol is two modules that run nothing: this one, the requests (what a body may
hold, its bounds, the sampling and stops it asks for, the built-in chat template), and
``openai_answers``, the answers (their exact shapes, the SSE framing, the error body).
The routes parse with ``parse_chat`` / ``parse_completion``, hand one request to the
same pipeline as ``/v1/generate``, and build their answers from ``openai_answers``'
response models (the ones ``/openapi.json`` publishes).

Requests. A field Ballast does not serve is refused with 400 naming it, never
ignored: a client that sends ``store`` (or ``tools`` to an engine without tool
calling) expects their effect, and an answer without it would look like the model's
fault. A field set to its neutral value
(``store: false``, ``presence_penalty: 0``, any field ``null``) asks for nothing and
passes. Unknown fields (typos) are refused too.

Log-probabilities and choices: chat's ``logprobs: true`` with ``top_logprobs`` 0-20,
completions' ``logprobs`` 0-20 (OpenAI's bound is 5; vLLM's and Ballast's 20) and
``echo`` (the prompt's own log-probabilities; ``max_tokens: 0`` only with echo), ``n``
up to ``limits.max_choices``; a completions prompt may be token ids (one prompt).

The built-in model's chat template (``render_chat``), one block per message and an
open assistant block for the model to continue::

    <|system|>
    You are terse.
    <|user|>
    Hi
    <|assistant|>

``developer`` messages render as ``system``. A Hugging Face model brings its own
tokenizer's template; the router picks the renderer, this one is the default.

Bounds. Every field is bounded in size and in the work it causes (docs/api.md,
"Limits"): the models below carry the fixed bounds (OpenAI's: 4 stop strings, 128
tools; a seed within int64; finite sampling values), ``check_limits`` the configured
ones (``limits``: a stop's length, a schema's nesting, nodes, patterns, counts and
literals: ``ballast.policies.schema``). A schema past its
bounds is 400 ``SCHEMA_TOO_COMPLEX`` naming ``response_format`` or ``tools``; an earlier
tool call's ``arguments`` (JSON text the template decodes) nest at most as the body; any
other bound, 400 ``INVALID_REQUEST`` naming the field. A temperature below
``GREEDY_BELOW_TEMPERATURE`` is served as 0 (greedy).

Stop strings go to the model, which ends the row where one completes (no step spent
past it), and the front cuts what it sends as well (``ballast.stops``: a stop can
straddle two streamed chunks, and a fallback may not know stops). A stop string ends
the answer where it *completes* first, so a stream and a unary answer cut the same
text at the same place whatever the chunking.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ballast.config import LimitsConfig
from ballast.errors import InvalidRequest, SchemaTooComplex
from ballast.model.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from ballast.policies.criticality import Criticality
from ballast.policies.engines import unhonoured_request_fields
from ballast.policies.json_bounds import json_extent, json_nesting
from ballast.policies.sampling import MAX_SEED, MIN_SEED, sampling_temperature
from ballast.policies.schema import bounded_numbers, schema_fault
from ballast.router.metadata import metadata_fault
from ballast.router.tool_calls import MAX_TOOLS, ToolCall, ToolChoice, ToolSpec

# OpenAI fields Ballast knows and does not serve, each with the one value that asks
# for nothing (None: only absent or null). One table for both endpoints: a field of
# the other endpoint is refused just as clearly.
_UNSUPPORTED: dict[str, Any] = {
    "functions": None,
    "function_call": None,
    "best_of": 1,
    "suffix": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "store": False,
    "web_search_options": None,
}


class BadRequest(InvalidRequest):
    """An invalid OpenAI request: 400, as OpenAI clients expect, with the native code."""

    status = 400


# ---------------------------------------------------------------------------- requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """One part of a message's content; only text parts are served."""

    type: str = Field(description="Always 'text'.")
    text: str = Field(description="The part's text.")

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise PydanticCustomError("part_type", "only 'text' parts are served; got {got}", {"got": repr(v[:40])})
        return v


_TEXT_PARTS = TypeAdapter(list[TextPart])
_STOP = Annotated[str, Field(min_length=1)]
MAX_STOPS = 4  # OpenAI's limit; each stop's length is limits.max_stop_chars
MAX_TEMPLATE_KWARGS = 16  # chat_template_kwargs' variables
_TEMPLATE_VARIABLE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# apply_chat_template's own arguments and the template's inputs: a request sets none of them
# (a chat_template of its own least of all).
_TEMPLATE_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "raise_exception",
        "strftime_now",
    }
)
MAX_MESSAGES = 2048
MAX_PROMPT_IDS = 1 << 17  # a token-id prompt's ids (the model's context bounds it further)
_STOP_LIST = Annotated[list[_STOP], Field(max_length=MAX_STOPS)]
_ONE_STOP, _STOPS = TypeAdapter(_STOP), TypeAdapter(_STOP_LIST)


# The str-or-list fields below are checked by before-validators rather than by their
# unions, so that an error names the field's path (``messages.1.content.0.type``), not
# a union branch (``messages.1.content.list[TextPart].0.type``); the unions stay in the
# type for the OpenAPI document.


def _join_text_parts(value: Any) -> Any:
    """A list of text parts becomes their joined text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(part.text for part in _TEXT_PARTS.validate_python(value))
    raise PydanticCustomError("content_type", "must be a string or a list of text parts")


def _one_prompt(value: Any) -> Any:
    """A prompt is a string, a list holding exactly one string, token ids (a list of ints),
    or a list holding exactly one list of token ids (several prompts are not served)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
        if isinstance(value, str):
            return value
    if _token_ids(value):
        return value
    raise PydanticCustomError(
        "prompt_type", "must be a string, token ids, or a list holding exactly one of either (one prompt)"
    )


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and 0 < len(value) <= MAX_PROMPT_IDS
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in value)
    )


def _stop_value(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        return _ONE_STOP.validate_python(value)
    if isinstance(value, list):
        return _STOPS.validate_python(value)
    raise PydanticCustomError("stop_type", "must be a string or a list of at most 4 non-empty strings")


class ChatMessage(_Strict):
    """One message of the conversation. After validation ``content`` is a str, or None
    in an assistant message that only calls tools."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who speaks; 'developer' is treated as 'system'; 'tool' is a tool's result "
        "(the vLLM engine). The deprecated 'function' role is not served."
    )
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_join_text_parts)] = Field(
        None,
        description="The text, or a list of text parts (joined); may be null in an assistant message with tool_calls.",
    )
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls of tools.")
    tool_call_id: str | None = Field(None, min_length=1, max_length=256, description="A tool message's call, answered.")

    @field_validator("role", mode="before")
    @classmethod
    def _no_function_role(cls, v: Any) -> Any:
        if v == "function":
            raise PydanticCustomError("role_function", "role 'function' is not served (deprecated); use 'tool'")
        return v

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        # "field" names the field at fault: the error's path ends there (``_parse``).
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("role_field", "tool_calls are an assistant message's", {"field": "tool_calls"})
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise PydanticCustomError(
                "role_field", "a tool message has a tool_call_id, and only a tool message", {"field": "tool_call_id"}
            )
        if self.content is None and not self.tool_calls:
            raise PydanticCustomError(
                "role_field",
                "must be a string or a list of text parts (null only in an assistant message with tool_calls)",
                {"field": "content"},
            )
        return self

    @property
    def calls_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)


class StreamOptions(_Strict):
    """Options of a streamed answer."""

    include_usage: bool = Field(False, description="Send a last chunk with the usage and no choices.")
    continuous_usage_stats: bool = Field(False, description="vLLM's extension: every chunk carries the usage so far.")


class JsonSchemaFormat(_Strict):
    """The schema the answer must follow (``response_format.json_schema``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The schema's name.")
    description: str | None = Field(None, max_length=1024, description="What the answer is for.")
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema, as an object.")
    strict: bool | None = Field(None, description="Follow the schema exactly (the engine always does).")


class ResponseFormat(_Strict):
    """The answer's format: text, any JSON object, or JSON following a schema. The
    vLLM engine honours it by guided decoding; the others refuse anything but text."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="text, json_object or json_schema.")
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema, and only then.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema is given with type json_schema, and only then")
        return self

    def schema_text(self) -> str | None:
        """The JSON Schema the answer must follow, as JSON text, its numbers bounded
        (``bounded_numbers``); None for text."""
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.json_schema is not None:
            return json.dumps(bounded_numbers(self.json_schema.schema_), separators=(",", ":"))
        return None


class _Sampling(_Strict):
    """What both endpoints share: the model, the length, sampling, streaming, Ballast's criticality."""

    model: str = Field(min_length=1, max_length=256, description="The served model's name (GET /v1/models lists them).")
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="At most this many tokens are generated (limits.max_tokens_limit); 0 only with echo "
        "(the prompt's log-probabilities alone).",
    )
    temperature: float | None = Field(
        None, ge=0, le=2, allow_inf_nan=False, description="Sampling temperature, 0 to 2; below 1e-5 it is 0 (greedy)."
    )
    top_p: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description="Nucleus sampling mass, above 0 and at most 1."
    )
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED, description="Seed for reproducible sampling: an int64.")
    stop: Annotated[_STOP | _STOP_LIST | None, BeforeValidator(_stop_value)] = Field(
        None, description="A string, or up to 4 strings, that end the answer (not included in it)."
    )
    stream: bool = Field(False, description="Answer as server-sent events, ending with 'data: [DONE]'.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    user: str | None = Field(None, max_length=256, description="The end user's id, for abuse tracking.")
    # vLLM's extensions, which the tools that measure LLM servers send (guidellm, vllm bench).
    ignore_eos: bool = Field(False, description="vLLM's extension: go on past the end-of-sequence token.")
    min_tokens: int = Field(
        0, ge=0, description="vLLM's extension: no end of sequence before this many tokens (at most max_tokens)."
    )
    top_k: int | None = Field(
        None,
        ge=-1,
        description="vLLM's extension: sample among the k likeliest; 0 or -1: all; at most the vocabulary's size.",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=2,
        allow_inf_nan=False,
        description="vLLM's extension: above 1 penalises repeated tokens; 1 is neutral.",
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, allow_inf_nan=False, description="-2 to 2: above 0 favours tokens not yet used (vLLM)."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, allow_inf_nan=False, description="-2 to 2: above 0 penalises tokens by their count (vLLM)."
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="Token id (as a string key) to a bias of -100 to 100 added to its logit (vLLM).",
    )
    response_format: ResponseFormat | None = Field(
        None, description="The answer's format: text, json_object or json_schema (the vLLM engine)."
    )
    n: int | None = Field(
        None, ge=1, description="Choices per request, each a row at the model (at most limits.max_choices)."
    )
    criticality: Criticality | None = Field(
        None,
        description="Ballast extension: how much the request matters under overload, as the "
        "X-Ballast-Criticality header (both must agree); default critical, lowered to the "
        "tenant's cap when above it.",
    )
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = Field(
        None,
        description="'auto'/'default': the class claimed (criticality); 'priority' ('fast'): the tenant's "
        "cap; 'flex': sheddable, held (not refused) until spare capacity or its deadline "
        "(X-Request-Timeout-Ms, else batch.flex_max_wait_s). 'flex' and 'priority' take no criticality claim.",
    )

    @field_validator("temperature")
    @classmethod
    def _greedy_below_the_floor(cls, v: float | None) -> float | None:
        return None if v is None else sampling_temperature(v)

    @field_validator("response_format")
    @classmethod
    def _text_asks_for_nothing(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        return None if v is not None and v.type == "text" else v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and info.data.get("stream") is not True:
            raise PydanticCustomError("stream_options", "only allowed when stream is true")
        return v


class ChatCompletionRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``."""

    logprobs: bool | None = Field(None, description="Each answer token's log-probability (choices[].logprobs).")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="With logprobs: this many likeliest tokens at each position, with theirs (0-20).",
    )

    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_MESSAGES, description="The conversation so far, oldest first."
    )
    tools: list[ToolSpec] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="Functions the model may call (the vLLM engine; ballast.router.tool_calls).",
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="'none', 'auto' (the default with tools; needs model.tool_parser), 'required', "
        "or a named function.",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call with 'required'.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        max_length=MAX_TEMPLATE_KWARGS,
        description='Variables for the model\'s chat template, e.g. {"enable_thinking": false} (the '
        "transformers and vLLM engines); lower-case names, none of the template call's own.",
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="The newer name of max_tokens; both given, they must agree."
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description="To the model's chat template as reasoning_effort (and enable_thinking: not 'none'), as vLLM "
        "passes it (the transformers and vLLM engines).",
    )
    metadata: dict[str, str] | None = Field(
        None,
        max_length=16,
        description="OpenAI's: up to 16 pairs; accepted and not kept (a chat answer is not stored).",
    )

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: ``chat_template_kwargs``, with ``reasoning_effort``
        and, unless the request set it, ``enable_thinking`` (vLLM's chat protocol's rule)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        own = self.chat_template_kwargs or {}
        return {"enable_thinking": self.reasoning_effort != "none", **own, "reasoning_effort": self.reasoning_effort}

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        fault = metadata_fault(v) if v else None
        if fault is not None:
            raise PydanticCustomError("metadata", fault.removeprefix("metadata: "))
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in v or {}:
            special = name.endswith(("_token", "_tokens"))
            if not _TEMPLATE_VARIABLE.fullmatch(name) or name in _TEMPLATE_RESERVED or special:
                raise PydanticCustomError(
                    "template_variable",
                    "{name} is not a chat template variable a request may set (lower-case, not one of the "
                    "template call's own arguments nor a special token)",
                    {"name": repr(name[:64])},
                )
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees_with_max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise PydanticCustomError(
                "max_tokens_conflict",
                "{v} disagrees with max_tokens {other}; send one of them",
                {"v": v, "other": other},
            )
        return v


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``."""

    prompt: Annotated[
        str | list[int] | Annotated[list[str | list[int]], Field(min_length=1, max_length=1)],
        BeforeValidator(_one_prompt),
    ] = Field(
        description="The text to continue: a string, or token ids of the model's tokenizer, or a list holding "
        "exactly one of either. After validation a str or a list of ints."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        strict=True,
        description="The log-probability of each token, and this many likeliest at each position (0-20).",
    )
    echo: bool = Field(False, description="The prompt first in the answer's text (and its log-probabilities).")

    @property
    def prompt_text(self) -> str:
        """The prompt as text (``_one_prompt`` made it a str, or ids: ``prompt_ids``)."""
        return self.prompt if isinstance(self.prompt, str) else ""

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids as sent (None: a text prompt)."""
        return self.prompt if isinstance(self.prompt, list) else None  # type: ignore[return-value]


_DEFAULT_LIMITS = LimitsConfig()
_Request = TypeVar("_Request", bound=_Sampling)


def parse_chat(data: Any, limits: LimitsConfig = _DEFAULT_LIMITS) -> ChatCompletionRequest:
    """A decoded body as a chat request within ``limits``, or ``BadRequest`` naming the field."""
    return _parse(ChatCompletionRequest, data, limits)


def parse_completion(data: Any, limits: LimitsConfig = _DEFAULT_LIMITS) -> CompletionRequest:
    """A decoded body as a completion request within ``limits``, or ``BadRequest`` naming the field."""
    return _parse(CompletionRequest, data, limits)


def _parse(model: type[_Request], data: Any, limits: LimitsConfig) -> _Request:
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object", field="body")
    try:
        req = model.model_validate(_served_fields(data))
    except ValidationError as e:
        first = e.errors()[0]
        loc = (*first["loc"], first["ctx"]["field"]) if first["type"] == "role_field" else first["loc"]
        field = ".".join(str(p) for p in loc) or "body"
        if field == "tools" and first["type"] == "too_long":
            raise SchemaTooComplex(f"tools: at most {MAX_TOOLS} tools", field="tools") from None
        reason = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise BadRequest(f"{field}: {reason}", field=field) from None
    most = max_tokens_of(req)
    if most == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        raise BadRequest(
            "max_tokens: must be >= 1 (0 only with echo: the prompt's log-probabilities)", field="max_tokens"
        )
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs: needs logprobs true", field="top_logprobs")
    if most is not None and req.min_tokens > most:
        raise BadRequest(
            f"min_tokens: {req.min_tokens} is above the maximum of {most} tokens asked for", field="min_tokens"
        )
    check_limits(req, limits)
    return req


def check_limits(req: _Sampling, limits: LimitsConfig) -> None:
    """The configured bounds (the module docstring): ``BadRequest`` or ``SchemaTooComplex`` naming the field."""
    if req.min_tokens > limits.max_tokens_limit:
        raise BadRequest(f"min_tokens: must be <= {limits.max_tokens_limit}", field="min_tokens")
    if req.n is not None and req.n > limits.max_choices:
        raise BadRequest(f"n: at most {limits.max_choices} choices a request (limits.max_choices)", field="n")
    longest = max((len(s) for s in stops_of(req)), default=0)
    if longest > limits.max_stop_chars:
        raise BadRequest(
            f"stop: a stop string of {longest} characters; the limit is {limits.max_stop_chars}", field="stop"
        )
    if req.response_format is not None and req.response_format.json_schema is not None:
        fault = schema_fault(limits.schema_bounds(), req.response_format.json_schema.schema_)
        if fault is not None:
            raise SchemaTooComplex(f"response_format: the schema {fault}", field="response_format")
    if isinstance(req, ChatCompletionRequest):
        if req.chat_template_kwargs:
            extent = json_extent(req.chat_template_kwargs)
            if extent.depth > limits.max_json_depth or extent.nodes > limits.max_schema_nodes:
                raise BadRequest(
                    f"chat_template_kwargs: nests {extent.depth} deep with {extent.nodes} values; the limits are "
                    f"{limits.max_json_depth} and {limits.max_schema_nodes}",
                    field="chat_template_kwargs",
                )
        if req.tools:
            _check_tools(req.tools, limits)
        _check_call_arguments(req.messages, limits)


def _check_call_arguments(messages: Sequence[ChatMessage], limits: LimitsConfig) -> None:
    """Earlier calls' arguments are JSON text that the chat template is given decoded:
    nested at most ``max_json_depth``, as the body itself."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or ()):
            depth = json_nesting(call.function.arguments)
            if depth > limits.max_json_depth:
                field = f"messages.{i}.tool_calls.{j}.function.arguments"
                raise BadRequest(f"{field}: nested {depth} deep; the limit is {limits.max_json_depth}", field=field)


def _check_tools(tools: Sequence[ToolSpec], limits: LimitsConfig) -> None:
    """Each tool's parameters nested at most ``max_schema_depth``; all of them together
    within the other schema bounds (``ballast.policies.schema``: what tool_choice
    "required" compiles at once)."""
    schemas = []
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is None:
            continue
        extent = json_extent(params)
        if extent.depth > limits.max_schema_depth:
            raise SchemaTooComplex(
                f"tools: tool {i}'s parameters nest {extent.depth} deep; the limit is {limits.max_schema_depth}",
                field="tools",
            )
        schemas.append(params)
    fault = schema_fault(limits.schema_bounds(), *schemas)
    if fault is not None:
        raise SchemaTooComplex(f"tools: the tools' parameters taken as one schema {fault}", field="tools")


def refuse_unhonoured(req: _Sampling, engine: str) -> None:
    """400 naming the first field ``req`` asks of an engine that cannot honour it (tool
    calls and results in the messages are asked of the engine that calls tools)."""
    limits = unhonoured_request_fields(engine)  # ballast.policies.engines' one table
    for name, neutral in limits.items():
        value = getattr(req, name, None)
        if value is not None and value != neutral:
            allowed = "leave it out" if neutral is None else f"leave it out or send {neutral}"
            raise BadRequest(f"{name}: not honoured by the {engine!r} engine; {allowed}", field=name)
    if "tools" in limits and isinstance(req, ChatCompletionRequest):
        for i, m in enumerate(req.messages):
            if m.calls_tools:
                field = f"messages.{i}.{'role' if m.role == 'tool' else 'tool_calls'}"
                raise BadRequest(
                    f"{field}: tool calls and results are not honoured by the {engine!r} engine", field=field
                )


def sampling_of(
    req: _Sampling,
    json_schema: str | None = None,
    keep_special_tokens: bool = False,
    structural_tag: str | None = None,
) -> Any:
    """The model's sampling for the request (``protocol.RowSampling``), or None when it
    asks for none (every field at its neutral value: the engine decodes greedily).
    ``json_schema`` or ``structural_tag`` (the grammar vLLM's parser built for the tools,
    else ``response_format``'s schema) and ``keep_special_tokens`` (the parser reads
    markers that are special tokens) come from the request's parser. A value the
    sampling refuses is ``EngineRefused`` naming its field."""
    from ballast.model.protocol import RowSampling

    fields: dict[str, Any] = {"temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0:  # 1 is neutral
        fields["repetition_penalty"] = req.repetition_penalty
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):  # None and 0 are neutral
            fields[name] = getattr(req, name)
    if req.logit_bias:
        fields["logit_bias"] = req.logit_bias
    if req.top_k is not None and req.top_k > 0:
        fields["top_k"] = req.top_k
    fields["min_tokens"], fields["ignore_eos"] = req.min_tokens, req.ignore_eos
    if structural_tag is not None:
        fields["structural_tag"], fields["json_schema_of"] = structural_tag, "tools"
    elif json_schema is not None:
        fields["json_schema"], fields["json_schema_of"] = json_schema, "tools"
    elif req.response_format is not None:
        fields["json_schema"] = req.response_format.schema_text()
    fields["keep_special_tokens"] = keep_special_tokens
    if req.seed is None and not any(v for k, v in fields.items() if k != "seed"):
        return None
    return RowSampling.of(fields)


def _served_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` less the unsupported fields that ask for nothing; ``BadRequest`` for one that asks."""
    if data.get("cache_salt") is not None:  # vLLM's field: here the tenant's key decides it
        raise BadRequest(
            "cache_salt: set by Ballast from the tenant's cache group (tenants.<name>.cache_group); leave it out",
            field="cache_salt",
        )
    for name, neutral in _UNSUPPORTED.items():
        value = data.get(name)
        if value is not None and not _same(value, neutral):
            allowed = "leave it out" if neutral is None else f"leave it out or send {json.dumps(neutral)}"
            raise BadRequest(f"{name}: not supported by Ballast; {allowed}", field=name)
    return {k: v for k, v in data.items() if k not in _UNSUPPORTED}


def _same(value: Any, neutral: Any) -> bool:
    # bool is an int in Python: logprobs=0 (a count on /v1/completions) is not false.
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def model_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    """Token ids a client sent (a prompt, an embeddings input), each the model's: below its
    vocabulary, else 400 naming ``field``."""
    beyond = next((i for i in ids if i >= vocab_size), None)
    if beyond is not None:
        raise BadRequest(f"{field}: {beyond} is not a token id of this model (0 to {vocab_size - 1})", field=field)
    return list(ids)


def logprobs_of(req: _Sampling) -> tuple[int | None, int | None]:
    """(k likeliest for each answer token, k for each prompt position): None where the
    request asks for none. Chat: ``logprobs: true`` with ``top_logprobs`` (default 0);
    completions: ``logprobs`` k, and with ``echo`` the prompt's too."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0 if req.logprobs else None), None
    if isinstance(req, CompletionRequest):
        return req.logprobs, req.logprobs if req.echo and req.logprobs is not None else None
    return None, None


def max_tokens_of(req: _Sampling) -> int | None:
    """The requested length: max_completion_tokens, else max_tokens, else None."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def stops_of(req: _Sampling) -> tuple[str, ...]:
    """The request's stop strings, however it sent them."""
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The built-in model's prompt for a conversation (template in the module docstring)."""
    blocks = [f"<|{'system' if m.role == 'developer' else m.role}|>\n{m.content}\n" for m in messages]
    return "".join(blocks) + "<|assistant|>\n"


@dataclass(frozen=True)
class Streaming:
    """What a streamed answer carries besides its text: the usage in a last chunk
    (``include_usage``), and the usage so far in every chunk (``continuous_usage_stats``)."""

    final_usage: bool = False
    running_usage: bool = False

    @classmethod
    def of(cls, req: _Sampling) -> Streaming:
        o = req.stream_options
        return cls(bool(o and o.include_usage), bool(o and o.continuous_usage_stats))
