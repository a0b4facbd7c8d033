"""The Responses API's stored responses in ``BatchStore`` (``store_responses``), against a real
redis-server (no mock, no fake): each redis-server that is here in turn (Redis 6.2 and 7), each
test under a key prefix of its own.

Expiry runs on the server's clock, as Redis expires keys: the tests that need a record expired
store it with a 1 ms ``ttl_s`` and wait until Redis itself no longer has it (a few
milliseconds; no test asserts that a short-lived record is still there, so none depends on
how fast the machine is). After every change the tests check the tenant's counters against
the records Redis still holds (``held``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import batchkit
import pytest

from ballast.batch.embedded import EmbeddedRedis
from ballast.batch.store import BatchStore, connect
from ballast.batch.store_responses import RESPONSE_ID, new_response_id
from ballast.config import BallastConfig, BatchConfig, ResponsesConfig, load_config
from ballast.errors import InvalidRequest, PayloadTooLarge, StoreUnavailable

T0 = 1_800_000_000
DAY_S = 86400.0
EXPIRY_WAIT_S = 5.0  # the longest a test waits for Redis to drop a 1 ms record: a failure, not a pause


@pytest.fixture(scope="session", params=sorted(batchkit.binaries()))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("run"), binary=batchkit.binaries()[request.param]) as s:
        yield s


def open_store(server: EmbeddedRedis, app: str | None = None, **responses: Any) -> BatchStore:
    cfg = BatchConfig(store_url=server.url, store_password_file=str(server.password_file))
    return connect(cfg, app or f"t{uuid.uuid4().hex[:12]}", environ={}, responses=ResponsesConfig(**responses))


@pytest.fixture
async def store(server: EmbeddedRedis) -> AsyncIterator[BatchStore]:
    s = open_store(server)
    yield s
    await s.close()


def record(n: int, size: int = 40) -> bytes:
    """A response's JSON of exactly ``size`` bytes, told apart by ``n``."""
    head = f'{{"id":"resp_{n}","x":"'.encode()
    return head + b"a" * (size - len(head) - 2) + b'"}'


async def held(store: BatchStore, tenant: str) -> tuple[int, int]:
    """(records, bytes) the tenant's counters say, checked against the records Redis holds."""
    k = store.keys
    ids = [i.decode() for i in await store._r.zrange(k.responses(tenant), 0, -1)]
    sizes = {f.decode(): int(v) for f, v in (await store._r.hgetall(k.response_sizes(tenant))).items()}
    total = int(await store._r.get(k.response_bytes(tenant)) or 0)
    assert set(sizes) == set(ids)
    assert total == sum(sizes.values())
    for i in ids:
        assert await store._r.hstrlen(k.response(tenant, i), "record") == sizes[i]
    return len(ids), total


async def server_ms(store: BatchStore) -> int:
    seconds, micros = await store._r.time()
    return seconds * 1000 + micros // 1000


async def expired(store: BatchStore, tenant: str, response_id: str) -> None:
    """Returns once Redis has dropped the record (its own clock past its expiry)."""
    deadline = time.monotonic() + EXPIRY_WAIT_S
    while await store._r.exists(store.keys.response(tenant, response_id)):
        assert time.monotonic() < deadline, "Redis kept a record past its expiry"
        await asyncio.sleep(0.001)


# -- put, get, delete ----------------------------------------------------------------------
async def test_a_response_round_trips_and_its_deletion_leaves_nothing(store: BatchStore) -> None:
    rid = new_response_id()
    assert RESPONSE_ID.match(rid) and rid.startswith("resp_")
    assert await store.put_response("acme", rid, '{"id": "x", "output": []}', created_at=T0 + 0.7, depth=3) == 0
    got = await store.get_response("acme", rid)
    assert got is not None
    assert (got.id, got.tenant, got.record, got.created_at, got.depth) == (
        rid,
        "acme",
        b'{"id": "x", "output": []}',
        T0,
        3,
    )
    assert await held(store, "acme") == (1, 25)
    assert await store.delete_response("acme", rid) is True
    assert await store.get_response("acme", rid) is None
    assert await store.delete_response("acme", rid) is False
    assert await store._r.keys(f"{store.keys.prefix}:*") == []  # no index, no counter left behind


async def test_a_put_of_the_same_id_replaces_it_counted_once(store: BatchStore) -> None:
    await store.put_response("acme", "resp_a", record(1, 40), T0, 1)
    await store.put_response("acme", "resp_a", record(2, 60), T0 + 1, 2)
    got = await store.get_response("acme", "resp_a")
    assert got is not None and (got.record, got.created_at, got.depth) == (record(2, 60), T0 + 1, 2)
    assert await held(store, "acme") == (1, 60)


async def test_a_record_expires_after_ttl_s_and_its_index_with_the_last(server: EmbeddedRedis) -> None:
    store = open_store(server, ttl_s=3600.0)
    try:
        k = store.keys
        before_ms = await server_ms(store)
        await store.put_response("acme", "resp_a", record(1), T0, 1)
        indexes = [
            await store._r.pttl(i) for i in (k.responses("acme"), k.response_sizes("acme"), k.response_bytes("acme"))
        ]
        ttl_ms = await store._r.pttl(k.response("acme", "resp_a"))
        elapsed_ms = await server_ms(store) - before_ms
        # ttl_s from the put, on the server's clock (the put was within the elapsed time)
        assert 3_600_000 - elapsed_ms - 1 <= ttl_ms <= 3_600_000
        assert all(ttl_ms <= index <= 3_600_000 for index in indexes)  # they go with the last record
    finally:
        await store.close()


async def test_expired_records_read_nothing_and_leave_the_counters_at_the_next_put(server: EmbeddedRedis) -> None:
    app = f"t{uuid.uuid4().hex[:12]}"
    lasting = open_store(server, app, max_stored=3)
    brief = open_store(server, app, max_stored=3, ttl_s=0.001)
    try:
        # One brief record at a time: a put forgets the records expired before it, so a second
        # brief put after the first expired (a millisecond's stall) would forget it early.
        await lasting.put_response("acme", "resp_keep", record(1), T0, 1)
        await brief.put_response("acme", "resp_x", record(2), T0 + 1, 1)
        await expired(lasting, "acme", "resp_x")
        assert await lasting.get_response("acme", "resp_x") is None
        # the counters still count it (Redis dropped the record on its own) ...
        assert await lasting._r.zcard(lasting.keys.responses("acme")) == 2
        # ... until a delete of it, which answers False (it was gone) and forgets it,
        assert await lasting.delete_response("acme", "resp_x") is False
        assert await lasting._r.zcard(lasting.keys.responses("acme")) == 1
        await brief.put_response("acme", "resp_y", record(3), T0 + 2, 1)
        await expired(lasting, "acme", "resp_y")
        assert await lasting.get_response("acme", "resp_y") is None
        assert await lasting._r.zcard(lasting.keys.responses("acme")) == 2
        # or the next put, which forgets it before it counts: nothing live is evicted
        assert await lasting.put_response("acme", "resp_new", record(4), T0 + 3, 1) == 0
        assert await held(lasting, "acme") == (2, 80)
        assert await lasting.get_response("acme", "resp_keep") is not None
    finally:
        await lasting.close()
        await brief.close()


# -- bounds --------------------------------------------------------------------------------
async def test_past_max_stored_the_oldest_go_first(server: EmbeddedRedis) -> None:
    store = open_store(server, max_stored=3)
    try:
        for n in range(1, 4):
            assert await store.put_response("acme", f"resp_{n}", record(n), T0 + n, 1) == 0
        assert await store.put_response("acme", "resp_4", record(4), T0 + 4, 1) == 1
        assert await store.get_response("acme", "resp_1") is None
        assert await held(store, "acme") == (3, 120)
        await store.get_response("acme", "resp_2")  # a read does not make it younger
        assert await store.put_response("acme", "resp_5", record(5), T0 + 5, 1) == 1
        alive = [n for n in range(1, 6) if await store.get_response("acme", f"resp_{n}") is not None]
        assert alive == [3, 4, 5]
        assert await held(store, "acme") == (3, 120)
    finally:
        await store.close()


async def test_past_max_stored_bytes_the_oldest_go_until_the_new_one_fits(server: EmbeddedRedis) -> None:
    store = open_store(server, max_stored_bytes=100)
    try:
        assert await store.put_response("acme", "resp_1", record(1, 40), T0, 1) == 0
        assert await store.put_response("acme", "resp_2", record(2, 40), T0, 1) == 0
        assert await store.put_response("acme", "resp_3", record(3, 40), T0, 1) == 1  # 120 > 100: resp_1 goes
        assert await held(store, "acme") == (2, 80)
        assert await store.put_response("acme", "resp_4", record(4, 100), T0, 1) == 2  # exactly the bound: alone
        assert await held(store, "acme") == (1, 100)
        assert await store.get_response("acme", "resp_4") is not None
    finally:
        await store.close()


async def test_a_record_larger_than_the_tenants_bytes_is_refused_and_nothing_changes(server: EmbeddedRedis) -> None:
    store = open_store(server, max_stored_bytes=100)
    try:
        await store.put_response("acme", "resp_1", record(1, 60), T0, 1)
        with pytest.raises(PayloadTooLarge) as e:
            await store.put_response("acme", "resp_big", record(2, 101), T0, 1)
        assert (e.value.status, e.value.code) == (413, "PAYLOAD_TOO_LARGE")
        assert "101 bytes" in str(e.value) and "responses.max_stored_bytes" in str(e.value)
        assert await store.get_response("acme", "resp_big") is None
        assert await store.get_response("acme", "resp_1") is not None
        assert await held(store, "acme") == (1, 60)
    finally:
        await store.close()


async def test_after_ttl_s_is_lowered_the_record_stored_is_never_the_one_evicted(server: EmbeddedRedis) -> None:
    app = f"t{uuid.uuid4().hex[:12]}"
    before = open_store(server, app, max_stored=2, ttl_s=3600.0)
    after = open_store(server, app, max_stored=2, ttl_s=60.0)  # the next deploy's config
    try:
        await before.put_response("acme", "resp_1", record(1), T0, 1)
        await before.put_response("acme", "resp_2", record(2), T0 + 1, 1)
        # resp_3 expires first of the three; the oldest other one goes instead
        assert await after.put_response("acme", "resp_3", record(3), T0 + 2, 1) == 1
        alive = [n for n in range(1, 4) if await after.get_response("acme", f"resp_{n}") is not None]
        assert alive == [2, 3]
        assert await held(after, "acme") == (2, 80)
    finally:
        await before.close()
        await after.close()


async def test_each_tenant_has_its_own_bounds(server: EmbeddedRedis) -> None:
    store = open_store(server, max_stored=2)
    try:
        for n in range(1, 3):
            await store.put_response("acme", f"resp_a{n}", record(n), T0, 1)
            await store.put_response("globex", f"resp_g{n}", record(n), T0, 1)
        assert await store.put_response("globex", "resp_g3", record(3), T0, 1) == 1  # only globex's oldest
        assert await held(store, "acme") == (2, 80) and await held(store, "globex") == (2, 80)
        assert await store.get_response("acme", "resp_a1") is not None
    finally:
        await store.close()


async def test_a_chain_deeper_than_max_chain_depth_is_refused(server: EmbeddedRedis) -> None:
    store = open_store(server, max_chain_depth=4)
    try:
        assert await store.put_response("acme", "resp_deep", record(1), T0, 4) == 0
        for depth in (0, 5):
            with pytest.raises(InvalidRequest) as e:
                await store.put_response("acme", "resp_x", record(1), T0, depth)
            assert (e.value.status, e.value.field) == (422, "previous_response_id")
        assert await store.get_response("acme", "resp_x") is None
    finally:
        await store.close()


# -- tenants and ids -----------------------------------------------------------------------
async def test_another_tenants_id_reads_and_deletes_nothing(store: BatchStore) -> None:
    await store.put_response("acme", "resp_1", record(1), T0, 1)
    assert await store.get_response("globex", "resp_1") is None  # as an id never stored
    assert await store.delete_response("globex", "resp_1") is False
    assert await store.get_response("acme", "resp_1") is not None
    await store.put_response("globex", "resp_1", record(2), T0, 1)  # the same id, globex's own
    mine, theirs = await store.get_response("acme", "resp_1"), await store.get_response("globex", "resp_1")
    assert mine is not None and theirs is not None and (mine.record, theirs.record) == (record(1), record(2))
    assert await held(store, "acme") == (1, 40) and await held(store, "globex") == (1, 40)


@pytest.mark.parametrize("bad", ["", "resp:1", "resp_1 ", "a" * 129, "résp", "*"])
async def test_an_id_the_store_never_makes_is_refused_on_put_and_unknown_on_read(store: BatchStore, bad: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        await store.put_response("acme", bad, record(1), T0, 1)
    assert e.value.field == "id"
    assert await store.get_response("acme", bad) is None
    assert await store.delete_response("acme", bad) is False
    assert await store._r.keys(f"{store.keys.prefix}:*") == []


# -- failures ------------------------------------------------------------------------------
async def test_a_store_that_does_not_answer_is_store_unavailable() -> None:
    cfg = BatchConfig(store_url="redis://127.0.0.1:1/0", store_timeout_s=0.5)  # nothing listens on port 1
    store = connect(cfg, "t", environ={})
    try:
        calls = (
            store.put_response("acme", "resp_1", record(1), T0, 1),
            store.get_response("acme", "resp_1"),
            store.delete_response("acme", "resp_1"),
        )
        for call in calls:
            with pytest.raises(StoreUnavailable) as e:
                await call
            assert (e.value.status, e.value.code) == (503, "STORE_UNAVAILABLE")
    finally:
        await store.close()


# -- config --------------------------------------------------------------------------------
def test_the_responses_section_defaults_and_bounds() -> None:
    cfg = BallastConfig().responses
    assert (cfg.store, cfg.max_stored, cfg.max_stored_bytes, cfg.ttl_s) == (True, 1000, 64 * 1024 * 1024, 30 * DAY_S)
    assert (cfg.max_chain_depth, cfg.max_input_items) == (64, 256)
    for key, value in (
        ("max_stored", 0),
        ("max_stored", 100_001),
        ("max_stored_bytes", 0),
        ("ttl_s", 0),
        ("ttl_s", 366 * DAY_S),
        ("max_chain_depth", 0),
        ("max_chain_depth", 1025),
        ("max_input_items", 0),
        ("unknown", 1),
    ):
        with pytest.raises(ValueError, match=f"responses.{key}"):
            load_config({"responses": {key: value}})
    assert load_config({"responses": {"store": False, "max_stored": 10}}).responses.max_stored == 10
