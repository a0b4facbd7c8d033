"""Degradation level policy, walked tick by tick with integer ``now_s``."""

from __future__ import annotations

import pytest

from ballast.policies.criticality import DEFAULT_CRITICALITY, Criticality
from ballast.policies.degradation import (
    DEFAULT_CONSTRAINTS,
    MAX_LEVEL,
    DegradationConfig,
    DegradationState,
    LevelConstraints,
    LoadSignals,
    conservative_level,
    decide,
    target_level,
)

CP, C, SP, S = (
    Criticality.CRITICAL_PLUS,
    Criticality.CRITICAL,
    Criticality.SHEDDABLE_PLUS,
    Criticality.SHEDDABLE,
)


def sig(
    queue: int = 0,
    wait_ms: float | None = None,
    gpu: float | None = None,
    vram: float | None = None,
    err: float | None = None,
    n: int = 0,
    kv: float | None = None,
) -> LoadSignals:
    return LoadSignals(
        queue_length=queue,
        queue_wait_p95_ms=wait_ms,
        gpu_util_pct=gpu,
        vram_pct=vram,
        error_rate=err,
        request_count=n,
        kv_util_pct=kv,
    )


CFG = DegradationConfig()  # stable_window_s = 30


# ----------------------------------------------------------------- criticality


def test_criticality_rank_and_default() -> None:
    assert [c.rank for c in (CP, C, SP, S)] == [0, 1, 2, 3]
    assert DEFAULT_CRITICALITY is C
    assert Criticality("sheddable_plus") is SP
    assert Criticality.parse(None) is C
    with pytest.raises(ValueError, match="criticality"):
        Criticality.parse("urgent")


# ----------------------------------------------------------------- constraints


def test_default_constraints_follow_the_seed_table() -> None:
    assert len(DEFAULT_CONSTRAINTS) == 5
    assert [c.max_tokens for c in DEFAULT_CONSTRAINTS] == [8192, 4096, 2048, 1024, 512]
    assert [c.max_batch_size for c in DEFAULT_CONSTRAINTS] == [32, 24, 16, 8, 4]
    assert [c.streaming for c in DEFAULT_CONSTRAINTS] == [True, True, False, False, False]
    assert [c.admitted for c in DEFAULT_CONSTRAINTS] == [
        frozenset({CP, C, SP, S}),
        frozenset({CP, C, SP}),
        frozenset({CP, C}),
        frozenset({CP}),
        frozenset(),
    ]


def test_level_constraints_round_trip_and_sorted_admitted() -> None:
    c = LevelConstraints(max_tokens=100, max_batch_size=2, streaming=False, admitted=["sheddable", "critical_plus"])
    assert c.admitted == frozenset({S, CP})
    d = c.to_dict()
    assert d == {"max_tokens": 100, "max_batch_size": 2, "streaming": False, "admitted": ["critical_plus", "sheddable"]}
    assert LevelConstraints.from_dict(d) == c
    for level in DEFAULT_CONSTRAINTS:
        assert LevelConstraints.from_dict(level.to_dict()) == level


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"streaming": "yes"}, "streaming"),
        ({"admitted": ["urgent"]}, "admitted"),
        ({"admitted": "critical"}, "admitted"),
    ],
)
def test_level_constraints_validation(kwargs: dict, field: str) -> None:
    base = {"max_tokens": 10, "max_batch_size": 1, "streaming": True, "admitted": [C]}
    with pytest.raises(ValueError, match=field):
        LevelConstraints(**{**base, **kwargs})


def test_level_constraints_from_dict_missing_field() -> None:
    with pytest.raises(ValueError, match="admitted"):
        LevelConstraints.from_dict({"max_tokens": 1, "max_batch_size": 1, "streaming": True})


# ----------------------------------------------------------------- target level


@pytest.mark.parametrize(
    ("signals", "level"),
    [
        # queue length: 50/100/200/500
        (sig(queue=49), 0),
        (sig(queue=50), 1),
        (sig(queue=99), 1),
        (sig(queue=100), 2),
        (sig(queue=199), 2),
        (sig(queue=200), 3),
        (sig(queue=499), 3),
        (sig(queue=500), 4),
        # queue wait p95: 250/500/1000/2000 ms
        (sig(wait_ms=249.9), 0),
        (sig(wait_ms=250.0), 1),
        (sig(wait_ms=500.0), 2),
        (sig(wait_ms=1000.0), 3),
        (sig(wait_ms=1999.9), 3),
        (sig(wait_ms=2000.0), 4),
        # GPU util: 85/92/97, never level 4 alone
        (sig(gpu=84.9), 0),
        (sig(gpu=85.0), 1),
        (sig(gpu=92.0), 2),
        (sig(gpu=96.9), 2),
        (sig(gpu=97.0), 3),
        (sig(gpu=100.0), 3),
        # VRAM: 97 critical, 99 emergency, nothing below
        (sig(vram=96.9), 0),
        (sig(vram=97.0), 3),
        (sig(vram=98.9), 3),
        (sig(vram=99.0), 4),
        # error rate: >= 0.1 with >= 20 requests -> 3
        (sig(err=0.0999, n=100), 0),
        (sig(err=0.1, n=20), 3),
        (sig(err=1.0, n=20), 3),
        (sig(err=1.0, n=19), 0),
        (sig(err=None, n=1000), 0),
    ],
)
def test_each_signal_threshold_at_the_boundary(signals: LoadSignals, level: int) -> None:
    assert target_level(signals, CFG)[0] == level


def test_absent_signals_are_ignored_not_zero_nor_max() -> None:
    # No GPU at all: only the queue speaks.
    assert target_level(sig(queue=10, gpu=None, vram=None), CFG) == (0, "normal")
    assert target_level(sig(queue=120, gpu=None, vram=None), CFG)[0] == 2
    # The same host with a hot GPU present: the GPU now raises the level.
    assert target_level(sig(queue=10, gpu=97.0, vram=None), CFG)[0] == 3
    assert target_level(sig(queue=10, gpu=None, vram=99.5), CFG)[0] == 4
    # A present zero is a real reading and does not lower a queue-driven level.
    assert target_level(sig(queue=120, gpu=0.0, vram=0.0), CFG)[0] == 2


def test_reason_names_the_signal_and_ties_go_to_the_queue() -> None:
    assert target_level(sig(queue=230), CFG) == (3, "queue_length=230>=200")
    assert target_level(sig(gpu=92.5), CFG) == (2, "gpu_util_pct=92.5>=92")
    # Queue length and GPU util both ask for 2: queue first.
    assert target_level(sig(queue=100, gpu=92.0), CFG) == (2, "queue_length=100>=100")
    # Queue wait before GPU util on a tie.
    assert target_level(sig(wait_ms=500.0, gpu=92.0), CFG) == (2, "queue_wait_p95_ms=500>=500")
    # Error rate ties with queue at 3: queue wins; above the queue, error rate wins.
    assert target_level(sig(queue=200, err=0.5, n=50), CFG)[1] == "queue_length=200>=200"
    level, reason = target_level(sig(queue=100, err=0.5, n=50), CFG)
    assert level == 3 and reason.startswith("error_rate=0.5>=0.1")
    # The max wins regardless of order: VRAM 99 beats queue 3.
    assert target_level(sig(queue=200, vram=99.0), CFG) == (4, "vram_pct=99>=99")


# ----------------------------------------------------------------- decide: tick by tick


def at(level: int, now_s: float = 0.0) -> DegradationState:
    """A state that reached ``level`` by evidence, with no streak open."""
    return DegradationState(level=level)


def gap(serving: int, target: int, **kw) -> LoadSignals:
    s = sig(**kw)
    return LoadSignals(**{**s.__dict__, "replicas_serving": serving, "replicas_target": target})


def test_one_sample_moves_the_level_one_up_only() -> None:
    d, state = decide(sig(queue=10), DegradationState(), CFG, now_s=0)
    assert (d.level, d.changed) == (0, False)
    # One report asks for level 4 (a 3.1 s queue-wait p95): one level, at once.
    d, state = decide(sig(wait_ms=3100.0), state, CFG, now_s=1)
    assert (d.level, d.target_level, d.changed) == (1, 4, True)
    assert d.constraints == DEFAULT_CONSTRAINTS[1]
    assert d.reason.startswith("up 0->1: queue_wait_p95_ms=3100>=2000")
    assert (state.up_since_s, state.up_min) == (1, 4)
    # The next sample is calm: the up-streak ends and nothing more happens.
    d, state = decide(sig(), state, CFG, now_s=1.5)
    assert d.level == 1 and (state.up_since_s, state.up_min) == (None, None)
    assert state.lower_since_s == 1.5


def test_evidence_that_persists_moves_straight_to_the_target() -> None:
    d, state = decide(sig(queue=230), DegradationState(), CFG, now_s=0)
    assert d.level == 1
    # Still asked half a second later: held at 1 until the streak is up_confirm_s (1 s) old.
    d, state = decide(sig(queue=230), state, CFG, now_s=0.5)
    assert (d.level, d.changed) == (1, False)
    assert d.reason == "hold 1: target 3 (queue_length=230>=200) for 0.5s of 1s"
    d, state = decide(sig(queue=600), state, CFG, now_s=1.0)
    # 0 -> 1 -> 3: the lowest target of the streak (3, not 4: 4 was asked once).
    assert (d.level, d.changed) == (3, True)
    assert d.reason == "up 1->3: queue_length=600>=500 held 1s"
    assert (state.up_since_s, state.up_min) == (None, None)
    # The 4 now persists in its own streak: +1 at once is 4 already.
    d, state = decide(sig(queue=600), state, CFG, now_s=1.5)
    assert (d.level, state.up_since_s) == (4, None)


def test_an_interrupted_up_streak_starts_again_with_one_level() -> None:
    d, state = decide(sig(queue=600), DegradationState(), CFG, now_s=0)
    assert d.level == 1
    d, state = decide(sig(queue=60), state, CFG, now_s=0.5)  # back at the level: interrupted
    assert d.level == 1 and state.up_since_s is None
    d, state = decide(sig(queue=600), state, CFG, now_s=1.0)
    assert d.level == 2 and (state.up_since_s, state.up_min) == (1.0, 4)
    d, state = decide(sig(queue=600), state, CFG, now_s=1.5)
    assert d.level == 2
    d, state = decide(sig(queue=600), state, CFG, now_s=2.0)
    assert d.level == 4


def test_a_target_one_above_is_reached_at_once_with_no_streak() -> None:
    d, state = decide(sig(queue=60), DegradationState(), CFG, now_s=0)
    assert d.level == 1 and state.up_since_s is None
    d, state = decide(sig(queue=120), state, CFG, now_s=1)
    assert d.level == 2 and state.up_since_s is None


def test_down_to_the_target_in_one_stable_window_with_exact_boundaries() -> None:
    state = at(4)
    # Load disappears from t=1: the level drops 4 -> 0 at t=31, in one step.
    for t in range(1, 100):
        d, state = decide(sig(queue=0), state, CFG, now_s=t)
        assert d.level == (4 if t < 31 else 0), t
        assert d.changed == (t == 31), t
        assert d.target_level == 0
        assert state.lower_since_s == (1 if t < 31 else None), t
    assert state == DegradationState(level=0)


def test_down_goes_to_the_highest_target_of_the_window() -> None:
    state = at(4)
    # The target wanders between 0 and 2 below 4: the streak holds and the level
    # lands on 2, the most the window asked for; then 2 -> 0 takes a fresh window.
    for t in range(1, 31):
        d, state = decide(sig(queue=120 if t == 17 else 0), state, CFG, now_s=t)
        assert d.level == 4
    assert (state.lower_since_s, state.lower_max) == (1, 2)
    d, state = decide(sig(queue=0), state, CFG, now_s=31)
    assert (d.level, d.changed) == (2, True)
    assert d.reason == "down 4->2: target 0 (normal) held 30s>=30s"
    assert (state.lower_since_s, state.lower_max) == (31, 0)
    for t in range(32, 61):
        d, state = decide(sig(queue=0), state, CFG, now_s=t)
        assert d.level == 2
    d, state = decide(sig(queue=0), state, CFG, now_s=61)
    assert d.level == 0


def test_step_down_stops_the_streak_when_target_reached() -> None:
    state = at(3)
    for t in range(1, 31):
        d, state = decide(sig(queue=100), state, CFG, now_s=t)
        assert d.level == 3
        assert state.lower_since_s == 1
    d, state = decide(sig(queue=100), state, CFG, now_s=31)
    assert (d.level, d.changed, state.lower_since_s) == (2, True, None)
    for t in range(32, 100):
        d, state = decide(sig(queue=100), state, CFG, now_s=t)
        assert d.level == 2 and state.lower_since_s is None


def test_interrupted_calm_restarts_the_window() -> None:
    state = at(2)
    for t in range(1, 21):
        d, state = decide(sig(queue=0), state, CFG, now_s=t)
        assert d.level == 2
    assert state.lower_since_s == 1
    # One tick back at the current level interrupts the streak.
    d, state = decide(sig(queue=150), state, CFG, now_s=21)
    assert (d.level, state.lower_since_s) == (2, None)
    # The window starts again at t=22: no step at t=31 (where the old streak
    # would have ended), the step comes at t=52.
    for t in range(22, 52):
        d, state = decide(sig(queue=0), state, CFG, now_s=t)
        assert d.level == 2, t
        assert state.lower_since_s == 22
    d, state = decide(sig(queue=0), state, CFG, now_s=52)
    assert (d.level, d.changed) == (0, True)


def test_a_spike_during_calm_costs_one_level_and_one_window() -> None:
    state = at(2)
    for t in range(1, 10):
        d, state = decide(sig(queue=0), state, CFG, now_s=t)
    assert state.lower_since_s == 1
    # One report asks for 4: one level up (3), and the calm window restarts after it.
    d, state = decide(sig(queue=500), state, CFG, now_s=10)
    assert d.level == 3 and state.lower_since_s is None and state.up_min == 4
    for t in range(11, 41):
        d, state = decide(sig(queue=0), state, CFG, now_s=t)
        assert d.level == 3, t
    d, state = decide(sig(queue=0), state, CFG, now_s=41)
    assert d.level == 0


def test_error_rate_below_min_requests_never_sheds() -> None:
    state = DegradationState()
    d, state = decide(sig(err=0.9, n=5), state, CFG, now_s=0)
    assert d.level == 0
    d, state = decide(sig(err=0.9, n=20), state, CFG, now_s=1)
    assert d.level == 1
    d, state = decide(sig(err=0.9, n=20), state, CFG, now_s=2)
    assert d.level == 3
    assert d.reason.endswith("(n=20) held 1s")


def test_level_bounds() -> None:
    # Every signal at its most extreme still gives level 4, never more.
    extreme = sig(queue=10**9, wait_ms=1e9, gpu=100.0, vram=100.0, err=1.0, n=10**6)
    d, state = decide(extreme, DegradationState(), CFG, 0)
    d, state = decide(extreme, state, CFG, 1)
    assert d.level == MAX_LEVEL
    d, state = decide(extreme, state, CFG, 2)
    assert d.level == MAX_LEVEL and state.up_since_s is None
    # At level 0 a calm target never goes below 0 and never starts a streak.
    state = DegradationState()
    for t in range(0, 100):
        d, state = decide(sig(), state, CFG, now_s=t)
        assert d.level == 0 and state.lower_since_s is None
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="level"):
            DegradationState(level=bad)
    with pytest.raises(ValueError, match="up_min"):
        DegradationState(up_min=7)


def test_clock_going_backwards_restarts_the_streaks() -> None:
    state = DegradationState(level=2, lower_since_s=1000.0, lower_max=0)
    d, state = decide(sig(), state, CFG, now_s=5)
    assert (d.level, state.lower_since_s) == (2, 5)
    d, state = decide(sig(), state, CFG, now_s=35)
    assert d.level == 0
    state = DegradationState(level=0, up_since_s=1000.0, up_min=4)
    d, state = decide(sig(queue=600), state, CFG, now_s=5)
    assert (d.level, state.up_since_s) == (1, 5)


# ----------------------------------------------------------------- capacity gap


def test_a_capacity_gap_holds_the_queue_signals_at_the_level() -> None:
    # One replica serving, then gone (0 of 1): requests wait for the replacement.
    d, state = decide(gap(1, 1), DegradationState(), CFG, now_s=0)
    assert (d.capacity_gap, state.serving_high) == (False, 1)
    for t in range(1, 20):
        d, state = decide(gap(0, 1, wait_ms=3100.0, queue=600), state, CFG, now_s=t)
        assert (d.level, d.capacity_gap) == (0, True), t
    assert d.target_level == 0
    assert d.reason == "normal [capacity gap 0/1 for 18s: queue signals held at 0, would ask 4]"
    assert (state.gap_since_s, state.gap_last_s, state.serving_high) == (1, 19, 1)
    # The replacement serves; the replicas' wait window still holds the gap's waits
    # for capacity_gap_settle_s (10 s): still held, then the signals count again.
    for t in range(20, 30):
        d, state = decide(gap(1, 1, wait_ms=3100.0), state, CFG, now_s=t)
        assert (d.level, d.capacity_gap) == (0, True), t
    d, state = decide(gap(1, 1, wait_ms=3100.0), state, CFG, now_s=30)
    assert (d.level, d.capacity_gap) == (1, False)
    assert (state.gap_since_s, state.gap_last_s) == (None, None)


def test_kv_utilisation_sheds_from_80_percent_tick_by_tick() -> None:
    assert target_level(sig(kv=79.9), CFG) == (0, "normal")
    assert target_level(sig(kv=80.0), CFG) == (1, "kv_util_pct=80>=80")
    assert target_level(sig(kv=96.0), CFG) == (2, "kv_util_pct=96>=90")
    assert target_level(sig(kv=100.0), CFG)[0] == 3  # never 4 by itself
    assert target_level(sig(queue=100, kv=95.0), CFG)[1] == "queue_length=100>=100"  # the queue first on a tie
    # The replicas' caches fill: one level at once, the rest when it holds; back down in one window.
    d, state = decide(sig(kv=85.0), DegradationState(), CFG, now_s=0)
    assert (d.level, d.reason) == (1, "up 0->1: kv_util_pct=85>=80")
    d, state = decide(sig(kv=98.0), state, CFG, now_s=1)
    assert (d.level, d.target_level) == (2, 3)
    d, state = decide(sig(kv=98.0), state, CFG, now_s=2)
    assert d.level == 3
    for t in range(3, 33):
        d, state = decide(sig(kv=40.0), state, CFG, now_s=t)
        assert d.level == 3, t
    d, state = decide(sig(kv=40.0), state, CFG, now_s=33)
    assert (d.level, d.changed) == (0, True)


def test_a_capacity_gap_holds_kv_utilisation_too() -> None:
    # The replica left takes the missing one's rows: its cache fills for the gap's reason.
    state = DegradationState(serving_high=2)
    for t in range(5):
        d, state = decide(gap(1, 2, kv=95.0), state, CFG, now_s=t)
        assert (d.level, d.capacity_gap) == (0, True), t
    assert d.reason == "normal [capacity gap 1/2 for 4s: queue signals held at 0, would ask 2]"


def test_a_scale_up_is_demand_not_a_gap() -> None:
    # The autoscaler wants 4 where 1 serves: those 3 were never there; the queue counts.
    d, state = decide(gap(1, 1), DegradationState(), CFG, now_s=0)
    d, state = decide(gap(1, 4, queue=600), state, CFG, now_s=1)
    assert (d.level, d.capacity_gap, state.serving_high) == (1, False, 1)
    d, state = decide(gap(2, 4, queue=600), state, CFG, now_s=2)
    assert (d.level, state.serving_high) == (4, 2)
    # Scaled back down to 1: what it had follows the target down, so 1 serving is no gap.
    d, state = decide(gap(1, 1), state, CFG, now_s=3)
    assert (d.capacity_gap, state.serving_high) == (False, 1)


def test_a_capacity_gap_holds_a_level_it_did_not_raise() -> None:
    state = DegradationState(level=2, serving_high=2)
    d, state = decide(gap(1, 2, queue=600), state, CFG, now_s=0)
    assert (d.level, d.target_level, d.capacity_gap) == (2, 2, True)  # held at 2: no streak either way
    assert state.lower_since_s is None and state.up_since_s is None


def test_gpu_vram_and_errors_are_never_held_by_a_gap() -> None:
    state = DegradationState(serving_high=1)
    d, s2 = decide(gap(0, 1, vram=99.5), state, CFG, now_s=0)
    d, s2 = decide(gap(0, 1, vram=99.5), s2, CFG, now_s=1)
    assert (d.level, d.capacity_gap) == (4, True)
    d, _ = decide(gap(0, 1, err=0.5, n=50), state, CFG, now_s=0)
    assert (d.level, d.target_level) == (1, 3)


def test_a_gap_longer_than_its_limit_is_the_new_capacity() -> None:
    state = DegradationState(serving_high=2)
    for t in range(0, 120):
        d, state = decide(gap(1, 2, queue=600), state, CFG, now_s=t)
        assert d.level == 0, t
    d, state = decide(gap(1, 2, queue=600), state, CFG, now_s=120)
    assert (d.level, d.capacity_gap, state.serving_high) == (1, False, 1)
    d, state = decide(gap(1, 2, queue=600), state, CFG, now_s=121)
    assert d.level == 4


def test_a_gap_that_reopens_within_the_settle_time_keeps_its_clock() -> None:
    state = DegradationState(serving_high=1)
    for t in range(0, 60):
        d, state = decide(gap(0, 1, queue=600), state, CFG, now_s=t)
    for t in range(60, 65):  # closed for 5 s, less than the settle time
        d, state = decide(gap(1, 1), state, CFG, now_s=t)
    d, state = decide(gap(0, 1, queue=600), state, CFG, now_s=65)
    assert state.gap_since_s == 0
    for t in range(66, 120):
        d, state = decide(gap(0, 1, queue=600), state, CFG, now_s=t)
        assert d.level == 0
    d, state = decide(gap(0, 1, queue=600), state, CFG, now_s=120)
    assert d.level == 1  # 120 s of gap in all: no longer held


def test_a_recycle_under_way_holds_the_queue_signals_too() -> None:
    # The surge replica starts beside the old one (on a small host it slows it down),
    # then the old one drains: the waits are the recycle's, not demand.
    state = DegradationState(serving_high=1)
    recycling = LoadSignals(**{**gap(1, 2, wait_ms=310.0).__dict__, "recycling": True})
    for t in range(0, 15):
        d, state = decide(recycling, state, CFG, now_s=t)
        assert (d.level, d.capacity_gap) == (0, True), t
    assert d.reason == "normal [recycle under way for 14s: queue signals held at 0, would ask 1]"
    # Done: the settle time passes, then the signals count again.
    for t in range(15, 25):
        d, state = decide(gap(2, 2, wait_ms=310.0), state, CFG, now_s=t)
        assert d.level == 0, t
    d, state = decide(gap(2, 2, wait_ms=310.0), state, CFG, now_s=25)
    assert d.level == 1


def test_no_gap_without_both_counts() -> None:
    state = DegradationState(serving_high=3)
    d, state2 = decide(sig(queue=600), state, CFG, now_s=0)
    assert not d.capacity_gap and state2.serving_high == 3
    with pytest.raises(ValueError, match="replicas_serving"):
        gap(-1, 1)
    with pytest.raises(ValueError, match="serving_high"):
        DegradationState(serving_high=-1)


def test_conservative_level() -> None:
    assert conservative_level(None, 2) == 2
    assert conservative_level(0, 2) == 2
    assert conservative_level(3, 2) == 3
    assert conservative_level(4, 0) == 4
    with pytest.raises(ValueError, match="floor"):
        conservative_level(1, 5)
    with pytest.raises(ValueError, match="last_level"):
        conservative_level(-1, 0)


# ----------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"queue_length_thresholds": (50, 100, 200)}, "queue_length_thresholds"),
        ({"queue_length_thresholds": (50, 100, 100, 500)}, "queue_length_thresholds"),
        ({"queue_wait_ms_thresholds": (500.0, 250.0, 1000.0, 2000.0)}, "queue_wait_ms_thresholds"),
        ({"gpu_util_pct_thresholds": (85.0, None, 80.0, None)}, "gpu_util_pct_thresholds"),
        ({"kv_util_pct_thresholds": (80.0, 80.0, None, None)}, "kv_util_pct_thresholds"),
        ({"vram_pct_thresholds": (None, None, -1.0, 99.0)}, "vram_pct_thresholds"),
        ({"error_rate_threshold": 0.0}, "error_rate_threshold"),
        ({"error_rate_threshold": 1.5}, "error_rate_threshold"),
        ({"error_rate_min_requests": -1}, "error_rate_min_requests"),
        ({"error_rate_level": 0}, "error_rate_level"),
        ({"stable_window_s": 0.0}, "stable_window_s"),
        ({"stable_window_s": -1.0}, "stable_window_s"),
        ({"constraints": DEFAULT_CONSTRAINTS[:4]}, "constraints"),
        # A higher level may not admit what a lower one refuses.
        ({"constraints": (*DEFAULT_CONSTRAINTS[:4], DEFAULT_CONSTRAINTS[0])}, "constraints"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DegradationConfig(**kwargs)


def test_config_dict_round_trip_and_list_coercion() -> None:
    assert DegradationConfig.from_dict(CFG.to_dict()) == CFG
    cfg = DegradationConfig.from_dict({"queue_length_thresholds": [10, 20, 30, 40], "stable_window_s": 5})
    assert cfg.queue_length_thresholds == (10, 20, 30, 40)
    assert cfg.constraints == DEFAULT_CONSTRAINTS
    assert target_level(sig(queue=30), cfg)[0] == 3
    with pytest.raises(ValueError, match="stable_windw_s"):
        DegradationConfig.from_dict({"stable_windw_s": 5})


def test_signals_validation() -> None:
    with pytest.raises(ValueError, match="queue_length"):
        sig(queue=-1)
    with pytest.raises(ValueError, match="gpu_util_pct"):
        sig(gpu=float("nan"))
    with pytest.raises(ValueError, match="error_rate"):
        sig(err=1.5)
    with pytest.raises(ValueError, match="request_count"):
        sig(n=-3)


# ----------------------------------------------------------------- demand by criticality


def demand(
    cp: float = 0.0, c: float = 0.0, sp: float = 0.0, s: float = 0.0, capacity: float | None = 35.0
) -> LoadSignals:
    return LoadSignals(
        queue_length=0,
        queue_wait_p95_ms=None,
        gpu_util_pct=None,
        vram_pct=None,
        error_rate=None,
        demand_rps={"critical_plus": cp, "critical": c, "sheddable_plus": sp, "sheddable": s},
        capacity_rps=capacity,
    )


def test_demand_sheds_a_class_only_when_the_classes_kept_fill_the_model() -> None:
    # Four times capacity, 20 % critical: critical + sheddable_plus fill it, critical alone
    # does not. Level 1 (sheddable out), not level 2, which would idle the model.
    level, reason = target_level(demand(7.0, 21.0, 42.0, 70.0), CFG)
    assert level == 1
    assert reason.startswith("demand=70>=38.5 (capacity_rps) for critical_plus,critical,sheddable_plus")
    # Critical alone beyond capacity: level 2.
    assert target_level(demand(10.0, 35.0, 42.0, 70.0), CFG)[0] == 2
    # Critical_plus alone beyond capacity: level 3; level 4 (nothing admitted) is never asked for.
    assert target_level(demand(50.0, 35.0, 42.0, 70.0), CFG)[0] == 3


def test_classes_that_are_all_served_never_read_as_filling_the_model() -> None:
    # Everything offered was answered: demand == capacity. The ratio (1.1) keeps this at 0.
    assert target_level(demand(3.5, 10.5, 21.0, 0.0, capacity=35.0), CFG) == (0, "normal")
    # No capacity figure (the gate was not full), or no demand: the signal is absent.
    assert target_level(demand(100.0, 100.0, 100.0, 100.0, capacity=None), CFG) == (0, "normal")
    assert target_level(demand(capacity=35.0), CFG) == (0, "normal")
    # Disabled by config.
    off = DegradationConfig(demand_shed_ratio=None)
    assert target_level(demand(7.0, 21.0, 42.0, 70.0), off) == (0, "normal")


def at_one_c(capacity: float | None) -> LoadSignals:
    """1 C of the bench's mix (57 req/s: half of it sheddable) with the gate's answer rate ``capacity``."""
    return demand(2.85, 8.55, 17.1, 28.5, capacity=capacity)


def test_a_stall_that_halves_one_windows_answers_is_not_a_smaller_model() -> None:
    # The gate answered 52 req/s while full; then a 3 s stall of the host: 25 req/s in the
    # next window. The classes level 1 keeps (28.5 req/s) are >= 1.1 x 25, not 1.1 x 52.
    d, state = decide(at_one_c(52.0), DegradationState(), CFG, now_s=0)
    assert d.level == 0 and state.capacity_peak_rps == 52.0
    for t in range(1, 31):
        d, state = decide(at_one_c(25.0), state, CFG, now_s=t)
        assert d.level == 0, t  # the peak holds for capacity_window_s (30)
    assert (state.capacity_peak_rps, state.capacity_peak_s) == (52.0, 0)
    # Past the window the model is read as smaller, and the level follows the demand.
    d, state = decide(at_one_c(25.0), state, CFG, now_s=31)
    assert d.level == 1 and d.reason.startswith("up 0->1: demand=28.5>=27.5 (capacity_rps)")
    assert (state.capacity_peak_rps, state.capacity_peak_s) == (25.0, 31)


def test_without_a_capacity_window_the_latest_answer_rate_is_the_capacity() -> None:
    cfg = DegradationConfig(capacity_window_s=0.0)
    _, state = decide(at_one_c(52.0), DegradationState(), cfg, now_s=0)
    d, _ = decide(at_one_c(25.0), state, cfg, now_s=1)
    assert d.level == 1


def test_a_higher_answer_rate_replaces_the_peak_and_an_unmeasured_tick_keeps_it() -> None:
    _, state = decide(at_one_c(40.0), DegradationState(), CFG, now_s=0)
    _, state = decide(at_one_c(52.0), state, CFG, now_s=10)
    assert (state.capacity_peak_rps, state.capacity_peak_s) == (52.0, 10)
    d, state = decide(at_one_c(None), state, CFG, now_s=20)  # the gate not full: no capacity read
    assert d.level == 0 and (state.capacity_peak_rps, state.capacity_peak_s) == (52.0, 10)
    d, _ = decide(at_one_c(25.0), state, CFG, now_s=39)
    assert d.level == 0  # 29 s after the peak: still in the window
    # A clock that went back forgets the peak rather than keeping it for ever.
    d, state = decide(at_one_c(25.0), state, CFG, now_s=5)
    assert d.level == 1 and (state.capacity_peak_rps, state.capacity_peak_s) == (25.0, 5)


def test_the_capacity_window_is_checked() -> None:
    with pytest.raises(ValueError, match="capacity_window_s"):
        DegradationConfig(capacity_window_s=-1.0)
    with pytest.raises(ValueError, match="capacity_peak_rps"):
        DegradationState(capacity_peak_rps=float("nan"))


def test_demand_never_lowers_what_another_signal_asks_for() -> None:
    s = LoadSignals(
        queue_length=250,
        queue_wait_p95_ms=None,
        gpu_util_pct=None,
        vram_pct=None,
        error_rate=None,
        demand_rps={"sheddable": 100.0, "sheddable_plus": 100.0},
        capacity_rps=35.0,
    )
    assert target_level(s, CFG) == (3, "queue_length=250>=200")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"demand_rps": {"urgent": 1.0}}, "demand_rps"),
        ({"demand_rps": {"critical": -1.0}}, "demand_rps[critical]"),
        ({"demand_rps": [1.0]}, "demand_rps"),
        ({"capacity_rps": float("nan")}, "capacity_rps"),
    ],
)
def test_bad_demand_signals_are_refused(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        LoadSignals(queue_length=0, queue_wait_p95_ms=None, gpu_util_pct=None, vram_pct=None, error_rate=None, **kwargs)
    with pytest.raises(ValueError, match="demand_shed_ratio"):
        DegradationConfig(demand_shed_ratio=0)


# ----------------------------------------------------------------- a step, tick by tick

# The bench's mix at 1 C (57 req/s offered: 5 % critical_plus, 15 % critical, 30 %
# sheddable_plus, 50 % sheddable), against a gate that answered 52 req/s while full.
ONE_C = {"critical_plus": 2.85, "critical": 8.55, "sheddable_plus": 17.1, "sheddable": 28.5}
CAPACITY = 52.0
REPORT_S = 0.5


def load(**fields) -> LoadSignals:
    """Signals with no queue, wait, GPU or errors: only what ``fields`` say."""
    return LoadSignals(
        queue_length=0, queue_wait_p95_ms=None, gpu_util_pct=None, vram_pct=None, error_rate=None, **fields
    )


class Crowd:
    """One router's demand window (``DemandWindow``, on a fake clock) fed one report per
    ``REPORT_S`` at a multiple of 1 C, and the controller's ``decide`` on the tick after
    each report: the path a step takes from the door to the level."""

    def __init__(self, cfg: DegradationConfig = CFG) -> None:
        from ballast.policies.gate import DemandWindow

        self.now = 0.0
        self.cfg = cfg
        self.window = DemandWindow(5.0, clock=lambda: self.now)
        self.state = DegradationState()
        self.levels: list[tuple[float, int, str]] = []

    def report(self, multiple: float, span_s: float = REPORT_S, offered_s: float | None = None) -> int:
        """A report ``span_s`` after the last, with ``offered_s`` seconds of ``multiple`` x
        1 C offered in it (default: its span's), then one control tick; the level."""
        self.now += span_s
        seconds = span_s if offered_s is None else offered_s
        offered = {c: round(rps * multiple * seconds) for c, rps in ONE_C.items()}
        self.window.add(offered, served=round(CAPACITY * span_s), saturated=True)
        rates = self.window.rates()
        signals = load(
            demand_rps=rates["demand_rps"],
            demand_sustained_rps=rates["demand_sustained_rps"] or None,
            demand_recent_max_rps=rates["demand_recent_max_rps"] or None,
            capacity_rps=CAPACITY,
        )
        d, self.state = decide(signals, self.state, self.cfg, now_s=self.now)
        self.levels.append((self.now, d.level, d.reason))
        return d.level

    def run(self, multiple: float, seconds: float) -> list[int]:
        return [self.report(multiple) for _ in range(round(seconds / REPORT_S))]


def test_a_step_to_ten_c_sheds_on_the_first_tick_after_two_reports_see_it() -> None:
    crowd = Crowd()
    assert set(crowd.run(1.0, 10.0)) == {0}
    # The first report of the crowd: the one before it was 1 C, so it is not yet a step.
    assert crowd.report(10.0) == 0
    # The second: both saw it. critical_plus + critical (114 req/s) fill the model by
    # themselves (>= 1.1 x 52), critical_plus alone (28.5) does not: level 2, at once.
    assert crowd.report(10.0) == 2
    assert "up 0->2: demand_now=114>=57.2 (capacity_rps) for critical_plus,critical (a step" in crowd.levels[-1][2]
    assert set(crowd.run(10.0, 10.0)) == {2}


def test_the_window_alone_would_still_be_at_level_one_then() -> None:
    """What the step rule replaces: the 5 s mean, one second into a 10 C crowd, reads
    2.8 C, and asks only for level 1 (one level on a sample, the rest after up_confirm_s)."""
    crowd = Crowd()
    crowd.run(1.0, 10.0)
    crowd.report(10.0)
    crowd.report(10.0)
    window = crowd.window.rates()["demand_rps"]
    slow = load(demand_rps=window, capacity_rps=CAPACITY)
    assert target_level(slow, CFG)[0] == 1


def test_a_step_down_releases_on_the_tick_after_the_crowd_leaves_both_reports() -> None:
    crowd = Crowd()
    crowd.run(1.0, 5.0)
    crowd.run(10.0, 5.0)
    assert crowd.state.level == 2 and crowd.state.by_demand
    # The first 1 C report: the one before it still had the crowd (its peak holds level 2).
    assert crowd.report(1.0) == 2
    # The second: neither report asks; down at once, not after stable_window_s (30 s).
    assert crowd.report(1.0) == 0
    assert "down 2->0" in crowd.levels[-1][2] and "the step is over" in crowd.levels[-1][2]
    assert not crowd.state.by_demand


def test_demand_within_the_band_holds_the_level_without_flapping() -> None:
    """critical_plus + critical between 0.9 and 1.1 x capacity (46.8-57.2 req/s), up and
    down each report: a level the step reached holds; none is reached from below."""
    crowd = Crowd()
    crowd.run(1.0, 5.0)
    crowd.run(10.0, 2.0)
    assert crowd.state.level == 2
    # 4.4 C: critical_plus + critical = 50.2 req/s; 4.9 C: 55.9. Both inside the band.
    levels = [crowd.report(m) for m in [4.4, 4.9] * 20]
    assert set(levels) == {2}
    # From level 0 the same wobble asks for level 1 only (what sheddable_plus adds fills
    # the model), by the window's rule as before; never level 2.
    calm = Crowd()
    calm.run(1.0, 5.0)
    assert 2 not in [calm.report(m) for m in [4.4, 4.9] * 20]


def test_a_three_second_host_stall_and_its_catch_up_shed_nothing() -> None:
    """The host stalls 3 s: no report, then one report spanning the stall with nothing
    offered in it, then the generator's backlog (3.5 s of 1 C) in one half-second. Each
    shows in one of the last two reports only: no step, level 0 throughout."""
    crowd = Crowd()
    crowd.run(1.0, 10.0)
    levels = [crowd.report(1.0, span_s=3.0, offered_s=0.0), crowd.report(1.0, offered_s=3.5)]
    levels += crowd.run(1.0, 10.0)
    assert set(levels) == {0}, crowd.levels


def test_a_step_that_lasts_one_report_only_is_not_a_step() -> None:
    crowd = Crowd()
    crowd.run(1.0, 5.0)
    levels = [crowd.report(10.0), *crowd.run(1.0, 5.0)]
    assert 2 not in levels and 3 not in levels


def test_without_a_release_ratio_a_steps_level_drops_after_the_stable_window() -> None:
    cfg = DegradationConfig(demand_release_ratio=None)
    crowd = Crowd(cfg)
    crowd.run(1.0, 5.0)
    crowd.run(10.0, 5.0)
    assert crowd.state.level == 2
    after = crowd.run(1.0, 40.0)
    first_zero = after.index(0) * REPORT_S
    assert 29.0 <= first_zero <= 31.0  # one stable window, not one report


def test_the_release_ratio_must_leave_a_band() -> None:
    with pytest.raises(ValueError, match="demand_release_ratio"):
        DegradationConfig(demand_shed_ratio=1.1, demand_release_ratio=1.1)
    with pytest.raises(ValueError, match="by_demand"):
        DegradationState(by_demand=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"demand_sustained_rps\[critical\]"):
        load(demand_sustained_rps={"critical": -1.0})
