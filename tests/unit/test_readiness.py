"""The router's cached readiness (ballast/router/readiness.py), tick by tick, and the
health routes that answer from it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeClock

from ballast.router.readiness import CachedProbe


class FakePing:
    """The model's ``ping`` as a test scripts it (no replica here): each probe waits until
    the test releases it, then succeeds or raises the scripted error."""

    def __init__(self) -> None:
        self.calls = 0
        self.error: BaseException | None = None
        self.release = asyncio.Event()

    async def __call__(self) -> None:
        self.calls += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_probe_per_interval_one_in_flight_and_a_failure_cached_too():
    async def walk() -> None:
        clock, ping = FakeClock(100), FakePing()
        ready = CachedProbe(ping, interval_s=2, clock=clock)

        # t=100: fifty callers at once make one probe, and all get its answer.
        callers = [asyncio.ensure_future(ready.problem()) for _ in range(50)]
        await _settle()
        assert ping.calls == 1 and not any(c.done() for c in callers)
        ping.release.set()
        assert await asyncio.gather(*callers) == [None] * 50

        # t=101: within the interval (from the probe's start): the cached answer, no probe.
        clock.advance()
        ping.error = ConnectionError("down")
        assert await ready.problem() is None and ping.calls == 1

        # t=102: the interval is over: one probe, which fails; its failure is the answer.
        clock.advance()
        assert await ready.problem() == "model deployment unreachable: ConnectionError"
        assert ping.calls == 2

        # t=103: the failure is cached as a success is: no probe.
        clock.advance()
        assert await ready.problem() == "model deployment unreachable: ConnectionError" and ping.calls == 2

        # t=104: a slow probe in flight: callers at t=104..110 wait on it; none starts another.
        clock.advance()
        ping.error, ping.release = None, asyncio.Event()
        waiting = [asyncio.ensure_future(ready.problem())]
        await _settle()
        for _ in range(6):
            clock.advance()
            waiting.append(asyncio.ensure_future(ready.problem()))
            await _settle()
        assert ping.calls == 3
        ping.release.set()
        assert await asyncio.gather(*waiting) == [None] * 7

        # t=110: the answer is dated from its probe's start (t=104): it is stale already.
        assert await ready.problem() is None and ping.calls == 4
        # t=111: fresh.
        clock.advance()
        assert await ready.problem() is None and ping.calls == 4
        assert ready.probes == ping.calls

    asyncio.run(walk())


def test_a_caller_that_goes_away_does_not_cancel_the_probe_for_the_others():
    async def walk() -> None:
        clock, ping = FakeClock(0), FakePing()
        ready = CachedProbe(ping, interval_s=1, clock=clock)
        first, second = asyncio.ensure_future(ready.problem()), asyncio.ensure_future(ready.problem())
        await _settle()
        first.cancel()
        await _settle()
        ping.release.set()
        assert await second is None and ping.calls == 1

    asyncio.run(walk())


def test_a_probe_that_never_answers_is_cut_at_its_timeout_and_cached_as_a_failure():
    async def walk() -> None:
        clock, ping = FakeClock(0), FakePing()  # never released
        ready = CachedProbe(ping, interval_s=5, timeout_s=0.01, clock=clock)
        assert await ready.problem() == "model deployment unreachable: TimeoutError"
        clock.advance()
        assert await ready.problem() == "model deployment unreachable: TimeoutError" and ping.calls == 1

    asyncio.run(walk())


def test_settings_are_checked():
    with pytest.raises(ValueError, match="interval_s"):
        CachedProbe(FakePing(), interval_s=0)
    from ballast.config import load_config

    assert load_config({}).http.ready_probe_interval_s == 1.0
    with pytest.raises(ValueError, match="ready_probe_interval_s"):
        load_config({"http": {"ready_probe_interval_s": 0}})


# ---------------------------------------------------------------- the health routes


class CountingPing:
    """The model handle's ``ping`` (a scripted fake: no Serve replica here), counting calls."""

    def __init__(self) -> None:
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1

        async def answer() -> None:
            return None

        return answer()


def test_a_flood_of_health_checks_pings_the_model_once_per_interval():
    from routerkit import at_level, build_router, routed
    from test_resilient_caller import FakeHandle

    model = FakeHandle()
    model.ping = CountingPing()
    # An interval far longer than the test: however slow the machine, the flood is within one.
    router = build_router({"http": {"ready_probe_interval_s": 60}}, model)
    at_level(router, 0)
    with routed(router) as client:
        for _ in range(40):
            assert client.get("/health").status_code == 200
            assert client.get("/healthz/ready").json()["status"] == "ready"
    assert model.ping.calls == 1
