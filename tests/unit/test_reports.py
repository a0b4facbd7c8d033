"""ballast.policies.reports: the typed messages routers, replicas and watchdogs send the controller
(and a watchdog its replica).

Each report checks itself when built, survives the pickling a Ray actor call does,
is checked again by ``checked`` on arrival, and keeps the JSON shape the HTTP
answers (``/admin/replicas``, a replica's ``stats``) have always had.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
from fakes import FakeClock

from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.names import MODEL_DEPLOYMENT
from ballast.policies.reports import (
    IDLE,
    MAX_ENGINE_PROCESSES,
    MAX_PROCESS_NAME_CHARS,
    MAX_REPORTED_MODELS,
    ModelLoad,
    ReplicaReport,
    RouterReport,
    SeriesTrend,
    WatchdogOrders,
    WatchdogReport,
    WatchedReplica,
    bounded_processes,
    checked,
)

REPLICA = WatchedReplica("m1", MODEL_DEPLOYMENT, 1000.0, None, 4242, "SERVE_REPLICA::ballast#BallastModel#m1", "serve")
TREND = SeriesTrend(slope_per_h=3.5, r2=0.9, leaking=True, time_to_limit_s=7200.0, short_window=False)


def reports() -> list[object]:
    return [
        RouterReport(
            router_id="r1",
            models={
                "a": ModelLoad(
                    inflight=3,
                    requests=10,
                    errors=1,
                    gate_waiting=2,
                    demand_rps={"critical": 4.0},
                    served_rps=3.5,
                    gate_full=True,
                ),
                "b": ModelLoad(inflight=1, routed={"prefix": 2}),
                "c": ModelLoad(),
            },
            demand_tokens_per_s={"gold": 120.0},
        ),
        ReplicaReport(
            replica_id="m1",
            deployment=MODEL_DEPLOYMENT,
            role="primary",
            queued=2,
            running=8,
            kv_util_pct=40.0,
            chaos={"latency_ms": 50},
            started_at_s=1000.0,
        ),
        WatchdogReport.of(
            REPLICA,
            at_s=1010.0,
            rss_bytes=1e9,
            heartbeat_age_s=0.5,
            trends={"rss_bytes": TREND},
            actions_total={"gc_collect": 1},
        ),
        REPLICA,
        WatchdogOrders(actions=("gc_collect", "stop_intake"), ready=False),
    ]


@pytest.mark.parametrize("report", reports(), ids=lambda r: type(r).__name__)
def test_a_report_crosses_a_process_unchanged_and_is_accepted_on_arrival(report) -> None:
    arrived = pickle.loads(pickle.dumps(report))
    assert arrived == report and type(arrived) is type(report)
    assert checked(arrived, type(report)) == report


def test_checked_drops_what_is_not_a_well_formed_report_of_its_kind() -> None:
    report = RouterReport(router_id="r1", models={"a": ModelLoad(), "b": ModelLoad()})
    bad_load = copy.copy(ModelLoad())
    object.__setattr__(bad_load, "requests", -1)  # past __post_init__, as unpickling would let through
    bad = copy.copy(report)
    object.__setattr__(bad, "models", {"a": ModelLoad(), "b": bad_load})
    assert checked(bad, RouterReport) is None  # a model's load is checked again too, not only the first's
    assert checked(report, ReplicaReport) is None
    assert checked({"router_id": "r1"}, RouterReport) is None
    assert checked(None, RouterReport) is None


def test_every_model_of_a_router_report_is_alike_and_one_it_did_not_report_is_idle() -> None:
    loads = {"a": ModelLoad(inflight=1), "b": ModelLoad(inflight=2, errors=1), "c": ModelLoad(requests=3)}
    report = RouterReport(router_id="r1", models=loads)
    assert {name: report.load(name) for name in loads} == loads  # no model is read from elsewhere
    assert report.load("d") is IDLE and IDLE == ModelLoad()


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: RouterReport(router_id=""), "router_id"),
        (lambda: ModelLoad(inflight=-1), "inflight"),
        (lambda: ModelLoad(requests=True), "requests"),
        (lambda: ModelLoad(queue_wait_p95_ms=float("nan")), "queue_wait_p95_ms"),
        (lambda: ModelLoad(gate_full=1), "gate_full"),
        (lambda: ModelLoad(routed={"nearest": 1}), "routed"),
        (lambda: ModelLoad(routed={"prefix": -1}), "routed"),
        (lambda: RouterReport(router_id="r", models={"a": {"inflight": 1}}), "models"),
        (lambda: RouterReport(router_id="r", models={"": ModelLoad()}), "models"),
        (lambda: RouterReport(router_id="r", models={f"m{i}": IDLE for i in range(MAX_REPORTED_MODELS + 1)}), "models"),
        (lambda: ReplicaReport(replica_id="m", deployment="D", prefix_blocks=-1), "prefix_blocks"),
        (lambda: RouterReport(router_id="r", demand_tokens_per_s={"gold": float("inf")}), "demand_tokens_per_s"),
        (lambda: ReplicaReport(replica_id="m", deployment=""), "deployment"),
        (lambda: ReplicaReport(replica_id="m", deployment="D", running=-0.5), "running"),
        (lambda: ReplicaReport(replica_id="m", deployment="D", vram_pct=-1.0), "vram_pct"),
        (lambda: ReplicaReport(replica_id="m", deployment="D", started_at_s=float("inf")), "started_at_s"),
        (lambda: WatchdogReport(replica_id="m", deployment="D", inflight=-2), "inflight"),
        (lambda: WatchdogReport(replica_id="m", deployment="D", heartbeat_age_s=-1.0), "heartbeat_age_s"),
        (lambda: WatchdogReport(replica_id="m", deployment="D", actor_namespace=""), "actor_namespace"),
        (lambda: WatchdogReport(replica_id="m", deployment="D", hung=None), "hung"),
        (lambda: WatchdogOrders(actions=["gc_collect"]), "actions"),
        (lambda: WatchdogOrders(ready=None), "ready"),
    ],
)
def test_a_malformed_report_is_refused_where_it_is_built_naming_the_field(build, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        build()


def test_the_engine_process_list_is_bounded_in_count_and_name_where_it_is_built() -> None:
    at_bounds = tuple((pid, "W" * MAX_PROCESS_NAME_CHARS) for pid in range(1, MAX_ENGINE_PROCESSES + 1))
    assert WatchedReplica("m", "D", engine_processes=at_bounds).engine_processes == at_bounds
    one_more = at_bounds + ((MAX_ENGINE_PROCESSES + 1, "VLLM::Worker_TP9"),)
    long_name = ((1, "W" * (MAX_PROCESS_NAME_CHARS + 1)),)
    for processes in (one_more, long_name, ((1, ""),)):
        with pytest.raises(ValueError, match="^engine_processes:") as refused:
            WatchedReplica("m", "D", engine_processes=processes)
        assert len(str(refused.value)) < 400  # the message names the field, not the whole list
        with pytest.raises(ValueError, match="^engine_processes:"):
            WatchdogReport(replica_id="m", deployment="D", engine_processes=processes)


def test_a_replica_cuts_its_engine_process_list_to_the_bounds_keeping_the_first() -> None:
    listed = [(10, "VLLM::EngineCore"), (11, "/opt/venv/bin/" + "x" * 300)] + [
        (100 + i, f"ray::RayWorkerWrapper{i}") for i in range(MAX_ENGINE_PROCESSES + 50)
    ]
    kept = bounded_processes(listed)
    assert len(kept) == MAX_ENGINE_PROCESSES
    assert kept[0] == (10, "VLLM::EngineCore")  # the engine's own come first and stay
    assert kept[1] == (11, listed[1][1][:MAX_PROCESS_NAME_CHARS])
    assert kept[2:] == tuple(listed[2:MAX_ENGINE_PROCESSES])
    assert WatchedReplica("m", "D", engine_processes=kept).engine_processes == kept
    within = ((10, "VLLM::EngineCore"), (11, "VLLM::Worker_TP0"))
    assert bounded_processes(within) == within  # within them: unchanged


def test_an_engine_process_list_past_the_bounds_is_refused_where_it_arrives() -> None:
    """Ray unpickles a watchdog's ``WatchedReplica`` and the controller's reports without
    ``__post_init__``: the watchdog checks its ``info`` again (``dataclasses.replace``) and
    the controller each report (``checked``)."""
    too_many = tuple((pid, "VLLM::Worker") for pid in range(1, MAX_ENGINE_PROCESSES + 2))
    info = copy.copy(REPLICA)
    object.__setattr__(info, "engine_processes", too_many)  # past __post_init__, as unpickling lets through
    arrived = pickle.loads(pickle.dumps(info))
    assert arrived.engine_processes == too_many
    with pytest.raises(ValueError, match="^engine_processes:"):
        dataclasses.replace(arrived)
    assert checked(arrived, WatchedReplica) is None
    report = WatchdogReport.of(REPLICA, at_s=1010.0)
    object.__setattr__(report, "engine_processes", too_many)
    assert checked(pickle.loads(pickle.dumps(report)), WatchdogReport) is None


def test_the_simulators_fluid_running_and_a_replica_started_before_the_epoch_are_reports() -> None:
    r = ReplicaReport(replica_id="fleet", deployment="D", queued=3, running=2.5, started_at_s=-60.0)
    assert (r.running, r.started_at_s) == (2.5, -60.0)


def test_a_replicas_stats_keep_their_fields() -> None:
    stats = ReplicaReport(replica_id="m1", deployment=MODEL_DEPLOYMENT).as_dict()
    assert list(stats) == [
        "replica_id",
        "deployment",
        "role",
        "queued",
        "running",
        "batches",
        "batch_size_avg",
        "batch_size_limit",
        "kv_util_pct",
        "kv_tokens_reserved",
        "kv_tokens_budget",
        "queue_wait_p95_ms",
        "engine_waiting",
        "prefix_cache_hit_pct",
        "engine_rows",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prefix_blocks",
        "gpu_util_pct",
        "vram_pct",
        "vram_used_bytes",
        "vram_total_bytes",
        "device",
        "chaos_leaked_bytes",
        "chaos_vram_leaked_bytes",
        "chaos_vram_leak",
        "chaos",
        "started_at_s",
        "ready",
        "draining",
    ]
    assert (stats["ready"], stats["draining"], stats["gpu_util_pct"]) == (True, False, None)


def test_admin_replicas_shows_the_watchdog_report_as_json() -> None:
    clock, wall = FakeClock(0), FakeClock(1_000_000)
    core = ControllerCore(load_config({}), clock=clock, wall_clock=wall)
    _, replica, watchdog, *_ = reports()
    core.report_replica(replica)
    assert core.replica_status()["replicas"][0]["watchdog"] is None  # no watchdog report yet
    core.report_watchdog(watchdog)
    (row,) = json.loads(json.dumps(core.replica_status()))["replicas"]
    assert (row["replica_id"], row["queued"], row["running"], row["chaos"]) == ("m1", 2, 8, {"latency_ms": 50})
    shown = row["watchdog"]
    assert shown["trends"] == {
        "rss_bytes": {"slope_per_h": 3.5, "r2": 0.9, "leaking": True, "time_to_limit_s": 7200.0, "short_window": False}
    }
    assert (shown["rss_bytes"], shown["heartbeat_age_s"], shown["actions_total"]) == (1e9, 0.5, {"gc_collect": 1})
    assert set(shown) == {
        "rss_bytes",
        "vram_bytes",
        "vram_total_bytes",
        "threads",
        "fds",
        "gpu_util_pct",
        "cpu_pct",
        "heartbeat_age_s",
        "stalled_s",
        "warming_up",
        "hung",
        "hung_reason",
        "severity",
        "reason",
        "action_reason",
        "ready",
        "recycle_requested",
        "critical",
        "trends",
        "actions_total",
        "engine_processes",
    }
    assert shown["engine_processes"] == []  # an engine in the replica's own process: none listed
