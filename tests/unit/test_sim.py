"""Fleet simulator (loadtest.sim): small fleets and short runs, so the file stays fast.

The full comparison (24 h, 1,000 replicas) is ``python -m loadtest.sim`` (``make sim``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtest.sim import ARMS, BALLAST, BALLAST_NO_RECYCLE, HPA, RAY_SERVE, SimConfig, arrivals, simulate
from loadtest.sim.__main__ import main
from loadtest.sim.baselines import HpaUtilization, RayServeDefault
from loadtest.sim.fleet import RequestQueue, split
from loadtest.sim.model import LoadProfile, ServiceModel, Spike

# 40 minutes around the evening flash crowd (20:00) of a 40-replica fleet.
SPIKE = SimConfig(replicas_peak=40, hours=40 / 60, start_hour=19.75, record_ticks=True)


@pytest.fixture(scope="module")
def spike_results():
    arr = arrivals(SPIKE, 7)
    return {arm: simulate(SPIKE, arm, 7, arr) for arm in ARMS}


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_result():
    a = simulate(SPIKE, BALLAST, 3)
    b = simulate(SPIKE, BALLAST, 3)
    assert a == b
    assert a.ticks  # the per-tick records are compared too


def test_different_seeds_differ():
    a = simulate(SPIKE, BALLAST, 3)
    b = simulate(SPIKE, BALLAST, 4)
    assert a.arrivals != b.arrivals
    assert a != b


def test_arms_share_the_arrivals_of_a_seed(spike_results):
    counts = {arm: [c.arrivals for c in r.classes] for arm, r in spike_results.items()}
    assert len({tuple(v) for v in counts.values()}) == 1


# --------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("arm", ARMS)
def test_conservation_per_class(spike_results, arm):
    r = spike_results[arm]
    for c in r.classes:
        assert c.arrivals == c.served + c.shed + c.timed_out + c.failed + c.queued, c
        assert 0 <= c.served_in_slo <= c.served + 1e-6


def test_conservation_with_crashes_and_timeouts():
    # Many leaks and failures, an overloaded fleet: every path of a request is taken.
    cfg = replace(SPIKE, leak_fraction=0.6, leak_tto_median_h=0.5, mtbf_h=2.0, max_replicas_ratio=1.0)
    for arm in (BALLAST_NO_RECYCLE, RAY_SERVE):
        r = simulate(cfg, arm, 11)
        assert r.total("failed") > 0
        for c in r.classes:
            assert c.arrivals == c.served + c.shed + c.timed_out + c.failed + c.queued, (arm, c)
    assert simulate(cfg, RAY_SERVE, 11).total("timed_out") > 0


# --------------------------------------------------------------------------- shedding


def test_ballast_sheds_by_criticality_at_every_tick(spike_results):
    r = spike_results[BALLAST]
    shedding_ticks = 0
    for t in r.ticks:
        frac = [s / a if a else 0.0 for s, a in zip(t.shed, t.arrivals)]
        # Rank order: a more critical class never loses a larger share than a less critical one.
        assert all(frac[i] <= frac[i + 1] for i in range(3)), t
        if t.shed[0]:  # critical_plus shed only when sheddable is shed entirely
            assert t.shed[3] == t.arrivals[3], t
        shedding_ticks += any(t.shed)
    assert shedding_ticks > 0  # the flash crowd did make it shed
    assert r.by_class("sheddable").shed > r.by_class("critical_plus").shed


def test_baselines_never_shed_and_ballast_protects_critical_traffic(spike_results):
    for arm in (RAY_SERVE, HPA):
        assert spike_results[arm].total("shed") == 0
    ballast = spike_results[BALLAST].by_class("critical_plus").slo_attainment
    for arm in (RAY_SERVE, HPA):
        assert ballast > spike_results[arm].by_class("critical_plus").slo_attainment


# --------------------------------------------------------------------------- leaks and recycling


def test_leaks_crash_replicas_without_recycling_and_not_with_it():
    # Half the replicas leak to OOM in about 2 h; no hard failures, no flash crowd.
    cfg = SimConfig(
        replicas_peak=30,
        hours=6.0,
        start_hour=10.0,
        tick_s=5.0,
        leak_fraction=0.5,
        leak_tto_median_h=2.0,
        leak_tto_sigma=0.3,
        mtbf_h=1e6,
        load=LoadProfile(spike=None),
    )
    without = simulate(cfg, BALLAST_NO_RECYCLE, 5)
    with_ = simulate(cfg, BALLAST, 5)
    assert without.oom_crashes >= 15
    assert with_.oom_crashes * 5 <= without.oom_crashes
    reasons = dict(with_.recycles_by_reason)
    assert reasons.get("watchdog", 0) + reasons.get("critical", 0) > 0
    assert with_.total("failed") < without.total("failed")
    assert without.recycles == 0


# --------------------------------------------------------------------------- autoscaling


@pytest.mark.parametrize("arm", ARMS)
def test_autoscalers_follow_the_diurnal_load(arm):
    cfg = SimConfig(replicas_peak=40, hours=24.0, tick_s=10.0, record_ticks=True, load=LoadProfile(spike=None))
    r = simulate(cfg, arm, 2)

    def mean_live(h0, h1):
        xs = [t.live for t in r.ticks if h0 <= t.t_s / 3600 < h1]
        return sum(xs) / len(xs)

    night, noon = mean_live(2, 5), mean_live(11, 14)
    assert noon > 2.5 * night, (night, noon)
    assert noon <= cfg.max_replicas
    assert r.peak_replicas <= cfg.max_replicas


# --------------------------------------------------------------------------- model pieces


def test_service_model():
    m = ServiceModel()
    assert m.work_ratio(8192) == pytest.approx(1.0)
    assert m.work_ratio(512) < m.work_ratio(1024) < m.work_ratio(2048) <= 1.0
    for b in (1.0, 8.0, 20.0):
        rate = b / m.service_s(b)
        assert m.batch_for_rate(rate, 32) == pytest.approx(b)
    assert m.batch_for_rate(1e9, 32) == 32.0
    assert m.batch_for_rate(0.0, 32) == 0.0


def test_load_profile_shape():
    p = LoadProfile(spike=Spike(start_hour=20.0, ramp_up_s=60.0, hold_s=600.0, ramp_down_s=60.0, ratio=2.0))
    assert p.ratio(12.5) == pytest.approx(1.0)
    assert p.ratio(3.0) < 0.35
    assert p.ratio(20.0 + 5 / 60) == pytest.approx(2.0)
    assert p.ratio(19.9) < 0.6


def test_split_is_proportional_and_exact():
    assert split(5, [1, 4, 3, 2]) == [1, 2, 1, 1]
    assert split(10, [1, 4, 3, 2]) == [1, 4, 3, 2]
    assert split(0, [1, 4, 3, 2]) == [0, 0, 0, 0]
    for m in range(11):
        out = split(m, [1, 4, 3, 2])
        assert sum(out) == m and all(0 <= o <= c for o, c in zip(out, [1, 4, 3, 2]))


def test_queue_fifo_waits_and_timeouts():
    q = RequestQueue()
    q.push([10, 0, 0, 0], 0.0, 10.0)  # one arrival per second over [0, 10)
    # At t = 10, starting 2/s: member i starts at 10 + i/2, arrived at i, waits 10 - i/2.
    got = q.serve(10.0, capacity=4, rate_per_s=2.0, wait_budget_s=9.0)
    assert got.counts == [4, 0, 0, 0]
    assert got.in_slo[0] == pytest.approx(2.0)  # waits 10, 9.5, 9, 8.5: the last two within 9 s
    assert got.chunks == [(4, 10.0, 8.5)]
    assert len(q) == 6
    assert q.expire(6.0) == [2, 0, 0, 0]  # members 4 and 5 arrived before t = 6
    assert len(q) == 4
    assert q.head_wait_s(10.0) == pytest.approx(4.0)


# --------------------------------------------------------------------------- baselines, tick by tick


def test_ray_serve_default_upscale_waits_for_its_delay():
    p = RayServeDefault(8.0, 1, 100, upscale_delay_s=30.0, downscale_delay_s=600.0, look_back_s=1.0)
    target = 2
    for t in range(0, 30, 10):  # wants 4 at t = 0, 10, 20: not yet
        assert p.decide(float(t), 32.0, target) == 2
    assert p.decide(30.0, 32.0, target) == 4


def test_ray_serve_default_interrupted_streak_restarts():
    p = RayServeDefault(8.0, 1, 100, upscale_delay_s=30.0, downscale_delay_s=600.0, look_back_s=1.0)
    assert p.decide(0.0, 32.0, 2) == 2
    assert p.decide(20.0, 16.0, 2) == 2  # back at target: the up-streak is broken
    assert p.decide(30.0, 32.0, 2) == 2  # a new streak starts here
    assert p.decide(50.0, 32.0, 2) == 2
    assert p.decide(60.0, 32.0, 2) == 4


def test_ray_serve_default_downscale_after_600s_in_one_step():
    p = RayServeDefault(8.0, 1, 100, upscale_delay_s=30.0, downscale_delay_s=600.0, look_back_s=1.0)
    for t in range(0, 600, 60):
        assert p.decide(float(t), 8.0, 10) == 10
    assert p.decide(600.0, 8.0, 10) == 1


def test_hpa_syncs_every_15s_and_stabilizes_downscale():
    # Target 50 %; utilization is given as the sum over ready replicas.
    p = HpaUtilization(50.0, 1, 100, sync_s=15.0, stabilization_s=300.0, tolerance=0.1, metric_window_s=1.0)
    assert p.decide(0.0, 4 * 100.0, ready=4, current=4) == 8  # 100 % on 4 -> 8
    assert p.decide(5.0, 4 * 100.0, ready=4, current=8) == 8  # between syncs: unchanged
    assert p.decide(15.0, 8 * 52.0, ready=8, current=8) == 8  # within the 10 % tolerance
    # Load drops to 10 %: the highest recommendation of the last 300 s (8) holds.
    assert p.decide(30.0, 8 * 10.0, ready=8, current=8) == 8
    t = 45.0
    while t < 300.0:
        assert p.decide(t, 8 * 10.0, ready=8, current=8) == 8, t
        t += 15.0
    assert p.decide(315.0, 8 * 10.0, ready=8, current=8) == 2


def test_hpa_scale_up_is_bounded_per_sync():
    p = HpaUtilization(10.0, 1, 1000, sync_s=15.0, stabilization_s=300.0, tolerance=0.1, metric_window_s=1.0)
    assert p.decide(0.0, 10 * 100.0, ready=10, current=10) == 20  # wants 100, max(4, +100 %) per sync


# --------------------------------------------------------------------------- CLI


def test_cli_prints_the_comparison(capsys):
    assert main(["--replicas-peak", "20", "--hours", "0.25", "--tick-s", "5", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    for arm in ARMS:
        assert f"| {arm} |" in out
    assert "SLO attainment" in out and "replica-hours" in out and "Wall time" in out


def test_config_is_validated():
    with pytest.raises(ValueError, match="mix"):
        SimConfig(mix=(0.5, 0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="tick_s"):
        SimConfig(tick_s=0)
    with pytest.raises(ValueError, match="arm"):
        simulate(replace(SPIKE, hours=0.01), "nope", 1)
