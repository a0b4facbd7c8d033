"""What a JSON schema asks of guided decoding, measured without compiling it.

A ``response_format`` schema, or the tools' parameters, become a grammar over the model's
vocabulary (xgrammar, in the vLLM engine) before a row can decode by it. The compile's
time grows with what the grammar has to spell out, and a few features multiply it:

- **counts**: ``minLength``/``maxLength`` of a string, ``minItems``/``maxItems`` of an
  array, ``minProperties``/``maxProperties`` of an object (and ``min``/``maxContains``):
  the grammar unrolls a copy of the item per unit counted;
- **patterns** (regular expressions): their counted repetitions multiply when nested
  (``(.{1,16}){1,16}`` spells 256 copies of ``.``) and add up when chained;
- **literals**: property and definition names, ``enum`` and ``const`` strings, spelled
  out character by character.

:func:`schema_size` measures one schema or several together (the tools' parameters:
``tool_choice: "required"`` compiles all of them at once) in one walk with an explicit
stack (no recursion); :func:`schema_fault` compares a size with :class:`SchemaBounds` and
says which bound it passes. Every schema is measured at the router's front, before any
work is queued for it.

The measure is deliberately coarse and errs on the large side (a count is taken as the
largest a schema object asks; the alternatives of a pattern add up). It bounds the work a
schema can ask for; it does not predict the compile's time, which ambiguous patterns make
grow much faster than any size: that is why the replica also compiles within a time limit
on a share of threads per tenant (``ballast.model.grammar``).

:func:`bounded_numbers` is the schema the engine is handed in the client's place: each
integer and number the schema leaves unbounded gets bounds, so that the grammar admits a
bounded count of digits (a model otherwise may write digits until ``max_tokens``). It
rewrites what was measured, never the measure: a schema is measured as the client sent it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from ballast.policies.sampling import INT64_MAX, INT64_MIN

__all__ = [
    "COUNT_KEYWORDS",
    "INTEGER_BOUNDS",
    "NUMBER_BOUNDS",
    "SchemaBounds",
    "SchemaSize",
    "bounded_numbers",
    "pattern_repeat",
    "schema_fault",
    "schema_size",
]

#: Keywords whose value is a count the grammar unrolls.
COUNT_KEYWORDS = frozenset(
    {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains"}
)
#: Keywords whose value maps names (spelled out in the grammar) to schemas.
_NAMED = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})
#: A count past this is taken as this (a pattern's ``{99999999999}`` is read as at most 10
#: digits, so that measuring costs nothing however big the number written).
_COUNT_CAP = 10**10
_MAX_DIGITS = 10

#: The bounds :func:`bounded_numbers` gives an ``integer`` where its schema gives none: int64,
#: the integers every engine takes and a request's own integers are held to (at most 19
#: digits in xgrammar's grammar).
INTEGER_BOUNDS = (INT64_MIN, INT64_MAX)
#: The bounds it gives a ``number``: +-10**15 (doubles hold its integers exactly). A range
#: is what bounds a number's digits in xgrammar's grammar (0.2.8: at most 16 before the
#: point, at most 6 after it, no exponent); without one its digits are unbounded.
NUMBER_BOUNDS = (-(10**15), 10**15)
#: Where a schema object holds schemas, by keyword: a schema (``items`` also a list of them,
#: draft 4's tuples), a list of schemas, or names mapped to schemas. ``not``, ``if``,
#: ``contains`` and ``propertyNames`` are not walked: a schema there is a condition, and
#: bounding it would change what the whole admits (under ``not``, widen it).
_ONE_SCHEMA = frozenset(
    {"items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties"}
)
_SCHEMA_LIST = frozenset({"prefixItems", "anyOf", "oneOf", "allOf"})
_SCHEMA_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_Role = Literal["schema", "map", "data"]  # what a value in a schema is (bounded_numbers)


class SchemaSize(NamedTuple):
    """What one schema, or several together, asks (see the module).

    ``depth``: its arrays' and objects' nesting (0: a scalar; the deepest of several);
    ``nodes``: every object, array and scalar in it (an object's keys are not counted);
    ``repeat``: the counts it asks, each schema object its largest, summed;
    ``literal_chars``: the characters of its property and definition names, of its
    ``enum`` and ``const`` strings and of its patterns, summed; ``pattern_chars``: its
    longest pattern, as written or unrolled (:func:`pattern_repeat`), whichever is longer."""

    depth: int
    nodes: int
    repeat: int
    literal_chars: int
    pattern_chars: int


@dataclass(frozen=True)
class SchemaBounds:
    """The most a schema (or the tools' schemas together) may ask; ``limits.max_schema_*``."""

    max_depth: int
    max_nodes: int
    max_repeat: int
    max_pattern_chars: int
    max_literal_chars: int

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_nodes", "max_repeat", "max_pattern_chars", "max_literal_chars"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SchemaBounds.{name} must be an int >= 1, got {v!r}")


def schema_size(*schemas: Any, bounds: SchemaBounds | None = None) -> SchemaSize:
    """The :class:`SchemaSize` of ``schemas`` (decoded JSON values) together.

    With ``bounds``, a pattern is unrolled (:func:`pattern_repeat`) only when it is within
    ``max_pattern_chars`` as written and the patterns read so far are within
    ``max_literal_chars``; any other counts as written. Such a size is past ``bounds``
    either way (a pattern's text is in ``literal_chars``), and measuring reads at most
    ``max_literal_chars`` characters of patterns whatever the body holds."""
    depth = nodes = repeat = literal = pattern = scanned = 0
    most_read = bounds.max_literal_chars if bounds is not None else _COUNT_CAP
    longest_read = bounds.max_pattern_chars if bounds is not None else _COUNT_CAP
    stack: list[tuple[Any, int]] = [(s, 1) for s in schemas]
    while stack:
        node, level = stack.pop()
        nodes += 1
        if isinstance(node, list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in node)
        elif isinstance(node, dict):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in node.values())
            repeat += max((_count(node[k]) for k in COUNT_KEYWORDS.intersection(node)), default=0)
            literal += _literal_chars(node)
            for p in _patterns(node):
                literal += len(p)
                pattern = max(pattern, len(p))
                if len(p) <= longest_read and scanned + len(p) <= most_read:
                    scanned += len(p)
                    pattern = max(pattern, pattern_repeat(p))
    return SchemaSize(depth, nodes, repeat, literal, pattern)


def schema_fault(bounds: SchemaBounds, *schemas: Any) -> str | None:
    """Why ``schemas`` together are past ``bounds`` (a phrase: "nests 40 deep; the limit is
    32"), or None."""
    size = schema_size(*schemas, bounds=bounds)
    if size.depth > bounds.max_depth:
        return f"nests {size.depth} deep; the limit is {bounds.max_depth}"
    if size.nodes > bounds.max_nodes:
        return f"has {size.nodes} nodes; the limit is {bounds.max_nodes}"
    if size.pattern_chars > bounds.max_pattern_chars:
        return (
            f"has a pattern of {size.pattern_chars} characters (as written, or with its counted repetitions "
            f"unrolled); the limit is {bounds.max_pattern_chars}"
        )
    if size.repeat > bounds.max_repeat:
        return (
            f"asks for counts (minLength, maxLength, minItems, maxItems, ...) adding up to {size.repeat}; "
            f"the limit is {bounds.max_repeat}"
        )
    if size.literal_chars > bounds.max_literal_chars:
        return (
            f"spells {size.literal_chars} characters of names, enum and const values and patterns; "
            f"the limit is {bounds.max_literal_chars}"
        )
    return None


def bounded_numbers(schema: Any) -> Any:
    """A copy of ``schema`` (a decoded JSON value) in which every schema object that admits
    an ``integer`` or a ``number`` is bounded on each side it leaves open: ``minimum`` /
    ``maximum`` from :data:`NUMBER_BOUNDS` where its ``type`` names ``number`` (or a list
    holding it), else from :data:`INTEGER_BOUNDS` where it names ``integer``. The schema's
    own bounds win: a side with ``minimum`` or ``exclusiveMinimum`` (``maximum``,
    ``exclusiveMaximum``) is kept as sent, and a side stays open where the schema's other
    bound lies past its default (``minimum: 1e16`` on a number gets no ``maximum``). An
    ``integer`` with ``multipleOf`` is left as sent: xgrammar drops ``multipleOf`` from an
    integer given a range.

    Schema objects are found where the keywords hold them (``properties``, ``items``,
    ``anyOf``, ``$defs``, ...: ``_ONE_SCHEMA``, ``_SCHEMA_LIST``, ``_SCHEMA_MAP``); any other
    value (``enum``, ``const``, ``default``) is data, copied as it is. One walk with an
    explicit stack (no recursion); ``schema`` itself is never changed."""
    root: dict[Any, Any] = {}  # the copy, under 0
    stack: list[tuple[Any, dict[Any, Any] | list[Any], Any, _Role]] = [(schema, root, 0, "schema")]
    while stack:
        node, parent, key, role = stack.pop()
        copy: Any = node
        if isinstance(node, dict):
            copy = dict(node)
            stack.extend((v, copy, k, _role_in(role, k)) for k, v in node.items())
            if role == "schema":
                copy.update(_number_bounds(node))
        elif isinstance(node, list):
            copy = list(node)
            stack.extend((v, copy, i, "schema" if role == "schema" else "data") for i, v in enumerate(node))
        parent[key] = copy
    return root[0]


def _role_in(role: _Role, key: str) -> _Role:
    """What the value under ``key`` of a dict that is a ``role`` is."""
    if role == "map":
        return "schema"
    if role == "schema" and (key in _ONE_SCHEMA or key in _SCHEMA_LIST):
        return "schema"
    if role == "schema" and key in _SCHEMA_MAP:
        return "map"
    return "data"


def _number_bounds(node: dict[str, Any]) -> dict[str, int]:
    """The bounds :func:`bounded_numbers` adds to the schema object ``node``: none, one or both."""
    named = node.get("type")
    types = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    if "number" in types:
        low, high = NUMBER_BOUNDS
    elif "integer" in types and "multipleOf" not in node:
        low, high = INTEGER_BOUNDS
    else:
        return {}
    lows = [v for k in ("minimum", "exclusiveMinimum") if k in node and _is_number(v := node[k])]
    highs = [v for k in ("maximum", "exclusiveMaximum") if k in node and _is_number(v := node[k])]
    added = {}
    if "minimum" not in node and "exclusiveMinimum" not in node and all(h > low for h in highs):
        added["minimum"] = low
    if "maximum" not in node and "exclusiveMaximum" not in node and all(lo < high for lo in lows):
        added["maximum"] = high
    return added


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pattern_repeat(pattern: str) -> int:
    """How many characters ``pattern`` spells with every counted repetition unrolled: each
    atom (a character, an escape, a class ``[...]``, ``.``) counts 1, a group the sum of its
    alternatives, ``x{n,m}`` m times ``x`` (``{n}`` and ``{n,}``: n), ``*``, ``+`` and ``?``
    once. One scan of the tokens (``_TOKEN``: runs of plain characters are one token); a
    construct read another way by the engine is counted the larger way (a class ends at its
    first ``]`` and holds no ``[``, else its ``[`` is a character; an escape's tail counts as
    characters)."""
    groups: list[list[int]] = [[0, 0]]  # per open group: [its size so far, its last atom's size]
    for m in _TOKEN.finditer(pattern):
        kind, text = m.lastgroup, m.group()
        top = groups[-1]
        if kind == "open":
            groups.append([0, 0])
            continue
        if kind == "close" and len(groups) > 1:
            size = groups.pop()[0]
            top = groups[-1]
            top[0], top[1] = min(top[0] + size, _COUNT_CAP), size
        elif kind == "count":
            times = _times(text)
            top[0] = min(top[0] + top[1] * (times - 1), _COUNT_CAP)  # the atom counted once already
            top[1] = min(top[1] * times, _COUNT_CAP)
        elif kind == "op":
            if text == "|":
                top[1] = 0
        else:  # an escape, a class, a run of plain characters (its last one is what a count repeats)
            top[0] = min(top[0] + (len(text) if kind == "run" else 1), _COUNT_CAP)
            top[1] = 1
    while len(groups) > 1:  # unclosed groups: what they hold counts
        size = groups.pop()[0]
        groups[-1][0] = min(groups[-1][0] + size, _COUNT_CAP)
    return groups[0][0]


#: A pattern's tokens for :func:`pattern_repeat`. Possessive where a token repeats and no
#: token reads past the next ``[`` it does not start with, so the scan is linear; every
#: character is in exactly one token.
_TOKEN = re.compile(
    r"""(?P<escape>\\.?)
    |(?P<cls>\[\^?(?:[^\]\\\[]|\\.)*+\])
    |(?P<open>\((?:\?(?:[:=!]|<[=!]|<\w*+>))?)
    |(?P<close>\))
    |(?P<count>\{(?:[0-9]++(?:,[0-9]*+)?|,[0-9]++)\})
    |(?P<op>[*+?|^$])
    |(?P<run>[^\\\[()*+?|^${]++|[\[{])""",
    re.VERBOSE | re.DOTALL,
)


def _times(count: str) -> int:
    """The times ``{n}``, ``{n,}``, ``{n,m}`` or ``{,m}`` unrolls its atom: m, else n; at least 1."""
    low, _, high = count[1:-1].partition(",")
    bound = high or low
    return max(1, int(bound)) if len(bound) <= _MAX_DIGITS else _COUNT_CAP


def _count(v: Any) -> int:
    return min(v, _COUNT_CAP) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _literal_chars(node: dict[str, Any]) -> int:
    chars = 0
    for key in _NAMED.intersection(node):
        names = node[key]
        if isinstance(names, dict):
            chars += sum(len(k) for k in names)
    enum = node.get("enum")
    if isinstance(enum, list):
        chars += sum(len(v) for v in enum if isinstance(v, str))
    const = node.get("const")
    if isinstance(const, str):
        chars += len(const)
    return chars


def _patterns(node: dict[str, Any]) -> list[str]:
    """The regular expressions a schema object holds: its ``pattern`` and its
    ``patternProperties``' names."""
    found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    by_pattern = node.get("patternProperties")
    if isinstance(by_pattern, dict):
        found.extend(by_pattern)
    return found
