"""The step scenario's pure parts (loadtest.bench_steps): its send times and its figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from loadtest.bench_overload import Outcome
from loadtest.bench_steps import StepFigures, level_moves, parse_steps, send_times, step_figures


def test_send_times_run_back_to_back_evenly_within_each_step():
    times = send_times([2.0, 10.0, 2.0], step_s=1.0)
    assert times[:2] == [0.0, 0.5]
    assert times[2:12] == pytest.approx([1.0 + i / 10 for i in range(10)])
    assert times[12:] == [2.0, 2.5]
    assert times == sorted(times) and len(times) == 14
    assert send_times([0.1], step_s=1.0) == [0.0]  # at least one a step


@dataclass
class FakePhase:
    slo_s: float
    outcomes: list[Outcome] = field(default_factory=list)

    def good_fraction(self, criticality: str) -> float:
        mine = [o for o in self.outcomes if o.criticality == criticality]
        good = [o for o in mine if o.status == 200 and o.latency_s <= self.slo_s]
        return len(good) / len(mine) if mine else math.nan


def test_the_figures_of_a_step_up_and_back_down():
    phase = FakePhase(slo_s=1.0)
    ok = lambda crit, t: Outcome(crit, 200, "OK", 0.2, t)  # noqa: E731
    for t in range(0, 10):  # 1 C: all answered, but one refusal in it
        phase.outcomes.append(ok("critical_plus", t + 0.1))
    phase.outcomes.append(Outcome("sheddable", 503, "OVERLOADED", 0.01, 5.5))
    for t in range(10, 20):  # 10 C: refusals from 11.3 on; one critical_plus late
        phase.outcomes.append(ok("critical_plus", t + 0.1))
        phase.outcomes.append(Outcome("sheddable", 503, "OVERLOADED", 0.01, t + 1.3) if t < 19 else ok("sheddable", t))
    phase.outcomes.append(Outcome("critical_plus", 200, "OK", 1.5, 10.2))
    for t in range(20, 30):  # back to 1 C: one refusal left over from the crowd
        phase.outcomes.append(ok("critical_plus", t + 0.1))
    phase.outcomes.append(Outcome("sheddable", 503, "OVERLOADED", 0.01, 20.4))
    trace = [{"_t": t / 2, "level": 2 if 21 <= t < 46 else 0} for t in range(60)]  # level 2 from 10.5 s to 23 s
    f = step_figures(phase, [1.0, 10.0, 1.0], 10.0, trace)
    assert f.refused_1c == 2  # the one at 5.5 s and the one at 20.4 s, not the crowd's
    assert f.refused_1c_at == {5: 1, 20: 1}
    assert f.critical_plus == pytest.approx(30 / 31)
    up, down = f.steps
    assert (up.before, up.after, up.at_s) == (1.0, 10.0, 10.0)
    assert up.first_refusal_s == pytest.approx(1.3) and up.level0_after_s is None
    assert down.level0_after_s == pytest.approx(3.0) and down.first_refusal_s is None
    second = {r.s: r for r in up.rows}
    assert (second[0].plus_sent, second[0].plus_missed, second[0].level) == (2, 1, 2)
    assert second[-1].level == 0 and second[1].refused == 1
    line = f.final_line("builtin")
    assert line == "steps builtin: critical_plus=0.9677 refused_1c=2 first_refusal_s=1.30 level0_after_s=3.00"


def test_a_run_with_no_refusal_and_no_return_reads_nan():
    f = StepFigures(1.0, 0, [])
    assert (
        f.final_line("vllm") == "steps vllm: critical_plus=1.0000 refused_1c=0 first_refusal_s=nan level0_after_s=nan"
    )


def test_the_steps_flags_are_checked_and_the_rest_left_to_the_overload_bench():
    own, rest = parse_steps(["--steps", "1,10,1", "--step-s", "5", "--capacity", "40"])
    assert own.steps == [1.0, 10.0, 1.0] and own.step_s == 5.0 and rest == ["--capacity", "40"]
    for bad in (["--steps", "1"], ["--steps", "1,x"], ["--steps", "1,0"], ["--step-s", "0.5"]):
        with pytest.raises(SystemExit):
            parse_steps(bad)


def test_each_level_move_is_listed_once_with_its_reason_and_inputs():
    up = {
        "reason": "up 0->2: demand_now",
        "inputs": {
            "queue_wait_p95_ms": 60.0,
            "kv_util_pct": None,
            "demand_sustained_rps": {"critical": 40.0, "sheddable": 10.04},
        },
    }
    trace = [
        {"_t": 0.5, "level": 0},
        {"_t": 1.0, "level": 2, "controller": up},
        {"_t": 1.5, "level": 2, "controller": up},  # no move
        {"_t": 2.0},  # a sample without a level: skipped
        {"_t": 2.5, "level": 0, "controller": {"reason": "down 2->0", "inputs": {}}},
    ]
    assert level_moves(trace) == [
        "   1.00 s: 0 -> 2: up 0->2: demand_now {'queue_wait_p95_ms': 60.0, 'demand_sustained': 50.0}",
        "   2.50 s: 2 -> 0: down 2->0 {}",
    ]
