"""The control loop end to end: overload sheds sheddable first, bursts scale, a dead controller fails nothing.

Load here is bounded (a fixed number of closed-loop workers, a fixed duration), goes
to loopback only, and stops by itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from conftest import BASE, FREE, GOLD, model_status, serve_replica_states, status, wait_quiet, wait_until

pytestmark = pytest.mark.integration


@dataclass
class LoadResult:
    outcomes: list[tuple[float, str, int, str]] = field(default_factory=list)  # (t, criticality, status, code)
    retry_after: list[str] = field(default_factory=list)

    def by(self, criticality: str) -> Counter:
        return Counter((s, c) for _, crit, s, c in self.outcomes if crit == criticality)


async def _worker(client, criticality, headers, max_tokens, stop_at, result, header=False):
    """``header``: the class also in X-Ballast-Criticality, which HAProxy reads (the edge);
    a refusal HAProxy answered is counted as ``OVERLOADED@edge``."""
    if header:
        headers = {**headers, "X-Ballast-Criticality": criticality}
    while time.monotonic() < stop_at:
        try:
            r = await client.post(
                "/v1/generate",
                headers=headers,
                json={"prompt": "load", "max_tokens": max_tokens, "criticality": criticality},
            )
        except httpx.HTTPError as e:  # counted, never hidden
            result.outcomes.append((time.monotonic(), criticality, 0, type(e).__name__))
            continue
        code = "OK" if r.status_code == 200 else r.json()["error"]["code"]
        if r.headers.get("x-ballast-edge") == "refused":
            code += "@edge"
        result.outcomes.append((time.monotonic(), criticality, r.status_code, code))
        if r.status_code == 503:
            result.retry_after.append(r.headers.get("retry-after", ""))
            await asyncio.sleep(0.05)


def run_load(workers: dict[str, int], duration_s: float, max_tokens: int = 24, header: bool = False) -> LoadResult:
    """Closed-loop workers per criticality for ``duration_s`` (bounded in time and count);
    with ``header``, every other worker also names its class in X-Ballast-Criticality."""

    async def main() -> LoadResult:
        result = LoadResult()
        stop_at = time.monotonic() + duration_s
        limits = httpx.Limits(max_connections=sum(workers.values()) + 4)
        async with httpx.AsyncClient(base_url=BASE, timeout=60, limits=limits) as client:
            tasks = [
                _worker(
                    client,
                    crit,
                    GOLD if crit.startswith("critical") else FREE,
                    max_tokens,
                    stop_at,
                    result,
                    header and i % 2 == 1,
                )
                for crit, n in workers.items()
                for i in range(n)
            ]
            await asyncio.gather(*tasks)
        return result

    return asyncio.run(main())


def model_replicas() -> int:
    return serve_replica_states().get("RUNNING", 0)


def model_replicas_wanted() -> int:
    """Replicas Serve runs or is bringing up: its scale decision, whatever a start costs."""
    return sum(n for state, n in serve_replica_states().items() if state != "STOPPING")


def test_overload_sheds_sheddable_first_and_critical_keeps_succeeding(client):
    wait_quiet(client)
    levels: list[int] = []
    done = threading.Event()

    def watch():
        with httpx.Client(base_url=BASE, timeout=10) as c:
            while not done.is_set():
                levels.append(model_status(c)["level"])
                time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_load({"critical": 12, "sheddable": 12}, duration_s=12, header=True)
    finally:
        done.set()
        watcher.join(timeout=5)

    assert max(levels) >= 1, f"level never rose: {levels}"
    critical, sheddable = result.by("critical"), result.by("sheddable")
    # Critical traffic never failed, and got real work done.
    assert set(critical) == {(200, "OK")}, (critical, f"levels seen: {sorted(set(levels))}")
    assert critical[(200, "OK")] >= 20
    # Sheddable was refused explicitly, with Retry-After: by HAProxy when it named its
    # class in the header (the edge, before Python), by the router when only in the body.
    assert sheddable[(503, "OVERLOADED")] > 0 and sheddable[(503, "OVERLOADED@edge")] > 0, sheddable
    assert set(sheddable) <= {(200, "OK"), (503, "OVERLOADED"), (503, "OVERLOADED@edge")}, sheddable
    assert all(v.isdigit() and int(v) >= 1 for v in result.retry_after)
    # Shedding began with sheddable: no critical refusal exists at all, and the
    # first refusal came while critical requests were still being served.
    first_shed = min(t for t, crit, s, _ in result.outcomes if s == 503)
    assert any(t > first_shed for t, crit, s, _ in result.outcomes if crit == "critical" and s == 200)

    # Quiet: the level steps back down to 0 (one level per stable window).
    wait_until(lambda: model_status(client)["level"] == 0, 30, 0.5, "level back to 0")
    r = client.post("/v1/generate", headers=FREE, json={"prompt": "x", "max_tokens": 4, "criticality": "sheddable"})
    assert r.status_code == 200
    # The edge follows the level down: the class passes HAProxy again.
    r = client.post(
        "/v1/generate", headers={**FREE, "X-Ballast-Criticality": "sheddable"}, json={"prompt": "x", "max_tokens": 4}
    )
    assert r.status_code == 200, r.text


def test_burst_scales_model_up_and_quiet_scales_it_down(client, ballast):
    wait_quiet(client)
    # Serve's own count, which can trail the controller's snapshot by a moment.
    wait_until(lambda: model_replicas() == 1, 60, 0.5, "Serve reports one model replica")
    peak = {"n": 1}
    done = threading.Event()

    def watch():
        # Serve's decision (a replica started), not its start time: on a busy 2-core host
        # a new replica can take longer than the burst to load and reach RUNNING.
        while not done.is_set():
            peak["n"] = max(peak["n"], model_replicas_wanted())
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # Critical only (never shed here): 16 in flight against a target of 4 per replica.
        result = run_load({"critical": 16}, duration_s=20)
    finally:
        done.set()
        watcher.join(timeout=5)
    assert set(result.by("critical")) == {(200, "OK")}
    assert peak["n"] == ballast.deployments.model.max_replicas, "burst did not scale the model deployment up"
    s = status(client)["replicas"]["BallastModel"]
    assert s["desired"] == ballast.deployments.model.max_replicas or model_replicas() == 2

    # Quiet: after the stable window and the scale-down delay it returns to min.
    wait_until(lambda: model_replicas() == ballast.deployments.model.min_replicas, 90, 1.0, "scale down to min")


def test_controller_killed_mid_traffic_fails_no_request_and_comes_back(client, ballast):
    from conftest import ADMIN

    NOISY = {"Authorization": "Bearer dev-key-noisy"}

    from ballast.control.link import lookup_controller

    wait_quiet(client)
    # What operators set must survive the restart: a kill switch (on a tenant the load
    # does not use: noisy) and a chaos setting (on the fallback, which the load does not reach).
    switch = client.post(
        "/admin/kill-switch",
        headers=ADMIN,
        json={
            "scope": "tenant",
            "value": "noisy",
            "reason": "survives the controller",
            "expires_in_s": 300,
        },
    ).json()
    assert client.post("/admin/chaos", headers=ADMIN, json={"target": "fallback", "latency_ms": 1}).status_code == 200
    try:
        epoch_before = status(client)["snapshot"]["epoch"]
        handle = lookup_controller(ballast)
        killer = threading.Timer(2.0, lambda: ray.kill(handle, no_restart=False))
        killer.start()
        result = run_load({"critical": 4, "sheddable_plus": 2}, duration_s=10, max_tokens=8)
        killer.join()
        # Not one request failed while the controller was dead and restarting.
        assert {k for k in result.by("critical")} == {(200, "OK")}, result.by("critical")
        assert {k for k in result.by("sheddable_plus")} == {(200, "OK")}, result.by("sheddable_plus")
        # Ray restarted it (max_restarts=-1) and the routers follow its new epoch.
        wait_until(
            lambda: status(client)["snapshot"]["epoch"] != epoch_before,
            30,
            0.5,
            "a snapshot from the restarted controller",
        )
        wait_until(lambda: model_status(client)["source"] == "snapshot", 10, 0.5, "fresh snapshot")
        # ... and it took back the kill switch and the chaos setting: the routers still enforce them.
        after = status(client)
        assert [k["id"] for k in after["kill_switches"]] == [switch["id"]], after["kill_switches"]
        assert list(after["chaos"]) == ["fallback"] and after["chaos"]["fallback"]["latency_ms"] == 1, after["chaos"]
        r = client.post("/v1/generate", headers=NOISY, json={"prompt": "k", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "KILL_SWITCH"
        audit = client.get("/admin/kill-switch", headers=ADMIN).json()["audit"]
        assert "admin_state_adopted" in [e["action"] for e in audit]
    finally:
        client.delete(f"/admin/kill-switch/{switch['id']}", headers=ADMIN)
        client.delete("/admin/chaos", headers=ADMIN)
