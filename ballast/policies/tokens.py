"""A request's tokens as the router weighs them: what the quota charges up front, when a
tenant short of them may retry, and whether the prompt and ``max_tokens`` fit the context.

Pure functions of their arguments: the router (``ballast.router.quotas``,
``ballast.router.tokens``) gathers the counts with the model's own tokenizer and applies
what these return; the fleet simulator and the unit tests use the same rules.
"""

from __future__ import annotations

# The quota's Retry-After: the bucket may be a hair short of a refill when it answers
# ("retry in 0 s" helps nobody), and a rate so low that the wait is hours is better
# answered with a bounded hint than with a figure nobody will honour.
QUOTA_RETRY_AFTER_FLOOR_S = 0.01
QUOTA_RETRY_AFTER_CAP_S = 3600.0


def token_cost(prompt_token_count: int, granted_max_tokens: int) -> int:
    """What the quota charges up front: the prompt and every token the request may
    generate; settled to the real count when the request ends."""
    return prompt_token_count + granted_max_tokens


def quota_retry_after_s(bucket_wait_s: float) -> float:
    """The Retry-After for a tenant over its quota: the bucket's own wait, floored and capped."""
    return min(max(bucket_wait_s, QUOTA_RETRY_AFTER_FLOOR_S), QUOTA_RETRY_AFTER_CAP_S)


def fit_context(prompt_tokens: int, asked: int | None, context: int) -> tuple[int, str | None]:
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
