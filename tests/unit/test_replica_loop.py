"""The replica's loop (ballast.model.replica_loop), built through its constructor over the
real built-in engine (a tiny decoder on CPU) and, where time matters, a fake clock.

The loop carries out its scheduler's decision (ballast/policies/scheduler.py), checks what
the router decided on a call (max_tokens, the prompt's ids) without deciding it again,
and answers each call with its chunks."""

from __future__ import annotations

import asyncio

import pytest

from ballast.errors import DeadlineExceeded, EngineRefused
from ballast.model.builtin_checkpoint import BackendSpec, load_backend
from ballast.model.builtin_decoder import TinyDecoderConfig
from ballast.model.protocol import BATCH_PRIORITY, AttemptDeadline, Join, ModelCall, Resume, RowSampling
from ballast.model.replica_loop import (
    WAIT_WINDOW_S,
    WINDOW,
    ModelStalled,
    ReplicaLoop,
    ReplicaRow,
    recent_percentile,
)
from ballast.model.special_tokens import BYTES_TOKENIZER
from ballast.policies.scheduler import STALL_S, SchedulerConfig
from ballast.policies.window import CountWindow
from tests.unit.fakes import FakeClock

CONTEXT = 64


@pytest.fixture(scope="module")
def engine():
    cfg = TinyDecoderConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=CONTEXT)
    return load_backend(BackendSpec(config=cfg, device="cpu", compile="eager"))


class Recorded:
    """The real engine, whose batches record the rows they are told to drop."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.removed: list[int] = []
        self.batches: list = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def open_batch(self):
        batch = self._engine.open_batch()
        remove = batch.remove

        def recorded(keys) -> None:
            self.removed += list(keys)
            remove(keys)

        batch.remove = recorded
        self.batches.append(batch)
        return batch


def make_loop(engine, kv_budget_tokens: int = 8 * CONTEXT, batch_limit: int = 4, **kw) -> ReplicaLoop:
    kw.setdefault("max_tokens_limit", CONTEXT - 1)
    kw.setdefault("max_deadline_s", 60.0)
    kw.setdefault("chunk_tokens", 2)
    return ReplicaLoop(
        engine,
        SchedulerConfig(kv_budget_tokens=kv_budget_tokens, context_tokens=CONTEXT),
        batch_limit=batch_limit,
        **kw,
    )


def call(ids, max_tokens: int, budget_s: float | None = None, wall_s: float = 0.0, **kw) -> ModelCall:
    """A call as the router sends it to the built-in model: its ids are bytes."""
    deadline = AttemptDeadline.starting(budget_s, wall_s) if budget_s is not None else None
    kw.setdefault("prompt", "")
    kw.setdefault("tokenizer", BYTES_TOKENIZER)
    return ModelCall(prompt_ids=tuple(ids), max_tokens=max_tokens, deadline=deadline, **kw)


def alone(engine, ids: list[int], n: int) -> list[int]:
    """What the engine generates for ``ids`` in a batch of its own (greedy)."""
    batch, out, joins = engine.open_batch(), [], [Join("x", ids, n)]
    while joins or batch.size:
        out += batch.run_chunk(joins, 4).get("x", [])
        joins = []
    return out


async def collect(loop: ReplicaLoop, c: ModelCall):
    return [chunk async for chunk in loop.stream(c)]


# -- the windows the replica reports --------------------------------------------------------


def stamped(samples: list[tuple[float, float]]) -> CountWindow[float]:
    """A replica's wait window holding (stamp, value) samples, oldest first."""
    window: CountWindow[float] = CountWindow(WINDOW)
    for at_s, value in samples:
        window.add(value, at_s)
    return window


def test_queue_wait_p95_forgets_waits_older_than_the_window():
    # A burst of 5 s waits, then nothing admitted (level 4 sheds all): the burst must age
    # out, or the replica keeps reporting it and holds the level up by itself.
    waits = stamped([(float(t), 5000.0) for t in range(20)])
    assert recent_percentile(waits, 20.0, WAIT_WINDOW_S, 0.95) == 5000.0
    assert recent_percentile(waits, 20.0 + WAIT_WINDOW_S + 0.5, WAIT_WINDOW_S, 0.95) is None
    assert len(waits) == 0  # dropped, not just skipped


def test_queue_wait_p95_of_recent_samples():
    waits = stamped([(100.0 + i * 0.01, float(i)) for i in range(100)])
    assert recent_percentile(waits, 101.0, WAIT_WINDOW_S, 0.95) == 95.0
    assert recent_percentile(stamped([]), 0.0, WAIT_WINDOW_S, 0.95) is None


# -- the loop carries out its scheduler's decision, tick by tick ------------------------------


async def test_the_loop_moves_rows_and_reserves_kv_as_its_scheduler_decides(engine):
    clock = FakeClock(0)
    loop = make_loop(engine, kv_budget_tokens=100, batch_limit=2, clock=clock, wall_clock=clock)

    async def enqueue(prompt: int, max_tokens: int, budget_s: int, **kw) -> ReplicaRow:
        row = await loop.prepare(call(range(prompt), max_tokens, budget_s, clock(), **kw))
        loop.enqueue(row)
        return row

    first = await enqueue(10, 30, budget_s=10)  # deadline at 9.9 (the replica's lead is 0.1 s)
    late = await enqueue(10, 30, budget_s=1)  # deadline at 0.9
    clock.advance()
    third = await enqueue(20, 40, budget_s=10, cache_salt="group-a", priority=BATCH_PRIORITY)  # both ride on its join
    assert (loop.queued, loop.running, loop.kv_reserved_tokens) == (3, 0, 0)

    clock.advance()  # t = 2
    leaving, joins = loop.step()
    assert leaving == []
    assert joins == [
        Join(first.key, first.ids, 30),
        Join(third.key, third.ids, 40, cache_salt="group-a", priority=BATCH_PRIORITY),
    ]
    assert isinstance(late.out.get_nowait(), DeadlineExceeded) and not late.started  # dropped, no prefill
    assert (loop.queued, loop.running, loop.kv_reserved_tokens) == (0, 2, 100)
    assert third.started and third.queue_wait_ms == 1000.0 and loop.queue_wait_p95_ms() == 2000.0

    first.cancelled = True  # its caller left: it leaves at the next boundary, answered with nothing
    clock.advance()  # t = 3
    fourth = await enqueue(10, 30, budget_s=10)  # deadline at 12.9
    clock.advance()  # t = 4
    leaving, joins = loop.step()
    assert leaving == [first.key] and [j.key for j in joins] == [fourth.key]
    assert first.out.empty()
    assert (loop.queued, loop.running, loop.kv_reserved_tokens) == (0, 2, 100) and fourth.started

    clock.advance(9)  # t = 13: both deadlines passed while running
    leaving, joins = loop.step()
    assert sorted(leaving) == [third.key, fourth.key] and joins == []
    assert isinstance(third.out.get_nowait(), DeadlineExceeded)
    assert isinstance(fourth.out.get_nowait(), DeadlineExceeded)
    assert (loop.running, loop.kv_reserved_tokens, loop.in_flight) == (0, 0, 0)


async def test_a_timed_out_request_is_a_stall_only_when_no_step_came_for_stall_s(engine):
    assert STALL_S == 1.0
    clock = FakeClock(100)
    loop = make_loop(engine, clock=clock, wall_clock=clock)  # no step yet: progress at 100
    row = await loop.prepare(call(range(10), 30, budget_s=5, wall_s=100))
    loop.enqueue(row)
    clock.advance()  # idle for exactly stall_s: the request's own time ran out
    assert isinstance(loop.timed_out(row), DeadlineExceeded) and loop.stalled_s() == 1.0
    clock.advance()
    err = loop.timed_out(row)
    assert isinstance(err, ModelStalled) and "no decode step for 2.0s" in str(err)
    assert loop.stalled_s() == 2.0


# -- a call as the router sends it --------------------------------------------------------------


async def test_the_replica_takes_the_routers_ids_without_tokenizing_again(engine):
    loop = make_loop(engine)
    ids = (7, 200, 3)  # not what the prompt's bytes would give
    row = await loop.prepare(call(ids, 8, prompt="abc"))
    assert row.ids == [7, 200, 3] and row.max_tokens == 8
    try:
        chunks = await collect(loop, call(ids, 8, prompt="abc"))
    finally:
        loop.stop()
    assert [i for c in chunks for i in c.ids] == alone(engine, [7, 200, 3], 8)  # those ids were prefilled


async def test_a_replica_with_another_tokenizer_or_no_ids_tokenizes_the_prompt(engine):
    loop = make_loop(engine)
    other = await loop.prepare(call((7, 200, 3), 8, prompt="abc", tokenizer="hf:someone-else"))
    assert other.ids == list(b"abc")
    none_sent = await loop.prepare(ModelCall("abc", max_tokens=8))
    assert none_sent.ids == list(b"abc")
    empty = await loop.prepare(call((), 8, prompt=""))
    assert empty.ids == list(b"\n")  # encode_bytes: an empty prompt is one newline


async def test_ids_outside_the_vocabulary_are_refused_naming_the_field(engine):
    loop = make_loop(engine)
    for bad in ((0, 256), (-1,), (True,)):
        with pytest.raises(EngineRefused) as e:
            await loop.prepare(call(bad, 8))
        assert e.value.field == "prompt" and e.value.status == 400
    for bad in ((0, 256), (-1,), (True,)):
        with pytest.raises(EngineRefused) as e:
            await loop.prepare(call((1, 2), 8, resume=Resume(bad)))
        assert e.value.field == "resume.ids" and str(e.value) == "resume.ids: must be token ids in [0, 256)"
    assert loop.in_flight == 0


async def test_max_tokens_past_the_models_is_refused_and_a_fallback_shortens_it(engine):
    loop = make_loop(engine)  # a primary: the router admitted max_tokens against this model
    assert (await loop.prepare(call(range(4), CONTEXT - 1))).max_tokens == CONTEXT - 1
    for bad in (CONTEXT, 10_000, 0, -1):
        with pytest.raises(EngineRefused) as e:
            await loop.prepare(call(range(4), bad))
        assert e.value.field == "max_tokens" and e.value.status == 400
    fallback = make_loop(engine, max_tokens_limit=None)  # a shorter context than the primary's
    row = await fallback.prepare(call(range(100), 500))
    assert row.max_tokens == CONTEXT - 1 and row.ids == [99]  # shortened to fit, the prompt's end kept
    with pytest.raises(EngineRefused):
        await fallback.prepare(call(range(4), 0))


async def test_the_calls_deadline_and_sampling_reach_its_row(engine):
    clock = FakeClock(50)
    wall = FakeClock(1000)
    loop = make_loop(engine, clock=clock, wall_clock=wall, max_deadline_s=30.0)
    row = await loop.prepare(call(range(4), 8, budget_s=5, wall_s=998))  # 3 s left on the wall clock
    assert (row.timeout_s, row.deadline_s) == (3, pytest.approx(50 + 3 - 0.1))
    row = await loop.prepare(call(range(4), 8))  # no deadline: the longest a request may have
    assert (row.timeout_s, row.deadline_s) == (30.0, pytest.approx(50 + 30.0 - 0.1))
    assert row.sampling is None  # greedy
    row = await loop.prepare(call(range(4), 8, sampling=RowSampling.of({"temperature": 1e-40})))
    assert row.sampling.temperature == 0.0
    for req, field in (
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"top_p": 1.5}, "top_p"),
    ):
        with pytest.raises(EngineRefused) as e:
            RowSampling.of(req)
        assert e.value.field == field


async def test_a_new_requests_first_chunk_carries_its_queue_wait_and_a_resumed_ones_does_not(engine):
    loop = make_loop(engine)
    try:
        whole = await collect(loop, call(b"Hello", 10))
        ids = [i for c in whole for i in c.ids]
        assert whole[0].queue_wait_ms is not None and whole[0].queue_wait_ms >= 0 and whole[0].max_tokens == 10
        assert all(c.queue_wait_ms is None and c.max_tokens is None for c in whole[1:])
        assert whole[-1].finish_reason == "length" and len(ids) == 10

        text = "".join(c.text for c in whole)
        rest = await collect(loop, call(b"Hello", 10, resume=Resume(tuple(ids[:3]), 3)))
        assert all(c.queue_wait_ms is None and c.max_tokens is None for c in rest)
        assert [i for c in rest for i in c.ids] == ids[3:]  # it carries on where the lost replica was
        assert "".join(c.text for c in rest) == text[3:]

        done = await collect(loop, call(b"Hello", 10, resume=Resume(tuple(ids), len(text))))
        assert [(c.text, c.ids, c.finish_reason, c.queue_wait_ms) for c in done] == [("", (), "length", None)]
    finally:
        loop.stop()


async def test_a_stop_string_ends_a_row_and_the_batch_drops_it_at_the_next_chunk(engine):
    spy = Recorded(engine)
    loop = make_loop(spy)
    try:
        ids = alone(engine, list(b"Hi"), 20)
        text = bytes(ids).decode()
        stop = text[6:8]
        cut = text[: text.index(stop)]
        chunks = await collect(loop, call(b"Hi", 20, stops=(stop,)))  # its row: key 1, the loop's first
        assert "".join(c.text for c in chunks) == cut and chunks[-1].finish_reason == "stop"
        assert sum(c.tokens for c in chunks) < 20
        other = await collect(loop, call(b"Yo", 2))  # the next chunk: the stopped row leaves first
        assert other[-1].finish_reason == "length"
        assert 1 in spy.removed and 1 not in spy.batches[-1].keys()
    finally:
        loop.stop()


async def _until(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_row_that_leaves_an_otherwise_empty_batch_is_dropped_before_the_next_chunk(engine):
    spy = Recorded(engine)
    seen: list[tuple[int, int]] = []
    loop = make_loop(spy, on_chunk=lambda rows, tokens: seen.append((rows, tokens)))
    loop.start()
    try:
        gone = await loop.prepare(call(range(4), CONTEXT - 5))
        loop.enqueue(gone)
        its_chunks = loop.chunks(gone)
        await its_chunks.__anext__()  # it decodes
        await its_chunks.aclose()  # its caller left, and nothing else is waiting or running
        assert gone.cancelled
        await _until(lambda: loop.running == 0, "the loop let the row go")  # and went idle at once
        nxt = await loop.prepare(call(range(4), 3))
        loop.enqueue(nxt)
        got = [await nxt.out.get() for _ in range(3)]
        assert got[-1] is None and got[-2].finish_reason == "length"
        assert gone.key in spy.removed and gone.key not in spy.batches[-1].keys()  # not decoded beside it
        assert loop.recent_batch_sizes()[-2:] == [1, 1] and seen[-2:] == [(1, 2), (1, 1)]
    finally:
        loop.stop()


async def test_a_row_the_batch_fails_alone_fails_its_request_only_and_the_others_finish_whole(engine):
    # Four rows join one chunk, one of them with a prompt id outside the vocabulary (a
    # batch-level poison the loop's own checks refuse first, put in the line here as a
    # row). That request gets a 400 ENGINE_REFUSED; the other three get every token, the
    # same tokens as each alone.
    clock = FakeClock(0)
    loop = make_loop(engine, clock=clock)
    prompts = {1: [72, 105], 2: [65, 66, 67], 3: [999, 1], 4: [120]}
    rows = {}
    for k, ids in prompts.items():
        rows[k] = ReplicaRow(ids, 6, enqueued_at_s=0.0, deadline_s=1e12, decoder=engine.text.stream_decoder(), key=k)
        loop.enqueue(rows[k])
    loop.start()
    try:
        got = {}
        for k, row in rows.items():
            chunks = []
            while (c := await asyncio.wait_for(row.out.get(), 30)) is not None and not isinstance(c, BaseException):
                chunks.append(c)
            got[k] = c if isinstance(c, BaseException) else [i for ch in chunks for i in ch.ids]
        assert isinstance(got[3], EngineRefused) and got[3].field == "prompt" and got[3].status == 400
        for k in (1, 2, 4):
            assert got[k] == alone(engine, prompts[k], 6), k
        assert loop.running == 0 and loop.kv_reserved_tokens == 0
    finally:
        loop.stop()


async def test_a_call_naming_an_adapter_is_refused_by_an_engine_without_adapters(engine):
    # The loop refuses it before it queues (EngineRefused naming model); a row that reaches
    # the batch with an adapter all the same is refused there alone, and the others finish.
    loop = make_loop(engine)
    with pytest.raises(EngineRefused, match="adapter 'sql' is not served") as refused:
        await loop.prepare(call([72, 105], 4, adapter="sql"))
    assert refused.value.field == "model" and refused.value.status == 400 and loop.queued == 0

    batch = engine.open_batch()
    out = batch.run_chunk([Join(1, [72, 105], 4, adapter="sql"), Join(2, [65], 4)], 4)
    failed = batch.take_failed()
    assert set(failed) == {1} and isinstance(failed[1], EngineRefused) and failed[1].field == "model"
    assert 1 not in out and len(out[2]) >= 1


async def test_chunks_run_on_the_compute_thread_when_one_is_given(engine):
    """``model.compute_niceness``: the replica gives its loop one thread for the engine's
    chunks (ModelServer._compute_thread); every chunk runs there and nowhere else."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    seen: set[str] = set()

    class Where(Recorded):
        def open_batch(self):
            batch = super().open_batch()
            run = batch.run_chunk

            def recorded(joins, steps):
                seen.add(threading.current_thread().name)
                return run(joins, steps)

            batch.run_chunk = recorded
            return batch

    with ThreadPoolExecutor(1, thread_name_prefix="compute") as compute:
        loop = make_loop(Where(engine), compute=compute)
        chunks = await asyncio.gather(*(collect(loop, call([1, 2, 3], 6)) for _ in range(3)))
    assert all(c[-1].finish_reason for c in chunks)
    assert seen == {"compute_0"}


# -- choices and log-probabilities ---------------------------------------------------------


async def test_n_choices_are_n_rows_answered_by_index_each_to_its_own_end(engine):
    loop = make_loop(engine, batch_limit=8)
    ids = [72, 105, 33]
    chunks = await collect(loop, call(ids, 5, n=3))
    by_index = {i: [c for c in chunks if c.index == i] for i in range(3)}
    expected = alone(engine, ids, 5)
    for mine in by_index.values():
        assert [t for c in mine for t in c.ids] == expected  # greedy: each choice is the row alone
        assert [c.finish_reason for c in mine][-1] == "length" and mine[0].max_tokens == 5
    assert loop.in_flight == 0 and loop.kv_reserved_tokens == 0


async def test_a_call_for_the_prompts_log_probabilities_alone_may_ask_no_token(engine):
    loop = make_loop(engine)
    (last,) = await collect(loop, call([72, 105, 33], 0, prompt_logprobs=1))
    assert (last.ids, last.finish_reason, last.text) == ((), "length", "")
    with pytest.raises(EngineRefused) as e:
        await collect(loop, call([72, 105], 0))  # no token and nothing else asked: a mistake
    assert e.value.field == "max_tokens"


def test_a_choices_seed_is_the_calls_plus_its_index_within_int64():
    from ballast.model.replica_loop import choice_call
    from ballast.policies.sampling import MAX_SEED, MIN_SEED

    c = call([1], 4, n=3, sampling=RowSampling(temperature=1.0, seed=MAX_SEED - 1))
    assert [choice_call(c, i).sampling.seed for i in range(3)] == [MAX_SEED - 1, MAX_SEED, MIN_SEED]
    assert all(choice_call(c, i).n == 1 for i in range(3))
    assert choice_call(call([1], 4, n=2), 1).sampling is None


async def test_an_embeddings_call_is_a_row_per_input_answered_by_index_with_its_vector(engine):
    import math
    import struct

    from ballast.model.protocol import Pooling

    loop = make_loop(engine)
    chunks = await collect(loop, call([], 0, pool=Pooling(), inputs=((72, 105), (33,), (72, 105))))
    vectors = {c.index: struct.unpack(f"<{len(c.embedding) // 4}f", c.embedding) for c in chunks}
    assert sorted(vectors) == [0, 1, 2] and all(c.ids == () for c in chunks)
    assert all(math.isclose(math.hypot(*v), 1.0, abs_tol=1e-5) for v in vectors.values())  # normalised
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-6) and vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    assert loop.in_flight == 0
    with pytest.raises(EngineRefused):
        await collect(loop, call([], 3, pool=Pooling(), inputs=((72,),)))  # a pooled row generates nothing


async def test_a_pooled_row_its_engine_gave_no_vector_is_refused_not_left_waiting(engine):
    from ballast.model.protocol import Pooling

    class PoolsNone(Recorded):  # the real engine, whose batches give no vector
        def open_batch(self):
            batch = super().open_batch()
            batch.take_embeddings = dict
            return batch

    loop = make_loop(PoolsNone(engine))
    with pytest.raises(EngineRefused) as e:
        await collect(loop, call([], 0, pool=Pooling(), inputs=((72, 105), (33,))))
    assert e.value.field == "model" and loop.in_flight == 0


async def test_the_rows_of_one_call_wait_in_line_as_one_request(engine):
    from ballast.model.protocol import Pooling
    from ballast.model.replica_loop import input_call

    loop = make_loop(engine)  # not started: what is enqueued waits
    embed = call([], 0, pool=Pooling(), inputs=tuple((72, 105 + i) for i in range(5)))
    for i in range(5):
        row = await loop.prepare(input_call(embed, i))
        row.group = -1
        loop.enqueue(row)
    loop.enqueue(await loop.prepare(call([72], 2)))
    assert (loop.queued, loop.in_flight) == (2, 6)  # one embeddings request of 5 inputs, one of its own


async def test_a_stall_is_taken_out_of_the_queue_waits_the_level_reads(engine):
    """Each chunk takes 0.05 s of the fake clock; before the 25th the host stalls 3 s. Rows
    that waited in line across it report their whole wait to their callers, but the
    level's sample (``queue_wait_p95_ms``) is the wait less the stall."""
    clock = FakeClock(100)
    chunks = [0]

    async def stall_point() -> None:
        chunks[0] += 1
        clock.advance(3.05 if chunks[0] == 25 else 0.05)

    loop = make_loop(engine, batch_limit=2, clock=clock, wall_clock=clock, stall_point=stall_point)
    try:
        answers = await asyncio.gather(*(collect(loop, call(range(10), 20)) for _ in range(8)))
    finally:
        loop.stop()
    waits = [a[0].queue_wait_ms for a in answers]
    assert max(waits) > 3000.0  # what a caller waited, the stall in it, as it was
    p95 = loop.queue_wait_p95_ms()
    assert p95 is not None and p95 < 3000.0 and p95 < max(waits) - 2900.0
