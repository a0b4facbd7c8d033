"""Tool calling on the OpenAI chat front: what ``tools`` / ``tool_choice`` ask, how the
answer becomes ``tool_calls``.

Served with the vLLM engine (the others refuse ``tools`` with a 400 naming it), in
vLLM's own way, so that a client gets from Ballast what it gets from ``vllm serve``:

* ``tool_choice`` a named function: the answer is that function's arguments, made
  JSON following its ``parameters`` schema by the engine's guided decoding; the
  message carries one tool call, ``finish_reason`` "stop" (OpenAI's rule for a
  forced function).
* ``"required"``: guided decoding of a JSON array of ``{"name", "parameters"}``, one
  object per call, each following one tool's schema (``parallel_tool_calls: false``:
  at most one); ``finish_reason`` "tool_calls".
* ``"auto"`` (the default when tools are given): the model answers freely and
  vLLM's tool parser for the model (``model.tool_parser``, e.g. ``hermes``) finds the
  calls in its text; without a parser configured, a 400 (as ``vllm serve`` without
  ``--tool-call-parser``). The text keeps the special tokens the parser looks for.
* ``"none"``: a plain answer; the tools are still shown to the model's template.

Bounds: at most ``MAX_TOOLS`` tools (OpenAI's limit); the schema guided decoding
compiles for "required" (an array of ``anyOf`` over every tool) holds every tool's
parameters and grows with their number, so it is measured as built (``schema_fault``:
nesting and nodes) and refused as ``tool_choice``'s when past the bounds; the
front bounds each tool's parameters and response_format's schema the same way.

The tools and any earlier tool calls and tool results go to the model's chat template
(``ballast.model.hf_checkpoint.render_chat``), which shows them to the model as it was
trained to see them. A streamed answer that may call a tool (every choice but "none")
is sent when the model has finished: its content, then each call whole, then the
finish; the arguments are not streamed piece by piece.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from ballast.config import LimitsConfig
from ballast.policies.request import json_extent, json_nesting

__all__ = [
    "MAX_TOOLS",
    "CalledFunction",
    "NamedToolChoice",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolParser",
    "ToolPlan",
    "ToolRequestError",
    "ToolSchemaTooComplex",
    "ToolSpec",
    "plan",
    "schema_fault",
]

MAX_TOOLS = 128  # OpenAI's limit
# How deep a "required" answer's JSON may nest to be read as calls (the parser recurses
# once per level). Its array, a call and parameters that follow a schema of at most
# limits.max_schema_depth levels nest far less; only a recursive schema ($ref) allows
# more, and an answer past this is taken as text.
MAX_ANSWER_NESTING = 256
_DEFAULT_LIMITS = LimitsConfig()


def schema_fault(schema: Any, max_depth: int, max_nodes: int) -> Optional[str]:
    """Why ``schema`` is past the bounds (a phrase: "nests 40 deep; the limit is 32"), or None."""
    extent = json_extent(schema)
    if extent.depth > max_depth:
        return f"nests {extent.depth} deep; the limit is {max_depth}"
    if extent.nodes > max_nodes:
        return f"has {extent.nodes} nodes; the limit is {max_nodes}"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    """A function the model may call."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The function's name.")
    description: Optional[str] = Field(None, description="What it does, for the model.")
    parameters: Optional[dict[str, Any]] = Field(None, description="Its arguments, as a JSON Schema object.")
    strict: Optional[bool] = Field(None, description="Follow the schema exactly (guided decoding always does).")


class ToolSpec(_Strict):
    """One tool of ``tools``: a function."""

    type: Literal["function"] = Field(description="Always 'function'.")
    function: FunctionSpec


class ChosenFunction(_Strict):
    name: str = Field(description="The function the model must call.")


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = Field(description="Always 'function'.")
    function: ChosenFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    """A call the model made (in an answer), or made earlier (in an assistant message)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolCallDelta(BaseModel):
    """A call in a streamed chunk: whole, with its place among the answer's calls."""

    index: int
    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolParser:
    """vLLM's tool parser ``name`` for the model's tokenizer: the calls in a free answer.

    Loaded when the router starts (vLLM's import takes seconds), so an unknown name
    fails there with vLLM's list, never on a request."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError as e:
            raise ValueError(f"model.tool_parser: {e}") from None
        self.name = name
        self._parser = cls(tokenizer)

    def extract(self, text: str, tools: Sequence[ToolSpec]) -> tuple[Optional[str], list[CalledFunction]]:
        """(the content before the calls or None, the calls) in ``text``."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(
            model="-",
            messages=[{"role": "user", "content": ""}],
            tools=[t.model_dump(exclude_none=True) for t in tools],
            tool_choice="auto",
        )
        got = self._parser.extract_tool_calls(text, request)
        if not got.tools_called:
            return text, []
        calls = [CalledFunction(name=c.function.name, arguments=c.function.arguments) for c in got.tool_calls]
        return got.content, calls


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools, and how its answer's text becomes calls."""

    mode: Literal["none", "named", "required", "auto"]
    tools: tuple[ToolSpec, ...] = ()
    name: Optional[str] = None  # "named": the function
    schema: Optional[dict[str, Any]] = None  # "named" / "required": what guided decoding follows
    parser: Optional[ToolParser] = field(default=None, compare=False)  # "auto"

    @property
    def may_call(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools as the chat template takes them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def answer(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """The answer's content and its calls, from the model's text."""
        if self.mode == "named":
            assert self.name is not None
            return None, [_call(CalledFunction(name=self.name, arguments=text))]
        if self.mode == "required":
            found = _required_calls(text)
            return (None, [_call(f) for f in found]) if found else (text, [])
        if self.mode == "auto" and self.parser is not None:
            content, found = self.parser.extract(text, self.tools)
            return content, [_call(f) for f in found]
        return text, []

    def settle(self, text: str, finish: str) -> tuple[Optional[str], list[ToolCall], str]:
        """The whole answer: its content, its calls and its finish reason."""
        content, calls = self.answer(text)
        return content, calls, self.finish(calls, finish)

    def finish(self, calls: list[ToolCall], finish: str) -> str:
        """OpenAI's finish reason: "tool_calls" when the model chose to call ("required",
        "auto"); a forced function's call ends with "stop"."""
        if calls and self.mode in ("required", "auto") and finish == "stop":
            return "tool_calls"
        return finish


def plan(
    tools: Optional[Sequence[ToolSpec]],
    choice: Optional[ToolChoice],
    parallel: Optional[bool],
    parser: Optional[ToolParser] = None,
    limits: LimitsConfig = _DEFAULT_LIMITS,
) -> ToolPlan:
    """The plan for a request's tools; :class:`ToolRequestError` (naming the field)
    where it asks what cannot be done, :class:`ToolSchemaTooComplex` where the schema
    "required" builds is past ``limits.max_schema_depth`` / ``max_schema_nodes``."""
    tools = tuple(tools or ())
    if not tools:
        if choice not in (None, "none"):
            raise ToolRequestError("tool_choice", "needs tools: name the functions in tools")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError("tools", "two tools have the same name")
    if choice == "none":
        return ToolPlan("none", tools)
    if isinstance(choice, NamedToolChoice):
        chosen = next((t for t in tools if t.function.name == choice.function.name), None)
        if chosen is None:
            raise ToolRequestError("tool_choice", f"no tool named {choice.function.name!r} in tools")
        return ToolPlan("named", tools, name=chosen.function.name, schema=_parameters(chosen))
    if choice == "required":
        schema = _array_schema(tools, parallel)
        fault = schema_fault(schema, limits.max_schema_depth, limits.max_schema_nodes)
        if fault is not None:
            raise ToolSchemaTooComplex(
                "tool_choice",
                f"'required' over these tools builds a schema that {fault}; "
                "send fewer or smaller tools, or name one function",
            )
        return ToolPlan("required", tools, schema=schema)
    if parser is None:
        raise ToolRequestError(
            "tool_choice",
            "'auto' (the default with tools) needs the model's tool parser "
            "(model.tool_parser, e.g. hermes); or send 'required' or a named function",
        )
    return ToolPlan("auto", tools, parser=parser)


class ToolRequestError(ValueError):
    """A request's tools that cannot be served, with the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ToolSchemaTooComplex(ToolRequestError):
    """The schema a request's tools would have guided decoding compile is past the bounds."""


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _array_schema(tools: Sequence[ToolSpec], parallel: Optional[bool]) -> dict[str, Any]:
    """vLLM's schema for "required": an array of calls, each one tool's name and parameters."""
    each = [
        {
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": each}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def _required_calls(text: str) -> list[CalledFunction]:
    """The calls in a "required" answer's JSON array; none where the text is not one
    (cut short by max_tokens, or nested past ``MAX_ANSWER_NESTING``)."""
    if json_nesting(text) > MAX_ANSWER_NESTING:
        return []
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [
        CalledFunction(name=i["name"], arguments=json.dumps(i["parameters"], ensure_ascii=False))
        for i in items
        if isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i
    ]


def _call(f: CalledFunction) -> ToolCall:
    return ToolCall(id=f"call_{secrets.token_hex(12)}", type="function", function=f)
