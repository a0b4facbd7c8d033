"""Staggered recycling (ballast/policies/recycle.py): triggers, guards and rolling walks.

The walks drive ``plan`` tick by tick against a small fake deployment that
behaves like Serve: an ordered replica drains (unhealthy at once), is gone two
ticks later, and its replacement appears unhealthy and turns healthy two ticks
after that. Wall times are integers; hours of day are passed in directly.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from typing import Any

import pytest
from fakes import FakeClock

from ballast.policies.recycle import (
    REASONS,
    InFlight,
    Order,
    Plan,
    RecycleConfig,
    RecycleState,
    ReplicaView,
    age_threshold_s,
    due,
    expected_availability,
    in_window,
    measured_availability,
    plan,
)

HOUR_S = 3600
T0 = 1_700_000_000  # an integer wall time
DEP = "BallastModel"
IN_WINDOW = 3.0
OUTSIDE_WINDOW = 12.0


def view(
    replica_id: str,
    age_s: float,
    *,
    healthy: bool = True,
    now_s: float = T0,
    deployment: str = DEP,
    **kw: Any,
) -> ReplicaView:
    return ReplicaView(replica_id, deployment, now_s - age_s, healthy, **kw)


class FakeDeployment:
    """Replicas as Serve runs them, driven by the orders ``plan`` returns.

    An ordered replica stops being healthy at once (it drains), disappears
    ``drain_ticks`` later and is replaced by a new replica that is unhealthy for
    ``ready_ticks`` (None: never becomes healthy). ``replace=False`` models an
    autoscaler that does not replace it.
    """

    def __init__(self, clock: FakeClock, tick_s: int, replicas: list[ReplicaView]) -> None:
        self.clock = clock
        self.tick_s = tick_s
        self.replicas = {r.replica_id: r for r in replicas}
        self.gone_at: dict[str, float] = {}
        self.ready_at: dict[str, float | None] = {}
        self.ready_log: list[tuple[str, float]] = []  # (replacement id, when healthy)
        self.drain_ticks = 2
        self.ready_ticks: int | None = 2
        self.replace = True
        self._n = 0

    def views(self) -> list[ReplicaView]:
        return list(self.replicas.values())

    def healthy(self) -> int:
        return sum(1 for r in self.replicas.values() if r.healthy)

    def apply(self, orders: tuple[Order, ...]) -> None:
        for o in orders:
            r = self.replicas[o.replica_id]
            self.replicas[o.replica_id] = ReplicaView(r.replica_id, r.deployment, r.started_at_s, False)
            self.gone_at[o.replica_id] = self.clock() + self.drain_ticks * self.tick_s

    def step(self) -> None:
        now_s = self.clock()
        for rid, at_s in list(self.gone_at.items()):
            if now_s >= at_s:
                old = self.replicas.pop(rid)
                del self.gone_at[rid]
                if self.replace:
                    new_id = f"new-{self._n}"
                    self._n += 1
                    self.replicas[new_id] = ReplicaView(new_id, old.deployment, now_s, False)
                    self.ready_at[new_id] = None if self.ready_ticks is None else now_s + self.ready_ticks * self.tick_s
        for rid, at_s in list(self.ready_at.items()):
            if at_s is not None and now_s >= at_s:
                r = self.replicas[rid]
                self.replicas[rid] = ReplicaView(rid, r.deployment, r.started_at_s, True)
                del self.ready_at[rid]
                self.ready_log.append((rid, now_s))


# -- config -------------------------------------------------------------------------


def test_defaults_follow_seed_000() -> None:
    cfg = RecycleConfig()
    assert (cfg.max_age_s, cfg.forced_max_age_s) == (6 * HOUR_S, 24 * HOUR_S)
    assert (cfg.window_start_hour, cfg.window_end_hour) == (2.0, 5.0)
    assert (cfg.max_unavailable, cfg.min_available, cfg.block_at_level) == (1, 1, 3)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_age_s", 0),
        ("max_age_s", float("inf")),
        ("jitter_ratio", 1.0),
        ("jitter_ratio", -0.1),
        ("window_start_hour", 24),
        ("window_start_hour", -1),
        ("window_end_hour", 24.0),
        ("window_end_hour", 2.0),  # equal to the start
        ("window_end_hour", None),  # one end without the other
        ("forced_max_age_s", 3600.0),  # shorter than max_age_s
        ("forced_max_age_s", -1.0),
        ("max_unavailable", 0),
        ("max_unavailable", 1.0),
        ("min_available", -1),
        ("min_available", True),
        ("block_at_level", -1),
        ("recycle_timeout_s", 0),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        RecycleConfig(**{field: value})


def test_optional_triggers_may_be_disabled() -> None:
    cfg = RecycleConfig(max_age_s=None, forced_max_age_s=None, window_start_hour=None, window_end_hour=None)
    assert age_threshold_s("a", cfg) is None
    assert due(view("a", 1000 * HOUR_S), cfg, T0, IN_WINDOW) is None
    assert RecycleConfig(max_age_s=None, forced_max_age_s=HOUR_S).forced_max_age_s == HOUR_S


# -- jitter and window --------------------------------------------------------------


def test_jitter_spreads_thresholds_within_the_ratio_stably_per_id() -> None:
    cfg = RecycleConfig(jitter_ratio=0.1)
    ids = [f"replica-{i}" for i in range(100)]
    thresholds = [age_threshold_s(i, cfg) for i in ids]
    lo, hi = 0.9 * cfg.max_age_s, 1.1 * cfg.max_age_s  # type: ignore[operator]
    assert all(lo <= t <= hi for t in thresholds)  # type: ignore[operator]
    assert len(set(thresholds)) > 90
    assert min(thresholds) < 0.95 * cfg.max_age_s < 1.05 * cfg.max_age_s < max(thresholds)  # type: ignore[operator,type-var]
    # Stable: a pure function of the id, through crc32 (not the per-process salted hash()).
    assert [age_threshold_s(i, cfg) for i in ids] == thresholds
    u = zlib.crc32(b"replica-7") / 2**32
    assert thresholds[7] == pytest.approx(cfg.max_age_s * (1 + 0.1 * (2 * u - 1)))  # type: ignore[operator]


def test_zero_jitter_gives_every_replica_max_age() -> None:
    cfg = RecycleConfig(jitter_ratio=0.0)
    assert {age_threshold_s(f"r{i}", cfg) for i in range(20)} == {6 * HOUR_S}


def test_window_is_half_open() -> None:
    cfg = RecycleConfig()  # 02:00-05:00
    assert [in_window(h, cfg) for h in (0.0, 1.99, 2.0, 3.5, 4.99, 5.0, 12.0, 23.99)] == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        False,
    ]


def test_window_wraps_around_midnight() -> None:
    cfg = RecycleConfig(window_start_hour=22.0, window_end_hour=4.0)
    assert [in_window(h, cfg) for h in (21.99, 22.0, 23.5, 0.0, 3.99, 4.0, 12.0)] == [
        False,
        True,
        True,
        True,
        True,
        False,
        False,
    ]


def test_no_window_means_any_time_and_bad_hours_are_refused() -> None:
    cfg = RecycleConfig(window_start_hour=None, window_end_hour=None)
    assert all(in_window(h, cfg) for h in (0.0, 5.0, 12.0, 23.5))
    for bad in (24.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="^hour_of_day:"):
            in_window(bad, cfg)


# -- triggers -----------------------------------------------------------------------


def test_due_follows_the_priority_order() -> None:
    cfg = RecycleConfig()
    kw: dict[str, Any] = dict(request="leak", critical=True, manual=True)
    old = 25 * HOUR_S
    assert due(view("a", old, **kw), cfg, T0, OUTSIDE_WINDOW) == Order("a", DEP, "critical", True)
    kw["critical"] = False
    assert due(view("a", old, **kw), cfg, T0, OUTSIDE_WINDOW) == Order("a", DEP, "forced_max_age", True)
    assert due(view("a", 1, **kw), cfg, T0, OUTSIDE_WINDOW) == Order("a", DEP, "manual", True)
    kw["manual"] = False
    assert due(view("a", 1, **kw), cfg, T0, OUTSIDE_WINDOW) == Order("a", DEP, "watchdog", False)
    assert due(view("a", 7 * HOUR_S), cfg, T0, IN_WINDOW) == Order("a", DEP, "max_age", False)
    assert due(view("a", 7 * HOUR_S), cfg, T0, OUTSIDE_WINDOW) is None
    assert due(view("a", 1), cfg, T0, IN_WINDOW) is None
    assert REASONS == ("critical", "forced_max_age", "manual", "watchdog", "max_age")


def test_max_age_uses_each_replicas_own_threshold() -> None:
    cfg = RecycleConfig()
    for rid in ("a", "b", "replica-42"):
        t = age_threshold_s(rid, cfg)
        assert t is not None
        # Whole seconds either side (integer times keep the comparison exact).
        assert due(view(rid, math.floor(t) - 1), cfg, T0, IN_WINDOW) is None
        assert due(view(rid, math.ceil(t)), cfg, T0, IN_WINDOW) is not None


def test_forced_max_age_fires_at_exactly_forced_age_outside_the_window() -> None:
    cfg = RecycleConfig()
    assert due(view("a", 24 * HOUR_S - 1), cfg, T0, OUTSIDE_WINDOW) is None
    assert due(view("a", 24 * HOUR_S), cfg, T0, OUTSIDE_WINDOW) == Order("a", DEP, "forced_max_age", True)


def test_a_critical_flag_without_a_reason_is_still_critical() -> None:
    assert due(view("a", 1, critical=True), RecycleConfig(), T0, OUTSIDE_WINDOW) == Order("a", DEP, "critical", True)


def test_a_clock_stepping_back_makes_a_replica_young_not_due() -> None:
    assert due(view("a", -HOUR_S), RecycleConfig(), T0, IN_WINDOW) is None


# -- the rolling walk ---------------------------------------------------------------


def test_rolling_walk_recycles_four_replicas_one_at_a_time() -> None:
    tick_s = 30
    clock = FakeClock(T0)
    cfg = RecycleConfig()
    # All four are past the top of the jittered range (6.6 h); r0 is the oldest.
    fleet = FakeDeployment(clock, tick_s, [view(f"r{i}", 7 * HOUR_S - 60 * i) for i in range(4)])
    state = RecycleState()
    starts: list[tuple[int, str]] = []
    completions: list[tuple[int, str]] = []
    for tick in range(24):
        fleet.step()
        hour = IN_WINDOW + (clock() - T0) / HOUR_S
        p, state = plan(fleet.views(), {DEP: 4}, state, 0, cfg, clock(), hour)
        fleet.apply(p.start)
        starts += [(tick, o.replica_id) for o in p.start]
        completions += [(tick, f.replica_id) for f in p.completed]
        assert p.stuck == ()
        # Invariants at every tick, after the orders took effect.
        assert len(state.in_flight) <= cfg.max_unavailable
        assert fleet.healthy() >= cfg.min_available
        assert fleet.healthy() >= 4 - cfg.max_unavailable  # a rolling restart, never a rolling outage
        assert all(o.reason == "max_age" and not o.forced for o in p.start)
        if tick == 1:
            assert p.waiting == (("r1", "max_unavailable"), ("r2", "max_unavailable"), ("r3", "max_unavailable"))
        clock.advance(tick_s)

    # Each one starts on the tick the previous replacement turned healthy.
    assert starts == [(0, "r0"), (4, "r1"), (8, "r2"), (12, "r3")]
    assert completions == [(4, "r0"), (8, "r1"), (12, "r2"), (16, "r3")]
    ready_ticks = [(at_s - T0) // tick_s for _, at_s in fleet.ready_log]
    assert ready_ticks == [4, 8, 12, 16]
    assert state == RecycleState()
    assert sorted(r.replica_id for r in fleet.views()) == ["new-0", "new-1", "new-2", "new-3"]
    assert all(r.healthy for r in fleet.views())


def test_rolling_walk_with_two_unavailable_never_exceeds_two() -> None:
    tick_s = 30
    clock = FakeClock(T0)
    cfg = RecycleConfig(max_unavailable=2, min_available=2)
    fleet = FakeDeployment(clock, tick_s, [view(f"r{i}", 7 * HOUR_S - 60 * i) for i in range(5)])
    state = RecycleState()
    started: list[str] = []
    for _ in range(30):
        fleet.step()
        p, state = plan(fleet.views(), {DEP: 5}, state, 0, cfg, clock(), IN_WINDOW)
        fleet.apply(p.start)
        started += [o.replica_id for o in p.start]
        assert len(state.in_flight) <= 2
        assert fleet.healthy() >= 3
        clock.advance(tick_s)
    assert started == ["r0", "r1", "r2", "r3", "r4"]
    assert state == RecycleState()


def test_an_unhealthy_replica_recycled_still_waits_for_a_healthy_replacement() -> None:
    tick_s = 30
    clock = FakeClock(T0)
    cfg = RecycleConfig()
    fleet = FakeDeployment(
        clock,
        tick_s,
        [view("sick", 1, healthy=False, request="fd_growth"), view("y", 7 * HOUR_S), view("z", 7 * HOUR_S - 60)],
    )
    state = RecycleState()
    p, state = plan(fleet.views(), {DEP: 3}, state, 0, cfg, clock(), IN_WINDOW)
    # The watchdog request outranks max_age; recycling it lowers no healthy count.
    assert p.start == (Order("sick", DEP, "watchdog", False),)
    assert state.in_flight == (InFlight("sick", DEP, "watchdog", T0, 3),)
    fleet.apply(p.start)
    starts = []
    for tick in range(1, 12):
        clock.advance(tick_s)
        fleet.step()
        p, state = plan(fleet.views(), {DEP: 3}, state, 0, cfg, clock(), IN_WINDOW)
        fleet.apply(p.start)
        starts += [(tick, o.replica_id) for o in p.start]
        assert fleet.healthy() >= 1
    # sick is gone at tick 2, its replacement healthy at tick 4: only then does y start.
    assert starts[0] == (4, "y")


# -- guards -------------------------------------------------------------------------


def three(**first: Any) -> list[ReplicaView]:
    """Three healthy replicas; only the first is due (its kwargs decide why)."""
    age = first.pop("age_s", 7 * HOUR_S)
    return [view("a", age, **first), view("b", 60), view("c", 120)]


@pytest.mark.parametrize("level,started", [(0, True), (2, True), (3, False), (4, False)])
def test_level_blocks_scheduled_recycles_from_block_at_level(level: int, started: bool) -> None:
    p, state = plan(three(), {DEP: 3}, RecycleState(), level, RecycleConfig(), T0, IN_WINDOW)
    if started:
        assert p.start == (Order("a", DEP, "max_age", False),) and p.waiting == ()
    else:
        assert p.start == () and p.waiting == (("a", "level"),) and state == RecycleState()


@pytest.mark.parametrize(
    "first,reason",
    [
        (dict(age_s=25 * HOUR_S), "forced_max_age"),
        (dict(age_s=60, request="vram", critical=True), "critical"),
        (dict(age_s=60, manual=True), "manual"),
    ],
)
def test_level_does_not_block_forced_or_critical(first: dict[str, Any], reason: str) -> None:
    p, _ = plan(three(**first), {DEP: 3}, RecycleState(), 4, RecycleConfig(), T0, OUTSIDE_WINDOW)
    assert p.start == (Order("a", DEP, reason, True),)


def test_level_blocks_a_non_critical_watchdog_request() -> None:
    p, _ = plan(three(age_s=60, request="leak"), {DEP: 3}, RecycleState(), 3, RecycleConfig(), T0, OUTSIDE_WINDOW)
    assert p.start == () and p.waiting == (("a", "level"),)


def test_min_available_blocks() -> None:
    cfg = RecycleConfig(min_available=2, max_unavailable=2)
    both = [view("a", 7 * HOUR_S), view("b", 7 * HOUR_S - 60)]
    p, state = plan(both, {DEP: 2}, RecycleState(), 0, cfg, T0, IN_WINDOW)
    assert p.start == () and state == RecycleState()
    assert p.waiting == (("a", "min_available"), ("b", "min_available"))


def test_min_available_even_blocks_critical_on_a_single_replica() -> None:
    one = [view("a", 60, request="oom", critical=True)]
    p, _ = plan(one, {DEP: 1}, RecycleState(), 0, RecycleConfig(), T0, IN_WINDOW)
    assert p.start == () and p.waiting == (("a", "min_available"),)
    p, _ = plan(one, {DEP: 1}, RecycleState(), 0, RecycleConfig(min_available=0), T0, IN_WINDOW)
    assert p.start == (Order("a", DEP, "critical", True),)


def test_an_unhealthy_replica_does_not_count_against_min_available() -> None:
    cfg = RecycleConfig(min_available=1, max_unavailable=2)
    reps = [view("a", 7 * HOUR_S, healthy=False), view("b", 7 * HOUR_S - 60)]
    p, state = plan(reps, {DEP: 2}, RecycleState(), 0, cfg, T0, IN_WINDOW)
    assert p.start == (Order("a", DEP, "max_age", False),)
    assert p.waiting == (("b", "min_available"),)
    assert state.in_flight == (InFlight("a", DEP, "max_age", T0, 2),)


def test_a_lone_replica_that_stopped_taking_work_is_recycled_even_at_min_available() -> None:
    # Its watchdog switched intake off: it serves nothing, so recycling it costs nothing;
    # waiting for min_available would leave it leaking until it dies.
    one = [view("a", 60, healthy=False, request="rss leak", critical=True)]
    p, state = plan(one, {DEP: 1}, RecycleState(), 0, RecycleConfig(min_available=1), T0, IN_WINDOW)
    assert p.start == (Order("a", DEP, "critical", True),)
    assert state.in_flight == (InFlight("a", DEP, "critical", T0, 1),)


def test_outside_the_window_an_aged_replica_is_listed_as_waiting() -> None:
    reps = [view("a", 7 * HOUR_S), view("b", 60)]
    p, state = plan(reps, {DEP: 2}, RecycleState(), 0, RecycleConfig(), T0, OUTSIDE_WINDOW)
    assert p == Plan((), (), (), (("a", "window"),))
    assert state == RecycleState()


def test_due_replicas_are_taken_by_priority_then_oldest() -> None:
    reps = [
        view("young-aged", 6.7 * HOUR_S),
        view("old-aged", 6.8 * HOUR_S),
        view("watch", 60, request="threads"),
        view("healthy", 60),
    ]
    p, _ = plan(reps, {DEP: 4}, RecycleState(), 0, RecycleConfig(), T0, IN_WINDOW)
    assert p.start == (Order("watch", DEP, "watchdog", False),)
    assert p.waiting == (("old-aged", "max_unavailable"), ("young-aged", "max_unavailable"))


def test_deployments_are_planned_independently() -> None:
    reps = [
        view("a1", 7 * HOUR_S, deployment="A"),
        view("a2", 60, deployment="A"),
        view("b1", 7 * HOUR_S, deployment="B"),
        view("b2", 60, deployment="B"),
    ]
    p, state = plan(reps, {"A": 2, "B": 2}, RecycleState(), 0, RecycleConfig(), T0, IN_WINDOW)
    assert [o.replica_id for o in p.start] == ["a1", "b1"]
    assert len(state.in_flight) == 2


# -- completion, stuck, autoscaler --------------------------------------------------


def test_stuck_after_timeout_frees_the_slot() -> None:
    tick_s = 60
    clock = FakeClock(T0)
    cfg = RecycleConfig(recycle_timeout_s=600)
    fleet = FakeDeployment(clock, tick_s, [view(r, 7 * HOUR_S - 60 * i) for i, r in enumerate("abc")])
    fleet.ready_ticks = None  # the replacement never becomes healthy (no GPU to place it on)
    state = RecycleState()
    stuck: list[tuple[int, str]] = []
    starts: list[tuple[int, str]] = []
    for tick in range(16):
        fleet.step()
        p, state = plan(fleet.views(), {DEP: 3}, state, 0, cfg, clock(), IN_WINDOW)
        fleet.apply(p.start)
        stuck += [(tick, f.replica_id) for f in p.stuck]
        starts += [(tick, o.replica_id) for o in p.start]
        assert len(state.in_flight) <= 1
        if 0 < tick < 10:
            assert ("b", "max_unavailable") in p.waiting
        clock.advance(tick_s)
    # Reported once, on the tick the timeout is reached, and the next one starts at once.
    assert stuck[0] == (10, "a")
    assert starts[:2] == [(0, "a"), (10, "b")]
    # min_available is the floor under a rollout whose replacements never come up.
    assert fleet.healthy() >= cfg.min_available


def test_a_recycle_that_never_drained_goes_stuck_and_is_ordered_again() -> None:
    cfg = RecycleConfig(recycle_timeout_s=600)
    reps = three()
    p, state = plan(reps, {DEP: 3}, RecycleState(), 0, cfg, T0, IN_WINDOW)
    assert [o.replica_id for o in p.start] == ["a"]
    p, state = plan(reps, {DEP: 3}, state, 0, cfg, T0 + 599, IN_WINDOW)
    assert p.start == () and p.stuck == () and len(state.in_flight) == 1
    p, state = plan(reps, {DEP: 3}, state, 0, cfg, T0 + 600, IN_WINDOW)
    assert [f.replica_id for f in p.stuck] == ["a"]
    assert [o.replica_id for o in p.start] == ["a"]
    assert state.in_flight == (InFlight("a", DEP, "max_age", T0 + 600, 3),)


def test_completion_wins_over_timeout_on_the_same_tick() -> None:
    cfg = RecycleConfig(recycle_timeout_s=600)
    state = RecycleState((InFlight("a", DEP, "max_age", T0, 2),))
    reps = [view("b", 60, now_s=T0 + 600), view("new", 10, now_s=T0 + 600)]
    p, state = plan(reps, {DEP: 2}, state, 0, cfg, T0 + 600, IN_WINDOW)
    assert [f.replica_id for f in p.completed] == ["a"] and p.stuck == ()


def test_the_autoscaler_shrinking_the_deployment_still_completes() -> None:
    cfg = RecycleConfig()
    reps = [view(f"r{i}", 7 * HOUR_S - 60 * i) for i in range(4)]
    p, state = plan(reps, {DEP: 4}, RecycleState(), 0, cfg, T0, IN_WINDOW)
    assert state.in_flight == (InFlight("r0", DEP, "max_age", T0, 4),)
    rest = [view(f"r{i}", 7 * HOUR_S - 60 * i, now_s=T0 + 60) for i in range(1, 4)]
    # r0 is gone and not replaced: with the target still 4, the recycle stays open ...
    p, state = plan(rest, {DEP: 4}, state, 0, cfg, T0 + 60, IN_WINDOW)
    assert p.completed == () and len(state.in_flight) == 1
    assert p.waiting == (("r1", "max_unavailable"), ("r2", "max_unavailable"), ("r3", "max_unavailable"))
    # ... until the autoscaler's target says three is all there should be.
    p, state = plan(rest, {DEP: 3}, state, 0, cfg, T0 + 120, IN_WINDOW)
    assert [f.replica_id for f in p.completed] == ["r0"]
    assert [o.replica_id for o in p.start] == ["r1"]


def test_a_vanished_deployment_completes_when_its_target_is_zero() -> None:
    state = RecycleState((InFlight("a", "Gone", "manual", T0, 1),))
    p, state = plan([], {"Gone": 0}, state, 0, RecycleConfig(), T0 + 10, IN_WINDOW)
    assert [f.replica_id for f in p.completed] == ["a"] and state == RecycleState()


def test_the_state_stays_bounded_under_random_churn() -> None:
    rng = random.Random(7)
    cfg = RecycleConfig(max_unavailable=2, min_available=1, recycle_timeout_s=300)
    now_s = T0
    replicas: dict[str, ReplicaView] = {}
    n = 0
    state = RecycleState()
    for _ in range(500):
        now_s += 30
        # Churn: replicas come and go, flip health, get requests.
        for rid in list(replicas):
            if rng.random() < 0.05:
                del replicas[rid]
        while len(replicas) < rng.randint(3, 12):
            dep = rng.choice(["A", "B", "C"])
            replicas[f"r{n}"] = ReplicaView(
                f"r{n}",
                dep,
                now_s - rng.uniform(0, 30 * HOUR_S),
                rng.random() < 0.8,
                request="leak" if rng.random() < 0.1 else None,
                critical=rng.random() < 0.05,
                manual=rng.random() < 0.02,
            )
            n += 1
        views = list(replicas.values())
        p, state = plan(views, {"A": 4, "B": 4, "C": 4}, state, rng.randint(0, 4), cfg, now_s, rng.uniform(0, 23.99))
        ids = [f.replica_id for f in state.in_flight]
        assert len(ids) == len(set(ids))
        for dep in ("A", "B", "C"):
            assert sum(1 for f in state.in_flight if f.deployment == dep) <= cfg.max_unavailable
        assert len(state.in_flight) <= len(views) + 3 * cfg.max_unavailable
        assert {o.replica_id for o in p.start} <= set(replicas)


def test_duplicate_in_flight_entries_collapse_to_one() -> None:
    f = InFlight("a", DEP, "max_age", T0, 3)
    _, state = plan(three(), {DEP: 3}, RecycleState((f, f)), 0, RecycleConfig(), T0 + 1, IN_WINDOW)
    assert state.in_flight == (f,)


def test_plan_refuses_malformed_input() -> None:
    cfg = RecycleConfig()
    with pytest.raises(ValueError, match="^replicas:"):
        plan([view("a", 1), view("a", 2)], {}, RecycleState(), 0, cfg, T0, IN_WINDOW)
    with pytest.raises(ValueError, match="^level:"):
        plan([], {}, RecycleState(), -1, cfg, T0, IN_WINDOW)
    with pytest.raises(ValueError, match="^hour_of_day:"):
        plan([], {}, RecycleState(), 0, cfg, T0, 24.0)
    with pytest.raises(ValueError, match="^replica_id:"):
        view("", 1)
    with pytest.raises(ValueError, match="^reason:"):
        InFlight("a", DEP, "whim", T0, 1)


def test_recycle_state_round_trips_through_json() -> None:
    state = RecycleState((InFlight("a", DEP, "critical", T0, 3), InFlight("b", "Other", "max_age", T0 + 1.5, 1)))
    assert RecycleState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    with pytest.raises(ValueError, match="^in_flight:"):
        RecycleState.from_dict({"in_flight": [{"replica_id": "a"}]})
    with pytest.raises(ValueError, match="^healthy_before:"):
        RecycleState.from_dict({"in_flight": [{**state.in_flight[0].to_dict(), "healthy_before": -1}]})


# -- availability -------------------------------------------------------------------


def test_expected_availability_matches_hand_computed_values() -> None:
    # N = 4, T_restart = 60 s, T_period = 6 h = 21600 s:
    # A_restart = 1 - 60/21600 = 0.997222...; A = 3/4 + 0.997222.../4 = 1 - 1/1440 = 0.999305...
    a = expected_availability(4, 60.0, 6 * HOUR_S)
    assert a == pytest.approx(0.75 + 0.25 * (1 - 60 / 21600))
    assert a == pytest.approx(1 - 1 / 1440)
    assert round(a, 6) == 0.999306  # type: ignore[arg-type]
    # N = 3, 3 min every 6 h -> 99.72 %.
    assert round(expected_availability(3, 180.0, 6 * HOUR_S), 4) == 0.9972  # type: ignore[arg-type]
    # One replica: the plain A_restart (99.17 % in the seed).
    assert round(expected_availability(1, 180.0, 6 * HOUR_S), 4) == 0.9917  # type: ignore[arg-type]


def test_expected_availability_edges() -> None:
    assert expected_availability(0, 60.0, HOUR_S) is None
    assert expected_availability(4, 60.0, 0) is None
    assert expected_availability(4, 60.0, -1) is None
    assert expected_availability(1, 2 * HOUR_S, HOUR_S) == 0.0  # clamped
    assert expected_availability(4, 0.0, HOUR_S) == 1.0
    with pytest.raises(ValueError, match="^restart_s:"):
        expected_availability(4, -1.0, HOUR_S)


def test_measured_availability() -> None:
    # 4 replicas over 6 h, one out for 60 s: the same 1 - 1/1440 as expected.
    assert measured_availability(60.0, 4 * 6 * HOUR_S) == pytest.approx(1 - 1 / 1440)
    assert measured_availability(0.0, 100.0) == 1.0
    assert measured_availability(200.0, 100.0) == 0.0
    assert measured_availability(1.0, 0.0) is None
    with pytest.raises(ValueError, match="^out_s:"):
        measured_availability(-1.0, 100.0)


# --------------------------------------------------------------------------- the controller's side

from ballast.policies import recycle as _rc  # noqa: E402
from ballast.policies.reports import ReplicaReport, WatchdogReport  # noqa: E402


def replica_report(rid: str = "a", **fields) -> ReplicaReport:
    return ReplicaReport(replica_id=rid, deployment="D", **fields)


def watchdog_report(rid: str = "a", **fields) -> WatchdogReport:
    return WatchdogReport(replica_id=rid, deployment="D", **fields)


@pytest.mark.parametrize(
    "report, watchdog, in_flight, healthy",
    [
        ({}, None, False, True),
        ({}, {}, False, True),
        ({"ready": False}, {}, False, False),
        ({"draining": True}, None, False, False),
        ({}, {"ready": False}, False, False),
        ({}, {"hung": True}, False, False),
        ({}, {}, True, False),
    ],
)
def test_replica_healthy(report, watchdog, in_flight, healthy) -> None:
    wd = watchdog_report(**watchdog) if watchdog is not None else None  # None: no watchdog report
    assert _rc.replica_healthy(replica_report(**report), wd, in_flight) is healthy


def test_replica_view_carries_the_watchdog_request_and_a_zero_start() -> None:
    v = _rc.replica_view(
        replica_report(started_at_s=0.0),
        watchdog_report(recycle_requested=True, reason="rss_leak", critical=True),
        in_flight=False,
        manual=False,
        now_s=500.0,
    )
    assert (v.started_at_s, v.request, v.critical) == (0.0, "rss_leak", True)
    v = _rc.replica_view(replica_report(), watchdog_report(started_at_s=7.0), False, True, 500.0)
    assert (v.started_at_s, v.request, v.critical, v.manual) == (7.0, None, False, True)
    v = _rc.replica_view(replica_report(), None, False, False, 500.0)  # neither says: seen now
    assert (v.started_at_s, v.request, v.healthy) == (500.0, None, True)


def test_surging_names_stopped_waiting_and_in_flight_deployments() -> None:
    known = {"a": "A", "b": "B", "c": "C", "d": "D"}
    state = _rc.RecycleState(in_flight=(_rc.InFlight("c", "C", "max_age", 0.0, 1),))
    stopped = {"a": watchdog_report("a", ready=False), "x": watchdog_report("x", ready=False)}
    got = _rc.surging(known, stopped, state, (("b", "min_available"), ("d", "level")))
    assert got == frozenset({"A", "B", "C"})
    assert _rc.surging(known, {"a": watchdog_report("a", ready=False)}, state, (), enabled=False) == frozenset()


def test_hung_kill_once_then_again_after_the_cooldown_tick_by_tick() -> None:
    clock = FakeClock(0)
    hung = {"r": watchdog_report("r", hung=True, actor_name="act")}
    state = _rc.KillState()
    kills_at = []
    for _ in range(130):
        kills, state = _rc.hung_kills(hung, state, clock(), cooldown_s=60)
        kills_at += [clock()] * len(kills)
        clock.advance()
    assert kills_at == [0, 61, 122]
    kills, _ = _rc.hung_kills(hung, _rc.KillState(), 0)
    assert kills == (_rc.KillOrder("r", "D", "act", "serve"),)


def test_hung_without_an_actor_name_or_not_hung_is_not_killed() -> None:
    wds = {"a": watchdog_report("a", hung=True), "b": watchdog_report("b", hung=False, actor_name="x")}
    kills, state = _rc.hung_kills(wds, _rc.KillState(), 0)
    assert kills == () and state.killed == ()


def test_hung_kills_remember_at_most_max_killed() -> None:
    wds = {f"r{i}": watchdog_report(f"r{i}", hung=True, actor_name=f"a{i}") for i in range(5)}
    kills, state = _rc.hung_kills(wds, _rc.KillState(), 0, max_killed=3)
    assert len(kills) == 5 and [rid for rid, _ in state.killed] == ["r2", "r3", "r4"]
