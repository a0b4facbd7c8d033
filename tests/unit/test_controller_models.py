"""One level, autoscaler, error window and recycle target per model (ballast.control.controller).

A config with two models, ``a`` (the first: ``BallastModel``) and ``b``
(``BallastModel-b``), built with ``BallastConfig.model_validate``: ``load_config``
still refuses several models. Both clocks are ``FakeClock`` instances moved in whole
seconds, as in test_controller_core.py; nothing here starts Ray or sleeps.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from fakes import FakeClock

from ballast.config import BallastConfig, load_config
from ballast.control.autoscaling import autoscaling_config
from ballast.control.controller import ControllerCore
from ballast.control.snapshot import ModelState, Snapshot, SnapshotCache
from ballast.names import FALLBACK_DEPLOYMENT, MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT
from ballast.ops.cli import format_status
from ballast.policies import control
from ballast.policies.control import RoutingSummary
from ballast.policies.degradation import conservative_level
from ballast.policies.reports import MAX_REPORTED_MODELS, ModelLoad, ReplicaReport, RouterReport, checked
from ballast.router import reporter

EXPIRY_S = 3
A, B = "a", "b"
A_DEP, B_DEP = MODEL_DEPLOYMENT, f"{MODEL_DEPLOYMENT}-b"
B_FALLBACK = f"{FALLBACK_DEPLOYMENT}-b"


def settings(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "deployments": {"model": {"min_replicas": 1, "max_replicas": 4}},
        "controller": {"report_expiry_s": EXPIRY_S, "error_window_s": 10},
        "degradation": {"stable_window_s": 5},
        "autoscale": {"stable_window_s": 20, "panic_window_s": 4, "scale_down_delay_s": 5},
    }
    data.update(over)
    return data


def two_models(**over: Any) -> BallastConfig:
    """``a`` on deployments.model (1..4), ``b`` on its own deployment (2..3) with a fallback."""
    models = [
        {"name": A},
        {
            "name": B,
            "deployment": {"min_replicas": 2, "max_replicas": 3},
            "fallback": {"model": {"name": "b-small"}},
        },
    ]
    return BallastConfig.model_validate(settings(models=models, **over))


def one_model() -> BallastConfig:
    return load_config(settings(models=[{"name": A}]))


class Harness:
    def __init__(self, cfg: BallastConfig | None = None) -> None:
        self.clock = FakeClock(0)
        self.wall = FakeClock(1_000_000)
        self.core = ControllerCore(cfg or two_models(), clock=self.clock, wall_clock=self.wall)

    def advance(self, seconds: int = 1) -> None:
        self.clock.advance(seconds)
        self.wall.advance(seconds)

    def router(self, rid: str = "r1", b: ModelLoad | None = None, **fields: Any) -> dict[str, Any]:
        """A router report: ``a``'s load from ``fields`` (less the router's own tenant fields),
        ``b``'s when given (a router that sent none for ``b`` reports it idle)."""
        own = {k: fields.pop(k) for k in ("demand_tokens_per_s", "fair_charged", "fair_backlogged") if k in fields}
        models = {A: ModelLoad(**fields), **({B: b} if b is not None else {})}
        return self.core.report_router(RouterReport(router_id=rid, models=models, **own))

    def replica(self, rid: str, deployment: str, **fields: Any) -> None:
        self.core.report_replica(ReplicaReport(replica_id=rid, deployment=deployment, **fields))

    def levels(self) -> tuple[int, int]:
        snap = self.core.snapshot()
        return snap["models"][A]["level"], snap["models"][B]["level"]


@pytest.fixture
def h() -> Harness:
    return Harness()


# --------------------------------------------------------------------------- config


def test_two_models_load_and_name_their_deployments() -> None:
    cfg = two_models()
    assert [m.name for m in cfg.models] == [A, B]
    assert (cfg.deployment_name(A), cfg.deployment_name(B)) == (A_DEP, B_DEP)
    assert load_config(cfg.model_dump(mode="json")) == cfg


def test_autoscale_config_and_serves_autoscaling_config_are_each_models_own() -> None:
    cfg = two_models()
    assert (cfg.autoscale_config().min_replicas, cfg.autoscale_config().max_replicas) == (1, 4)
    assert cfg.autoscale_config(A) == cfg.autoscale_config()
    assert (cfg.autoscale_config(B).min_replicas, cfg.autoscale_config(B).max_replicas) == (2, 3)
    assert autoscaling_config(cfg) == autoscaling_config(cfg, A)
    b = autoscaling_config(cfg, B)
    assert (b["min_replicas"], b["max_replicas"], b["initial_replicas"]) == (2, 3, 2)
    assert (b["policy"]["policy_kwargs"]["min_replicas"], b["policy"]["policy_kwargs"]["max_replicas"]) == (2, 3)


# --------------------------------------------------------------------------- router reports


class TestRouterReportModels:
    def test_a_model_load_is_checked_where_it_is_built(self) -> None:
        for name, bad in [("inflight", -1), ("queue_wait_p95_ms", float("nan")), ("demand_rps", {"nope": 1.0})]:
            with pytest.raises(ValueError, match=f"^{name}:"):
                ModelLoad(**{name: bad})

    def test_models_are_named_bounded_and_model_loads(self) -> None:
        with pytest.raises(ValueError, match="^models: model name"):
            RouterReport(router_id="r", models={"": ModelLoad()})
        with pytest.raises(ValueError, match="^models: model name"):
            RouterReport(router_id="r", models={"x" * 65: ModelLoad()})
        with pytest.raises(ValueError, match="^models: 'b' must be a ModelLoad"):
            RouterReport(router_id="r", models={"b": {"inflight": 1}})  # type: ignore[dict-item]
        many = {f"m{i}": ModelLoad() for i in range(MAX_REPORTED_MODELS + 1)}
        with pytest.raises(ValueError, match=f"^models: at most {MAX_REPORTED_MODELS} models"):
            RouterReport(router_id="r", models=many)
        assert len(RouterReport(router_id="r", models=dict(list(many.items())[:-1])).models) == MAX_REPORTED_MODELS

    def test_checked_checks_an_unpickled_model_load_again(self) -> None:
        bad = copy.copy(ModelLoad(inflight=1))
        object.__setattr__(bad, "inflight", -5)  # what unpickling a foreign sender's could give
        report = RouterReport(router_id="r", models={"b": ModelLoad()})
        object.__setattr__(report, "models", {"b": bad})
        assert checked(report, RouterReport) is None
        with pytest.raises(ValueError, match=r"^models\.b\.inflight:"):
            replace(report)

    def test_each_model_is_read_from_the_models_map_alike(self) -> None:
        a = ModelLoad(inflight=7, requests=3)
        b = ModelLoad(inflight=40, errors=2, requests=9, gate_full=True, demand_rps={"critical": 1.0})
        report = RouterReport(router_id="r", models={A: a, B: b}, demand_tokens_per_s={"gold": 5.0})
        assert (report.load(A), report.load(B)) == (a, b)
        assert control.model_views([report, report], B) == [b, b]
        c = report.load("c")  # not reported by this router: no load
        assert (c.inflight, c.requests, c.queue_wait_p95_ms, c.served_rps, c.gate_full) == (0, 0, None, 0.0, False)


# --------------------------------------------------------------------------- levels


class TestLevels:
    def test_a_flooded_first_model_rises_while_the_other_stays_at_zero(self, h: Harness) -> None:
        h.replica("b1", B_DEP, queued=1, running=2)
        seen = []
        for _ in range(3):
            h.router(inflight=600, b=ModelLoad(inflight=3))
            h.replica("b1", B_DEP, queued=1, running=2)
            h.core.tick()
            seen.append(h.levels())
            h.advance()
        assert seen == [(1, 0), (4, 0), (4, 0)]
        snap = h.core.snapshot()
        assert snap["models"][A]["inputs"]["queue_length"] == 600
        assert snap["models"][B]["inputs"]["queue_length"] == 1  # its own: 3 in flight, 2 running
        assert snap["models"][B]["reason"] == "normal"
        assert not {"level", "reason", "inputs"} & set(snap)  # no model at the top level

    def test_each_models_entry_carries_the_rows_its_engines_run_usefully(self, h: Harness) -> None:
        h.replica("a1", A_DEP, engine_rows=14)
        h.replica("a2", A_DEP, engine_rows=9)
        h.replica("b1", B_DEP)  # an engine Ballast batches: its slots bound it
        h.router()
        h.core.tick()
        snap = h.core.snapshot()
        assert (snap["models"][A]["engine_rows"], snap["models"][B]["engine_rows"]) == (23, None)
        ceiling = reporter.model_ceiling(h.core.cfg, Snapshot.from_dict(snap), model=A)
        assert ceiling == 23  # not 2 replicas x max_ongoing_requests
        h.replica("a2", A_DEP)  # a replica whose engine has not said yet: no cap from the engines
        h.core.tick()
        snap = h.core.snapshot()
        assert snap["models"][A]["engine_rows"] is None
        slots = 2 * h.core.cfg.deployment_of(A).max_ongoing_requests
        assert reporter.model_ceiling(h.core.cfg, Snapshot.from_dict(snap), model=A) == slots

    def test_a_flooded_second_model_rises_while_the_first_stays_at_zero(self, h: Harness) -> None:
        seen = []
        for _ in range(3):
            h.router(inflight=2, b=ModelLoad(inflight=250, queue_wait_p95_ms=100.0))
            h.core.tick()
            seen.append(h.levels())
            h.advance()
        assert seen == [(0, 1), (0, 3), (0, 3)]
        snap = h.core.snapshot()
        assert snap["models"][A]["level"] == 0 and snap["models"][A]["inputs"]["queue_length"] == 2
        assert snap["models"][B]["target_level"] == 3
        assert snap["models"][B]["constraints"] == h.core.cfg.degradation_config().constraints[3].to_dict()

    def test_the_flood_goes_and_only_that_models_level_walks_down(self, h: Harness) -> None:
        for _ in range(2):
            h.router(b=ModelLoad(inflight=600))
            h.core.tick()
            h.advance()
        assert h.levels() == (0, 4)
        seen = []
        for _ in range(7):  # quiet: down to 0 after one stable window (5 s)
            h.router(b=ModelLoad(inflight=0))
            h.core.tick()
            seen.append(h.levels())
            h.advance()
        assert seen == [(0, 4)] * 5 + [(0, 0)] * 2

    def test_each_models_error_window_counts_its_own_outcomes(self, h: Harness) -> None:
        for _ in range(5):
            h.router(requests=10, errors=0, b=ModelLoad(requests=10, errors=6))
        assert h.core.signals(A).error_rate == 0.0 and h.core.signals(A).request_count == 50
        assert h.core.signals(B).error_rate == pytest.approx(0.6) and h.core.signals(B).request_count == 50

    def test_gpu_signals_come_from_the_models_own_replicas_and_its_fallbacks(self, h: Harness) -> None:
        h.replica("a1", A_DEP, gpu_util_pct=90.0, vram_pct=95.0)
        h.replica("b1", B_DEP, gpu_util_pct=10.0, vram_pct=20.0)
        h.replica("bf", B_FALLBACK, gpu_util_pct=30.0, vram_pct=40.0)
        a, b = h.core.signals(A), h.core.signals(B)
        assert (a.gpu_util_pct, a.vram_pct) == (90.0, 95.0)
        assert (b.gpu_util_pct, b.vram_pct) == (20.0, 40.0)


# --------------------------------------------------------------------------- replicas


class TestReplicas:
    def test_quiet_models_sit_at_their_own_minimum(self, h: Harness) -> None:
        snap = h.core.tick()
        assert snap.desired_replicas == {A_DEP: 1, B_DEP: 2}
        assert snap.running_replicas == {A_DEP: 0, B_DEP: 0, B_FALLBACK: 0, ROUTER_DEPLOYMENT: 0}
        assert set(snap.autoscale) == {A_DEP, B_DEP}

    def test_each_model_scales_within_its_own_maximum(self, h: Harness) -> None:
        h.replica("a1", A_DEP, running=1)
        h.replica("b1", B_DEP, running=40, queued=40)
        snap = h.core.tick()
        assert snap.desired_replicas == {A_DEP: 1, B_DEP: 3}
        assert snap.autoscale[B_DEP]["ongoing_requests"] == 80
        assert snap.autoscale[A_DEP]["ongoing_requests"] == 1
        assert snap.running_replicas[A_DEP] == snap.running_replicas[B_DEP] == 1

    def test_gate_waiters_of_a_model_scale_that_model(self, h: Harness) -> None:
        h.router(b=ModelLoad(gate_waiting=50))
        snap = h.core.tick()
        assert snap.desired_replicas == {A_DEP: 1, B_DEP: 3}

    def test_the_recycler_sees_every_deployment_with_its_models_level(self, h: Harness) -> None:
        calls = []
        real = h.core.recycler.tick

        def spy(replicas, watchdogs, targets, level, ceilings=None):  # type: ignore[no-untyped-def]
            calls.append((dict(targets), dict(level), dict(ceilings or {})))
            real(replicas, watchdogs, targets, level, ceilings)

        h.core.recycler.tick = spy  # type: ignore[method-assign]
        for _ in range(2):
            h.router(b=ModelLoad(inflight=600))
            h.core.tick()
            h.advance()
        targets, levels, ceilings = calls[-1]
        assert targets == {A_DEP: 1, B_DEP: 3, B_FALLBACK: 1}  # b scaled up for its flood
        assert ceilings == {A_DEP: 4, B_DEP: 3, B_FALLBACK: 1}
        assert levels == {A_DEP: 0, B_DEP: 4, B_FALLBACK: 4}
        assert h.core.deployments() == [A_DEP, B_DEP, B_FALLBACK]


def test_a_recycle_is_held_by_its_own_models_level_only() -> None:
    from ballast.policies.recycle import RecycleConfig, RecycleState, ReplicaView, plan

    cfg = RecycleConfig(max_age_s=100.0, jitter_ratio=0.0, min_available=0, block_at_level=3)
    in_window = 3.0  # the default window: 02:00-05:00
    old = [ReplicaView("a1", A_DEP, 0.0, True), ReplicaView("b1", B_DEP, 0.0, True)]
    p, _ = plan(old, {A_DEP: 1, B_DEP: 1}, RecycleState(), {A_DEP: 0, B_DEP: 3}, cfg, 1000.0, in_window)
    assert [o.replica_id for o in p.start] == ["a1"]
    assert list(p.waiting) == [("b1", "level")]
    # A deployment no level names takes the highest.
    p, _ = plan(old, {A_DEP: 1, B_DEP: 1}, RecycleState(), {B_DEP: 3}, cfg, 1000.0, in_window)
    assert p.start == () and len(p.waiting) == 2
    with pytest.raises(ValueError, match=r"^level\['b'\]:"):
        plan(old, {}, RecycleState(), {"b": -1}, cfg, 1000.0, in_window)


def test_a_sheddable_tenants_lease_shrinks_by_the_highest_models_level() -> None:
    tenants = {"free": {"rate_tokens_per_s": 100, "sheddable": True}}
    h = Harness(two_models(tenants=tenants, quota={"lend_at_levels": [0], "min_share_ratio": 0.0}))
    assert h.router(demand_tokens_per_s={"free": 10.0})["leases"]["free"]["rate_tokens_per_s"] == 100.0
    for _ in range(2):
        h.router(demand_tokens_per_s={"free": 10.0}, b=ModelLoad(inflight=250, queue_wait_p95_ms=1.0))
        h.core.tick()
        h.advance()
    assert h.levels() == (0, 3)
    lease = h.router(demand_tokens_per_s={"free": 10.0})["leases"]["free"]
    assert lease["rate_tokens_per_s"] == pytest.approx(25.0)  # level_factors[3]: b's level, not a's


# --------------------------------------------------------------------------- snapshot


class TestSnapshot:
    def test_the_first_snapshot_names_every_model_starting(self, h: Harness) -> None:
        snap = Snapshot.from_dict(h.core.snapshot())
        assert set(snap.models) == {A, B}
        level_0 = h.core.cfg.degradation_config().constraints[0]
        for name, dep in [(A, A_DEP), (B, B_DEP)]:
            assert snap.models[name] == ModelState(dep, level_0, level=0, target_level=0, reason="starting")
            assert snap.models[name].inputs is None and snap.models[name].routing == RoutingSummary()

    def test_to_dict_from_dict_round_trip_carries_models(self, h: Harness) -> None:
        h.router(b=ModelLoad(inflight=250))
        snap = h.core.tick()
        back = Snapshot.from_dict(snap.to_dict())
        assert back == snap
        b = back.models[B]
        assert b.inputs is not None and b.inputs.queue_length == 250 and b.level == 1
        assert back.models[A].inputs is not None and back.models[A].inputs.queue_length == 0
        # A newer controller's extra keys are ignored; an older one's snapshot has no models.
        assert Snapshot.from_dict({**snap.to_dict(), "newer": 1}) == snap
        older = {k: v for k, v in snap.to_dict().items() if k != "models"}
        assert Snapshot.from_dict(older).models == {}

    def test_a_one_model_config_has_that_model_alone_in_the_map(self) -> None:
        h = Harness(one_model())
        h.router(inflight=120)
        snap = h.core.tick()
        assert list(snap.models) == [A]
        entry = snap.models[A]
        assert entry.deployment == MODEL_DEPLOYMENT
        assert snap.desired_replicas == {MODEL_DEPLOYMENT: 4}  # 120 in flight
        assert snap.running_replicas == {MODEL_DEPLOYMENT: 0, ROUTER_DEPLOYMENT: 1}
        assert entry.level == 1 and entry.inputs is not None and entry.inputs.queue_length == 120


class TestEffective:
    STALE_S, MAX_STALE_S, FLOOR = 2, 10, 1

    def cache(self, h: Harness) -> SnapshotCache:
        cache = SnapshotCache(
            h.core.cfg.degradation_config(), self.STALE_S, self.MAX_STALE_S, self.FLOOR, wall_clock=h.wall
        )
        assert cache.offer(Snapshot.from_dict(h.core.snapshot()))
        return cache

    def flood_b(self, h: Harness) -> None:
        for _ in range(2):
            h.router(b=ModelLoad(inflight=600))
            h.core.tick()
            h.advance()
        assert h.levels() == (0, 4)

    def test_each_model_gets_its_own_level_and_constraints(self, h: Harness) -> None:
        self.flood_b(h)
        cache = self.cache(h)
        deg = h.core.cfg.degradation_config()
        a, b = cache.effective(A), cache.effective(B)
        assert (a.level, a.constraints, a.source) == (0, deg.constraints[0], "snapshot")
        assert (b.level, b.constraints, b.source) == (4, deg.constraints[4], "snapshot")
        unknown = cache.effective("unknown")  # a model the snapshot does not name: fail-static at once
        assert (unknown.level, unknown.source) == (conservative_level(None, self.FLOOR), "fail-static")

    def test_fail_static_per_model_from_each_models_last_level(self, h: Harness) -> None:
        self.flood_b(h)
        cache = self.cache(h)
        seen = []
        for _ in range(self.MAX_STALE_S + 2):  # the controller is gone: no new snapshot
            h.advance()
            seen.append((cache.effective(A).source, cache.effective(A).level, cache.effective(B).level))
        age = self.MAX_STALE_S  # the snapshot was 1 s old when the walk began
        assert seen[: self.STALE_S - 1] == [("snapshot", 0, 4)] * (self.STALE_S - 1)
        assert seen[age - 2] == ("stale-snapshot", 0, 4)
        fail_static = ("fail-static", conservative_level(0, self.FLOOR), conservative_level(4, self.FLOOR))
        assert seen[age - 1 :] == [fail_static] * 3
        assert fail_static[1:] == (1, 4)


# --------------------------------------------------------------------------- redeploy


class TestConfigure:
    def test_a_redeploy_dropping_a_model_drops_its_state_and_keeps_the_others(self, h: Harness) -> None:
        for _ in range(2):
            h.router(inflight=600, requests=10, errors=5, b=ModelLoad(inflight=600))
            h.core.tick()
            h.advance()
        assert h.levels() == (4, 4)
        h.core.configure(one_model())
        assert h.core.deployments() == [A_DEP]
        assert h.core.signals(A).request_count == 20  # a's error window stays
        with pytest.raises(KeyError):
            h.core.signals(B)
        snap = h.core.tick()
        assert list(snap.models) == [A] and snap.models[A].level == 4  # a kept its level (no reports: walking down)
        assert set(snap.desired_replicas) == {A_DEP} and B_DEP not in snap.running_replicas
        # b comes back: it starts afresh, at level 0 and its minimum.
        h.core.configure(two_models())
        h.router(b=ModelLoad(inflight=0))
        snap = h.core.tick()
        assert (snap.models[B].level, snap.models[B].reason) == (0, "normal")
        assert h.core.signals(B).request_count == 0
        assert snap.desired_replicas[B_DEP] == 2

    def test_a_kept_models_last_target_is_brought_within_its_new_bounds(self, h: Harness) -> None:
        h.replica("b1", B_DEP, running=40, queued=40)
        assert h.core.tick().desired_replicas[B_DEP] == 3
        models = [{"name": A}, {"name": B, "deployment": {"min_replicas": 1, "max_replicas": 2}}]
        h.core.configure(BallastConfig.model_validate(settings(models=models)))
        h.replica("b1", B_DEP, running=40, queued=40)
        assert h.core.tick().desired_replicas[B_DEP] == 2


# --------------------------------------------------------------------------- ballast status


def test_status_shows_one_block_per_model() -> None:
    h = Harness()
    for _ in range(2):
        h.router(b=ModelLoad(inflight=600))
        h.replica("b1", B_DEP)
        h.core.tick()
        h.advance()
    snap = h.core.snapshot()
    doc = {
        "snapshot": {k: snap[k] for k in ("epoch", "version", "models")},
        "replicas": {
            dep: {"desired": snap["desired_replicas"].get(dep), "running": snap["running_replicas"].get(dep)}
            for dep in set(snap["desired_replicas"]) | set(snap["running_replicas"])
        },
    }
    lines = format_status(doc).splitlines()
    a, b = (
        lines.index(f"model a: level 0: {snap['models'][A]['reason']}"),
        lines.index(f"model b: level 4: {snap['models'][B]['reason']}"),
    )
    assert lines[a + 2 : a + 3] == ["  replicas running / desired: 0 / 1 (BallastModel)"]
    assert lines[b + 2 : b + 3] == ["  replicas running / desired: 1 / 3 (BallastModel-b)"]
    assert lines[b + 1].startswith("  inputs: queue_length 600")
