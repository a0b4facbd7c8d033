"""The router's priority gate on a real event loop: slots, order, deadlines, bounds."""

import asyncio
import gc
import time

import pytest

from policies.limiter import AimdLimit, LimiterConfig
from serve_app.router.gate import GateRefused, GateSlot, PriorityGate


def gate(limit: int = 1, max_waiting: int = 8, max_wait_s: float = 2.0, **kw) -> PriorityGate:
    cfg = LimiterConfig(initial=limit, min_limit=1, max_limit=limit, target_wait_ms=1e9, interval_s=3600)
    return PriorityGate(AimdLimit(cfg), max_waiting, max_wait_s, **kw)


def far() -> float:
    return time.monotonic() + 60.0


def test_free_slots_are_taken_at_once_and_given_back():
    async def main():
        g = gate(limit=2)
        await g.acquire(3, far())
        await g.acquire(3, far())
        assert (g.in_flight, g.waiting) == (2, 0)
        g.release()
        g.release()
        assert g.in_flight == 0

    asyncio.run(main())


def test_waiters_are_served_most_critical_first_then_oldest_first():
    async def main():
        g = gate(limit=1)
        await g.acquire(0, far())  # holds the only slot
        order: list[str] = []

        async def waiter(name: str, rank: int) -> None:
            await g.acquire(rank, far())
            order.append(name)
            await asyncio.sleep(0)
            g.release()

        tasks = []
        for name, rank in [("sheddable-1", 3), ("critical-1", 1), ("sheddable-2", 3), ("critical_plus", 0), ("critical-2", 1)]:
            tasks.append(asyncio.create_task(waiter(name, rank)))
            await asyncio.sleep(0)
        assert g.waiting == 5
        g.release()
        await asyncio.gather(*tasks)
        assert order == ["critical_plus", "critical-1", "critical-2", "sheddable-1", "sheddable-2"]
        assert (g.in_flight, g.waiting) == (0, 0)

    asyncio.run(main())


def served(g: PriorityGate, *service_s: float) -> None:
    """Requests that took a slot and were answered after ``service_s``."""
    for s in service_s:
        g.in_flight += 1
        g.release(s)


def test_a_waiter_whose_deadline_leaves_no_time_is_refused_at_once():
    async def main():
        g = gate(limit=1)
        served(g, 0.5)
        await g.acquire(0, far())
        t0 = time.monotonic()
        with pytest.raises(GateRefused) as e:
            await g.acquire(0, time.monotonic() + 0.4)  # 0.4 s left < 0.5 s of service
        assert e.value.reason == "no_time"
        assert time.monotonic() - t0 < 0.05
        assert g.refused["no_time"] == 1 and g.waiting == 0

    asyncio.run(main())


def test_sheddable_waiters_need_the_p90_of_service_and_critical_ones_the_mean():
    async def main():
        g = gate(limit=1)
        served(g, *([0.1] * 8 + [0.6] * 2))  # mean-like estimate ~0.2 s, p90 0.6 s
        assert g.expected_service_s < 0.4 and g.snapshot()["service_p90_ms"] == 600.0
        await g.acquire(0, far())
        with pytest.raises(GateRefused) as e:
            await g.acquire(3, time.monotonic() + 0.5)  # enough for the mean, not for the slow tenth
        assert e.value.reason == "no_time"
        # A critical request with the same time left is not refused: it waits its turn.
        critical = asyncio.create_task(g.acquire(1, time.monotonic() + 0.5))
        await asyncio.sleep(0.01)
        assert not critical.done() and g.waiting == 1
        g.release()
        await critical
        assert g.served == 10 and g.in_flight == 1

    asyncio.run(main())


def test_a_newcomer_behind_a_line_that_cannot_drain_in_time_is_refused_at_once():
    async def main():
        g = gate(limit=2)
        served(g, *([0.2] * 40))  # 2 slots at 0.2 s: the line moves 10 per second
        await g.acquire(0, far())
        await g.acquire(0, far())
        line = [asyncio.create_task(g.acquire(1, time.monotonic() + 5.0)) for _ in range(6)]
        await asyncio.sleep(0)
        assert g.waiting == 6
        # 6 critical ahead take ~0.7 s to drain; a critical newcomer with 0.6 s to wait
        # (1.0 s left minus 0.2 s of service) is refused now, not after 0.6 s in line ...
        t0 = time.monotonic()
        with pytest.raises(GateRefused) as e:
            await g.acquire(1, time.monotonic() + 0.8)
        assert e.value.reason == "drain" and time.monotonic() - t0 < 0.05
        # ... while a critical_plus newcomer, with nobody ahead of its rank, waits its turn.
        first = asyncio.create_task(g.acquire(0, time.monotonic() + 0.8))
        await asyncio.sleep(0)
        assert not first.done() and g.waiting == 7
        g.release()
        await first
        for t in line:
            t.cancel()
        await asyncio.gather(*line, return_exceptions=True)
        assert g.waiting == 0 and g.snapshot()["waiting"] == 0

    asyncio.run(main())


def test_a_waiter_gives_up_when_its_time_runs_out_and_leaves_no_trace():
    async def main():
        g = gate(limit=1, max_wait_s=0.1)
        await g.acquire(0, far())
        t0 = time.monotonic()
        with pytest.raises(GateRefused) as e:
            await g.acquire(3, far())  # capped by max_wait_s
        assert e.value.reason == "expired" and g.refused["expired"] == 1
        assert 0.09 <= time.monotonic() - t0 < 0.5
        assert g.waiting == 0
        g.release()
        assert g.in_flight == 0  # the expired waiter was not granted the freed slot

    asyncio.run(main())


def test_a_full_line_displaces_the_least_critical_youngest_or_refuses_the_newcomer():
    async def main():
        g = gate(limit=1, max_waiting=2)
        await g.acquire(0, far())
        a = asyncio.create_task(g.acquire(3, far()))
        await asyncio.sleep(0)
        b = asyncio.create_task(g.acquire(3, far()))
        await asyncio.sleep(0)
        # A sheddable newcomer cannot displace an equal: refused.
        with pytest.raises(GateRefused) as e:
            await g.acquire(3, far())
        assert e.value.reason == "queue_full"
        # A critical newcomer displaces the youngest sheddable (b), not the oldest (a).
        c = asyncio.create_task(g.acquire(1, far()))
        await asyncio.sleep(0.01)
        assert b.done() and isinstance(b.exception(), GateRefused) and b.exception().reason == "displaced"
        assert not a.done() and g.waiting == 2
        g.release()
        await c  # the critical one goes first
        assert not a.done()
        g.release()
        await a
        g.release()
        assert (g.in_flight, g.waiting) == (0, 0)

    asyncio.run(main())


def test_a_cancelled_waiter_frees_its_place():
    async def main():
        g = gate(limit=1)
        await g.acquire(0, far())
        t = asyncio.create_task(g.acquire(2, far()))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert g.waiting == 0
        g.release()
        assert g.in_flight == 0

    asyncio.run(main())


def test_release_feeds_the_service_time_estimate():
    async def main():
        g = gate(limit=1)
        for _ in range(40):
            await g.acquire(0, far())
            g.release(0.3)
        assert g.expected_service_s == pytest.approx(0.3, rel=0.01)

    asyncio.run(main())


def test_a_slot_is_given_back_once_even_if_never_released_by_hand():
    async def main():
        g = gate(limit=1)
        await g.acquire(0, far())
        slot = GateSlot(g)
        slot.release()
        slot.release()
        assert g.in_flight == 0
        await g.acquire(0, far())
        GateSlot(g)  # dropped unreleased, like a stream whose client left before it began
        gc.collect()
        assert g.in_flight == 0

    asyncio.run(main())


def test_the_demand_window_rates_offers_per_criticality_and_knows_when_the_gate_was_full():
    from serve_app.router.gate import DemandWindow

    t = [0.0]
    w = DemandWindow(window_s=10.0, clock=lambda: t[0], max_entries=100)
    assert w.rates() == {"demand_rps": {}, "served_rps": 0.0, "gate_full": False}
    for i in range(10):  # ten 1-s reports: 4 critical and 10 sheddable offered, 5 answered each
        t[0] += 1.0
        w.add({"critical": 4, "sheddable": 10}, served=5, saturated=i >= 3)
    r = w.rates()
    assert r["demand_rps"] == {"critical": 4.0, "sheddable": 10.0}
    assert r["served_rps"] == 5.0 and r["gate_full"] is True  # full in 7 of 10 s
    # Old reports leave the window; a gate full in too little of it gives no capacity figure.
    for _ in range(10):
        t[0] += 1.0
        w.add({"critical": 2}, served=2, saturated=False)
    w.add({}, served=0, saturated=True)
    r = w.rates()
    assert r["demand_rps"] == {"critical": 2.0} and r["gate_full"] is False
    assert len(w._entries) <= 100


def test_sheddable_classes_leave_the_reserved_slots_while_critical_traffic_needs_them():
    class Clock:
        t = 100.0

        def __call__(self) -> float:
            return self.t

    async def main():
        clock = Clock()
        cfg = LimiterConfig(initial=8, min_limit=1, max_limit=8, target_wait_ms=1e9, interval_s=3600)
        g = PriorityGate(AimdLimit(cfg), 8, 2.0, clock=clock, reserve_ratio=0.25, reserve_hold_s=1.0)
        # No critical pressure yet: sheddable traffic may fill every slot.
        for _ in range(8):
            await g.acquire(3, clock.t + 60)
        assert g.in_flight == 8 and not g.reserving()
        for _ in range(8):
            g.release()
        # Critical requests take slots into the top quarter (2 of 8): the reserve is on.
        for _ in range(7):
            await g.acquire(1, clock.t + 60)
        assert g.reserving() and g.snapshot()["reserving"] is True
        for _ in range(5):
            g.release()
        # 2 in flight: a sheddable request may fill up to 6, not 8.
        for _ in range(4):
            await g.acquire(2, clock.t + 60)
        assert g.in_flight == 6
        held = asyncio.create_task(g.acquire(3, clock.t + 60))
        await asyncio.sleep(0)
        assert not held.done() and g.waiting == 1
        # ... while a critical newcomer goes past it into the reserve at once.
        await g.acquire(0, clock.t + 60)
        assert g.in_flight == 7 and not held.done()
        # The pressure ends: a second later the held sheddable waiter may use any slot.
        clock.t += 1.5
        assert not g.reserving()
        g.release()  # any release lets the line move
        await held
        assert g.in_flight == 7 and g.waiting == 0

    asyncio.run(main())


def test_without_a_reserve_and_with_a_bad_one():
    async def main():
        g = gate(limit=2)  # reserve_ratio 0: critical traffic changes nothing
        await g.acquire(1, far())
        await g.acquire(3, far())
        assert g.in_flight == 2 and not g.reserving()

    asyncio.run(main())
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError):
            gate(limit=4, reserve_ratio=bad)


def test_a_miss_in_about_the_usual_service_time_is_a_late_admission_not_congestion():
    # An hour-long window: the limit moves only when the test ticks it (never here), so
    # what a miss did shows in AimdLimit's own flag.
    g = gate(limit=4, miss_service_factor=1.5)
    served(g, *([0.1] * 9 + [0.2]))  # p90 of service: 0.2 s
    g.observe_miss(250.0)  # held 0.25 s <= 1.5 x 0.2 s: the request had waited, the model did not slow
    assert g.limit._missed is False
    assert g.snapshot()["misses"] == {"congestion": 0, "late_admission": 1}
    assert g.limit._waits == [250.0]  # still a wait sample
    g.observe_miss(301.0)  # held past 1.5 x p90: the model slowed
    assert g.limit._missed is True
    assert g.snapshot()["misses"] == {"congestion": 1, "late_admission": 1}


def test_every_miss_is_congestion_without_a_factor_or_before_any_answer():
    g = gate(limit=4)  # no factor: the old rule
    served(g, 0.1)
    g.observe_miss(1.0)
    assert g.limit._missed is True
    g = gate(limit=4, miss_service_factor=1.5)
    g.observe_miss(1.0)  # nothing answered yet: no service time to compare with
    assert g.limit._missed is True and g.misses_counted == 1


def test_the_miss_factor_decides_whether_the_limit_goes_down():
    cfg = LimiterConfig(initial=10, min_limit=1, max_limit=20, target_wait_ms=1e9, interval_s=0.5)
    now = [0.0]
    for factor, expected in ((None, 9), (1.5, 10)):
        g = PriorityGate(AimdLimit(cfg, clock=lambda: now[0]), 8, 2.0, miss_service_factor=factor)
        served(g, *([0.1] * 10))
        g.observe_miss(120.0)  # 1.2 x p90
        now[0] += 1.0
        assert g.limit.value == expected, factor
        now[0] = 0.0


def test_a_bad_miss_factor_is_refused():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="miss_service_factor"):
            gate(miss_service_factor=bad)
