"""A real agent against Ballast on vLLM: the openai-agents SDK, run from its own environment
(``.venv-agents``; ``make test`` installs it) by ``tests/integration/test_vllm.py``.

``python agent_client.py BASE_URL API_KEY MODEL [chat|responses]``: one agent with one
local Python tool, run unary (``Runner.run``) and streamed (``Runner.run_streamed``: the SDK
reassembles the streamed ``delta.tool_calls`` itself), on chat completions
(``OpenAIChatCompletionsModel``) or on the SDK's default model class, the Responses API
(a model named by its name, the client set as the SDK's default). The model has random weights, so the agent is told
to call the tool (``tool_choice`` "required") and to finish with the tool's output
(``tool_use_behavior`` "stop_on_first_tool"). Prints one JSON line: each run's calls and
final output.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

CALLS: list[str] = []


@function_tool
def weather(city: Literal["Paris", "Oslo"]) -> str:
    """The weather in a city now."""
    CALLS.append(city)
    return f"20 degrees and sunny in {city}"


async def main(base: str, key: str, model: str, api: str = "chat") -> dict:
    set_tracing_disabled(True)  # no trace export: nothing leaves loopback
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    if api == "responses":
        set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[weather],
        model=model if api == "responses" else OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(  # 359 prompt tokens + 140 <= the test model's 512
            tool_choice="required", parallel_tool_calls=False, max_tokens=140, temperature=1.0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    out = {}
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    out["unary"] = {"calls": list(CALLS), "final": result.final_output}
    CALLS.clear()
    streamed = Runner.run_streamed(agent, "What is the weather in Oslo?", max_turns=3)
    async for _ in streamed.stream_events():
        pass
    out["streamed"] = {"calls": list(CALLS), "final": streamed.final_output}
    await client.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
