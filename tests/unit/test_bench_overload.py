"""The overload benchmark's arithmetic: the mix, and goodput and success per phase."""

import math

from loadtest.bench_overload import DEFAULT_MIX, Outcome, Phase, bench_config, criticality_sequence


def test_the_criticality_sequence_is_seeded_and_follows_the_mix():
    a = criticality_sequence(20000, DEFAULT_MIX, seed=3)
    assert a == criticality_sequence(20000, DEFAULT_MIX, seed=3)
    assert a != criticality_sequence(20000, DEFAULT_MIX, seed=4)
    for crit, share in DEFAULT_MIX.items():
        assert abs(a.count(crit) / len(a) - share) < 0.015
    # Critical traffic at 4 C stays within C: the target is reachable at all.
    assert 4 * (DEFAULT_MIX["critical_plus"] + DEFAULT_MIX["critical"]) <= 1.0


def test_goodput_counts_only_answers_within_the_slo():
    p = Phase(rate=10.0, duration_s=2.0, slo_s=1.0)
    p.outcomes = [
        Outcome("critical", 200, "OK", 0.2),
        Outcome("critical", 200, "OK", 1.5),  # answered, but too late: not good
        Outcome("sheddable", 503, "OVERLOADED", 0.01),
        Outcome("sheddable", 0, "ReadTimeout", 10.0),
        Outcome("critical_plus", 200, "OK", 0.9),
    ]
    assert p.good() == 2
    assert p.goodput() == 1.0
    assert p.good_fraction("critical") == 0.5
    assert p.good_fraction("sheddable") == 0.0
    assert math.isnan(p.good_fraction("sheddable_plus"))
    assert p.admitted_p99_ms() == 1500.0  # admitted = answered 200, however late
    assert p.codes()["OK"] == 3


def test_the_bench_tenant_has_no_token_quota_and_its_own_key():
    cfg = bench_config("cluster/local.yaml")
    key = next(k for k, t in cfg.auth.demo_keys.items() if t == "bench")
    assert key and cfg.tenants["bench"].rate_tokens_per_s is None
    assert cfg.tenants["bench"].max_criticality.value == "critical_plus"


def test_the_bench_fixes_the_model_replica_count():
    cfg = bench_config("cluster/local.yaml")
    m = cfg.deployments.model
    assert (m.min_replicas, m.max_replicas) == (1, 1)
    m = bench_config("cluster/local.yaml", model_replicas=2).deployments.model
    assert (m.min_replicas, m.max_replicas, m.initial_replicas) == (2, 2, 2)


def test_level_reasons_are_grouped_without_their_numbers():
    from loadtest.bench_overload import reason_kind

    assert reason_kind("up 2->3: error_rate=0.109005>=0.1 (n=211)") == "up 2->3: error_rate"
    assert reason_kind("hold 1: target 0 (normal) for 4.5s of 30s") == "hold 1: target 0 (normal)"
    assert reason_kind("normal") == "normal" and reason_kind(None) is None
