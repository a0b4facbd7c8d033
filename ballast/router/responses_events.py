"""The Responses API's stream: the events of ``POST /v1/responses`` with ``stream: true``,
from the chat stream Ballast's chat front produces for the same request.

``ResponseStream`` is fed each chat chunk's choice (its ``delta``: ``content``,
``reasoning_content``, ``tool_calls`` fragments with ``index``, ``id`` and the
function's ``name`` / ``arguments``; its ``logprobs``; its ``finish_reason``) and
returns the Responses events it makes, each with the next ``sequence_number``. It
mirrors vLLM's ``SimpleStreamingEventProcessor``
(``vllm/entrypoints/openai/responses/streaming_events.py``), the state machine vLLM's
own ``/v1/responses`` streams by:

1. ``start``: ``response.created`` and ``response.in_progress``, each with the response
   object in progress (no output, no usage).
2. ``feed``: a delta holding several kinds is split, reasoning first, then content, then
   the tool calls by index (vLLM's ``split_delta``). Each part belongs to an item: the
   reasoning item, the message, or the function call of its index. A part of another
   item than the open one closes the open one (its ``.done`` events, then
   ``response.output_item.done``) and opens its own (``response.output_item.added``,
   and for text ``response.content_part.added``); then its delta event:
   ``response.reasoning_text.delta``, ``response.output_text.delta`` (with the
   log-probabilities the chat stream sent since the last text, OpenAI's delta shape: a
   piece's text may be held back while its log-probabilities come),
   ``response.function_call_arguments.delta``. Empty text opens nothing.
3. ``finish``: the open item closed, then ``response.completed`` (``response.incomplete``
   when the chat answer ended on ``length``: OpenAI's event, where vLLM sends completed
   with an incomplete status) with the whole response object: the items as they were
   closed (same ids as streamed) and the usage of the chat stream's last chunk.
   ``fail`` ends it instead with ``response.failed`` carrying the error.

Where the events differ from vLLM's: ``response.output_text.done`` carries the text's
log-probabilities (vLLM sends an empty list), and ``finish`` says ``response.incomplete``
on ``length``. Everything it holds (the text so far, the closed items) is bounded by the
chat answer it is fed, which ``max_tokens`` bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ballast.errors import BallastError
from ballast.router.responses_items import (
    ResponseHead,
    delta_logprob,
    new_item_id,
    output_logprob,
    response_object,
    status_of,
)

__all__ = ["ResponseStream", "error_of"]

_Kind = Literal["reasoning", "message", "function_call"]


@dataclass
class _OpenItem:
    """The item being streamed: its kind, id, place, and what it has said so far."""

    kind: _Kind
    id: str
    output_index: int
    text: str = ""  # the reasoning, the message's text, or the call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat's shape
    call_index: int | None = None  # a function call's index in the chat stream
    call_id: str = ""
    name: str = ""


def error_of(error: BallastError) -> dict[str, Any]:
    """A Ballast error as a failed response's ``error``: OpenAI's code for its kind
    (``rate_limit_exceeded`` for a 429, ``invalid_prompt`` for a 4xx, else
    ``server_error``), Ballast's stable code as its ``type``, the field as ``param``."""
    if error.status == 429:
        code = "rate_limit_exceeded"
    elif 400 <= error.status < 500:
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": error.message, "type": error.code, "param": getattr(error, "field", None) or None}


class ResponseStream:
    """The events of one streamed response (the module docstring). Not thread-safe: one
    request's chat stream feeds it, in order."""

    def __init__(self, head: ResponseHead, new_id: Callable[[str], str] = new_item_id) -> None:
        self._head = head
        self._new_id = new_id
        self._sequence = 0
        self._open: _OpenItem | None = None
        self._done: list[dict[str, Any]] = []  # the closed items, in output order
        self._finish_reason: str | None = None
        # Log-probabilities of tokens whose text has not come yet (held back by the stop
        # scanner, or reasoning's): the next text's, else the message's when it closes, as
        # a unary answer gives every token's log-probability with the message's text.
        self._pending: list[dict[str, Any]] = []

    @property
    def output(self) -> list[dict[str, Any]]:
        """The items closed so far, as the response's ``output`` holds them."""
        return list(self._done)

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        obj = response_object(self._head, "in_progress")
        return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]

    def feed(self, choice: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk's choice."""
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
        delta = choice.get("delta") or {}
        self._pending += [dict(lp) for lp in (choice.get("logprobs") or {}).get("content") or ()]
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            events += self._content(delta["content"])
        calls: dict[int, list[Mapping[str, Any]]] = {}
        for call in delta.get("tool_calls") or ():
            calls.setdefault(call["index"], []).append(call)
        for index, fragments in calls.items():
            events += self._call(index, fragments)
        return events

    def finish(self, usage: Mapping[str, Any] | None, service_tier: str | None = None) -> list[dict[str, Any]]:
        """The open item closed, then ``response.completed`` or ``response.incomplete`` with
        the whole response (``usage``: the chat stream's, chat's shape)."""
        events = self._close()
        status = status_of(self._finish_reason)
        obj = response_object(self._head, status, self._done, usage, service_tier=service_tier)
        events.append(self._event(f"response.{status}", response=obj))
        return events

    def fail(self, error: BallastError) -> list[dict[str, Any]]:
        """``response.failed``: the response with what was closed before ``error``, and the error."""
        obj = response_object(self._head, "failed", self._done, error=error_of(error))
        return [self._event("response.failed", response=obj)]

    # ------------------------------------------------------------------ the open item

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = self._switch_to("reasoning")
        item = self._item()
        item.text += text
        return [*events, self._event("response.reasoning_text.delta", **self._at(item), content_index=0, delta=text)]

    def _content(self, text: str) -> list[dict[str, Any]]:
        events = self._switch_to("message")
        item = self._item()
        item.text += text
        logprobs, self._pending = self._pending, []
        item.logprobs += logprobs
        delta = self._event(
            "response.output_text.delta",
            **self._at(item),
            content_index=0,
            delta=text,
            logprobs=[delta_logprob(lp) for lp in logprobs],
        )
        return [*events, delta]

    def _call(self, index: int, fragments: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        functions = [f["function"] for f in fragments if f.get("function") is not None]
        if not functions:
            return []
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item.kind != "function_call" or item.call_index != index:
            first = fragments[0]
            events += self._close()
            item = self._open = _OpenItem(
                "function_call",
                self._new_id("fc"),
                len(self._done),
                call_index=index,
                call_id=first.get("id") or self._new_id("call"),
                name=functions[0].get("name") or "",
            )
            added = {**self._call_item(item), "status": "in_progress"}
            events.append(self._event("response.output_item.added", output_index=item.output_index, item=added))
        arguments = "".join(f.get("arguments") or "" for f in functions)
        if arguments:
            item.text += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._at(item), delta=arguments))
        return events

    def _switch_to(self, kind: Literal["reasoning", "message"]) -> list[dict[str, Any]]:
        """Close the open item unless it is of ``kind``; open one of ``kind``."""
        if self._open is not None and self._open.kind == kind:
            return []
        events = self._close()
        item = self._open = _OpenItem(kind, self._new_id("rs" if kind == "reasoning" else "msg"), len(self._done))
        if kind == "reasoning":
            added: dict[str, Any] = {"id": item.id, "type": "reasoning", "summary": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            added = {"id": item.id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._event("response.output_item.added", output_index=item.output_index, item=added))
        events.append(self._event("response.content_part.added", **self._at(item), content_index=0, part=part))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The open item's ``.done`` events and ``response.output_item.done``; none open, none."""
        item, self._open = self._open, None
        if item is None:
            return []
        at = self._at(item)
        if item.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": item.text}
            done: dict[str, Any] = {
                "id": item.id,
                "type": "reasoning",
                "summary": [],
                "content": [part],
                "status": "completed",
            }
            events = [
                self._event("response.reasoning_text.done", **at, content_index=0, text=item.text),
                self._event("response.content_part.done", **at, content_index=0, part=part),
            ]
        elif item.kind == "message":
            item.logprobs += self._pending  # tokens whose text never came (a stop string's)
            self._pending = []
            part = {"type": "output_text", "text": item.text, "annotations": []}
            if item.logprobs:
                part["logprobs"] = [output_logprob(lp) for lp in item.logprobs]
            done = {"id": item.id, "type": "message", "role": "assistant", "status": "completed", "content": [part]}
            events = [
                self._event(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=item.text,
                    logprobs=[delta_logprob(lp) for lp in item.logprobs],
                ),
                self._event("response.content_part.done", **at, content_index=0, part=part),
            ]
        else:
            done = {**self._call_item(item), "status": "completed"}
            events = [self._event("response.function_call_arguments.done", **at, name=item.name, arguments=item.text)]
        self._done.append(done)
        events.append(self._event("response.output_item.done", output_index=item.output_index, item=done))
        return events

    def _item(self) -> _OpenItem:
        assert self._open is not None  # _switch_to opened it
        return self._open

    @staticmethod
    def _at(item: _OpenItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.output_index}

    @staticmethod
    def _call_item(item: _OpenItem) -> dict[str, Any]:
        return {
            "id": item.id,
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.text,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
