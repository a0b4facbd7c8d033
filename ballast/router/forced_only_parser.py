"""The tool parser of a vLLM model configured without one (``model.tool_parser`` null).

It finds no call in free text, so only calls the request forces (``tool_choice``
"required" or a named function) are read, by vLLM's standard JSON path for them; the
front refuses "auto" for such a model. Registered with vLLM's ``ToolParserManager`` as
``ballast_forced_only`` by ``ballast.router.chat_parsing`` (vLLM imports this module when
the router builds its parser).
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage, ExtractedToolCallInformation
from vllm.tool_parsers.abstract_tool_parser import ToolParser


class ForcedOnlyToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str, request: Any) -> Any:
        return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str, *_: Any) -> Any:
        return DeltaMessage(content=delta_text) if delta_text else None
