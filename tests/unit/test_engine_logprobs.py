"""Log-probabilities from the built-in and transformers engines (``Batch.take_logprobs``):
each generated token's and each prompt position's, with the k likeliest, equal within 1e-3
to a plain full forward of the same model over prompt + answer, in float32.

Rows that ask sit in batches with rows that do not, join mid-run, and span several chunks;
what a chunk hands back is aligned with the ids ``run_chunk`` returned for the row."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ballast.model.builtin_batch import LiveBatch, _prefill_mask
from ballast.model.hf_checkpoint import load_checkpoint
from ballast.model.hf_engine import HFBackend
from ballast.model.hf_text import ContextTooLong
from ballast.model.protocol import IdLogprobs, Join, RowSampling
from tests.unit.hf_fixture import make_tiny_llama
from tests.unit.test_builtin_engine import make_backend

ATOL = 1e-3


# ------------------------------------------------------------------------- helpers


def drive(batch: Any, joins_by_chunk: list[list[Join]], steps: int) -> tuple[dict, dict, dict]:
    """Run ``batch`` until empty, ``joins_by_chunk[i]`` joining before chunk i: (ids, token
    logprobs, prompt logprobs) by key. Checks per chunk what every chunk must hold: only rows
    that asked get log-probabilities, a row's tokens are the ids the chunk returned for it,
    its prompt comes once (on the chunk it joined), and a second take gets none."""
    asks = {j.key: j for chunk in joins_by_chunk for j in chunk}
    ids: dict[Any, list[int]] = {}
    tokens: dict[Any, list[IdLogprobs]] = {}
    prompts: dict[Any, tuple[IdLogprobs, ...]] = {}
    i = 0
    with torch.inference_mode():
        while i < len(joins_by_chunk) or batch.keys():
            joins = joins_by_chunk[i] if i < len(joins_by_chunk) else []
            out = batch.run_chunk(joins, steps)
            got = batch.take_logprobs()
            assert batch.take_logprobs() == {}
            for key, row in got.items():
                join = asks[key]
                assert join.logprobs is not None or join.prompt_logprobs is not None, key
                if join.logprobs is not None:
                    assert [t.id for t in row.tokens] == out[key]
                else:
                    assert row.tokens == ()
                if row.prompt is not None:
                    assert join in joins and key not in prompts and join.prompt_logprobs is not None
                    prompts[key] = row.prompt
            for key, new in out.items():
                if asks[key].logprobs is not None and new:
                    assert key in got  # every emitted token of an asking row has its own
                ids.setdefault(key, []).extend(new)
                tokens.setdefault(key, []).extend(got[key].tokens if key in got else ())
            i += 1
    return ids, tokens, prompts


def assert_position(got: IdLogprobs, ref: torch.Tensor, want_id: int, k: int) -> None:
    """``got`` is the logprob of ``want_id`` under the reference row ``ref`` [V] and its ``k``
    likeliest (ids distinct, each with the reference's logprob, none below the kth)."""
    assert got.id == want_id
    assert abs(got.logprob - float(ref[want_id])) <= ATOL, (got.logprob, float(ref[want_id]))
    assert len(got.top) == k and len({i for i, _ in got.top}) == k
    kth = float(ref.topk(k).values[-1]) if k else 0.0
    for i, lp in got.top:
        assert abs(lp - float(ref[i])) <= ATOL and lp >= kth - ATOL
    assert [lp for _, lp in got.top] == sorted((lp for _, lp in got.top), reverse=True)


def assert_matches(join: Join, ids: list[int], tokens: list[IdLogprobs], prompt: Any, ref: torch.Tensor) -> None:
    """A row's log-probabilities against the reference ``ref`` [S, V] of prompt + answer."""
    n = len(join.ids)
    if join.logprobs is not None:
        assert len(tokens) == len(ids) == join.max_new_tokens
        for j, (tok, t) in enumerate(zip(ids, tokens)):
            assert_position(t, ref[n - 1 + j], tok, join.logprobs)
    if join.prompt_logprobs is not None:
        assert prompt is not None and len(prompt) == n - 1
        for i, p in enumerate(prompt):
            assert_position(p, ref[i], join.ids[i + 1], join.prompt_logprobs)


# ------------------------------------------------------------------------- built-in


def builtin_reference(backend: Any, full: list[int]) -> torch.Tensor:
    """The module's own forward over ``full`` alone, no cache: log_softmax [S, V]."""
    ids = torch.tensor([full])
    valid = torch.ones_like(ids, dtype=torch.bool)
    positions = torch.arange(len(full))[None]
    empty = backend.empty_kv_cache(1)
    with torch.inference_mode():
        logits, _, _ = backend.forward(ids, positions, _prefill_mask(valid), empty, empty)
    return logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def builtin():
    b = make_backend()
    assert b._dtype == torch.float32
    return b


def test_builtin_logprobs_of_rows_that_ask_equal_the_full_forward_beside_rows_that_do_not(builtin):
    text = builtin.text
    a = Join("a", text.tokenize("The quick brown fox"), 9, logprobs=3, prompt_logprobs=2)
    b = Join("b", text.tokenize("zz"), 7)  # asks nothing
    c = Join("c", text.tokenize("hi, a longer prompt"), 6, logprobs=0)  # joins at the second chunk
    d = Join("d", text.tokenize("to score"), 0, prompt_logprobs=5)  # prefill only, left padded beside c
    e = Join("e", text.tokenize("x y"), 5, prompt_logprobs=0)  # prompt only, joins at the third
    joins = [[a, b], [c, d], [e]]
    ids, tokens, prompts = drive(builtin.open_batch(), joins, steps=3)
    assert ids["d"] == [] and set(prompts) == {"a", "d", "e"}
    assert tokens["b"] == [] and tokens["e"] == []
    printable = builtin._printable
    for join in (a, c, d, e):
        ref = builtin_reference(builtin, list(join.ids) + ids[join.key])
        assert_matches(join, ids[join.key], tokens[join.key], prompts.get(join.key), ref)
        n = len(join.ids)
        for j, tok in enumerate(ids[join.key]):  # greedy under the engine's printable mask
            assert tok == int(ref[n - 1 + j].masked_fill(~printable, float("-inf")).argmax())
    # Raw: before the printable mask, so the likeliest byte is at times one it cannot pick.
    assert any(not printable[t.top[0][0]] for t in tokens["a"])


def test_builtin_prefill_only_row_leaves_with_its_prompt_and_no_token(builtin):
    batch = builtin.open_batch()
    ids = builtin.text.tokenize("score me")
    with torch.inference_mode():
        out = batch.run_chunk([Join("p", ids, 0, prompt_logprobs=1), Join("q", ids, 0, logprobs=2)], 4)
    assert out == {"p": [], "q": []} and batch.keys() == []
    got = batch.take_logprobs()
    assert set(got) == {"p"} and got["p"].tokens == ()  # q asked for tokens it never emits
    assert_matches(Join("p", ids, 0, prompt_logprobs=1), [], [], got["p"].prompt, builtin_reference(builtin, ids))


def test_builtin_a_one_token_prompt_has_no_prompt_position(builtin):
    batch = builtin.open_batch()
    with torch.inference_mode():
        out = batch.run_chunk([Join("one", [104], 2, logprobs=1, prompt_logprobs=3)], 4)
    got = batch.take_logprobs()["one"]
    assert got.prompt == () and [t.id for t in got.tokens] == out["one"]


def test_builtin_rows_that_ask_nothing_get_nothing(builtin):
    batch = builtin.open_batch()
    assert isinstance(batch, LiveBatch)
    with torch.inference_mode():
        for joins in ([Join(0, [104, 105], 5)], [Join(1, [120], 3)], []):
            assert batch.run_chunk(joins, 2) and batch.take_logprobs() == {}


# ------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    b = HFBackend(load_checkpoint(make_tiny_llama(tmp_path_factory.mktemp("tiny")), "cpu"), name="tiny")
    assert b.model.dtype == torch.float32
    b.eos_ids = frozenset()  # rows run to their max_new_tokens
    return b


def hf_reference(backend: HFBackend, full: list[int]) -> torch.Tensor:
    """transformers' plain forward over ``full`` alone: log_softmax [S, V]."""
    with torch.inference_mode():
        return backend.model(input_ids=torch.tensor([full])).logits[0].float().log_softmax(-1)


def test_hf_logprobs_of_rows_that_ask_equal_the_full_forward_beside_rows_that_do_not(hf):
    text = hf.text
    a = Join("a", text.tokenize("The quick brown fox"), 9, logprobs=3, prompt_logprobs=2)
    b = Join("b", text.tokenize("Hello!"), 7)
    c = Join("c", text.tokenize("A replica serves requests"), 6, logprobs=0)
    d = Join("d", text.tokenize("東京 and Café, a longer prompt"), 0, prompt_logprobs=5)
    e = Join("e", text.tokenize("Hi"), 5, logprobs=4, sampling=RowSampling(temperature=1.5, seed=7))
    f = Join("f", text.tokenize("the router sends each one to"), 4, prompt_logprobs=0)
    joins = [[a, b], [c, d], [e, f]]
    ids, tokens, prompts = drive(hf.open_batch(), joins, steps=3)
    assert ids["d"] == [] and set(prompts) == {"a", "d", "f"}
    assert tokens["b"] == [] and tokens["f"] == []
    for join in (a, c, d, e, f):
        ref = hf_reference(hf, list(join.ids) + ids[join.key])
        assert_matches(join, ids[join.key], tokens[join.key], prompts.get(join.key), ref)
        if join.sampling is None:  # greedy: each id the reference's likeliest
            n = len(join.ids)
            assert ids[join.key] == [int(ref[n - 1 + j].argmax()) for j in range(len(ids[join.key]))]


def test_hf_a_prompt_scored_in_pieces_gives_the_same_logprobs_and_answer(hf):
    prompt = hf.text.tokenize("A replica serves requests; the router sends each one to")
    pieces = HFBackend(hf.loaded, name="pieces", prompt_logits_per_forward=3 * hf.vocab_size)
    pieces.eos_ids = frozenset()
    assert pieces.prompt_positions_per_forward == 3 and len(prompt) > 3 * 3
    join = Join("s", prompt, 6, logprobs=2, prompt_logprobs=3)
    ids, tokens, prompts = drive(pieces.open_batch(), [[join, Join("t", prompt[:5], 8)]], steps=4)
    ref = hf_reference(hf, list(prompt) + ids["s"])
    assert_matches(join, ids["s"], tokens["s"], prompts["s"], ref)
    plain, _, _ = drive(hf.open_batch(), [[Join("s", prompt, 6)]], steps=4)
    assert ids["s"] == plain["s"]  # the cache built in pieces decodes as the one built at once


def test_hf_logprobs_are_taken_before_min_tokens_masks_the_end_of_sequence(hf):
    prompt = hf.text.tokenize("The quick brown fox")
    greedy, _, _ = drive(hf.open_batch(), [[Join("g", prompt, 6)]], steps=6)
    b = HFBackend(hf.loaded, name="eos")
    b.eos_ids = frozenset({greedy["g"][1]})  # greedy would end at its second token
    join = Join("m", prompt, 6, logprobs=1, sampling=RowSampling(min_tokens=4))
    ids, tokens, _ = drive(b.open_batch(), [[join]], steps=6)
    assert ids["m"][1] != greedy["g"][1] and tokens["m"][1].top[0][0] == greedy["g"][1]
    assert_matches(join, ids["m"], tokens["m"], None, hf_reference(hf, list(prompt) + ids["m"]))


def test_hf_a_prompt_that_fills_the_context_is_scored_with_no_token(hf):
    assert hf.text.fit([5] * hf.max_seq_len, 0) == ([5] * hf.max_seq_len, 0)
    with pytest.raises(ContextTooLong, match="no room left"):
        hf.text.fit([5] * hf.max_seq_len, 1)
    with pytest.raises(ContextTooLong):
        hf.text.fit([5] * (hf.max_seq_len + 1), 0)
    prompt = (hf.text.tokenize("The quick brown fox jumps over the lazy dog. ") * 40)[: hf.max_seq_len]
    join = Join("full", prompt, 0, logprobs=3, prompt_logprobs=2)
    ids, tokens, prompts = drive(hf.open_batch(), [[join, Join("x", prompt[:9], 3)]], steps=2)
    assert ids["full"] == [] and tokens["full"] == []
    assert_matches(join, [], [], prompts["full"], hf_reference(hf, list(prompt)))


def test_hf_rows_that_ask_nothing_get_nothing(hf):
    batch = hf.open_batch()
    with torch.inference_mode():
        for joins in ([Join(0, [5, 6, 7], 5)], [Join(1, [8], 3)], []):
            assert batch.run_chunk(joins, 2) and batch.take_logprobs() == {}
