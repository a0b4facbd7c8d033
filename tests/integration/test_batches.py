"""OpenAI's Batch API through the official ``openai`` client, on the session's stack and its
embedded store (conftest.py): a round trip of good and bad lines, a cancel midway, tenant
separation, a line dead-lettered under injected engine failures and re-driven, and kills
mid-batch: the controller, the model's replica, a router and the store. Every batch is a
few lines with a small max_tokens.

A kill is made while the batch's lines are in flight, and the test reads the store itself
(redis-py, as an operator would: the model's queue streams, one per tenant, and their consumer
groups' pending entries) to show it: lines answered, others claimed by a router and not acknowledged. Each
kill prints one line saying what it did to its batch.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from typing import Any

import openai
import pytest
import ray
from conftest import ADMIN, BASE, clear_chaos, heal, model_status, set_chaos, status, wait_quiet, wait_until

from ballast.batch.store_layout import Keys, entries, entry_ref, text
from ballast.batch.store_queue import GROUP
from ballast.control.link import lookup_controller

pytestmark = pytest.mark.integration

ENDPOINT = "/v1/chat/completions"
MODEL = "tiny-decoder"  # cluster/local.yaml's model


def oai(key: str = "dev-key-gold") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=2, timeout=60)


def line(custom_id: str, content: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": ENDPOINT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **body},
    }


def upload(c: openai.OpenAI, lines: list[Any]) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return c.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def wait_status(c: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 90) -> Any:
    def reached() -> Any:
        try:
            b = c.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):  # a router or the store restarting
            return None
        return b if b.status in statuses else None

    return wait_until(reached, timeout_s, 0.5, f"batch {batch_id} in {statuses}")


def results(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_good_and_bad_lines_round_trip_each_exactly_once(ballast) -> None:
    c = oai()
    lines = [
        line("ok-1", "batch round trip one"),
        line("bad-max-tokens", "too long an answer", max_tokens=10**9),  # past limits.max_tokens_limit
        line("ok-2", "batch round trip two"),
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}},
        line("bad-model", "no such model", model="no-such-model"),
        line("ok-3", "batch round trip three"),
    ]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint=ENDPOINT, completion_window="24h")
    assert batch.status == "in_progress" and batch.request_counts.total == 6
    done = wait_status(c, batch.id, {"completed"})
    out, err = results(c, done.output_file_id), results(c, done.error_file_id)
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 3), err
    assert [x["custom_id"] for x in out] == ["ok-1", "ok-2", "ok-3"]  # input-line order
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"] for x in out)
    assert [x["custom_id"] for x in err] == ["bad-max-tokens", "bad-url", "bad-model"]
    codes = {x["custom_id"]: x["error"]["code"] for x in err}
    assert codes == {"bad-max-tokens": "INVALID_REQUEST", "bad-url": "invalid_url", "bad-model": "model_not_found"}
    assert all(x["response"]["status_code"] in (400, 404) for x in err)
    # usage: the sum over the output file's answers, each line once; error lines count nothing
    answered = [x["response"]["body"]["usage"] for x in out]
    usage = done.usage
    assert usage is not None and usage.output_tokens > 0
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        sum(u["prompt_tokens"] for u in answered),
        sum(u["completion_tokens"] for u in answered),
        sum(u["total_tokens"] for u in answered),
    )
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in answered)
    assert usage.input_tokens_details.cached_tokens == cached
    listed = {b.id: b for b in c.batches.list(limit=100).data}
    assert listed[batch.id].usage == usage
    with pytest.raises(openai.ConflictError):  # a completed batch: nothing to cancel
        c.batches.cancel(batch.id)


def test_a_bad_file_fails_the_batch_with_errors_data(ballast) -> None:
    c = oai()
    file_id = upload(c, [line("dup", "one"), line("dup", "two"), "not json"])
    batch = c.batches.create(input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2), ("invalid_json_line", 3)]


def test_another_tenant_gets_404_and_the_admin_lists_every_tenant(ballast, client) -> None:
    gold, free = oai("dev-key-gold"), oai("dev-key-free")
    file_id = upload(gold, [line("t-1", "tenant separation")])
    batch = gold.batches.create(input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h")
    for call in (
        lambda: free.files.retrieve(file_id),
        lambda: free.files.content(file_id),
        lambda: free.files.delete(file_id),
        lambda: free.batches.retrieve(batch.id),
        lambda: free.batches.cancel(batch.id),
        lambda: free.batches.create(input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in free.files.list().data]
    assert batch.id not in [b.id for b in free.batches.list().data]
    listed = client.get("/admin/batches", headers=ADMIN, params={"limit": 100}).json()["data"]
    assert {"id": batch.id, "tenant": "gold"}.items() <= {**next(b for b in listed if b["id"] == batch.id)}.items()
    assert wait_status(gold, batch.id, {"completed"}).request_counts.completed == 1


def test_a_batch_cancelled_midway_keeps_what_was_answered(ballast, client) -> None:
    c = oai()
    set_chaos(client, "primary", step_delay_ms=30)  # a slow device: the model answers 4 rows at a time
    try:
        lines = [line(f"c-{i}", f"cancel midway {i}", max_tokens=48) for i in range(24)]
        batch = c.batches.create(input_file_id=upload(c, lines), endpoint=ENDPOINT, completion_window="24h")
        wait_until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 1, 60, 0.2, "a first answer")
        assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = wait_status(c, batch.id, {"cancelled"})
    finally:
        clear_chaos(client)
    out = results(c, done.output_file_id)
    assert 1 <= len(out) < 24 and done.request_counts.completed == len(out)
    assert len({x["custom_id"] for x in out}) == len(out) and not results(c, done.error_file_id)
    assert c.batches.cancel(batch.id).status == "cancelled"  # asked again: the batch as it is


def test_a_line_dead_lettered_under_engine_failures_is_redriven(ballast, client) -> None:
    c = oai()
    wait_quiet(client)
    set_chaos(client, "primary", error_ratio=1.0)
    set_chaos(client, "fallback", error_ratio=1.0)
    try:
        batch = c.batches.create(
            input_file_id=upload(c, [line("dlq-1", f"dead letter {time.time()}")]),
            endpoint=ENDPOINT,
            completion_window="24h",
        )

        def dead() -> list[dict[str, Any]]:
            r = client.get("/admin/dlq", headers=ADMIN)
            return [d for d in r.json()["data"] if d["batch_id"] == batch.id]

        (entry,) = wait_until(dead, 60, 0.5, "the line on the dead-letter queue")
        assert entry["attempts"] == 2 and entry["custom_id"] == "dlq-1" and entry["tenant"] == "gold"
        assert entry["last_error"].split(":")[0] in ("MODEL_UNAVAILABLE", "REPLICA_LOST", "INTERNAL")
        assert c.batches.retrieve(batch.id).status == "in_progress"  # the batch waits for it
    finally:
        clear_chaos(client)
    heal(client)
    assert (
        client.post(f"/admin/dlq/{entry['id']}/retry", headers={"Authorization": "Bearer dev-key-gold"}).status_code
        == 403
    )
    r = client.post(f"/admin/dlq/{entry['id']}/retry", headers={**ADMIN, "X-Ballast-Operator": "ops"})
    assert r.status_code == 200, r.text
    assert client.post(f"/admin/dlq/{entry['id']}/retry", headers=ADMIN).status_code == 404  # once
    done = wait_status(c, batch.id, {"completed"})
    assert [x["custom_id"] for x in results(c, done.output_file_id)] == ["dlq-1"]
    audit = client.get("/admin/kill-switch", headers=ADMIN).json()["audit"]
    assert any(e["action"] == "dlq_retry" and e["operator_claimed"] == "ops" for e in audit)


# A kill lands while lines run: on the slowed device a round of the replica's 4 rows takes
# 8 steps of 100 ms, so a batch of 12 lines runs for 3 rounds (2.4 s and more).
KILL_LINES = 12
KILL_MAX_TOKENS = 8
KILL_STEP_DELAY_MS = 100


class QueueView:
    """The model's queue on the store, read straight from it: which of a batch's lines are on
    the queue, which a router has claimed and not acknowledged (the consumer group's pending
    entries: consumer, times delivered), how many are answered. A connection per read: the
    store restarts under the test."""

    def __init__(self, store: Any, cfg: Any) -> None:
        self._store = store
        self._keys = Keys(f"{cfg.batch.key_prefix}:{cfg.app_name}")

    def queued(self, batch_id: str) -> dict[str, str]:
        """entry id (<tenant>/<stream id>) -> custom_id, the batch's lines on the queue (claimed or not)."""
        with self._store.client() as r:
            return self._queued(r, batch_id)

    def _tenants(self, r: Any) -> list[str]:
        return sorted(text(t) for t in r.smembers(self._keys.queue_tenants(MODEL)))

    def _queued(self, r: Any, batch_id: str) -> dict[str, str]:
        return {
            entry_ref(tenant, eid): f["custom_id"]
            for tenant in self._tenants(r)
            for eid, f in entries(r.xrange(self._keys.queue(MODEL, tenant)))
            if f["batch"] == batch_id
        }

    def claimed(self, batch_id: str) -> dict[str, tuple[str, int]]:
        """entry id -> (consumer, times delivered), the batch's lines a router holds unacknowledged."""
        with self._store.client() as r:
            queued = self._queued(r, batch_id)
            pending = {
                entry_ref(tenant, text(p["message_id"])): p
                for tenant in (self._tenants(r) if queued else [])
                for p in r.xpending_range(self._keys.queue(MODEL, tenant), GROUP, "-", "+", 1000)
            }
        return {eid: (text(p["consumer"]), int(p["times_delivered"])) for eid, p in pending.items() if eid in queued}

    def answered(self, batch_id: str) -> int:
        with self._store.client() as r:
            return int(r.hlen(self._keys.answers(batch_id, "output")) + r.hlen(self._keys.answers(batch_id, "error")))


def started_mid_batch(c: openai.OpenAI, view: QueueView, tag: str) -> tuple[Any, dict[str, tuple[str, int]]]:
    """A batch of ``KILL_LINES`` lines, returned once some are answered and a router holds
    others claimed (the moment for a kill); with those claimed lines."""
    lines = [line(f"{tag}-{i}", f"{tag} killed mid batch {i}", max_tokens=KILL_MAX_TOKENS) for i in range(KILL_LINES)]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint=ENDPOINT, completion_window="24h")

    def mid() -> dict[str, tuple[str, int]]:
        claimed = view.claimed(batch.id)
        return claimed if claimed and view.answered(batch.id) >= 1 else {}

    return batch, wait_until(mid, 60, 0.1, f"batch {batch.id} answered in part, its other lines claimed")


def assert_each_line_once(c: openai.OpenAI, done: Any, tag: str) -> None:
    """Every input line in the output file once, in input order, and none in the error file."""
    out = results(c, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"{tag}-{i}" for i in range(KILL_LINES)], out
    assert all(x["response"]["status_code"] == 200 for x in out) and not results(c, done.error_file_id)
    assert (done.request_counts.completed, done.request_counts.failed) == (KILL_LINES, 0)


def serve_replica(deployment: str) -> Any:
    """The one replica actor of ``deployment`` (Serve names it ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA") and f"#{deployment}#" in a["name"]
    ]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def dispatched(client: Any) -> dict[str, int]:
    """What became of the model's batch lines at the router, by outcome (its dispatcher's count)."""
    return dict(status(client)["batch"]["models"][MODEL]["lines"])


def test_the_controller_killed_mid_batch_loses_no_line_and_repeats_none(ballast, batch_store, client) -> None:
    c, view = oai(), QueueView(batch_store, ballast)
    controller = lookup_controller(ballast)
    epoch = status(client)["snapshot"]["epoch"]
    retried = dispatched(client).get("retried", 0)
    set_chaos(client, "primary", step_delay_ms=KILL_STEP_DELAY_MS)
    try:
        batch, claimed = started_mid_batch(c, view, "ctl")
        ray.kill(controller, no_restart=False)  # Ray restarts it (max_restarts=-1)
        killed_at = time.monotonic()
        done = wait_status(c, batch.id, {"completed"})
        completed_s = time.monotonic() - killed_at
        # The routers kept their last snapshot meanwhile; the restarted controller's comes next.
        wait_until(lambda: status(client)["snapshot"]["epoch"] != epoch, 30, 0.5, "the restarted controller's snapshot")
        back_s = time.monotonic() - killed_at
    finally:
        clear_chaos(client)
    assert_each_line_once(c, done, "ctl")
    retried = dispatched(client).get("retried", 0) - retried
    print(
        f"\ncontroller killed mid-batch: {len(claimed)} of {KILL_LINES} lines claimed at the kill, {retried} retried; "
        f"the batch completed {completed_s:.1f} s after the kill (a restarted controller's snapshot by {back_s:.1f} s)"
    )


def test_a_model_replica_killed_mid_batch_loses_no_line_and_repeats_none(ballast, batch_store, client) -> None:
    c, view = oai(), QueueView(batch_store, ballast)
    wait_quiet(client)  # one primary replica: the one killed
    replica = serve_replica("BallastModel")
    lost, retried = model_status(client)["lost_capacity"], dispatched(client).get("retried", 0)
    set_chaos(client, "primary", step_delay_ms=KILL_STEP_DELAY_MS)
    try:
        batch, claimed = started_mid_batch(c, view, "rep")
        ray.kill(replica, no_restart=True)  # Serve starts another in its place
        killed_at = time.monotonic()
        done = wait_status(c, batch.id, {"completed"})
        completed_s = time.monotonic() - killed_at
    finally:
        clear_chaos(client)
    assert_each_line_once(c, done, "rep")
    after = model_status(client)["lost_capacity"]
    migrated, not_migrated = (after[k] - lost[k] for k in ("migrated", "not_migrated"))
    assert migrated + not_migrated >= 1, (lost, after)  # the kill cut rows in flight
    retried = dispatched(client).get("retried", 0) - retried
    by_model = Counter(x["response"]["body"]["model"] for x in results(c, done.output_file_id))
    assert set(by_model) == {MODEL}, by_model  # each line by the model it names: never the fallback
    print(
        f"\nmodel replica killed mid-batch: {len(claimed)} of {KILL_LINES} lines claimed at the kill; "
        f"{migrated + not_migrated} rows cut, {migrated} sent again to the model, {not_migrated} past the retry "
        f"budget (back to the queue, deferred); {retried} lines retried; answered by {dict(by_model)}; "
        f"the batch completed {completed_s:.1f} s after the kill"
    )


@pytest.mark.last
def test_a_router_and_the_store_killed_mid_batch_lose_no_line_and_repeat_none(ballast, batch_store, client) -> None:
    c, view = oai(), QueueView(batch_store, ballast)
    router = serve_replica("BallastRouter")
    set_chaos(client, "primary", step_delay_ms=KILL_STEP_DELAY_MS)
    try:
        batch, _ = started_mid_batch(c, view, "rtr")
        ray.kill(router, no_restart=False)
        killed_at = time.monotonic()
        held = view.claimed(batch.id)  # read after the kill: the dead router acknowledges none of them
        assert held, "the router died holding no line"
        (dead,) = {consumer for consumer, _ in held.values()}
        # The store too, while those lines wait on it; back on its data (append-only file), on its port.
        queued = view.queued(batch.id)
        batch_store.stop()
        batch_store.start()
        assert view.queued(batch.id) == queued, "the store lost queued lines"
        assert {e: who for e, (who, _) in view.claimed(batch.id).items()} == {e: who for e, (who, _) in held.items()}
        # After claim_idle_s another router takes the dead one's lines (XAUTOCLAIM): each is seen
        # pending at a new consumer, delivered again, until it is answered and acknowledged.
        taken: dict[str, tuple[str, int]] = {}

        def taken_over() -> bool:
            taken.update((e, who) for e, who in view.claimed(batch.id).items() if e in held and who[0] != dead)
            return held.keys() <= taken.keys()

        wait_until(taken_over, ballast.batch.claim_idle_s + 60, 0.1, "the dead router's lines taken over")
        taken_s = time.monotonic() - killed_at
        done = wait_status(c, batch.id, {"completed"})
        completed_s = time.monotonic() - killed_at
    finally:
        clear_chaos(client)
    assert all(times > held[e][1] for e, (_, times) in taken.items()), (held, taken)
    assert_each_line_once(c, done, "rtr")
    lines = dispatched(client)  # the new router's count: the dead one's went with it
    print(
        f"\nrouter killed mid-batch: {len(held)} of {KILL_LINES} lines claimed by it at the kill and {len(queued)} on "
        f"the queue when the store was restarted; {len(taken)} taken over by "
        f"{', '.join(sorted({who for who, _ in taken.values()}))} {taken_s:.1f} s after the kill "
        f"(claim_idle_s {ballast.batch.claim_idle_s:g}), {lines.get('retried', 0)} retried; "
        f"the batch completed {completed_s:.1f} s after the kill"
    )
