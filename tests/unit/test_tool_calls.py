"""Tool calling on the OpenAI chat front (ballast.router.tool_calls): what tools and
tool_choice ask, the schema a forced call is decoded by, how an answer's text becomes
tool_calls, and the answers' shapes as the official client reads them."""

import json

import pytest

from ballast.router import openai_answers as answers
from ballast.router import openai_api as oa
from ballast.router.tool_calls import NamedToolChoice, ToolCall, ToolPlan, ToolRequestError, ToolSpec, plan

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


def test_a_named_function_is_planned_by_its_name():
    p = plan(
        tools(WEATHER, TIME),
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}),
        None,
    )
    assert (p.mode, p.name, p.may_call) == ("named", "get_weather", True)
    assert p.vllm_choice() == {"type": "function", "function": {"name": "get_weather"}}
    err = refused(
        tools=tools(WEATHER),
        choice=NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}}),
        parallel=None,
    )
    assert (err.field, str(err)) == ("tool_choice", "tool_choice: no tool named 'f' in tools")


def test_required_keeps_parallel_tool_calls_for_vllms_parser():
    p = plan(tools(WEATHER, TIME), "required", None)
    assert (p.mode, p.vllm_choice(), p.parallel) == ("required", "required", None)
    assert plan(tools(WEATHER), "required", False).parallel is False


def test_auto_needs_the_models_tool_parser_and_none_keeps_the_tools_for_the_template():
    err = refused(tools=tools(WEATHER), choice=None, parallel=None)  # auto is the default with tools
    assert err.field == "tool_choice" and "model.tool_parser" in str(err)
    assert plan(tools(WEATHER), None, None, auto=True).mode == "auto"
    p = plan(tools(WEATHER), "none", None)
    assert not p.may_call and p.template_tools() == [WEATHER] and p.vllm_choice() == "none"
    assert refused(tools=tools(WEATHER, WEATHER), choice="required", parallel=None).field == "tools"


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
    return [
        ToolCall.model_validate(
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        )
    ]


def test_an_answer_that_calls_tools_reads_as_openais():
    openai = pytest.importorskip("openai")
    ident = answers.Ident("chatcmpl-1", 1, "toy")
    body = answers.chat_completion(ident, None, "tool_calls", answers.Counts(5, 9), _calls())
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    answer = openai.types.chat.ChatCompletion.model_validate(body)
    assert answer.choices[0].finish_reason == "tool_calls"
    assert json.loads(answer.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    plain = answers.chat_completion(ident, "Sunny", "stop", answers.Counts(5, 1))
    assert "tool_calls" not in plain["choices"][0]["message"]  # no calls: no key, as before


def test_a_streamed_answer_carries_its_calls_whole_before_the_finish():
    openai = pytest.importorskip("openai")
    raw = answers.one_event_stream(
        answers.Ident("chatcmpl-1", 1, "toy"),
        True,
        None,
        "tool_calls",
        answers.Counts(5, 9),
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


def test_chat_template_kwargs_reach_the_template_and_only_its_own_variables_pass(tmp_path):
    from ballast.model.demo import make_tiny_llama
    from ballast.router.tokens import TokenizerText

    text = TokenizerText(str(make_tiny_llama(tmp_path / "m")))
    text._tokenizer.chat_template = "{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}"
    req = chat(chat_template_kwargs={"enable_thinking": True})
    assert text.render_chat(req.messages, None, req.chat_template_kwargs) == "<s><think>Weather in Paris?"
    assert text.render_chat(req.messages) == "<s>Weather in Paris?"
    for bad in ({"chat_template": "{{ 7 }}"}, {"tokenize": True}, {"eos_token": "x"}, {"Enable": 1}, {"a-b": 1}):
        with pytest.raises(oa.BadRequest) as e:
            chat(chat_template_kwargs=bad)
        assert e.value.field.startswith("chat_template_kwargs")
    with pytest.raises(oa.BadRequest) as e:
        oa.refuse_unhonoured(req, "builtin")
    assert e.value.field == "chat_template_kwargs"
    oa.refuse_unhonoured(req, "transformers")


def test_a_row_that_keeps_special_tokens_decodes_them():
    """tool_choice "auto": the tool parser reads markers that some models make special tokens."""
    from ballast.model.demo import train_tokenizer
    from ballast.model.hf_text import IncrementalDetokenizer
    from ballast.model.protocol import RowSampling

    tok = train_tokenizer()
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    assert IncrementalDetokenizer(tok).feed(ids, final=True) == "hi"
    assert IncrementalDetokenizer(tok, skip_special_tokens=False).feed(ids, final=True) == "hi</s>"
    assert RowSampling.of({"keep_special_tokens": True}).keep_special_tokens is True
