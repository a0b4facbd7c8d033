"""ballast/policies/hedge.py: the learned delay, the budget and the heartbeats, step by step."""

from __future__ import annotations

import pytest

from ballast.policies.hedge import (
    FIRST_CHUNK,
    NEXT_CHUNK,
    UNARY,
    Heartbeats,
    HedgeBudget,
    HedgeConfig,
    HedgeDelay,
    hedge_limit,
)


def test_no_delay_until_min_samples_then_p95_times_the_factor() -> None:
    d = HedgeDelay(HedgeConfig(factor=3, min_delay_s=0.1, max_delay_s=10, min_samples=20, window=100))
    for _ in range(19):
        d.observe(FIRST_CHUNK, 0.1)
        assert d.delay_s(FIRST_CHUNK) is None  # not learned yet: never hedged
    d.observe(FIRST_CHUNK, 0.1)
    assert d.delay_s(FIRST_CHUNK) == pytest.approx(0.3)
    # One slow wait in 21 is past the p95 (nearest rank 19 of 21): the delay does not move ...
    d.observe(FIRST_CHUNK, 5.0)
    assert d.delay_s(FIRST_CHUNK) == pytest.approx(0.3)
    # ... three of 23 reach it.
    d.observe(FIRST_CHUNK, 0.5)
    d.observe(FIRST_CHUNK, 0.5)
    assert d.delay_s(FIRST_CHUNK) == pytest.approx(1.5)
    # Each kind learns its own.
    assert d.delay_s(NEXT_CHUNK) is None and d.delay_s(UNARY) is None


def test_the_delay_is_clamped_and_the_window_forgets() -> None:
    d = HedgeDelay(HedgeConfig(factor=3, min_delay_s=0.5, max_delay_s=2, min_samples=2, window=2))
    d.observe(NEXT_CHUNK, 0.01)
    d.observe(NEXT_CHUNK, 0.01)
    assert d.delay_s(NEXT_CHUNK) == 0.5  # 0.03 s would hedge on jitter
    d.observe(NEXT_CHUNK, 4)
    d.observe(NEXT_CHUNK, 4)
    assert d.samples(NEXT_CHUNK) == 2 and d.delay_s(NEXT_CHUNK) == 2  # the old ones forgotten; capped
    d.observe(NEXT_CHUNK, float("nan"))
    d.observe(NEXT_CHUNK, -1)
    assert d.samples(NEXT_CHUNK) == 2  # nonsense is not a sample


def test_a_unary_wait_is_learned_per_unit_of_work() -> None:
    d = HedgeDelay(HedgeConfig(factor=2, min_delay_s=0, max_delay_s=100, min_samples=1, window=10))
    d.observe(UNARY, 9.0, max_tokens=8)  # 1 s per unit: its first token and 8 more
    assert d.delay_s(UNARY, max_tokens=8) == pytest.approx(18)
    assert d.delay_s(UNARY, max_tokens=0) == pytest.approx(2)  # a short call is hedged sooner
    off = HedgeDelay(HedgeConfig(enabled=False, min_samples=1, window=1))
    off.observe(UNARY, 1.0)
    assert off.delay_s(UNARY) is None


def test_the_budget_is_a_share_of_the_requests_in_flight_with_a_floor() -> None:
    cfg = HedgeConfig(budget_ratio=0.1, budget_min_concurrent=1)
    assert [hedge_limit(n, cfg) for n in (0, 9, 10, 19, 20, 100)] == [1, 1, 1, 1, 2, 10]
    b = HedgeBudget(cfg)
    assert b.try_acquire(active=10)
    assert not b.try_acquire(active=10)  # one in flight is the limit at 10 requests
    assert b.try_acquire(active=20)
    b.release()
    b.release()
    b.release()  # one too many: never below zero
    assert b.snapshot(active=0) == {"in_flight": 0, "limit": 1, "sent": 2, "denied": 1, "won": 0}
    none = HedgeBudget(HedgeConfig(budget_ratio=0, budget_min_concurrent=0))
    assert not none.try_acquire(active=1000)


def test_a_config_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="min_delay_s"):
        HedgeConfig(min_delay_s=5, max_delay_s=1)
    with pytest.raises(ValueError, match="window"):
        HedgeConfig(min_samples=50, window=10)


def test_a_replica_is_silent_when_its_heartbeat_stops_while_anothers_moves() -> None:
    beats = Heartbeats()
    beats.saw("m", {"a": 1.0, "b": 1.0}, now_s=100)
    assert beats.silent_of("m", after_s=4, now_s=104) == set()  # exactly the limit is not yet silent
    beats.saw("m", {"a": 2.0, "b": 1.0}, now_s=104)  # a beats, b does not
    assert beats.silent_of("m", after_s=4, now_s=104.5) == {"b"}
    assert beats.silent("m", "b", after_s=4, now_s=104.5) and not beats.silent("m", "a", after_s=4, now_s=104.5)
    # Nobody beats for a while: the view stopped, not every replica.
    assert beats.silent_of("m", after_s=4, now_s=109) == set()
    # b beats again: it is back at once.
    beats.saw("m", {"a": 3.0, "b": 5.0}, now_s=110)
    assert beats.silent_of("m", after_s=4, now_s=110) == set()


def test_unknown_replicas_and_ones_without_a_heartbeat_are_never_silent() -> None:
    beats = Heartbeats(max_replicas=2)
    beats.saw("m", {"a": 1.0, "old": None}, now_s=100)
    beats.saw("m", {"a": 2.0, "old": None}, now_s=110)
    assert beats.silent_of("m", after_s=4, now_s=111) == set()  # "old" sends none: an older replica
    assert not beats.silent("m", "never-seen", after_s=4, now_s=111)
    assert not beats.silent("other-model", "a", after_s=4, now_s=111)
    # At most max_replicas are kept: a third is not seen, so never silent.
    beats.saw("m", {"x": 1.0, "y": 1.0, "z": 1.0}, now_s=120)
    beats.saw("m", {"x": 1.0, "y": 2.0, "z": 1.0}, now_s=130)
    assert beats.silent_of("m", after_s=4, now_s=131) == {"x"}


def test_a_models_only_replica_is_silent_while_another_models_replica_beats() -> None:
    beats = Heartbeats()
    beats.saw("solo", {"s": 1.0}, now_s=100)
    beats.saw("fallback", {"f": 1.0}, now_s=100)
    beats.saw("fallback", {"f": 2.0}, now_s=105)  # the fallback's replica beats; solo's does not
    assert beats.silent_of("solo", after_s=4, now_s=106) == {"s"}
    assert beats.silent_of("solo", after_s=4, now_s=110) == set()  # nothing beat since 105: the view stopped


def test_a_replica_serve_no_longer_lists_is_gone_and_silent_until_it_is_listed_again() -> None:
    beats = Heartbeats(max_replicas=2)
    beats.saw("m", {"a": 1.0, "b": 1.0}, now_s=100)
    beats.saw("m", {"a": 1.0}, now_s=101)  # b left the running set (its node lost, say)
    assert beats.silent("m", "b", after_s=4, now_s=101)  # at once: an attempt waiting there is lost
    assert beats.silent_of("m", after_s=4, now_s=101) == set()  # no candidate to leave out
    beats.saw("m", {"a": 1.0, "b": 2.0}, now_s=102)  # listed again (a node back)
    assert not beats.silent("m", "b", after_s=4, now_s=102)
    for i in range(5):  # replicas come and go: the gone ones are bounded too
        beats.saw("m", {f"r{i}": 1.0}, now_s=110 + i)
    assert beats.silent("m", "r3", after_s=4, now_s=120) and not beats.silent("m", "a", after_s=4, now_s=120)


def test_where_a_hedge_could_go_is_the_other_replicas_heard_from() -> None:
    beats = Heartbeats()
    beats.saw("m", {"a": 1.0}, now_s=100)
    assert beats.others("m", "a", after_s=4, now_s=100) == 0  # one replica: nowhere else
    beats.saw("m", {"a": 1.0, "b": 1.0, "c": 1.0}, now_s=101)
    beats.saw("m", {"a": 2.0, "b": 2.0, "c": 1.0}, now_s=104)
    assert beats.others("m", "a", after_s=4, now_s=105.5) == 1  # b; c is silent
    assert beats.others("other", "a", after_s=4, now_s=105.5) == 0
