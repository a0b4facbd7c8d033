"""The Hugging Face engine on a tiny random Llama built here: batching, the cache, sampling, EOS, text."""

from __future__ import annotations

import pytest
import torch

from ballast.model.hf_checkpoint import load_checkpoint
from ballast.model.hf_engine import HFBackend
from ballast.model.hf_text import ContextTooLong, IncrementalDetokenizer, TokenizerText
from ballast.model.protocol import Join, RowSampling
from tests.unit.hf_fixture import make_tiny_llama

PROMPTS = [
    "The quick brown fox",
    "Hello!",
    "A replica serves requests; the router sends each one to",
    "東京 and Café",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def backend(ckpt):
    return HFBackend(load_checkpoint(ckpt, "cpu"), name="tiny")


def run(backend, joins_by_chunk, steps=3):
    """Drive a batch: ``joins_by_chunk[i]`` join before chunk i; returns every row's ids."""
    batch = backend.open_batch()
    got: dict = {}
    i = 0
    with torch.inference_mode():
        while i < len(joins_by_chunk) or batch.size:
            joins = joins_by_chunk[i] if i < len(joins_by_chunk) else []
            for key, ids in batch.run_chunk(joins, steps).items():
                got.setdefault(key, []).extend(ids)
            i += 1
    return got


def alone(backend, prompt, n, sampling=None):
    ids = backend.text.encode(prompt, n)
    return run(backend, [[Join("x", ids, n, sampling)]])["x"]


def reference_generate(backend, prompt, n):
    """transformers' own greedy generate, one prompt, no EOS stop."""
    ids = torch.tensor([backend.text.encode(prompt, n)])
    with torch.inference_mode():
        out = backend.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def no_eos(backend):
    """The same model with no end-of-sequence token, so rows run to max_new_tokens."""
    b = HFBackend(backend.loaded, name="tiny-no-eos")
    b.eos_ids = frozenset()
    return b


def test_greedy_alone_equals_transformers_generate(backend):
    b = no_eos(backend)
    for p in PROMPTS:
        assert alone(b, p, 12) == reference_generate(b, p, 12)


def test_greedy_output_depends_on_the_prompt(backend):
    b = no_eos(backend)
    outs = {tuple(alone(b, p, 8)) for p in PROMPTS}
    assert len(outs) == len(PROMPTS)  # the fixture's weights are not flat


def test_batched_greedy_equals_each_prompt_alone_with_rows_joining_and_leaving(backend):
    b = no_eos(backend)
    lengths = [5, 17, 9, 13]
    want = {i: alone(b, p, n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))}
    enc = [b.text.encode(p, n) for p, n in zip(PROMPTS, lengths)]
    # Rows 0 and 1 start together; 2 joins at the second chunk, 3 at the fourth (after 0 left).
    got = run(b, [[Join(0, enc[0], 5), Join(1, enc[1], 17)], [Join(2, enc[2], 9)], [], [Join(3, enc[3], 13)]])
    assert got == want


def test_remove_drops_a_row_and_the_rest_continue_unchanged(backend):
    b = no_eos(backend)
    want = alone(b, PROMPTS[2], 10)
    batch = b.open_batch()
    got = []
    with torch.inference_mode():
        out = batch.run_chunk(
            [Join("a", b.text.encode(PROMPTS[0], 20), 20), Join("b", b.text.encode(PROMPTS[2], 10), 10)], 3
        )
        got += out["b"]
        assert (
            batch.reserved_tokens == len(b.text.encode(PROMPTS[0], 20)) + 20 + len(b.text.encode(PROMPTS[2], 10)) + 10
        )
        batch.remove({"a"})
        assert batch.keys() == ["b"]
        while batch.size:
            got += batch.run_chunk([], 3)["b"]
    assert got == want
    assert batch.reserved_tokens == 0 and batch.width == 0


def test_eos_ends_a_row_at_that_token_and_it_is_emitted(backend):
    b = no_eos(backend)
    full = alone(b, PROMPTS[0], 12)
    stopper = full[4]
    first = full.index(stopper)  # the first time greedy output emits it
    b.eos_ids = frozenset({stopper})
    got = run(b, [[Join("x", b.text.encode(PROMPTS[0], 12), 12), Join("y", b.text.encode(PROMPTS[1], 30), 30)]])
    assert got["x"] == full[: first + 1]


def test_ignore_eos_goes_on_to_max_tokens_past_the_end_of_sequence(backend):
    b = no_eos(backend)
    full = alone(b, PROMPTS[0], 12)
    b.eos_ids = frozenset({full[4]})
    assert len(alone(b, PROMPTS[0], 12)) < 12  # it ends there by default
    assert alone(b, PROMPTS[0], 12, RowSampling(ignore_eos=True)) == full  # the same greedy tokens, all of them


def test_min_tokens_keeps_the_end_of_sequence_out_of_reach_until_then(backend):
    b = no_eos(backend)
    full = alone(b, PROMPTS[0], 12)
    stopper = full[1]
    b.eos_ids = frozenset({stopper})
    assert alone(b, PROMPTS[0], 12) == full[:2]  # greedy picks the eos second, and ends
    got = alone(b, PROMPTS[0], 12, RowSampling(min_tokens=6))
    assert got[0] == full[0] and stopper not in got[:6] and len(got) >= 6


def test_top_k_of_one_is_greedy_whatever_the_temperature(backend):
    b = no_eos(backend)
    assert alone(b, PROMPTS[2], 10, RowSampling(temperature=2.0, top_k=1, seed=5)) == alone(b, PROMPTS[2], 10)
    assert alone(b, PROMPTS[2], 10, RowSampling(temperature=2.0, top_k=50, seed=5)) != alone(b, PROMPTS[2], 10)


def test_the_same_seed_gives_the_same_tokens_alone_and_beside_others(backend):
    b = no_eos(backend)
    s = RowSampling(temperature=1.0, top_p=0.95, seed=7)
    one = alone(b, PROMPTS[0], 16, s)
    assert alone(b, PROMPTS[0], 16, s) == one
    enc = [b.text.encode(p, 16) for p in PROMPTS]
    beside = run(
        b, [[Join("x", enc[0], 16, s), Join("g", enc[1], 16, None), Join("h", enc[2], 16, RowSampling(1.0, seed=8))]]
    )
    assert beside["x"] == one
    assert alone(b, PROMPTS[0], 16, RowSampling(temperature=1.0, top_p=0.95, seed=8)) != one
    assert one != alone(b, PROMPTS[0], 16)  # sampled, not greedy


def test_a_tiny_top_p_keeps_only_the_most_likely_token(backend):
    b = no_eos(backend)
    assert alone(b, PROMPTS[1], 10, RowSampling(temperature=1.5, top_p=1e-6, seed=3)) == alone(b, PROMPTS[1], 10)


def test_tokenize_is_the_routers_encode_and_fit_shortens_max_tokens_to_the_context(backend, ckpt):
    from ballast.model.hf_checkpoint import tokenizer_id
    from ballast.model.special_tokens import encode_text

    assert backend.tokenizer_id == tokenizer_id(ckpt) and backend.tokenizer_id.startswith("hf:")
    for prompt, special in ((PROMPTS[0], True), (PROMPTS[2], False)):
        ids = backend.text.tokenize(prompt, special)
        assert ids == encode_text(backend.tokenizer, prompt, special)
        assert backend.text.fit(ids, 16) == (ids, 16) and ids == backend.text.encode(prompt, 16, special)
    assert backend.text.fit([5] * 100, 126) == ([5] * 100, 28)  # shortened to the context of 128, never lengthened
    with pytest.raises(ContextTooLong, match="empty"):
        backend.text.tokenize("", add_special_tokens=False)
    with pytest.raises(ContextTooLong, match="empty"):
        backend.text.fit([], 4)
    with pytest.raises(ContextTooLong, match="no room left in the context of 128"):
        backend.text.fit([5] * 128, 4)
    with pytest.raises(ContextTooLong, match="context of 128"):
        backend.text.fit([5] * 129, 4)
    assert backend.text.fit([5] * 100, 126) == backend.text.fit([5] * 100, 126)  # one text side, held
    with pytest.raises(ValueError, match="context must be an int >= 1"):
        TokenizerText(backend.tokenizer, 0)


def test_context_and_empty_prompts_are_refused_before_any_work(backend):
    with pytest.raises(ContextTooLong, match="context of 128"):
        backend.text.encode("The quick brown fox", 126)
    assert backend.text.encode("The quick brown fox", 64)
    with pytest.raises(ContextTooLong, match="empty"):
        backend.text.encode("", 4, add_special_tokens=False)
    assert backend.text.encode("", 4) == [backend.tokenizer.bos_token_id]  # a raw prompt has its bos
    batch = backend.open_batch()
    with pytest.raises(ContextTooLong):
        batch.run_chunk([Join("x", [1] * 100, 29)], 1)
    with pytest.raises(TypeError, match="Join rows, got tuple"):
        batch.run_chunk([Join("y", [1], 2), ("x", [1], 2)], 1)
    assert batch.size == 0 and batch.take_failed() == {}


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(seed="x"),
        dict(temperature=float("nan")),
        dict(top_k=0),
        dict(top_k=True),
        dict(min_tokens=-1),
    ],
)
def test_row_sampling_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        RowSampling(**bad)


def test_row_sampling_of_a_request_dict():
    assert RowSampling.of({}) == RowSampling()
    assert RowSampling.of({"temperature": 0.5, "top_p": 0.9, "seed": 4}) == RowSampling(0.5, 0.9, 4)
    assert RowSampling.of({"temperature": None}) == RowSampling()
    assert RowSampling.of({"top_k": 3, "min_tokens": 2, "ignore_eos": True}) == RowSampling(
        top_k=3, min_tokens=2, ignore_eos=True
    )


@pytest.mark.parametrize(
    "req, field",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ],
)
def test_a_request_with_sampling_out_of_range_is_refused_naming_the_field(req, field):
    from ballast.errors import EngineRefused

    with pytest.raises(EngineRefused) as e:
        RowSampling.of(req)
    assert e.value.field == field and e.value.status == 400


async def test_sampling_at_the_edge_of_range_is_normalised(backend):
    assert RowSampling.of({"temperature": 1e-40}).temperature == 0.0  # greedy: logits / 1e-40 overflow
    assert RowSampling.of({"temperature": 1e-5}).temperature == 1e-5
    assert RowSampling.of({"seed": 2**63 - 1}).seed == 2**63 - 1 and RowSampling.of({"seed": -(2**63)}).seed == -(2**63)
    capped = await backend.check(RowSampling(temperature=1.0, top_k=10**9))
    assert capped.top_k is None  # past the vocabulary: every token
    assert (await backend.check(RowSampling(temperature=1.0, top_k=5))).top_k == 5
    b = no_eos(backend)
    assert alone(b, PROMPTS[1], 8, RowSampling.of({"temperature": 1e-40, "seed": 2**63 - 1})) == alone(b, PROMPTS[1], 8)


def test_one_poisoned_row_among_four_fails_alone_and_the_three_others_finish_whole(backend):
    # Four rows join one chunk. One samples with a top_k of -5 (a value the replica's
    # checks refuse; here it reaches the batch as a poison would): its own draw raises and
    # it leaves with EngineRefused. The three others get the same tokens as each alone.
    from ballast.errors import EngineRefused

    b = no_eos(backend)
    poison = RowSampling(temperature=1.0, seed=1)
    object.__setattr__(poison, "top_k", -5)
    seeded = RowSampling(temperature=1.0, seed=7)
    enc = [b.text.encode(p, 12) for p in PROMPTS]
    batch = b.open_batch()
    got: dict = {}
    failed: dict = {}
    joins = [
        Join("a", enc[0], 12, None),
        Join("poison", enc[1], 12, poison),
        Join("c", enc[2], 12, seeded),
        Join("d", enc[3], 12, None),
    ]
    with torch.inference_mode():
        while joins or batch.size:
            for key, ids in batch.run_chunk(joins, 3).items():
                got.setdefault(key, []).extend(ids)
            failed.update(batch.take_failed())
            joins = []
    assert set(failed) == {"poison"} and isinstance(failed["poison"], EngineRefused) and failed["poison"].status == 400
    assert "poison" not in got
    assert got["a"] == alone(b, PROMPTS[0], 12) and got["d"] == alone(b, PROMPTS[3], 12)
    assert got["c"] == alone(b, PROMPTS[2], 12, seeded) and len(got["c"]) == 12


def test_a_row_with_ids_outside_the_vocabulary_is_refused_at_its_join(backend):
    from ballast.errors import EngineRefused

    batch = backend.open_batch()
    ok = backend.text.encode(PROMPTS[0], 4)
    with torch.inference_mode():
        out = batch.run_chunk([Join("ok", ok, 4), Join("bad", [1, backend.vocab_size], 4)], 2)
    failed = batch.take_failed()
    assert list(out) == ["ok"] and len(out["ok"]) == 2 and batch.keys() == ["ok"]
    assert isinstance(failed["bad"], EngineRefused) and failed["bad"].field == "prompt"
    assert batch.take_failed() == {}


def test_a_row_whose_logits_are_not_finite_fails_alone_as_a_model_failure(backend):
    # The model's fault for one row (its logits): that row fails, not as a refusal of the request.
    from ballast.model.hf_engine import HFBatch, RowFailed, _Row

    batch = HFBatch(backend)
    rows = [_Row(k, 4, 8, RowSampling(temperature=1.0, seed=k), "cpu") for k in range(3)]
    logits = torch.randn(3, backend.vocab_size)
    logits[1, 5] = float("nan")
    picked = batch._pick(logits, rows)
    failed = batch.take_failed()
    assert set(failed) == {1} and isinstance(failed[1], RowFailed) and rows[1].remaining == 0
    assert rows[0].remaining == rows[2].remaining == 4 and picked.shape == (3,)


def test_incremental_text_is_correct_across_multi_byte_characters(backend):
    text = "Café, naïve, über, 東京, Ελληνικά, emoji 🙂 and more."
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 10
    d = IncrementalDetokenizer(backend.tokenizer)
    pieces = [d.feed([i], final=(n == len(ids) - 1)) for n, i in enumerate(ids)]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_an_unfinished_character_is_flushed_at_the_end(backend):
    ids = backend.tokenizer.encode("🙂", add_special_tokens=False)
    d = IncrementalDetokenizer(backend.tokenizer)
    if len(ids) > 1:  # a byte-level vocabulary this small splits the emoji
        assert d.feed(ids[:1]) == ""
        assert d.feed([], final=True) != ""


def test_special_tokens_decode_to_nothing(backend):
    d = IncrementalDetokenizer(backend.tokenizer)
    tok = backend.tokenizer
    assert d.feed([tok.eos_token_id]) == ""
    assert d.feed(tok.encode("Hello", add_special_tokens=False)) == "Hello"
    assert d.feed([tok.eos_token_id], final=True) == ""


def test_streaming_pieces_join_to_the_unary_text(backend):
    b = no_eos(backend)
    n = 20
    pieces = list(b.generate_chunks(PROMPTS, [n] * len(PROMPTS), chunk_tokens=3))
    for i, p in enumerate(PROMPTS):
        streamed = "".join(chunk[i] for chunk in pieces)
        unary = b.tokenizer.decode(alone(b, p, n), skip_special_tokens=True)
        assert streamed == unary


def test_a_sharded_checkpoint_generates_what_the_single_file_does(tmp_path, backend):
    sharded = HFBackend(load_checkpoint(make_tiny_llama(tmp_path / "s", shards=3), "cpu"), name="s")
    assert alone(no_eos(sharded), PROMPTS[0], 10) == alone(no_eos(backend), PROMPTS[0], 10)


def test_warmup_runs_each_batch_size_and_describe_names_the_model(backend):
    backend.warmup((1, 3))
    d = backend.describe()
    assert d["backend"] == "transformers" and d["architecture"] == "LlamaForCausalLM"
    assert d["max_seq_len"] == 128 and d["params"] == backend.parameter_count > 0
