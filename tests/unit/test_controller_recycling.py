"""The controller's recycling: watchdog reports in, orders, kills and leases out (no Ray).

``ControllerCore`` runs with two ``FakeClock``s (monotonic for report expiry, wall
for leases and ages). Replicas and watchdogs are their typed reports, re-sent every
simulated second as the real ones are; a change is a new report (``Fleet.set``). A controller restart is a second
``ControllerCore`` adopting the lease table the first one persisted.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from fakes import FakeClock

from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.names import FALLBACK_DEPLOYMENT, MODEL_DEPLOYMENT
from ballast.policies.reports import ReplicaReport, WatchdogReport

WALL0 = 1_000_000


def cfg(replicas: tuple[int, int] = (2, 2), **recycle: Any):
    return load_config(
        {
            "deployments": {"model": {"min_replicas": replicas[0], "max_replicas": replicas[1]}},
            "controller": {"report_expiry_s": 3},
            "recycle": {
                "max_age_s": None,
                "forced_max_age_s": None,
                "window_start_hour": None,
                "window_end_hour": None,
                "lease_heartbeat_s": 2,
                "recycle_timeout_s": 120,
                **recycle,
            },
        }
    )


class Fleet:
    """Replicas and their watchdogs reporting to one controller; replicas may be replaced."""

    def __init__(self, core: ControllerCore, clock: FakeClock, wall: FakeClock, n: int = 2) -> None:
        self.core, self.clock, self.wall = core, clock, wall
        self.replicas: dict[str, ReplicaReport] = {}
        self.watchdogs: dict[str, WatchdogReport] = {}
        for i in range(n):
            self.add(f"r{i}")

    def add(self, rid: str, ready: bool = True) -> None:
        self.replicas[rid] = ReplicaReport(
            replica_id=rid,
            deployment=MODEL_DEPLOYMENT,
            queued=0,
            running=0,
            started_at_s=float(self.wall()),
            ready=ready,
            draining=False,
        )
        self.watchdogs[rid] = WatchdogReport(
            replica_id=rid,
            deployment=MODEL_DEPLOYMENT,
            actor_name=f"SERVE_REPLICA::ballast#BallastModel#{rid}",
            actor_namespace="serve",
            ready=True,
            hung=False,
            recycle_requested=False,
            critical=False,
            reason=None,
            rss_bytes=1e9,
            heartbeat_age_s=0.1,
            inflight=0,
        )

    def set(self, rid: str, replica: dict[str, Any] | None = None, **watchdog: Any) -> None:
        """What ``rid`` and its watchdog report from now on: these fields changed."""
        self.replicas[rid] = replace(self.replicas[rid], **(replica or {}))
        self.watchdogs[rid] = replace(self.watchdogs[rid], **watchdog)

    def step(self, seconds: int = 1) -> dict[str, Any]:
        snap: dict[str, Any] = {}
        for _ in range(seconds):
            self.clock.advance(1)
            self.wall.advance(1)
            for rid, r in self.replicas.items():
                self.core.report_replica(r)
                self.core.report_watchdog(self.watchdogs[rid])
            snap = self.core.tick().to_dict()
            # A replica with an order drains: Serve replaces it once its health check has failed.
            for rid in list(snap["recycle_orders"]):
                if rid in self.replicas:
                    self.set(rid, {"draining": True})
        return snap

    def replace_draining(self, new_id: str) -> None:
        (old,) = [rid for rid, r in self.replicas.items() if r.draining]
        del self.replicas[old]
        del self.watchdogs[old]
        self.add(new_id)


def harness(config=None, n: int = 2) -> Fleet:
    clock, wall = FakeClock(0), FakeClock(WALL0)
    return Fleet(ControllerCore(config or cfg(), clock=clock, wall_clock=wall), clock, wall, n)


def events(core: ControllerCore, outcome: str | None = None) -> list[dict[str, Any]]:
    return [e for e in core.recycler.events if outcome is None or e["outcome"] == outcome]


def test_a_hung_replica_gets_one_kill_order_and_an_event() -> None:
    f = harness()
    f.step()
    f.set("r1", hung=True, hung_reason="stalled", inflight=2, heartbeat_age_s=0.4, stalled_s=4.0)
    f.step()
    orders = list(f.core.recycler.kill_orders)
    assert orders == [
        {
            "replica_id": "r1",
            "deployment": MODEL_DEPLOYMENT,
            "actor_name": "SERVE_REPLICA::ballast#BallastModel#r1",
            "namespace": "serve",
        }
    ]
    f.step(5)  # still reported hung (the kill takes a moment): no second order within the cooldown
    assert len(f.core.recycler.kill_orders) == 1
    (e,) = events(f.core, "killed_hung")
    assert (e["replica_id"], e["reason"], e["stalled_s"], e["heartbeat_age_s"]) == ("r1", "stalled", 4.0, 0.4)


def test_manual_recycle_of_every_replica_goes_one_at_a_time_with_a_lease() -> None:
    f = harness()
    f.step()
    with pytest.raises(ValueError, match="replica_id"):
        f.core.request_recycle("nope", None, False, "ops")
    assert sorted(f.core.request_recycle(None, MODEL_DEPLOYMENT, True, "ops")) == ["r0", "r1"]
    snap = f.step()
    (rid,) = snap["recycle_orders"]  # one at a time (max_unavailable 1)
    order = snap["recycle_orders"][rid]
    assert order["reason"] == "manual" and order["expires_at_s"] > f.wall()
    assert snap["recycle"]["in_flight"][0]["replica_id"] == rid
    lease = f.core.recycler.leases.get(f"recycle/{MODEL_DEPLOYMENT}/{rid}")
    assert lease is not None and lease.holder == f.core.epoch
    assert f.core.recycler.leases_dirty
    # Orders keep their lease alive while the replica drains.
    for _ in range(6):
        snap = f.step()
        assert list(snap["recycle_orders"]) == [rid]
    f.replace_draining("r2")
    f.step(4)  # old gone (its last report expires), replacement healthy: complete; the next one starts
    assert [e["replica_id"] for e in events(f.core, "completed")] == [rid]
    snap = f.step()
    (nxt,) = snap["recycle_orders"]
    assert nxt != rid and nxt in ("r0", "r1")
    assert f.core.recycler.leases.get(f"recycle/{MODEL_DEPLOYMENT}/{rid}") is None, "released on completion"
    f.replace_draining("r3")
    f.step(4)
    assert {e["replica_id"] for e in events(f.core, "completed")} == {"r0", "r1"}
    assert f.step()["recycle_orders"] == {}
    avail = f.core.replica_status()["availability"]
    assert 0 < avail["measured"] < 1 and avail["out_s"] > 0
    took = [e["duration_s"] for e in events(f.core, "completed")]
    assert avail["restart_s"] == pytest.approx(sum(took) / len(took), abs=1e-3)  # the recycles' mean, not the estimate


def test_a_critical_lone_replica_at_its_ceiling_is_recycled_at_once() -> None:
    # max_replicas 1: no replacement can come first, and the replica will go down anyway.
    f = harness(cfg((1, 1), min_available=1), n=1)
    f.step()
    f.set("r0", ready=False, recycle_requested=True, critical=True, reason="rss_bytes leak 900 MiB/h, limit in 0.4h")
    snap = f.step()
    assert snap["recycle_orders"]["r0"]["reason"] == "critical"


def test_a_critical_lone_replica_below_its_ceiling_waits_for_its_replacement() -> None:
    f = harness(cfg((1, 2), min_available=1), n=1)
    f.step()
    f.set("r0", ready=False, recycle_requested=True, critical=True, reason="rss_bytes leak 900 MiB/h, limit in 0.4h")
    snap = f.step()
    assert snap["recycle_orders"] == {} and snap["desired_replicas"][MODEL_DEPLOYMENT] == 1
    snap = f.step()  # the surge from the last tick's plan: one replica more
    assert snap["desired_replicas"][MODEL_DEPLOYMENT] == 2 and snap["recycle_orders"] == {}
    f.add("r1")
    assert list(f.step()["recycle_orders"]) == ["r0"]


STARTUP_TICKS = 5  # a new replica reports this many ticks after Serve starts it
HEALTH_FAILS = 3  # Serve stops a replica whose health check failed this many times


def test_a_planned_recycle_starts_the_replacement_before_the_old_replica_stops(  # noqa: C901
) -> None:
    """The order of a leak recycle on a lone replica, tick by tick, with Serve played here.

    Serve starts replicas up to the controller's desired count (each reports after
    STARTUP_TICKS) and stops a draining replica HEALTH_FAILS ticks after its order.
    While no replica takes traffic, every replica reports a 3.1 s queue wait (what the
    soak saw). The replacement must serve before the old replica stops, so no tick is
    without a serving replica and the level never moves.
    """
    f = harness(cfg((1, 2), min_available=1), n=1)
    f.step()
    starting: list[int] = []  # ticks left before each started replica reports
    draining_for: dict[str, int] = {}
    log: list[tuple[int, str]] = []
    seq = 1
    f.set("r0", ready=False, recycle_requested=True, reason="rss_bytes leak 750 MiB/h, limit in 3.0h")
    f.set("r0", {"ready": False})  # the ladder's stop_intake rung: the replica says so too
    for tick in range(60):
        serving = [r for r, rep in f.replicas.items() if not rep.draining]
        for rid in f.replicas:
            f.set(rid, {"queue_wait_p95_ms": None if serving else 3100.0})
        snap = f.step()
        assert serving, f"tick {tick}: no replica serving"
        model = snap["models"]["tiny-decoder"]  # the config's one model
        assert model["level"] == 0, (tick, model["reason"])
        for rid in snap["recycle_orders"]:
            if rid not in draining_for and rid in f.replicas:
                draining_for[rid] = HEALTH_FAILS
                log.append((tick, f"order {rid}"))
        for rid in list(draining_for):
            draining_for[rid] -= 1
            if draining_for[rid] == 0 and rid in f.replicas:
                del f.replicas[rid], f.watchdogs[rid]
                log.append((tick, f"stopped {rid}"))
        # Serve: start what the desired count asks for beyond what runs or is starting.
        desired = snap["desired_replicas"][MODEL_DEPLOYMENT]
        live = sum(1 for r in f.replicas.values() if not r.draining)
        for _ in range(desired - live - len(starting)):
            starting.append(STARTUP_TICKS)
        starting = [t - 1 for t in starting]
        while starting and starting[0] <= 0:
            starting.pop(0)
            f.add(f"r{seq}")
            log.append((tick, f"serving r{seq}"))
            seq += 1
        # ... and stop the extra one once the surge is given back (the newest, as Serve may).
        extra = [r for r, rep in f.replicas.items() if not rep.draining][desired:]
        for rid in extra:
            del f.replicas[rid], f.watchdogs[rid]
            log.append((tick, f"scaled down {rid}"))
    kinds = [e for _, e in log]
    assert kinds.index("serving r1") < kinds.index("order r0") < kinds.index("stopped r0"), log
    assert [e["outcome"] for e in events(f.core)] == ["started", "completed"]
    final = f.step()
    assert final["recycle_orders"] == {} and final["autoscale"][MODEL_DEPLOYMENT]["recycle_surge"] == 0
    assert final["desired_replicas"][MODEL_DEPLOYMENT] == 1 and len(f.replicas) == 1 and "r0" not in f.replicas


def test_a_controller_that_dies_mid_recycle_leaves_nothing_stuck() -> None:
    f = harness()
    f.step()
    f.set("r0", recycle_requested=True, reason="fds growth")
    f.step()
    assert list(f.step()["recycle_orders"]) == ["r0"]
    persisted = f.core.recycler.leases_dict()  # what the actor wrote to Ray's KV store
    lease_before = f.core.recycler.leases.get(f"recycle/{MODEL_DEPLOYMENT}/r0")

    # The controller dies; Ray starts a new one (new epoch), which reads the KV store.
    new = ControllerCore(cfg(), clock=f.clock, wall_clock=f.wall)
    assert new.epoch != f.core.epoch
    assert new.recycler.adopt(persisted) == 1
    f.core = new
    f.set("r1", recycle_requested=True, reason="thread growth")  # another one wants to go
    expiry = lease_before.expires_at_s()
    while f.wall() < expiry:
        snap = f.step()
        # The old lease still counts: r0's order stands, r1 waits (max_unavailable 1).
        assert list(snap["recycle_orders"]) == ["r0"], snap["recycle_orders"]
    # Exactly three missed heartbeats later the lease expires and the new controller carries on.
    snap = f.step()
    assert events(new, "lease_expired")[0]["replica_id"] == "r0"
    assert len(snap["recycle_orders"]) == 1
    (rid,) = snap["recycle_orders"]
    lease = new.recycler.leases.get(f"recycle/{MODEL_DEPLOYMENT}/{rid}")
    assert lease.holder == new.epoch


def test_expected_availability_follows_the_schedule() -> None:
    f = harness(cfg(max_age_s=6 * 3600, forced_max_age_s=24 * 3600, restart_estimate_s=60))
    snap = f.step()
    # a rolling restart: (N-1)/N + (1 - T_restart/T_period)/N with N = 2, T = 60 s, period 6 h
    assert snap["recycle"]["availability"]["expected"] == {
        MODEL_DEPLOYMENT: pytest.approx(0.5 + (1 - 60 / 21600) / 2, abs=1e-6)
    }


def test_malformed_watchdog_reports_are_refused_when_built_and_dropped_on_arrival() -> None:
    f = harness()
    before = f.core.rejected_reports
    with pytest.raises(ValueError, match="^rss_bytes:"):
        WatchdogReport(replica_id="x", deployment=MODEL_DEPLOYMENT, rss_bytes=-5)
    with pytest.raises(ValueError, match="^replica_id:"):
        WatchdogReport(replica_id="", deployment=MODEL_DEPLOYMENT, rss_bytes=5)
    # What arrives is checked again (unpickling skips __post_init__): a bad field, or no report at all.
    bad = copy.copy(WatchdogReport(replica_id="x", deployment=MODEL_DEPLOYMENT))
    object.__setattr__(bad, "rss_bytes", -5)
    assert f.core.report_watchdog(bad)["accepted"] is False
    assert f.core.report_watchdog("garbage")["accepted"] is False  # type: ignore[arg-type]
    assert f.core.report_watchdog({"replica_id": "x", "rss_bytes": 5})["accepted"] is False  # type: ignore[arg-type]
    assert f.core.rejected_reports == before + 3


def test_recycling_disabled_still_honours_watchdog_and_manual_requests() -> None:
    f = harness(cfg(enabled=False, max_age_s=10, forced_max_age_s=20))
    snap = f.step(30)  # every replica is past its forced max age
    assert snap["recycle_orders"] == {}
    f.core.request_recycle("r1", None, False, "ops")
    assert list(f.step()["recycle_orders"]) == ["r1"]
    assert FALLBACK_DEPLOYMENT not in f.step()["recycle_orders"]


def lone(**recycle: Any):
    """One primary replica (autoscaled 1..2), due for an age recycle after 100 s."""
    return load_config(
        {
            "deployments": {"model": {"min_replicas": 1, "max_replicas": 2}},
            "controller": {"report_expiry_s": 3},
            "recycle": {
                "max_age_s": 100,
                "jitter_ratio": 0,
                "forced_max_age_s": None,
                "window_start_hour": None,
                "window_end_hour": None,
                "min_available": 1,
                "lease_heartbeat_s": 2,
                "recycle_timeout_s": 120,
                **recycle,
            },
        }
    )


def test_a_lone_replica_is_recycled_with_a_surge_of_one_and_never_leaves_none_serving() -> None:
    f = harness(lone(), n=1)
    snap = f.step(50)
    assert snap["desired_replicas"][MODEL_DEPLOYMENT] == 1 and not f.core.recycler.surging
    snap = f.step(60)  # r0 is past its age: it may not go while it is the only one serving ...
    assert snap["recycle"]["waiting"] == [["r0", "min_available"]]
    assert snap["desired_replicas"][MODEL_DEPLOYMENT] == 2  # ... so the controller asks for one more
    assert snap["autoscale"][MODEL_DEPLOYMENT]["recycle_surge"] == 1 and snap["recycle"]["surging"] == [
        MODEL_DEPLOYMENT
    ]
    f.add("r1")  # Serve starts it
    snap = f.step()
    assert list(snap["recycle_orders"]) == ["r0"] and snap["desired_replicas"][MODEL_DEPLOYMENT] == 2
    for _ in range(3):  # r0 drains while r1 serves: the surge holds
        snap = f.step()
        serving = [rid for rid, r in f.replicas.items() if not r.draining]
        assert serving == ["r1"] and snap["desired_replicas"][MODEL_DEPLOYMENT] == 2
    f.replace_draining("r2")  # Serve replaces r0 to keep two
    snap = f.step(5)
    assert [e["replica_id"] for e in events(f.core, "completed")] == ["r0"]
    assert snap["desired_replicas"][MODEL_DEPLOYMENT] == 1 and not f.core.recycler.surging  # given back


def test_without_the_surge_a_lone_replica_waits_and_a_watchdog_stop_surges_early() -> None:
    f = harness(lone(surge=False), n=1)
    snap = f.step(110)
    assert snap["recycle"]["waiting"] == [["r0", "min_available"]] and snap["desired_replicas"][MODEL_DEPLOYMENT] == 1
    # With the surge on, a replica whose watchdog stopped its intake (the rung before a
    # leak recycle) already gets its replacement started.
    g = harness(lone(max_age_s=None, forced_max_age_s=None), n=1)
    g.step(2)
    g.set("r0", ready=False, reason="rss_bytes leak 900 MiB/h, limit in 2.0h")
    snap = g.step(2)
    assert snap["desired_replicas"][MODEL_DEPLOYMENT] == 2 and not snap["recycle_orders"]
