"""The engine's step curve: the rows an engine that schedules itself runs usefully."""

import math

import pytest

from ballast.policies import control
from ballast.policies import request as rp
from ballast.policies.engine_curve import MIN_ROWS, StepCurve
from ballast.policies.reports import ReplicaReport


def feed(curve: StepCurve, a: float, b: float, rows: range, rounds: int = 10) -> None:
    for _ in range(rounds):
        for r in rows:
            curve.observe(r, a + b * r)


def test_the_fit_finds_the_line_and_the_knee_where_throughput_reaches_the_gain():
    c = StepCurve(gain=0.85)
    feed(c, 0.005, 0.0005, range(1, 33))
    a, b = c.fit()
    assert a == pytest.approx(0.005) and b == pytest.approx(0.0005)
    # rows / (a + b rows) = 0.85 / b at rows = 0.85 / 0.15 * a / b = 56.7
    assert c.rows() == 57
    assert c.snapshot() == {"step_base_ms": 5.0, "step_per_row_ms": 0.5, "rows": 57}
    r = c.rows()
    assert r / (a + b * r) >= 0.85 / b > (r - 1) / (a + b * (r - 1))


def test_a_slower_host_keeps_the_same_knee():
    fast, slow = StepCurve(), StepCurve()
    feed(fast, 0.004, 0.001, range(1, 17))
    feed(slow, 0.004 * 2.5, 0.001 * 2.5, range(1, 17))  # every step 2.5x longer
    assert fast.rows() == slow.rows() == math.ceil(0.85 / 0.15 * 4)


def test_rows_that_cost_nothing_give_no_knee_and_a_flat_step_of_rows_gives_the_floor():
    free = StepCurve()
    feed(free, 0.01, 0.0, range(1, 17))
    assert free.fit() is not None and free.rows() is None  # more rows are free: no cap
    saturated = StepCurve()
    feed(saturated, 0.0, 0.002, range(1, 17))  # step time grows with rows alone
    assert saturated.rows() == MIN_ROWS  # a noisy or saturated fit never closes the engine


def test_no_fit_until_the_steps_spread_over_rows_and_weigh_enough():
    c = StepCurve()
    for _ in range(500):
        c.observe(8, 0.01)  # rows never vary: the slope is unknown
    assert c.fit() is None and c.rows() is None
    few = StepCurve()
    feed(few, 0.005, 0.0005, range(1, 9), rounds=2)  # 16 steps
    assert few.fit() is None
    feed(few, 0.005, 0.0005, range(1, 9), rounds=6)
    assert few.fit() is not None


def test_old_steps_fade_so_the_knee_follows_an_engine_that_changed():
    c = StepCurve(horizon=200)
    feed(c, 0.005, 0.0005, range(1, 17), rounds=20)
    assert c.rows() == 57
    feed(c, 0.005, 0.002, range(1, 17), rounds=60)  # each row now costs four times as much
    assert c.rows() == math.ceil(0.85 / 0.15 * 2.5)


def test_bad_samples_are_ignored():
    c = StepCurve()
    feed(c, 0.003, 0.001, range(1, 17))
    before = c.fit()
    assert before is not None
    for rows, step_s in ((0, 0.01), (-2, 0.01), (math.nan, 0.01), (4, 0.0), (4, -1.0), (4, math.nan), (4, math.inf)):
        c.observe(rows, step_s)
    assert c.fit() == before


def test_the_arguments_are_checked():
    for kwargs in ({"gain": 1.0}, {"gain": 0.0}, {"horizon": 1}, {"min_rows": 0}, {"min_weight": 0}):
        with pytest.raises(ValueError):
            StepCurve(**kwargs)


def report(rid: str, rows, deployment: str = "m") -> ReplicaReport:
    return ReplicaReport(replica_id=rid, deployment=deployment, engine_rows=rows)


def test_a_models_engine_rows_are_its_replicas_sum_only_when_every_one_knows():
    assert control.engine_rows([report("a", 12), report("b", 9), report("c", 40, "other")], "m") == 21
    assert control.engine_rows([report("a", 12), report("b", None)], "m") is None
    assert control.engine_rows([], "m") is None
    with pytest.raises(ValueError):
        report("a", -1)


def test_the_gates_ceiling_takes_no_more_rows_than_the_engines_run_usefully():
    assert rp.model_ceiling(2, 1, 32) == 64
    assert rp.model_ceiling(2, 1, 32, engine_rows=20) == 20
    assert rp.model_ceiling(2, 2, 32, engine_rows=20) == 10  # split among the routers
    assert rp.model_ceiling(2, 2, 32, share=0.25, engine_rows=20) == 5
    assert rp.model_ceiling(1, 1, 8, engine_rows=20) == 8  # the slots still bound it
    assert rp.model_ceiling(0, 1, 8, engine_rows=20) is None
