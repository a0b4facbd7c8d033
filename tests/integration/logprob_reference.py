"""What a model's own forward pass says of a sequence: the reference a served answer's
log-probabilities are checked against (the transformers and vLLM stacks serve a Hugging
Face directory; transformers reads the same directory here, in float32)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

TOLERANCE = 1e-3  # issue 63: each logprob within 1e-3 of the engine's own


@functools.cache
def _model(path: str):  # one directory per stack module
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()


def forward_logprobs(path: Path, ids: Sequence[int]) -> list[list[float]]:
    """log_softmax of the model's logits at every position of ``ids``: row i is the
    distribution of token i + 1."""
    import torch

    with torch.inference_mode():
        logits = _model(str(path))(input_ids=torch.tensor([list(ids)])).logits[0].float()
    return logits.log_softmax(-1).tolist()


def check_positions(rows: list[list[float]], start: int, ids: Sequence[int], logprobs: Sequence[float], tops) -> None:
    """Position j of ``ids`` (token ids following the sequence's first ``start``) has the
    logprob the forward pass gives it, and its likeliest tokens' logprobs are the forward
    pass's k largest, in order (``tops``: each position's listed logprobs)."""
    assert len(ids) == len(logprobs) == len(tops)
    for j, (tid, lp, top) in enumerate(zip(ids, logprobs, tops, strict=True)):
        row = rows[start + j - 1]
        assert math.isclose(lp, max(row[tid], -9999.0), abs_tol=TOLERANCE), (j, lp, row[tid])
        best = sorted(row, reverse=True)[: len(top)]
        assert all(math.isclose(a, b, abs_tol=TOLERANCE) for a, b in zip(sorted(top, reverse=True), best)), (j, top)


def greedy_ids(path: Path, ids: Sequence[int], count: int, eos: int | None) -> list[int]:
    """The model's greedy continuation of ``ids`` by its own forward pass (up to ``count``
    tokens, ending at ``eos``)."""
    out: list[int] = []
    for _ in range(count):
        row = forward_logprobs(path, [*ids, *out])[-1]
        out.append(max(range(len(row)), key=row.__getitem__))
        if out[-1] == eos:
            break
    return out


def check_served_logprobs(oai, model: str, tok, path: Path) -> None:
    """Log-probabilities served on ``model`` (a Hugging Face directory at ``path``) equal
    its forward pass's: chat's unary and streamed, top_logprobs the k likeliest; a
    completion's echoed prompt and answer; echo alone with max_tokens 0; n choices."""
    messages = [{"role": "user", "content": "Name three colours."}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(rendered, add_special_tokens=False)
    greedy = greedy_ids(path, prompt, 6, tok.eos_token_id)
    rows = forward_logprobs(path, prompt + greedy)
    ask = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True}
    unary = oai.chat.completions.create(**ask, top_logprobs=5).choices[0].logprobs.content
    streamed = [
        t
        for chunk in oai.chat.completions.create(**ask, top_logprobs=5, stream=True)
        for c in chunk.choices
        if c.logprobs is not None
        for t in c.logprobs.content or ()
    ]
    for content in (unary, streamed):
        n = len(content)
        assert 1 <= n <= len(greedy)
        check_positions(
            rows,
            len(prompt),
            greedy[:n],
            [t.logprob for t in content],
            [[e.logprob for e in t.top_logprobs] for t in content],
        )
        assert all(len(t.top_logprobs) == 5 and t.bytes == list(t.token.encode()) for t in content)

    text = "The quick brown fox"
    ids = tok.encode(text)
    greedy = greedy_ids(path, ids, 4, tok.eos_token_id)
    rows = forward_logprobs(path, ids + greedy)
    done = oai.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = done.choices[0].logprobs
    answer = len(lp.tokens) - len(ids)
    assert 1 <= answer <= len(greedy) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    check_positions(rows, 1, (ids + greedy)[1 : len(ids) + answer], lp.token_logprobs[1:], [[]] * (len(lp.tokens) - 1))
    assert done.choices[0].text.startswith(tok.decode(ids)) and lp.text_offset[0] == 0
    assert done.usage.completion_tokens == answer

    alone = oai.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1)
    (choice,) = alone.choices
    assert (choice.text, alone.usage.completion_tokens, choice.finish_reason) == (text, 0, "length")
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    check_positions(rows, 1, ids[1:], choice.logprobs.token_logprobs[1:], [[]] * (len(ids) - 1))

    three = oai.completions.create(model=model, prompt=text, max_tokens=4, temperature=0, n=3)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert len({c.text for c in three.choices}) == 1  # greedy: three equal choices
    assert three.usage.completion_tokens == 3 * answer
