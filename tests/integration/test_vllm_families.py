"""A second model family on vLLM: Llama 3.1's JSON tool calls and a reasoning parser.

For this module the session's stack is replaced by one whose primary model is a tiny
random Llama with the demo's ``llama3`` tokenizer and template (``ballast.model.demo``:
header markers, ``<|eot_id|>``, calls as ``{"name": ..., "parameters": ...}``, a tool's
result as an ``ipython`` turn, thinking opened by the generation prompt or written closed
with ``enable_thinking: false``), read by vLLM's ``llama3_json`` tool parser and
``deepseek_r1`` reasoning parser; put back after. Through the official ``openai``
client: a forced call streamed is the unary call, with the parser's ids; the call and its
result go back on the next turn, rendered by vLLM's renderer as transformers renders the
template; the thinking lands in ``reasoning_content`` (unary and streamed), split where the
model wrote ``</think>``, and a prompt that closed it is answered as content.
"""

from __future__ import annotations

import json

import openai
import pytest

pytest.importorskip("vllm")

import conftest as integration  # noqa: E402
from conftest import BASE, GOLD, _deploy, _merge  # noqa: E402
from test_vllm import vllm_overrides  # noqa: E402

from ballast.model.demo import VLLM_GEOMETRY, make_llama  # noqa: E402

pytestmark = pytest.mark.integration
# Deploys a stack of its own and leaves it running (conftest.py: the default comes back once).
OWN_STACK = True

MODEL = "tiny-llama3"
KEY = GOLD["Authorization"].split()[1]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(ballast, tmp_path_factory):
    from ballast.config import load_config

    ckpt = make_llama(tmp_path_factory.mktemp("llama3") / MODEL, family="llama3", **VLLM_GEOMETRY)
    over = vllm_overrides(ckpt)
    over["model"] = {**over["model"], "name": MODEL, "tool_parser": "llama3_json", "reasoning_parser": "deepseek_r1"}
    _deploy(load_config(_merge(integration.test_config_dict(), over)), MODEL)
    yield ckpt


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt, local_files_only=True)


@pytest.fixture
def oai(ckpt):
    with openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _reassembled(chunks) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] = (d.function.name if d.function else None) or call["name"]
            call["arguments"] += (d.function.arguments if d.function else None) or ""
    return [calls[i] for i in sorted(calls)], finish


def test_a_forced_llama3_call_streams_as_the_unary_call_and_goes_back_with_its_result(oai, tok):
    ask = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the answer
        max_tokens=60,
        seed=3,
        extra_body=NO_THINKING,
    )
    whole = oai.chat.completions.create(**ask)
    (call,) = whole.choices[0].message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and whole.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    calls, finish = _reassembled(oai.chat.completions.create(**ask, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call.function.name, json.loads(call.function.arguments))
    ]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and finish == "tool_calls"

    # The call and its result go back: the template writes them as Llama 3 does (the
    # call's JSON, an ipython turn), the prompt counted as transformers renders it.
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "20 degrees and sunny"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER], max_tokens=8, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered_turns = json.loads(json.dumps(turns))
    rendered_turns[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    rendered = tok.apply_chat_template(
        rendered_turns, tools=[WEATHER], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n20 degrees and sunny<|eot_id|>" in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_the_thinking_lands_in_reasoning_content_split_where_the_model_ended_it(oai, tok):
    """The same prompt, seed and bias as a raw completion (whose text keeps ``</think>``,
    a whole token but not a special one) and as a chat: the chat's reasoning is the text
    before ``</think>``, its content the text after; a stream says the same."""
    end = tok.convert_tokens_to_ids("</think>")
    sampling = dict(max_tokens=24, seed=6, temperature=1.0, logit_bias={str(end): 5})
    rendered = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<think>\n")  # the template opened the thinking
    raw = oai.completions.create(model=MODEL, prompt=rendered[len(tok.bos_token) :], **sampling).choices[0].text
    assert "</think>" in raw, raw  # the bias makes the model end its thinking within 24 tokens
    thought, _, after = raw.partition("</think>")

    m = oai.chat.completions.create(model=MODEL, messages=ASK, **sampling).choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == (thought, after or None)
    reasoning, content = "", ""
    for chunk in oai.chat.completions.create(model=MODEL, messages=ASK, stream=True, **sampling):
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (thought, after)

    # enable_thinking false: the template wrote the thinking closed; the answer is content.
    closed = oai.chat.completions.create(model=MODEL, messages=ASK, extra_body=NO_THINKING, **sampling)
    assert closed.choices[0].message.model_extra.get("reasoning_content") is None
    assert closed.choices[0].message.content
