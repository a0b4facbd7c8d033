"""What a schema asks of guided decoding, measured at the front (ballast.policies.schema):
patterns written and unrolled, the counts a schema asks, its literals, and the tools taken
together; each bound passed is its own phrase, and measuring reads a bounded amount of a
body whatever it holds."""

from __future__ import annotations

import pytest

from ballast.config import load_config
from ballast.policies.json_bounds import json_extent
from ballast.policies.schema import SchemaBounds, pattern_repeat, schema_fault, schema_size

BOUNDS = SchemaBounds(max_depth=32, max_nodes=4096, max_repeat=1024, max_pattern_chars=128, max_literal_chars=32768)


def text(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


@pytest.mark.parametrize(
    "pattern, spelled",
    [
        ("", 0),
        ("abc", 3),
        ("^abc$", 3),  # anchors spell nothing
        ("a{3}", 3),
        ("a{2,5}", 5),  # the most it may repeat
        ("a{5,}", 5),  # at least n, then a loop: n copies
        ("a{,4}", 4),
        ("a{0}", 1),  # at least the atom itself
        ("ab{3}", 4),  # a count repeats the last character only
        ("a*b+c?", 3),  # loops and options: one copy each
        (r"^\d{3}-\d{4}$", 8),
        ("[a-z]{2,64}", 64),  # a class is one atom
        (r"[^\]]{4}", 4),  # an escaped ] inside a class
        ("(?:ab|cd){3}", 12),  # a group: its alternatives add up, then repeat
        ("(?<year>[0-9]{4})-(?=x)", 6),
        ("(a{1,16}){1,16}", 256),  # nested counts multiply
        ("(.{1,8}){1,16}", 128),
        (".{1,8}" * 16, 128),  # chained counts add up
        ("((.{1,4}){1,4}){1,4}", 64),
        ("x{99999999999999}", 10**10),  # any count past 10 digits is read as 10**10
        ("a{}b{,}", 7),  # not counts: characters
        ("{{{{", 4),
        ("(ab", 2),  # an unclosed group counts what it holds
        ("ab)", 3),  # an unmatched ) is a character
        ("[]a]{4}", 6),  # read the larger way: "[]" then "a", then "]" four times
        ("[a[b]{2}", 4),  # a class holds no "[": "[", "a", then "[b]" twice
        ("[abc", 4),  # an unclosed class is characters
    ],
)
def test_a_pattern_spells_its_counted_repetitions_unrolled(pattern: str, spelled: int) -> None:
    assert pattern_repeat(pattern) == spelled


def test_the_size_of_a_schema_counts_its_patterns_counts_and_literals() -> None:
    schema = {
        "type": "object",
        "properties": {
            "code": text("^[A-Z]{3}$"),
            "name": {"type": "string", "minLength": 2, "maxLength": 100},  # its largest count: 100
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 20},
            "kind": {"enum": ["small", "large", 3]},  # strings only: 10 characters
            "fixed": {"const": "yes"},
        },
        "$defs": {"Unused": {"type": "object", "patternProperties": {"^x-[a-z]{1,8}$": {}}}},
    }
    size = schema_size(schema)
    assert (size.depth, size.nodes) == json_extent(schema)  # nesting and nodes as the body's own measure
    assert size.repeat == 100 + 20 + 10
    names = len("codenametagskindfixed") + len("Unused")
    assert size.literal_chars == names + len("smalllarge") + len("yes") + len("^[A-Z]{3}$") + len("^x-[a-z]{1,8}$")
    assert size.pattern_chars == len("^x-[a-z]{1,8}$")  # 14 written, 11 unrolled
    assert schema_fault(BOUNDS, schema) is None


def test_a_keyword_used_as_a_property_name_is_a_name_not_a_bound() -> None:
    schema = {"type": "object", "properties": {"pattern": {"type": "string"}, "maxLength": {"type": "integer"}}}
    size = schema_size(schema)
    assert (size.repeat, size.pattern_chars, size.literal_chars) == (0, 0, len("patternmaxLength"))


@pytest.mark.parametrize(
    "schema, says",
    [
        (text("(.{1,16}){1,16}"), "a pattern of 256 characters"),
        (text("a" * 129), "a pattern of 129 characters"),
        (text("[a-z]{0,128}"), None),  # exactly at the bound
        ({"type": "string", "maxLength": 1025}, "adding up to 1025; the limit is 1024"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 256} for i in range(5)}},
            "adding up to 1280",
        ),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 10**12}, "adding up to 10000000000;"),
        ({"enum": ["x" * 20000, "y" * 12769]}, "spells 32769 characters"),
        ({"const": "z" * 32768}, None),
    ],
)
def test_each_bound_passed_is_named(schema: dict, says: str | None) -> None:
    fault = schema_fault(BOUNDS, schema)
    if says is None:
        assert fault is None
    else:
        assert fault is not None and says in fault


def test_schemas_measured_together_add_up() -> None:
    """The tools' parameters are one grammar under tool_choice "required": their counts
    and literals add up, their depth is the deepest one's."""
    one = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 600}}}
    assert schema_fault(BOUNDS, one) is None
    both = schema_size(one, one)
    assert (both.repeat, both.literal_chars, both.depth) == (1200, 2, 3)
    fault = schema_fault(BOUNDS, one, one)
    assert fault is not None and "adding up to 1200" in fault


def test_measuring_reads_at_most_the_literal_bound_of_patterns() -> None:
    """Past ``max_literal_chars`` of pattern text (or past ``max_pattern_chars`` for one), a
    pattern counts as written, unread: the schema is past the literal bound anyway."""
    small = SchemaBounds(max_depth=32, max_nodes=4096, max_repeat=1024, max_pattern_chars=64, max_literal_chars=100)
    nested = "(a{1,16}){1,16}"  # 15 characters, 256 unrolled
    # Measured last (schemas are walked last first): 60 + 35 read already, it would pass 100.
    schemas = (text(nested), text("c" * 35), text("b" * 60))
    size = schema_size(*schemas, bounds=small)
    assert (size.pattern_chars, size.literal_chars) == (60, 110)
    assert "spells 110 characters" in (schema_fault(small, *schemas) or "")
    assert schema_size(text(nested), bounds=small).pattern_chars == 256  # read when within the bounds
    assert schema_size(text("(" * 65), bounds=small).pattern_chars == 65  # longer than a pattern may be: unread
    assert schema_size(text(nested)).pattern_chars == 256  # no bounds: every pattern read


def test_bounds_are_checked_and_built_from_the_config() -> None:
    with pytest.raises(ValueError, match="max_repeat"):
        SchemaBounds(max_depth=32, max_nodes=4096, max_repeat=0, max_pattern_chars=128, max_literal_chars=1)
    assert load_config({}).limits.schema_bounds() == BOUNDS
    with pytest.raises(ValueError, match="max_schema_pattern_chars"):
        load_config({"limits": {"max_schema_pattern_chars": 5000}})
