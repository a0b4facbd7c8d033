"""vLLM's own parsers read Ballast's chat answers on the vLLM engine (ballast.router.chat_parsing):
real parsers (hermes, mistral, deepseek_r1 and Ballast's forced-only one) on the demo
tokenizer, the answers written as the model would write them. Each vLLM symbol the module
relies on is exercised here: ParserManager.get_parser, Parser.adjust_request / parse /
parse_delta, ToolParserManager.register_lazy_module, ChatCompletionRequest,
make_tool_call_id."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from ballast.router.chat_parsing import MAX_WHITESPACE, ChatParsing, ParsedChat
from ballast.router.tool_calls import NamedToolChoice, ToolSpec, plan

pytest.importorskip("vllm")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
# A pydantic-made schema: its own $defs, referred to from its properties.
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"room": {"$ref": "#/$defs/Room"}},
            "required": ["room"],
            "$defs": {"Room": {"type": "string", "enum": ["a", "b"]}},
        },
    },
}
HERMES_CALL = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from ballast.model.demo import train_tokenizer

    t = train_tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<think>", "</think>"]})
    return t


def tools(*specs: dict) -> list[ToolSpec]:
    return [ToolSpec.model_validate(s) for s in specs]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def streamed(
    chat: ParsedChat, tok: Any, text: str, finish: str = "stop", prompt: Sequence[int] = (1, 2, 3)
) -> tuple[dict[str, Any], list, str]:
    """``text`` fed token by token as the replica streams it after ``prompt``: (content and
    reasoning joined, the calls reassembled as a client does, the finish reason)."""
    chat.rendered(prompt)
    reader = chat.stream()
    ids = tok.encode(text, add_special_tokens=False)
    joined: dict[str, Any] = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict[str, Any]] = {}
    previous = ""
    for i, token in enumerate(ids):
        current = tok.decode(ids[: i + 1], skip_special_tokens=False)
        delta = reader.feed(current[len(previous) :], [token], i == len(ids) - 1)
        previous = current
        for key in ("content", "reasoning_content"):
            joined[key] += (delta or {}).get(key, "")
        for d in (delta or {}).get("tool_calls", []):
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function"  # id, type and name come first, once
                call["id"] = d["id"]
            fn = d.get("function", {})
            call["name"] = fn.get("name", call["name"])
            call["arguments"] += fn.get("arguments", "")
    return joined, [calls[i] for i in sorted(calls)], reader.finish(finish)


def unary(
    chat: ParsedChat, text: str, finish: str = "stop", prompt: Sequence[int] = (1, 2, 3)
) -> tuple[str | None, str | None, list, str]:
    chat.rendered(prompt)
    return chat.answer(text, finish)


def test_auto_streams_a_hermes_call_as_openai_does_and_matches_the_whole_answer(tok):
    parsing = ChatParsing(tok, "hermes", None)
    joined, calls, finish = streamed(parsing.start(plan(tools(WEATHER), None, None, auto=True)), tok, HERMES_CALL)
    assert joined["content"] == "Let me look. " and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("chatcmpl-tool-")  # vLLM's id, not one Ballast made up
    reasoning, content, whole, finish = unary(parsing.start(plan(tools(WEATHER), None, None, auto=True)), HERMES_CALL)
    assert (reasoning, content, finish) == (None, "Let me look. ", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in whole] == [(calls[0]["name"], calls[0]["arguments"])]
    # No call in the answer: plain content, "stop"; each request has its own parser.
    assert unary(parsing.start(plan(tools(WEATHER), None, None, auto=True)), "Sunny.") == (None, "Sunny.", [], "stop")
    a, b = (parsing.start(plan(tools(WEATHER), None, None, auto=True)) for _ in range(2))
    assert a.parser is not b.parser


def test_mistral_calls_carry_mistrals_nine_character_ids(tok):
    """Mistral's templates refuse any other id on the next turn."""
    parsing = ChatParsing(tok, "mistral", None)
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    _, content, calls, finish = unary(parsing.start(plan(tools(WEATHER), None, None, auto=True)), text)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_forced_calls_decode_by_each_tools_schema_with_its_defs_resolved(tok):
    # No tool parser: vLLM's JSON schema for the calls, $defs hoisted to its root.
    forced = ChatParsing(tok, None, None)
    schema, tag = forced.start(plan(tools(WEATHER, BOOK), named("book"), None)).guided()
    assert tag is None and json.loads(schema) == BOOK["function"]["parameters"]
    schema, tag = forced.start(plan(tools(WEATHER, BOOK), "required", False)).guided()
    built = json.loads(schema)
    assert tag is None and built["type"] == "array" and built["maxItems"] == 1  # parallel_tool_calls false
    assert _refs_resolve(built, built) and "Room" in built["$defs"]
    # hermes: a structural tag in the model's own format, each tool's schema (its $defs in it)
    # pinned, whitespace runs bounded.
    hermes = ChatParsing(tok, "hermes", None)
    schema, tag = hermes.start(plan(tools(WEATHER, BOOK), "required", None)).guided()
    contents = _json_contents(json.loads(tag))
    begins = [t["begin"] for t in json.loads(tag)["format"]["tags"]]
    assert schema is None and '<tool_call>\n{"name": "book", "arguments": ' in begins
    assert {json.dumps(c["json_schema"], sort_keys=True) for c in contents} == {
        json.dumps(t["function"]["parameters"], sort_keys=True) for t in (WEATHER, BOOK)
    }
    assert all(
        c["max_whitespace_cnt"] == MAX_WHITESPACE and _refs_resolve(c["json_schema"], c["json_schema"])
        for c in contents
    )
    # "auto" and "none" force nothing: no grammar of the tools'.
    assert hermes.start(plan(tools(WEATHER), None, None, auto=True)).guided()[0] is None
    assert forced.start(plan(tools(WEATHER), "none", None)).guided() == (None, None)


def test_required_and_named_stream_their_calls_and_match_the_whole_answer(tok):
    forced = ChatParsing(tok, None, None)
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    _, calls, finish = streamed(forced.start(plan(tools(WEATHER, TIME), "required", None)), tok, text)
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {}]
    assert len({c["id"] for c in calls}) == 2
    _, content, whole, finish = unary(forced.start(plan(tools(WEATHER, TIME), "required", None)), text)
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    # A named function: one call, its arguments streamed in fragments, "stop" (OpenAI's rule).
    _, calls, finish = streamed(forced.start(plan(tools(WEATHER), named("get_weather"), None)), tok, '{"city":"Paris"}')
    assert finish == "stop" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city":"Paris"}')]


def test_an_answer_cut_by_max_tokens_says_length(tok):
    forced = ChatParsing(tok, None, None)
    _, _, calls, finish = unary(forced.start(plan(tools(WEATHER), named("get_weather"), None)), '{"city":"Pa', "length")
    assert finish == "length" and calls[0].function.arguments == '{"city":"Pa'  # what was written, cut
    _, content, calls, finish = unary(
        forced.start(plan(tools(WEATHER), "required", None)), '[{"name":"get_we', "length"
    )
    assert (calls, finish) == ([], "length")
    _, _, finish = streamed(forced.start(plan(tools(WEATHER), "required", None)), tok, '[{"name":"get_we', "length")
    assert finish == "length"


def test_reasoning_goes_apart_and_a_call_written_while_thinking_is_not_a_call(tok):
    parsing = ChatParsing(tok, "hermes", "deepseek_r1")
    text = '<think>I could <tool_call>{"name": "get_weather", "arguments": {"city": "X"}}</tool_call></think>Sunny.'
    reasoning, content, calls, finish = unary(parsing.start(plan(tools(WEATHER), None, None, auto=True)), text)
    assert reasoning.startswith("I could <tool_call>") and (content, calls, finish) == ("Sunny.", [], "stop")
    joined, calls, finish = streamed(parsing.start(plan(tools(WEATHER), None, None, auto=True)), tok, text)
    assert (joined["reasoning_content"], joined["content"], calls, finish) == (reasoning, "Sunny.", [], "stop")
    # Without tools, a reasoning parser still reads the answer.
    assert unary(parsing.start(plan(None, None, None)), "<think>hm</think>Hi.")[:2] == ("hm", "Hi.")


def test_a_prompt_whose_template_closed_the_thinking_is_answered_as_content_streamed_or_not(tok):
    """R1's parser takes an answer without ``</think>`` for thinking; a template that wrote
    ``<think></think>`` already (``enable_thinking: false``) asked for none: content, and a call
    read as a call, in a whole answer as in a stream (vLLM's stream decides it from the prompt)."""
    parsing = ChatParsing(tok, "hermes", "deepseek_r1")
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    closed, opened = (1, think, end, 5), (1, end, think)
    start = lambda: parsing.start(plan(tools(WEATHER), None, None, auto=True))  # noqa: E731
    for prompt, expected in ((closed, (None, "Let me look. ")), (opened, (HERMES_CALL, None))):
        reasoning, content, calls, finish = unary(start(), HERMES_CALL, prompt=prompt)
        joined, streamed_calls, _ = streamed(start(), tok, HERMES_CALL, prompt=prompt)
        assert (reasoning, content) == expected
        assert (joined["reasoning_content"] or None, joined["content"] or None) == expected
        assert len(calls) == len(streamed_calls) == (1 if prompt == closed else 0)


# Tools vLLM's tool utilities refuse (VLLMValidationError) when they build the JSON schema
# of a forced call for a model without a tool parser (every tool's $defs hoisted to its
# root): a $defs that is not an object; two tools defining one name two ways. (A parser's
# structural tag keeps each tool's schema whole: the replica's compile judges those.)
DEFS_NOT_AN_OBJECT = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "$defs": 1}}}]
DEFS_IN_CONFLICT = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "$defs": {"X": {"type": t}}}}}
    for n, t in (("a", "string"), ("b", "integer"))
]


@pytest.mark.parametrize("specs, says", [(DEFS_NOT_AN_OBJECT, "must be an object"), (DEFS_IN_CONFLICT, "'X'")])
def test_tools_vllm_refuses_are_engine_refused_naming_tools(tok, specs, says):
    from ballast.errors import EngineRefused

    with pytest.raises(EngineRefused) as e:
        ChatParsing(tok, None, None).start(plan(tools(*specs), "required", None))
    assert (e.value.status, e.value.code, e.value.field) == (400, "ENGINE_REFUSED", "tools")
    assert e.value.message.startswith("tools: vLLM refuses the request's tools: ") and says in e.value.message
    assert "parameter=" not in e.value.message


def test_tools_vllm_refuses_are_a_400_through_the_openai_front(tmp_path):
    """The real router on a vLLM model (its renderer and parsers; the Serve handle a
    scripted fake that no request reaches): 400 ENGINE_REFUSED naming tools, not a 500."""
    from routerkit import at_level, build_router, routed
    from test_resilient_caller import FakeHandle

    from ballast.model.demo import make_tiny_llama

    model = {"name": "llama", "backend": "vllm", "path": str(make_tiny_llama(tmp_path / "m"))}
    cfg = {"tenants": {"gold": {}}, "auth": {"demo_keys": {"k": "gold"}}, "models": [model]}
    handle = FakeHandle()
    router = build_router(cfg, handle)
    at_level(router, 0)
    with routed(router) as client:
        for specs in (DEFS_NOT_AN_OBJECT, DEFS_IN_CONFLICT):
            body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "tools": specs}
            r = client.post(
                "/v1/chat/completions", headers={"authorization": "Bearer k"}, json={**body, "tool_choice": "required"}
            )
            error = r.json()["error"]
            assert (r.status_code, error["code"], error["param"]) == (400, "ENGINE_REFUSED", "tools"), r.text
            assert error["type"] == "invalid_request_error" and "vLLM refuses the request's tools" in error["message"]
    assert handle.generate.calls == [] and handle.generate_stream.calls == []


def test_unknown_parser_names_fail_when_the_router_starts(tok):
    with pytest.raises(ValueError, match="model.tool_parser"):
        ChatParsing(tok, "no-such-parser", None)
    with pytest.raises(ValueError, match="model.reasoning_parser"):
        ChatParsing(tok, None, "no-such-parser")


def test_an_answer_nested_past_pythons_stack_is_text_not_an_error(tok):
    forced = ChatParsing(tok, None, None)
    text = "[" * 100_000
    assert unary(forced.start(plan(tools(WEATHER), "required", None)), text, "length")[2] == []


def _json_contents(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            return [node]
        return [c for v in node.values() for c in _json_contents(v)]
    if isinstance(node, list):
        return [c for v in node for c in _json_contents(v)]
    return []


def _refs_resolve(node: Any, root: Any) -> bool:
    """Every ``$ref`` under ``node`` names a path that exists from ``root``."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = root
            for part in ref.removeprefix("#/").split("/"):
                if not isinstance(target, dict) or part not in target:
                    return False
                target = target[part]
        return all(_refs_resolve(v, root) for v in node.values())
    if isinstance(node, list):
        return all(_refs_resolve(v, root) for v in node)
    return True


def test_a_second_family_llama3_json_calls_stream_as_the_whole_answer_with_the_parsers_ids():
    """Llama 3.1's JSON calls (vLLM's llama3_json parser) on the demo's llama3 tokenizer: the
    grammar is the model's own call format, a stream is the whole answer, R1's reasoning
    parser beside it reads a prompt whose thinking is closed as content."""
    from ballast.model.demo import train_tokenizer

    tok = train_tokenizer(family="llama3")
    parsing = ChatParsing(tok, "llama3_json", "deepseek_r1")
    closed = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for choice in ("required", named("get_weather"), None):
        chat = parsing.start(plan(tools(WEATHER), choice, None, auto=True))
        assert '"begin":"{\\"name\\": \\"get_weather\\", \\"parameters\\": "' in chat.guided()[1]
        reasoning, content, whole, finish = unary(chat, call, prompt=closed)
        joined, calls, streamed_finish = streamed(
            parsing.start(plan(tools(WEATHER), choice, None, auto=True)), tok, call, prompt=closed
        )
        assert reasoning is None and not joined["reasoning_content"]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
        assert whole[0].id.startswith("chatcmpl-tool-") and calls[0]["id"].startswith("chatcmpl-tool-")
        assert finish == streamed_finish == ("stop" if choice not in ("required", None) else "tool_calls")


def test_ids_whose_text_the_replica_held_back_go_to_the_parser_with_that_text():
    """The replica holds a piece's text back while it ends in a cut character, and sends its
    ids at once: the parser gets them with the text they make, so ``</think>`` in a held
    piece still splits the thinking where its text is."""
    from ballast.model.demo import train_tokenizer

    tok = train_tokenizer(family="llama3")
    chat = ChatParsing(tok, None, "deepseek_r1").start(plan(None, None, None))
    chat.rendered(tok.encode("hi<think>\n", add_special_tokens=False))
    reader = chat.stream()
    held = tok.encode("<|</think>", add_special_tokens=False)
    assert reader.feed("", held, False) is None
    assert reader.feed("<|</think>ant", tok.encode("ant", add_special_tokens=False), False) == {
        "reasoning_content": "<|",
        "content": "ant",
    }
