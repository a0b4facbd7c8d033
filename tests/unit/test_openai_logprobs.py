"""ballast.router.openai_logprobs against vLLM's own OpenAI server code.

Each test builds positions once (token ids, texts, logprobs), turns them into vLLM's
``Logprob`` dicts with vLLM's own ``append_logprobs_for_next_position`` (what its engine
does with a sampler's output: the sampled token first, then the k likeliest) and into
Ballast's ``TokenLogprob``s (the token, its logprob, the k likeliest), then asserts that
vLLM's ``_create_chat_logprobs`` / ``_create_completion_logprobs`` (called on a bare
instance of their serving class: they read nothing of it but one flag) and Ballast's
functions write the same dict. The shapes are validated with the ``openai`` client's own
types too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import vllm.logprobs as vllm_logprobs
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

from ballast.model.protocol import TokenLogprob
from ballast.router.openai_logprobs import chat_logprobs, completion_logprobs
from tests.unit.hf_fixture import train_tokenizer

Entry = tuple[int, str, float]  # token id, its text, its logprob


@dataclass(frozen=True)
class Position:
    """One position as an engine reports it: its own token, and the k likeliest."""

    token: Entry
    top: tuple[Entry, ...] = ()

    def vllm(self) -> dict[int, Any]:
        """vLLM's dict for this position, built by vLLM's engine-side function."""
        out: list[dict[int, Any] | None] = []
        ids, texts, lps = zip(self.token, *self.top)
        rank = 1 + sum(1 for _, _, lp in self.top if lp > self.token[2])
        vllm_logprobs.append_logprobs_for_next_position(out, list(ids), list(lps), list(texts), rank, len(self.top))
        entry = out[0]
        assert entry is not None
        return entry

    def ballast(self) -> TokenLogprob:
        return TokenLogprob(self.token[1], self.token[2], tuple((text, lp) for _, text, lp in self.top))


@pytest.fixture(scope="module")
def tok() -> Any:
    return train_tokenizer()


def vllm_chat(positions: list[Position], k: int, tokenizer: Any) -> dict[str, Any]:
    serving = object.__new__(OpenAIServingChat)  # its methods read only this flag of it
    serving.return_tokens_as_token_ids = False
    made = serving._create_chat_logprobs(
        token_ids=[p.token[0] for p in positions],
        top_logprobs=[p.vllm() for p in positions],
        tokenizer=tokenizer,
        num_output_top_logprobs=k,
    )
    out: dict[str, Any] = made.model_dump()
    return out


def vllm_completion(
    token_ids: list[int], dicts: list[dict[int, Any] | None], k: int, tokenizer: Any, offset: int = 0
) -> dict[str, Any]:
    serving = object.__new__(OpenAIServingCompletion)
    serving.return_tokens_as_token_ids = False
    made = serving._create_completion_logprobs(
        token_ids=token_ids,
        top_logprobs=dicts,
        num_output_top_logprobs=k,
        tokenizer=tokenizer,
        initial_text_offset=offset,
    )
    out: dict[str, Any] = made.model_dump()
    return out


def keyed(d: dict[str, Any]) -> Any:
    """A completion answer with each top dict as its (key, value) list: dict equality
    ignores order, and the order of the keys is what vLLM's collapse of one text decides."""
    return {**d, "top_logprobs": [None if t is None else list(t.items()) for t in d["top_logprobs"]]}


# Positions written by hand: unicode texts (CJK, emoji, accents, a lone replacement
# character, the empty text of an unfinished character), the sampled token among the
# likeliest and not, a text shared by two ids, logprobs of -inf and below -9999.
HAND = [
    Position((11, "東京", -0.25), ((11, "東京", -0.25), (12, "🙂", -1.5), (13, "é", -2.0), (14, " naïve", -3.0))),
    Position((21, "\ufffd", -4.5), ((22, "Ελ", -0.5), (23, "", -1.0), (24, "a", -2.0), (25, "b", -3.0))),
    Position((31, "x", -0.75), ((32, "y", -0.5), (31, "x", -0.75), (33, "x", -1.0), (34, "z", -12000.0))),
    Position((41, "the", -20000.0), ((42, " the", -0.1), (43, "The", -3.0), (44, "the", -7.0), (45, "q", -math.inf))),
    Position((51, "p", -0.5), ((51, "p", -0.5), (52, "r", -math.inf), (53, "s", -math.inf), (54, "s", -math.inf))),
]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_chat_equals_vllm_on_hand_positions(tok: Any, k: int) -> None:
    ours = chat_logprobs([p.ballast() for p in HAND], k)
    assert ours == vllm_chat(HAND, k, tok)
    # the token itself and its top entries, the token listed once: 4 where it is among them
    assert [len(c["top_logprobs"]) for c in ours["content"]] == [min(k, n) for n in (4, 5, 4, 5, 4)]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_completion_equals_vllm_on_hand_positions(tok: Any, k: int) -> None:
    ours = completion_logprobs([p.ballast() for p in HAND], k, text_offset=7)
    theirs = vllm_completion([p.token[0] for p in HAND], [p.vllm() for p in HAND], k, tok, offset=7)
    assert keyed(ours.wire) == keyed(theirs)
    assert ours.next_text_offset == theirs["text_offset"][-1] + len(theirs["tokens"][-1])


def test_the_rules_vllm_follows_as_seen_on_the_wire(tok: Any) -> None:
    """What the comparisons above pin, said once in plain values."""
    chat = chat_logprobs([p.ballast() for p in HAND], 2)["content"]
    # the sampled token not among the likeliest comes first, then the likeliest (k - 1 of them)
    assert [e["token"] for e in chat[1]["top_logprobs"]] == ["\ufffd", "Ελ"]
    # among them, it keeps the first place and is listed once
    assert [e["token"] for e in chat[2]["top_logprobs"]] == ["x", "y"]
    assert chat[0]["bytes"] == list("東京".encode()) and chat[1]["bytes"] == [239, 191, 189]
    assert chat[3]["logprob"] == -9999.0 and chat_logprobs([HAND[4].ballast()], 4)["content"][0]["top_logprobs"][1] == {
        "token": "r",
        "logprob": -9999.0,
        "bytes": [114],
    }
    comp = completion_logprobs([p.ballast() for p in HAND], 4).wire
    # k + 1 entries, one text once: "x" keeps its first place with the last "x"'s logprob
    assert list(comp["top_logprobs"][2].items()) == [("x", -1.0), ("y", -0.5), ("z", -9999.0)]
    assert comp["text_offset"] == [0, 2, 3, 4, 7]
    assert completion_logprobs([HAND[0].ballast()], 0).wire["top_logprobs"] == [{"東京": -0.25}]


def test_chat_position_without_a_logprob_is_vllms_missing_entry(tok: Any) -> None:
    """vLLM's unary chat answer for a token absent from its position's dict: its text
    (``tokenizer.decode``), logprob -9999.0, no top entries."""
    serving = object.__new__(OpenAIServingChat)
    serving.return_tokens_as_token_ids = False
    tid = tok.encode(" fox")[1]
    theirs = serving._create_chat_logprobs(
        token_ids=[tid, HAND[0].token[0]], top_logprobs=[None, HAND[0].vllm()], tokenizer=tok, num_output_top_logprobs=2
    ).model_dump()
    ours = chat_logprobs([TokenLogprob(tok.decode(tid), None), HAND[0].ballast()], 2)
    assert ours == theirs
    text = tok.decode(tid)
    assert ours["content"][0] == {"token": text, "logprob": -9999.0, "bytes": list(text.encode()), "top_logprobs": []}


def model_positions(tokenizer: Any, k: int, n: int, seed: int, given: list[int] | None = None) -> list[Position]:
    """``n`` positions from a log-softmax over the tokenizer's vocabulary, as an engine
    reports them: texts as vLLM names them (``convert_ids_list_to_tokens``), the k
    likeliest by ``torch.topk``, the position's token drawn from the distribution (so now
    among the likeliest, now not) or ``given`` (a prompt's); a quarter of the vocabulary
    ruled out (-inf)."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    out = []
    for i in range(n):
        logits = torch.randn(vocab, generator=g) * 3
        logits[torch.randperm(vocab, generator=g)[: vocab // 4]] = -math.inf
        if given is not None:
            logits[given[i]] = 0.0  # a prompt's token is never ruled out
        lps = torch.log_softmax(logits, dim=-1)
        sampled = int(torch.multinomial(lps.exp(), 1, generator=g)) if given is None else given[i]
        top = torch.topk(lps, k)
        ids = [sampled, *top.indices.tolist()]
        texts = convert_ids_list_to_tokens(tokenizer, ids)
        values = [float(lps[sampled]), *top.values.tolist()]
        out.append(Position((ids[0], texts[0], values[0]), tuple(zip(ids[1:], texts[1:], values[1:]))))
    return out


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_chat_equals_vllm_on_model_positions(tok: Any, k: int) -> None:
    positions = model_positions(tok, k, 40, seed=k)
    assert any(p.token not in p.top for p in positions) and (k == 0 or any(p.token in p.top for p in positions))
    assert chat_logprobs([p.ballast() for p in positions], k) == vllm_chat(positions, k, tok)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_echo_completion_equals_vllm_unary_and_streamed(tok: Any, k: int) -> None:
    """Echo: the prompt's positions (the first with no logprob, its token named by
    ``tokenizer.decode``) then the generated ones, unary and in streamed chunks, the
    offsets carried from chunk to chunk as vLLM's streaming loop carries them."""
    prompt_ids = tok.encode("Café 東京 🙂 The quick brown fox")
    prompt = model_positions(tok, k, len(prompt_ids) - 1, seed=100 + k, given=prompt_ids[1:])
    first = TokenLogprob(tok.decode(prompt_ids[0]), None)
    ours_prompt = [first, *(p.ballast() for p in prompt)]
    vllm_prompt: list[dict[int, Any] | None] = [None, *(p.vllm() for p in prompt)]
    generated = model_positions(tok, k, 9, seed=200 + k)
    gen_ids = [p.token[0] for p in generated]

    # max_tokens 0: the prompt alone
    alone = completion_logprobs([], k, prompt=ours_prompt)
    assert keyed(alone.wire) == keyed(vllm_completion(prompt_ids, vllm_prompt, k, tok))
    assert alone.wire["token_logprobs"][0] is None and alone.wire["top_logprobs"][0] is None
    assert alone.wire["tokens"][0] == "<s>"

    unary = completion_logprobs([p.ballast() for p in generated], k, prompt=ours_prompt)
    theirs = vllm_completion(prompt_ids + gen_ids, [*vllm_prompt, *(p.vllm() for p in generated)], k, tok)
    assert keyed(unary.wire) == keyed(theirs)

    # streamed in chunks of 4, 0 (a chunk that carried no token), 1 and 4 tokens
    ours_offset = vllm_offset = 0
    start = 0
    for i, size in enumerate([4, 0, 1, 4]):
        chunk = generated[start : start + size]
        start += size
        ids, dicts = [p.token[0] for p in chunk], [p.vllm() for p in chunk]
        if i == 0:
            ids, dicts = prompt_ids + ids, [*vllm_prompt, *dicts]
        expected = vllm_completion(ids, dicts, k, tok, offset=vllm_offset)
        if expected["tokens"]:  # vLLM's streaming loop
            vllm_offset = expected["text_offset"][-1] + len(expected["tokens"][-1])
        made = completion_logprobs(
            [p.ballast() for p in chunk], k, text_offset=ours_offset, prompt=ours_prompt if i == 0 else None
        )
        assert keyed(made.wire) == keyed(expected)
        ours_offset = made.next_text_offset
        assert ours_offset == vllm_offset
    assert start == len(generated)
    assert ours_offset == unary.next_text_offset == sum(len(t) for t in unary.wire["tokens"])


def test_shapes_are_the_openai_clients() -> None:
    from openai.types.chat.chat_completion import ChoiceLogprobs
    from openai.types.completion_choice import Logprobs

    chat = ChoiceLogprobs.model_validate(chat_logprobs([p.ballast() for p in HAND], 4))
    assert chat.content is not None and chat.content[2].top_logprobs[1].token == "y"
    assert chat.content[0].bytes == list("東京".encode())

    comp = Logprobs.model_validate(completion_logprobs([p.ballast() for p in HAND], 2, text_offset=3).wire)
    assert comp.text_offset == [3, 5, 6, 7, 10] and comp.top_logprobs is not None
    # The openai types declare no null, yet OpenAI's own API and vLLM write one at an
    # echoed prompt's first position (the client's default parsing keeps it): every other
    # position validates.
    echoed = completion_logprobs([HAND[0].ballast()], 1, prompt=[TokenLogprob("<s>", None), HAND[1].ballast()]).wire
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    Logprobs.model_validate({name: values[1:] for name, values in echoed.items()})


@pytest.mark.parametrize("bad", [-1, 21, True, 1.0, None])
def test_k_out_of_bounds_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="top_logprobs must be an int in"):
        chat_logprobs([HAND[0].ballast()], bad)
    with pytest.raises(ValueError, match="logprobs must be an int in"):
        completion_logprobs([HAND[0].ballast()], bad)
    with pytest.raises(ValueError, match="text_offset must be"):
        completion_logprobs([HAND[0].ballast()], 1, text_offset=-1)
