"""One recorded sequence of reports through the controller and through the fleet simulator.

tests/unit/data/control_trace.json holds 90 ticks (3 s apart) of router, replica and
watchdog reports: a load rise, a saturated spell, a hung replica killed twice (the
cooldown), a watchdog-asked recycle with its surge, and the replacement. ``ControllerCore`` (on ``FakeClock``s) and the
simulator's ``BallastController.policy_tick`` each get every tick's reports; the
level, the desired replicas, the recycle orders and the kill orders must be equal
tick by tick. The simulator keeps no copy of the controller's tick, so a change to
either path that is not made to the policies shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import FakeClock

from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.control.recycling import _hour_of_day
from ballast.names import MODEL_DEPLOYMENT
from ballast.policies import control, recycle
from ballast.policies.reports import ModelLoad, ReplicaReport, RouterReport, WatchdogReport
from loadtest.sim.config import SimConfig
from loadtest.sim.controllers import BallastController

RAW = json.loads((Path(__file__).parent / "data" / "control_trace.json").read_text())
MODEL = "tiny-decoder"  # the config's one model: the trace's router loads are its


def router_report(raw: dict) -> RouterReport:
    """A recorded router report (its id and the model's load) as the router builds it."""
    load = {k: v for k, v in raw.items() if k != "router_id"}
    return RouterReport(router_id=raw["router_id"], models={MODEL: ModelLoad(**load)})


# Each tick's reports as their senders build them.
TRACE = {
    **RAW,
    "ticks": [
        {
            **t,
            "routers": [router_report(r) for r in t["routers"]],
            "replicas": [ReplicaReport(**r) for r in t["replicas"]],
            "watchdogs": [WatchdogReport(**w) for w in t["watchdogs"]],
        }
        for t in RAW["ticks"]
    ],
}
ERROR_WINDOW_S = 10


def make_cfg():
    return load_config(
        {
            "deployments": {"model": {"min_replicas": 1, "max_replicas": 4}},
            # Reports live 2 s and ticks are 3 s apart: each tick sees exactly its own reports.
            "controller": {"report_expiry_s": 2, "error_window_s": ERROR_WINDOW_S},
            "watchdog": {"interval_s": 0.5},
            "degradation": {"stable_window_s": 5},
            "autoscale": {"stable_window_s": 20, "panic_window_s": 4, "scale_down_delay_s": 5},
            "recycle": {
                "max_age_s": None,
                "window_start_hour": None,
                "window_end_hour": None,
                "forced_max_age_s": None,
            },
        }
    )


def controller_path() -> list[dict]:
    cfg = make_cfg()
    clock, wall = FakeClock(0), FakeClock(TRACE["wall0_s"])
    core = ControllerCore(cfg, clock=clock, wall_clock=wall)
    out = []
    for t in TRACE["ticks"]:
        for r in t["routers"]:
            core.report_router(r)
        for r in t["replicas"]:
            core.report_replica(r)
        for w in t["watchdogs"]:
            core.report_watchdog(w)
        snap = core.tick()
        kills = []
        while core.recycler.kill_orders:
            kills.append(core.recycler.kill_orders.popleft()["replica_id"])
        out.append(
            {
                "level": snap.models[MODEL].level,
                "desired": snap.desired_replicas[MODEL_DEPLOYMENT],
                "surge": snap.autoscale[MODEL_DEPLOYMENT]["recycle_surge"],
                "recycling": sorted(snap.recycle_orders),
                "kills": kills,
            }
        )
        clock.advance(TRACE["tick_s"])
        wall.advance(TRACE["tick_s"])
    return out


def simulator_path() -> list[dict]:
    cfg = make_cfg()
    ctrl = BallastController(
        SimConfig(),
        fleet=None,
        recycling=True,
        deg_cfg=cfg.degradation_config(),
        as_cfg=cfg.autoscale_config(),
        rc_cfg=cfg.recycle.recycle_config(),
    )
    outcomes: list[tuple[int, int, int]] = []  # (at, requests, errors): the error window, as the glue keeps it
    out = []
    for j, t in enumerate(TRACE["ticks"]):
        now, wall = j * TRACE["tick_s"], t["wall_s"]
        loads = control.model_views(t["routers"], MODEL)
        outcomes += [(now, r.requests, r.errors) for r in loads]
        window = [o for o in outcomes if o[0] >= now - ERROR_WINDOW_S]
        watchdogs = {w.replica_id: w for w in t["watchdogs"]}
        replicas = t["replicas"]
        views = recycle.replica_views(replicas, watchdogs, ctrl.rc_state, frozenset(), wall)
        dec, step = ctrl.policy_tick(
            loads,
            replicas,
            sum(o[1] for o in window),
            sum(o[2] for o in window),
            sum(1 for r in replicas if r.deployment == MODEL_DEPLOYMENT),
            now,
            views=views,
            watchdogs=watchdogs,
            wall_s=wall,
            hour_of_day=_hour_of_day(wall),
            serving_replicas=control.serving_replicas(replicas, watchdogs, MODEL_DEPLOYMENT),
        )
        out.append(
            {
                "level": dec.level.level,
                "desired": dec.desired_replicas,
                "surge": dec.recycle_surge,
                "recycling": sorted(f.replica_id for f in ctrl.rc_state.in_flight),
                "kills": [k.replica_id for k in step.kills],
            }
        )
    return out


@pytest.fixture(scope="module")
def paths() -> tuple[list[dict], list[dict]]:
    return controller_path(), simulator_path()


def test_same_decisions_tick_by_tick(paths):
    core, sim = paths
    assert len(core) == len(sim) == len(TRACE["ticks"])
    for k, (a, b) in enumerate(zip(core, sim)):
        assert a == b, f"tick {k}: controller {a} != simulator {b}"


def test_the_trace_exercises_every_decision(paths):
    """The fixture is only worth comparing if every kind of decision happens in it."""
    core, _ = paths
    levels = [d["level"] for d in core]
    assert levels[0] == 0 and max(levels) >= 3 and levels[-1] == 0  # a rise, a saturated spell, calm again
    desired = [d["desired"] for d in core]
    assert max(desired) > desired[0]  # the autoscaler scaled up
    assert any(d["recycling"] == ["r1"] for d in core) and core[-1]["recycling"] == []  # a recycle, completed
    assert any(d["surge"] == 1 for d in core) and core[-1]["surge"] == 0  # one replica more while it ran
    kill_ticks = [k for k, d in enumerate(core) if d["kills"] == ["r2"]]
    # Hung for ticks 45-69: killed at once, then again only after the 60 s cooldown (20 ticks).
    assert kill_ticks[:2] == [45, 66] and len(kill_ticks) == 2
