"""The Responses API's requests: the body ``POST /v1/responses`` accepts, bounded.

The Responses API is served through the same pipeline as chat: ``responses_items``
turns a request into the chat-completions body ``openai_api.parse_chat`` accepts, and
the answer back into Responses output items; ``responses_events`` does the same for a
stream. This module only says what a body may hold, in ``openai_api``'s manner: a
strict model (unknown fields refused), every field bounded, and each fault a
``BadRequest`` (400) naming the field by its path (``input.3.call_id``,
``tools.0.type``, ``text.format.name``).

What a body may hold (OpenAI's fields; vLLM's own Responses request is the reference
for what an engine serves):

* ``input``: a string (one user message), or a list of items, at most ``max_items``
  (a configured bound): ``message`` items (role user, system, developer or assistant;
  content a string or ``input_text`` / ``output_text`` parts; the ``type`` may be left
  out, as the openai-agents SDK does), ``function_call`` items (a call made earlier:
  call_id, name, arguments), ``function_call_output`` items (its result), and
  ``reasoning`` items, accepted and not shown to the model (an engine's reasoning is
  not replayed to its template; encrypted reasoning, which vLLM refuses, is refused).
  Any other item (``web_search_call``, ``item_reference``, images, files) is a 400
  naming the item's ``type``.
* ``instructions`` (a system message first; not carried over a chain of responses),
  ``tools`` (function tools only, at most ``MAX_TOOLS``), ``tool_choice``,
  ``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema),
  ``reasoning.effort`` (to the chat template, as vLLM passes it), ``max_output_tokens``,
  ``temperature``, ``top_p``, ``top_logprobs`` (0-20; the log-probabilities come with
  ``include: ["message.output_text.logprobs"]``, as OpenAI and vLLM send them),
  ``truncation`` ("disabled" only), ``store``, ``previous_response_id``, ``metadata``
  (OpenAI's bounds: ``ballast.router.metadata``), ``user``, ``service_tier``, ``stream``
  and Ballast's ``criticality``.
* Refused with 400 naming them: ``background``, ``conversation``, ``prompt`` and the
  other OpenAI fields Ballast does not serve (``_UNSERVED``; each passes at its neutral
  value), ``reasoning.summary``, ``text.verbosity``, tools other than functions.

Bounds: the fixed ones are in the models (ids and names as chat's, ``include`` at most
``MAX_INCLUDE`` values, metadata as OpenAI); the configured ones (``limits``: a schema's
nesting, nodes, patterns and literals; an earlier call's arguments nesting at most as the
body) are checked by ``check_limits`` on the Responses fields, so a fault names
``text.format`` or ``tools`` rather than the chat field they become. Text and the lists
inside an item are bounded by the body's size (``limits.max_body_bytes``), as on chat.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ballast.config import LimitsConfig
from ballast.errors import SchemaTooComplex
from ballast.model.protocol import MAX_TOP_LOGPROBS
from ballast.policies.criticality import Criticality
from ballast.policies.json_bounds import json_extent, json_nesting
from ballast.policies.schema import schema_fault
from ballast.router.metadata import MAX_METADATA_PAIRS, metadata_fault
from ballast.router.openai_api import BadRequest
from ballast.router.tool_calls import MAX_TOOLS

__all__ = [
    "DEFAULT_MAX_ITEMS",
    "BadRequest",
    "LOGPROBS_INCLUDE",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "MessageItem",
    "NamedFunction",
    "ReasoningItem",
    "ResponsesRequest",
    "TextFormat",
    "check_limits",
    "parse_responses",
]

DEFAULT_MAX_ITEMS = 256  # input items a request may hold, unless the caller configures another bound
MAX_INCLUDE = 8
MAX_ID_CHARS = 256  # an item's id, a call's call_id (chat's tool_call_id bound)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{1,64}$")
_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # chat's (tool_calls.FunctionSpec)
_ID = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
_ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]

# OpenAI fields Ballast knows and does not serve, each with the one value that asks for
# nothing (None: only absent or null), as ``openai_api``'s table for chat.
_UNSERVED: dict[str, Any] = {
    "background": False,
    "conversation": None,
    "prompt": None,
    "max_tool_calls": None,
    "prompt_cache_key": None,
    "prompt_cache_retention": None,
    "safety_identifier": None,
    "context_management": None,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _not_served(what: str) -> Any:
    """A before-validator refusing any value but null, naming what is not served."""

    def check(value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError(
                "not_served", "not served by Ballast; leave it out or send null ({what})", {"what": what}
            )
        return value

    return BeforeValidator(check)


# ------------------------------------------------------------------------------- input


class TextPart(_Strict):
    """One text part of a message's content, or of a tool's output."""

    type: Literal["input_text", "output_text"] = Field(description="input_text, or output_text (an answer replayed).")
    text: str = Field(description="The part's text.")
    # What an output_text part of an earlier answer carries; replayed by clients, not read.
    annotations: list[dict[str, Any]] | None = Field(None, description="An answer's annotations (not read).")
    logprobs: list[dict[str, Any]] | None = Field(None, description="An answer's log-probabilities (not read).")

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v not in ("input_text", "output_text"):
            raise PydanticCustomError(
                "part_type",
                "only text parts are served (input_text, output_text); got {got}",
                {"got": repr(v)[:40]},
            )
        return v


def _as_parts(value: Any) -> Any:
    """A string is one text part (the error paths of a list then name its part)."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if isinstance(value, list):
        return value
    raise PydanticCustomError("content_type", "must be a string or a list of text parts")


_Parts = Annotated[list[TextPart], BeforeValidator(_as_parts)]


def joined(parts: Sequence[TextPart]) -> str:
    """The text of ``parts``, joined (as chat joins a message's text parts)."""
    return "".join(p.text for p in parts)


class MessageItem(_Strict):
    """A message: the user's, the system's or developer's, or an assistant's answer replayed."""

    type: Literal["message"] = Field("message", description="Always 'message'; may be left out.")
    role: Literal["user", "system", "developer", "assistant"] = Field(description="Who speaks.")
    content: _Parts = Field(description="The text, or a list of input_text / output_text parts (joined).")
    id: _ID | None = Field(None, description="An answer's id, replayed (not read).")
    status: _ITEM_STATUS | None = Field(None, description="An answer's status, replayed (not read).")

    @property
    def text(self) -> str:
        return joined(self.content)


class FunctionCallItem(_Strict):
    """A call of a function tool the model made earlier."""

    type: Literal["function_call"]
    call_id: _ID = Field(description="The call's id; its result names it.")
    name: str = Field(pattern=_FUNCTION_NAME, description="The function called.")
    arguments: str = Field(description="The arguments, as JSON text.")
    id: _ID | None = Field(None, description="The item's id, replayed (not read).")
    status: _ITEM_STATUS | None = Field(None, description="The item's status, replayed (not read).")


class FunctionCallOutputItem(_Strict):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: _ID = Field(description="The call answered.")
    output: _Parts = Field(description="The result: a string or a list of input_text parts (joined).")
    id: _ID | None = Field(None, description="The item's id, replayed (not read).")
    status: _ITEM_STATUS | None = Field(None, description="The item's status, replayed (not read).")

    @property
    def text(self) -> str:
        return joined(self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier answer's reasoning, replayed: accepted, and not shown to the model."""

    type: Literal["reasoning"]
    id: _ID | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[None, _not_served("encrypted reasoning")] = None
    status: _ITEM_STATUS | None = None


class _UnservedItem(_Strict):
    """Any other item: refused, naming its type."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise PydanticCustomError("item_type", "an input item must be an object")
        kind = v.get("type")
        if kind is None:
            raise PydanticCustomError(
                "item_field",
                "an item has a type (message, function_call, function_call_output, reasoning) or a role",
                {"field": "type"},
            )
        raise PydanticCustomError(
            "item_field",
            "item type {got} is not served (message, function_call, function_call_output, reasoning)",
            {"field": "type", "got": repr(kind)[:40]},
        )


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_UNSERVED_KIND = "unserved"


def _item_kind(value: Any) -> str:
    """The item's tag: its type; a message when it has a role and no type (OpenAI's
    easy input message); anything else is ``_UnservedItem``'s."""
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
        return kind if kind in _ITEM_KINDS else _UNSERVED_KIND
    return str(getattr(value, "type", _UNSERVED_KIND))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[_UnservedItem, Tag(_UNSERVED_KIND)],
    Discriminator(_item_kind),
]


def _as_items(value: Any) -> Any:
    """A string is one user message (as OpenAI and vLLM read it)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return value
    raise PydanticCustomError("input_type", "must be a string or a list of items")


# ------------------------------------------------------------------------------- tools


class FunctionTool(_Strict):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"] = Field(description="Always 'function': other tools are not served.")
    name: str = Field(pattern=_FUNCTION_NAME, description="The function's name.")
    description: str | None = Field(None, description="What it does, for the model.")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments, as a JSON Schema object.")
    strict: bool | None = Field(None, description="Follow the schema exactly (guided decoding always does).")

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        # Before the fields, so that a web_search tool is refused for its type, not its fields.
        if isinstance(v, dict) and v.get("type") != "function":
            raise PydanticCustomError(
                "item_field",
                "only function tools are served; got {got}",
                {"field": "type", "got": repr(v.get("type"))[:40]},
            )
        return v


class NamedFunction(_Strict):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)


ToolChoice = Literal["none", "auto", "required"] | NamedFunction


def _tool_choice(value: Any) -> Any:
    # Checked here rather than by the union, so that the error names tool_choice.
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        return value
    raise PydanticCustomError(
        "tool_choice",
        "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...} (function tools only)",
    )


# -------------------------------------------------------------------------- text, reasoning


class TextFormat(_Strict):
    """``text.format``: text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = Field(description="text, json_object or json_schema.")
    name: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="json_schema: the schema's name."
    )
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: a JSON Schema object.")
    description: str | None = Field(None, max_length=1024, description="json_schema: what the answer is for.")
    strict: bool | None = Field(None, description="json_schema: follow it exactly (the engine always does).")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        with_schema = self.name is not None or self.schema_ is not None
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise PydanticCustomError("json_schema", "type json_schema needs a name and a schema")
        if self.type != "json_schema" and (with_schema or self.strict is not None or self.description is not None):
            raise PydanticCustomError("json_schema", "name, schema, description and strict go with type json_schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = Field(None, description="The answer's format; text when absent.")
    verbosity: Annotated[None, _not_served("verbosity")] = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's chat protocol's


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = Field(
        None, description="To the chat template as reasoning_effort (and enable_thinking), as vLLM passes it."
    )
    summary: Annotated[None, _not_served("reasoning summaries")] = None
    generate_summary: Annotated[None, _not_served("reasoning summaries")] = None


# ------------------------------------------------------------------------------ request


class ResponsesRequest(_Strict):
    """Body of ``POST /v1/responses``."""

    model: str = Field(min_length=1, max_length=256, description="The served model's name (GET /v1/models lists them).")
    input: Annotated[list[InputItem], BeforeValidator(_as_items)] = Field(
        min_length=1, description="A string (one user message) or a list of items; after validation a list."
    )
    instructions: str | None = Field(None, description="A system message first; not carried over a chain.")
    tools: list[FunctionTool] | None = Field(
        None, max_length=MAX_TOOLS, description="Function tools the model may call."
    )
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(_tool_choice)] = Field(
        None, description="'none', 'auto' (the default with tools), 'required', or a named function."
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call.")
    text: TextConfig | None = Field(None, description="text.format: the answer's format.")
    reasoning: ReasoningConfig | None = Field(None, description="reasoning.effort, to the chat template.")
    max_output_tokens: int | None = Field(None, ge=1, description="At most this many tokens are generated.")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False, description="Sampling temperature, 0-2.")
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="Nucleus sampling mass, (0, 1].")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="The likeliest tokens at each position (0-20), with include."
    )
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, max_length=MAX_INCLUDE, description="Only 'message.output_text.logprobs' is served."
    )
    truncation: Literal["disabled"] | None = Field(
        None, description="Only 'disabled' (a prompt past the context is a 400)."
    )
    store: bool | None = Field(None, description="Keep the response for previous_response_id (OpenAI's default: true).")
    previous_response_id: str | None = Field(
        None, pattern=RESPONSE_ID.pattern, description="Continue from a stored response of the same tenant."
    )
    metadata: dict[str, str] | None = Field(
        None, max_length=MAX_METADATA_PAIRS, description="At most 16 pairs; keys <= 64 characters, values <= 512."
    )
    user: str | None = Field(None, max_length=256, description="The end user's id, for abuse tracking.")
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = Field(
        None, description="As on chat: 'auto'/'default', 'priority' ('fast'), or 'flex'."
    )
    stream: bool = Field(False, description="Answer as server-sent Responses events.")
    criticality: Criticality | None = Field(
        None, description="Ballast extension: how much the request matters under overload, as on chat."
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        fault = metadata_fault(v or {})
        if fault is not None:
            raise PydanticCustomError("metadata", fault.removeprefix("metadata: "))
        return v

    @property
    def wants_logprobs(self) -> bool:
        """The answer's log-probabilities are asked for (``include``; ``top_logprobs`` alone asks nothing)."""
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def stored(self) -> bool:
        """The response is to be kept: OpenAI's default, unless ``store`` is false."""
        return self.store is not False


_DEFAULT_LIMITS = LimitsConfig()


def parse_responses(
    data: Any, limits: LimitsConfig = _DEFAULT_LIMITS, max_items: int = DEFAULT_MAX_ITEMS
) -> ResponsesRequest:
    """A decoded body as a Responses request within ``limits`` and ``max_items`` input
    items, or ``BadRequest`` / ``SchemaTooComplex`` naming the field."""
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object", field="body")
    for name, neutral in _UNSERVED.items():
        value = data.get(name)
        if value is not None and not (value == neutral and isinstance(value, bool) == isinstance(neutral, bool)):
            allowed = "leave it out" if neutral is None else f"leave it out or send {json.dumps(neutral)}"
            raise BadRequest(f"{name}: not supported by Ballast; {allowed}", field=name)
    items = data.get("input")
    if isinstance(items, list) and len(items) > max_items:  # before any item costs work
        raise BadRequest(f"input: at most {max_items} items", field="input")
    try:
        req = ResponsesRequest.model_validate({k: v for k, v in data.items() if k not in _UNSERVED})
    except ValidationError as e:
        raise _bad_request(e) from None
    _check_tool_choice(req)
    check_limits(req, limits)
    return req


def _bad_request(e: ValidationError) -> BadRequest | SchemaTooComplex:
    """The first error, named by its path in the body: an item's tag (the union's branch)
    is left out of the path, and a field a model-level check blames is added to it."""
    first = e.errors()[0]
    loc: tuple[Any, ...] = first["loc"]
    if len(loc) > 2 and loc[0] == "input" and loc[2] in (*_ITEM_KINDS, _UNSERVED_KIND):
        loc = (*loc[:2], *loc[3:])
    if first["type"] == "item_field":
        loc = (*loc, first["ctx"]["field"])
    field = ".".join(str(p) for p in loc) or "body"
    if field == "tools" and first["type"] == "too_long":
        return SchemaTooComplex(f"tools: at most {MAX_TOOLS} tools", field="tools")
    reason = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    return BadRequest(f"{field}: {reason}", field=field)


def _check_tool_choice(req: ResponsesRequest) -> None:
    """A named or required choice needs tools, the named one among them; tools' names are unique."""
    names = [t.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise BadRequest("tools: two tools have the same name", field="tools")
    choice = req.tool_choice
    if isinstance(choice, NamedFunction) and choice.name not in names:
        raise BadRequest(f"tool_choice: no tool named {choice.name!r} in tools", field="tool_choice")
    if choice == "required" and not names:
        raise BadRequest("tool_choice: 'required' needs tools", field="tool_choice")


def check_limits(req: ResponsesRequest, limits: LimitsConfig) -> None:
    """The configured bounds, as ``openai_api.check_limits`` applies them to chat, named
    by the Responses fields: ``text.format``'s schema and the tools' parameters
    (``SchemaTooComplex``), an earlier call's arguments (``BadRequest``)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.schema_ is not None:
        fault = schema_fault(limits.schema_bounds(), fmt.schema_)
        if fault is not None:
            raise SchemaTooComplex(f"text.format: the schema {fault}", field="text.format")
    schemas = []
    for i, tool in enumerate(req.tools or ()):
        if tool.parameters is None:
            continue
        depth = json_extent(tool.parameters).depth
        if depth > limits.max_schema_depth:
            raise SchemaTooComplex(
                f"tools: tool {i}'s parameters nest {depth} deep; the limit is {limits.max_schema_depth}",
                field="tools",
            )
        schemas.append(tool.parameters)
    fault = schema_fault(limits.schema_bounds(), *schemas)
    if fault is not None:
        raise SchemaTooComplex(f"tools: the tools' parameters taken as one schema {fault}", field="tools")
    for i, item in enumerate(req.input):
        if isinstance(item, FunctionCallItem):
            depth = json_nesting(item.arguments)
            if depth > limits.max_json_depth:
                field = f"input.{i}.arguments"
                raise BadRequest(f"{field}: nested {depth} deep; the limit is {limits.max_json_depth}", field=field)
