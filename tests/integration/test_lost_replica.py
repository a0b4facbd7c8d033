"""A model replica killed with a unary request and a stream in flight on it: both are answered.

The primary's only replica is slowed (chaos ``step_delay_ms``: each decode step waits,
as on a slow device) so that both requests are mid-way when its actor is killed. The
unary request is sent again and answered whole; the stream is carried on by the
replica Serve starts in its place, from the tokens it had delivered, and reads as the
uninterrupted stream would (the built-in model is greedy: the same prompt gives the
same text). The level stays 0: a lost replica is capacity that is gone, not a model error.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
import ray
from conftest import ADMIN, BASE, GOLD, clear_chaos, model_status, set_chaos, status, wait_quiet, wait_until

pytestmark = pytest.mark.integration

PROMPT = "a stream that outlives its replica"
MAX_TOKENS = 96  # 24 chunks of 4: about 2.4 s at 100 ms a step


def primary_replica() -> Any:
    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA") and "BallastModel" in a["name"] and "Fallback" not in a["name"]
    ]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def read_stream(events: list[tuple[str, dict]], arrivals: list[float], first: threading.Event) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    with httpx.Client(base_url=BASE, timeout=60) as c, c.stream("POST", "/v1/generate", headers=GOLD, json=body) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
                arrivals.append(time.monotonic())
                if name == "token" and sum(e[1].get("tokens", 0) for e in events) >= 12:
                    first.set()  # three chunks delivered: mid-way


def test_a_killed_replica_loses_neither_its_unary_request_nor_its_stream(client) -> None:
    wait_quiet(client)
    reference = client.post("/v1/generate", headers=GOLD, json={"prompt": PROMPT, "max_tokens": MAX_TOKENS}).json()
    assert reference["tokens_generated"] == MAX_TOKENS
    before = model_status(client)["lost_capacity"]
    replica = primary_replica()
    set_chaos(client, "primary", step_delay_ms=100)
    events: list[tuple[str, dict]] = []
    arrivals: list[float] = []
    unary: dict[str, httpx.Response] = {}
    mid_way = threading.Event()
    levels: list[int] = []
    try:
        stream = threading.Thread(target=read_stream, args=(events, arrivals, mid_way), daemon=True)
        stream.start()

        def send():
            unary["r"] = httpx.post(
                f"{BASE}/v1/generate", headers=GOLD, json={"prompt": PROMPT, "max_tokens": MAX_TOKENS}, timeout=60
            )
            unary["t"] = time.monotonic()

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        assert mid_way.wait(20), events
        wait_until(lambda: rows_running(client) >= 2, 3, 0.1, "both requests in the replica's batch")
        ray.kill(replica, no_restart=True)
        t_kill = time.monotonic()
        while (stream.is_alive() or sender.is_alive()) and time.monotonic() - t_kill < 50:
            levels.append(model_status(client)["level"])
            time.sleep(0.5)
        stream.join(1)
        sender.join(1)
    finally:
        clear_chaos(client)
    r = unary["r"]
    assert r.status_code == 200, r.text
    assert r.json()["text"] == reference["text"] and r.json()["tokens_generated"] == MAX_TOKENS
    assert int(r.headers["x-ballast-migrations"]) >= 1
    names = [name for name, _ in events]
    assert names[-1] == "done" and "error" not in names, events[-3:]
    done = events[-1][1]
    assert done["tokens_generated"] == MAX_TOKENS and done["migrations"] >= 1, done
    streamed = "".join(data["text"] for name, data in events if name == "token")
    assert streamed == reference["text"]  # nothing duplicated, nothing missing
    assert max(levels, default=0) == 0, levels
    after = model_status(client)["lost_capacity"]
    assert after["migrated"] >= before["migrated"] + 2 and after["not_migrated"] == before["not_migrated"], (
        before,
        after,
    )
    assert after["streams_carried_on"] >= before["streams_carried_on"] + 1, (before, after)
    paused_s = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    print(
        f"\nreplica killed mid-stream: the stream paused {paused_s:.1f} s (a replacement starting), the unary "
        f"request was answered {unary['t'] - t_kill:.1f} s after the kill; migrations: unary "
        f"{r.headers['x-ballast-migrations']}, stream {done['migrations']}"
    )
    wait_until(lambda: status(client)["replicas"]["BallastModel"]["running"] >= 1, 60, 0.5, "primary replaced")


def rows_running(client: httpx.Client) -> int:
    """Requests in the primary replica's batch, as its last report said."""
    rows = client.get("/admin/replicas", headers=ADMIN).json()["replicas"]
    return sum(int(row.get("running") or 0) for row in rows if row["deployment"] == "BallastModel")
