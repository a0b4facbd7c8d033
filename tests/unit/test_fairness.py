"""Virtual token counters (ballast/policies/fairness.py) step by step, and the gate
ordering tenants inside a class by them (ballast/router/gate.py) on a fake clock."""

import asyncio
import math
import random

import pytest

from ballast.policies.fairness import FairnessConfig, TenantCounters, jain_index, merge_reports
from tests.unit.test_gate import far, gate, settle

# 1 per prompt token, 2 per output token (the defaults), so costs are easy to read.
CFG = FairnessConfig()


def counters(**weights: float) -> TenantCounters:
    return TenantCounters(weights or {"a": 1.0, "b": 1.0}, CFG)


def test_a_slot_charges_prompt_and_max_tokens_then_settles_to_what_was_generated():
    c = counters()
    charge = c.charge("a", 10, 20)
    assert c.counter("a") == 10 + 2 * 20
    c.settle(charge, 5)  # stopped early: 15 output tokens never made
    assert c.counter("a") == 10 + 2 * 5
    c.settle(c.charge("b", 4, 3), None)  # unknown: the upfront charge stands
    assert c.counter("b") == 4 + 2 * 3


def test_weight_divides_the_cost():
    c = counters(a=1.0, b=2.0)
    c.charge("a", 100, 0)
    c.charge("b", 100, 0)
    assert (c.counter("a"), c.counter("b")) == (100.0, 50.0)


def test_a_tenant_that_becomes_backlogged_is_lifted_to_the_lowest_backlogged_counter():
    c = counters(a=1.0, b=1.0, q=1.0)
    c.backlogged("a")
    c.backlogged("b")
    c.charge("a", 500, 0)
    c.charge("b", 300, 0)
    assert c.counter("q") == 0.0
    c.backlogged("q")  # idle until now: lifted to min(500, 300), earning nothing for the quiet time
    assert c.counter("q") == 300.0
    c.backlogged("q")  # already backlogged: no second lift
    assert c.counter("q") == 300.0
    c.charge("q", 50, 0)
    assert c.pick(["a", "b", "q"]) == "b"  # 300 < 350 < 500


def test_a_counter_above_the_floor_is_never_lowered_by_a_lift():
    c = counters()
    c.backlogged("b")
    c.charge("a", 900, 0)
    c.backlogged("a")  # 900 is above b's 0: kept, not lowered
    assert c.counter("a") == 900.0


def test_with_nobody_backlogged_the_floor_is_the_last_tenant_to_leave():
    c = counters(a=1.0, b=1.0)
    c.backlogged("a")
    c.charge("a", 700, 0)
    c.drained("a")  # the line empties; a leaves at 700
    assert not c.is_backlogged("a")
    c.backlogged("b")  # the next burst, after a quiet spell: b starts at 700, not 0
    assert c.counter("b") == 700.0


def test_a_burst_after_idling_earns_nothing():
    """b is idle while a is served alone; when b's burst arrives, b and a alternate at
    once instead of b taking every slot until it has 'caught up'."""
    c = counters()
    c.backlogged("a")
    for _ in range(50):  # a alone: work-conserving, it takes every slot
        assert c.pick(["a"]) == "a"
        c.charge("a", 10, 0)
    c.backlogged("b")
    served = []
    for _ in range(10):
        t = c.pick(["a", "b"])
        served.append(t)
        c.charge(t, 10, 0)
    assert served.count("b") == 5, served


def test_pick_takes_the_lowest_counter_and_the_first_given_among_equals():
    c = counters(a=1.0, b=1.0, c=1.0)
    assert c.pick(["b", "a", "c"]) == "b"
    c.charge("b", 1, 0)
    assert c.pick(["b", "a", "c"]) == "a"
    assert c.pick([]) is None


@pytest.mark.parametrize("wa, wb", [(1.0, 1.0), (2.0, 1.0)])
def test_two_backlogged_tenants_share_by_weight_whatever_their_prompt_lengths(wa: float, wb: float):
    """One slot; a sends prompts 4x longer than b's. Served tokens (input + 2 x output)
    follow the weights within one request's cost."""
    c = TenantCounters({"a": wa, "b": wb}, CFG)
    cost = {"a": (400, 50), "b": (100, 50)}
    served = {"a": 0.0, "b": 0.0}
    c.backlogged("a")
    c.backlogged("b")
    for _ in range(600):
        t = c.pick(["a", "b"])
        prompt, out = cost[t]
        c.charge(t, prompt, out)
        served[t] += prompt + 2 * out
    ratio = (served["a"] / wa) / (served["b"] / wb)
    assert ratio == pytest.approx(1.0, abs=0.02)
    assert jain_index([served["a"] / wa, served["b"] / wb]) >= 0.999


def test_the_service_difference_of_two_backlogged_tenants_stays_within_the_bound_on_a_trace():
    """VTC's bound: while both are backlogged, their weighted service differs by at most
    2 x the largest request's cost. Walked request by request on a recorded (seeded) trace
    of mixed sizes, settled to what each really generated."""
    rng = random.Random(7)
    trace = [(rng.choice("ab"), rng.randint(1, 300), rng.randint(1, 200), rng.random()) for _ in range(2000)]
    c = counters()
    c.backlogged("a")
    c.backlogged("b")
    queues = {"a": [r for r in trace if r[0] == "a"], "b": [r for r in trace if r[0] == "b"]}
    served = {"a": 0.0, "b": 0.0}
    largest = max(p + 2 * m for _, p, m, _ in trace)
    while queues["a"] and queues["b"]:
        t = c.pick(["a", "b"])
        _, prompt, max_tokens, stop = queues[t].pop(0)
        charge = c.charge(t, prompt, max_tokens)
        generated = int(max_tokens * stop)
        c.settle(charge, generated)
        served[t] += prompt + 2 * generated
        assert abs(served["a"] - served["b"]) <= 2 * largest


def test_reports_carry_what_was_charged_and_adopting_the_cluster_keeps_only_what_came_after():
    r1, r2 = counters(), counters()
    r1.charge("a", 100, 0)  # tenant a only through router 1
    r2.charge("b", 30, 0)  # tenant b only through router 2
    cluster = merge_reports({}, [r1.take_report(), r2.take_report()])
    assert cluster == {"a": 100.0, "b": 30.0}
    r1.charge("a", 5, 0)  # after the report: local until the next one
    r1.adopt(cluster)
    r2.adopt(cluster)
    assert r1.shared and r2.shared
    assert r1.counters() == {"a": 105.0, "b": 30.0}
    assert r2.counters() == {"a": 100.0, "b": 30.0}  # router 2 now sees what router 1 served a
    assert r2.pick(["a", "b"]) == "b"
    assert r1.take_report() == {"a": 5.0}
    assert r1.take_report() == {}


def test_without_the_controller_a_router_keeps_ordering_by_its_own_view():
    r = counters()
    r.adopt({"a": 50.0, "b": 0.0})
    r.charge("b", 80, 0)
    r.adopt(None)  # fail-static: nothing forgotten, nothing shared
    assert not r.shared
    assert r.counters() == {"a": 50.0, "b": 80.0}


def test_bad_settings_and_unknown_tenants_are_refused():
    with pytest.raises(ValueError, match="output_weight"):
        FairnessConfig(output_weight=-1)
    with pytest.raises(ValueError, match="both be 0"):
        FairnessConfig(input_weight=0, output_weight=0)
    with pytest.raises(ValueError, match="weight of 'a'"):
        TenantCounters({"a": 0.0})
    with pytest.raises(KeyError, match="unknown tenant 'z'"):
        counters().charge("z", 1, 1)


def test_jain_index():
    assert jain_index([]) == 1.0
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)


# -- the gate ------------------------------------------------------------------------------


def test_the_gate_serves_the_tenant_with_the_lowest_counter_first_inside_a_class():
    async def main():
        fair = counters(a=1.0, b=1.0)
        g = gate(limit=1, fair=fair)
        held = await g.acquire(3, far(), "a", (100, 0))  # a holds the only slot, charged 100
        order: list[str] = []

        async def waiter(tenant: str) -> None:
            share = await g.acquire(3, far(), tenant, (100, 0))
            order.append(tenant)
            g.settle(share, 0)

        tasks = [asyncio.create_task(waiter(t)) for t in "aaab"]  # a's three came first
        await settle()
        assert g.waiting == 4
        g.settle(held, 0)
        for _ in range(4):
            g.release()
            await settle()
        await asyncio.gather(*tasks)
        # b, idle until its request came, was lifted to a's 100: on the tie a's oldest goes;
        # then b (100) goes before a's older requests (200); then a's, the only ones left.
        assert order == ["a", "b", "a", "a"]
        assert fair.counters() == {"a": 400.0, "b": 200.0}

    asyncio.run(main())


def test_class_order_stays_above_tenant_order():
    async def main():
        fair = counters(a=1.0, b=1.0)
        g = gate(limit=1, fair=fair)
        fair.charge("a", 10_000, 0)  # a has had far more than b
        await g.acquire(0, far(), "b", (1, 0))
        order: list[str] = []

        async def waiter(name: str, tenant: str, rank: int) -> None:
            await g.acquire(rank, far(), tenant, (1, 0))
            order.append(name)

        tasks = [asyncio.create_task(waiter("b-sheddable", "b", 3)), asyncio.create_task(waiter("a-critical", "a", 1))]
        await settle()
        for _ in range(2):
            g.release()
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["a-critical", "b-sheddable"]

    asyncio.run(main())


def test_a_slot_granted_to_a_client_that_left_is_refunded():
    async def main():
        fair = counters()
        g = gate(limit=1, fair=fair)
        await g.acquire(0, far(), "a", (1, 0))
        t = asyncio.create_task(g.acquire(0, far(), "b", (50, 10)))
        await settle()
        g.release()  # grants b's waiter ...
        t.cancel()  # ... whose client leaves in the same instant
        with pytest.raises(asyncio.CancelledError):
            await t
        assert fair.counter("b") == 0.0
        assert g.in_flight == 0

    asyncio.run(main())


def test_without_counters_the_gate_keeps_first_come_first_served_inside_a_class():
    async def main():
        g = gate(limit=1)
        await g.acquire(3, far(), "a", (100, 0))
        order: list[str] = []

        async def waiter(name: str, tenant: str) -> None:
            await g.acquire(3, far(), tenant, (100, 0))
            order.append(name)

        tasks = [asyncio.create_task(waiter(n, t)) for n, t in (("a1", "a"), ("a2", "a"), ("b1", "b"))]
        await settle()
        for _ in range(3):
            g.release()
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["a1", "a2", "b1"]

    asyncio.run(main())


# -- the model's slots among routers -------------------------------------------------------

from ballast.policies.fairness import router_shares  # noqa: E402


def test_with_nobody_waiting_the_even_split_stands():
    assert router_shares({"r1": (), "r2": ()}, {}, {"a": 1.0}, 2048.0, 0.1) == {}
    assert router_shares({}, {}, {"a": 1.0}, 2048.0, 0.1) == {}


def test_routers_share_the_model_by_the_weights_of_the_tenants_waiting_at_them():
    w = {"a": 2.0, "b": 1.0, "c": 1.0}
    shares = router_shares({"r1": ("a",), "r2": ("b",), "r3": ()}, {"a": 0.0, "b": 0.0}, w, 2048.0, 0.3)
    assert shares == pytest.approx({"r1": 0.1 + 0.7 * 2 / 3, "r2": 0.1 + 0.7 / 3, "r3": 0.1})
    assert sum(shares.values()) == pytest.approx(1.0)
    # c waits at both routers: its weight is split between them.
    shares = router_shares({"r1": ("a", "c"), "r2": ("c",)}, {}, w, 2048.0, 0.0)
    assert shares == pytest.approx({"r1": 2.5 / 3, "r2": 0.5 / 3})


def test_a_tenant_ahead_of_the_others_loses_share_by_a_factor_e_per_lag():
    w = {"a": 1.0, "b": 1.0}
    even = router_shares({"r1": ("a",), "r2": ("b",)}, {"a": 0.0, "b": 0.0}, w, 100.0, 0.0)
    ahead = router_shares({"r1": ("a",), "r2": ("b",)}, {"a": 100.0, "b": 0.0}, w, 100.0, 0.0)
    assert even["r1"] == pytest.approx(0.5)
    assert ahead["r1"] == pytest.approx(math.exp(-1) / (1 + math.exp(-1)))
    far_ahead = router_shares({"r1": ("a",), "r2": ("b",)}, {"a": 1e9, "b": 0.0}, w, 100.0, 0.0)
    assert far_ahead["r1"] >= 0.0 and far_ahead["r2"] == pytest.approx(1.0)  # no overflow, no NaN
    with pytest.raises(ValueError, match="lag_tokens"):
        router_shares({"r1": ("a",)}, {}, w, 0.0, 0.1)
    with pytest.raises(ValueError, match="floor_ratio"):
        router_shares({"r1": ("a",)}, {}, w, 1.0, 1.0)


@pytest.mark.parametrize("wa, wb", [(1.0, 1.0), (2.0, 1.0)])
def test_skewed_ingress_shares_by_weight_only_with_shared_counters(wa: float, wb: float):
    """Tenant a only through router 1, b only through router 2, both always waiting; a's
    requests cost 2.3x b's per slot-second (4x the prompt). Tick by tick (1 s): the
    controller's shares set each router's slots; each tenant's counter grows by what its
    slots served. With the counters shared, served service per unit of weight evens out
    (within 10 %); with an even split of the slots it follows the request costs instead."""
    slots, cost = 32, {"a": 2.3 * 40.0, "b": 40.0}  # weighted tokens per slot-second, before the weight
    weights = {"a": wa, "b": wb}

    def run(shared: bool) -> float:
        counters = {"a": 0.0, "b": 0.0}
        served = {"a": 0.0, "b": 0.0}
        for tick in range(600):
            shares = router_shares({"r1": ("a",), "r2": ("b",)}, counters, weights, 2048.0, 0.1) if shared else {}
            for t, r in (("a", "r1"), ("b", "r2")):
                got = slots * shares.get(r, 0.5) * cost[t]
                counters[t] += got / weights[t]
                if tick >= 100:  # after the first lead built up
                    served[t] += got
        return (served["a"] / wa) / (served["b"] / wb)

    assert run(shared=True) == pytest.approx(1.0, abs=0.1)
    assert run(shared=False) == pytest.approx(2.3 * wb / wa, rel=0.01)  # what sharing fixes


def test_served_per_second_counts_settled_service_over_the_last_30_s():
    from tests.unit.fakes import FakeClock

    clock = FakeClock(100)
    c = TenantCounters({"a": 2.0, "b": 1.0}, CFG, clock=clock)
    c.settle(c.charge("a", 10, 20), 5)  # served (10 + 2 x 5) / 2 = 10
    c.settle(c.charge("b", 4, 3), None)  # unknown: the charge, 10
    assert c.served_per_s() == pytest.approx({"a": 10 / 30, "b": 10 / 30})
    clock.advance(29)
    c.settle(c.charge("a", 60, 0), 0)
    assert c.served_per_s() == pytest.approx({"a": 40 / 30, "b": 10 / 30})
    clock.advance(1)  # the first second's samples leave
    assert c.served_per_s() == pytest.approx({"a": 30 / 30, "b": 0.0})
    assert c.view()["served_per_s"] == {"a": 1.0, "b": 0.0}
    clock.advance(30)
    assert c.served_per_s() == {"a": 0.0, "b": 0.0}
