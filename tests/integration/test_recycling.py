"""Watchdogs, staggered recycling and hang kills on a real local Ray Serve stack.

Every model replica (primary: one, fallback: two in the test config) runs with its
own watchdog actor. Steady traffic flows from a background thread while replicas
are recycled, so "no failed request" is measured, not assumed. Faults come from
the chaos hooks (a capped memory leak, a stalled work loop) and are cleared by
each test.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from conftest import ADMIN, BASE, GOLD, model_status, serve_replica_states, status, wait_chaos, wait_until

pytestmark = pytest.mark.integration

PRIMARY, FALLBACK = "BallastModel", "BallastFallbackModel"


def replicas(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/admin/replicas", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def watchdog_of(client: httpx.Client, replica_id: str) -> dict[str, Any]:
    """That replica's watchdog report; {} while it has none (or the replica is gone)."""
    for row in replicas(client)["replicas"]:
        if row["replica_id"] == replica_id:
            return row["watchdog"] or {}
    return {}


def ids(client: httpx.Client, deployment: str) -> set[str]:
    return {r["replica_id"] for r in replicas(client)["replicas"] if r["deployment"] == deployment}


def settled(client: httpx.Client) -> None:
    """One primary replica, wanted and reporting: no scale-up from an earlier test still arriving."""

    def one() -> bool:
        model = status(client)["replicas"]["BallastModel"]
        # Serve's own view too: a replica it is still starting does not report yet, and
        # would join a recycle-all a moment later.
        return (
            model["desired"] == model["running"] == 1
            and len(ids(client, PRIMARY)) == 1
            and serve_replica_states(PRIMARY) == {"RUNNING": 1}
        )

    wait_until(one, 120, 0.5, "one primary replica, desired and running")


def events(client: httpx.Client, outcome: str, deployment: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in replicas(client)["events"]
        if e["outcome"] == outcome and (deployment is None or e["deployment"] == deployment)
    ]


def recycle_under_load(client: httpx.Client, what: str, timeout_s: float, model: str | None = None) -> None:
    """Recycle the one primary replica (of the first model, ``model``, when the stack serves
    several) under a steady load (level 0, settled first): the recycle completes within
    ``timeout_s``, no request fails, the replica is gone."""
    wait_until(lambda: model_status(client, model)["level"] == 0, 30, 0.5, "level back to 0")
    settled(client)  # an earlier test may have left the autoscaler's second replica
    (rid,) = ids(client, "BallastModel")
    with SteadyLoad() as load:
        time.sleep(1.0)
        r = client.post("/admin/recycle", headers=ADMIN, json={"replica_id": rid})
        assert r.status_code == 202, r.text
        wait_until(
            lambda: rid in {e["replica_id"] for e in events(client, "completed")},
            timeout_s,
            1.0,
            f"the {what} replica recycled",
        )
        time.sleep(1.0)
    assert load.statuses and not load.errors, f"{len(load.errors)} failed of {len(load.statuses)}: {load.errors[:5]}"
    assert rid not in ids(client, "BallastModel")


class SteadyLoad:
    """A bounded background stream of small gold requests; records every status."""

    def __init__(self, concurrency: int = 2, max_requests: int = 5000, max_s: float = 180.0) -> None:
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + max_s
        self._max = max_requests
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]

    def _run(self, worker: int) -> None:
        with httpx.Client(base_url=BASE, timeout=60) as c:
            i = 0
            while not self._stop.is_set() and time.monotonic() < self._deadline and len(self.statuses) < self._max:
                i += 1
                try:
                    r = c.post("/v1/generate", headers=GOLD, json={"prompt": f"steady {worker} {i}", "max_tokens": 8})
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.statuses.append(0)
                    self.errors.append(repr(e))
                time.sleep(0.05)

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=70)


def test_every_replica_has_a_watchdog_reporting_process_figures(client):
    def all_watched() -> list[dict[str, Any]]:
        rows = replicas(client)["replicas"]
        ok = len(rows) >= 3 and all(r["watchdog"] and r["watchdog"]["rss_bytes"] for r in rows)
        return rows if ok else []

    rows = wait_until(all_watched, 30, 0.5, "a watchdog report for every replica")
    for r in rows:
        w = r["watchdog"]
        assert w["rss_bytes"] > 50 * 2**20 and w["threads"] >= 4 and w["fds"] >= 8, w
        if r["device"].startswith("cuda"):  # a GPU machine: NVML's figures for this replica's process
            assert w["vram_bytes"] > 0 and w["gpu_util_pct"] is not None and w["vram_total_bytes"] > w["vram_bytes"], w
        else:
            assert r["device"] == "cpu", r
            assert w["vram_bytes"] is None and w["gpu_util_pct"] is None  # CPU: absent, never 0
        assert w["hung"] is False and w["severity"] == "ok" and r["ready"], r
    assert {r["deployment"] for r in rows} == {PRIMARY, FALLBACK}


def test_recycling_every_replica_in_turn_fails_no_request(client):
    settled(client)
    before = {PRIMARY: ids(client, PRIMARY), FALLBACK: ids(client, FALLBACK)}
    assert len(before[FALLBACK]) == 2, before
    done_before = len(events(client, "completed"))
    with SteadyLoad() as load:
        time.sleep(1.0)
        r = client.post("/admin/recycle", headers=ADMIN, json={"all": True})
        assert r.status_code == 202, r.text
        assert set(r.json()["accepted"]) == before[PRIMARY] | before[FALLBACK]

        def all_recycled() -> bool:
            done = {e["replica_id"] for e in events(client, "completed")}
            return (before[PRIMARY] | before[FALLBACK]) <= done

        wait_until(all_recycled, 150, 1.0, "every original replica recycled and replaced")
        time.sleep(1.0)
    assert load.statuses and not load.errors, f"{len(load.errors)} failed of {len(load.statuses)}: {load.errors[:5]}"
    assert len(events(client, "completed")) - done_before >= 3
    # Staggered: the fallback's two replicas were never out at the same time.
    fb = [e for e in replicas(client)["events"] if e["deployment"] == FALLBACK and e["replica_id"] in before[FALLBACK]]
    order = [e["outcome"] for e in fb if e["outcome"] in ("started", "completed")]
    assert order == ["started", "completed", "started", "completed"], "; ".join(map(str, fb))
    after = ids(client, PRIMARY) | ids(client, FALLBACK)
    assert not after & (before[PRIMARY] | before[FALLBACK]), "replacements are new replicas"
    avail = replicas(client)["availability"]
    assert avail["measured"] is not None and 0 < avail["measured"] < 1, avail
    print(f"\nrecycled 3 replicas under load: {len(load.statuses)} requests, 0 failed; availability {avail}")


def test_a_leaking_replica_is_detected_and_recycled_before_its_limit(client):
    settled(client)
    (victim,) = ids(client, PRIMARY)
    # A fresh replica (the last test's replacement) first finishes its warm-up: growth
    # while loading and serving its first batches is not a leak and is not sampled.
    wait_until(
        lambda: watchdog_of(client, victim).get("warming_up") is False,
        60,
        0.5,
        "the victim past its warm-up",
    )
    seen: dict[str, Any] = {}
    try:
        with SteadyLoad() as load:
            r = client.post("/admin/chaos", headers=ADMIN, json={"target": "primary", "leak_mb_per_s": 20})
            assert r.status_code == 200, r.text

            def leak_verdict() -> bool:
                w = watchdog_of(client, victim)
                if w.get("trends", {}).get("rss_bytes", {}).get("leaking") and w.get("recycle_requested"):
                    seen.update(w)
                    return True
                return False

            wait_until(leak_verdict, 40, 0.25, "the watchdog's leak verdict and recycle request")
            started = wait_until(
                lambda: [e for e in events(client, "started", PRIMARY) if e["replica_id"] == victim],
                30,
                0.5,
                "a recycle order",
            )
            client.delete("/admin/chaos", headers=ADMIN)  # the replacement must not leak too
            wait_until(
                lambda: any(e["replica_id"] == victim for e in events(client, "completed", PRIMARY)),
                90,
                1.0,
                "the recycle done",
            )
            time.sleep(1.0)
    finally:
        client.delete("/admin/chaos", headers=ADMIN)
    trend = seen["trends"]["rss_bytes"]
    assert trend["leaking"] and trend["slope_per_h"] > 100 * 2**20, (seen["reason"], trend)
    # The ladder acted on the RSS leak; the replica was caught well ahead of its limit
    # (rss_limit_mb: 2000 in the test config).
    assert "rss_bytes leak" in (seen["action_reason"] or ""), (seen, replicas(client))
    assert seen["rss_bytes"] < 2000 * 2**20 and trend["time_to_limit_s"] > 0, seen
    assert seen["ready"] is False, seen
    assert started[0]["reason"] in ("critical", "watchdog"), started
    assert seen["actions_total"]["gc_collect"] >= 1 and seen["actions_total"]["stop_intake"] >= 1, seen["actions_total"]
    assert not load.errors, f"{len(load.errors)} failed of {len(load.statuses)}: {load.errors[:5]}"
    print(
        f"\nleak: {seen['action_reason']} at rss {seen['rss_bytes'] / 2**20:.0f} MiB; "
        f"recycle reason {started[0]['reason']}; "
        f"{len(load.statuses)} requests, 0 failed"
    )


def test_a_vram_leak_is_measured_by_the_watchdog_on_a_gpu_and_refused_on_a_cpu(client):
    """On a GPU, a real CUDA leak read by the watchdog through NVML by PID; on a CPU, the
    replica leaks nothing and says so."""
    settled(client)
    (row,) = [r for r in replicas(client)["replicas"] if r["deployment"] == PRIMARY]
    victim = row["replica_id"]
    if row["device"] == "cpu":
        try:
            r = client.post("/admin/chaos", headers=ADMIN, json={"target": "primary", "vram_leak_mb_per_s": 50})
            assert r.status_code == 200, r.text
            wait_until(
                lambda: [
                    r
                    for r in replicas(client)["replicas"]
                    if r["replica_id"] == victim and r["chaos_vram_leak"] == "no_gpu"
                ],
                10,
                0.25,
                "the CPU replica saying it has no GPU to leak into",
            )
        finally:
            client.delete("/admin/chaos", headers=ADMIN)
        wait_until(
            lambda: all(r["chaos_vram_leak"] is None for r in replicas(client)["replicas"]), 10, 0.25, "chaos lifted"
        )
        return
    assert row["device"].startswith("cuda"), row
    wait_until(
        lambda: watchdog_of(client, victim).get("warming_up") is False,
        60,
        0.5,
        "the victim past its warm-up",
    )
    rate = 50 * 2**20  # bytes/s; chaos.max_leak_mb (800) caps it after 16 s
    seen: dict[str, Any] = {}
    try:
        r = client.post("/admin/chaos", headers=ADMIN, json={"target": "primary", "vram_leak_mb_per_s": rate / 2**20})
        assert r.status_code == 200, r.text

        def vram_verdict() -> bool:
            w = watchdog_of(client, victim)
            trend = w.get("trends", {}).get("vram_bytes", {})
            if trend.get("leaking") and trend.get("time_to_limit_s"):
                seen.update(w)
                return True
            return False

        wait_until(vram_verdict, 40, 0.25, "the watchdog's VRAM leak verdict")
    finally:
        client.delete("/admin/chaos", headers=ADMIN)
    trend = seen["trends"]["vram_bytes"]
    slope = trend["slope_per_h"] / 3600.0
    assert 0.5 * rate <= slope <= 2.0 * rate, (slope / 2**20, seen)
    truth = (seen["vram_total_bytes"] - seen["vram_bytes"]) / rate
    assert 0.5 * truth <= trend["time_to_limit_s"] <= 2.0 * truth, (trend, truth)
    assert trend["r2"] >= 0.7, trend
    print(
        f"\nVRAM leak at {rate / 2**20:.0f} MiB/s: watchdog slope {slope / 2**20:.1f} MiB/s (r2 {trend['r2']:.3f}), "
        f"process VRAM {seen['vram_bytes'] / 2**20:.0f} MiB of {seen['vram_total_bytes'] / 2**30:.0f} GiB, "
        f"time to limit {trend['time_to_limit_s']:.0f} s (truth {truth:.0f} s); severity {seen['severity']}"
    )


def test_a_hung_replica_is_killed_and_replaced(client):
    settled(client)
    (victim,) = ids(client, PRIMARY)
    try:
        r = client.post("/admin/chaos", headers=ADMIN, json={"target": "primary", "stall": True})
        assert r.status_code == 200, r.text
        wait_chaos(client, "primary", {"stall": True})
        # Work in flight that never progresses: the watchdog's heartbeat check trips.
        threads = [
            threading.Thread(
                target=lambda i=i: httpx.post(
                    f"{BASE}/v1/generate",
                    headers={**GOLD, "X-Request-Timeout-Ms": "15000"},
                    json={"prompt": f"stall {i}", "max_tokens": 8},
                    timeout=30,
                ),
                daemon=True,
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        killed = wait_until(
            lambda: [e for e in events(client, "killed_hung", PRIMARY) if e["replica_id"] == victim],
            30,
            0.3,
            "the hung replica killed",
        )
    finally:
        client.delete("/admin/chaos", headers=ADMIN)
    # The replica's own clock says its work loop stood still; its heartbeats kept coming.
    assert killed[0]["reason"] == "stalled" and killed[0]["stalled_s"] > 3 * 0.5, killed
    wait_until(lambda: ids(client, PRIMARY) - {victim}, 60, 1.0, "a replacement replica")
    ok = wait_until(
        lambda: (
            client.post("/v1/generate", headers=GOLD, json={"prompt": "after the hang", "max_tokens": 4}).status_code
            == 200
        ),
        60,
        1.0,
        "the replacement serving",
    )
    assert ok
    for t in threads:
        t.join(timeout=30)
