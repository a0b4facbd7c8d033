"""What an engine honours of a call to the model, beyond what every engine does.

A call (``/v1/generate``'s or the OpenAI fronts' body as the replica gets it) may carry
fields only some engines honour: ``repetition_penalty``, ``json_schema`` (from
``response_format`` and forced tool calls) and ``keep_special_tokens`` (tool_choice
"auto") only vLLM's. The router's fronts refuse them for a primary engine
that cannot honour them (``ballast.router.openai_api.ENGINE_LIMITS``, by request field);
the resilient caller keeps a call off any backend whose engine would ignore them, so a
fallback model never answers a JSON-schema request with free text.
"""

from __future__ import annotations

from typing import Any, Mapping

#: Call fields that only these engines honour (any value sent asks for it: the fronts
#: leave neutral values out). Every other field, every engine honours.
ENGINE_ONLY_FIELDS: Mapping[str, frozenset[str]] = {
    "repetition_penalty": frozenset({"vllm"}),
    "json_schema": frozenset({"vllm"}),
    "keep_special_tokens": frozenset({"vllm"}),  # tool_choice "auto": the tool parser reads them
}


def honours(engine: str, call: Mapping[str, Any]) -> bool:
    """Whether ``engine`` honours every field of ``call``."""
    return all(engine in engines for field, engines in ENGINE_ONLY_FIELDS.items() if call.get(field) is not None)
