"""Every input the API takes is bounded, at the fronts: a malformed or oversized body is
the route's 4xx naming the field, never a 500 (ballast/router/api.py ``read_json``,
ballast/router/openai_api.py ``check_limits``, ballast/router/tool_calls.py).

Request-path cases go through a real Router object without Ray (tests/unit/routerkit.py);
the Serve handle is the scripted fake of test_resilient_caller.py and none of these
requests reaches it."""

from __future__ import annotations

import asyncio
import json

import pytest
from routerkit import at_level, build_router, routed
from starlette.requests import Request
from test_resilient_caller import FakeHandle

from ballast.config import load_config
from ballast.errors import InvalidRequest, PayloadTooLarge, SchemaTooComplex
from ballast.model.protocol import GREEDY
from ballast.policies.json_bounds import json_extent, json_nesting
from ballast.policies.sampling import sampling_temperature
from ballast.router import openai_api as oa
from ballast.router.api import parse_json_object, read_body
from ballast.router.openai import OpenAIFront
from ballast.router.tokens import ModelText
from ballast.router.tool_calls import ToolSchemaTooComplex, ToolSpec, plan

KEY = {"authorization": "Bearer dev-key-gold"}
ADMIN = {"authorization": "Bearer admin-token"}
CFG = {
    "tenants": {"gold": {}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}, "demo_admin_token": "admin-token"},
    "chaos": {"enabled": True},
}
CHAT = {"model": "tiny-decoder", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny-decoder", "prompt": "once"}
EMBEDDING = {"model": "tiny-decoder", "input": "once"}


@pytest.fixture(scope="module")
def client():
    handle = FakeHandle()  # no script: a request that reached the model would fail the test
    router = build_router(CFG, handle)
    at_level(router, 0)
    with routed(router) as c:
        yield c
    assert handle.generate.calls == [] and handle.generate_stream.calls == []


# Every route that reads a JSON body, with its key and the status its refusals take.
BODY_ROUTES = [
    ("/v1/generate", KEY, 422),
    ("/v1/chat/completions", KEY, 400),  # OpenAI's shape: 400 invalid_request_error
    ("/v1/completions", KEY, 400),
    ("/v1/embeddings", KEY, 400),
    ("/admin/kill-switch", ADMIN, 422),
    ("/admin/chaos", ADMIN, 422),
    ("/admin/recycle", ADMIN, 422),
]


def field_of(r) -> str:
    err = r.json()["error"]
    return err.get("field", err.get("param"))


# ------------------------------------------------------------------- JSON nesting


def test_nesting_is_counted_exactly_for_valid_json_and_strings_do_not_count():
    cases = ["1", '"[[["', "[]", '{"a": [1, {"b": "]]]{{"}]}', '[[["\\"[", "\\\\"]]]', '{"a": "\\u005b"}']
    for text in cases:
        assert json_nesting(text) == json_extent(json.loads(text)).depth, text


def test_an_unterminated_string_ends_the_scan_and_brackets_after_it_do_not_count():
    assert json_nesting('[["abc') == 2
    assert json_nesting('["\\"\\"\\"' + "\\" * 1001 + "[[[[") == 1


def test_the_extent_counts_every_node_and_the_nesting_of_containers():
    assert json_extent(3) == (0, 1)
    assert json_extent({"a": [1, 2, {"b": None}], "c": {}}) == (3, 7)


@pytest.mark.parametrize("path,headers,status", BODY_ROUTES)
def test_fifty_thousand_brackets_are_a_4xx_naming_the_body_on_every_route(client, path, headers, status):
    r = client.post(path, headers=headers, content=b"[" * 50_000)
    assert r.status_code == status, r.text
    assert field_of(r) == "body" and r.json()["error"]["code"] == "INVALID_REQUEST"
    assert "nested 50000 deep; the limit is 64" in r.text


def test_the_depth_limit_is_the_setting_and_its_edge_passes():
    at_limit = '{"a":' * 63 + "{}" + "}" * 63  # 64 objects
    assert json_nesting(at_limit) == 64
    assert parse_json_object(at_limit.encode(), 64)
    with pytest.raises(InvalidRequest) as e:
        parse_json_object(("[" + at_limit + "]").encode(), 64)
    assert e.value.field == "body"
    with pytest.raises(InvalidRequest):
        parse_json_object(at_limit.encode(), 63)


# ------------------------------------------------------------------ other bodies

MALFORMED = [
    (b"\xff\xfe{}", "body", "not UTF-8"),
    (b"", "body", "not JSON"),
    (b'{"prompt": "x"', "body", "not JSON"),
    (b"[1]", "body", "must be a JSON object"),
    (b'"a string"', "body", "must be a JSON object"),
    (b"null", "body", "must be a JSON object"),
    (b'{"prompt": NaN}', "prompt", "finite"),
    (b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens", "finite"),
    (b'{"a": {"b": [1, -Infinity]}}', "a.b.1", "finite"),
    (b'{"prompt": "x", "max_tokens": 1e999}', "max_tokens", "finite"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens", "int64"),
    (b'{"prompt": "x", "max_tokens": 9223372036854775808}', "max_tokens", "int64"),
    (b'{"prompt": "x", "max_tokens": -9223372036854775809}', "max_tokens", "int64"),
    (b'{"prompt": "x", "prompt": "y"}', "prompt", "twice"),
    (b'{"a": [{"k": 1, "k": 2}]}', "a.0.k", "twice"),
    (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
    (b'{"\\udfff": 1}', "\\udfff", "surrogate"),
]


@pytest.mark.parametrize("path,headers,status", BODY_ROUTES)
def test_a_malformed_body_is_a_4xx_naming_the_field_on_every_route(client, path, headers, status):
    for body, field, says in MALFORMED:
        r = client.post(path, headers=headers, content=body)
        assert (r.status_code, field_of(r), r.json()["error"]["code"]) == (status, field, "INVALID_REQUEST"), (
            body,
            r.text,
        )
        assert says in r.json()["error"]["message"], (body, r.text)


def body_read_with(content_length: bytes) -> bytes:
    """``read_body`` on a Starlette request declaring ``content_length`` and carrying ``{}``."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "query_string": b"",
        "headers": [(b"content-length", content_length)],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    return asyncio.run(read_body(Request(scope, receive), 100))


def test_a_declared_length_that_is_not_a_number_is_left_to_the_count_and_a_huge_one_is_413():
    assert body_read_with(b"\xb2") == b"{}"  # Latin-1 "²": isdigit() holds, int() raises
    assert body_read_with(b"2") == b"{}"
    for declared, says in ((b"101", "body is 101 bytes"), (b"9" * 5000, "a 5000-digit number of bytes")):
        with pytest.raises(PayloadTooLarge) as e:
            body_read_with(declared)
        assert says in e.value.message


def test_int64_edges_and_a_surrogate_pair_pass_the_reader():
    body = '{"lo": -9223372036854775808, "hi": 9223372036854775807, "emoji": "\\ud83d\\ude00", "x": 1.5e308}'
    assert parse_json_object(body.encode(), 64) == {"lo": -(2**63), "hi": 2**63 - 1, "emoji": "😀", "x": 1.5e308}


def test_a_wrong_type_anywhere_is_a_4xx_naming_it(client):
    cases = [
        ("/v1/generate", {"prompt": ["x"]}, "prompt"),
        ("/v1/generate", {"prompt": "x", "resume": {"ids": "1", "text_chars": 0}}, "resume.ids"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": {"a": 1}}]}, "messages.0.content"),
        ("/v1/chat/completions", {**CHAT, "stream_options": []}, "stream_options"),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools.0.function.parameters",
        ),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3]]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "stop": {"a": 1}}, "stop"),
        ("/v1/embeddings", {**EMBEDDING, "input": {"a": 1}}, "input"),
        ("/v1/embeddings", {**EMBEDDING, "input": [[1], "a"]}, "input.1"),
        ("/v1/embeddings", {**EMBEDDING, "input": [[1, 2.5]]}, "input.0"),
        ("/v1/embeddings", {**EMBEDDING, "input": [1, -1]}, "input"),
        ("/v1/embeddings", {**EMBEDDING, "dimensions": "8"}, "dimensions"),
        ("/v1/embeddings", {**EMBEDDING, "dimensions": 1 << 17}, "dimensions"),
        ("/v1/embeddings", {**EMBEDDING, "encoding_format": 1}, "encoding_format"),
        ("/v1/embeddings", {**EMBEDDING, "user": ["u"]}, "user"),
        ("/v1/embeddings", {**EMBEDDING, "input": ["x"] * 2049}, "input"),
        ("/v1/embeddings", EMBEDDING, "model"),  # a generating model: its kind is not embed
    ]
    for path, body, field in cases:
        r = client.post(path, headers=KEY, json=body)
        assert 400 <= r.status_code < 500 and field_of(r) == field, (body, r.text)


# ---------------------------------------------------------------- stop strings


def test_stops_are_at_most_four_of_at_most_max_stop_chars_on_both_openai_routes(client):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        r = client.post(path, headers=KEY, json={**body, "stop": ["a"] * 5})
        assert (r.status_code, field_of(r)) == (400, "stop"), r.text
        r = client.post(path, headers=KEY, json={**body, "stop": ["a", "b" * 257]})
        assert (r.status_code, field_of(r)) == (400, "stop"), r.text
        assert "257 characters; the limit is 256" in r.text
        r = client.post(path, headers=KEY, json={**body, "stop": "c" * 257})
        assert (r.status_code, field_of(r)) == (400, "stop"), r.text


def test_a_stop_at_the_bound_passes_and_the_bound_is_the_setting():
    assert oa.stops_of(oa.parse_completion({**COMPLETION, "stop": ["x" * 256] * 4})) == ("x" * 256,) * 4
    limits = load_config({"limits": {"max_stop_chars": 8}}).limits
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_completion({**COMPLETION, "stop": "x" * 9}, limits)
    assert e.value.field == "stop"


def test_the_native_route_takes_no_stop(client):
    r = client.post("/v1/generate", headers=KEY, json={"prompt": "x", "stop": ["a"] * 100})
    assert (r.status_code, field_of(r)) == (422, "stop")


# ---------------------------------------------------------------- schemas and tools


def nested(depth: int) -> dict:
    """A schema whose JSON nests ``depth`` deep (objects inside "items")."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def wide(nodes: int) -> dict:
    """A schema of ``nodes`` nodes: an object holding an enum of nodes - 3 values."""
    return {"type": "string", "enum": list(range(nodes - 3))}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_response_format_schema_past_its_depth_or_nodes_is_schema_too_complex(client):
    assert json_extent(nested(32)).depth == 32 and json_extent(wide(4096)).nodes == 4096
    oa.check_limits(oa.parse_chat({**CHAT, "response_format": response_format(nested(32))}), load_config({}).limits)
    oa.parse_chat({**CHAT, "response_format": response_format(wide(4096))})
    for schema, says in (
        (nested(33), "nests 33 deep; the limit is 32"),
        (wide(4097), "has 4097 nodes; the limit is 4096"),
    ):
        r = client.post("/v1/chat/completions", headers=KEY, json={**CHAT, "response_format": response_format(schema)})
        assert (r.status_code, r.json()["error"]["code"], field_of(r)) == (400, "SCHEMA_TOO_COMPLEX", "response_format")
        assert says in r.text


def test_more_than_128_tools_is_schema_too_complex(client):
    tools = [function(f"f{i}", {"type": "object"}) for i in range(129)]
    r = client.post("/v1/chat/completions", headers=KEY, json={**CHAT, "tools": tools})
    assert (r.status_code, r.json()["error"]["code"], field_of(r)) == (400, "SCHEMA_TOO_COMPLEX", "tools"), r.text
    assert len(oa.parse_chat({**CHAT, "tools": tools[:128]}).tools) == 128


def test_tools_past_the_schema_bounds_are_schema_too_complex():
    deep = {**CHAT, "tools": [function("a", {"type": "object"}), function("b", nested(33))]}
    with pytest.raises(SchemaTooComplex) as e:
        oa.parse_chat(deep)
    assert e.value.field == "tools" and "tool 1's parameters nest 33 deep" in e.value.message
    # Nodes are summed over the tools: "required" compiles every one of them at once.
    many = {**CHAT, "tools": [function(f"f{i}", wide(1025)) for i in range(4)]}
    with pytest.raises(SchemaTooComplex) as e:
        oa.parse_chat(many)
    assert e.value.field == "tools" and "4100 nodes" in e.value.message
    assert len(oa.parse_chat({**CHAT, "tools": many["tools"][:3]}).tools) == 3


def test_patterns_counts_and_literals_past_their_bounds_are_schema_too_complex(client):
    """What else a grammar spells out (ballast.policies.schema), refused at the front before
    any work: a nested pattern 50 characters long that unrolls to 256, counts that add up,
    literals; the tools' schemas counted together."""
    for schema, says in (
        ({"type": "string", "pattern": "^(.{1,16}){1,16}$"}, "a pattern of 256 characters"),
        ({"type": "string", "maxLength": 2048}, "adding up to 2048; the limit is 1024"),
        ({"enum": ["x" * 40000]}, "spells 40000 characters"),
    ):
        r = client.post("/v1/chat/completions", headers=KEY, json={**CHAT, "response_format": response_format(schema)})
        assert (r.status_code, r.json()["error"]["code"], field_of(r)) == (400, "SCHEMA_TOO_COMPLEX", "response_format")
        assert says in r.text, r.text
    within = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,64}$", "maxLength": 600}}}
    oa.parse_chat({**CHAT, "response_format": response_format(within)})
    oa.parse_chat({**CHAT, "tools": [function("a", within)]})
    r = client.post("/v1/chat/completions", headers=KEY, json={**CHAT, "tools": [function("a", within)] * 2})
    assert (r.status_code, r.json()["error"]["code"], field_of(r)) == (400, "SCHEMA_TOO_COMPLEX", "tools"), r.text
    assert "adding up to 1200" in r.text


def test_required_over_tools_that_pass_alone_can_build_a_schema_too_complex():
    """The grammar vLLM's parser builds for "required" holds every tool's parameters: it is
    measured as built (``ParsedChat.check``), with no tool parser (a JSON array of calls)
    and with hermes (a structural tag, each tool's schema in it)."""
    pytest.importorskip("vllm")
    from ballast.model.demo import train_tokenizer
    from ballast.router.chat_parsing import ChatParsing

    tools = [ToolSpec.model_validate(function(f"f{i}", wide(40))) for i in range(9)]  # 360 nodes of parameters
    limits = load_config({"limits": {"max_schema_nodes": 400}}).limits
    bounds = limits.schema_bounds()
    for parser in (None, "hermes"):
        parsing = ChatParsing(train_tokenizer(), parser, None)
        parsing.start(plan(tools, "none", None)).check(bounds)  # no call forced: no grammar
        with pytest.raises(ToolSchemaTooComplex) as e:
            parsing.start(plan(tools, "required", None)).check(bounds)
        assert e.value.field == "tool_choice" and "nodes; the limit is 400" in str(e.value)
        parsing.start(plan(tools[:2], "required", None)).check(bounds)  # hermes writes each tool twice
    # The front answers it as 400 SCHEMA_TOO_COMPLEX naming tool_choice.
    front = OpenAIFront(None, load_config({"limits": {"max_schema_nodes": 400}}), created_s=0)
    req = oa.parse_chat({**CHAT, "tools": [t.model_dump() for t in tools], "tool_choice": "required"}, limits)
    text = ModelText(64)
    text.parsing = ChatParsing(train_tokenizer(), None, None)
    with pytest.raises(SchemaTooComplex) as err:
        front._parsed(req, text)
    assert (err.value.status, err.value.code, err.value.field) == (400, "SCHEMA_TOO_COMPLEX", "tool_choice")


# ----------------------------------------------------------------- sampling values


def test_a_temperature_below_the_greedy_floor_is_sent_as_zero():
    for asked, sent in ((1e-40, 0.0), (9.9e-6, 0.0), (1e-5, 1e-5), (0.7, 0.7), (0, 0.0)):
        req = oa.parse_chat({**CHAT, "temperature": asked})
        sampling = oa.sampling_of(req) or GREEDY  # None: nothing asked, the engine's greedy default
        assert sampling.temperature == sent
        assert sampling_temperature(asked) == sent


def test_sampling_values_out_of_range_are_refused_naming_the_field(client):
    cases = [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1e-40}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 257}, "top_k"),  # the built-in model's vocabulary is 256 tokens
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 8193}, "min_tokens"),
        ({"max_tokens": 8193}, "max_tokens"),
        ({"n": 9}, "n"),
        ({"model": "m" * 257}, "model"),
        ({"user": "u" * 257}, "user"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ]
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        for fields, field in cases:
            r = client.post(path, headers=KEY, json={**base, **fields})
            assert (r.status_code, field_of(r)) == (400, field), (path, fields, r.text)
    for fields in ({"seed": 2**63 - 1}, {"seed": -(2**63)}, {"top_k": 256}):
        oa.parse_chat({**CHAT, **fields})


def test_a_non_finite_sampling_value_is_refused_even_from_python():
    for name in ("temperature", "top_p", "repetition_penalty"):
        with pytest.raises(oa.BadRequest) as e:
            oa.parse_chat({**CHAT, name: float("nan")})
        assert e.value.field == name


def test_chat_lists_and_ids_are_bounded():
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_chat({**CHAT, "messages": [{"role": "user", "content": "x"}] * (oa.MAX_MESSAGES + 1)})
    assert e.value.field == "messages"
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_chat({**CHAT, "messages": [{"role": "tool", "content": "x", "tool_call_id": "c" * 257}]})
    assert e.value.field == "messages.0.tool_call_id"


def test_an_earlier_calls_arguments_nest_at_most_as_the_body():
    def call(arguments: str) -> dict:
        return {
            **CHAT,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
        }

    oa.parse_chat(call("[" * 64 + "]" * 64))
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_chat(call("[" * 50_000))  # a string: the body itself nests 5 deep
    assert e.value.field == "messages.1.tool_calls.0.function.arguments"
