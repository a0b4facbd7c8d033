"""ballast.policies.control: how reports become the level's and the autoscaler's inputs, and the tick."""

from __future__ import annotations

import pytest
from fakes import FakeClock

from ballast.policies import control
from ballast.policies.autoscale import AutoscaleConfig, AutoscaleState
from ballast.policies.degradation import DegradationConfig
from ballast.policies.reports import ModelLoad, ReplicaReport

P = "Primary"


def replica(rid: str, queued: int = 0, running: int = 0, deployment: str = P, **more) -> ReplicaReport:
    return ReplicaReport(replica_id=rid, deployment=deployment, queued=queued, running=running, **more)


def router(**fields) -> ModelLoad:
    """One router's load of the model (what ``control.model_views`` gives the policies)."""
    return ModelLoad(**fields)


class TestFoldReports:
    def test_queue_is_router_inflight_minus_running_when_larger(self) -> None:
        sig = control.fold_reports([router(inflight=30)], [replica("a", queued=2, running=8)], P)
        assert sig.queue_length == 22

    def test_queue_is_replica_queue_when_larger(self) -> None:
        sig = control.fold_reports([router(inflight=5)], [replica("a", queued=4, running=8)], P)
        assert sig.queue_length == 4

    def test_fallback_replicas_do_not_count_in_the_queue_but_do_in_gpu_util(self) -> None:
        reps = [
            replica("a", queued=1, gpu_util_pct=20.0),
            replica("f", queued=50, deployment="Fallback", gpu_util_pct=60.0),
        ]
        sig = control.fold_reports([], reps, P)
        assert sig.queue_length == 1
        assert sig.gpu_util_pct == 40.0  # the mean over every replica

    def test_worst_p95_and_highest_vram(self) -> None:
        reps = [
            replica("a", queue_wait_p95_ms=100.0, vram_pct=50.0),
            replica("b", queue_wait_p95_ms=300.0, vram_pct=70.0),
        ]
        sig = control.fold_reports([router(queue_wait_p95_ms=200.0)], reps, P)
        assert (sig.queue_wait_p95_ms, sig.vram_pct) == (300.0, 70.0)

    def test_kv_is_the_mean_over_the_primary_replicas_only(self) -> None:
        reps = [
            replica("a", kv_util_pct=90.0),
            replica("b", kv_util_pct=70.0),
            replica("c"),  # no KV report: left out, not a zero
            replica("f", deployment="Fallback", kv_util_pct=0.0),
        ]
        assert control.fold_reports([], reps, P).kv_util_pct == 80.0
        assert control.fold_reports([], [replica("a")], P).kv_util_pct is None

    def test_capacity_only_while_some_gate_was_full(self) -> None:
        routers = [router(served_rps=10.0, gate_full=False), router(served_rps=15.0, gate_full=False)]
        assert control.fold_reports(routers, [], P).capacity_rps is None
        routers[1] = router(served_rps=15.0, gate_full=True)
        assert control.fold_reports(routers, [], P).capacity_rps == 25.0

    def test_demand_sums_over_routers_and_error_rate_over_the_window(self) -> None:
        routers = [
            router(demand_rps={"critical": 2.0}),
            router(demand_rps={"critical": 3.0, "sheddable": 1.0}),
        ]
        sig = control.fold_reports(routers, [], P, requests=20, errors=5)
        assert sig.demand_rps == {"critical": 5.0, "sheddable": 1.0}
        assert (sig.error_rate, sig.request_count) == (0.25, 20)
        assert control.fold_reports([], [], P).error_rate is None

    def test_the_last_two_reports_sum_over_routers_once_each_has_two(self) -> None:
        routers = [
            router(
                demand_rps={"critical": 2.0},
                demand_sustained_rps={"critical": 1.5},
                demand_recent_max_rps={"critical": 2.5},
            ),
            router(
                demand_rps={"critical": 3.0, "sheddable": 1.0},
                demand_sustained_rps={"critical": 3.0, "sheddable": 0.5},
                demand_recent_max_rps={"critical": 4.0, "sheddable": 1.0},
            ),
            router(),  # sees no demand of this model: counts for nothing, holds nothing back
        ]
        sig = control.fold_reports(routers, [], P)
        assert sig.demand_sustained_rps == {"critical": 4.5, "sheddable": 0.5}
        assert sig.demand_recent_max_rps == {"critical": 6.5, "sheddable": 1.0}
        # A router that sees demand but has not two reports of it yet: the window's mean is read.
        routers.append(router(demand_rps={"critical": 9.0}))
        sig = control.fold_reports(routers, [], P)
        assert sig.demand_sustained_rps is None and sig.demand_recent_max_rps is None
        assert sig.demand_rps == {"critical": 14.0, "sheddable": 1.0}

    def test_bad_counts_raise(self) -> None:
        with pytest.raises(ValueError, match="requests"):
            control.fold_reports([], [], P, requests=-1)


def test_ongoing_takes_gate_waiting_into_account() -> None:
    reps = [replica("a", queued=2, running=6)]
    assert control.ongoing_requests([], reps, P, queue_length=2) == 8
    assert control.ongoing_requests([router(gate_waiting=10)], reps, P, queue_length=2) == 18


def test_current_target_is_the_last_decision_once_there_is_one() -> None:
    cfg = AutoscaleConfig(min_replicas=2, max_replicas=8)
    assert control.current_target(AutoscaleState(), running_replicas=1, cfg=cfg) == 2
    assert control.current_target(AutoscaleState(), running_replicas=5, cfg=cfg) == 5
    assert control.current_target(AutoscaleState(last_desired=3), running_replicas=5, cfg=cfg) == 3


class TestControlPolicy:
    def inputs(self, queue: int = 0, ongoing: float = 0.0, surging: bool = False) -> control.ControlInputs:
        sig = control.fold_reports([], [replica("a", queued=queue)], P)
        return control.ControlInputs(signals=sig, ongoing_requests=ongoing, running_replicas=1, surging=surging)

    def test_surge_adds_one_within_max_replicas_tick_by_tick(self) -> None:
        clock = FakeClock(0)
        policy = control.ControlPolicy(DegradationConfig(), AutoscaleConfig(min_replicas=1, max_replicas=2))
        d = policy.step(self.inputs(surging=True), clock())
        assert (d.desired_replicas, d.recycle_surge, d.scale.desired_replicas) == (2, 1, 1)
        clock.advance()
        d = policy.step(self.inputs(), clock())
        assert (d.desired_replicas, d.recycle_surge) == (1, 0)
        clock.advance()
        # The autoscaler already wants max_replicas: the surge cannot go past it.
        d = policy.step(self.inputs(ongoing=1000.0, surging=True), clock())
        assert (d.scale.desired_replicas, d.desired_replicas, d.recycle_surge) == (2, 2, 0)

    def test_level_follows_the_queue(self) -> None:
        policy = control.ControlPolicy(DegradationConfig(), AutoscaleConfig())
        assert policy.step(self.inputs(queue=0), 0).level.level == 0
        assert policy.step(self.inputs(queue=10_000), 1).level.level >= 1

    def test_inputs_are_checked(self) -> None:
        sig = control.fold_reports([], [], P)
        with pytest.raises(ValueError, match="running_replicas"):
            control.ControlInputs(signals=sig, ongoing_requests=0.0, running_replicas=-1)
