"""Breakers, fallbacks, deadlines, retries, idempotency and the kill switch, with chaos on a real stack.

Chaos settings go through the admin API into the controller's snapshot and reach
the model replicas within a report interval. Every test clears what it set.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
import ray
from conftest import ADMIN, BASE, FREE, GOLD, breaker, clear_chaos, heal, model_status, status, wait_chaos, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def chaos(client):
    """Set chaos on a target; cleared (and breakers given time to close) afterwards."""

    def set_(target: str, **settings):
        r = client.post("/admin/chaos", headers=ADMIN, json={"target": target, **settings})
        assert r.status_code == 200, r.text
        # every replica of the target picks it up from its next snapshot, and says so
        wait_chaos(client, target, settings)

    yield set_
    client.delete("/admin/chaos", headers=ADMIN)


def test_failing_primary_opens_breaker_fallback_serves_then_heals(client, chaos):
    chaos("primary", error_ratio=1.0)
    outcomes = []
    for i in range(12):
        r = client.post("/v1/generate", headers=GOLD, json={"prompt": f"p{i}", "max_tokens": 6})
        outcomes.append((r.status_code, r.json().get("fallback"), r.headers.get("x-ballast-fallback")))
    # Every request was answered by the fallback model (or refused clearly: none were).
    assert all(o == (200, "fallback_model", "fallback_model") for o in outcomes), outcomes
    s = model_status(client)["breakers"]["primary"]
    assert s["state"] == "open", s
    body = client.post("/v1/generate", headers=GOLD, json={"prompt": "x", "max_tokens": 4}).json()
    assert body["model"] == "tiny-decoder-small" and body["fallback"] == "fallback_model"

    clear_chaos(client)
    heal(client)  # open → (after open_duration) half-open probes → closed
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "after", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["fallback"] is None and r.headers["x-ballast-fallback"] == "none"


def test_both_backends_failing_is_a_clear_503_or_a_cached_answer(client, chaos, ballast):
    cached = client.post("/v1/generate", headers=GOLD, json={"prompt": "cache me", "max_tokens": 5}).json()
    chaos("primary", error_ratio=1.0)
    chaos("fallback", error_ratio=1.0)
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "cache me", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["fallback"] == "cache" and r.json()["text"] == cached["text"]
    # The cache is per tenant: another tenant sending gold's exact call learns nothing of it.
    r = client.post("/v1/generate", headers=FREE, json={"prompt": "cache me", "max_tokens": 5})
    assert r.status_code == 503 and r.json()["error"]["code"] == "MODEL_UNAVAILABLE", r.text
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "never seen", "max_tokens": 5})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "MODEL_UNAVAILABLE" and int(r.headers["retry-after"]) >= 1
    clear_chaos(client)
    heal(client, "primary")
    # The fallback only sees traffic when the primary is out: switch the primary off
    # for a moment so the fallback's breaker gets its half-open probes.
    entry = client.post(
        "/admin/kill-switch",
        headers=ADMIN,
        json={"scope": "model", "value": ballast.model.name, "reason": "heal the fallback", "expires_in_s": 60},
    ).json()
    try:
        heal(client, "fallback")
    finally:
        client.delete(f"/admin/kill-switch/{entry['id']}", headers=ADMIN)


def test_slow_primary_trips_on_slow_calls(client, chaos, ballast):
    slow_s = ballast.resilience.breaker.slow_call_duration_s
    chaos("primary", latency_ms=int((slow_s + 0.7) * 1000))

    async def burst(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=BASE, timeout=60) as c:
            return await asyncio.gather(
                *(c.post("/v1/generate", headers=GOLD, json={"prompt": f"slow{i}", "max_tokens": 4}) for i in range(n))
            )

    # A full window of slow calls (earlier fast successes may still sit in it).
    first = asyncio.run(burst(ballast.resilience.breaker.window_size))
    assert all(r.status_code == 200 and r.json()["fallback"] is None for r in first)  # slow, but answered
    assert breaker(client) == "open"
    t0 = time.monotonic()
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "next", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["fallback"] == "fallback_model"
    assert time.monotonic() - t0 < slow_s  # not waiting on the slow primary any more
    clear_chaos(client)
    heal(client)


def test_hung_primary_keeps_p99_within_the_deadline(client, chaos):
    chaos("primary", hang=True)
    deadline_ms = 1500

    async def run() -> list[tuple[float, int, str]]:
        out: list[tuple[float, int, str]] = []

        async def one(c, i):
            t0 = time.monotonic()
            r = await c.post(
                "/v1/generate",
                headers={**GOLD, "X-Request-Timeout-Ms": str(deadline_ms)},
                # critical_plus: never shed before level 4, so this measures the breaker
                # and the deadline, not admission.
                json={"prompt": f"hang{i}", "max_tokens": 4, "criticality": "critical_plus"},
            )
            out.append((time.monotonic() - t0, r.status_code, r.text[:200]))

        async with httpx.AsyncClient(base_url=BASE, timeout=30) as c:
            for wave in range(5):
                await asyncio.gather(*(one(c, wave * 4 + k) for k in range(4)))
        return out

    results = asyncio.run(run())
    latencies = sorted(t for t, _, _ in results)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    assert p99 <= deadline_ms / 1000 + 0.1, (p99, results)
    codes = {code for _, code, _ in results}
    # 504 while the primary's breaker is still judging; then the fallback answers
    # (or, while its own breaker is half-open and out of probes, a clear 503).
    assert codes <= {200, 503, 504}, [r for r in results if r[1] not in (200, 503, 504)]
    refused = [text for _, code, text in results if code == 503]
    assert all('"MODEL_UNAVAILABLE"' in text for text in refused), refused
    assert 200 in codes
    clear_chaos(client)
    heal(client)


def test_the_front_runs_at_the_normal_cpu_priority_and_a_model_at_its_own(ballast):
    """Why the hung-primary test keeps its deadline on a busy host (ballast/model/niceness.py):
    Ray starts its workers at nice 15, so the router and its HAProxy waited behind any
    ordinary process; Ballast starts them at 0 and each model replica moves to its
    ``model.niceness`` (the primary's default 0; this suite's fallback 15)."""
    import os

    import psutil

    procs = {"router": [], "haproxy": [], "model": [], "fallback": []}
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "ServeReplica:ballast:BallastRouter" in line:
            procs["router"].append(p)
        elif "haproxy" in line and f"/ballast-{ballast.http.port}-" in line:
            procs["haproxy"].append(p)
        elif "ServeReplica:ballast:BallastModel" in line:
            procs["model"].append(p)
        elif "ServeReplica:ballast:BallastFallbackModel" in line:
            procs["fallback"].append(p)
    assert all(procs.values()), {k: len(v) for k, v in procs.items()}
    for role in ("router", "haproxy"):
        assert {p.nice() for p in procs[role]} == {0}, role
    want = {"model": ballast.model.niceness, "fallback": ballast.fallback.model.niceness}
    assert want == {"model": 0, "fallback": 15}
    for role, expected in want.items():
        for p in procs[role]:  # every thread: torch's and Ray's too
            nice = {os.getpriority(os.PRIO_PROCESS, t.id) for t in p.threads()}
            assert nice == {expected}, (role, p.pid, nice)


def test_a_deadline_that_runs_out_at_the_replica_is_not_a_breaker_failure(client, chaos):
    def primary() -> dict:
        return model_status(client)["breakers"]["primary"]

    heal(client)
    chaos("primary", stall=True)  # no decode step from here on
    before = primary()
    # A deadline shorter than the stall rule (1 s without a decode step): for all the
    # replica can tell, the request's own time ran out; the breaker hears nothing.
    r = client.post(
        "/v1/generate",
        headers={**GOLD, "X-Request-Timeout-Ms": "500"},
        json={"prompt": "short of time", "max_tokens": 4, "criticality": "critical_plus"},
    )
    assert r.status_code == 504 and r.json()["error"]["code"] == "DEADLINE_EXCEEDED", r.text
    after = primary()
    assert (after["calls"], after["failures"]) == (before["calls"], before["failures"])
    clear_chaos(client)
    heal(client)


def _primary_replica_handles():
    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "BallastModel" in a["name"] and "Fallback" not in a["name"]
    ]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names if a["name"].startswith("SERVE_REPLICA")]


def test_replica_killed_mid_traffic_fails_no_idempotent_request(client, ballast):
    heal(client)
    (replica, *_) = _primary_replica_handles()

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=BASE, timeout=60) as c:

            async def worker(w: int) -> list[httpx.Response]:
                got = []
                for i in range(8):
                    key = f"kill-{w}-{i}-{uuid.uuid4().hex[:6]}"
                    got.append(
                        await c.post(
                            "/v1/generate",
                            headers={**GOLD, "Idempotency-Key": key},
                            json={"prompt": f"w{w} i{i}", "max_tokens": 16},
                        )
                    )
                return got

            async def killer() -> None:
                await asyncio.sleep(0.8)
                ray.kill(replica, no_restart=False)

            *lists, _ = await asyncio.gather(*(worker(w) for w in range(3)), killer())
            return [r for lst in lists for r in lst]

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(responses), [
        r.text for r in responses if r.status_code != 200
    ]
    budget = model_status(client)["retry_budget"]
    print(
        f"\nreplica kill: retries granted {budget['retries_granted']}, denied {budget['retries_denied']}, "
        f"fallbacks {sum(r.json()['fallback'] is not None for r in responses)}/{len(responses)}"
    )
    wait_until(lambda: status(client)["replicas"]["BallastModel"]["running"] >= 1, 60, 0.5, "primary replaced")


def test_an_idempotency_key_answered_by_another_router_is_replayed_here(client, ballast):
    """The key table every router shares: another router (played here by the test,
    through the real actor) claims a key; this router's request with that key waits
    for that router's answer and replays it, generating nothing itself."""
    import concurrent.futures

    from ballast.control.keys import keys_actor
    from ballast.model.protocol import ModelCall
    from ballast.router.answered import Settled
    from ballast.router.idempotency import request_fingerprint

    keys = keys_actor(ballast)
    key = f"elsewhere-{uuid.uuid4().hex}"
    same = request_fingerprint(ModelCall("one", model=ballast.model.name), 6)  # the request this router will be sent
    assert ray.get(keys.claim.remote("gold", key, "router-on-another-node", 30.0, same)).state == "mine"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.post,
            "/v1/generate",
            headers={**GOLD, "Idempotency-Key": key},
            json={"prompt": "one", "max_tokens": 6},
        )
        time.sleep(1.0)
        assert not pending.done()  # waiting for the other router's attempt, not generating its own
        answer = Settled("answered elsewhere", 2, "length", fallback=None, model=ballast.model.name)
        assert ray.get(keys.complete.remote("gold", key, "router-on-another-node", answer)) is True
        r = pending.result(timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-ballast-idempotent-replay"] == "true"
    assert r.json()["text"] == "answered elsewhere"
    # A key another router claimed and then gave up is run here for real.
    key = f"released-{uuid.uuid4().hex}"
    ray.get(keys.claim.remote("gold", key, "router-on-another-node", 30.0, same))
    ray.get(keys.release.remote("gold", key, "router-on-another-node"))
    r = client.post("/v1/generate", headers={**GOLD, "Idempotency-Key": key}, json={"prompt": "one", "max_tokens": 6})
    assert r.status_code == 200 and "x-ballast-idempotent-replay" not in r.headers


def test_idempotency_key_replays_the_first_answer(client):
    key = f"idem-{uuid.uuid4().hex}"
    h = {**GOLD, "Idempotency-Key": key}
    first = client.post("/v1/generate", headers=h, json={"prompt": "one", "max_tokens": 6})
    again = client.post("/v1/generate", headers=h, json={"prompt": "one", "max_tokens": 6})
    assert first.status_code == again.status_code == 200
    assert again.headers["x-ballast-idempotent-replay"] == "true"
    assert "x-ballast-idempotent-replay" not in first.headers
    assert again.json() == first.json()
    # Another tenant's identical key is another request.
    other = client.post(
        "/v1/generate", headers={**FREE, "Idempotency-Key": key}, json={"prompt": "one", "max_tokens": 6}
    )
    assert "x-ballast-idempotent-replay" not in other.headers

    async def concurrent() -> list[httpx.Response]:
        k = {**GOLD, "Idempotency-Key": f"idem-{uuid.uuid4().hex}"}
        async with httpx.AsyncClient(base_url=BASE, timeout=60) as c:
            return await asyncio.gather(
                *(c.post("/v1/generate", headers=k, json={"prompt": "two", "max_tokens": 40}) for _ in range(3))
            )

    rs = asyncio.run(concurrent())
    assert len({r.text for r in rs}) == 1  # the repeats waited for the first
    assert sum(r.headers.get("x-ballast-idempotent-replay") == "true" for r in rs) == 2


def test_kill_switch_scopes_expiry_and_audit(client, ballast):
    def ks(scope, value, reason="test", expires_in_s=60):
        r = client.post(
            "/admin/kill-switch",
            headers={**ADMIN, "X-Ballast-Operator": "pytest"},
            json={"scope": scope, "value": value, "reason": reason, "expires_in_s": expires_in_s},
        )
        assert r.status_code == 201, r.text
        return r.json()

    def gen(headers=GOLD, criticality="critical"):
        return client.post(
            "/v1/generate", headers=headers, json={"prompt": "k", "max_tokens": 4, "criticality": criticality}
        )

    # tenant scope, expiring by itself
    e = ks("tenant", "free", reason="abuse from free", expires_in_s=2)
    assert e["set_by"] == "pytest" and e["expires_at_s"] - e["created_at_s"] == 2
    assert [k["id"] for k in status(client)["kill_switches"]] == [e["id"]]  # this router enforces it now
    r = gen(FREE)
    assert r.status_code == 503 and r.json()["error"]["code"] == "KILL_SWITCH"
    assert "abuse from free" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
    assert gen(GOLD).status_code == 200
    wait_until(lambda: gen(FREE).status_code == 200, 10, 0.3, "tenant kill switch to expire")

    # criticality scope, deleted by id
    e = ks("criticality", "sheddable")
    assert gen(criticality="sheddable").json()["error"]["code"] == "KILL_SWITCH"
    assert gen(criticality="critical").status_code == 200
    assert client.delete(f"/admin/kill-switch/{e['id']}", headers=ADMIN).status_code == 200
    assert gen(criticality="sheddable").status_code == 200
    assert client.delete(f"/admin/kill-switch/{e['id']}", headers=ADMIN).status_code == 404

    # model scope: the primary is switched off, the fallback serves; both off: refused
    e1 = ks("model", ballast.model.name)
    r = gen()
    assert r.status_code == 200 and r.json()["fallback"] == "fallback_model"
    e2 = ks("model", ballast.fallback.model.name)
    r = gen()
    assert r.status_code == 503 and r.json()["error"]["code"] == "KILL_SWITCH"
    for e in (e1, e2):
        client.delete(f"/admin/kill-switch/{e['id']}", headers=ADMIN)

    # global
    e = ks("global", None, reason="maintenance")
    assert gen(GOLD).json()["error"]["code"] == "KILL_SWITCH"
    client.delete(f"/admin/kill-switch/{e['id']}", headers=ADMIN)
    assert gen(GOLD).status_code == 200

    listing = client.get("/admin/kill-switch", headers=ADMIN).json()
    assert listing["entries"] == []
    actions = [a["action"] for a in listing["audit"]]
    assert {"kill_switch_set", "kill_switch_deleted", "kill_switch_expired"} <= set(actions)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"scope": "planet", "value": "x", "reason": "r", "expires_in_s": 5}, "scope"),
        ({"scope": "tenant", "value": "free", "reason": "r"}, "expires_in_s"),
        ({"scope": "tenant", "value": "free", "reason": "r", "expires_in_s": 0}, "expires_in_s"),
        ({"scope": "global", "value": "x", "reason": "r", "expires_in_s": 5}, "value"),
        ({"scope": "tenant", "value": "free", "reason": "", "expires_in_s": 5}, "reason"),
    ],
)
def test_kill_switch_bad_input_names_the_field(client, body, field):
    r = client.post("/admin/kill-switch", headers=ADMIN, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field


def test_admin_routes_need_the_admin_token(client):
    assert client.get("/admin/kill-switch", headers=GOLD).status_code == 403
    assert client.post("/admin/chaos", headers=GOLD, json={"target": "primary"}).status_code == 403
    assert client.delete("/admin/chaos").status_code == 401


def test_request_timeout_header_is_validated(client):
    r = client.post("/v1/generate", headers={**GOLD, "X-Request-Timeout-Ms": "soon"}, json={"prompt": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "X-Request-Timeout-Ms"


def test_operator_cli(client, capsys):
    import json

    from ballast.ops.cli import main

    common = ["--url", BASE, "--token", "dev-admin-token", "--operator", "cli-test"]
    assert (
        main(
            [
                *common,
                "kill-switch",
                "on",
                "--scope",
                "tenant",
                "--value",
                "free",
                "--reason",
                "cli",
                "--expires-in-s",
                "30",
            ]
        )
        == 0
    )
    entry = json.loads(capsys.readouterr().out)
    assert entry["set_by"] == "cli-test" and entry["scope"] == "tenant"
    r = client.post("/v1/generate", headers=FREE, json={"prompt": "x", "max_tokens": 2})
    assert r.json()["error"]["code"] == "KILL_SWITCH"
    assert main([*common, "kill-switch", "list"]) == 0
    assert entry["id"] in capsys.readouterr().out
    assert main([*common, "kill-switch", "off", entry["id"]]) == 0
    assert main([*common, "kill-switch", "off", entry["id"]]) == 1  # already gone: 404
    assert client.post("/v1/generate", headers=FREE, json={"prompt": "x", "max_tokens": 2}).status_code == 200
    capsys.readouterr()

    assert main([*common, "status", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (name,) = doc["models"]
    assert doc["models"][name]["level"] in range(5)
    assert main([*common, "status"]) == 0  # the summary: the snapshot, then a block per model naming its level
    assert capsys.readouterr().out.splitlines()[1].startswith(f"model {name}: level ")
    assert main([*common, "tenants"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert "noisy" in rows and {"counter", "served_per_s", "waiting", "view"} <= set(rows["noisy"]["fair_shares"][name])
    assert main([*common, "chaos", "on", "--target", "fallback", "--latency-ms", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["chaos"]["fallback"]["latency_ms"] == 5
    assert main([*common, "chaos", "off"]) == 0
    capsys.readouterr()

    # clear errors: a wrong token, a server that is not there
    assert main(["--url", BASE, "--token", "wrong", "status"]) == 1
    assert "token was refused" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--token", "x", "status"]) == 2
    assert "cannot reach Ballast" in capsys.readouterr().err
