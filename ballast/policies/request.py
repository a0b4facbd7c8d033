"""The router's per-request decisions on the native generate path.

ballast/router/ gathers a request's inputs (its tenant's config, the level's
constraints, the snapshot's replica counts) and applies what these return; each is a
pure function of its arguments, so the fleet simulator and the unit tests use the
same rules as the router.

Input bounds: how deep a JSON text nests (``json_nesting``: a linear scan, no parse)
and how big a decoded value is (``json_extent``: nesting and nodes, no recursion), the
measures the fronts compare with ``limits``; the temperature served (greedy below
``GREEDY_BELOW_TEMPERATURE``) and the seeds' range.
"""

from __future__ import annotations

import math
import re
from itertools import accumulate
from typing import Any, NamedTuple, Optional

from ballast.policies.criticality import Criticality

# The quota's Retry-After: the bucket may be a hair short of a refill when it answers
# ("retry in 0 s" helps nobody), and a rate so low that the wait is hours is better
# answered with a bounded hint than with a figure nobody will honour.
QUOTA_RETRY_AFTER_FLOOR_S = 0.01
QUOTA_RETRY_AFTER_CAP_S = 3600.0

# Outcomes that are not errors for the level's error rate, whatever their status:
# - DEADLINE_EXCEEDED: a deadline that ran out is load (the queue signals measure it)
#   or a slow model (its breaker counts the attempt timeouts and takes it out).
#   Counted as an error, the first burst of expired requests at the onset of overload
#   would read as a failing model: level 3, critical traffic shed for a stable window.
# - KILL_SWITCH: an operator's refusal, not a failing model.
# - REPLICA_LOST: the replica or node that held the request went away and it could not be
#   carried on elsewhere (ballast/policies/migration.py): capacity that is gone, not a sick model.
#   Counted as an error, the requests in flight on a lost node would take the level to 3
#   and the survivors would shed healthy traffic for a whole stable window.
NOT_LEVEL_ERRORS = frozenset({"DEADLINE_EXCEEDED", "KILL_SWITCH", "REPLICA_LOST"})


def lower_criticality(claimed: Criticality, cap: Criticality) -> tuple[Criticality, bool]:
    """(granted, lowered): a claim above what the tenant may claim is lowered to its cap
    (rank 0 is the most critical), and the router says so in the answer."""
    if claimed.rank < cap.rank:
        return cap, True
    return claimed, False


def prompt_tokens(prompt: str, model_max_tokens: int) -> int:
    """The prompt's tokens as the quota counts them: the built-in model is byte-level, one
    token per UTF-8 byte, at most the model's context."""
    return min(len(prompt.encode("utf-8")), model_max_tokens)


def token_cost(prompt_token_count: int, granted_max_tokens: int) -> int:
    """What the quota charges up front: the prompt and every token the request may
    generate; settled to the real count when the request ends."""
    return prompt_token_count + granted_max_tokens


def degraded_reasons(
    *,
    requested_max_tokens: int,
    level_max_tokens: int,
    model_max_tokens: int,
    lowered: bool,
    stream_requested: bool,
    streaming_allowed: bool,
) -> list[str]:
    """Why the answer is less than what was asked, in this order. Clamped by the level is
    degradation; clamped by the model's context is not."""
    reasons = ["max_tokens_clamped"] if level_max_tokens < min(requested_max_tokens, model_max_tokens) else []
    if lowered:
        reasons.append("criticality_lowered")
    if stream_requested and not streaming_allowed:
        reasons.append("streaming_disabled")
    return reasons


def quota_retry_after_s(bucket_wait_s: float) -> float:
    """The Retry-After for a tenant over its quota: the bucket's own wait, floored and capped."""
    return min(max(bucket_wait_s, QUOTA_RETRY_AFTER_FLOOR_S), QUOTA_RETRY_AFTER_CAP_S)


def counts_as_error(code: str, status: int) -> bool:
    """Whether an outcome counts as an error for the level's error rate: a 5xx, less the
    outcomes in ``NOT_LEVEL_ERRORS``. The same rule for unary answers and streams (a
    kill switch that ends a stream is still an operator's refusal)."""
    return status >= 500 and code not in NOT_LEVEL_ERRORS


def fit_context(prompt_tokens: int, asked: Optional[int], context: int) -> tuple[int, Optional[str]]:
    """(max_tokens, None) when the prompt and ``asked`` fit a model of ``context`` tokens, else
    (0, why not). No ``asked``: all the context the prompt leaves, as OpenAI's API does.

    Checked at the router, before any work, with the model's own tokenizer; the replica
    never has to cut an answer short for lack of context."""
    if prompt_tokens < 1:
        return 0, "the prompt has no tokens; send at least one"
    room = context - prompt_tokens
    if asked is None:
        if room < 1:
            return 0, f"the model's context is {context} tokens and the prompt alone is {prompt_tokens}"
        return room, None
    if asked > room:
        return 0, (
            f"the model's context is {context} tokens, but {prompt_tokens + asked} were asked for "
            f"({prompt_tokens} in the prompt, {asked} for the completion)"
        )
    return asked, None


# ------------------------------------------------------------------- input bounds

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


#: Below this a temperature samples the argmax anyway (a logit gap of 0.001 becomes a
#: factor e^100), and logits / temperature heads for overflow (float16 ends at 65504):
#: such a temperature is served as 0, greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_temperature(asked: float) -> float:
    """The temperature the engines are sent: ``asked``, or 0 (greedy) below
    ``GREEDY_BELOW_TEMPERATURE``. ``asked`` is finite and >= 0 (checked where it is read)."""
    if not math.isfinite(asked) or asked < 0:
        raise ValueError(f"temperature: must be a finite number >= 0, got {asked!r}")
    return 0.0 if asked < GREEDY_BELOW_TEMPERATURE else asked


#: Seeds as every engine takes them: an int64 (OpenAI's and vLLM's range; torch's
#: generators take any int64 and wrap a negative one).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
