"""Fair shares in the fleet simulator (loadtest.sim.tenants): small fixed fleets, minutes, so
the file stays fast. At fleet scale: ``python -m loadtest.sim.fairness`` (``make sim-fairness``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from loadtest.sim import BALLAST, RAY_SERVE, SimConfig, simulate
from loadtest.sim.config import TenancyConfig, TenantSpec
from loadtest.sim.fairness import cases, fleet_config, jain, main, overloaded_arrivals, served_ratio
from loadtest.sim.fleet import RequestQueue
from loadtest.sim.tenants import TenantLines, apportion

SMALL = fleet_config(20, 5.0)  # 20 replicas, 300 ticks of 1 s
OVERLOADED = overloaded_arrivals(SMALL, 4.0, 3)
COST_RATIO = (96 + 2 * 16) / (24 + 2 * 16)  # a's request over b's, as the counters weigh them


def run(tenancy: TenancyConfig | None, arr: np.ndarray = OVERLOADED):
    return simulate(replace(SMALL, tenancy=tenancy), RAY_SERVE, 3, arr)


def within(x: float, target: float, tol: float) -> bool:
    return abs(x / target - 1.0) <= tol


# --------------------------------------------------------------------------- first come, first served


def test_fcfs_serves_in_proportion_to_offered_requests():
    ten = TenancyConfig((TenantSpec("a", arrival_share=3.0), TenantSpec("b")), enabled=False)
    a, b = run(ten).tenants
    assert within(a.served / b.served, 3.0, 0.03), (a.served, b.served)
    assert a.backlogged_ticks == b.backlogged_ticks == SMALL.n_ticks


def test_fcfs_gives_the_costlier_tenant_more_service():
    fcfs = cases((1.0, 1.0), 2)[1].tenancy
    r = run(fcfs)
    a, b = r.tenants
    assert within(a.served / b.served, 1.0, 0.03)  # offered alike, served alike in requests ...
    assert within(served_ratio(r), COST_RATIO, 0.03)  # ... so a gets 2.3x b's service
    assert jain(r, SMALL.n_ticks) < 0.9


# --------------------------------------------------------------------------- fair shares


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_fair_shares_follow_the_weights_whatever_the_prompts(weights):
    fair, fcfs = (c.tenancy for c in cases(weights, 2)[:2])
    r = run(fair)
    assert within(served_ratio(r), 1.0, 0.10), served_ratio(r)
    assert jain(r, SMALL.n_ticks) >= 0.95
    assert not within(served_ratio(run(fcfs)), 1.0, 0.10)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_skewed_ingress_needs_the_counters_shared(weights):
    shared, not_shared = (c.tenancy for c in cases(weights, 2)[2:])
    assert shared.routers == 2 and shared.tenants[0].routers == (0,) and shared.tenants[1].routers == (1,)
    assert within(served_ratio(run(shared)), 1.0, 0.10), served_ratio(run(shared))
    # Not shared: each router takes half the fleet, whatever the weights.
    r = run(not_shared)
    assert not within(served_ratio(r), 1.0, 0.10)
    a, b = r.tenants
    assert within(a.served / b.served, 1.0, 0.03)


# --------------------------------------------------------------------------- work conservation


def test_a_lone_tenant_is_served_as_the_one_fifo():
    plain = run(None)
    alone = run(TenancyConfig((TenantSpec("a", prompt_tokens=96, output_tokens=16),)))
    for p, t in zip(plain.classes, alone.classes):
        assert (p.served, p.timed_out, p.queued) == (t.served, t.timed_out, t.queued)
        assert t.served_in_slo == pytest.approx(p.served_in_slo, rel=1e-9)
    assert alone.tenants[0].served == plain.total("served") > 0


def test_the_order_never_leaves_capacity_idle_at_one_router():
    fair, fcfs = (c.tenancy for c in cases((2.0, 1.0), 2)[:2])
    starts = {run(t).total("served") for t in (None, fair, fcfs)}
    assert len(starts) == 1  # every tick starts its whole capacity, whoever it goes to


def test_a_router_keeps_its_floor_when_nobody_waits_there():
    # A lone tenant through router 0 of two: router 1 keeps floor / 2 of the fleet, as a
    # gate's ceiling is not lent to another router.
    ten = TenancyConfig((TenantSpec("a"),), routers=2)
    served = run(ten).tenants[0].served
    assert within(served / run(None).total("served"), 1.0 - ten.router_floor_ratio / 2, 0.01)


# --------------------------------------------------------------------------- class order


def test_class_order_stays_above_tenant_order():
    # Half the arrivals critical_plus, half sheddable, 1.5x what the fleet starts: every
    # critical_plus request goes first, whichever tenant's counter is lower.
    n = overloaded_arrivals(SMALL, 1.5, 4)[:, 1]
    zero = np.zeros_like(n)
    arr = np.stack([n // 2, zero, zero, n - n // 2], axis=1)
    r = run(cases((1.0, 1.0), 2)[0].tenancy, arr)
    assert r.by_class("critical_plus").timed_out == 0
    assert r.by_class("sheddable").timed_out > 0
    # The one FIFO (no tenants) has no class order: there critical_plus waits its turn too.
    assert run(None, arr).by_class("critical_plus").timed_out > 0


# --------------------------------------------------------------------------- the previous path


def test_no_tenants_gives_the_previous_results():
    """One short run per kind of arm, as the simulator gave it before tenants existed."""
    cfg = SimConfig(replicas_peak=40, hours=20 / 60, start_hour=19.9)
    want = {
        BALLAST: (
            [
                (116935, 111803, 5132, 0, 110392.032),
                (466520, 429562, 36958, 0, 425042.829),
                (350611, 320518, 30093, 0, 319223.661),
                (233591, 212997, 20594, 0, 212727.478),
            ],
            12.493611,
            (1115.0, 3.0, 8.0, 35.0, 39.0),
        ),
        RAY_SERVE: (
            [
                (116935, 115723, 0, 1212, 96474.393),
                (466520, 461569, 0, 4951, 385250.212),
                (350611, 346899, 0, 3712, 288850.347),
                (233591, 231122, 0, 2469, 192321.048),
            ],
            12.269444,
            (1200.0, 0.0, 0.0, 0.0, 0.0),
        ),
    }
    for arm, (classes, replica_hours, levels) in want.items():
        r = simulate(cfg, arm, 5)
        got = [(c.arrivals, c.served, c.shed, c.timed_out, round(c.served_in_slo, 3)) for c in r.classes]
        assert (got, round(r.replica_hours, 6), r.level_seconds, r.tenants) == (classes, replica_hours, levels, ())


# --------------------------------------------------------------------------- tick by tick


def test_a_quantum_starts_where_the_tick_reached():
    whole, parts = RequestQueue(), RequestQueue()
    for q in (whole, parts):
        q.push([0, 10, 0, 0], 0.0, 10.0)  # one arrival per second over [0, 10)
    one = whole.serve(10.0, 6, 2.0, 8.0)
    first = parts.serve(10.0, 2, 2.0, 8.0)
    second = parts.serve(10.0, 4, 2.0, 8.0, start=2)
    assert second.chunks == [(4, 9.0, 7.5)]  # member 2 starts at 10 + 2/2 s, arrived at 2
    assert [a + b for a, b in zip(first.counts, second.counts)] == one.counts == [0, 6, 0, 0]
    # Waits 10, 9.5, 9, 8.5, 8, 7.5: the last two within 8 s, both in the second quantum.
    assert first.in_slo[1] + second.in_slo[1] == one.in_slo[1] == second.in_slo[1] == pytest.approx(2.0)


def lines(routers: int = 1, shared: bool = True, grants: int = 4) -> TenantLines:
    via = (0,) if routers == 1 else (1,)
    ten = TenancyConfig(
        (TenantSpec("a", 1.0, 1.0, 96, 16), TenantSpec("b", 1.0, 1.0, 24, 16, via)),
        routers=routers,
        shared=shared,
        grants_per_router=grants,
    )
    return TenantLines(ten, lag_tokens=1000.0, seed=9)


def test_one_router_tick_by_tick_keeps_the_counters_within_a_quantum():
    tl = lines(grants=4)
    (c,) = tl.counters
    for tick in range(20):
        tl.push([0, 200, 0, 0], float(tick), 1.0)
        assert c.backlog() == ("a", "b")
        waiting = tl.total
        got = tl.serve(float(tick), 40, 40.0, 0.5)
        assert sum(got.counts) == 40 and tl.total == waiting - 40
        # At most one quantum (10 requests) of either tenant ahead: 10 x a's 128 tokens.
        assert abs(c.counter("a") - c.counter("b")) <= 10 * 128
        tl.expire(tick - 5.0)
    a, b = tl.stats()
    assert within(a.service / b.service, 1.0, 0.05)  # 800 started: one quantum is ~4 % of either's
    assert b.served > 2 * a.served


def test_a_tenant_served_dry_leaves_the_backlog_and_is_lifted_on_return():
    tl = lines()
    (c,) = tl.counters
    tl.push([0, 10, 0, 0], 0.0, 1.0)
    tl.serve(0.0, 100, 100.0, 0.5)  # everyone started: both drained
    assert c.backlog() == () and tl.total == 0
    before = c.counters()
    for tick in range(1, 5):  # b alone for four ticks
        tl.arrive("b", 0, 1, 50, float(tick), 1.0)
        tl.serve(float(tick), 50, 50.0, 0.5)
    assert c.counter("b") > before["b"] and c.counter("a") == before["a"]
    tl.arrive("a", 0, 1, 5, 5.0, 1.0)
    # No credit for idling: a is lifted to b's counter as b left the backlog, which was
    # before the charge of b's last grant (11 requests of 56), as at the gate.
    assert c.counter("a") == pytest.approx(c.counter("b") - 11 * 56)


def test_shared_counters_merge_at_the_control_tick_and_apportion_the_fleet():
    tl = lines(routers=2, shared=True)
    r0, r1 = tl.counters
    tl.push([0, 400, 0, 0], 0.0, 1.0)
    assert tl.shares is None and tl.startable(100) == 100  # even split until the first control tick
    tl.serve(0.0, 100, 100.0, 0.5)  # 50 each: a's cost more, so a is ahead
    assert r0.counter("b") == 0.0 and r1.counter("a") == 0.0  # each router saw one tenant
    tl.control()
    assert r0.counters() == r1.counters() == tl.cluster
    assert tl.cluster["a"] == pytest.approx(50 * 128) and tl.cluster["b"] == pytest.approx(50 * 56)
    assert tl.shares is not None and tl.shares[1] > 0.9  # b's router, behind, gets most of the fleet
    assert tl.shares[0] >= tl.spec.router_floor_ratio / 2


def test_not_shared_each_router_keeps_its_own_view_and_half_the_fleet():
    tl = lines(routers=2, shared=False)
    r0, r1 = tl.counters
    tl.push([0, 400, 0, 0], 0.0, 1.0)
    for tick in range(3):
        got = tl.serve(float(tick), 100, 100.0, 0.5)
        tl.control()
        assert sum(got.counts) == 100 and tl.shares is None
    assert r0.counter("b") == 0.0 and r1.counter("a") == 0.0
    a, b = tl.stats()
    assert a.served == b.served == 150


def test_apportion_is_exact():
    assert apportion(10, [0.5, 0.5]) == [5, 5]
    assert apportion(11, [0.5, 0.5]) == [6, 5]
    assert apportion(7, [0.05, 0.95]) == [0, 7]
    for n in range(30):
        out = apportion(n, [0.2, 0.3, 0.5])
        assert sum(out) == n and all(abs(o - n * s) < 1 for o, s in zip(out, [0.2, 0.3, 0.5]))


# --------------------------------------------------------------------------- config and CLI


def test_tenancy_is_validated():
    with pytest.raises(ValueError, match="routers"):
        TenancyConfig((TenantSpec("a", routers=(1,)),), routers=1)
    with pytest.raises(ValueError, match="distinct names"):
        TenancyConfig((TenantSpec("a"), TenantSpec("a")))
    with pytest.raises(ValueError, match="weight"):
        TenantSpec("a", weight=0.0)
    with pytest.raises(ValueError, match="grants_per_router"):
        TenancyConfig((TenantSpec("a"),), grants_per_router=0)


def test_cli_prints_the_table(capsys):
    assert main(["--replicas", "10", "--minutes", "1", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("| one router |") == 4 and out.count("| 2 routers, skewed |") == 4
    assert "(a/wa) / (b/wb)" in out and "Wall time" in out
