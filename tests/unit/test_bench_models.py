"""loadtest.bench_models' pure parts: what it reads from the sampled ``/v1/status`` trace
(each model's levels, the reasons it rose, its gate's service time) and its class check.

Its core layout, config and options are in test_cpu_pinning.py; the run itself needs a
Ray Serve stack (``make bench-models``).
"""

from __future__ import annotations

import math

from loadtest.bench_models import A, B, critical_plus_first, gate_service_ms, level_rises, levels_seen
from loadtest.bench_overload import Outcome, Phase

# Three /v1/status samples as the benchmark keeps them: the controller's snapshot per model,
# and the router's own view per model (its level and gate).
TRACE = [
    {
        "snapshot": {"models": {A: {"level": 0, "reason": "ok", "inputs": {}}, B: {"level": 0}}},
        "models": {A: {"level": 0, "gate": {"expected_service_ms": 40.0}}, B: {"level": 0}},
    },
    {
        "snapshot": {"models": {A: {"level": 2, "reason": "queue 240 >= 200", "inputs": {"queue": 240}}}},
        "models": {A: {"level": 1, "gate": {"expected_service_ms": 60.0}}, B: {"level": 0, "gate": {}}},
    },
    {
        "snapshot": {"models": {A: {"level": 1, "reason": "hold", "inputs": {"queue": 90}}}},
        "models": {A: {"level": 2, "gate": {"expected_service_ms": 50.0}}},
    },
    {},  # a sample whose status call failed: nothing in it
]


def test_levels_seen_come_from_the_snapshot_and_the_router():
    assert levels_seen(TRACE, A) == [0, 0, 2, 1, 1, 2]
    assert levels_seen(TRACE, B) == [0, 0, 0]
    assert levels_seen(TRACE, "c") == []


def test_level_rises_keep_the_first_sample_at_each_level():
    rises = level_rises(TRACE, A)
    assert rises == [(1, "hold", {"queue": 90}), (2, "queue 240 >= 200", {"queue": 240})]
    assert level_rises(TRACE, B) == []


def test_gate_service_is_the_median_of_the_samples_that_have_one():
    assert gate_service_ms(TRACE, A) == 50.0
    assert math.isnan(gate_service_ms(TRACE, B))  # B's gate said nothing


def _phase(good_by_class: dict[str, tuple[int, int]]) -> Phase:
    """A phase whose answers are ``good`` within the SLO and ``slow`` past it, by class."""
    p = Phase(rate=10.0, duration_s=1.0, slo_s=1.0)
    for crit, (good, slow) in good_by_class.items():
        p.outcomes += [Outcome(crit, 200, "", 0.5)] * good + [Outcome(crit, 200, "", 2.0)] * slow
    return p


def test_critical_plus_first_compares_its_share_with_every_class_sent():
    assert critical_plus_first(_phase({"critical_plus": (9, 1), "critical": (8, 2), "sheddable": (1, 9)}))
    assert not critical_plus_first(_phase({"critical_plus": (7, 3), "critical": (8, 2)}))
    assert critical_plus_first(_phase({"critical_plus": (1, 1)}))  # no other class was sent
