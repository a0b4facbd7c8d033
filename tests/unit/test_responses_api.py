"""The Responses API's pure layer: the request's bounds, its items as chat messages, a
chat answer as output items and a response object, the stream's events. Compared with
vLLM's own Responses pieces on the same inputs, and every object and event validated
by the official openai client's types. No app, no Ray."""

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from openai import BaseModel as OpenAIModel
from openai.types.responses import Response, ResponseFunctionCallArgumentsDoneEvent, ResponseStreamEvent
from pydantic import TypeAdapter

from ballast.config import LimitsConfig
from ballast.errors import EngineRefused, InvalidRequest, ModelUnavailable, QuotaExceeded, SchemaTooComplex
from ballast.policies.criticality import Criticality
from ballast.router import openai_api as oa
from ballast.router import responses_items as ri
from ballast.router.responses_api import BadRequest, parse_responses
from ballast.router.responses_events import ResponseStream

BASE = {"model": "toy", "input": "hi"}
ROOT = Path(__file__).resolve().parents[2]
AGENT_BODIES = json.loads((Path(__file__).parent / "data" / "agents_responses_bodies.json").read_text())
ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    "strict": True,
}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def refused(body: dict[str, Any], **kwargs: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        parse_responses(body, **kwargs)
    return e.value


# Fields sent that the client's types do not declare: OpenAI's response objects carry
# ``store``; vLLM's function_call_arguments.done carries the function's ``name``.
UNDECLARED = {Response: {"store"}, ResponseFunctionCallArgumentsDoneEvent: {"name"}}


def openai_checked(model: OpenAIModel) -> OpenAIModel:
    """``model`` (the openai client's type, which keeps unknown fields) holds no field its
    type does not declare, at any depth, but those of ``UNDECLARED``."""
    stack: list[Any] = [model]
    while stack:
        node = stack.pop()
        if isinstance(node, OpenAIModel):
            extra = set(node.model_extra or {}) - UNDECLARED.get(type(node), set())
            assert not extra, f"{type(node).__name__} has undeclared fields {sorted(extra)}"
            stack.extend(getattr(node, name) for name in type(node).model_fields)
        elif isinstance(node, list):
            stack.extend(node)
    return model


def checked_response(obj: dict[str, Any]) -> Response:
    return openai_checked(Response.model_validate(obj))  # type: ignore[return-value]


# ------------------------------------------------------------------------------ bounds


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input.0"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"content": "no role, no type"}]}, "input.0.type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"role": "user", "content": "a", "extra": 1}]}, "input.0.extra"),
        ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f g", "arguments": "{}"}]}, "input.0.name"),
        ({"input": [{"type": "function_call_output", "call_id": "c" * 257, "output": "5"}]}, "input.0.call_id"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input.0.encrypted_content"),
        ({"tools": [{"type": "web_search", "search_context_size": "low"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        ({"tools": [{**ADD_TOOL, "name": "no spaces"}]}, "tools.0.name"),
        ({"tools": [ADD_TOOL, ADD_TOOL]}, "tools"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tool_choice": "any"}, "tool_choice"),
        ({"tools": [ADD_TOOL], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"text": {"format": {"type": "json_object", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"include": ["file_search_call.results"]}, "include.0"),
        ({"include": ["message.output_text.logprobs"] * 9}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"previous_response_id": "resp_XYZ"}, "previous_response_id"),
        ({"previous_response_id": "resp_" + "a" * 65}, "previous_response_id"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"user": "u" * 257}, "user"),
        ({"service_tier": "scale"}, "service_tier"),
        ({"criticality": "urgent"}, "criticality"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"model": ""}, "model"),
        ({"temprature": 1}, "temprature"),
    ],
)
def test_each_fault_is_a_bad_request_naming_its_field(fields: dict[str, Any], field: str) -> None:
    e = refused({**BASE, **fields})
    assert type(e) is BadRequest and e.status == 400
    assert e.field == field and e.message.startswith(f"{field}: ")


def test_an_unserved_item_or_tool_is_named_by_its_type() -> None:
    assert "'web_search_call' is not served" in refused({**BASE, "input": [{"type": "web_search_call"}]}).message
    assert (
        "only function tools are served; got 'web_search'"
        in refused({**BASE, "tools": [{"type": "web_search"}]}).message
    )


def test_neutral_values_of_unserved_fields_pass() -> None:
    req = parse_responses({**BASE, "background": False, "conversation": None, "prompt": None, "include": []})
    assert req.include == [] and not req.wants_logprobs


def test_input_items_are_bounded_by_the_configured_count_before_they_are_read() -> None:
    items = [{"role": "user", "content": "x"}] * 4
    assert len(parse_responses({**BASE, "input": items}, max_items=4).input) == 4
    e = refused({**BASE, "input": [*items, 7]}, max_items=4)  # the bad fifth item is never read
    assert e.field == "input" and e.message == "input: at most 4 items"
    assert refused({**BASE, "input": [{"role": "user", "content": "x"}] * 257}).message == "input: at most 256 items"


def test_schemas_and_arguments_are_held_to_the_configured_limits() -> None:
    limits = LimitsConfig(max_schema_depth=4, max_json_depth=8)
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(4):
        deep = {"type": "object", "properties": {"a": deep}}
    fmt = {"format": {"type": "json_schema", "name": "deep", "schema": deep}}
    for fields, field in ((({"text": fmt}), "text.format"), ({"tools": [{**ADD_TOOL, "parameters": deep}]}, "tools")):
        e = refused({**BASE, **fields}, limits=limits)
        assert isinstance(e, SchemaTooComplex) and e.field == field and "deep; the limit is 4" in e.message
    call = {"type": "function_call", "call_id": "c", "name": "add", "arguments": "[" * 9 + "]" * 9}
    e = refused({**BASE, "input": [{"role": "user", "content": "q"}, call]}, limits=limits)
    assert type(e) is BadRequest and e.field == "input.1.arguments" and "nested 9 deep; the limit is 8" in e.message
    tools = [{**ADD_TOOL, "name": f"f{i}"} for i in range(129)]
    e = refused({**BASE, "tools": tools})
    assert isinstance(e, SchemaTooComplex) and e.message == "tools: at most 128 tools"


def test_a_bad_request_survives_pickling_with_its_field() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(refused({**BASE, "truncation": "auto"})))
    assert isinstance(e, BadRequest) and e.field == "truncation" and e.body()["error"]["field"] == "truncation"


def test_batch_metadata_keeps_the_bounds_it_shares_with_responses() -> None:
    from ballast.router.batches import _checked_create

    body = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    assert _checked_create({**body, "metadata": {"k": "v"}}).metadata == {"k": "v"}
    with pytest.raises(BadRequest) as e:
        _checked_create({**body, "metadata": {"k" * 65: "v"}})
    assert e.value.field == "metadata" and "keys of at most 64 characters" in e.value.message


# ------------------------------------------------------------- the openai-agents SDK


@pytest.mark.parametrize("body", AGENT_BODIES, ids=range(len(AGENT_BODIES)))
def test_what_the_agents_sdk_sends_is_accepted_and_becomes_a_chat_body(body: dict[str, Any]) -> None:
    req = parse_responses(body)
    chat = oa.parse_chat(ri.to_chat(req))
    assert chat.model == "tiny" and chat.messages[0].role == "system"  # the agent's instructions
    assert chat.stream == bool(body.get("stream"))
    assert len(chat.tools or ()) == len(body.get("tools") or ())


def test_the_agents_sdk_replay_of_a_tool_turn_becomes_chat_messages() -> None:
    second_run = next(b for b in AGENT_BODIES if len(b["input"]) == 5)  # the first run's items and a new question
    messages = ri.to_chat(parse_responses(second_run))["messages"]
    assert messages == [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 3+4?"},
    ]


def test_the_agents_sdk_settings_reach_the_chat_body() -> None:
    tuned = next(b for b in AGENT_BODIES if b.get("metadata"))
    chat = ri.to_chat(parse_responses(tuned))
    assert {k: chat[k] for k in ("max_tokens", "temperature", "top_p", "tool_choice", "parallel_tool_calls")} == {
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    assert oa.parse_chat(chat).template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert chat["tools"][0]["function"]["strict"] is True
    assert oa.logprobs_of(oa.parse_chat(chat)) == (2, None)


AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"


@pytest.mark.skipif(not AGENTS_PYTHON.exists(), reason="the openai-agents environment (.venv-agents) is not installed")
def test_the_recorded_agents_bodies_are_what_the_installed_sdk_sends() -> None:
    script = Path(__file__).parent / "data" / "make_agents_responses_bodies.py"
    run = subprocess.run([str(AGENTS_PYTHON), str(script), "--stdout"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == AGENT_BODIES


# ------------------------------------------------------------------ items <-> messages

RICH_INPUT = [
    {
        "role": "developer",
        "content": [{"type": "input_text", "text": "Use "}, {"type": "input_text", "text": "tools."}],
    },
    {"role": "user", "content": "What is 2+3 and 4+5?"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add twice"}]},
    {
        "type": "function_call",
        "call_id": "c1",
        "name": "add",
        "arguments": '{"a":2,"b":3}',
        "id": "fc_1",
        "status": "completed",
    },
    {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":4,"b":5}'},
    {"type": "function_call_output", "call_id": "c1", "output": "5"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "9"}]},
    {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "5 and 9", "annotations": []}],
    },
    {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
]


def vllm_messages(body: dict[str, Any], previous: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages`` on ``body`` as vLLM parses it, in chat's terms:
    text parts joined (chat joins them too) and the ``reasoning`` key it sets left out
    (chat messages have no such field; Ballast does not replay reasoning)."""
    utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
    protocol = pytest.importorskip("vllm.entrypoints.openai.responses.protocol")
    req = protocol.ResponsesRequest.model_validate(body)
    out = []
    for m in utils.construct_input_messages(
        request_instructions=req.instructions, request_input=req.input, prev_msg=previous
    ):
        m = {k: v for k, v in dict(m).items() if k in ("role", "content", "tool_calls", "tool_call_id")}
        if isinstance(m.get("content"), list):
            m["content"] = "".join(part["text"] for part in m["content"])
        if "tool_calls" in m:
            m["tool_calls"] = [dict(c, function=dict(c["function"])) for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize(
    ("body", "previous"),
    [
        ({"model": "toy", "input": "Hello"}, None),
        ({"model": "toy", "instructions": "Be brief.", "input": RICH_INPUT}, None),
        (
            {"model": "toy", "instructions": "Be brief.", "input": RICH_INPUT},
            [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}],
        ),
    ],
)
def test_input_items_become_the_messages_vllm_builds(body: dict[str, Any], previous: Any) -> None:
    ours = ri.to_chat(parse_responses(body), previous)["messages"]
    assert ours == vllm_messages(body, previous)
    oa.parse_chat({"model": "toy", "messages": ours})


def test_rich_input_as_chat_messages() -> None:
    messages = ri.input_messages(parse_responses({**BASE, "input": RICH_INPUT}))
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert messages[0]["content"] == "Use tools." and messages[4] == {
        "role": "tool",
        "tool_call_id": "c2",
        "content": "9",
    }
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # two calls, one assistant turn


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.responses.protocol")
    for effort in ("none", "low", "high"):
        body = {**BASE, "reasoning": {"effort": effort}}
        ours = oa.parse_chat(ri.to_chat(parse_responses(body))).template_kwargs
        theirs = protocol.ResponsesRequest.model_validate(body).build_chat_params(None, "auto").chat_template_kwargs
        assert ours == {k: theirs[k] for k in ("reasoning_effort", "enable_thinking")}


def test_the_chat_body_carries_every_served_field() -> None:
    body = {
        **BASE,
        "tools": [ADD_TOOL],
        "tool_choice": {"type": "function", "name": "add"},
        "text": {"format": {"type": "json_schema", "name": "sum", "schema": {"type": "object"}, "strict": True}},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 3,
        "max_output_tokens": 50,
        "stream": True,
        "user": "u1",
        "service_tier": "flex",
        "criticality": "sheddable",
        "store": True,
        "metadata": {"k": "v"},
        "previous_response_id": "resp_" + "0" * 48,
    }
    chat = ri.to_chat(parse_responses(body))
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "sum", "schema": {"type": "object"}, "strict": True},
    }
    assert chat["stream_options"] == {"include_usage": True}
    assert "store" not in chat and "metadata" not in chat  # the Responses front's own, not chat's
    parsed = oa.parse_chat(chat)
    assert oa.logprobs_of(parsed) == (3, None) and oa.max_tokens_of(parsed) == 50
    assert parsed.criticality is Criticality.SHEDDABLE and parsed.service_tier == "flex" and parsed.user == "u1"
    assert parsed.response_format is not None and parsed.response_format.schema_text() == '{"type":"object"}'
    json_object = ri.to_chat(parse_responses({**BASE, "text": {"format": {"type": "json_object"}}}))
    assert json_object["response_format"] == {"type": "json_object"}
    assert "response_format" not in ri.to_chat(parse_responses({**BASE, "text": {"format": {"type": "text"}}}))


def test_top_logprobs_without_include_asks_for_nothing_as_on_vllm() -> None:
    chat = ri.to_chat(parse_responses({**BASE, "top_logprobs": 5}))
    assert "logprobs" not in chat and oa.logprobs_of(oa.parse_chat(chat)) == (None, None)


def test_no_tools_no_choice() -> None:
    chat = ri.to_chat(parse_responses({**BASE, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}))
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(chat)
    oa.parse_chat(chat)


def test_a_conversation_past_the_message_bound_names_the_chain() -> None:
    previous = [{"role": "user", "content": "x"}] * oa.MAX_MESSAGES
    with pytest.raises(BadRequest) as e:
        ri.to_chat(parse_responses(BASE), previous)
    assert e.value.field == "previous_response_id" and f"at most {oa.MAX_MESSAGES}" in e.value.message


# ---------------------------------------------------------------- output items, response

CALL = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
CHAT_LOGPROBS = [
    {
        "token": "5",
        "logprob": -0.1,
        "bytes": [53],
        "top_logprobs": [
            {"token": "5", "logprob": -0.1, "bytes": [53]},
            {"token": "6", "logprob": -2.5, "bytes": [54]},
        ],
    },
    {"token": "!", "logprob": -0.7, "bytes": None, "top_logprobs": []},
]


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_output_items_are_what_vllm_builds_from_the_same_answer() -> None:
    utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
    base = pytest.importorskip("vllm.entrypoints.generate.base.protocol")
    from openai.types.responses.response_output_text import Logprob

    parts = ri.AnswerParts(reasoning="add them", content="5!", logprobs=tuple(CHAT_LOGPROBS), tool_calls=(CALL,))
    ours = ri.output_items(parts)
    theirs = utils.build_response_output_items(
        reasoning="add them",
        content="5!",
        tool_calls=[base.FunctionCall(id=CALL["id"], **CALL["function"])],
        logprobs=[Logprob.model_validate(ri.output_logprob(lp)) for lp in CHAT_LOGPROBS],
    )
    assert without_ids(ours) == without_ids([item.model_dump(mode="json", exclude_none=True) for item in theirs])
    assert [item["id"][:3] for item in ours] == ["rs_", "msg", "fc_"]
    assert ours[1]["content"][0]["logprobs"][1]["bytes"] == [33]  # "!" without bytes: its UTF-8


def test_a_chat_choice_gives_its_parts() -> None:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [CALL]},
        "finish_reason": "tool_calls",
    }
    parts = ri.AnswerParts.of_choice(choice)
    assert parts == ri.AnswerParts(reasoning="hmm", content=None, logprobs=None, tool_calls=(CALL,))
    assert [item["type"] for item in ri.output_items(parts)] == ["reasoning", "function_call"]


def fixed_clock() -> float:
    return 1_700_000_000.7


def test_the_response_object_is_an_openai_response() -> None:
    body = {**BASE, "instructions": "Be brief.", "tools": [ADD_TOOL], "metadata": {"k": "v"}, "temperature": 0.5}
    body |= {"reasoning": {"effort": "low"}, "text": {"format": {"type": "json_object"}}, "max_output_tokens": 9}
    req = parse_responses(body)
    head = ri.response_head(req, "toy", clock=fixed_clock)
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    output = ri.output_items(ri.AnswerParts(content="5", tool_calls=(CALL,)))
    obj = ri.response_object(head, ri.status_of("stop"), output, usage, service_tier="default")
    response = checked_response(obj)
    assert response.id.startswith("resp_") and len(response.id) == 5 + 48 and int(response.id[5:], 16) >= 0
    assert response.created_at == 1_700_000_000 and response.status == "completed" and response.model == "toy"
    assert response.output_text == "5" and response.output[1].type == "function_call"
    assert response.usage is not None and response.usage.input_tokens == 7 and response.usage.total_tokens == 10
    assert response.usage.input_tokens_details.cached_tokens == 4 and response.usage.output_tokens == 3
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"} and response.temperature == 0.5
    assert response.tools[0].name == "add" and response.tool_choice == "auto" and response.parallel_tool_calls
    assert response.reasoning is not None and response.reasoning.effort == "low" and response.max_output_tokens == 9
    assert response.text is not None and response.text.format is not None and response.text.format.type == "json_object"
    assert obj["store"] is True and response.truncation == "disabled" and response.service_tier == "default"


def test_an_answer_cut_at_max_output_tokens_is_incomplete() -> None:
    head = ri.response_head(parse_responses(BASE), "toy", clock=fixed_clock)
    usage = {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}
    obj = ri.response_object(head, ri.status_of("length"), ri.output_items(ri.AnswerParts(content="12345")), usage)
    response = checked_response(obj)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"


def test_a_named_choice_and_a_schema_are_echoed_in_openai_shapes() -> None:
    fmt = {"type": "json_schema", "name": "sum", "schema": {"type": "object"}, "strict": True}
    req = parse_responses(
        {**BASE, "tools": [ADD_TOOL], "tool_choice": {"type": "function", "name": "add"}, "text": {"format": fmt}}
    )
    response = checked_response(ri.response_object(ri.response_head(req, "toy"), "completed"))
    assert response.tool_choice.type == "function" and response.tool_choice.name == "add"  # type: ignore[union-attr]
    assert response.text is not None and response.text.format is not None
    assert response.text.format.model_dump(by_alias=True, exclude_none=True) == fmt


# ------------------------------------------------------------------- conversations


def test_a_three_turn_chain_keeps_calls_and_answers_and_drops_the_instructions() -> None:
    turn1 = parse_responses({**BASE, "instructions": "Be brief.", "input": "2+3?", "tools": [ADD_TOOL]})
    sent1 = ri.input_messages(turn1)
    out1 = ri.output_items(ri.AnswerParts(reasoning="use add", tool_calls=(CALL,)))
    stored1 = ri.conversation_after(None, sent1, out1)
    assert stored1 == [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]

    result = {"type": "function_call_output", "call_id": CALL["id"], "output": "5"}
    turn2 = parse_responses({**BASE, "instructions": "Answer in words.", "input": [result], "tools": [ADD_TOOL]})
    chat2 = ri.to_chat(turn2, stored1)
    assert chat2["messages"][0] == {"role": "system", "content": "Answer in words."}
    assert chat2["messages"][1:] == [*stored1, {"role": "tool", "tool_call_id": CALL["id"], "content": "5"}]
    oa.parse_chat(chat2)  # the tool result answers a call the conversation holds
    stored2 = ri.conversation_after(stored1, ri.input_messages(turn2), ri.output_items(ri.AnswerParts(content="five")))

    turn3 = parse_responses({**BASE, "input": "and 4+5?"})
    messages = ri.to_chat(turn3, stored2)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[3] == {"role": "assistant", "content": "five"} and "Be brief." not in json.dumps(messages)
    oa.parse_chat({"model": "toy", "messages": messages})


def test_an_answer_with_nothing_to_say_is_kept_as_empty_text() -> None:
    kept = ri.conversation_after([], [{"role": "user", "content": "q"}], ri.output_items(ri.AnswerParts(reasoning="r")))
    assert kept[-1] == {"role": "assistant", "content": ""}
    oa.parse_chat({"model": "toy", "messages": kept})


# --------------------------------------------------------------------------- events


def chunk(
    content: str | None = None,
    reasoning: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    """A choice of a chat chunk as Ballast's chat front streams it (``openai_answers.ChunkChoice``)."""
    delta = {"content": content, "reasoning_content": reasoning, "tool_calls": calls}
    out: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        out["logprobs"] = {"content": logprobs}
    return out


def call_delta(index: int, call_id: str | None = None, name: str | None = None, args: str = "") -> dict[str, Any]:
    fragment: dict[str, Any] = {"index": index, "function": {"name": name, "arguments": args}}
    if call_id is not None:
        fragment |= {"id": call_id, "type": "function"}
    return fragment


# Reasoning, then text with log-probabilities (one chunk holding both), then two calls.
STREAM = [
    chunk(content=""),  # the role chunk: opens nothing
    chunk(reasoning="Add "),
    chunk(reasoning="them.", content="Calling", logprobs=CHAT_LOGPROBS[:1]),
    chunk(content=" add", logprobs=CHAT_LOGPROBS[1:]),
    chunk(calls=[call_delta(0, "call_a", "add", '{"a":')]),
    chunk(calls=[call_delta(0, args="2}"), call_delta(1, "call_b", "add", "")]),
    chunk(calls=[call_delta(1, args='{"a":4}')], finish="tool_calls"),
]


def run_stream(
    choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], ResponseStream]:
    head = ri.response_head(parse_responses({**BASE, "stream": True}), "toy", clock=fixed_clock)
    stream = ResponseStream(head)
    events = stream.start()
    for choice in choices:
        events += stream.feed(choice)
    return events + stream.finish(usage), stream


def test_stream_events_in_order_each_an_openai_event() -> None:
    events, stream = run_stream(STREAM, {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17})
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # call 0
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # call 1
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        openai_checked(STREAM_EVENT.validate_python(event))
    text_deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["logprobs"][0]["token"] for e in text_deltas] == ["5", "!"]
    assert text_deltas[0]["logprobs"][0]["top_logprobs"] == [
        {"token": "5", "logprob": -0.1},
        {"token": "6", "logprob": -2.5},
    ]
    calls_done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"], e["output_index"]) for e in calls_done] == [
        ("add", '{"a":2}', 2),
        ("add", '{"a":4}', 3),
    ]
    final = checked_response(events[-1]["response"])
    assert final.status == "completed" and final.usage is not None and final.usage.total_tokens == 17
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == events[-1]["response"]["output"]
    assert final.output_text == "Calling add" and stream.output == events[-1]["response"]["output"]
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert [getattr(item, "call_id", None) for item in final.output[2:]] == ["call_a", "call_b"]
    created = checked_response(events[0]["response"])
    assert created.status == "in_progress" and created.output == [] and created.usage is None


def test_log_probabilities_of_held_back_text_come_with_the_text_or_the_message() -> None:
    lp = [{**CHAT_LOGPROBS[1], "token": t} for t in "abcd"]
    held = [
        chunk(content="a", logprobs=lp[:1]),
        chunk(logprobs=lp[1:2]),  # "b" held back (a stop string may begin here)
        chunk(content="bc", logprobs=lp[2:3]),
        chunk(logprobs=lp[3:], finish="stop"),  # "d" began the stop string: never sent
    ]
    events, _ = run_stream(held, None)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in e["logprobs"]] for e in deltas] == [["a"], ["b", "c"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [x["token"] for x in done["logprobs"]] == ["a", "b", "c", "d"]
    final = checked_response(events[-1]["response"])
    text = final.output[0].content[0]  # type: ignore[union-attr]
    assert [x.token for x in text.logprobs] == ["a", "b", "c", "d"]  # type: ignore[union-attr]


def test_a_stream_cut_at_max_output_tokens_ends_incomplete() -> None:
    events, _ = run_stream([chunk(content="1234"), chunk(content="5", finish="length")], None)
    assert events[-1]["type"] == "response.incomplete"
    response = checked_response(STREAM_EVENT.validate_python(events[-1]).response.model_dump())  # type: ignore[union-attr]
    assert response.status == "incomplete" and response.output_text == "12345"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ModelUnavailable("no replica can answer"), "server_error"),
        (QuotaExceeded("tokens spent"), "rate_limit_exceeded"),
        (EngineRefused("the schema does not compile", field="text.format"), "invalid_prompt"),
    ],
)
def test_a_failed_stream_carries_the_error_and_what_was_said(error: Any, code: str) -> None:
    head = ri.response_head(parse_responses(BASE), "toy", clock=fixed_clock)
    stream = ResponseStream(head)
    events = [*stream.start(), *stream.feed(chunk(content="partial")), *stream.fail(error)]
    failed = openai_checked(STREAM_EVENT.validate_python(events[-1]))
    assert failed.type == "response.failed" and events[-1]["sequence_number"] == len(events) - 1  # type: ignore[union-attr]
    response = checked_response(events[-1]["response"])
    assert response.status == "failed" and response.error is not None and response.error.code == code
    assert response.error.type == error.code and response.error.message == error.message
    assert response.error.param == (getattr(error, "field", None) or None)
    assert response.output == []  # the open message never closed


def test_the_stream_makes_the_events_vllms_processor_makes() -> None:
    """The same deltas through vLLM's ``SimpleStreamingEventProcessor``, driven as its
    serving loop drives it; the events compared without ids and sequence numbers (vLLM
    numbers them in its serving loop). Two differences are Ballast's on purpose (module
    docstring): output_text.done carries the log-probabilities, and the end event."""
    events_mod = pytest.importorskip("vllm.entrypoints.openai.responses.streaming_events")
    base = pytest.importorskip("vllm.entrypoints.generate.base.protocol")
    from openai.types.responses.response_output_text import Logprob

    processor = events_mod.SimpleStreamingEventProcessor()
    theirs: list[dict[str, Any]] = []
    for choice in STREAM:
        d = choice["delta"]
        calls = [
            base.DeltaToolCall(
                index=c["index"], id=c.get("id"), type=c.get("type"), function=base.DeltaFunctionCall(**c["function"])
            )
            for c in d["tool_calls"] or ()
        ]
        message = base.DeltaMessage(content=d["content"], reasoning=d["reasoning_content"], tool_calls=calls)
        lps = [
            Logprob.model_validate(ri.output_logprob(lp)) for lp in (choice.get("logprobs") or {}).get("content", [])
        ]
        for dm in events_mod.split_delta(message):
            target, call = processor.resolve_target_state(dm)
            if target == events_mod._StateType.NONE:
                continue
            if processor.needs_transition(target, call):
                theirs += [e.model_dump(mode="json", exclude_none=True) for e in processor.close_current()]
                theirs += [e.model_dump(mode="json", exclude_none=True) for e in processor.open(target, call)]
            emitted = processor.emit_delta(dm, None, lambda _output, lps=lps: lps)
            theirs += [e.model_dump(mode="json", exclude_none=True) for e in emitted]
    theirs += [e.model_dump(mode="json", exclude_none=True) for e in processor.close_current()]

    ours, _ = run_stream(STREAM, {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17})
    ours = ours[2:-1]  # vLLM's serving loop makes created, in_progress and completed

    def comparable(event: dict[str, Any]) -> dict[str, Any]:
        event = json.loads(json.dumps(event))
        event.pop("sequence_number", None)
        event.pop("item_id", None)
        if event["type"] == "response.output_text.done":
            event["logprobs"] = []  # vLLM sends none here
        item = event.get("item")
        if item is not None:
            item.pop("id", None)
            for part in item.get("content") or ():
                part.setdefault("annotations", [])
        return {k: v for k, v in event.items() if v is not None}

    assert [comparable(e) for e in ours] == [comparable(e) for e in theirs]
    assert len(ours) == 23
