"""What the router says of an answer beyond its text: why it is less than what was asked
(``degraded_reasons``), and whether its outcome counts as an error of the model for the
level's error rate (``counts_as_error``). The same rules for unary answers and streams.
"""

from __future__ import annotations

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


def counts_as_error(code: str, status: int) -> bool:
    """Whether an outcome counts as an error for the level's error rate: a 5xx, less the
    outcomes in ``NOT_LEVEL_ERRORS``. The same rule for unary answers and streams (a
    kill switch that ends a stream is still an operator's refusal)."""
    return status >= 500 and code not in NOT_LEVEL_ERRORS
