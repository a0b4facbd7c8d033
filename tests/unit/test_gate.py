"""The router's priority gate on a real event loop and a fake clock: slots, order,
deadlines, bounds. Waits end when the test advances the clock (FakeTimer), never by
sleeping; the rules themselves are tested in test_gate_policy.py."""

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from ballast.policies.limiter import AimdLimit, LimiterConfig
from ballast.router.gate import GateRefused, GateSlot, PriorityGate
from tests.unit.fakes import FakeClock


class FakeTimer:
    """``asyncio.wait_for`` on a FakeClock: a wait ends when what it awaits is done, or
    when ``advance`` moves the clock to its due time."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._alarms: list[tuple[float, asyncio.Future]] = []

    async def wait_for(self, aw: Awaitable[Any], timeout_s: float) -> Any:
        inner = asyncio.ensure_future(aw)
        alarm = asyncio.get_running_loop().create_future()
        self._alarms.append((self.clock() + timeout_s, alarm))
        try:
            await asyncio.wait({inner, alarm}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            inner.cancel()
            raise
        finally:
            if not alarm.done():
                alarm.cancel()
        if inner.done():
            return inner.result()
        inner.cancel()
        raise asyncio.TimeoutError

    async def advance(self, seconds: int) -> None:
        self.clock.advance(seconds)
        for due_s, alarm in self._alarms:
            if due_s <= self.clock() and not alarm.done():
                alarm.set_result(None)
        self._alarms = [(d, a) for d, a in self._alarms if not a.done()]
        await settle()


async def settle() -> None:
    """Let every ready task run (a few event-loop turns, no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


CLOCK = FakeClock(1000)


def gate(limit: int = 1, max_waiting: int = 8, max_wait_s: float = 2.0, clock: FakeClock = CLOCK, **kw) -> PriorityGate:
    cfg = LimiterConfig(initial=limit, min_limit=1, max_limit=limit, target_wait_ms=1e9, interval_s=3600)
    timer = kw.pop("timer", FakeTimer(clock))
    return PriorityGate(
        AimdLimit(cfg, clock=clock), max_waiting, max_wait_s, clock=clock, wait_for=timer.wait_for, **kw
    )


def far() -> float:
    return CLOCK() + 60.0


async def refused_at_once(g: PriorityGate, rank: int, deadline_s: float) -> str:
    """The refusal reason of an acquire that must not wait (it gets no clock advance)."""
    task = asyncio.create_task(g.acquire(rank, deadline_s))
    await settle()
    assert task.done(), "the request waited instead of being refused at once"
    with pytest.raises(GateRefused) as e:
        task.result()
    return e.value.reason


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
        for name, rank in [
            ("sheddable-1", 3),
            ("critical-1", 1),
            ("sheddable-2", 3),
            ("critical_plus", 0),
            ("critical-2", 1),
        ]:
            tasks.append(asyncio.create_task(waiter(name, rank)))
            await asyncio.sleep(0)
        assert g.waiting == 5
        g.release()
        await asyncio.gather(*tasks)
        assert order == ["critical_plus", "critical-1", "critical-2", "sheddable-1", "sheddable-2"]
        assert (g.in_flight, g.waiting) == (0, 0)

    asyncio.run(main())


def test_the_status_shows_each_class_p90_wait_in_line():
    async def main():
        clock = FakeClock(1000)
        timer = FakeTimer(clock)
        g = gate(limit=1, clock=clock, timer=timer)
        await g.acquire(3, clock() + 60.0)  # at once: no wait
        assert g.snapshot()["wait_p90_ms"] == {"sheddable": 0.0}
        critical_plus = asyncio.create_task(g.acquire(0, clock() + 60.0))
        await settle()
        clock.advance(0.25)  # the slot comes back a quarter second later
        g.release()
        await settle()
        assert critical_plus.done()
        assert g.snapshot()["wait_p90_ms"] == {"critical_plus": 250.0, "sheddable": 0.0}

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
        assert await refused_at_once(g, 0, CLOCK() + 0.4) == "no_time"  # 0.4 s left < 0.5 s of service
        assert g.refused["no_time"] == 1 and g.waiting == 0

    asyncio.run(main())


def test_sheddable_waiters_need_the_p90_of_service_and_critical_ones_the_mean():
    async def main():
        g = gate(limit=1)
        served(g, *([0.1] * 8 + [0.6] * 2))  # mean-like estimate ~0.2 s, p90 0.6 s
        assert g.expected_service_s < 0.4 and g.snapshot()["service_p90_ms"] == 600.0
        await g.acquire(0, far())
        # enough for the mean, not for the slow tenth
        assert await refused_at_once(g, 3, CLOCK() + 0.5) == "no_time"
        # A critical request with the same time left is not refused: it waits its turn.
        critical = asyncio.create_task(g.acquire(1, CLOCK() + 0.5))
        await settle()
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
        line = [asyncio.create_task(g.acquire(1, CLOCK() + 5.0)) for _ in range(6)]
        await asyncio.sleep(0)
        assert g.waiting == 6
        # 6 critical ahead take ~0.7 s to drain; a critical newcomer with 0.6 s to wait
        # (1.0 s left minus 0.2 s of service) is refused now, not after 0.6 s in line ...
        assert await refused_at_once(g, 1, CLOCK() + 0.8) == "drain"
        # ... while a critical_plus newcomer, with nobody ahead of its rank, waits its turn.
        first = asyncio.create_task(g.acquire(0, CLOCK() + 0.8))
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
        clock = FakeClock(0)
        timer = FakeTimer(clock)
        g = gate(limit=1, max_wait_s=2, clock=clock, timer=timer)
        await g.acquire(0, clock() + 60)
        waiter = asyncio.create_task(g.acquire(3, clock() + 60))  # capped by max_wait_s
        await settle()
        await timer.advance(1)
        assert not waiter.done() and g.waiting == 1  # tick 1 of 2: still in line
        await timer.advance(1)
        assert waiter.done()
        with pytest.raises(GateRefused) as e:
            waiter.result()
        assert e.value.reason == "expired" and g.refused["expired"] == 1
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
        assert await refused_at_once(g, 3, far()) == "queue_full"
        # A critical newcomer displaces the youngest sheddable (b), not the oldest (a).
        c = asyncio.create_task(g.acquire(1, far()))
        await settle()
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


def test_a_slot_is_given_back_once():
    async def main():
        g = gate(limit=1)
        await g.acquire(0, far())
        slot = GateSlot(g)
        slot.release()
        slot.release()
        assert g.in_flight == 0

    asyncio.run(main())


def test_sheddable_classes_leave_the_reserved_slots_while_critical_traffic_needs_them():
    async def main():
        clock = FakeClock(100)
        g = gate(limit=8, clock=clock, reserve_ratio=0.25, reserve_hold_s=1.0)
        # No critical pressure yet: sheddable traffic may fill every slot.
        for _ in range(8):
            await g.acquire(3, clock() + 60)
        assert g.in_flight == 8 and not g.reserving()
        for _ in range(8):
            g.release()
        # Critical requests take slots into the top quarter (2 of 8): the reserve is on.
        for _ in range(7):
            await g.acquire(1, clock() + 60)
        assert g.reserving() and g.snapshot()["reserving"] is True
        for _ in range(5):
            g.release()
        # 2 in flight: a sheddable request may fill up to 6, not 8.
        for _ in range(4):
            await g.acquire(2, clock() + 60)
        assert g.in_flight == 6
        held = asyncio.create_task(g.acquire(3, clock() + 60))
        await asyncio.sleep(0)
        assert not held.done() and g.waiting == 1
        # ... while a critical newcomer goes past it into the reserve at once.
        await g.acquire(0, clock() + 60)
        assert g.in_flight == 7 and not held.done()
        # The pressure ends: past the hold the held sheddable waiter may use any slot.
        clock.advance(1)
        assert g.reserving()  # 1 s after the last press: still held
        clock.advance(1)
        assert not g.reserving()
        g.release()  # any release lets the line move
        await held
        assert g.in_flight == 7 and g.waiting == 0

    asyncio.run(main())


def test_a_request_held_back_by_the_reserve_lets_the_limit_grow():
    """The reserve is a share of the limit: sheddable traffic held at limit - reserve
    while critical traffic uses little of it is demand the limit has not met. Counting
    only the limit itself pinned it (in_flight never reached it) and at 1 C sheddable
    requests expired in line beside idle slots."""

    async def main():
        clock = FakeClock(100)
        cfg = LimiterConfig(initial=8, min_limit=1, max_limit=64, target_wait_ms=1e9, interval_s=1)
        timer = FakeTimer(clock)
        g = PriorityGate(
            AimdLimit(cfg, clock=clock),
            8,
            10.0,
            clock=clock,
            wait_for=timer.wait_for,
            reserve_ratio=0.25,
            reserve_hold_s=5.0,
        )
        for _ in range(7):  # critical traffic into the top quarter: the reserve is on
            await g.acquire(1, clock() + 60)
        for _ in range(6):
            g.release()
        for _ in range(5):  # sheddable fills its room: 6 of 8
            await g.acquire(3, clock() + 60)
        assert g.in_flight == 6 and g.reserving()
        held = asyncio.create_task(g.acquire(3, clock() + 60))
        await settle()
        assert not held.done() and g.in_flight < g.limit.value == 8
        await timer.advance(1)  # the window ends: the limit was needed, so it grows
        assert g.limit.value == 9
        g.observe_wait(0.0)  # the gate re-reads the limit: the sheddable room is now 9 - 3 = 6
        await settle()
        assert not held.done()
        behind = asyncio.create_task(g.acquire(3, clock() + 60))  # still held back: the next window grows too
        await settle()
        await timer.advance(1)
        g.observe_wait(0.0)
        await settle()
        assert g.reserving() and g.limit.value == 10 and held.done() and g.in_flight == 7  # room 10 - 3 = 7
        assert not behind.done() and g.waiting == 1

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


def miss_gate(factor=None, target_wait_ms: float = 1e9):
    """A gate whose limit's window is 1 s on its own clock: what a miss did shows in the
    limit's public snapshot once the test ticks the window."""
    clock = FakeClock(0)
    cfg = LimiterConfig(initial=10, min_limit=1, max_limit=20, target_wait_ms=target_wait_ms, interval_s=1)
    g = PriorityGate(AimdLimit(cfg, clock=clock), 8, 2.0, clock=clock, miss_service_factor=factor)
    return g, clock


def decreases_by(g: PriorityGate, clock: FakeClock) -> dict:
    clock.advance(1)
    return g.limit.snapshot()["decreases_by"]


def test_a_miss_in_about_the_usual_service_time_is_a_late_admission_not_congestion():
    g, clock = miss_gate(factor=1.5, target_wait_ms=200.0)
    served(g, *([0.1] * 9 + [0.2]))  # p90 of service: 0.2 s
    g.observe_miss(250.0)  # held 0.25 s <= 1.5 x 0.2 s: the request had waited, the model did not slow
    assert g.snapshot()["misses"] == {"congestion": 0, "late_admission": 1}
    # Not a miss for the limit, but still a wait sample (250 ms > the 200 ms target).
    assert decreases_by(g, clock) == {"missed": 0, "slow": 0, "wait": 1}
    g.observe_miss(301.0)  # held past 1.5 x p90: the model slowed
    assert g.snapshot()["misses"] == {"congestion": 1, "late_admission": 1}
    assert decreases_by(g, clock) == {"missed": 1, "slow": 0, "wait": 1}


def test_every_miss_is_congestion_without_a_factor_or_before_any_answer():
    g, clock = miss_gate()  # no factor: the old rule
    served(g, 0.1)
    g.observe_miss(1.0)
    assert decreases_by(g, clock)["missed"] == 1
    g, clock = miss_gate(factor=1.5)
    g.observe_miss(1.0)  # nothing answered yet: no service time to compare with
    assert decreases_by(g, clock)["missed"] == 1 and g.misses_counted == 1


def test_the_miss_factor_decides_whether_the_limit_goes_down():
    for factor, expected in ((None, 9), (1.5, 10)):
        g, clock = miss_gate(factor)
        served(g, *([0.1] * 10))
        g.observe_miss(120.0)  # 1.2 x p90
        clock.advance(1)
        assert g.limit.value == expected, factor


def test_a_bad_miss_factor_is_refused():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="miss_service_factor"):
            gate(miss_service_factor=bad)


def test_a_critical_waiter_left_with_less_than_the_p90_yields_to_its_own_class_behind_it():
    async def main():
        clock = FakeClock(0)
        timer = FakeTimer(clock)
        g = gate(limit=1, max_wait_s=60.0, clock=clock, timer=timer)
        served(g, *([1] * 8 + [6] * 2))  # mean 2.8 s, p90 6 s
        await g.acquire(0, clock() + 60)  # holds the only slot
        marginal = asyncio.create_task(g.acquire(1, clock() + 8))  # may wait until 8 - 2.8 s
        fresh = asyncio.create_task(g.acquire(1, clock() + 60))
        await settle()
        await timer.advance(3)  # 5 s left: more than the mean, less than the p90
        assert not marginal.done() and g.waiting == 2
        g.release()
        await settle()
        with pytest.raises(GateRefused, match="expired"):
            marginal.result()
        await fresh  # the slot went to the one that will likely make it
        assert (g.in_flight, g.waiting, g.refused["expired"]) == (1, 0, 1)

        # Alone in its class it still takes the slot at the mean: nobody else would use it.
        lone = asyncio.create_task(g.acquire(1, clock() + 8))
        behind = asyncio.create_task(g.acquire(3, clock() + 60))
        await settle()
        await timer.advance(3)
        g.release()
        await lone
        assert not behind.done() and g.refused["expired"] == 1
        behind.cancel()
        await asyncio.gather(behind, return_exceptions=True)

    asyncio.run(main())


# --- critical_plus's own rows ------------------------------------------------------------

CP, CRIT, SHED = 0, 1, 3


def plus_gate(clock: FakeClock, timer: FakeTimer, limit: int = 8, **plus: Any) -> PriorityGate:
    from ballast.policies.gate import PlusReserve

    reserve = PlusReserve(
        **{"max_ratio": 0.25, "window_s": 5.0, "idle_s": 0.5, "max_wait_s": 0.25, **plus}, clock=clock
    )
    return gate(limit=limit, clock=clock, timer=timer, max_wait_s=30.0, plus=reserve)


def test_critical_plus_keeps_rows_no_other_class_takes_and_lends_them_back_within_a_tick():
    async def main():
        clock = FakeClock(100)
        g = plus_gate(clock, FakeTimer(clock))
        # No critical_plus yet: critical may fill every slot.
        for _ in range(8):
            await g.acquire(CRIT, clock() + 60)
        assert g.in_flight == 8 and g.snapshot()["plus_reserve"]["rows"] == 0
        for _ in range(8):
            g.release(rank=CRIT)
        # One critical_plus request: its peak (1) plus one, two rows (within 0.25 x 8).
        await g.acquire(CP, clock() + 60)
        view = g.snapshot()["plus_reserve"]
        assert (view["rows"], view["held"], view["free"]) == (2, 1, 1)
        # critical (not only the sheddable classes) leaves the free one: 7 of 8, then waits.
        for _ in range(6):
            await g.acquire(CRIT, clock() + 60)
        assert g.in_flight == 7
        held = asyncio.create_task(g.acquire(CRIT, clock() + 60))
        await settle()
        assert not held.done() and g.waiting == 1
        # ... while a critical_plus newcomer takes the kept row at once.
        await g.acquire(CP, clock() + 60)
        assert g.in_flight == 8 and g.plus_in_flight == 2
        g.release(rank=CP)
        g.release(rank=CP)
        await settle()
        # critical_plus holds nothing now; its two rows stay free: critical waits at 6 of 8.
        assert not held.done() and g.in_flight == 6 and g.snapshot()["plus_reserve"]["free"] == 2
        # The router's report tick: at 0.5 s without a critical_plus arrival they are kept ...
        clock.advance(0.5)
        g.tick()
        await settle()
        assert not held.done()
        # ... and lent back on the tick past it, with no release needed.
        clock.advance(0.5)
        g.tick()
        await held
        assert g.in_flight == 7 and g.snapshot()["plus_reserve"]["rows"] == 0

    asyncio.run(main())


def test_the_reserve_follows_critical_plus_demand_within_its_bound():
    from ballast.policies.gate import PlusReserve

    clock = FakeClock(0)
    r = PlusReserve(max_ratio=0.25, window_s=5.0, idle_s=0.5, clock=clock)
    assert r.rows(16) == 0  # never arrived
    r.arrived(1)
    assert r.rows(16) == 2
    for rows in (2, 5, 3):
        r.arrived(rows)
    assert r.rows(16) == 4  # peak 5 + 1, bounded by 0.25 x 16
    assert r.rows(40) == 6  # the same peak under a larger limit
    assert r.free_rows(40, plus_held=4) == 2
    clock.advance(4.9)
    r.arrived(1)
    assert r.rows(40) == 6  # the peak of 5 s ago is still in the window
    clock.advance(0.2)
    r.arrived(1)
    assert r.rows(40) == 2  # it left: the peak is now 1
    assert PlusReserve(max_ratio=0.0).rows(16) == 0
    assert PlusReserve(max_ratio=0.25).bound(2) == 1 and PlusReserve(max_ratio=0.25).bound(1) == 0
    with pytest.raises(ValueError, match="max_ratio"):
        PlusReserve(max_ratio=1.0)


def test_a_critical_plus_waiter_goes_above_the_limit_at_its_bound_and_the_status_shows_its_p99():
    async def main():
        clock = FakeClock(100)
        timer = FakeTimer(clock)
        g = plus_gate(clock, timer, limit=4, max_wait_s=0.25)
        for _ in range(4):
            await g.acquire(CP, clock() + 60)  # critical_plus itself fills the limit
        late = [asyncio.create_task(g.acquire(CP, clock() + 60)) for _ in range(2)]
        await settle()
        assert g.waiting == 2
        await timer.advance(0.1)
        assert not any(t.done() for t in late)
        # At 0.25 s: above the limit by at most the reserve's bound (1 of 4): one goes, one waits on.
        await timer.advance(0.15)
        assert [t.done() for t in late] == [True, False]
        assert g.in_flight == 5 and g.plus_over_limit == 1
        view = g.snapshot()["plus_reserve"]
        assert view["over_limit"] == 1 and view["max_wait_ms"] == 250.0 and view["wait_p99_ms"] == 250.0
        g.release(rank=CP)
        g.release(rank=CP)  # back under the limit: the second waiter's turn by the line
        await settle()
        assert late[1].done() and g.in_flight == 4

    asyncio.run(main())


def test_other_classes_never_go_above_the_limit():
    async def main():
        clock = FakeClock(100)
        timer = FakeTimer(clock)
        g = plus_gate(clock, timer, limit=4)
        for _ in range(4):
            await g.acquire(CRIT, clock() + 60)
        waiting = asyncio.create_task(g.acquire(CRIT, clock() + 5))
        await settle()
        await timer.advance(1)
        assert not waiting.done() and g.in_flight == 4
        await timer.advance(5)
        with pytest.raises(GateRefused):
            await waiting

    asyncio.run(main())


def test_a_three_second_stall_leaves_the_service_estimate_and_refuses_no_one_it_can_serve():
    """Four requests of 0.1 s at a time, then a 3 s stall of the host (nothing answered),
    then the same service again. The stall is taken out of the samples: the p90 stays
    0.1 s, and a sheddable newcomer with 1 s left is let in line, not refused no_time
    (which a p90 of 3.1 s would have done)."""

    async def main():
        clock = FakeClock(100)
        g = gate(limit=4, clock=clock, max_wait_s=30.0)
        for _ in range(40):  # the model's normal service: 0.1 s per request, four at a time
            for _ in range(4):
                await g.acquire(3, clock() + 60)
            clock.advance(0.1)
            for _ in range(4):
                g.release(0.1)
        assert g.snapshot()["service_p90_ms"] == 100.0
        for _ in range(4):
            await g.acquire(3, clock() + 60)
        clock.advance(3.1)  # the stall: none of the four is answered for 3 s
        for _ in range(4):
            g.release(3.1)
        snap = g.snapshot()
        assert snap["stalled_s"] == pytest.approx(3.0, abs=0.01)
        assert snap["service_p90_ms"] == pytest.approx(100.0, abs=1.0)
        assert g.not_stalled_ms(3100.0) == pytest.approx(100.0, abs=1.0)  # a wait across it, likewise
        for _ in range(4):
            await g.acquire(3, clock() + 60)
        newcomer = asyncio.create_task(g.acquire(3, clock() + 1.0))
        await settle()
        assert not newcomer.done() and g.waiting == 1  # in line, not refused
        clock.advance(0.1)
        g.release(0.1)
        await newcomer
        assert g.refused == dict.fromkeys(g.refused, 0)

    asyncio.run(main())


def test_a_model_that_really_slows_is_read_as_slower():
    async def main():
        clock = FakeClock(100)
        g = gate(limit=4, clock=clock)
        for service in [0.1] * 20 + [0.4] * 40:  # four at a time, answered one by one
            for _ in range(4):
                await g.acquire(3, clock() + 60)
            for _ in range(4):
                clock.advance(service / 4)
                g.release(service)
        assert g.snapshot()["service_p90_ms"] == 400.0 and g.snapshot()["stalled_s"] == 0.0

    asyncio.run(main())


def test_an_idle_spell_before_a_batch_line_is_no_stall():
    """Idle for a minute, then a batch line takes the first slot: the wait before it was
    the model's idle time, not a stall, and the next answers' samples are whole."""

    async def main():
        clock = FakeClock(100)
        g = gate(limit=4, clock=clock)
        for _ in range(20):
            await g.acquire(3, clock() + 60)
            clock.advance(0.1)
            g.release(0.1)
        clock.advance(60)
        slot = g.try_batch()
        assert slot is not None
        clock.advance(0.1)
        slot.release(0.1)
        assert g.snapshot()["stalled_s"] == 0.0

    asyncio.run(main())
