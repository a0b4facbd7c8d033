"""The batch store's fair share of a model among tenants (ballast/batch/store_queue.py), against
a real redis-server, each one that is here (Redis 6.2 and 7: the claim is one Lua script).

Lines are claimed and acknowledged as a dispatcher does, and the tests read who got each line
(``Delivery.line.tenant``) and what each tenant holds pending, as Redis reports it. Claims that
should hand out only new lines run with ``claim_idle_s`` 60 s, so no pending line is idle long
enough to be taken over; the one test of a dead router's lines sets it to 0 on a second store.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import batchkit
import pytest

from ballast.batch.embedded import EmbeddedRedis
from ballast.batch.records import BatchRecord, Delivery, QueuedLine
from ballast.batch.store import BatchStore, connect
from ballast.batch.store_queue import GROUP
from ballast.config import BatchConfig

T0 = 1_800_000_000.0
MODEL = "tiny"


@pytest.fixture(scope="module", params=sorted(batchkit.binaries()))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    yield from batchkit.serve(tmp_path_factory, request.param)


def open_store(
    server: EmbeddedRedis, app: str | None = None, weights: Mapping[str, float] | None = None, **batch: Any
) -> BatchStore:
    settings = {"claim_idle_s": 60.0, "store_url": server.url, "store_password_file": str(server.password_file)}
    cfg = BatchConfig(**{**settings, **batch})
    return connect(cfg, app or f"t{uuid.uuid4().hex[:12]}", environ={}, weights=weights)


@pytest.fixture
async def store(server: EmbeddedRedis) -> AsyncIterator[BatchStore]:
    s = open_store(server)
    yield s
    await s.close()


async def queue(store: BatchStore, tenant: str, n: int, queued_at: float = T0) -> BatchRecord:
    """A batch of ``tenant``'s in progress with ``n`` lines of MODEL (custom_ids ``<tenant>-<i>``)."""
    return await batchkit.new_batch(store, n, MODEL, tenant, queued_at, ids=tenant)


def who(got: list[Delivery]) -> list[str]:
    return [d.line.tenant for d in got]


async def ack_all(store: BatchStore, got: list[Delivery]) -> None:
    for d in got:
        assert await store.ack(MODEL, d.entry_id)


async def pending(store: BatchStore, tenant: str) -> int:
    """The tenant's lines claimed and not acknowledged, as Redis counts them (XPENDING)."""
    summary = await store._r.xpending(store.keys.queue(MODEL, tenant), GROUP)
    return int(summary["pending"])


async def indexed(store: BatchStore) -> set[str]:
    """The tenants the model's index names, read from Redis."""
    return {t.decode() for t in await store._r.smembers(store.keys.queue_tenants(MODEL))}


async def test_a_small_batch_queued_after_a_big_one_alternates_with_it_from_the_first_claim(
    store: BatchStore,
) -> None:
    await queue(store, "big", 40, queued_at=T0)
    await queue(store, "small", 5, queued_at=T0 + 1)
    rounds = []
    for _ in range(4):  # claims of 4, each answered before the next, as a dispatcher does
        got = await store.claim(MODEL, "r1", 4)
        rounds.append([d.line.custom_id for d in got])
        await ack_all(store, got)
    assert rounds == [
        ["big-1", "small-1", "big-2", "small-2"],  # ties (as many in flight) to the line queued first
        ["big-3", "small-3", "big-4", "small-4"],
        ["big-5", "small-5", "big-6", "big-7"],  # small has no more: big gets the rest of the claim
        ["big-8", "big-9", "big-10", "big-11"],
    ]
    assert await indexed(store) == {"big"}  # small's stream is empty: it left the index
    assert await store.queue_depth(MODEL) == 40 - 11


async def test_lines_in_flight_follow_the_tenants_weights(server: EmbeddedRedis) -> None:
    store = open_store(server, weights={"heavy": 2.0, "light": 1.0})
    try:
        await queue(store, "light", 30, queued_at=T0)
        await queue(store, "heavy", 30, queued_at=T0 + 1)
        got = await store.claim(MODEL, "r1", 9)  # nothing acknowledged: every line stays in flight
        assert who(got) == ["light", "heavy", "heavy", "light", "heavy", "heavy", "light", "heavy", "heavy"]
        assert (await pending(store, "heavy"), await pending(store, "light")) == (6, 3)

        # two of heavy's end: it is owed lines until 2:1 again, the tie (6:3) to light's older line
        await ack_all(store, [d for d in got if d.line.tenant == "heavy"][:2])
        assert who(await store.claim(MODEL, "r2", 3)) == ["heavy", "heavy", "light"]
        assert (await pending(store, "heavy"), await pending(store, "light")) == (6, 4)
    finally:
        await store.close()


async def test_ties_go_to_the_line_queued_first_then_by_tenant_name(store: BatchStore) -> None:
    await queue(store, "a", 2, queued_at=T0)
    await queue(store, "z", 2, queued_at=T0 - 5)  # written after a's, queued before them
    assert who(await store.claim(MODEL, "r1", 4)) == ["z", "a", "z", "a"]
    await queue(store, "c", 2, queued_at=T0 + 9)
    await queue(store, "b", 2, queued_at=T0 + 9)  # queued at the same time as c's: by name
    assert who(await store.claim(MODEL, "r1", 2)) == ["b", "c"]


async def test_in_flight_counts_every_routers_lines(server: EmbeddedRedis) -> None:
    store = open_store(server)
    try:
        await queue(store, "a", 10, queued_at=T0)
        await queue(store, "b", 10, queued_at=T0 + 1)
        first = await store.claim(MODEL, "r1", 1)  # a: 1 in flight at r1
        assert who(first) == ["a"]
        assert who(await store.claim(MODEL, "r2", 3)) == ["b", "a", "b"]  # r2 sees r1's line of a's
    finally:
        await store.close()


async def test_a_lone_tenant_gets_every_line_whatever_the_weights(server: EmbeddedRedis) -> None:
    store = open_store(server, weights={"solo": 0.1, "absent": 10.0})
    try:
        await queue(store, "solo", 12)
        got = await store.claim(MODEL, "r1", 10)
        assert [d.line.custom_id for d in got] == [f"solo-{i}" for i in range(1, 11)]
        assert [d.line.custom_id for d in await store.claim(MODEL, "r1", 10)] == ["solo-11", "solo-12"]
        assert await store.claim(MODEL, "r1", 10) == []
    finally:
        await store.close()


async def test_a_tenant_the_weights_do_not_name_weighs_as_the_lightest_named(server: EmbeddedRedis) -> None:
    store = open_store(server, weights={"gold": 3.0, "bronze": 1.5})
    try:
        await queue(store, "gold", 20, queued_at=T0)
        await queue(store, "gone", 20, queued_at=T0 + 1)  # taken out of the config while its lines wait
        got = await store.claim(MODEL, "r1", 9)
        assert (who(got).count("gold"), who(got).count("gone")) == (6, 3)  # 3 : 1.5
    finally:
        await store.close()
    with pytest.raises(ValueError, match="positive and finite"):
        open_store(server, weights={"bad": float("inf")})


async def test_a_dead_routers_lines_are_taken_over_across_tenant_streams(server: EmbeddedRedis) -> None:
    app = f"t{uuid.uuid4().hex[:12]}"
    patient = open_store(server, app, claim_idle_s=60.0)
    eager = open_store(server, app, claim_idle_s=0.0)  # the same queues, the idle time passed at once
    try:
        await queue(patient, "a", 2)
        await queue(patient, "b", 2)
        held = await patient.claim(MODEL, "dead-router", 4)  # its router dies holding them
        assert sorted(who(held)) == ["a", "a", "b", "b"]
        assert await patient.claim(MODEL, "r2", 4) == []  # idle < 60 s: still the dead router's
        await queue(patient, "c", 1)
        taken = await eager.claim(MODEL, "r2", 10)  # the dead router's lines first, then new ones
        assert {(d.entry_id, d.consumer) for d in taken[:4]} == {(d.entry_id, "r2") for d in held}
        assert [d.line.custom_id for d in taken[4:]] == ["c-1"]
        await ack_all(eager, taken)
        assert await eager.queue_depth(MODEL) == 0 and await indexed(eager) == set()
    finally:
        await patient.close()
        await eager.close()


async def test_an_entry_id_names_its_tenants_stream(store: BatchStore) -> None:
    # Two tenants' streams can hold the same stream id (both written in the same millisecond);
    # the id a Delivery carries (<tenant>/<stream id>) says whose it is, so acknowledging one
    # line never touches the other's, and a dispatcher never takes one for the other.
    body = json.dumps({"model": MODEL, "messages": []})
    for tenant in ("a", "b"):
        await store._queue.ensure_group(MODEL, tenant)
        line = QueuedLine("batch_x", 1, f"{tenant}-1", MODEL, tenant, body, queued_at=T0)
        await store._r.xadd(store.keys.queue(MODEL, tenant), dict(line.fields()), id="1-1")
        await store._r.sadd(store.keys.queue_tenants(MODEL), tenant)
    got = await store.claim(MODEL, "r1", 4)
    assert sorted(d.entry_id for d in got) == ["a/1-1", "b/1-1"]
    assert await store.ack(MODEL, "a/1-1") and not await store.ack(MODEL, "a/1-1")
    assert await store._r.xlen(store.keys.queue(MODEL, "b")) == 1 and await indexed(store) == {"b"}
    with pytest.raises(ValueError, match="not a queue entry id"):
        await store.ack(MODEL, "1-1")


async def test_depth_and_age_cover_every_tenants_stream(store: BatchStore) -> None:
    assert (await store.queue_depth(MODEL), await store.oldest_age_s(MODEL, T0)) == (0, 0.0)
    await queue(store, "a", 3, queued_at=T0)
    await queue(store, "b", 2, queued_at=T0 - 10)  # queued later, but its lines waited longer
    assert await store.queue_depth(MODEL) == 5
    assert await store.oldest_age_s(MODEL, T0 + 5) == 15.0
    got = await store.claim(MODEL, "r1", 5)
    await ack_all(store, [d for d in got if d.line.tenant == "b"])
    assert (await store.queue_depth(MODEL), await store.oldest_age_s(MODEL, T0 + 5)) == (3, 5.0)


async def test_a_dead_letter_retried_goes_back_on_its_tenants_stream(store: BatchStore) -> None:
    await queue(store, "a", 3, queued_at=T0)
    await queue(store, "b", 1, queued_at=T0 + 1)
    got = await store.claim(MODEL, "r1", 2)
    (b_line,) = [d for d in got if d.line.tenant == "b"]
    dead = await store.dead_letter(b_line, "engine lost", T0)
    assert dead is not None and await indexed(store) == {"a"}  # b's stream is empty
    new = await store.dlq_retry(dead.id)
    assert new is not None and new.startswith("b/") and await indexed(store) == {"a", "b"}
    (back,) = [d for d in await store.claim(MODEL, "r1", 2) if d.line.tenant == "b"]
    assert (back.entry_id, back.line.custom_id, back.line.attempts) == (new, "b-1", 0)
    requeued = await store.requeue(back, attempts=1, not_before=T0 + 5)
    assert requeued is not None and requeued.startswith("b/")
    assert await store._r.xlen(store.keys.queue(MODEL, "b")) == 1 and await store.queue_depth(MODEL) == 4


async def test_a_cancelled_batchs_lines_dropped_leave_the_other_tenant_running(store: BatchStore) -> None:
    gone = await queue(store, "a", 3)
    await queue(store, "b", 3)
    assert await store.cancel(gone.id, T0)
    got = await store.claim(MODEL, "r1", 6)
    for d in got:  # what a dispatcher does: a cancelled batch's line acknowledged, not run
        if d.line.batch_id == gone.id:
            assert await store.ack(MODEL, d.entry_id)
    assert await indexed(store) == {"b"} and await store.queue_depth(MODEL) == 3
    assert await store._r.get(store.keys.queued("a")) == b"0"


async def test_a_stream_that_lost_its_group_is_made_again_on_a_claim(store: BatchStore) -> None:
    await queue(store, "a", 1)
    await store._r.delete(store.keys.queue(MODEL, "a"))  # the server lost the stream, its group with it
    await queue(store, "a", 1)  # the group is known to this store: the XADD makes a stream without one
    (d,) = await store.claim(MODEL, "r1", 4)
    assert d.line.custom_id == "a-1" and await store.ack(MODEL, d.entry_id)
