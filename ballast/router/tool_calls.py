"""Tool calling on the OpenAI chat front: what ``tools`` / ``tool_choice`` ask.

Served with the vLLM engine (the others refuse ``tools`` with a 400 naming it), by
vLLM's own parsers (``ballast.router.chat_parsing``), so that a client gets from
Ballast what it gets from ``vllm serve``:

* ``tool_choice`` a named function: the model writes one call of it, in its own
  format, its arguments following the ``parameters`` schema (the engine's guided
  decoding); ``finish_reason`` "stop" (OpenAI's rule for a forced function).
* ``"required"``: at least one call (``parallel_tool_calls: false``: exactly one),
  each following its tool's schema; ``finish_reason`` "tool_calls".
* ``"auto"`` (the default when tools are given): the model answers freely and
  vLLM's tool parser for the model (``model.tool_parser``, e.g. ``hermes``) finds the
  calls in its text; without a parser configured, a 400 (as ``vllm serve`` without
  ``--tool-call-parser``).
* ``"none"``: a plain answer; the tools are still shown to the model's template.

Streamed, the calls come as OpenAI streams them: index, id and name first, then the
arguments in fragments. Ids are the parser's (Mistral's 9 characters, which its
templates require on the next turn; vLLM's ``chatcmpl-tool-`` ids otherwise).

Bounds: at most ``MAX_TOOLS`` tools (OpenAI's limit); each tool's parameters and all
of them together are bounded (``openai_api.check_limits``), and the grammar the
parser builds for them (every tool's schema in it) is measured as built
(``ballast.policies.schema``: nesting, nodes, patterns, counts and literals) and refused
as ``tool_choice``'s when past the bounds.

The tools and any earlier tool calls and tool results go to the model's chat template
(``ballast.model.hf_checkpoint.render_chat``), which shows them to the model as it was
trained to see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_TOOLS",
    "CalledFunction",
    "FunctionDelta",
    "NamedToolChoice",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolPlan",
    "ToolRequestError",
    "ToolSchemaTooComplex",
    "ToolSpec",
    "plan",
]

MAX_TOOLS = 128  # OpenAI's limit


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    """A function the model may call."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The function's name.")
    description: str | None = Field(None, description="What it does, for the model.")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments, as a JSON Schema object.")
    strict: bool | None = Field(None, description="Follow the schema exactly (guided decoding always does).")


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


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    """A call the model made (in an answer), or made earlier (in an assistant message)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = Field(None, description="The next fragment of the arguments' JSON text.")


class ToolCallDelta(BaseModel):
    """A call in a streamed chunk, as OpenAI streams it: its index among the answer's
    calls always; its id, type and name in its first delta; argument fragments after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools; vLLM's parser (``ballast.router.chat_parsing``)
    turns it into the grammar the engine decodes by and reads the calls in the answer."""

    mode: Literal["none", "named", "required", "auto"]
    tools: tuple[ToolSpec, ...] = ()
    name: str | None = None  # "named": the function
    parallel: bool | None = None  # parallel_tool_calls as sent

    @property
    def may_call(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def vllm_choice(self) -> Any:
        """``tool_choice`` as vLLM's request takes it (None: no tools)."""
        if not self.tools:
            return None
        if self.mode == "named":
            return {"type": "function", "function": {"name": self.name}}
        return self.mode


def plan(
    tools: Sequence[ToolSpec] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    auto: bool = False,
) -> ToolPlan:
    """The plan for a request's tools; :class:`ToolRequestError` (naming the field)
    where it asks what cannot be done. ``auto``: the model has a tool parser, which
    tool_choice "auto" (the default with tools) needs."""
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
        return ToolPlan("named", tools, name=chosen.function.name, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    if not auto:
        raise ToolRequestError(
            "tool_choice",
            "'auto' (the default with tools) needs the model's tool parser "
            "(model.tool_parser, e.g. hermes); or send 'required' or a named function",
        )
    return ToolPlan("auto", tools, parallel=parallel)


class ToolRequestError(ValueError):
    """A request's tools that cannot be served, with the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ToolSchemaTooComplex(ToolRequestError):
    """The schema a request's tools would have guided decoding compile is past the bounds."""
