"""The batch dispatcher's decisions (ballast/router/dispatcher.py), step by step on fake
clocks, against a real redis-server (EmbeddedRedis) and a real gate.

The model call is the one fake here (``FakeEngine``): a model deployment needs Ray Serve,
which the integration suite runs (tests/integration/test_batches.py). Nothing sleeps: the
tests call ``step()`` and wait for the lines it started to end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import batchkit
import pytest
from batchkit import open_store
from fakes import FakeSleep

from ballast.batch.embedded import EmbeddedRedis
from ballast.batch.records import BatchRecord
from ballast.batch.store import BatchStore
from ballast.config import load_config
from ballast.errors import BallastError, ModelUnavailable, QuotaExceeded, ReplicaLost, StoreUnavailable
from ballast.policies.criticality import Criticality
from ballast.policies.limiter import AimdLimit, LimiterConfig
from ballast.policies.spare import batch_rows
from ballast.router import openai_api as oa
from ballast.router.dispatcher import REFERENCE_EVERY_S, RESERVE_ROWS, BatchDispatch, Finalizer, ModelDispatcher
from ballast.router.gate import PriorityGate

T0 = 1_800_000_000.0
MODEL = "tiny"


class Clock:
    """A fake clock moved by the test, in whole seconds."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Stands in for the model call (``OpenAIFront.batch_line``): answers, or raises the
    error it is given, and gives the slot back as the real call's ticket does. ``hold``
    keeps every call running until it is set."""

    def __init__(self, error: BallastError | None = None) -> None:
        self.error = error
        self.calls: list[dict[str, Any]] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, caller: Any, body: dict[str, Any], chat: bool, slot: Any) -> Any:
        self.calls.append(body)
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.error is not None:
                raise self.error
            return {"id": f"chatcmpl-{len(self.calls)}", "choices": [{"message": {"content": "ok"}}]}
        finally:
            slot.release()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    yield from batchkit.serve(tmp_path_factory)


@pytest.fixture
async def store(server: EmbeddedRedis) -> AsyncIterator[BatchStore]:
    # claim_idle_s 0: a pending line is taken by the next claim (a dead router's, at once)
    async for s in open_store(server, claim_idle_s=0.0):
        yield s


def config(**batch: Any) -> Any:
    return load_config({"batch": batch})


def gate(limit: int = 8) -> PriorityGate:
    return PriorityGate(AimdLimit(LimiterConfig(initial=limit, min_limit=1)), max_waiting=16, max_wait_s=5.0)


def dispatcher(
    store: BatchStore, engine: FakeEngine, g: PriorityGate | None, level: list[int], wall: Clock, **batch: Any
) -> ModelDispatcher:
    return ModelDispatcher(
        MODEL, g, lambda: level[0], engine, store, config(**batch), "router-a", clock=wall, wall=wall, rng=lambda: 0.5
    )


async def new_batch(store: BatchStore, lines: int, expires_in_s: float = 86400) -> BatchRecord:
    return await batchkit.new_batch(store, lines, MODEL, "acme", T0, expires_in_s)


async def settle(d: ModelDispatcher) -> None:
    """Wait for the lines the dispatcher started to end (no clock involved)."""
    await asyncio.gather(*list(d.running))


async def until(done: Any) -> None:
    """Yield to the event loop (and its sockets) until ``done()``."""
    while not done():
        await asyncio.sleep(0.001)


async def result_lines(store: BatchStore, rec: BatchRecord, kind: str) -> list[dict[str, Any]]:
    done = await store.batch(rec.id)
    assert done is not None and done.status == "completed", done
    file_id = done.output_file_id if kind == "output" else done.error_file_id
    assert file_id is not None
    data = await store.file_data(file_id)
    assert data is not None
    return [json.loads(x) for x in data.decode().splitlines()]


async def test_claims_nothing_while_the_level_is_above_0(store: BatchStore) -> None:
    engine, g, level, wall = FakeEngine(), gate(), [1], Clock(T0)
    d = dispatcher(store, engine, g, level, wall)
    await new_batch(store, 3)
    assert d.room() == 0
    assert await d.step() == 0
    assert not d.held and not engine.calls and g.in_flight == 0
    level[0] = 0  # the level falls: the same dispatcher takes the lines
    assert await d.step() == 3
    await settle(d)
    assert len(engine.calls) == 3 and d.outcomes == {"completed": 3}


async def test_the_room_is_spare_batch_rows_and_each_line_takes_a_slot_without_waiting(store: BatchStore) -> None:
    engine, g, level, wall = FakeEngine(), gate(limit=8), [0], Clock(T0)
    engine.hold = asyncio.Event()
    d = dispatcher(store, engine, g, level, wall)
    await new_batch(store, 10)
    held_interactive = [await g.acquire(Criticality.CRITICAL.rank, T0 + 60) for _ in range(2)]
    wall.now += 1.0  # 2 interactive arrivals over 1 s: 2/s x the expected service time
    d.measure()
    assert d.rate_per_s == 2.0
    # no service time measured yet: no arrivals due; no reference sampled yet (one every
    # REFERENCE_EVERY_S): no interactive traffic known to keep room for, the limit bounds the step
    assert d.reference.value() is None and d.rows_cap(8, 2) == 8
    expected = batch_rows(0, 8, 2, 2.0, g.expected_service_s, RESERVE_ROWS, 0, rows_cap=8)
    assert d.room() == expected == 8 - 2 - 0 - RESERVE_ROWS
    assert await d.step() == expected
    assert g.batch_in_flight == expected and g.in_flight == 2 + expected
    assert d.room() == 0 and g.waiting == 0  # batch holds what was spare; it never joined the line
    engine.hold.set()
    await settle(d)
    assert g.batch_in_flight == 0 and g.in_flight == 2
    assert len(held_interactive) == 2


async def test_the_room_follows_the_engines_step_and_the_interactive_rows_at_their_high(store: BatchStore) -> None:
    """The gate's rows curve fitted from answers (4 ms + 1 ms a row a token: a / b = 4); then
    20 interactive requests a second of 25 tokens each, none in flight when sampled: alone
    they hold 20 x 25 x 0.004 / (1 - 20 x 25 x 0.001) = 4 rows (``spare.rows_alone``), the
    reference. In the valley batch fills up to the reference's step and its slack
    (4 + 0.5 x 8 = 8 rows); beside 6 interactive rows (past the reference) to
    6 + 0.5 x 10 = 11; none past that."""
    engine, wall = FakeEngine(), Clock(T0)
    engine.hold = asyncio.Event()
    g = PriorityGate(
        AimdLimit(LimiterConfig(initial=16, min_limit=1, max_limit=16, interval_s=1.0), clock=wall),
        max_waiting=16,
        max_wait_s=5.0,
    )
    for t in range(40):  # answers at varying rows: the curve's points, one a window
        rows = 2 + t % 12
        g.limit.rows_in_flight(rows)
        g.limit.observe_tokens(0.004 + 0.001 * rows)
        wall.now += 1.0
        g.limit.rows_in_flight(0)
    assert g.limit.curve_fit() == pytest.approx((0.004, 0.001))
    d = dispatcher(store, engine, g, [0], wall, step_slack=0.5)
    for _ in range(4 * int(REFERENCE_EVERY_S)):  # 20 s, one measure a second
        for _ in range(20):
            await g.acquire(Criticality.CRITICAL.rank, T0 + 600)
            g.release()
            g.observe_service(0.2, 10.0, tokens=25)
        wall.now += 1.0
        d.measure()
    assert g.in_flight == 0 and d.reference.value() == 4
    d.rate_per_s = 0.0  # no arrivals forecast (the limit's own room is the test above's)
    assert d.rows_cap(16, 0) == 8 and d.room() == 8
    await new_batch(store, 20)
    assert await d.step() == 8 and g.batch_in_flight == 8
    assert d.room() == 0
    assert d.status()["reference_rows"] == 4 and d.status()["rows_cap"] == 8
    for _ in range(6):
        await g.acquire(Criticality.CRITICAL.rank, T0 + 600)
    assert d.rows_cap(16, 6) == 11 and d.room() == 0  # 6 + 8 = 14 rows already: past the cap
    engine.hold.set()
    await settle(d)
    assert g.batch_in_flight == 0
    assert d.room() == 11 - 6  # beside 6 interactive rows: batch may add 5 (limit 16 less 6 and the reserve: 9)


async def test_a_line_that_ends_wakes_its_loop_to_refill_the_row_before_the_interval(store: BatchStore) -> None:
    """The loop steps once an interval (the fake sleep never lets it pass here) and at once
    when a line ends: room for one line, three queued, all three run one after another."""
    engine, g, wall, sleep = FakeEngine(), gate(limit=8), Clock(T0), FakeSleep()
    d = dispatcher(store, engine, g, [0], wall)
    d.rows_cap = lambda limit, interactive: 1  # type: ignore[method-assign]  # one row at a time
    await new_batch(store, 3)
    loops = BatchDispatch({MODEL: d}, Finalizer(store, [MODEL]), 0.5, sleep=sleep)
    loops.start()
    try:
        # each line: a claim and a record in the real store (I/O): polled, the bound a hang guard
        await asyncio.wait_for(until(lambda: d.outcomes["completed"] == 3), timeout=60)
        assert d.outcomes == {"completed": 3}
        assert len(sleep.slept_s) >= 3  # each step paused for its interval, and was woken before it passed
    finally:
        loops.close()


async def test_stops_starting_lines_while_an_interactive_request_waits(store: BatchStore) -> None:
    engine, g, level, wall = FakeEngine(), gate(limit=1), [0], Clock(T0)
    d = dispatcher(store, engine, g, level, wall)
    await new_batch(store, 2)
    await g.acquire(Criticality.CRITICAL.rank, T0 + 60)  # the one slot, interactive
    waiter = asyncio.get_running_loop().create_task(g.acquire(Criticality.SHEDDABLE.rank, 1e12))
    await asyncio.sleep(0)  # one turn of the loop: the request joins the gate's line
    assert g.waiting == 1
    assert d.room() == 0 and g.try_batch() is None
    assert await d.step() == 0 and not engine.calls
    g.release()  # the slot goes to the waiting interactive request, not to batch
    await waiter
    assert g.waiting == 0 and g.batch_in_flight == 0 and g.in_flight == 1


async def test_a_retryable_failure_is_retried_with_full_jitter_then_dead_lettered(store: BatchStore) -> None:
    engine, g, level, wall = FakeEngine(ModelUnavailable("replica gone")), gate(), [0], Clock(T0)
    d = dispatcher(store, engine, g, level, wall, max_attempts=2, backoff_base_s=4.0)
    rec = await new_batch(store, 1)
    assert await d.step() == 1
    await settle(d)
    assert d.outcomes == {"retried": 1} and await store.dlq_depth(MODEL) == 0
    # back on the queue with 1 attempt, not before 0.5 x min(cap, 4 x 2^0) = 2 s from now
    assert await d.step() == 0 and len(d.held) == 1
    assert d.held[0].line.attempts == 1 and d.held[0].line.not_before == T0 + 2.0
    wall.now += 1.0
    assert await d.step() == 0  # still held: its time has not come
    wall.now += 1.0
    assert await d.step() == 1
    await settle(d)
    assert d.outcomes == {"retried": 1, "dead_lettered": 1} and len(engine.calls) == 2
    dead = (await store.dlq_list(MODEL)).items
    assert len(dead) == 1 and dead[0].line.attempts == 2 and dead[0].line.custom_id == "req-1"
    assert dead[0].last_error.startswith("MODEL_UNAVAILABLE") and await store.queue_depth(MODEL) == 0
    assert not await store.answered(rec.id, "req-1")  # the batch waits for it (until its window ends)


async def test_a_client_error_goes_straight_to_the_error_file(store: BatchStore) -> None:
    engine = FakeEngine(oa.BadRequest("max_tokens: must be <= 64", field="max_tokens"))
    g, level, wall = gate(), [0], Clock(T0)
    d = dispatcher(store, engine, g, level, wall, max_attempts=3)
    rec = await new_batch(store, 1)
    await d.step()
    await settle(d)
    assert d.outcomes == {"failed": 1} and len(engine.calls) == 1 and await store.dlq_depth(MODEL) == 0
    assert await Finalizer(store, [MODEL], wall=wall).step() == 1
    (line,) = await result_lines(store, rec, "error")
    assert line["custom_id"] == "req-1" and line["error"]["code"] == "INVALID_REQUEST"
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    "refusal", [QuotaExceeded("over quota", retry_after_s=3.0), ReplicaLost("its replica died", retry_after_s=3.0)]
)
async def test_a_quota_refusal_or_a_lost_replica_puts_the_line_back_without_an_attempt(
    store: BatchStore, refusal: BallastError
) -> None:
    engine, g, level, wall = FakeEngine(refusal), gate(), [0], Clock(T0)
    d = dispatcher(store, engine, g, level, wall, max_attempts=1)
    await new_batch(store, 1)
    await d.step()
    await settle(d)
    await d.step()
    assert d.outcomes == {"deferred": 1} and len(d.held) == 1
    assert d.held[0].line.attempts == 0 and d.held[0].line.not_before == T0 + 3.0
    assert await store.dlq_depth(MODEL) == 0


async def test_a_line_past_its_window_goes_to_the_error_file_unrun(store: BatchStore) -> None:
    engine, g, level, wall = FakeEngine(), gate(), [0], Clock(T0 + 100)
    d = dispatcher(store, engine, g, level, wall)
    rec = await new_batch(store, 1, expires_in_s=50)
    await d.step()
    await settle(d)
    assert d.outcomes == {"expired": 1} and not engine.calls
    assert await Finalizer(store, [MODEL], wall=wall).step() == 1
    (line,) = await result_lines(store, rec, "error")
    assert line["error"]["code"] == "batch_expired" and line["response"] is None


class AckFails(BatchStore):
    """The real store whose acks fail (a router that dies after recording), calls logged."""

    def __init__(self, real: BatchStore, fail_ack: bool) -> None:
        self.__dict__.update(real.__dict__)
        self.order: list[str] = []
        self.fail_ack = fail_ack

    async def record(self, batch_id: str, custom_id: str, kind: Any, line_json: str) -> bool:
        self.order.append("record")
        return await super().record(batch_id, custom_id, kind, line_json)

    async def ack(self, model: str, entry_id: str) -> bool:
        self.order.append("ack")
        if self.fail_ack:
            raise StoreUnavailable("the store went away")
        return await super().ack(model, entry_id)


async def test_the_answer_is_recorded_before_the_ack_and_a_redelivery_is_skipped(store: BatchStore) -> None:
    engine, wall = FakeEngine(), Clock(T0)
    first = AckFails(store, fail_ack=True)
    a = dispatcher(first, engine, gate(), [0], wall)
    rec = await new_batch(store, 1)
    await a.step()
    await settle(a)
    assert first.order == ["record", "ack"]  # answered, then acknowledged (which failed)
    assert await store.answered(rec.id, "req-1") and await store.queue_depth(MODEL) == 1
    # another router takes the pending line (claim_idle_s 0 here) and does not run it again
    second = AckFails(store, fail_ack=False)
    b = ModelDispatcher(
        MODEL, gate(), lambda: 0, engine, second, config(), "router-b", clock=wall, wall=wall, rng=lambda: 0.5
    )
    assert await b.step() == 1
    await settle(b)
    assert b.outcomes == {"skipped": 1} and second.order == ["ack"] and len(engine.calls) == 1
    assert await store.queue_depth(MODEL) == 0
    assert await Finalizer(store, [MODEL], wall=wall).step() == 1
    (line,) = await result_lines(store, rec, "output")
    assert line["custom_id"] == "req-1" and line["response"]["status_code"] == 200


async def test_a_cancelled_batch_s_lines_are_dropped_unrun(store: BatchStore) -> None:
    engine, g, level, wall = FakeEngine(), gate(), [0], Clock(T0)
    d = dispatcher(store, engine, g, level, wall)
    rec = await new_batch(store, 2)
    assert await store.cancel(rec.id, T0)
    await d.step()
    await settle(d)
    assert d.outcomes == {"skipped": 2} and not engine.calls and await store.queue_depth(MODEL) == 0
    await Finalizer(store, [MODEL], wall=wall).step()
    done = await store.batch(rec.id)
    assert done is not None and done.status == "cancelled" and done.output_file_id is None
