"""OpenAI's Batch API on the local cluster, through the official ``openai`` client: a worker
node killed while a batch's lines run loses no line and writes none twice.

The batch store is the one cluster/cluster.yaml starts on the head (cluster/batch_store.sh,
run by the head's start commands in its namespace); every router reaches it at the head's
address. The test reads it as an operator would (redis-py: the model's queue and its
consumer group's pending entries) to fire the kill while each router holds lines claimed
and not acknowledged, then follows the dead router's lines: another router takes them
over after ``batch.claim_idle_s`` (XAUTOCLAIM) and runs them, while the lines that were
running on the lost node's model replica are sent again or put back by their router. The
kill prints one line saying what it did and adds a row to the cluster's fault report.
Only with ``make test-cluster`` (it runs for the production config's claim_idle_s, 150 s).
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from typing import Any

import openai
import redis
import yaml
from clusterkit import REPORT, Cluster, full_suite, steady, wait_until, worker_without_controller

from ballast.batch.store_layout import Keys, entries, text
from ballast.batch.store_queue import GROUP
from ballast.config import load_config
from ballast.ops.status_text import model_view, sole_model
from loadtest import netcluster

ENDPOINT = "/v1/chat/completions"
MODEL = "tiny-decoder"  # netcluster.serve_config's model
LINES = 160
MAX_TOKENS = 64
HELD_AT_KILL = 3  # lines each router holds claimed when the worker is killed, at least


def deployed() -> Any:
    """The config the local cluster runs (netcluster wrote it for `serve deploy`)."""
    spec = yaml.safe_load((netcluster.STATE / "serve_config.yaml").read_text())
    return load_config(spec["applications"][0]["args"]["config"])


class QueueView:
    """The model's queue on the cluster's store, read straight from it: the batch's lines a
    router has claimed and not acknowledged (the consumer group's pending entries: consumer,
    times delivered), and how many are answered."""

    def __init__(self, cluster: Cluster) -> None:
        cfg = deployed()
        self._r = redis.Redis.from_url(
            cluster.state["store_url"], password=netcluster.STORE_PASSWORD.read_text().strip(), socket_timeout=10
        )
        self._keys = Keys(f"{cfg.batch.key_prefix}:{cfg.app_name}")

    def claimed(self, batch_id: str) -> dict[str, tuple[str, int]]:
        """entry id -> (consumer, times delivered), the batch's lines a router holds unacknowledged
        (on each tenant's queue of the model: one stream per model and tenant)."""
        out: dict[str, tuple[str, int]] = {}
        for tenant in sorted(text(t) for t in self._r.smembers(self._keys.queue_tenants(MODEL))):
            queue = self._keys.queue(MODEL, tenant)
            queued = {eid for eid, f in entries(self._r.xrange(queue)) if f["batch"] == batch_id}
            pending = self._r.xpending_range(queue, GROUP, "-", "+", 1000) if queued else []
            out.update(
                (f"{tenant}/{text(p['message_id'])}", (text(p["consumer"]), int(p["times_delivered"])))
                for p in pending
                if text(p["message_id"]) in queued
            )
        return out

    def answered(self, batch_id: str) -> int:
        return int(
            self._r.hlen(self._keys.answers(batch_id, "output")) + self._r.hlen(self._keys.answers(batch_id, "error"))
        )

    def close(self) -> None:
        self._r.close()


def by_consumer(claimed: dict[str, tuple[str, int]]) -> Counter[str]:
    return Counter(consumer for consumer, _ in claimed.values())


def line(i: int) -> dict[str, Any]:
    return {
        "custom_id": f"w-{i}",
        "method": "POST",
        "url": ENDPOINT,
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"a worker killed mid batch, line {i}"}],
            "max_tokens": MAX_TOKENS,
        },
    }


def results(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def router_status(cluster: Cluster, endpoint: str) -> dict[str, Any]:
    r = cluster.admin_call("GET", "/v1/status", endpoint)
    r.raise_for_status()
    return dict(r.json())


@full_suite
def test_a_worker_killed_mid_batch_loses_no_line_and_writes_none_twice(cluster):
    steady(cluster)
    victim = worker_without_controller(cluster)
    survivor = next(w for w in cluster.workers if w != victim)
    c = openai.OpenAI(base_url=f"{survivor.endpoint}/v1", api_key=cluster.gold, max_retries=2, timeout=60)
    view = QueueView(cluster)
    try:
        body = "".join(json.dumps(line(i)) + "\n" for i in range(LINES)).encode()
        file_id = c.files.create(file=("in.jsonl", io.BytesIO(body)), purpose="batch").id
        batch = c.batches.create(input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h")

        def mid() -> dict[str, tuple[str, int]]:
            """Some lines answered, and each router (one a worker) holds others claimed."""
            claimed = view.claimed(batch.id)
            held = by_consumer(claimed)
            both = len(held) == len(cluster.workers) and min(held.values()) >= HELD_AT_KILL
            return claimed if both and view.answered(batch.id) >= 1 else {}

        before = wait_until(mid, 120, 0.1, f"batch {batch.id} answered in part, each router holding lines")
        cluster.broken = True
        killed = netcluster.kill_node(victim)
        killed_at = time.monotonic()
        held = view.claimed(batch.id)  # read after the kill: the dead router acknowledges none of them
        answered_at_kill = view.answered(batch.id)
        # The router left is the survivor's (the victim's died with it); the other consumer is the
        # dead one. (Until the survivor's HAProxy marks the dead router down, it may answer 502.)
        alive = wait_until(lambda: router_status(cluster, survivor.endpoint)["router_id"], 30, 1, "the router left")
        dead = {consumer for consumer, _ in held.values()} - {alive}
        assert len(dead) == 1 and alive in by_consumer(before), (alive, by_consumer(before), by_consumer(held))
        (dead_router,) = dead
        lost = {e: times for e, (consumer, times) in held.items() if consumer == dead_router}
        assert lost, f"the killed worker's router held no line at the kill: {by_consumer(held)}"

        # After claim_idle_s the router left takes the dead one's lines (XAUTOCLAIM), runs and
        # acknowledges them: none stays pending at the dead router.
        def taken_over() -> bool:
            return not any(view.claimed(batch.id).get(e, ("", 0))[0] == dead_router for e in lost)

        claim_idle_s = deployed().batch.claim_idle_s
        wait_until(taken_over, claim_idle_s + 90, 1, "the dead router's lines taken over")
        taken_s = time.monotonic() - killed_at

        def finished() -> Any:
            try:
                b = c.batches.retrieve(batch.id)
            except (openai.APIConnectionError, openai.InternalServerError):
                return None
            return b if b.status in ("completed", "failed", "expired", "cancelled") else None

        done = wait_until(finished, 180, 1, f"batch {batch.id} finished")
        completed_s = time.monotonic() - killed_at
    finally:
        view.close()
    assert done.status == "completed", done
    out, err = results(c, done.output_file_id), results(c, done.error_file_id)
    # Every input line once in one of the two files: all answered, in input-line order, none twice.
    assert [x["custom_id"] for x in out] == [f"w-{i}" for i in range(LINES)], Counter(x["custom_id"] for x in out)
    assert err == [], err[:3]
    assert (done.request_counts.completed, done.request_counts.failed, done.request_counts.total) == (LINES, 0, LINES)
    assert all(x["response"]["status_code"] == 200 for x in out)
    by_model = Counter(x["response"]["body"]["model"] for x in out)
    assert set(by_model) == {MODEL}, by_model  # each line by the model it names: never a fallback
    st = router_status(cluster, survivor.endpoint)
    cut = model_view(st, sole_model(st))["lost_capacity"]
    lines = st["batch"]["models"][MODEL]["lines"]
    notes = (
        f"{killed} processes of {victim.name} killed; {LINES} lines of {MAX_TOKENS} tokens, {answered_at_kill} "
        f"answered at the kill, {len(held)} claimed ({len(lost)} by the lost router); those taken over "
        f"{taken_s:.0f} s after the kill (claim_idle_s {claim_idle_s:g}); the batch completed {completed_s:.0f} s "
        f"after it, each line once; the router left: rows cut {cut}, its lines {dict(lines)}"
    )
    print(f"\nworker killed mid-batch: {notes}")
    REPORT.append(
        {
            "fault": "worker killed mid-batch",
            "requests": LINES,
            "keyed_failures": {},
            "other_failures": {},
            "per_10s": "-",
            "failures_stop_s": None,
            "recover_s": round(completed_s, 1),
            "max_level": "-",
            "notes": notes,
        }
    )
