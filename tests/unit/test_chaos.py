"""Fault injection (ballast/model/chaos.py): settings validation and the agent's faults.

The error draw is injected (``rand``), and so is the sleep: latency and the leak's
ticks go through ``fakes.FakeSleep``, which lets a tick pass only on ``wake()``, so
the leak is walked tick by tick and no test waits in real time.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
from fakes import FakeSleep

from ballast.errors import BallastError
from ballast.model.chaos import LEAK_TICK_S, MB, ChaosAgent, ChaosSettings, InjectedFault


class CountedRand:
    def __init__(self, value: float) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


async def started(sleep: FakeSleep) -> None:
    """Let a leak loop that apply() just created run its first tick."""
    await sleep.settle()


async def stop_leak(agent: ChaosAgent, sleep: FakeSleep) -> None:
    """Lift the chaos and let the leak loop see it on its next tick: no loop is left asleep."""
    agent.apply({})
    await sleep.wake()
    assert sleep.parked == 0, "the leak loop did not stop"


# -- ChaosSettings --------------------------------------------------------------------


def test_default_settings_are_inactive() -> None:
    s = ChaosSettings()
    assert (s.error_ratio, s.latency_ms, s.hang, s.leak_mb_per_s) == (0.0, 0, False, 0.0)
    assert s.active is False


@pytest.mark.parametrize(
    "kwargs",
    [{"error_ratio": 0.01}, {"latency_ms": 1}, {"hang": True}, {"leak_mb_per_s": 0.5}, {"vram_leak_mb_per_s": 0.5}],
)
def test_any_single_fault_makes_settings_active(kwargs: dict) -> None:
    assert ChaosSettings(**kwargs).active is True


@pytest.mark.parametrize(
    "field,ok,bad",
    [
        ("error_ratio", [0.0, 0.5, 1.0], [-0.01, 1.01, float("nan")]),
        ("latency_ms", [0, 1, 600_000], [-1, 600_001]),
        ("leak_mb_per_s", [0.0, 1.0, 1024], [-0.1, 1024.5, float("nan")]),
        ("vram_leak_mb_per_s", [0.0, 1.0, 1024], [-0.1, 1024.5, float("nan")]),
    ],
)
def test_settings_bounds_are_inclusive_and_errors_name_the_field(field: str, ok: list, bad: list) -> None:
    for v in ok:
        assert getattr(ChaosSettings(**{field: v}), field) == v
    for v in bad:
        with pytest.raises(ValueError, match=rf"^{field}: must be within"):
            ChaosSettings(**{field: v})


def test_settings_are_frozen() -> None:
    s = ChaosSettings()
    with pytest.raises(AttributeError):
        s.hang = True  # type: ignore[misc]


def test_from_dict_reads_the_known_keys_and_ignores_the_rest() -> None:
    s = ChaosSettings.from_dict(
        {
            "error_ratio": 0.25,
            "latency_ms": 40,
            "hang": True,
            "leak_mb_per_s": 2.0,
            "vram_leak_mb_per_s": 3.0,
            "target": "primary",
            "set_by": "x",
        }
    )
    assert s == ChaosSettings(error_ratio=0.25, latency_ms=40, hang=True, leak_mb_per_s=2.0, vram_leak_mb_per_s=3.0)


def test_from_dict_fills_missing_keys_with_defaults() -> None:
    assert ChaosSettings.from_dict({}) == ChaosSettings()
    assert ChaosSettings.from_dict({"latency_ms": 5, "unknown": 1}) == ChaosSettings(latency_ms=5)


def test_from_dict_still_validates() -> None:
    with pytest.raises(ValueError, match=r"^error_ratio: "):
        ChaosSettings.from_dict({"error_ratio": 2})


def test_injected_fault_is_a_picklable_model_error() -> None:
    exc = InjectedFault("injected failure (chaos)")
    assert isinstance(exc, BallastError)
    assert (exc.status, exc.code) == (500, "MODEL_ERROR")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is InjectedFault and back.message == exc.message


# -- ChaosAgent: disabled ------------------------------------------------------------


async def test_disabled_agent_ignores_apply() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=False, max_leak_mb=1, rand=CountedRand(0.0), sleep=sleep)
    agent.apply({"error_ratio": 1.0, "hang": True, "latency_ms": 600_000, "leak_mb_per_s": 1024})
    assert agent.settings == ChaosSettings()
    await sleep.settle()
    assert sleep.slept_s == []  # no leak loop started
    assert agent.leaked_bytes == 0


async def test_disabled_agent_never_injects_even_with_settings_forced() -> None:
    rand = CountedRand(0.0)
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=False, max_leak_mb=1, rand=rand, sleep=sleep)
    agent.settings = ChaosSettings(error_ratio=1.0, hang=True, latency_ms=600_000)
    await agent.before_request()  # returns at once: neither the latency nor the hang applies
    assert (rand.calls, sleep.slept_s) == (0, [])


async def test_enabled_agent_with_no_settings_is_inert() -> None:
    rand = CountedRand(0.0)
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=rand)
    agent.apply(None)
    assert agent.settings == ChaosSettings()
    await agent.before_request()
    assert rand.calls == 0


# -- ChaosAgent: errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    "u,ratio,fails",
    [
        (0.3, 0.5, True),
        (0.7, 0.5, False),
        (0.5, 0.5, False),  # strict <: the draw equal to the ratio passes
        (0.4999, 0.5, True),
        (0.0, 0.01, True),
        (0.999999, 1.0, True),  # ratio 1 fails every draw in [0, 1)
    ],
)
async def test_error_ratio_against_the_injected_draw(u: float, ratio: float, fails: bool) -> None:
    rand = CountedRand(u)
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=rand)
    agent.apply({"error_ratio": ratio})
    if fails:
        with pytest.raises(InjectedFault, match="injected failure"):
            await agent.before_request()
    else:
        await agent.before_request()
    assert rand.calls == 1


async def test_error_ratio_zero_never_draws() -> None:
    rand = CountedRand(0.0)
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=rand, sleep=sleep)
    agent.apply({"latency_ms": 1})  # active, but no error ratio
    request = asyncio.ensure_future(agent.before_request())
    await sleep.wake()  # the 1 ms passes
    await request
    assert rand.calls == 0


async def test_each_request_draws_once() -> None:
    draws = iter([0.9, 0.1, 0.9, 0.1])
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: next(draws))
    agent.apply({"error_ratio": 0.5})
    outcomes = []
    for _ in range(4):
        try:
            await agent.before_request()
            outcomes.append("ok")
        except InjectedFault:
            outcomes.append("fault")
    assert outcomes == ["ok", "fault", "ok", "fault"]


async def test_clearing_stops_the_errors() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.0)
    agent.apply({"error_ratio": 1.0})
    with pytest.raises(InjectedFault):
        await agent.before_request()
    agent.apply({})
    await agent.before_request()


# -- ChaosAgent: latency and hang -----------------------------------------------------


async def test_latency_holds_the_request_until_latency_ms_has_passed() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.99, sleep=sleep)
    agent.apply({"latency_ms": 20})
    request = asyncio.ensure_future(agent.before_request())
    await sleep.settle()
    assert sleep.slept_s == [0.020]
    assert not request.done()  # held while the 20 ms have not passed
    await sleep.wake()
    assert request.done()
    await request


async def test_latency_then_error() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.0, sleep=sleep)
    agent.apply({"latency_ms": 20, "error_ratio": 0.5})
    request = asyncio.ensure_future(agent.before_request())
    await sleep.settle()
    assert not request.done()  # the fault comes after the delay, not before
    await sleep.wake()
    with pytest.raises(InjectedFault):
        await request


async def test_hang_blocks_until_the_caller_gives_up() -> None:
    rand = CountedRand(0.0)
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=rand, sleep=sleep)
    agent.apply({"hang": True, "error_ratio": 1.0})
    request = asyncio.ensure_future(agent.before_request())
    for _ in range(3):  # however much time passes, it does not answer
        await sleep.wake()
        assert not request.done()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert rand.calls == 0  # it never got as far as the error draw


async def test_hang_is_cancellable_and_lifting_it_frees_new_requests() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"hang": True})
    task = asyncio.ensure_future(agent.before_request())
    await sleep.settle()
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    agent.apply({})
    await agent.before_request()  # returns at once


async def test_stall_holds_the_work_loop_until_it_is_lifted() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"stall": True})
    step = asyncio.ensure_future(agent.stall_point())
    for _ in range(3):
        await sleep.wake()
        assert not step.done()
    agent.apply({})
    await sleep.wake()  # the next poll sees the stall lifted
    assert step.done()
    assert set(sleep.slept_s) == {0.05}


async def test_a_step_delay_slows_each_decode_step_by_its_delay() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"step_delay_ms": 150})
    step = asyncio.ensure_future(agent.stall_point())
    await sleep.settle()
    assert not step.done()  # waiting out the delay
    await sleep.wake()
    assert step.done() and sleep.slept_s == [0.15]
    agent.apply({})
    await agent.stall_point()  # no delay: returns at once
    assert sleep.slept_s == [0.15]
    with pytest.raises(ValueError, match="step_delay_ms"):
        agent.apply({"step_delay_ms": 10_001})


# -- ChaosAgent: leak -----------------------------------------------------------------


async def test_leak_grows_tick_by_tick_up_to_the_cap_and_clearing_releases_it() -> None:
    # 4 MB/s = 419_430 bytes per 0.1 s tick; the 1 MB cap is reached on the third tick
    # with a partial chunk, never passed.
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"leak_mb_per_s": 4})
    await started(sleep)
    chunk = int(4 * MB / 10)
    seen = [agent.leaked_bytes]
    for _ in range(4):  # three ticks to the cap, then it stays there
        await sleep.wake()
        seen.append(agent.leaked_bytes)
    assert seen == [chunk, 2 * chunk, 1 * MB, 1 * MB, 1 * MB]
    assert set(sleep.slept_s) == {LEAK_TICK_S}
    await stop_leak(agent, sleep)
    assert agent.leaked_bytes == 0


async def test_a_huge_leak_rate_still_stops_at_max_leak_mb() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"leak_mb_per_s": 1024})
    await started(sleep)
    assert agent.leaked_bytes == 1 * MB  # the first chunk is cut to the cap
    await sleep.wake()
    assert agent.leaked_bytes == 1 * MB
    await stop_leak(agent, sleep)
    assert agent.leaked_bytes == 0


async def test_setting_the_leak_rate_to_zero_releases_it_while_other_faults_stay() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.0, sleep=sleep)
    agent.apply({"leak_mb_per_s": 1024})
    await started(sleep)
    assert agent.leaked_bytes > 0
    agent.apply({"leak_mb_per_s": 0, "error_ratio": 1.0})
    assert agent.leaked_bytes == 0
    assert agent.settings.active
    with pytest.raises(InjectedFault):
        await agent.before_request()
    await stop_leak(agent, sleep)


async def test_reapplying_the_leak_does_not_start_a_second_loop() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"leak_mb_per_s": 1})
    await started(sleep)
    agent.apply({"leak_mb_per_s": 2})
    await sleep.wake()
    assert sleep.parked == 1  # one loop asleep, not two
    # … and that one loop runs at the new rate: one tick of 1 MB/s, then one of 2 MB/s
    assert agent.leaked_bytes == int(1 * MB / 10) + int(2 * MB / 10)
    await stop_leak(agent, sleep)


async def test_a_tiny_leak_rate_leaks_nothing_tick_after_tick() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, sleep=sleep)
    agent.apply({"leak_mb_per_s": 1e-6})
    await started(sleep)
    for _ in range(3):
        await sleep.wake()
        assert agent.leaked_bytes == 0
    await stop_leak(agent, sleep)


# -- ChaosAgent: VRAM leak --------------------------------------------------------------


async def test_a_vram_leak_on_a_cpu_replica_leaks_nothing_and_says_so() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, device="cpu", sleep=sleep)
    assert agent.vram_leak_state is None
    agent.apply({"vram_leak_mb_per_s": 4})
    assert agent.vram_leak_state == "no_gpu"
    await started(sleep)
    assert sleep.slept_s == []  # nothing to leak into: no loop at all
    assert (agent.vram_leaked_bytes, agent.leaked_bytes) == (0, 0)
    agent.apply({})
    assert agent.vram_leak_state is None


async def test_a_vram_leak_beside_a_host_leak_on_cpu_grows_only_the_host_one() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=1, device="cpu", sleep=sleep)
    agent.apply({"leak_mb_per_s": 4, "vram_leak_mb_per_s": 4})
    await started(sleep)
    await sleep.wake()
    assert agent.leaked_bytes == 2 * int(4 * MB / 10)
    assert agent.vram_leaked_bytes == 0
    await stop_leak(agent, sleep)


async def test_a_disabled_agent_reports_no_vram_leak() -> None:
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=False, max_leak_mb=1, device="cuda:0", sleep=sleep)
    agent.apply({"vram_leak_mb_per_s": 4})
    await sleep.settle()
    assert agent.vram_leak_state is None and sleep.slept_s == []


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)")
async def test_a_vram_leak_on_a_gpu_allocates_real_cuda_memory_up_to_the_cap_and_releases_it() -> None:
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sleep = FakeSleep()
    agent = ChaosAgent(enabled=True, max_leak_mb=2, device="cuda:0", sleep=sleep)
    agent.apply({"vram_leak_mb_per_s": 1024})
    assert agent.vram_leak_state == "leaking"
    await started(sleep)
    assert agent.vram_leaked_bytes == 2 * MB and agent.leaked_bytes == 0  # the first tick, cut to the cap
    assert torch.cuda.memory_allocated() - before >= 2 * MB
    await stop_leak(agent, sleep)
    assert agent.vram_leaked_bytes == 0
    assert torch.cuda.memory_allocated() - before < 2 * MB
