"""OpenAI's Batch API through the official ``openai`` client, on the session's stack and its
embedded store (conftest.py): a round trip of good and bad lines, a cancel midway, tenant
separation, a line dead-lettered under injected engine failures and re-driven, and a router
and the store killed mid-batch. Every batch is a few lines with a small max_tokens.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import openai
import pytest
import ray
from conftest import ADMIN, BASE, clear_chaos, heal, set_chaos, wait_quiet, wait_until

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
    assert batch.id in [b.id for b in c.batches.list(limit=100).data]
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


def router_replica() -> Any:
    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA") and "BallastRouter" in a["name"]
    ]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


@pytest.mark.last
def test_a_router_and_the_store_killed_mid_batch_lose_no_line_and_repeat_none(ballast, batch_store) -> None:
    c = oai()
    n = 12
    lines = [line(f"k-{i}", f"killed mid batch {i}", max_tokens=32) for i in range(n)]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint=ENDPOINT, completion_window="24h")
    wait_until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 2, 60, 0.2, "answers before the kill")
    ray.kill(router_replica(), no_restart=False)  # its claimed lines are taken again after claim_idle_s
    batch_store.stop()  # the store too, then back on its data (append-only file), on its port
    batch_store.start()
    done = wait_status(c, batch.id, {"completed"}, timeout_s=150)
    out = results(c, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"k-{i}" for i in range(n))  # every line once
    assert [x["custom_id"] for x in out] == [f"k-{i}" for i in range(n)] and not results(c, done.error_file_id)
