"""Migration after a lost replica: the policy tick by tick, and the continuation on real engines.

A stream whose replica goes away is carried on by another replica from the token ids
already delivered (``ballast.model.replica_loop.resume``). These tests cut real streams
(the built-in byte decoder and the Hugging Face engine on a tiny Llama built here) at
every point and check that the continuation generates the same tokens and that the
client's text, the part it had plus the part it gets, is the uninterrupted text:
nothing duplicated, nothing missing, multi-byte characters and stop strings included.
"""

from __future__ import annotations

import pytest
import torch

from ballast.model.builtin_engine import ByteStreamDecoder
from ballast.model.protocol import Join
from ballast.model.replica_loop import ReplicaRow, resume, row_text
from ballast.policies.migration import MAX_PAUSE_S, MigrationConfig, pause_s, should_migrate
from ballast.stops import StopScanner

# -- the policy ---------------------------------------------------------------------------


def test_migrations_go_on_until_the_limit_then_stop() -> None:
    cfg = MigrationConfig(limit=3)
    steps = [should_migrate(done, cfg, deadline_left_s=10, next_pause_s=0.05, min_attempt_s=0.05) for done in range(5)]
    assert [ok for ok, _ in steps] == [True, True, True, False, False]
    assert steps[2][1] == "migration 3/3" and steps[3][1] == "migration limit reached (3/3)"


def test_a_migration_needs_room_for_its_pause_and_one_useful_attempt() -> None:
    cfg = MigrationConfig(limit=3)
    # The deadline draws nearer a tick (10 ms) at a time: room until pause + attempt no longer fit.
    verdicts = {left_ms: should_migrate(0, cfg, left_ms / 1000, 0.02, 0.05)[0] for left_ms in range(100, 40, -10)}
    assert verdicts == {100: True, 90: True, 80: True, 70: False, 60: False, 50: False}
    assert should_migrate(0, cfg, float("inf"), 0.02, 0.05)[0]  # no deadline


def test_a_limit_of_zero_never_migrates_and_bad_values_are_refused() -> None:
    assert should_migrate(0, MigrationConfig(limit=0), 10, 0, 0) == (False, "migration limit reached (0/0)")
    with pytest.raises(ValueError, match="limit"):
        MigrationConfig(limit=-1)
    with pytest.raises(ValueError, match="done"):
        should_migrate(-1, MigrationConfig(), 10, 0, 0)
    with pytest.raises(ValueError, match="rand"):
        pause_s(1, 1.5)


def test_the_pause_is_short_and_jittered() -> None:
    assert [pause_s(1, u) for u in (0.0, 0.5, 1.0)] == [0.0, MAX_PAUSE_S / 2, MAX_PAUSE_S]
    assert pause_s(3, 0.5) == pause_s(1, 0.5)  # no growth: the handle already dropped the dead replica


# -- the continuation's text ----------------------------------------------------------------


def item(prompt_ids: list[int], max_tokens: int, decoder, stops=None) -> ReplicaRow:
    return ReplicaRow(
        list(prompt_ids),
        max_tokens,
        enqueued_at_s=0.0,
        deadline_s=0.0,
        decoder=decoder,
        stops=StopScanner(stops) if stops else None,
    )


def stream_text(it: ReplicaRow, ids: list[int], chunk: int) -> tuple[str, list[int]]:
    """Run ``ids`` through a row's text path ``chunk`` at a time: (text sent, ids sent)."""
    out, sent = [], []
    for i in range(0, len(ids), chunk):
        piece = ids[i : i + chunk]
        done = i + chunk >= len(ids)
        text, stopped = row_text(it, piece, done)
        out.append(text)
        sent.extend(piece)
        if stopped:
            break
    return "".join(out), sent


def cut_and_resume(ids: list[int], cut_chunks: int, chunk: int, new_decoder, stops=None) -> str:
    """The client's text when the replica goes away after ``cut_chunks`` chunks and a new
    one carries the stream on."""
    had_ids = ids[: cut_chunks * chunk]
    first = item([1], len(ids), new_decoder(), stops)  # the lost replica: its row never ended
    had_text = "".join(row_text(first, had_ids[i : i + chunk], False)[0] for i in range(0, len(had_ids), chunk))
    second = item([1], len(ids), new_decoder(), stops)
    resume(second, had_ids, len(had_text))
    assert second.ids == [1, *had_ids] and second.max_tokens == len(ids) - len(had_ids)
    rest_text, _ = stream_text(second, ids[len(had_ids) :], chunk) if second.max_tokens else (second.pending, [])
    return had_text + rest_text


TEXT = "Café 東京 🙂 naïve — über STOP after"


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_a_byte_stream_cut_anywhere_reads_as_the_uninterrupted_text(chunk: int) -> None:
    ids = list(TEXT.encode())
    whole, _ = stream_text(item([1], len(ids), ByteStreamDecoder()), ids, chunk)
    assert whole == TEXT
    for cut in range(0, len(ids) // chunk + 1):
        assert cut_and_resume(ids, cut, chunk, ByteStreamDecoder) == TEXT, cut


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_stop_string_held_back_at_the_cut_is_still_honoured(chunk: int) -> None:
    ids = list(TEXT.encode())
    whole, _ = stream_text(item([1], len(ids), ByteStreamDecoder(), ["STOP"]), ids, chunk)
    assert whole == TEXT[: TEXT.index("STOP")]
    for cut in range(0, len(ids) // chunk + 1):
        assert cut_and_resume(ids, cut, chunk, ByteStreamDecoder, ["STOP"]) == whole, cut


# -- real engines: the continuation generates what the uninterrupted stream would ----------


@pytest.fixture(scope="module")
def tiny_decoder():
    from ballast.model.builtin_checkpoint import BackendSpec, load_backend
    from ballast.model.builtin_decoder import TinyDecoderConfig

    cfg = TinyDecoderConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128)
    return load_backend(BackendSpec(name="tiny", seed=7, config=cfg, device="cpu"))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from ballast.model.hf_checkpoint import load_checkpoint
    from ballast.model.hf_engine import HFBackend
    from tests.unit.hf_fixture import make_tiny_llama

    b = HFBackend(load_checkpoint(make_tiny_llama(tmp_path_factory.mktemp("tiny")), "cpu"), name="tiny")
    b.eos_ids = frozenset()  # rows run to max_tokens, so every cut point exists
    return b


def generate(backend, ids: list[int], n: int, chunk: int = 4) -> list[int]:
    batch = backend.open_batch()
    out: list[int] = []
    with torch.inference_mode():
        joins = [Join("x", ids, n)]
        while joins or batch.size:
            out.extend(batch.run_chunk(joins, chunk).get("x", []))
            joins = []
    return out


@pytest.mark.parametrize("engine", ["tiny_decoder", "hf"])
def test_a_continuation_generates_the_tokens_the_lost_replica_would_have(engine, request) -> None:
    backend = request.getfixturevalue(engine)
    n = 24
    prompt, n = backend.text.fit(backend.text.tokenize("A replica serves requests; the router sends each one to"), n)
    whole = generate(backend, prompt, n)
    assert len(whole) == n
    for cut in (1, 5, 12, 23):
        assert whole[:cut] + generate(backend, prompt + whole[:cut], n - cut) == whole, cut


def test_a_continuation_on_the_hf_engine_reads_as_the_uninterrupted_text(hf) -> None:
    from ballast.model.hf_text import IncrementalDetokenizer

    prompt, n = hf.text.fit(hf.text.tokenize("東京 and Café"), 30)
    ids = generate(hf, prompt, n)
    whole, _ = stream_text(item(prompt, n, IncrementalDetokenizer(hf.tokenizer)), ids, 3)
    assert whole == hf.tokenizer.decode(ids, skip_special_tokens=True)
    for cut in range(0, n // 3 + 1):
        assert cut_and_resume(ids, cut, 3, lambda: IncrementalDetokenizer(hf.tokenizer)) == whole, cut
