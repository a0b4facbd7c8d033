"""Log-probabilities in OpenAI's wire shapes, as vLLM's OpenAI server writes them.

A replica hands each position it reports as a ``TokenLogprob`` (the token as text, its
logprob, the k likeliest tokens with theirs, likeliest first). This module turns a run of
them into the ``logprobs`` object of an answer: ``chat_logprobs`` for
``/v1/chat/completions`` (``choices[].logprobs``), ``completion_logprobs`` for
``/v1/completions``. Both are pure (no Ray, no vLLM at run time) and take only the
positions they write, so a front calls them once per unary answer or once per streamed
chunk with that chunk's positions.

Written by hand because vLLM's own builders (``OpenAIServingChat._create_chat_logprobs``,
``OpenAIServingCompletion._create_completion_logprobs``, vLLM 0.32) are methods of its
serving objects that take token ids, a tokenizer and its ``Logprob`` dicts, none of which a
router holds. What they answer is followed rule by rule (the unit tests feed the same
positions to both and compare the dicts):

* **A position's entries.** vLLM keeps one dict per position, keyed by token id: the
  position's own token first, then the k likeliest (its sampler puts the sampled token
  first; ``vllm.logprobs.append_logprobs_for_next_position``). A token among the k
  likeliest keeps its first place (the sampled one's) and is not listed twice. Ballast
  knows tokens by text, so ``_entries`` recognises the token in ``top`` by its text *and*
  its logprob (one id gives one logprob, bit for bit, from one row of log-softmax); two
  distinct ids of equal text and equal logprob in one position read the same on the wire
  either way, up to their order among the tied.
* **Chat** lists the first ``top_logprobs`` entries: the token itself first, likeliest
  first after it. So when the sampled token is not among the k likeliest, the list holds
  it and the k - 1 likeliest (vLLM's rule, not "the k likeliest"); 0 gives ``[]``.
* **Completions** list up to k + 1 entries (OpenAI's ``logprobs`` counts "plus the
  sampled token"), as a ``{text: logprob}`` dict: entries of one text collapse into the
  first one's place with the last one's logprob, as a Python dict comprehension does in
  vLLM. k = 0 gives the token alone.
* **Clamp.** Every logprob is written as ``max(logprob, -9999.0)``: ``-inf`` (a token the
  model rules out) is not JSON, -9999.0 is what OpenAI and vLLM send instead.
* **Bytes** (chat) are ``list(text.encode("utf-8", errors="replace"))`` of the text as
  given; a token that is part of a multi-byte character names whatever the replica named
  it (vLLM corrects a trailing U+FFFD from the tokens before it, upstream of this module).
* **A prompt's first position** (``logprob`` None, echo only) has no context: completions
  write its token with ``null`` logprob and ``null`` top entries. vLLM names that token
  with ``tokenizer.decode(id)`` (not ``convert_ids_list_to_tokens`` as every other
  position): the replica must hand that text. Chat has no prompt positions; a position
  without a logprob there is written as vLLM's unary answer writes a token missing from
  its dict (logprob -9999.0, no top entries).
* **Text offsets** (completions) start at ``text_offset`` and advance by each token's
  length in characters (Python ``len``, as vLLM: not the length of the answer's text,
  which stop strings may hold back); a streamed answer starts each chunk where the last
  ended (``CompletionLogprobs.next_text_offset``), the first echoed chunk at 0 with the
  prompt's positions before the first generated ones.

Bounds: k and ``top_logprobs`` are ints in [0, MAX_TOP_LOGPROBS] (vLLM's -1, "every
token", is not offered); anything else is a ValueError here (a front refuses such a
request with a 400 before it is run). The work is linear in the positions and their ``top`` entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ballast.model.protocol import MAX_TOP_LOGPROBS, TokenLogprob

#: What OpenAI and vLLM write for a logprob below it (``-inf`` included).
MIN_LOGPROB = -9999.0


class CompletionLogprobs(NamedTuple):
    """A completion choice's (or one streamed chunk's) ``logprobs`` object, and the text
    offset the next chunk's first token starts at."""

    wire: dict[str, Any]
    next_text_offset: int


def chat_logprobs(tokens: Sequence[TokenLogprob], top_logprobs: int) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat answer (or of one streamed chunk, its positions
    alone): ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}, ...]}, ...]}``, each ``top_logprobs`` the position's first ``top_logprobs``
    entries (the token itself first; see the module's rules)."""
    _check_k("top_logprobs", top_logprobs)
    return {"content": [_chat_position(t, top_logprobs) for t in tokens]}


def completion_logprobs(
    tokens: Sequence[TokenLogprob],
    k: int,
    text_offset: int = 0,
    prompt: Sequence[TokenLogprob] | None = None,
) -> CompletionLogprobs:
    """``choices[].logprobs`` of a completion (or of one streamed chunk): ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (a ``{text: logprob}`` of up to k + 1 entries per
    position, None for a prompt's first) and ``text_offset``, one per position, the
    ``prompt``'s positions first when given (echo; ``tokens`` may then be empty, as with
    ``max_tokens: 0``). Offsets start at ``text_offset``."""
    _check_k("logprobs", k)
    if isinstance(text_offset, bool) or not isinstance(text_offset, int) or text_offset < 0:
        raise ValueError(f"text_offset must be an int >= 0, got {text_offset!r}")
    positions = [*prompt, *tokens] if prompt is not None else list(tokens)
    texts: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for pos in positions:
        texts.append(pos.token)
        offsets.append(offset)
        offset += len(pos.token)
        if pos.logprob is None:
            logprobs.append(None)
            tops.append(None)
        else:
            logprobs.append(_clamp(pos.logprob))
            tops.append({text: _clamp(lp) for text, lp in _entries(pos, pos.logprob)[: k + 1]})
    wire = {"text_offset": offsets, "token_logprobs": logprobs, "tokens": texts, "top_logprobs": tops}
    return CompletionLogprobs(wire, offset)


def _chat_position(pos: TokenLogprob, top_logprobs: int) -> dict[str, Any]:
    if pos.logprob is None:
        return {"token": pos.token, "logprob": MIN_LOGPROB, "bytes": _bytes(pos.token), "top_logprobs": []}
    return {
        "token": pos.token,
        "logprob": _clamp(pos.logprob),
        "bytes": _bytes(pos.token),
        "top_logprobs": [
            {"token": text, "logprob": _clamp(lp), "bytes": _bytes(text)}
            for text, lp in _entries(pos, pos.logprob)[:top_logprobs]
        ],
    }


def _entries(pos: TokenLogprob, logprob: float) -> list[tuple[str, float]]:
    """vLLM's dict of the position (whose ``logprob`` is given), in its order: the token
    itself, then ``top`` without the one entry that is the token (same text, same
    logprob), if it is there."""
    own = (pos.token, logprob)
    rest = list(pos.top)
    if own in rest:
        rest.remove(own)  # the first equal one: its place is the token's, first
    return [own, *rest]


def _clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _check_k(name: str, k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
