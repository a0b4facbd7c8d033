"""Tool calling on the OpenAI chat front (ballast.router.tool_calls): what tools and
tool_choice ask, the schema a forced call is decoded by, how an answer's text becomes
tool_calls, and the answers' shapes as the official client reads them."""

import json

import pytest

from ballast.router import openai_api as oa
from ballast.router.tool_calls import NamedToolChoice, ToolPlan, ToolRequestError, ToolSpec, plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CHAT = {"model": "toy", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def tools(*specs) -> list[ToolSpec]:
    return [ToolSpec.model_validate(s) for s in specs]


def chat(**fields) -> oa.ChatCompletionRequest:
    return oa.parse_chat({**CHAT, **fields})


def refused(**kwargs) -> ToolRequestError:
    with pytest.raises(ToolRequestError) as e:
        plan(**kwargs)
    return e.value


# ------------------------------------------------------------------------------ the plan


def test_no_tools_asks_for_nothing_and_a_choice_without_tools_is_refused():
    assert plan(None, None, None) == ToolPlan("none") and not plan([], "none", None).may_call
    err = refused(tools=None, choice="required", parallel=None)
    assert (err.field, str(err)) == ("tool_choice", "tool_choice: needs tools: name the functions in tools")


def test_a_named_function_is_decoded_by_its_parameters_schema():
    p = plan(
        tools(WEATHER, TIME),
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}),
        None,
    )
    assert (p.mode, p.name, p.schema) == ("named", "get_weather", WEATHER["function"]["parameters"])
    # A function without parameters: an empty object.
    p = plan(
        tools(WEATHER, TIME),
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}),
        None,
    )
    assert p.schema == {"type": "object", "properties": {}}
    err = refused(
        tools=tools(WEATHER),
        choice=NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}}),
        parallel=None,
    )
    assert (err.field, str(err)) == ("tool_choice", "tool_choice: no tool named 'f' in tools")


def test_required_is_an_array_of_calls_each_one_tools_name_and_parameters():
    p = plan(tools(WEATHER, TIME), "required", None)
    assert p.mode == "required" and p.schema["type"] == "array" and p.schema["minItems"] == 1
    names = [branch["properties"]["name"]["enum"] for branch in p.schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]] and "maxItems" not in p.schema
    assert plan(tools(WEATHER), "required", False).schema["maxItems"] == 1  # parallel_tool_calls false: one call


def test_auto_needs_the_models_tool_parser_and_none_keeps_the_tools_for_the_template():
    err = refused(tools=tools(WEATHER), choice=None, parallel=None)  # auto is the default with tools
    assert err.field == "tool_choice" and "model.tool_parser" in str(err)
    p = plan(tools(WEATHER), "none", None)
    assert not p.may_call and p.template_tools() == [WEATHER]
    assert refused(tools=tools(WEATHER, WEATHER), choice="required", parallel=None).field == "tools"


# ------------------------------------------------------------------ the answer's calls


def test_a_named_answer_is_one_call_of_that_function_ending_with_stop():
    p = plan(
        tools(WEATHER), NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}), None
    )
    content, calls = p.answer('{"city":"Paris"}')
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}')
    ]
    assert calls[0].id.startswith("call_") and p.finish(calls, "stop") == "stop"  # OpenAI: a forced call ends with stop


def test_a_required_answer_is_its_arrays_calls_ending_with_tool_calls():
    p = plan(tools(WEATHER, TIME), "required", None)
    content, calls = p.answer(
        '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    )
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and p.finish(calls, "stop") == "tool_calls"
    assert len({c.id for c in calls}) == 2
    # Cut short by max_tokens: no calls, the text as content, and "length".
    content, calls = p.answer('[{"name":"get_wea')
    assert (content, calls, p.finish(calls, "length")) == ('[{"name":"get_wea', [], "length")


def test_auto_finds_the_calls_with_vllms_own_parser():
    pytest.importorskip("vllm")
    from ballast.model.demo import train_tokenizer
    from ballast.router.tool_calls import ToolParser

    parser = ToolParser("hermes", train_tokenizer())
    p = plan(tools(WEATHER), "auto", None, parser)
    content, calls = p.answer(
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    assert content == "Let me look. " and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and p.finish(calls, "stop") == "tool_calls"
    assert p.answer("Sunny.") == ("Sunny.", []) and p.finish([], "stop") == "stop"
    with pytest.raises(ValueError, match="model.tool_parser"):
        ToolParser("no-such-parser", train_tokenizer())


# ----------------------------------------------------------------------- the requests


def test_a_conversation_with_tool_calls_and_results_parses():
    req = chat(
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
        ],
    )
    assert [m.calls_tools for m in req.messages] == [False, True, True]
    assert req.tool_choice == "required" and req.tools[0].function.name == "get_weather"
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert isinstance(named.tool_choice, NamedToolChoice)


@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"role": "tool", "content": "20 C"}], "messages.0.tool_call_id"),
        ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages.0.tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls"),
        ([{"role": "assistant", "content": None}], "messages.0.content"),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}],
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_a_message_with_another_roles_fields_is_refused_by_the_field(messages, field):
    with pytest.raises(oa.BadRequest) as e:
        chat(messages=messages)
    assert e.value.field == field


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_malformed_tools_are_refused_by_the_field(fields, field):
    with pytest.raises(oa.BadRequest) as e:
        chat(**fields)
    assert e.value.field.startswith(field)


def test_only_the_vllm_engine_calls_tools():
    asks = chat(tools=[WEATHER], tool_choice="required")
    results = chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "1"}])
    calls = chat(
        messages=[
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            }
        ]
    )
    for engine in ("builtin", "transformers"):
        with pytest.raises(oa.BadRequest) as e:
            oa.refuse_unhonoured(asks, engine)
        assert (e.value.field, e.value.message) == (
            "tools",
            f"tools: not honoured by the {engine!r} engine; leave it out",
        )
        for req, field in ((results, "messages.1.role"), (calls, "messages.0.tool_calls")):
            with pytest.raises(oa.BadRequest) as e:
                oa.refuse_unhonoured(req, engine)
            assert e.value.field == field
    for req in (asks, results, calls):
        oa.refuse_unhonoured(req, "vllm")


# ----------------------------------------------------------------------- the answers


def _calls():
    p = plan(tools(WEATHER, TIME), "required", None)
    return p.answer('[{"name":"get_weather","parameters":{"city":"Paris"}}]')[1]


def test_an_answer_that_calls_tools_reads_as_openais():
    openai = pytest.importorskip("openai")
    ident = oa.Ident("chatcmpl-1", 1, "toy")
    body = oa.chat_completion(ident, None, "tool_calls", oa.Counts(5, 9), _calls())
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    answer = openai.types.chat.ChatCompletion.model_validate(body)
    assert answer.choices[0].finish_reason == "tool_calls"
    assert json.loads(answer.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    plain = oa.chat_completion(ident, "Sunny", "stop", oa.Counts(5, 1))
    assert "tool_calls" not in plain["choices"][0]["message"]  # no calls: no key, as before


def test_a_streamed_answer_carries_its_calls_whole_before_the_finish():
    openai = pytest.importorskip("openai")
    raw = oa.one_event_stream(
        oa.Ident("chatcmpl-1", 1, "toy"),
        True,
        None,
        "tool_calls",
        oa.Counts(5, 9),
        oa.Streaming(final_usage=True),
        _calls(),
    )
    events = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    call = chunks[1].choices[0].delta.tool_calls[0]
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (
        0,
        "get_weather",
        {"city": "Paris"},
    )
    assert chunks[2].choices[0].finish_reason == "tool_calls" and chunks[3].usage.completion_tokens == 9


def test_tools_and_their_results_go_to_the_models_chat_template(tmp_path):
    from ballast.model.demo import make_tiny_llama
    from ballast.router.tokens import TokenizerText

    text = TokenizerText(str(make_tiny_llama(tmp_path / "m")))
    req = chat(
        tools=[WEATHER],
        tool_choice="none",
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
        ],
    )
    prompt = text.render_chat(req.messages, plan(req.tools, req.tool_choice, None).template_tools())
    assert json.dumps(WEATHER) in prompt  # the tools, shown to the model
    # The call's arguments reach the template as a mapping (it writes them out as JSON).
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert prompt.endswith("<|tool|>\n20 C</s>\n<|assistant|>\n")
    assert (
        text.render_chat(chat().messages) == "<s><|user|>\nWeather in Paris?</s>\n<|assistant|>\n"
    )  # no tools: as before


def test_a_row_that_keeps_special_tokens_decodes_them():
    """tool_choice "auto": the tool parser reads markers that some models make special tokens."""
    from ballast.model.demo import train_tokenizer
    from ballast.model.hf_engine import IncrementalDetokenizer, RowSampling

    tok = train_tokenizer()
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    assert IncrementalDetokenizer(tok).feed(ids, final=True) == "hi"
    assert IncrementalDetokenizer(tok, skip_special_tokens=False).feed(ids, final=True) == "hi</s>"
    assert RowSampling.of({"keep_special_tokens": True}).keep_special_tokens is True


def test_a_required_answer_nested_past_any_schema_is_no_call_not_a_recursion_error():
    p = plan(tools(WEATHER, TIME), "required", None)
    text = "[" * 100_000
    assert p.answer(text) == (text, [])
    assert (
        p.answer('[{"name": "get_time", "parameters": ' + "[" * 200 + "]" * 200 + "}]")[1][0].function.name
        == "get_time"
    )
