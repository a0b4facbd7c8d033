"""ballast.control.controller.ControllerCore: reports in, signals and snapshots out, no Ray.

Both clocks are ``FakeClock`` instances moved in whole seconds: ``clock`` (the
monotonic clock that ages reports and outcomes, and drives the policies) and
``wall_clock`` (what snapshots are stamped with). Importing the module defines
the ``Controller`` actor class but starts nothing.
"""

from __future__ import annotations

import copy
import json
from typing import Any, TypeVar

import pytest
from fakes import FakeClock

from ballast.config import BallastConfig, load_config
from ballast.control.controller import MAX_OUTCOME_BUCKETS, MAX_SENDERS, ControllerCore
from ballast.control.snapshot import Snapshot
from ballast.names import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT
from ballast.policies.reports import ModelLoad, ReplicaReport, RouterReport

MODEL = "tiny-decoder"  # the config's one model
#: A router report's own fields; every other field a test names is the model's load.
ROUTER_FIELDS = frozenset({"demand_tokens_per_s", "fair_charged", "fair_backlogged"})
EXPIRY_S = 3
ERROR_WINDOW_S = 10
DEG_WINDOW_S = 5

T = TypeVar("T")


def tampered(report: T, **fields: Any) -> T:
    """A copy of ``report`` with ``fields`` set past its check, as a foreign sender's could arrive
    (unpickling does not run ``__post_init__``)."""
    bad = copy.copy(report)
    for name, value in fields.items():
        object.__setattr__(bad, name, value)
    return bad


def make_cfg(**over: Any) -> BallastConfig:
    data: dict[str, Any] = {
        "deployments": {"model": {"min_replicas": 1, "max_replicas": 4}},
        "controller": {"report_expiry_s": EXPIRY_S, "error_window_s": ERROR_WINDOW_S},
        "degradation": {"stable_window_s": DEG_WINDOW_S},
        "autoscale": {"stable_window_s": 20, "panic_window_s": 4, "scale_down_delay_s": 5},
    }
    data.update(over)
    return load_config(data)


def router_report(rid: str, **fields: Any) -> RouterReport:
    load = ModelLoad(**{k: v for k, v in fields.items() if k not in ROUTER_FIELDS})
    return RouterReport(router_id=rid, models={MODEL: load}, **{k: v for k, v in fields.items() if k in ROUTER_FIELDS})


class Harness:
    def __init__(self, cfg: BallastConfig | None = None) -> None:
        self.clock = FakeClock(0)
        self.wall = FakeClock(1_000_000)
        self.core = ControllerCore(cfg or make_cfg(), clock=self.clock, wall_clock=self.wall)

    def advance(self, seconds: int = 1) -> None:
        self.clock.advance(seconds)
        self.wall.advance(seconds)

    def router(self, rid: str, **fields: Any) -> dict[str, Any]:
        """Router ``rid``'s report: its own ``ROUTER_FIELDS``, the rest the model's load."""
        return self.core.report_router(router_report(rid, **fields))

    def replica(self, rid: str, **fields: Any) -> dict[str, Any]:
        return self.core.report_replica(ReplicaReport(replica_id=rid, deployment=MODEL_DEPLOYMENT, **fields))


@pytest.fixture
def h() -> Harness:
    return Harness()


# --------------------------------------------------------------------------- signals


class TestSignals:
    def test_no_reports_means_no_load_and_absent_signals(self, h: Harness) -> None:
        sig = h.core.signals(MODEL)
        assert sig.queue_length == 0
        assert sig.queue_wait_p95_ms is None
        assert sig.gpu_util_pct is None
        assert sig.vram_pct is None
        assert sig.error_rate is None
        assert sig.request_count == 0

    def test_queue_is_router_inflight_minus_replica_running(self, h: Harness) -> None:
        h.router("r1", inflight=30)
        h.router("r2", inflight=20)
        h.replica("m1", running=10, queued=3)
        h.replica("m2", running=5, queued=4)
        assert h.core.signals(MODEL).queue_length == 50 - 15

    def test_queue_is_replica_queued_when_that_is_larger(self, h: Harness) -> None:
        h.router("r1", inflight=5)
        h.replica("m1", running=10, queued=3)
        h.replica("m2", running=5, queued=4)
        assert h.core.signals(MODEL).queue_length == 7

    def test_queue_without_routers_is_replica_queued(self, h: Harness) -> None:
        h.replica("m1", running=10, queued=3)
        h.replica("m2", running=0, queued=9)
        assert h.core.signals(MODEL).queue_length == 12

    def test_queue_is_never_negative(self, h: Harness) -> None:
        h.router("r1", inflight=0)
        h.replica("m1", running=8, queued=0)
        assert h.core.signals(MODEL).queue_length == 0

    def test_a_senders_latest_report_replaces_its_previous_one(self, h: Harness) -> None:
        h.replica("m1", queued=40)
        h.replica("m1", queued=6)
        assert h.core.signals(MODEL).queue_length == 6

    def test_queue_wait_is_the_worst_p95_of_routers_and_replicas(self, h: Harness) -> None:
        h.router("r1", inflight=0, queue_wait_p95_ms=120.0)
        h.router("r2", inflight=0, queue_wait_p95_ms=None)
        h.replica("m1", queue_wait_p95_ms=480.5)
        h.replica("m2", queue_wait_p95_ms=30.0)
        assert h.core.signals(MODEL).queue_wait_p95_ms == 480.5

    def test_gpu_util_is_the_mean_over_replicas_that_report_it(self, h: Harness) -> None:
        h.replica("m1", gpu_util_pct=90.0, vram_pct=40.0)
        h.replica("m2", gpu_util_pct=60.0, vram_pct=70.0)
        h.replica("cpu", gpu_util_pct=None, vram_pct=None)  # absent, not zero
        sig = h.core.signals(MODEL)
        assert sig.gpu_util_pct == 75.0
        assert sig.vram_pct == 70.0

    def test_a_single_gpu_replica_is_not_diluted_by_cpu_replicas(self, h: Harness) -> None:
        h.replica("gpu", gpu_util_pct=96.0, vram_pct=98.0)
        h.replica("cpu1")
        h.replica("cpu2", gpu_util_pct=None)
        sig = h.core.signals(MODEL)
        assert sig.gpu_util_pct == 96.0
        assert sig.vram_pct == 98.0

    def test_gpu_signals_are_none_when_no_replica_reports_them(self, h: Harness) -> None:
        h.replica("m1", gpu_util_pct=None, vram_pct=None, queued=1)
        h.replica("m2", queued=1)
        sig = h.core.signals(MODEL)
        assert sig.gpu_util_pct is None
        assert sig.vram_pct is None

    def test_routers_report_no_gpu_fields(self, h: Harness) -> None:
        with pytest.raises(TypeError, match="gpu_util_pct"):
            ModelLoad(gpu_util_pct=99.0)  # type: ignore[call-arg]
        h.router("r1", inflight=0)
        sig = h.core.signals(MODEL)
        assert (sig.gpu_util_pct, sig.vram_pct) == (None, None)


class TestExpiry:
    def test_a_report_counts_until_report_expiry_s_then_drops(self, h: Harness) -> None:
        h.replica("m1", queued=80, gpu_util_pct=50.0)
        for age in range(0, EXPIRY_S + 1):
            assert h.core.signals(MODEL).queue_length == 80, f"age {age}s"
            assert h.core.signals(MODEL).gpu_util_pct == 50.0
            h.advance()
        # age EXPIRY_S + 1: gone.
        sig = h.core.signals(MODEL)
        assert sig.queue_length == 0
        assert sig.gpu_util_pct is None

    def test_a_sender_that_keeps_reporting_stays_and_a_silent_one_goes(self, h: Harness) -> None:
        h.replica("steady", queued=1)
        h.replica("silent", queued=10)
        expected = {0: 11, 1: 11, 2: 11, 3: 11, 4: 1, 5: 1, 6: 1}
        for t in range(0, 7):
            if t % 2 == 0:
                h.replica("steady", queued=1)
            assert h.core.signals(MODEL).queue_length == expected[t], f"t={t}"
            h.advance()

    def test_expired_router_no_longer_counts_as_running(self, h: Harness) -> None:
        h.router("r1", inflight=3)
        h.core.tick()
        assert h.core.snapshot()["running_replicas"][ROUTER_DEPLOYMENT] == 1
        h.advance(EXPIRY_S + 1)
        snap = h.core.tick()
        assert snap.running_replicas[ROUTER_DEPLOYMENT] == 0


class TestErrorRate:
    def test_error_rate_over_the_window_walked_second_by_second(self, h: Harness) -> None:
        observed = []
        for t in range(0, 17):
            if t == 0:
                h.router("r1", inflight=0, requests=10, errors=5)
            if t == 5:
                h.router("r1", inflight=0, requests=10, errors=0)
            sig = h.core.signals(MODEL)
            observed.append((t, sig.request_count, sig.error_rate))
            h.advance()
        # Each bucket counts while its age <= ERROR_WINDOW_S (10 s).
        expected = (
            [(t, 10, 0.5) for t in range(0, 5)]
            + [(t, 20, 0.25) for t in range(5, 11)]
            + [(t, 10, 0.0) for t in range(11, 16)]
            + [(16, 0, None)]
        )
        assert observed == expected

    def test_reports_without_requests_add_no_bucket(self, h: Harness) -> None:
        h.router("r1", inflight=4, requests=0, errors=0)
        h.router("r2", inflight=4)
        sig = h.core.signals(MODEL)
        assert (sig.request_count, sig.error_rate) == (0, None)

    def test_outcomes_of_all_routers_add_up(self, h: Harness) -> None:
        h.router("r1", inflight=0, requests=30, errors=3)
        h.router("r2", inflight=0, requests=10, errors=9)
        sig = h.core.signals(MODEL)
        assert sig.request_count == 40
        assert sig.error_rate == pytest.approx(12 / 40)

    def test_a_high_error_rate_with_enough_requests_raises_the_level(self, h: Harness) -> None:
        h.replica("m1")
        h.router("r1", inflight=0, requests=19, errors=19)
        assert h.core.tick().models[MODEL].level == 0  # below error_rate_min_requests (20): noise
        h.router("r1", inflight=0, requests=1, errors=1)
        snap = h.core.tick()
        assert snap.models[MODEL].level == 1  # one level on the first sample that asks
        assert snap.models[MODEL].reason.startswith("up 0->1: error_rate=1>=0.1")
        h.advance()
        h.replica("m1")
        snap = h.core.tick()  # still asked a second later: all the way
        assert snap.models[MODEL].level == 3
        assert snap.models[MODEL].reason.startswith("up 1->3: error_rate=1>=0.1")


# --------------------------------------------------------------------------- tick: level


class TestLevel:
    def test_initial_snapshot_is_level_zero_version_one(self, h: Harness) -> None:
        s = h.core.snapshot()
        assert (s["version"], s["models"][MODEL]["level"], s["models"][MODEL]["reason"]) == (1, 0, "starting")
        assert s["epoch"] == h.core.epoch
        assert s["created_at_s"] == 1_000_000

    def test_big_queue_raises_the_level_in_two_reports(self, h: Harness) -> None:
        h.replica("m1", queued=600)
        assert (h.core.tick().models[MODEL].level, h.core.snapshot()["models"][MODEL]["target_level"]) == (1, 4)
        h.advance()
        h.replica("m1", queued=600)
        snap = h.core.tick()
        assert snap.models[MODEL].level == 4
        assert snap.models[MODEL].target_level == 4
        assert snap.models[MODEL].inputs.queue_length == 600
        assert snap.models[MODEL].constraints == h.core.cfg.degradation_config().constraints[4]

    @pytest.mark.parametrize("queued, level", [(49, 0), (50, 1), (100, 2), (199, 2), (200, 3), (500, 4)])
    def test_level_follows_the_queue_thresholds(self, h: Harness, queued: int, level: int) -> None:
        h.replica("m1", queued=queued)
        assert h.core.tick().models[MODEL].level == min(level, 1)
        h.advance()
        h.replica("m1", queued=queued)
        assert h.core.tick().models[MODEL].level == level

    def reach(self, h: Harness, queued: int) -> int:
        for _ in range(2):
            h.replica("m1", queued=queued)
            level = h.core.tick().models[MODEL].level
            h.advance()
        return level

    def test_steps_down_to_the_target_in_one_stable_window_tick_by_tick(self, h: Harness) -> None:
        assert self.reach(h, 600) == 4
        levels = []
        for _ in range(DEG_WINDOW_S + 2):
            h.replica("m1", queued=0)
            levels.append(h.core.tick().models[MODEL].level)
            h.advance()
        # Quiet from the first tick here: after DEG_WINDOW_S seconds of it, straight to 0.
        assert levels == [4] * DEG_WINDOW_S + [0, 0]

    def test_an_interrupted_streak_starts_again(self, h: Harness) -> None:
        assert self.reach(h, 250) == 3
        levels = []
        for t in range(1, 12):
            # Quiet, except at t=3 where the queue is back at level 3's threshold.
            h.replica("m1", queued=250 if t == 3 else 0)
            levels.append(h.core.tick().models[MODEL].level)
            h.advance()
        # Streak t=1,2 broken at t=3; restarts at t=4, drops at t=4+5=9.
        assert levels == [3, 3, 3, 3, 3, 3, 3, 3, 0, 0, 0]

    def test_a_spike_during_a_quiet_streak_holds_the_level_and_restarts_it(self, h: Harness) -> None:
        assert self.reach(h, 120) == 2
        for _ in range(DEG_WINDOW_S - 1):
            h.replica("m1", queued=0)
            assert h.core.tick().models[MODEL].level == 2
            h.advance()
        h.replica("m1", queued=600)  # one report: one level up, the quiet streak is gone
        assert h.core.tick().models[MODEL].level == 3
        h.advance()
        levels = []
        for _ in range(DEG_WINDOW_S + 1):
            h.replica("m1", queued=0)
            levels.append(h.core.tick().models[MODEL].level)
            h.advance()
        assert levels == [3] * DEG_WINDOW_S + [0]

    def test_when_the_reports_expire_the_level_walks_down(self, h: Harness) -> None:
        h.replica("m1", queued=600)
        h.core.tick()
        h.advance()
        h.replica("m1", queued=600)
        assert h.core.tick().models[MODEL].level == 4
        levels = []
        for _ in range(EXPIRY_S + DEG_WINDOW_S + 1):
            h.advance()
            levels.append(h.core.tick().models[MODEL].level)  # no new reports at all
        # Report counts through age EXPIRY_S; the quiet streak starts the tick after.
        assert levels == [4] * (EXPIRY_S + DEG_WINDOW_S) + [0]


class TestSnapshots:
    def test_versions_increase_by_one_per_tick_and_carry_the_wall_clock(self, h: Harness) -> None:
        versions, stamps = [], []
        for _ in range(5):
            h.advance()
            s = h.core.tick()
            versions.append(s.version)
            stamps.append(s.created_at_s)
            assert s.epoch == h.core.epoch
        assert versions == [2, 3, 4, 5, 6]
        assert stamps == [1_000_001, 1_000_002, 1_000_003, 1_000_004, 1_000_005]

    def test_reports_return_the_latest_published_snapshot(self, h: Harness) -> None:
        h.core.tick()
        assert h.router("r1", inflight=0)["version"] == 2
        assert h.replica("m1")["version"] == 2
        h.core.tick()
        assert h.router("r1", inflight=0)["version"] == 3
        assert h.core.snapshot()["version"] == 3

    def test_a_new_core_has_a_new_epoch_and_starts_over(self) -> None:
        a, b = Harness(), Harness()
        assert a.core.epoch != b.core.epoch
        assert b.core.snapshot()["version"] == 1

    def test_snapshot_dict_round_trips(self, h: Harness) -> None:
        from ballast.control.snapshot import Snapshot

        h.replica("m1", queued=120, running=4)
        snap = h.core.tick()
        assert Snapshot.from_dict(h.core.snapshot()) == snap


# --------------------------------------------------------------------------- tick: replicas


class TestDesiredReplicas:
    def test_quiet_stays_at_min(self, h: Harness) -> None:
        for _ in range(5):
            h.replica("m1", queued=0, running=0)
            assert h.core.tick().desired_replicas == {MODEL_DEPLOYMENT: 1}
            h.advance()

    def test_desired_rises_under_load(self, h: Harness) -> None:
        h.replica("m1", queued=20, running=8)
        snap = h.core.tick()
        # ongoing = 28 -> ceil(28 / 8) = 4 in the panic window, >= 2x current.
        assert snap.desired_replicas[MODEL_DEPLOYMENT] == 4
        assert snap.autoscale[MODEL_DEPLOYMENT]["mode"] == "panic"
        assert snap.autoscale[MODEL_DEPLOYMENT]["ongoing_requests"] == 28
        assert snap.running_replicas[MODEL_DEPLOYMENT] == 1

    def test_router_backlog_counts_as_ongoing(self, h: Harness) -> None:
        h.router("r1", inflight=24)
        h.replica("m1", queued=0, running=8)
        snap = h.core.tick()
        # queue = 24 - 8 = 16 waiting; ongoing = 16 + 8 running.
        assert snap.autoscale[MODEL_DEPLOYMENT]["ongoing_requests"] == 24
        assert snap.desired_replicas[MODEL_DEPLOYMENT] == 3

    def test_gate_waiters_count_for_the_autoscaler_but_not_as_the_levels_queue(self, h: Harness) -> None:
        h.router("r1", inflight=8, gate_waiting=60)
        h.replica("m1", queued=0, running=8)
        snap = h.core.tick()
        # 60 waiting at the gate: demand the autoscaler must see (ongoing 68) ...
        assert snap.autoscale[MODEL_DEPLOYMENT]["ongoing_requests"] == 68
        assert snap.desired_replicas[MODEL_DEPLOYMENT] == 4
        # ... but not a queue for the level (the gate refuses each by its deadline).
        assert snap.models[MODEL].inputs.queue_length == 0 and snap.models[MODEL].level == 0

    def test_only_model_replicas_count_as_running_model_replicas(self, h: Harness) -> None:
        h.core.report_replica(ReplicaReport(replica_id="x", deployment="Other", queued=0))
        h.replica("m1")
        h.replica("m2")
        assert h.core.tick().running_replicas[MODEL_DEPLOYMENT] == 2

    def test_desired_stays_within_min_and_max_under_any_load(self, h: Harness) -> None:
        loads = [0, 500, 3, 0, 0, 10_000, 1, 0] * 8
        desired = []
        for t, q in enumerate(loads):
            h.replica("m1", queued=q, running=min(q, 8))
            d = h.core.tick().desired_replicas[MODEL_DEPLOYMENT]
            assert 1 <= d <= 4, f"t={t}: {d}"
            desired.append(d)
            h.advance()
        # Quiet first tick at min; then the bursts keep re-triggering panic: held at max.
        assert desired == [1] + [4] * (len(loads) - 1)

    def test_scales_down_one_step_per_delay_once_quiet(self, h: Harness) -> None:
        h.replica("m1", queued=100, running=8)
        assert h.core.tick().desired_replicas[MODEL_DEPLOYMENT] == 4
        desired = []
        for _ in range(40):
            h.advance()
            h.replica("m1", queued=0, running=0)
            desired.append(h.core.tick().desired_replicas[MODEL_DEPLOYMENT])
        # t=1..40. Panic (triggered at t=0) holds 4 until t=20 (one stable window);
        # the quiet streak starts then and each step down waits scale_down_delay_s (5 s).
        assert desired == [4] * 24 + [3] * 5 + [2] * 5 + [1] * 6


# --------------------------------------------------------------------------- bounds


class TestBounded:
    def test_router_map_is_capped_at_max_senders_oldest_evicted(self, h: Harness) -> None:
        extra = 100
        for i in range(MAX_SENDERS + extra):
            h.router(f"r{i}", inflight=i)
        kept = range(extra, MAX_SENDERS + extra)  # r0..r99 evicted
        assert h.core.signals(MODEL).queue_length == sum(kept)
        assert h.core.tick().running_replicas[ROUTER_DEPLOYMENT] == MAX_SENDERS

    def test_replica_map_is_capped_at_max_senders(self, h: Harness) -> None:
        for i in range(MAX_SENDERS + 10):
            h.replica(f"m{i}", queued=1)
        assert h.core.signals(MODEL).queue_length == MAX_SENDERS
        assert h.core.tick().running_replicas[MODEL_DEPLOYMENT] == MAX_SENDERS

    def test_a_re_reporting_sender_is_not_the_oldest(self, h: Harness) -> None:
        for i in range(MAX_SENDERS):
            h.router(f"r{i}", inflight=0)
        h.router("r0", inflight=1000)  # moves to the back
        h.router("new", inflight=0)  # evicts r1, not r0
        assert h.core.signals(MODEL).queue_length == 1000

    def test_outcome_buckets_are_capped(self, h: Harness) -> None:
        for _i in range(MAX_OUTCOME_BUCKETS + 50):
            h.router("r1", inflight=0, requests=1, errors=0)
        assert h.core.signals(MODEL).request_count == MAX_OUTCOME_BUCKETS


class TestConfigure:
    def test_configure_swaps_thresholds_forgets_reports_and_keeps_the_models_level(self, h: Harness) -> None:
        h.replica("m1", queued=60)
        assert h.core.tick().models[MODEL].level == 1
        v = h.core.snapshot()["version"]
        h.core.configure(make_cfg(degradation={"queue_length_thresholds": [10, 20, 30, 40]}))
        assert h.core.signals(MODEL).queue_length == 0  # old reports gone
        h.replica("m1", queued=60)
        snap = h.core.tick()
        state = snap.models[MODEL]
        assert (state.level, state.target_level) == (2, 4)  # the model stays: one level up from where it was
        assert snap.version == v + 1  # versions keep rising within the epoch
        h.advance()
        h.replica("m1", queued=60)
        assert h.core.tick().models[MODEL].level == 4


def test_demand_by_criticality_sums_over_routers_and_capacity_needs_a_full_gate(h: Harness) -> None:
    h.router(
        "a", demand_rps={"critical": 20.0, "sheddable_plus": 40.0, "sheddable": 70.0}, served_rps=20.0, gate_full=True
    )
    h.router("b", demand_rps={"critical": 8.0, "sheddable_plus": 2.0}, served_rps=15.0, gate_full=False)
    h.replica("m1")  # serving: no capacity gap
    sig = h.core.signals(MODEL)
    assert sig.demand_rps == {"critical": 28.0, "sheddable_plus": 42.0, "sheddable": 70.0}
    assert sig.capacity_rps == 35.0  # both routers' answers, measured while a gate was full
    snap = h.core.tick()
    assert snap.models[MODEL].level == 1 and snap.models[MODEL].reason.startswith("up 0->1: demand=70>=38.5")
    assert snap.models[MODEL].inputs.demand_rps["sheddable"] == 70.0
    # No gate full: no capacity figure, and demand alone asks for nothing.
    h.router("a", demand_rps={"sheddable": 500.0}, served_rps=20.0, gate_full=False)
    assert h.core.signals(MODEL).capacity_rps is None


def test_the_edge_ceiling_is_published_once_a_gate_was_measured_full(h: Harness) -> None:
    h.replica("m1")
    h.router("a", demand_rps={"sheddable": 10.0}, served_rps=10.0, gate_full=False)
    assert h.core.tick().models[MODEL].edge_ceiling_rps is None  # never measured: no ceiling
    h.router("a", demand_rps={"sheddable": 60.0}, served_rps=40.0, gate_full=True)
    snap = h.core.tick()
    assert snap.models[MODEL].edge_ceiling_rps == 60.0  # 1.5 x 40 (degradation.edge_ceiling_ratio)
    assert Snapshot.from_dict(snap.to_dict()).models[MODEL].edge_ceiling_rps == 60.0
    h.advance(5)
    h.router("a", demand_rps={"sheddable": 5.0}, served_rps=5.0, gate_full=False)
    assert h.core.tick().models[MODEL].edge_ceiling_rps == 60.0  # calm: the measurement holds
    # Off in the config: none.
    off = Harness(make_cfg(degradation={"edge_ceiling_ratio": None}))
    off.replica("m1")
    off.router("a", demand_rps={"sheddable": 60.0}, served_rps=40.0, gate_full=True)
    assert off.core.tick().models[MODEL].edge_ceiling_rps is None


def test_malformed_demand_reports_are_refused_when_built_and_dropped_on_arrival(h: Harness) -> None:
    bads = [
        ("demand_rps", bad)
        for bad in ({"nope": 1.0}, {"critical": -2.0}, {"critical": "x"}, ["critical"], {"critical": float("inf")})
    ]
    for name, bad in bads + [("served_rps", -1.0)]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            ModelLoad(**{name: bad})
        h.core.report_router(tampered(router_report("a"), models={MODEL: tampered(ModelLoad(), **{name: bad})}))
    assert h.core.rejected_reports == 6
    assert h.core.signals(MODEL).demand_rps is None


def test_malformed_reports_are_dropped_and_never_wedge_the_tick():
    from ballast.config import load_config
    from ballast.control.controller import ControllerCore

    t = [0.0]
    core = ControllerCore(load_config({}), clock=lambda: t[0], wall_clock=lambda: 1000.0 + t[0])
    good = ReplicaReport(replica_id="r", deployment="BallastModel")
    for fields in ({"queued": None, "running": "x"}, {"gpu_util_pct": float("nan")}, {"queued": -3}):
        with pytest.raises(ValueError, match="^(queued|gpu_util_pct):"):
            ReplicaReport(replica_id="r", deployment="BallastModel", **fields)
        core.report_replica(tampered(good, **fields))
    core.report_replica(None)  # type: ignore[arg-type]
    core.report_replica({"replica_id": "r", "deployment": "BallastModel", "queued": 1})  # type: ignore[arg-type]  # not a report
    core.report_router(tampered(router_report("a"), models={MODEL: tampered(ModelLoad(), inflight=[1])}))
    assert core.rejected_reports == 6
    core.report_replica(ReplicaReport(replica_id="ok", deployment="BallastModel", queued=7, running=1))
    snap = core.tick()  # would raise if a malformed report had been kept
    assert snap.models[MODEL].inputs.queue_length == 7


def test_scale_down_decision_holds_while_the_old_replica_is_still_draining():
    """Running lags the target: a replica Serve has not stopped yet must not undo the decision."""
    from ballast.config import load_config
    from ballast.control.controller import ControllerCore
    from ballast.names import MODEL_DEPLOYMENT

    cfg = load_config(
        {
            "deployments": {"model": {"min_replicas": 1, "max_replicas": 2}},
            "autoscale": {
                "target_ongoing_requests": 4,
                "stable_window_s": 4,
                "panic_window_s": 1,
                "scale_down_delay_s": 2,
            },
        }
    )
    t = [0.0]
    core = ControllerCore(cfg, clock=lambda: t[0], wall_clock=lambda: 1000.0 + t[0])

    def replicas(n: int, running: int) -> None:
        for i in range(n):
            core.report_replica(
                ReplicaReport(replica_id=f"r{i}", deployment=MODEL_DEPLOYMENT, queued=0, running=running)
            )

    desired = []
    for tick in range(40):  # a burst for 5 s, then quiet; both replicas keep reporting throughout
        t[0] = float(tick)
        replicas(2, 8 if tick < 5 else 0)
        desired.append(core.tick().desired_replicas[MODEL_DEPLOYMENT])
    assert desired[:5] == [2] * 5
    first_down = desired.index(1)
    # Once down to 1 it stays there, although two replicas still report as running.
    assert desired[first_down:] == [1] * (40 - first_down)


def test_leases_split_a_tenants_rate_by_demand_and_cap_borrowing():
    from ballast.config import load_config
    from ballast.control.controller import ControllerCore

    cfg = load_config(
        {
            "tenants": {
                "small": {"rate_tokens_per_s": 100, "burst_tokens": 200},
                "big": {"rate_tokens_per_s": 10000, "burst_tokens": 10000},
            },
            "quota": {"lend_at_levels": [0], "max_borrow_ratio": 0.5, "min_share_ratio": 0.0},
        }
    )
    t = [0.0]
    core = ControllerCore(cfg, clock=lambda: t[0], wall_clock=lambda: 1000.0 + t[0])
    core.report_router(RouterReport(router_id="a", demand_tokens_per_s={"small": 900.0}))
    leases = core.report_router(RouterReport(router_id="b", demand_tokens_per_s={"small": 300.0}))["leases"]
    a = core.leases_for("a")
    # big is idle and lends, but small borrows at most half its own rate: 150 in all,
    # split 3:1 by the routers' demand; bursts split evenly.
    assert a["small"]["rate_tokens_per_s"] + leases["small"]["rate_tokens_per_s"] == pytest.approx(150.0)
    assert a["small"]["rate_tokens_per_s"] == pytest.approx(112.5)
    assert a["small"]["burst_tokens"] == leases["small"]["burst_tokens"] == 100.0


# --------------------------------------------------------------------------- admin state


def test_kill_switches_chaos_and_audit_are_taken_back_by_a_restarted_controller(h: Harness) -> None:
    assert not h.core.admin.dirty
    keep = h.core.admin.set_kill_switch("criticality", "sheddable_plus", "runaway clients", 600, "ops")
    short = h.core.admin.set_kill_switch("global", None, "maintenance", 5, "ops")
    h.core.admin.set_chaos("primary", {"latency_ms": 50}, "ops")
    assert h.core.admin.dirty  # the actor writes it before the admin call answers
    state = json.loads(json.dumps(h.core.admin.to_dict()))  # what goes through Ray's KV store

    # The controller dies; another starts 10 s later (wall clock): the 5 s switch has expired.
    h.wall.advance(10)
    again = ControllerCore(make_cfg(), clock=h.clock, wall_clock=h.wall)
    assert again.admin.adopt(state) == 1
    snap = again.snapshot()
    assert [e["id"] for e in snap["kill_switches"]] == [keep["id"]]
    assert short["id"] not in {e["id"] for e in snap["kill_switches"]}
    assert snap["chaos"] == {"primary": {"latency_ms": 50}}
    audit = again.admin.kill_switches()["audit"]
    assert [e["action"] for e in audit] == ["kill_switch_set", "kill_switch_set", "chaos_set", "admin_state_adopted"]


def test_a_malformed_persisted_state_loses_only_its_bad_entries(h: Harness) -> None:
    good = h.core.admin.set_kill_switch("criticality", "sheddable", "shed", 60, "ops")
    state = h.core.admin.to_dict()
    state["kill_switches"].append({"id": "x", "scope": "galaxy"})  # not a kill switch
    state["chaos"]["nowhere"] = {"latency_ms": 1}  # not a chaos target
    again = ControllerCore(make_cfg(), clock=h.clock, wall_clock=h.wall)
    assert again.admin.adopt(state) == 1
    assert [e["id"] for e in again.snapshot()["kill_switches"]] == [good["id"]]
    assert again.snapshot()["chaos"] == {}
    with pytest.raises(ValueError, match="admin state"):
        again.admin.adopt(["not", "an", "object"])


def test_an_expiring_kill_switch_marks_the_state_to_persist(h: Harness) -> None:
    h.core.admin.set_kill_switch("global", None, "maintenance", 5, "ops")
    h.core.admin.dirty = False  # written
    h.wall.advance(6)
    assert h.core.admin.kill_switches()["entries"] == []
    assert h.core.admin.dirty


# --------------------------------------------------------------------------- fair shares


def _fair_cfg(**fairness: Any) -> BallastConfig:
    tenants = {"a": {"weight": 2.0}, "b": {"weight": 1.0}}
    return make_cfg(tenants=tenants, fairness=fairness)


def test_routers_fair_charges_merge_into_cluster_counters_handed_back_to_each_router() -> None:
    """Tenant a comes only through router 1, b only through router 2 (skewed ingress): each
    router's reply carries both tenants' cluster-wide counters, so router 2 orders b
    against what router 1 served a."""
    from ballast.policies.fairness import FairnessConfig, TenantCounters

    h = Harness(_fair_cfg())
    r1 = TenantCounters({"a": 2.0, "b": 1.0}, FairnessConfig())
    r2 = TenantCounters({"a": 2.0, "b": 1.0}, FairnessConfig())
    r1.charge("a", 400, 0)  # a's weight 2: 200 on its counter
    r2.charge("b", 50, 0)
    reply1 = h.router("r1", fair_charged=r1.take_report())
    assert reply1["fair_counters"] == {"a": 200.0, "b": 0.0}
    reply2 = h.router("r2", fair_charged=r2.take_report())
    assert reply2["fair_counters"] == {"a": 200.0, "b": 50.0}
    r2.adopt(reply2["fair_counters"])
    assert r2.counters() == {"a": 200.0, "b": 50.0}
    # An unknown tenant's charge (a router with another config) is ignored; a bad one refused.
    assert h.router("r1", fair_charged={"zed": 5.0, "a": -20.0})["fair_counters"] == {"a": 180.0, "b": 50.0}
    with pytest.raises(ValueError, match="^fair_charged:"):
        RouterReport(router_id="r1", fair_charged={"a": float("nan")})
    h.core.report_router(tampered(RouterReport(router_id="r1"), fair_charged={"a": "x"}))
    assert h.core.rejected_reports == 1
    # A redeploy keeps the counters of tenants still configured.
    h.core.configure(_fair_cfg())
    assert h.router("r1")["fair_counters"] == {"a": 180.0, "b": 50.0}


def test_without_sharing_the_controller_hands_back_no_counters() -> None:
    h = Harness(_fair_cfg(shared=False))
    assert "fair_counters" not in h.router("r1", fair_charged={"a": 5.0})
    h = Harness(_fair_cfg(enabled=False))
    assert "fair_counters" not in h.router("r1", fair_charged={"a": 5.0})


def test_a_kill_switch_naming_no_tenant_model_or_class_is_refused_and_nothing_is_set(h: Harness) -> None:
    for scope, value in [("criticality", "sheddable "), ("tenant", "nobody"), ("model", "not-served")]:
        with pytest.raises(ValueError, match="^value: "):
            h.core.admin.set_kill_switch(scope, value, "incident", 60, "ops")
    assert h.core.admin.kill_switches()["entries"] == []
    assert not h.core.admin.dirty
    model = h.core.cfg.model.name
    assert h.core.admin.set_kill_switch("model", model, "incident", 60, "ops")["value"] == model
