"""A chat answer on the vLLM engine read by vLLM's own parsers: tool calls and reasoning,
one parser per request, streamed as they come.

The router builds, at start, vLLM's composed ``Parser`` class for the model
(``vllm.parser.ParserManager.get_parser``: the tool parser ``model.tool_parser`` and the
reasoning parser ``model.reasoning_parser``, as ``vllm serve`` composes them) and, for
each chat request, one instance of it (parsers keep streaming state):

* ``adjust_request`` decides what the engine decodes by: for ``tool_choice``
  ``"required"`` or a named function (and ``"auto"`` once the model opens a call), the
  structural tag or JSON schema vLLM builds from the tools (``$defs`` resolved
  in each tool's own schema; ``parallel_tool_calls: false`` keeps one call). Every
  call's arguments follow their schema (``TOOL_STRICT_LEVEL``, vLLM's
  ``--tool-strict-level parameter``: what Ballast's forced calls always did), the
  whitespace between JSON tokens bounded (``MAX_WHITESPACE``: a small model otherwise
  fills ``max_tokens`` with it), and so are the numbers each schema leaves unbounded
  (``ballast.policies.schema.bounded_numbers``: else its digits). It also says whether the
  text keeps special tokens.
* ``parse`` reads a whole answer: its reasoning, content and calls, with the ids the
  parser gives (Mistral's 9 characters; others vLLM's ``chatcmpl-tool-`` ids).
* ``parse_delta`` reads a stream piece by piece: content, reasoning and the calls as
  OpenAI streams them (``delta.tool_calls``: index, id and name first, then argument
  fragments).

A model without a tool parser still answers ``"required"`` and named functions, by
grammar alone (``FORCED_ONLY``: ``ballast.router.forced_only_parser``, registered with
vLLM's ``ToolParserManager``; it finds no call in free text, so ``"auto"`` needs
``model.tool_parser`` and is refused without).

vLLM symbols used: ``vllm.parser.ParserManager.get_parser``, ``Parser.adjust_request`` /
``parse`` / ``parse_delta``, ``vllm.tool_parsers.ToolParserManager.register_lazy_module`` and
``abstract_tool_parser.ToolParser``, ``vllm.entrypoints.openai.chat_completion.protocol.
ChatCompletionRequest``, ``vllm.entrypoints.generate.base.protocol`` (``DeltaMessage``,
``ExtractedToolCallInformation``), ``vllm.renderers.chat_utils.make_tool_call_id``; each
is exercised by ``tests/unit/test_chat_parsing.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ballast.errors import EngineRefused
from ballast.policies.schema import SchemaBounds, bounded_numbers, schema_fault
from ballast.router.openai_answers import FinishReason
from ballast.router.tool_calls import ToolCall, ToolPlan, ToolSchemaTooComplex

__all__ = ["FORCED_ONLY", "MAX_WHITESPACE", "TOOL_STRICT_LEVEL", "ChatParsing", "ParsedChat", "StreamedChat"]

FORCED_ONLY = "ballast_forced_only"  # the tool parser of a model without one: forced calls only
TOOL_STRICT_LEVEL = "parameter"  # vLLM's --tool-strict-level: arguments always follow their schema
MAX_WHITESPACE = 1  # consecutive whitespace characters a call's JSON may hold between tokens


def _register_forced_only() -> None:
    """Register ``FORCED_ONLY`` (``ballast.router.forced_only_parser``) with vLLM once."""
    from vllm.tool_parsers import ToolParserManager

    if FORCED_ONLY not in ToolParserManager.list_registered():
        ToolParserManager.register_lazy_module(FORCED_ONLY, "ballast.router.forced_only_parser", "ForcedOnlyToolParser")


class ChatParsing:
    """vLLM's parser class for one model (the module docstring); ``start`` makes each request's."""

    def __init__(
        self, tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None, model_name: str = ""
    ) -> None:
        from vllm.parser import ParserManager

        _register_forced_only()
        self.tool_parser = tool_parser  # None: forced calls only
        self.reasoning_parser = reasoning_parser
        self._tokenizer = tokenizer
        try:
            # vLLM's Parser classes, found by name: Any at this boundary, as ParsedChat holds them.
            self._cls: Any = ParserManager.get_parser(
                tool_parser_name=tool_parser or FORCED_ONLY,
                reasoning_parser_name=reasoning_parser,
                enable_auto_tools=True,
                model_name=model_name,
                tool_strict_level=TOOL_STRICT_LEVEL,
                tokenizer=tokenizer,
            )
            # A prompt whose template closed the thinking already (``enable_thinking: false``):
            # the answer is read without the reasoning parser (the stream's parser sees the prompt).
            self._content_cls: Any = (
                ParserManager.get_parser(
                    tool_parser_name=tool_parser or FORCED_ONLY,
                    enable_auto_tools=True,
                    model_name=model_name,
                    tool_strict_level=TOOL_STRICT_LEVEL,
                    tokenizer=tokenizer,
                )
                if reasoning_parser is not None
                else self._cls
            )
        except (TypeError, KeyError) as e:  # an unknown name, or a tokenizer without its markers
            which = "model.reasoning_parser" if "reasoning" in str(e) else "model.tool_parser"
            raise ValueError(f"{which}: {e}") from None

    @property
    def auto(self) -> bool:
        """tool_choice "auto" can be served: the model has a tool parser."""
        return self.tool_parser is not None

    def start(self, tools: ToolPlan, template_kwargs: dict[str, Any] | None = None) -> ParsedChat:
        """This request's parser and the request as vLLM adjusted it (what to decode by).

        The conversation itself is not given: the router renders it (``render_chat``), and
        vLLM's request would validate it again by rules of its own; the parsers read the
        answer, the tools and the choice. What vLLM refuses of the tools as sent (its tool
        utilities' ``VLLMValidationError``: a tool's ``$defs`` that is not an object, two
        tools defining one name two ways) is ``EngineRefused`` naming the field."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMClientError

        try:
            request: Any = ChatCompletionRequest.model_validate(
                {
                    "model": "-",
                    "messages": [{"role": "user", "content": ""}],
                    "tools": tools.template_tools(),
                    "tool_choice": tools.vllm_choice(),
                    "parallel_tool_calls": tools.parallel if tools.parallel is not None else True,
                    "chat_template_kwargs": template_kwargs,
                }
            )
            kwargs = template_kwargs or {}
            parser = self._cls(self._tokenizer, request.tools, chat_template_kwargs=kwargs)
            if tools.may_call or self.reasoning_parser is not None:
                request = parser.adjust_request(request)
        except VLLMClientError as e:
            raise _refused(e) from None
        content = (
            self._content_cls(self._tokenizer, request.tools, chat_template_kwargs=kwargs)
            if self.reasoning_parser is not None
            else None
        )
        return ParsedChat(request, parser, tools, tools.may_call or self.reasoning_parser is not None, content)


@dataclass
class ParsedChat:
    """One chat request as vLLM's parser reads it (``ChatParsing.start``)."""

    request: Any  # vLLM's ChatCompletionRequest, adjusted
    parser: Any  # vLLM's Parser, this request's own
    tools: ToolPlan
    reads: bool = True  # the answer goes through the parser (it may call tools, or reason)
    content_parser: Any | None = None  # the tool parser alone, for a prompt that closed the thinking
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as prefilled (``rendered``)

    def rendered(self, prompt_ids: Sequence[int]) -> None:
        """The prompt as the engine prefills it: the parsers' prefix state (vLLM's
        ``set_prompt_token_ids``), and for a reasoning model whether its template closed the
        thinking already (``Parser.is_reasoning_end`` on the prompt, as the engine and the
        stream's parser decide it)."""
        self.prompt_ids = list(prompt_ids)
        self.parser.set_prompt_token_ids(self.prompt_ids)
        if self.content_parser is not None:
            if self.parser.is_reasoning_end(self.prompt_ids):
                self.parser = self.content_parser
            self.content_parser = None

    @property
    def forced(self) -> bool:
        """A call is forced: tool_choice "required" or a named function."""
        return self.tools.mode in ("named", "required")

    @property
    def keep_special_tokens(self) -> bool:
        """The answer's text keeps special tokens (a parser reads its markers among them)."""
        return not self.request.skip_special_tokens

    def guided(self) -> tuple[str | None, str | None]:
        """(JSON schema, structural tag) the engine decodes by, as text: what vLLM's
        parser asked for the tools (None, None: the request's own ``response_format``)."""
        schema, tag, _ = self._grammar
        return schema, tag

    @cached_property
    def _grammar(self) -> tuple[str | None, str | None, Any]:
        """``guided()``'s texts, their numbers bounded, and the grammar as vLLM's parser
        built it from the tools (what ``check`` measures), built once a request."""
        so = self.request.structured_outputs
        if so is None or not self.tools.may_call:
            return None, None, None
        if so.structural_tag is not None:
            tag = _bounded_whitespace(json.loads(so.structural_tag))
            return None, json.dumps(_bounded_numbers(tag), separators=(",", ":")), tag
        if so.json is not None:
            schema = so.json if isinstance(so.json, dict) else json.loads(so.json)
            return json.dumps(bounded_numbers(schema), separators=(",", ":")), None, schema
        return None, None, None

    def check(self, bounds: SchemaBounds) -> None:
        """``ToolSchemaTooComplex`` naming tool_choice when the grammar the tools built is
        past the bounds (``ballast.policies.schema``)."""
        built = self._grammar[2]
        if built is None:
            return
        fault = schema_fault(bounds, built)
        if fault is not None:
            raise ToolSchemaTooComplex(
                "tool_choice",
                f"{self.tools.mode!r} over these tools builds a grammar that {fault}; "
                "send fewer or smaller tools, or name one function",
            )

    def answer(self, text: str, finish: FinishReason) -> tuple[str | None, str | None, list[ToolCall], FinishReason]:
        """A whole answer: (reasoning, content, calls, finish reason), as vLLM's server answers."""
        from vllm.renderers.chat_utils import make_tool_call_id

        if not self.reads:
            return None, text, [], finish
        try:
            reasoning, content, found = self.parser.parse(text, self.request, enable_auto_tools=True)
        except RecursionError:  # an answer nested past Python's stack: text, no call
            return None, text, [], finish
        calls = [_tool_call(c.id or make_tool_call_id(), c.name, c.arguments) for c in found or ()]
        if self.tools.mode in ("required", "auto") and calls and finish == "stop":
            finish = "tool_calls"  # OpenAI's: a forced function's call ends with "stop"
        if self.tools.mode in ("named", "required") and calls:
            content = content or None
        return reasoning, content, calls, finish

    def stream(self) -> StreamedChat:
        return StreamedChat(self, self.prompt_ids)


@dataclass
class StreamedChat:
    """One streamed answer read piece by piece by its request's parser."""

    chat: ParsedChat
    prompt_ids: list[int]
    called: bool = False  # a call was streamed
    _first: bool = field(default=True, repr=False)
    _broken: bool = field(default=False, repr=False)
    _held: list[int] = field(default_factory=list, repr=False)  # ids whose text has not come yet

    def feed(self, text: str, ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        """The delta this piece makes (``content``, ``reasoning_content``, ``tool_calls`` as
        OpenAI's chunk deltas carry them), or None when the parser holds it back."""
        if self._broken:
            return {"content": text} if text else None
        if not text and not finished:  # the replica holds this text back (a character cut in two)
            self._held.extend(ids)
            return None
        ids, self._held = [*self._held, *ids], []  # the ids of exactly this text: parsers read both
        try:
            message = self.chat.parser.parse_delta(
                text, ids, self.chat.request, self.prompt_ids if self._first else None, finished=finished
            )
        except RecursionError:  # an answer nested past Python's stack: the rest is text
            self._broken = True
            return {"content": text} if text else None
        self._first = False
        if message is None:
            return None
        delta: dict[str, Any] = {}
        if message.reasoning:
            delta["reasoning_content"] = message.reasoning
        if message.content:
            delta["content"] = message.content
        if message.tool_calls:
            self.called = True
            delta["tool_calls"] = [_call_delta(c) for c in message.tool_calls]
        return delta or None

    def finish(self, finish: FinishReason) -> FinishReason:
        if self.called and self.chat.tools.mode != "named" and finish == "stop":
            return "tool_calls"
        return finish


#: The request's fields ``ChatParsing.start`` hands vLLM: a refusal names one of them.
_GIVEN = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")


def _refused(e: Exception) -> EngineRefused:
    """vLLM's refusal of what ``start`` gave it, naming the field its ``parameter`` says
    (``tools`` when it names none of them), with vLLM's message."""
    parameter = getattr(e, "parameter", None)
    field = parameter if parameter in _GIVEN else "tools"
    reason = e.args[0] if e.args else type(e).__name__
    return EngineRefused(f"{field}: vLLM refuses the request's tools: {reason}", field=field)


def _tool_call(call_id: str, name: str, arguments: str) -> ToolCall:
    function = {"name": name, "arguments": arguments}
    return ToolCall.model_validate({"id": call_id, "type": "function", "function": function})


def _call_delta(c: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": c.index}
    if c.id is not None:
        out["id"], out["type"] = c.id, "function"
    if c.function is not None:
        fn = {k: v for k, v in (("name", c.function.name), ("arguments", c.function.arguments)) if v is not None}
        if fn:
            out["function"] = fn
    return out


def _bounded_whitespace(node: Any) -> Any:
    """``node`` (a structural tag) with every JSON content's whitespace runs capped at
    ``MAX_WHITESPACE`` where it sets none."""
    if isinstance(node, dict):  # a tool's own schema (under "json_schema") is left as it is
        out = {k: v if k == "json_schema" else _bounded_whitespace(v) for k, v in node.items()}
        if out.get("type") == "json_schema" and out.get("max_whitespace_cnt") is None:
            out["max_whitespace_cnt"] = MAX_WHITESPACE
        return out
    if isinstance(node, list):
        return [_bounded_whitespace(v) for v in node]
    return node


def _bounded_numbers(node: Any) -> Any:
    """``node`` (a structural tag) with each JSON content's schema's numbers bounded
    (``bounded_numbers``)."""
    if isinstance(node, dict):
        return {k: bounded_numbers(v) if k == "json_schema" else _bounded_numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_bounded_numbers(v) for v in node]
    return node
