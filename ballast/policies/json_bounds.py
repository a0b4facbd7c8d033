"""How big a JSON input is, measured without recursing: the fronts compare these measures
with their limits before a body, a schema or a tool's arguments costs any more work.

``json_nesting`` measures a JSON text (a linear scan, no parse), ``json_extent`` a decoded
value (nesting and nodes, an explicit stack). Python's ``json.loads`` recurses once per
level in C, so a text is measured before it is parsed.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any, NamedTuple

# A JSON string literal, escapes included; an unterminated one runs to the end of the
# text. Possessive, so the scan is linear whatever the text: it never backtracks.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NESTING_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_nesting(text: str) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest (0: a scalar), by a linear
    scan that recurses nowhere: string literals are dropped, then the running count of
    brackets is taken. Exact for valid JSON; for invalid JSON a count the parser will
    refuse anyway. Run before ``json.loads``, whose C parser recurses once per level."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_NESTING_STEP.__getitem__, brackets)), default=0)


class Extent(NamedTuple):
    """The size of a decoded JSON value: its containers' nesting (0: a scalar) and its
    node count (every object, array and scalar; an object's keys are not counted)."""

    depth: int
    nodes: int


def json_extent(value: Any) -> Extent:
    """The ``Extent`` of a decoded JSON value, walked with an explicit stack (no recursion)."""
    depth = nodes = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        nodes += 1
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children)
    return Extent(depth, nodes)
