"""The Responses API over chat: a Responses request as the chat-completions body the
chat front serves, and a chat answer as the Responses output and response object.

``/v1/responses`` is not a second front: its request becomes a chat body
(``to_chat``), which goes through ``openai_api.parse_chat`` and the same pipeline as
``/v1/chat/completions``; what the chat answer gives (reasoning, text with its
log-probabilities, tool calls) becomes Responses output items (``output_items``) in a
response object (``response_object``). It runs nothing and keeps nothing: a front calls
it, a store keeps what ``conversation_after`` returns.

The translation follows vLLM's own Responses pieces (``vllm/entrypoints/openai/responses``):

* Input items to chat messages as ``construct_input_messages`` builds them: the
  instructions a system message first; the stored conversation of
  ``previous_response_id`` next; then the items: a message's text parts joined; a
  ``function_call`` a tool call of the assistant message before it (a new assistant
  message when the item before is not one); an assistant message after an assistant
  message that has no text yet fills it in; a ``function_call_output`` a tool message.
  Reasoning items are not replayed: chat messages have no field for them (vLLM sets a
  ``reasoning`` key the chat template may read).
* ``instructions`` are not carried over a chain (OpenAI's rule): the stored
  conversation never holds them (``conversation_after`` keeps the input items and the
  answer only), so a system or developer message sent as an input item is carried over,
  as OpenAI carries it. (vLLM drops every system message of the stored conversation.)
* ``reasoning.effort`` is chat's ``reasoning_effort``, which reaches the chat template as
  vLLM's chat protocol passes it (``openai_api.ChatCompletionRequest.template_kwargs``):
  ``reasoning_effort``, and ``enable_thinking`` (effort not
  "none") for templates that opt in to thinking.
* Output items as ``build_response_output_items``: a ``reasoning`` item (no summary;
  its text a ``reasoning_text`` part), a ``message`` item (one ``output_text`` part,
  no annotations, the log-probabilities when asked), a ``function_call`` item per call
  (its ``call_id`` the chat call's id).

A stored conversation for the next turn (``conversation_after``) is the chat messages
this turn sent (less the instructions) and the answer as one assistant message: its
text, and its tool calls (vLLM's chain keeps only an answer's text, so a tool result on
the next turn would answer a call the model no longer sees).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ballast.router.openai_api import MAX_MESSAGES, BadRequest
from ballast.router.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ResponsesRequest,
)

__all__ = [
    "AnswerParts",
    "ResponseHead",
    "conversation_after",
    "delta_logprob",
    "input_messages",
    "new_item_id",
    "output_items",
    "output_logprob",
    "response_head",
    "response_object",
    "status_of",
    "to_chat",
    "usage_of",
]

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def new_item_id(prefix: str) -> str:
    """A fresh id: ``prefix``, an underscore and 48 hex digits (``resp_…``, ``msg_…``)."""
    return f"{prefix}_{secrets.token_hex(24)}"


# --------------------------------------------------------------------------- to chat


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input items as chat messages (the module docstring), without the instructions."""
    messages: list[dict[str, Any]] = []
    for item in req.input:
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem):
            if item.role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = item.text
            else:
                messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        # A reasoning item is not replayed.
    return messages


def to_chat(req: ResponsesRequest, previous: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The chat-completions body for ``req`` (what ``openai_api.parse_chat`` accepts), after
    ``previous``: the stored conversation of ``req.previous_response_id``, chat messages.
    A conversation past ``MAX_MESSAGES`` is a ``BadRequest`` naming what made it long."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [dict(m) for m in previous or ()]
    messages += input_messages(req)
    if len(messages) > MAX_MESSAGES:
        blamed = "previous_response_id" if previous else "input"
        raise BadRequest(
            f"{blamed}: the conversation has {len(messages)} messages; at most {MAX_MESSAGES}", field=blamed
        )
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the usage response.completed carries
    _put_tools(body, req)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": _present(schema)}
    if req.wants_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        body["reasoning_effort"] = effort
    body.update(
        _present(
            {
                "max_tokens": req.max_output_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "user": req.user,
                "service_tier": req.service_tier,
                "criticality": req.criticality.value if req.criticality is not None else None,
            }
        )
    )
    return body


def _put_tools(body: dict[str, Any], req: ResponsesRequest) -> None:
    """The tools in chat's shape, the choice and ``parallel_tool_calls`` with them; no
    tools, no choice (parsing refused a named or required choice without tools)."""
    if not req.tools:
        return
    body["tools"] = [
        {
            "type": "function",
            "function": _present(
                {"name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
            ),
        }
        for t in req.tools
    ]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls


def _present(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


# ------------------------------------------------------------------------- from chat


def output_logprob(lp: Mapping[str, Any]) -> dict[str, Any]:
    """A chat token's log-probability as an ``output_text`` part carries it."""
    return {
        "token": lp["token"],
        "bytes": _bytes(lp),
        "logprob": lp["logprob"],
        "top_logprobs": [
            {"token": t["token"], "bytes": _bytes(t), "logprob": t["logprob"]} for t in lp.get("top_logprobs") or ()
        ],
    }


def delta_logprob(lp: Mapping[str, Any]) -> dict[str, Any]:
    """A chat token's log-probability as an ``output_text.delta`` event carries it (no bytes)."""
    return {
        "token": lp["token"],
        "logprob": lp["logprob"],
        "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp.get("top_logprobs") or ()],
    }


def _bytes(lp: Mapping[str, Any]) -> list[int]:
    raw = lp.get("bytes")
    return list(raw) if raw is not None else list(str(lp["token"]).encode())


@dataclass(frozen=True)
class AnswerParts:
    """What one chat answer gave: its reasoning, its text (with each token's
    log-probability, chat's shape, when asked) and its tool calls (chat's shape)."""

    reasoning: str | None = None
    content: str | None = None
    logprobs: tuple[Mapping[str, Any], ...] | None = None
    tool_calls: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def of_choice(cls, choice: Mapping[str, Any]) -> AnswerParts:
        """The parts of a chat completion's choice (``message``, ``logprobs``)."""
        message = choice["message"]
        logprobs = (choice.get("logprobs") or {}).get("content")
        return cls(
            reasoning=message.get("reasoning_content"),
            content=message.get("content"),
            logprobs=tuple(logprobs) if logprobs is not None else None,
            tool_calls=tuple(message.get("tool_calls") or ()),
        )


def output_items(parts: AnswerParts, new_id: Callable[[str], str] = new_item_id) -> list[dict[str, Any]]:
    """The Responses ``output`` for a chat answer, as vLLM's ``build_response_output_items``."""
    items: list[dict[str, Any]] = []
    if parts.reasoning:
        items.append(
            {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": parts.reasoning}],
            }
        )
    if parts.content:
        text: dict[str, Any] = {"type": "output_text", "text": parts.content, "annotations": []}
        if parts.logprobs is not None:
            text["logprobs"] = [output_logprob(lp) for lp in parts.logprobs]
        items.append(
            {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "completed", "content": [text]}
        )
    for call in parts.tool_calls:
        function = call["function"]
        items.append(
            {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    return items


def usage_of(chat: Mapping[str, Any]) -> dict[str, Any]:
    """A chat answer's usage in the Responses API's shape (no reasoning tokens counted apart)."""
    details = chat.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0, "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def status_of(finish_reason: str | None) -> Status:
    """A finished answer's status: incomplete when it ran out of ``max_output_tokens``."""
    return "incomplete" if finish_reason == "length" else "completed"


@dataclass(frozen=True)
class ResponseHead:
    """What every response object of one request carries: its id, time, model, and the
    request's fields OpenAI echoes (``echo``, as sent or OpenAI's default)."""

    id: str
    created_at: int
    model: str
    echo: Mapping[str, Any] = field(default_factory=dict)


def response_head(
    req: ResponsesRequest,
    model: str,
    clock: Callable[[], float] = time.time,
    new_id: Callable[[str], str] = new_item_id,
) -> ResponseHead:
    """The head of ``req``'s response; ``model``: the name the answer gives (the chat answer's)."""
    choice = req.tool_choice
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    echo = {
        "instructions": req.instructions,
        "metadata": req.metadata,
        "tools": [t.model_dump() for t in req.tools or ()],
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": {"type": "text"}, **text},
        "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
        "previous_response_id": req.previous_response_id,
        "store": req.stored,
        "service_tier": req.service_tier or "auto",
        "truncation": "disabled",
        "user": req.user,
    }
    return ResponseHead(id=new_id("resp"), created_at=int(clock()), model=model, echo=echo)


def response_object(
    head: ResponseHead,
    status: Status,
    output: Sequence[Mapping[str, Any]] = (),
    usage: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    service_tier: str | None = None,
) -> dict[str, Any]:
    """The whole response object: ``head``, its ``status`` (incomplete: it ran out of
    ``max_output_tokens``), ``output`` items, ``usage`` (chat's shape, or None while in
    progress), an ``error`` when failed, and the tier that served it when known."""
    obj: dict[str, Any] = {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "model": head.model,
        "output": [dict(item) for item in output],
        "usage": usage_of(usage) if usage is not None else None,
        "error": dict(error) if error is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        **head.echo,
    }
    if service_tier is not None:
        obj["service_tier"] = service_tier
    return obj


def conversation_after(
    previous: Sequence[Mapping[str, Any]] | None,
    sent: Sequence[Mapping[str, Any]],
    output: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """The chat messages a stored response keeps for the next turn: ``previous`` (the
    conversation it continued), ``sent`` (this turn's ``input_messages``, without the
    instructions) and its ``output`` as one assistant message: the text of its message
    items, and its function calls as tool calls (reasoning is not kept)."""
    text: str | None = None
    calls: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = (text or "") + "".join(part["text"] for part in item["content"] if part["type"] == "output_text")
        elif item["type"] == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    answer: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        answer["tool_calls"] = calls
    elif text is None:
        answer["content"] = ""  # an answer that said nothing (only reasoning, or cut at once)
    return [*(dict(m) for m in previous or ()), *(dict(m) for m in sent), answer]
