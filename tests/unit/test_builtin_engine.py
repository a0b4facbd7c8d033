"""Unit tests for the built-in engine (ballast.model.builtin_engine, builtin_decoder, builtin_batch,
builtin_checkpoint): real torch on CPU, small configs for speed."""

from __future__ import annotations

import math
import pickle
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ballast.model.builtin_checkpoint import (
    BackendSpec,
    detect_checkpoint_format,
    load_backend,
    save_state_dict,
    save_torchscript,
)
from ballast.model.builtin_decoder import TinyDecoderConfig, build_tiny_decoder
from ballast.model.builtin_engine import ByteStreamDecoder, SamplingConfig, TorchDecoderBackend, encode_prompt
from ballast.model.engine import ModelBackend, ModelLoadError
from ballast.model.hf_text import ContextTooLong
from ballast.model.protocol import Join

SMALL = TinyDecoderConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128)
PROMPTS = ["hi", "The quick brown fox jumps", "", "zz top"]
MAX_NEW = [7, 12, 3, 9]
GREEDY = SamplingConfig()  # the engine's default


def make_backend(
    cfg: TinyDecoderConfig = SMALL,
    seed: int = 0,
    sampling: SamplingConfig = GREEDY,
) -> TorchDecoderBackend:
    model = build_tiny_decoder(cfg, seed)
    return TorchDecoderBackend(model, name="t", device="cpu", source=f"seed:{seed}", sampling=sampling)


def all_tokens(backend: TorchDecoderBackend, prompts, max_new, chunk=4, use_cache=True):
    """Concatenate every chunk's ids per prompt."""
    out: list[list[int]] = [[] for _ in prompts]
    for chunk_ids in backend.generate_token_chunks(prompts, max_new, chunk, use_cache=use_cache):
        for i, ids in enumerate(chunk_ids):
            out[i].extend(ids)
    return out


def all_text(backend, prompts, max_new, chunk=4) -> list[str]:
    out = [""] * len(prompts)
    for pieces in backend.generate_chunks(prompts, max_new, chunk):
        out = [a + b for a, b in zip(out, pieces)]
    return out


# ----------------------------------------------------------------------- config


def test_default_config_has_a_few_million_parameters():
    model = build_tiny_decoder(TinyDecoderConfig(), seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 10_000_000


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"d_model": 0}, "d_model"),
        ({"n_layers": -1}, "n_layers"),
        ({"n_heads": 3}, "divisible"),
        ({"vocab_size": 300}, "vocab_size"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"d_ff": 1.5}, "d_ff"),
        ({"n_layers": True}, "n_layers"),
    ],
)
def test_config_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TinyDecoderConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"name": ""}, "name"),
        ({"seed": -1}, "seed"),
        ({"checkpoint_format": "onnx"}, "checkpoint_format"),
        ({"checkpoint_format": "torchscript"}, "needs a checkpoint_path"),
        ({"device": "tpu"}, "device"),
        ({"checkpoint_path": ""}, "checkpoint_path"),
        ({"config": {"d_model": 64}}, "config"),
    ],
)
def test_backend_spec_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        BackendSpec(**kwargs)


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": float("nan")}, {"seed": -3}])
def test_sampling_config_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


# ------------------------------------------------------------------------ model


def test_same_seed_same_weights_and_global_rng_untouched():
    rng_before = torch.random.get_rng_state()
    a = build_tiny_decoder(SMALL, seed=7).state_dict()
    b = build_tiny_decoder(SMALL, seed=7).state_dict()
    c = build_tiny_decoder(SMALL, seed=8).state_dict()
    assert torch.equal(rng_before, torch.random.get_rng_state())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])
    assert not torch.equal(a["blocks.0.attn_qkv.weight"], c["blocks.0.attn_qkv.weight"])


def test_different_seeds_generate_different_text():
    outs = {tuple(all_tokens(make_backend(seed=s), ["hello world"], [24])[0]) for s in range(3)}
    assert len(outs) > 1


def test_output_depends_on_earlier_context():
    # Guards the init scale: if the random model only echoed its last byte, the
    # batching and cache tests below would pass without exercising attention.
    backend = make_backend(seed=0)
    same_tail = all_tokens(backend, ["abc x", "xyz x"], [16, 16])
    assert same_tail[0] != same_tail[1]
    assert len(set(same_tail[0])) > 2


def test_forward_with_cache_matches_full_forward_logits():
    model = build_tiny_decoder(SMALL, seed=1)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10).expand(2, 10)
    causal = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 10, 10)
    empty = torch.zeros(SMALL.n_layers, 2, SMALL.n_heads, 0, SMALL.head_dim)
    with torch.inference_mode():
        full, k_full, _ = model(ids, pos, causal, empty, empty)
        _, k, v = model(ids[:, :6], pos[:, :6], causal[:, :6, :6], empty, empty)
        step_logits = []
        for t in range(6, 10):
            new = slice(t, t + 1)
            logits, k, v = model(ids[:, new], pos[:, new], causal[:, new, : t + 1], k, v)
            step_logits.append(logits)
    assert k.shape == (SMALL.n_layers, 2, SMALL.n_heads, 10, SMALL.head_dim)
    torch.testing.assert_close(torch.cat(step_logits, dim=1), full[:, 6:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k, k_full, rtol=1e-4, atol=1e-5)


def test_kv_cache_generation_equals_recompute_without_cache():
    backend = make_backend(seed=2)
    cached = all_tokens(backend, PROMPTS, MAX_NEW, use_cache=True)
    recomputed = all_tokens(backend, PROMPTS, MAX_NEW, use_cache=False)
    assert cached == recomputed
    assert [len(t) for t in cached] == MAX_NEW


def test_batched_equals_single_for_mixed_prompt_lengths():
    backend = make_backend(seed=3)
    batched = all_tokens(backend, PROMPTS, MAX_NEW)
    singles = [all_tokens(backend, [p], [n])[0] for p, n in zip(PROMPTS, MAX_NEW)]
    assert batched == singles


def test_finished_rows_past_position_table_do_not_disturb_others():
    # Row 0 fills the context exactly and then idles for ~100 more steps while
    # row 1 runs; its positions would overflow the table if not clamped.
    backend = make_backend(seed=4)
    long_prompt = "x" * (SMALL.max_seq_len - 8)
    batched = all_tokens(backend, [long_prompt, "a"], [8, 100])
    assert [len(t) for t in batched] == [8, 100]
    assert batched[1] == all_tokens(backend, ["a"], [100])[0]
    assert batched[0] == all_tokens(backend, [long_prompt], [8])[0]


def test_greedy_output_is_printable_ascii_by_default():
    texts = all_text(make_backend(seed=5), PROMPTS, MAX_NEW)
    for text, n in zip(texts, MAX_NEW):
        assert len(text) == n  # one ASCII char per byte token
        assert all(ch == "\n" or 32 <= ord(ch) <= 126 for ch in text)


# ------------------------------------------------------------------ live batch


def run_live(backend, arrivals, steps=3, removals=None):
    """Drive a LiveBatch: ``arrivals[c]`` join before chunk c; ``removals[c]`` leave before it.

    Returns every row's ids and the batch's width after each chunk.
    """
    batch = backend.open_batch()
    got: dict = {}
    widths = []
    c = 0
    while c < len(arrivals) or batch.size:
        if removals and c in removals:
            batch.remove(removals[c])
        joins = [Join(key, backend.text.encode(p, n), n) for key, p, n in (arrivals[c] if c < len(arrivals) else [])]
        with torch.inference_mode():
            out = batch.run_chunk(joins, steps)
        for key, ids in out.items():
            got.setdefault(key, []).extend(ids)
        widths.append(batch.width)
        c += 1
    return got, widths


def test_live_batch_rows_joining_late_equal_generating_alone():
    backend = make_backend(seed=3)
    arrivals = [
        [("a", PROMPTS[1], 12)],
        [],
        [("b", PROMPTS[0], 7), ("c", PROMPTS[2], 3)],  # join a batch already 6 tokens in
        [("d", "x" * 40, 9)],  # a prompt wider than the running cache
    ]
    got, _ = run_live(backend, arrivals)
    for key, prompt, n in (r for chunk in arrivals for r in chunk):
        assert got[key] == all_tokens(backend, [prompt], [n])[0], key
        assert len(got[key]) == n


def test_live_batch_short_row_leaves_without_waiting_for_long_one():
    backend = make_backend(seed=4)
    batch = backend.open_batch()
    with torch.inference_mode():
        out = batch.run_chunk(
            [Join("long", backend.text.encode("l", 40), 40), Join("short", backend.text.encode("s", 4), 4)], 4
        )
        assert [len(out["long"]), len(out["short"])] == [4, 4]
        assert batch.keys() == ["long"]  # the short row emitted its last token and left
        out = batch.run_chunk([Join("late", backend.text.encode("late", 2), 2)], 4)
    assert out.keys() == {"long", "late"} and len(out["late"]) == 2 and len(out["long"]) == 4
    assert batch.keys() == ["long"]


def test_live_batch_cache_width_is_trimmed_to_the_longest_row():
    backend = make_backend(seed=5)
    arrivals = [[("wide", "w" * 60, 4), ("narrow", "n", 30)]]
    got, widths = run_live(backend, arrivals, steps=2)
    # chunk 1: the wide row (60 prompt ids + 1 fed token) sets the width; once it
    # has left (chunk 2), only the narrow row's own columns (1 + 3 fed) stay.
    assert widths[0] == 61
    assert widths[1] == 1 + 3
    assert got["narrow"] == all_tokens(backend, ["n"], [30])[0]


def test_live_batch_removed_rows_stop_and_others_are_undisturbed():
    backend = make_backend(seed=6)
    arrivals = [[("keep", "keep me", 20), ("drop", "drop me", 20)]]
    got, _ = run_live(backend, arrivals, steps=4, removals={2: ["drop", "never-there"]})
    assert len(got["drop"]) == 8
    assert got["keep"] == all_tokens(backend, ["keep me"], [20])[0]


class OnlySteps:
    """The built-in engine seen through ``builtin_batch.DecoderSteps`` alone: a batch that
    reached for any other part of it (a private attribute, say) fails with AttributeError."""

    __slots__ = ("_engine",)

    def __init__(self, engine: TorchDecoderBackend) -> None:
        self._engine = engine

    device = property(lambda self: self._engine.device)
    max_seq_len = property(lambda self: self._engine.max_seq_len)

    def forward(self, ids, positions, mask, k, v):
        return self._engine.forward(ids, positions, mask, k, v)

    def sample(self, logits, gen):
        return self._engine.sample(logits, gen)

    def empty_kv_cache(self, rows):
        return self._engine.empty_kv_cache(rows)

    def left_padded(self, prompts, extra=0):
        return self._engine.left_padded(prompts, extra)

    def sampler(self):
        return self._engine.sampler()


def test_a_live_batch_runs_on_the_engines_public_steps_alone():
    from ballast.model.builtin_batch import LiveBatch, ReferenceDecode

    backend = make_backend(seed=9, sampling=SamplingConfig(temperature=0.8, seed=3))
    arrivals = [[("a", PROMPTS[1], 12)], [("b", PROMPTS[0], 7)]]
    want, _ = run_live(backend, arrivals)
    batch, got = LiveBatch(OnlySteps(backend)), {}
    with torch.inference_mode():
        for c in range(12):
            chunk = arrivals[c] if c < len(arrivals) else []
            for key, ids in batch.run_chunk([Join(k, backend.text.encode(p, n), n) for k, p, n in chunk], 3).items():
                got.setdefault(key, []).extend(ids)
    assert got == want and [len(got["a"]), len(got["b"])] == [12, 7] and batch.size == 0
    reference = ReferenceDecode(OnlySteps(backend), [backend.text.encode("hi", 4)], 4)
    with torch.inference_mode():
        assert [int(reference.step(s)[0]) for s in range(4)] == all_tokens(backend, ["hi"], [4], use_cache=False)[0]


def test_live_batch_zero_and_one_token_rows_and_validation():
    backend = make_backend()
    batch = backend.open_batch()
    with torch.inference_mode():
        out = batch.run_chunk(
            [Join("z", backend.text.encode("a", 0), 0), Join("one", backend.text.encode("b", 1), 1)], 4
        )
    assert out == {"z": [], "one": all_tokens(backend, ["b"], [1])[0]}
    assert batch.size == 0 and batch.width == 0
    with pytest.raises(ValueError, match="steps"):
        batch.run_chunk([], 0)
    with pytest.raises(ContextTooLong, match=f"context of {SMALL.max_seq_len}"):  # a ValueError
        batch.run_chunk([Join("big", [1] * SMALL.max_seq_len, 1)], 1)
    with torch.inference_mode():
        batch.run_chunk([Join("dup", [1], 5)], 1)
    with pytest.raises(ValueError, match="already in the batch"):
        batch.run_chunk([Join("dup", [1], 5)], 1)
    with pytest.raises(ValueError, match="already in the batch"):  # twice in one chunk
        batch.run_chunk([Join("twin", [1], 5), Join("twin", [2], 5)], 1)
    with pytest.raises(TypeError, match="Join rows, got tuple"):  # no positional rows
        batch.run_chunk([("tuple", [1], 5)], 1)
    assert batch.keys() == ["dup"]  # nothing refused above joined
    with pytest.raises(ValueError, match="max_new_tokens"):
        backend.text.encode("a", SMALL.max_seq_len)


# ------------------------------------------------------------------ chunking


def test_chunks_exact_counts_and_empty_after_finish():
    backend = make_backend(seed=6)
    max_new = [1, 5, 10]
    chunks = list(backend.generate_chunks(["a", "bb", "ccc"], max_new, chunk_tokens=3))
    assert len(chunks) == math.ceil(max(max_new) / 3) == 4
    assert all(len(c) == 3 for c in chunks)
    # printable ASCII: one char per token, so lengths are token counts
    assert [[len(p) for p in c] for c in chunks] == [[1, 3, 3], [0, 2, 3], [0, 0, 3], [0, 0, 1]]
    assert chunks[1][0] == "" and chunks[3][1] == ""


@pytest.mark.parametrize("chunk_tokens", [1, 2, 4, 7, 64])
def test_number_of_chunks_and_text_independent_of_chunk_size(chunk_tokens):
    backend = make_backend(seed=6)
    chunks = list(backend.generate_chunks(["hello", "x"], [13, 9], chunk_tokens=chunk_tokens))
    assert len(chunks) == math.ceil(13 / chunk_tokens)
    joined = ["".join(c[i] for c in chunks) for i in range(2)]
    assert joined == all_text(backend, ["hello", "x"], [13, 9], chunk=1)


def test_zero_new_tokens_and_empty_batch():
    backend = make_backend()
    assert list(backend.generate_chunks([], [])) == []
    assert list(backend.generate_chunks(["a"], [0])) == []
    chunks = list(backend.generate_chunks(["a", "b"], [0, 2], chunk_tokens=1))
    assert [c[0] for c in chunks] == ["", ""]
    assert [len(c[1]) for c in chunks] == [1, 1]


def test_arguments_are_validated_before_iteration():
    backend = make_backend()
    with pytest.raises(ValueError, match="max_new_tokens"):
        backend.generate_chunks(["a", "b"], [1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        backend.generate_chunks(["a"], [1], chunk_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        backend.generate_chunks(["a"], [SMALL.max_seq_len])


def test_inference_mode_does_not_leak_between_yields():
    chunks = make_backend().generate_chunks(["a"], [8], chunk_tokens=2)
    next(chunks)
    assert not torch.is_inference_mode_enabled()
    assert torch.is_grad_enabled()


# -------------------------------------------------------------------- prompts


def test_encode_prompt_truncates_from_the_left_and_handles_empty():
    assert encode_prompt("", 5, 16) == [ord("\n")]
    assert encode_prompt("abcdefghij", 4, 10) == list(b"efghij")
    assert encode_prompt("é", 1, 10) == [0xC3, 0xA9]
    with pytest.raises(ValueError):
        encode_prompt("a", 10, 10)


def test_tokenize_is_the_routers_bytes_and_fit_keeps_the_prompts_end():
    from ballast.model.special_tokens import BYTES_TOKENIZER, MARK, encode_bytes

    backend = make_backend(TinyDecoderConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=10))
    assert backend.tokenizer_id == BYTES_TOKENIZER
    for prompt in ("", "abcdefghij", "é", f"<{MARK}|im_start|>"):
        assert (
            backend.text.tokenize(prompt)
            == backend.text.tokenize(prompt, add_special_tokens=False)
            == encode_bytes(prompt)
        )
        assert backend.text.fit(backend.text.tokenize(prompt), 4)[0] == backend.text.encode(
            prompt, 4
        )  # as encode_prompt keeps it
    assert backend.text.fit(list(b"abcdefghij"), 4) == (list(b"efghij"), 4)
    assert backend.text.fit([7, 8], 4) == ([7, 8], 4)  # ids as they are: the router's
    assert backend.text.fit([], 4) == ([ord("\n")], 4)
    # A fallback whose context is shorter than the primary's: max_tokens shortened, never lengthened.
    assert backend.text.fit(list(b"abc"), 500) == ([ord("c")], 9)
    with pytest.raises(ValueError, match="max_new_tokens"):
        backend.text.fit([1], -1)


def test_long_prompt_is_truncated_to_fit_context():
    backend = make_backend(seed=7)
    n_new = 10
    long_prompt = "".join(chr(97 + i % 26) for i in range(300))
    kept = long_prompt[-(SMALL.max_seq_len - n_new) :]
    assert all_tokens(backend, [long_prompt], [n_new]) == all_tokens(backend, [kept], [n_new])
    # bytes beyond the window cannot influence the output
    assert all_tokens(backend, ["Q" + kept], [n_new]) == all_tokens(backend, [kept], [n_new])


def test_empty_prompt_starts_from_newline():
    backend = make_backend(seed=8)
    assert all_tokens(backend, [""], [6]) == all_tokens(backend, ["\n"], [6])


# ------------------------------------------------------------------- UTF-8


def test_byte_stream_decoder_joins_split_characters():
    dec = ByteStreamDecoder()
    data = "é€!".encode()  # c3 a9 | e2 82 ac | 21
    assert dec.feed(data[:1]) == ""
    assert dec.feed(data[1:3]) == "é"
    assert dec.feed(data[3:5]) == "€"
    assert dec.feed(data[5:], final=True) == "!"
    dangling = ByteStreamDecoder()
    assert dangling.feed(b"a\xe2\x82") == "a"
    assert dangling.feed(b"", final=True) == "\ufffd"
    assert ByteStreamDecoder().feed(b"\xff") == "\ufffd"


class ScriptedBytes(nn.Module):
    """Fake model with the TinyDecoder forward contract that emits fixed bytes."""

    def __init__(self, script: bytes, prompt_len: int) -> None:
        super().__init__()
        self.vocab_size = 256
        self.n_layers = 1
        self.n_heads = 1
        self.head_dim = 1
        self.max_seq_len = 64
        self.prompt_len = prompt_len
        self.weight = nn.Parameter(torch.zeros(1))
        self.register_buffer("script", torch.tensor(list(script), dtype=torch.long))

    def forward(self, input_ids, position_ids, attn_mask, past_k, past_v):
        b, t = input_ids.shape
        new = torch.zeros(1, b, 1, t, 1)
        k = torch.cat([past_k, new], dim=3)
        step = (position_ids - (self.prompt_len - 1)).clamp(0, self.script.numel() - 1)
        logits = F.one_hot(self.script[step], 256).float() * 10.0
        return logits, k, k


def test_multibyte_characters_split_across_chunks_decode_right():
    script = "aé€😀".encode()  # 1 + 2 + 3 + 4 bytes = 10 tokens
    backend = TorchDecoderBackend(
        ScriptedBytes(script, prompt_len=1),
        name="fake",
        device="cpu",
        source="fake",
        sampling=SamplingConfig(printable_only=False),
    )
    chunks = list(backend.generate_chunks(["p"], [len(script)], chunk_tokens=2))
    pieces = [c[0] for c in chunks]
    # 2-byte chunks: "a\xc3" "\xa9\xe2" "\x82\xac" "\xf0\x9f" "\x98\x80"
    assert pieces == ["a", "é", "€", "", "😀"]
    # cut short mid-character: the dangling bytes are flushed as U+FFFD
    cut = list(backend.generate_chunks(["p"], [5], chunk_tokens=2))
    assert "".join(c[0] for c in cut) == "aé\ufffd"


def test_printable_mask_can_be_disabled():
    script = bytes([200, 201, 202])
    masked = TorchDecoderBackend(ScriptedBytes(script, 1), name="f", device="cpu", source="f")
    assert all(32 <= t <= 126 or t == 10 for t in all_tokens(masked, ["p"], [3])[0])
    unmasked = TorchDecoderBackend(
        ScriptedBytes(script, 1),
        name="f",
        device="cpu",
        source="f",
        sampling=SamplingConfig(printable_only=False),
    )
    assert all_tokens(unmasked, ["p"], [3])[0] == [200, 201, 202]


def test_temperature_sampling_is_seeded_and_printable():
    hot = SamplingConfig(temperature=5.0, seed=11)
    a = all_text(make_backend(sampling=hot), ["abc", "d"], [20, 20])
    b = all_text(make_backend(sampling=hot), ["abc", "d"], [20, 20])
    other_seed = SamplingConfig(temperature=5.0, seed=12)
    c = all_text(make_backend(sampling=other_seed), ["abc", "d"], [20, 20])
    greedy = all_text(make_backend(), ["abc", "d"], [20, 20])
    assert a == b
    assert a != c
    assert a != greedy
    assert all(ch == "\n" or 32 <= ord(ch) <= 126 for text in a for ch in text)


# ------------------------------------------------------------------ backend API


def test_backend_protocol_describe_and_warmup():
    backend = load_backend(BackendSpec(seed=3, device="cpu", config=SMALL))
    assert isinstance(backend, ModelBackend)
    assert backend.describe() == {
        "name": "tiny-decoder",
        "device": "cpu",
        "params": sum(p.numel() for p in build_tiny_decoder(SMALL, 3).parameters()),
        "max_seq_len": SMALL.max_seq_len,
        "source": "seed:3",
    }
    ran: list[int] = []
    real = backend.generate_chunks

    def counted(prompts, max_new_tokens, chunk_tokens=4):
        ran.append(len(prompts))
        return real(prompts, max_new_tokens, chunk_tokens)

    backend.generate_chunks = counted  # the real generation, counted
    backend.warmup((1, 4, 7))
    assert ran == [1, 1, 4, 4, 7, 7]  # each size twice: TorchScript profiles a shape on its first calls


def test_a_replica_warms_the_batch_sizes_it_will_run():
    from ballast.model.server import warmup_batch_sizes

    assert warmup_batch_sizes(1) == [1]
    assert warmup_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert warmup_batch_sizes(24) == [1, 2, 4, 8, 16, 24]


def test_auto_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_backend(BackendSpec(config=SMALL)).device == "cpu"


def test_cuda_requested_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="cuda"):
        load_backend(BackendSpec(device="cuda", config=SMALL))


def test_model_load_error_is_picklable_and_readable():
    err = pickle.loads(pickle.dumps(ModelLoadError("/m.pt", "bad shape")))
    assert (err.path, err.reason) == ("/m.pt", "bad shape")
    assert "/m.pt" in str(err) and "bad shape" in str(err)
    assert isinstance(err, ValueError)


# ---------------------------------------------------------------- checkpoints


def test_state_dict_round_trip(tmp_path):
    path = tmp_path / "model.pt"
    save_state_dict(build_tiny_decoder(SMALL, seed=9), path)
    assert detect_checkpoint_format(str(path)) == "state_dict"
    reference = all_tokens(make_backend(seed=9), PROMPTS, MAX_NEW)
    for fmt in ("auto", "state_dict"):
        # seed=0 in the spec: the weights must come from the file, not the seed
        spec = BackendSpec(checkpoint_path=str(path), checkpoint_format=fmt, config=SMALL)
        backend = load_backend(spec)
        assert backend.describe()["source"] == str(path)
        assert all_tokens(backend, PROMPTS, MAX_NEW) == reference


def test_torchscript_round_trip(tmp_path):
    path = tmp_path / "model.ts"
    save_torchscript(build_tiny_decoder(SMALL, seed=10), path)
    assert detect_checkpoint_format(str(path)) == "torchscript"
    reference = all_tokens(make_backend(seed=10), PROMPTS, MAX_NEW)
    # config deliberately wrong: an archive carries its own geometry
    backend = load_backend(BackendSpec(checkpoint_path=str(path), config=TinyDecoderConfig()))
    assert backend.describe()["source"] == str(path)
    assert backend.max_seq_len == SMALL.max_seq_len  # the archive's geometry, not the config's
    assert backend.parameter_count == make_backend(seed=10).parameter_count
    assert all_tokens(backend, PROMPTS, MAX_NEW) == reference
    assert all_tokens(backend, PROMPTS, MAX_NEW, use_cache=False) == reference


def test_missing_file_raises_with_path(tmp_path):
    path = str(tmp_path / "nope.pt")
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_backend(BackendSpec(checkpoint_path=path, config=SMALL))
    assert info.value.path == path and path in str(info.value)


@pytest.mark.parametrize("fmt", ["auto", "state_dict", "torchscript"])
def test_corrupt_file_raises_with_path(tmp_path, fmt):
    path = tmp_path / "corrupt.pt"
    path.write_bytes(b"\x00not a checkpoint at all" * 10)
    with pytest.raises(ModelLoadError) as info:
        load_backend(BackendSpec(checkpoint_path=str(path), checkpoint_format=fmt, config=SMALL))
    assert str(path) in str(info.value)


def test_truncated_zip_raises_with_path(tmp_path):
    good = tmp_path / "good.pt"
    save_state_dict(build_tiny_decoder(SMALL, 0), good)
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as info:
        load_backend(BackendSpec(checkpoint_path=str(bad), config=SMALL))
    assert str(bad) in str(info.value)


def test_wrong_shapes_raise_with_path(tmp_path):
    path = tmp_path / "wide.pt"
    narrow = TinyDecoderConfig(d_model=32, n_layers=2, d_ff=64, max_seq_len=128)
    save_state_dict(build_tiny_decoder(narrow, 0), path)
    with pytest.raises(ModelLoadError, match="size mismatch") as info:
        load_backend(BackendSpec(checkpoint_path=str(path), config=SMALL))
    assert str(path) in str(info.value)


def test_missing_keys_and_non_mapping_raise(tmp_path):
    partial = tmp_path / "partial.pt"
    state = build_tiny_decoder(SMALL, 0).state_dict()
    del state["ln_f.weight"]
    torch.save(state, partial)
    with pytest.raises(ModelLoadError, match="ln_f.weight"):
        load_backend(BackendSpec(checkpoint_path=str(partial), config=SMALL))
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], listed)
    with pytest.raises(ModelLoadError, match="mapping"):
        load_backend(BackendSpec(checkpoint_path=str(listed), config=SMALL))


def test_state_dict_forced_as_torchscript_raises(tmp_path):
    path = tmp_path / "sd.pt"
    save_state_dict(build_tiny_decoder(SMALL, 0), path)
    with pytest.raises(ModelLoadError, match="TorchScript") as info:
        load_backend(BackendSpec(checkpoint_path=str(path), checkpoint_format="torchscript", config=SMALL))
    assert str(path) in str(info.value)


def test_detect_format_non_zip_is_state_dict(tmp_path):
    path = tmp_path / "plain.bin"
    path.write_bytes(b"abc")
    assert detect_checkpoint_format(str(path)) == "state_dict"
    zipped = tmp_path / "other.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("archive/data.pkl", b"x")
    assert detect_checkpoint_format(str(zipped)) == "state_dict"


def test_tiny_decoder_is_scriptable_with_geometry_attributes():
    scripted = torch.jit.script(build_tiny_decoder(SMALL, 0))
    assert (scripted.n_layers, scripted.n_heads, scripted.head_dim, scripted.max_seq_len) == (
        SMALL.n_layers,
        SMALL.n_heads,
        SMALL.head_dim,
        SMALL.max_seq_len,
    )


def test_a_join_with_ids_that_are_not_bytes_fails_alone_and_the_three_others_finish_whole():
    from ballast.errors import EngineRefused
    from ballast.model.builtin_checkpoint import BackendSpec, load_backend
    from ballast.model.builtin_decoder import TinyDecoderConfig

    b = load_backend(
        BackendSpec(
            config=TinyDecoderConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64),
            device="cpu",
            compile="eager",
        )
    )
    prompts = {"a": [72, 105], "b": [65, 66, 67], "poison": [300, 1], "d": [120]}
    batch = b.open_batch()
    got: dict = {}
    joins = [Join(k, ids, 8) for k, ids in prompts.items()]
    with torch.inference_mode():
        while joins or batch.size:
            for key, ids in batch.run_chunk(joins, 3).items():
                got.setdefault(key, []).extend(ids)
            if joins:
                failed = batch.take_failed()
            joins = []
        for k in ("a", "b", "d"):
            assert got[k] == b.open_batch().run_chunk([Join(k, prompts[k], 8)], 8)[k]
    assert set(failed) == {"poison"} and isinstance(failed["poison"], EngineRefused) and "poison" not in got
