"""Writes agents_responses_bodies.json: the ``POST /v1/responses`` bodies the openai-agents
SDK's default model class (``OpenAIResponsesModel``) sends, recorded without a server.

The SDK runs real agents against an ``AsyncOpenAI`` client whose transport records each
request and answers with a minimal response object (a call of ``add`` while the input holds
no result, then the text "5"; streams are refused once recorded): a tool agent's two turns,
a second run replaying the first's items, a typed-output agent (``text.format`` json_schema),
an agent with every model setting Ballast serves, and a streamed run. Regenerate with
``.venv-agents/bin/python tests/unit/data/make_agents_responses_bodies.py`` (the environment
of requirements/agents.txt; the unit test reads the JSON, and compares a fresh recording with
it when that environment is there).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx2 as httpx  # the openai client of requirements/agents.txt is built on httpx2
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from openai.types.shared import Reasoning
from pydantic import BaseModel

OUT = Path(__file__).parent / "agents_responses_bodies.json"
bodies: list[dict[str, Any]] = []


def _reply(body: dict[str, Any]) -> dict[str, Any]:
    answered = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body["input"])
    if body.get("tools") and not answered:
        item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": '{"a":2,"b":3}'}
        output: list[dict[str, Any]] = [{**item, "status": "completed"}]
    else:
        typed = body.get("text", {}).get("format", {}).get("type") == "json_schema"
        part = {"type": "output_text", "text": '{"answer": 5}' if typed else "5", "annotations": []}
        output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [part]}]
    usage = {
        "input_tokens": 1,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 2,
    }
    return {
        "id": f"resp_{len(bodies):048x}",
        "object": "response",
        "created_at": 0,
        "model": body["model"],
        "status": "completed",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": output,
        "usage": usage,
    }


def _record(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    bodies.append(body)
    if body.get("stream"):
        return httpx.Response(500, json={"error": {"message": "recorded"}})
    return httpx.Response(200, json=_reply(body))


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Answer(BaseModel):
    answer: int


async def _run() -> None:
    transport = httpx.MockTransport(_record)
    client = AsyncOpenAI(base_url="http://recorder/v1", api_key="k", http_client=httpx.AsyncClient(transport=transport))
    set_default_openai_client(client, use_for_tracing=False)
    set_tracing_disabled(True)
    calc = Agent(name="calc", instructions="Use the add tool.", model="tiny", tools=[add])
    first = await Runner.run(calc, "What is 2+3?")
    await Runner.run(calc, [*first.to_input_list(), {"role": "user", "content": "And 3+4?"}])
    await Runner.run(
        Agent(name="typed", instructions="Answer as JSON.", model="tiny", output_type=Answer), "What is 2+3?"
    )
    settings = ModelSettings(
        temperature=0.2,
        top_p=0.9,
        max_tokens=64,
        tool_choice="required",
        parallel_tool_calls=False,
        top_logprobs=2,
        store=True,
        metadata={"run": "r1"},
        reasoning=Reasoning(effort="low"),
        truncation="disabled",
    )
    tuned = Agent(name="calc", instructions="Use the add tool.", model="tiny", tools=[add], model_settings=settings)
    await Runner.run(tuned, "What is 2+3?", max_turns=2)
    streamed = Runner.run_streamed(calc, "What is 2+3?")
    try:
        async for _ in streamed.stream_events():
            pass
    except Exception:  # the recorder refuses the stream once it has its body
        pass


def record() -> list[dict[str, Any]]:
    asyncio.run(_run())
    return bodies


if __name__ == "__main__":
    recorded = record()
    if sys.argv[1:] == ["--stdout"]:
        print(json.dumps(recorded))
    else:
        OUT.write_text(json.dumps(recorded, indent=1) + "\n")
