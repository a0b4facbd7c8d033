"""The grammar bounds what a model may write where a number is asked
(ballast.policies.schema.bounded_numbers): the rewrite itself on nested schemas, the
schema's own bounds kept, its input untouched; the real xgrammar compiler showing what the
bounds do to the digits; and the two places Ballast hands a schema to the engine, a forced
tool call's grammar (ballast.router.chat_parsing, vLLM's real parsers) and
``response_format`` (ballast.router.openai_api), each measured as the client sent it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ballast.config.limits import LimitsConfig
from ballast.policies.sampling import INT64_MAX, INT64_MIN
from ballast.policies.schema import INTEGER_BOUNDS, NUMBER_BOUNDS, SchemaBounds, bounded_numbers, schema_size

INT = {"minimum": INT64_MIN, "maximum": INT64_MAX}
NUM = {"minimum": NUMBER_BOUNDS[0], "maximum": NUMBER_BOUNDS[1]}
TWENTY_DIGITS = "1" + "0" * 19


def test_the_defaults_are_int64_and_plus_minus_ten_to_the_fifteen():
    assert INTEGER_BOUNDS == (-(2**63), 2**63 - 1) and NUMBER_BOUNDS == (-(10**15), 10**15)


def test_every_integer_and_number_wherever_a_schema_holds_one_is_bounded():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "description": "kept"},
            "x": {"type": "number"},
            "list": {"type": "array", "items": {"type": "integer"}},
            "pair": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}]},
            "tuple": {"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "number"}},
            "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "one": {"oneOf": [{"type": "number"}, {"type": "null"}]},
            "all": {"allOf": [{"type": "integer"}, {"maximum": 5}]},
            "ref": {"$ref": "#/$defs/Count"},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
            "by_pattern": {"type": "object", "patternProperties": {"^i": {"type": "integer"}}},
        },
        "$defs": {"Count": {"type": "integer"}},
        "definitions": {"Ratio": {"type": "number"}},
    }
    props = schema["properties"]
    assert bounded_numbers(schema) == {
        **schema,
        "properties": {
            "n": {"type": "integer", "description": "kept", **INT},
            "x": {"type": "number", **NUM},
            "list": {"type": "array", "items": {"type": "integer", **INT}},
            "pair": {"type": "array", "prefixItems": [{"type": "number", **NUM}, {"type": "string"}]},
            "tuple": {
                "type": "array",
                "items": [{"type": "integer", **INT}],
                "additionalItems": {"type": "number", **NUM},
            },
            "either": {"anyOf": [{"type": "integer", **INT}, {"type": "string"}]},
            "one": {"oneOf": [{"type": "number", **NUM}, {"type": "null"}]},
            "all": {"allOf": [{"type": "integer", **INT}, {"maximum": 5}]},  # a branch without a type: as sent
            "ref": props["ref"],
            "map": {"type": "object", "additionalProperties": {"type": "integer", **INT}},
            "by_pattern": {"type": "object", "patternProperties": {"^i": {"type": "integer", **INT}}},
        },
        "$defs": {"Count": {"type": "integer", **INT}},
        "definitions": {"Ratio": {"type": "number", **NUM}},
    }


def test_a_type_given_as_a_list_is_bounded_by_the_widest_numeric_type_in_it():
    assert bounded_numbers({"type": ["integer", "null"]}) == {"type": ["integer", "null"], **INT}
    assert bounded_numbers({"type": ["integer", "number"]}) == {"type": ["integer", "number"], **NUM}
    assert bounded_numbers({"type": ["string", "null"]}) == {"type": ["string", "null"]}
    odd = {"type": [{"not": "a type"}, ["integer"]]}  # not a schema xgrammar takes, but no crash here
    assert bounded_numbers(odd) == odd


@pytest.mark.parametrize(
    ("schema", "added"),
    [
        ({"type": "integer", "minimum": 0}, {"maximum": INT64_MAX}),
        ({"type": "integer", "exclusiveMaximum": 10}, {"minimum": INT64_MIN}),
        ({"type": "integer", "exclusiveMinimum": -1, "maximum": 3}, {}),
        ({"type": "number", "minimum": 0.5}, {"maximum": NUMBER_BOUNDS[1]}),
        ({"type": "number", "minimum": -1, "exclusiveMaximum": 1e30}, {}),
        # The schema's other bound lies past the default: that side stays as sent (open).
        ({"type": "number", "minimum": 1e16}, {}),
        ({"type": "number", "exclusiveMaximum": -(10**15)}, {}),
        # xgrammar drops an integer's multipleOf once it has a range: left as sent.
        ({"type": "integer", "multipleOf": 5}, {}),
        # a number's multipleOf xgrammar ignores either way: bounded.
        ({"type": "number", "multipleOf": 0.5}, NUM),
    ],
)
def test_the_schemas_own_bounds_win(schema: dict[str, Any], added: dict[str, Any]):
    assert bounded_numbers(schema) == {**schema, **added}


def test_data_and_conditions_are_not_rewritten():
    looks_like_a_schema = {"type": "integer"}
    schema = {
        "type": "object",
        "properties": {
            "a": {"const": looks_like_a_schema},
            "b": {"enum": [looks_like_a_schema], "default": looks_like_a_schema, "examples": [looks_like_a_schema]},
            "c": {"not": {"type": "integer"}},  # bounding it would widen what "c" admits
            "d": {"type": "array", "contains": {"type": "integer"}},
        },
    }
    assert bounded_numbers(schema) == schema


def test_the_input_is_never_changed_and_the_copy_shares_nothing_with_it():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "enum": [1, 2]}, "b": {"type": "array", "items": {"type": "number"}}},
        "required": ["a"],
    }
    before = copy.deepcopy(schema)
    out = bounded_numbers(schema)
    assert schema == before
    assert out != schema
    inputs = {id(c) for c in _containers(schema)}
    assert not inputs & {id(c) for c in _containers(out)}


def test_a_schema_nested_past_pythons_stack_is_walked_without_recursion():
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    out = bounded_numbers(schema)
    for _ in range(5000):
        out = out["items"]
    assert out == {"type": "integer", **INT}


# --- what xgrammar compiles (the engine's grammar backend) ---


def accepts(grammar: Any, text: str) -> bool:
    """``grammar`` (an xgrammar Grammar) matches the whole of ``text``."""
    xgr = pytest.importorskip("xgrammar")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def schema_accepts(schema: dict[str, Any], text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    return accepts(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


def test_a_bounded_integer_compiles_to_at_most_int64():
    assert schema_accepts({"type": "integer"}, TWENTY_DIGITS)  # as sent: any length
    bounded = bounded_numbers({"type": "integer"})
    assert not schema_accepts(bounded, TWENTY_DIGITS)
    assert schema_accepts(bounded, str(INT64_MAX)) and schema_accepts(bounded, str(INT64_MIN))
    assert not schema_accepts(bounded, str(INT64_MAX + 1)) and not schema_accepts(bounded, str(INT64_MIN - 1))
    assert schema_accepts(bounded, "0") and schema_accepts(bounded, "-42")


def test_a_bounded_number_compiles_to_a_bounded_count_of_digits():
    assert schema_accepts({"type": "number"}, "1" * 40 + ".5") and schema_accepts({"type": "number"}, "1e300")
    bounded = bounded_numbers({"type": "number"})
    assert schema_accepts(bounded, str(10**15)) and schema_accepts(bounded, "-999999999999999.123456")
    assert schema_accepts(bounded, "0.5")
    assert not schema_accepts(bounded, "1" + "0" * 16)  # 17 digits before the point
    assert not schema_accepts(bounded, "0.1234567")  # xgrammar's range: at most 6 after it
    assert not schema_accepts(bounded, "1e300")  # and no exponent


# --- where Ballast hands a schema to the engine ---

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("vllm")
    from ballast.model.demo import train_tokenizer

    return train_tokenizer()


def forced_add(tok: Any, tool_parser: str | None) -> Any:
    from ballast.router.chat_parsing import ChatParsing
    from ballast.router.tool_calls import NamedToolChoice, ToolSpec, plan

    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
    tools = [ToolSpec.model_validate(ADD)]
    return ChatParsing(tok, tool_parser, None).start(plan(tools, choice, None)), tools


def test_a_forced_calls_structural_tag_carries_the_bounds_and_refuses_a_twenty_digit_argument(tok):
    xgr = pytest.importorskip("xgrammar")
    chat, tools = forced_add(tok, "hermes")
    schema, tag = chat.guided()
    assert schema is None
    contents = [t["content"]["json_schema"] for t in json.loads(tag)["format"]["tags"]]
    assert contents and all(c["properties"]["a"] == {"type": "integer", **INT} for c in contents)
    assert tools[0].function.parameters == ADD["function"]["parameters"]  # what the client sent, as sent
    call = '<tool_call>\n{"name": "add", "arguments": {"a":%s}}\n</tool_call>'
    grammar = xgr.Grammar.from_structural_tag(tag)
    assert accepts(grammar, call % INT64_MAX)
    assert not accepts(grammar, call % TWENTY_DIGITS)
    unbounded = tag.replace(f',"minimum":{INT64_MIN},"maximum":{INT64_MAX}', "")
    assert accepts(xgr.Grammar.from_structural_tag(unbounded), call % TWENTY_DIGITS)  # the test can fail


def test_a_forced_calls_json_schema_carries_the_bounds(tok):
    chat, _ = forced_add(tok, None)  # no tool parser: vLLM's JSON schema of the arguments
    schema, tag = chat.guided()
    assert tag is None and json.loads(schema)["properties"]["a"] == {"type": "integer", **INT}
    assert not schema_accepts(json.loads(schema), f'{{"a":{TWENTY_DIGITS}}}')


def test_the_tools_grammar_is_measured_before_its_numbers_are_bounded(tok):
    from ballast.router.tool_calls import ToolSchemaTooComplex

    chat, _ = forced_add(tok, "hermes")
    handed = json.loads(chat.guided()[1])
    built = json.loads(json.dumps(handed).replace(f', "minimum": {INT64_MIN}, "maximum": {INT64_MAX}', ""))
    assert built != handed
    nodes = schema_size(built).nodes
    assert schema_size(handed).nodes > nodes
    chat.check(
        SchemaBounds(max_depth=32, max_nodes=nodes, max_repeat=1024, max_pattern_chars=128, max_literal_chars=1 << 15)
    )
    with pytest.raises(ToolSchemaTooComplex):
        chat.check(
            SchemaBounds(
                max_depth=32, max_nodes=nodes - 1, max_repeat=1024, max_pattern_chars=128, max_literal_chars=1 << 15
            )
        )


def test_response_formats_schema_goes_to_the_engine_bounded_and_is_measured_and_kept_as_sent():
    from ballast.router import openai_api as oa

    schema = {"type": "object", "properties": {f"n{i}": {"type": "integer"} for i in range(8)}}
    nodes = schema_size(schema).nodes
    assert schema_size(bounded_numbers(schema)).nodes > nodes
    body = {
        "model": "toy",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "counts", "schema": schema}},
    }
    req = oa.parse_chat(body, LimitsConfig(max_schema_nodes=nodes))  # within the bound as sent
    assert json.loads(oa.sampling_of(req).json_schema) == bounded_numbers(schema)
    assert req.response_format is not None and req.response_format.json_schema is not None
    assert req.response_format.json_schema.schema_ == schema
    with pytest.raises(oa.SchemaTooComplex):
        oa.parse_chat(body, LimitsConfig(max_schema_nodes=nodes - 1))


def _containers(value: Any) -> list[Any]:
    """Every dict and list in ``value``."""
    found, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            found.append(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            found.append(v)
            stack.extend(v)
    return found
