"""What an engine honours of a call to the model, beyond what every engine does: one table.

A call (``ballast.model.protocol.ModelCall``) may ask for things only some engines
honour: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``json_schema`` (from ``response_format`` and forced
tool calls), ``structural_tag`` (tool calls in the model's own format),
``keep_special_tokens`` (the tool parser reads the model's markers) and ``adapter`` (a
LoRA adapter, named by the request's ``model``: the router resolves that field itself,
so no request field asks for it here), only vLLM's.
``ENGINE_ONLY`` says, by call field, which engines honour it and which request fields ask
for it (with each one's neutral value, which asks for nothing). Two readers:

* the fronts refuse a request field that asks for what the primary's engine cannot
  honour, with 400 naming it (``unhonoured_request_fields``);
* the resilient caller keeps a call off any backend whose engine would ignore part of
  it (``honours``), so a fallback model never answers a JSON-schema request with free
  text.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class EngineOnly:
    """A call field only ``engines`` honour, and the request fields that ask for it
    (each with its neutral value: sent at that value, it asks for nothing)."""

    engines: frozenset[str]
    asked_by: Mapping[str, Any]


#: Call fields that only some engines honour. Every other field, every engine honours.
ENGINE_ONLY: Mapping[str, EngineOnly] = {
    "repetition_penalty": EngineOnly(frozenset({"vllm"}), {"repetition_penalty": 1.0}),
    "presence_penalty": EngineOnly(frozenset({"vllm"}), {"presence_penalty": 0}),
    "frequency_penalty": EngineOnly(frozenset({"vllm"}), {"frequency_penalty": 0}),
    "logit_bias": EngineOnly(frozenset({"vllm"}), {"logit_bias": None}),
    "json_schema": EngineOnly(frozenset({"vllm"}), {"response_format": None, "tools": None}),
    "structural_tag": EngineOnly(frozenset({"vllm"}), {"tools": None}),
    "keep_special_tokens": EngineOnly(frozenset({"vllm"}), {"tools": None}),
    "adapter": EngineOnly(frozenset({"vllm"}), {}),
    # No call field: the router renders the chat, through the model's own template (the
    # transformers and vLLM engines'); the built-in template takes no variables.
    "chat_template": EngineOnly(frozenset({"transformers", "vllm"}), {"chat_template_kwargs": None}),
}


def honours(engine: str, asks: Iterable[str]) -> bool:
    """Whether ``engine`` honours every call field in ``asks`` (``ModelCall.asks``)."""
    return all(engine in ENGINE_ONLY[f].engines for f in asks if f in ENGINE_ONLY)


@functools.cache  # a few engine names; read on every OpenAI request
def unhonoured_request_fields(engine: str) -> Mapping[str, Any]:
    """The request fields that ask for something ``engine`` cannot honour, each with its
    neutral value, in the table's order (each field once); read-only."""
    fields: dict[str, Any] = {}
    for only in ENGINE_ONLY.values():
        if engine not in only.engines:
            for name, neutral in only.asked_by.items():
                fields.setdefault(name, neutral)
    return MappingProxyType(fields)
