"""Fault injection (serve_app/model/chaos.py): settings validation and the agent's faults.

The error draw is injected (``rand``). Latency, hang and leak run on asyncio's own
timers, which chaos.py does not let us inject: those tests use real loop time, kept
to a few tens of milliseconds (latency, hang) or a few 0.1 s leak ticks.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Callable

import pytest

from serve_app.model.chaos import MB, ChaosAgent, ChaosSettings, InjectedFault
from serve_app.errors import BallastError

LEAK_TICK_S = 0.1  # chaos._leak_loop's own period


class CountedRand:
    def __init__(self, value: float) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


async def wait_until(pred: Callable[[], bool], timeout_s: float = 2.0, step_s: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(step_s)


async def stop_leak(agent: ChaosAgent) -> None:
    """Lift the chaos and wait for the leak task to end (no task left pending)."""
    agent.apply({})
    task = agent._leak_task
    if task is not None:
        await asyncio.wait_for(task, timeout=1.0)


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
        {"error_ratio": 0.25, "latency_ms": 40, "hang": True, "leak_mb_per_s": 2.0, "vram_leak_mb_per_s": 3.0,
         "target": "primary", "set_by": "x"}
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
    agent = ChaosAgent(enabled=False, max_leak_mb=1, rand=CountedRand(0.0))
    agent.apply({"error_ratio": 1.0, "hang": True, "latency_ms": 600_000, "leak_mb_per_s": 1024})
    assert agent.settings == ChaosSettings()
    assert agent._leak_task is None  # no leak started
    assert agent.leaked_bytes == 0


async def test_disabled_agent_never_injects_even_with_settings_forced() -> None:
    rand = CountedRand(0.0)
    agent = ChaosAgent(enabled=False, max_leak_mb=1, rand=rand)
    agent.settings = ChaosSettings(error_ratio=1.0, hang=True, latency_ms=600_000)
    await asyncio.wait_for(agent.before_request(), timeout=1.0)  # returns at once
    assert rand.calls == 0


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
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=rand)
    agent.apply({"latency_ms": 1})  # active, but no error ratio
    await agent.before_request()
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


async def test_latency_delays_the_request_by_at_least_latency_ms() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.99)
    agent.apply({"latency_ms": 20})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await agent.before_request()
    elapsed_s = loop.time() - t0
    assert elapsed_s >= 0.020 - 1e-6  # asyncio may fire a timer within its clock resolution
    assert elapsed_s < 1.0


async def test_latency_then_error() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.0)
    agent.apply({"latency_ms": 20, "error_ratio": 0.5})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(InjectedFault):
        await agent.before_request()
    assert loop.time() - t0 >= 0.020 - 1e-6  # the fault comes after the delay


async def test_hang_blocks_until_the_caller_gives_up() -> None:
    rand = CountedRand(0.0)
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=rand)
    agent.apply({"hang": True, "error_ratio": 1.0})
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(agent.before_request(), timeout=0.05)
    assert rand.calls == 0  # it never got as far as the error draw


async def test_hang_is_cancellable_and_lifting_it_frees_new_requests() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1)
    agent.apply({"hang": True})
    task = asyncio.ensure_future(agent.before_request())
    await asyncio.sleep(0.01)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    agent.apply({})
    await asyncio.wait_for(agent.before_request(), timeout=1.0)


# -- ChaosAgent: leak -----------------------------------------------------------------


async def test_leak_grows_tick_by_tick_up_to_the_cap_and_clearing_releases_it() -> None:
    # 4 MB/s = 419_430 bytes per 0.1 s tick; the 1 MB cap is reached on the third tick
    # with a partial chunk, never passed.
    cap = 1 * MB
    agent = ChaosAgent(enabled=True, max_leak_mb=1)
    agent.apply({"leak_mb_per_s": 4})
    seen: list[int] = []
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.0
        while agent.leaked_bytes < cap:
            assert loop.time() < end, f"the leak never reached the cap: {seen}"
            if not seen or seen[-1] != agent.leaked_bytes:
                seen.append(agent.leaked_bytes)
            await asyncio.sleep(0.01)
        seen.append(agent.leaked_bytes)
        chunk = int(4 * MB / 10)
        assert [b for b in seen if b] == [chunk, 2 * chunk, cap]
        # a few more ticks: it stays at the cap
        await asyncio.sleep(2.5 * LEAK_TICK_S)
        assert agent.leaked_bytes == cap
    finally:
        await stop_leak(agent)
    assert agent.leaked_bytes == 0
    assert agent._leak_task is not None and agent._leak_task.done()


async def test_a_huge_leak_rate_still_stops_at_max_leak_mb() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1)
    agent.apply({"leak_mb_per_s": 1024})
    try:
        await wait_until(lambda: agent.leaked_bytes > 0)
        assert agent.leaked_bytes == 1 * MB  # the first chunk is cut to the cap
        await asyncio.sleep(1.5 * LEAK_TICK_S)
        assert agent.leaked_bytes == 1 * MB
    finally:
        await stop_leak(agent)
    assert agent.leaked_bytes == 0


async def test_setting_the_leak_rate_to_zero_releases_it_while_other_faults_stay() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1, rand=lambda: 0.0)
    agent.apply({"leak_mb_per_s": 1024})
    try:
        await wait_until(lambda: agent.leaked_bytes > 0)
        agent.apply({"leak_mb_per_s": 0, "error_ratio": 1.0})
        assert agent.leaked_bytes == 0
        assert agent.settings.active
        with pytest.raises(InjectedFault):
            await agent.before_request()
    finally:
        await stop_leak(agent)


async def test_reapplying_the_leak_does_not_start_a_second_loop() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1)
    agent.apply({"leak_mb_per_s": 4})
    first = agent._leak_task
    try:
        agent.apply({"leak_mb_per_s": 8})
        assert agent._leak_task is first
    finally:
        await stop_leak(agent)


async def test_a_tiny_leak_rate_does_not_grow_the_leak_list_without_bound() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1)
    agent.apply({"leak_mb_per_s": 1e-6})
    try:
        await asyncio.sleep(3.5 * LEAK_TICK_S)
        assert agent.leaked_bytes == 0
        assert len(agent._leak) == 0
    finally:
        await stop_leak(agent)


# -- ChaosAgent: VRAM leak --------------------------------------------------------------


async def test_a_vram_leak_on_a_cpu_replica_leaks_nothing_and_says_so() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1, device="cpu")
    assert agent.vram_leak_state is None
    agent.apply({"vram_leak_mb_per_s": 4})
    try:
        assert agent.vram_leak_state == "no_gpu"
        assert agent._leak_task is None  # nothing to leak into: no loop at all
        await asyncio.sleep(1.5 * LEAK_TICK_S)
        assert (agent.vram_leaked_bytes, agent.leaked_bytes) == (0, 0)
    finally:
        await stop_leak(agent)
    assert agent.vram_leak_state is None


async def test_a_vram_leak_beside_a_host_leak_on_cpu_grows_only_the_host_one() -> None:
    agent = ChaosAgent(enabled=True, max_leak_mb=1, device="cpu")
    agent.apply({"leak_mb_per_s": 4, "vram_leak_mb_per_s": 4})
    try:
        await wait_until(lambda: agent.leaked_bytes > 0)
        assert agent.vram_leaked_bytes == 0
    finally:
        await stop_leak(agent)


def test_a_disabled_agent_reports_no_vram_leak() -> None:
    agent = ChaosAgent(enabled=False, max_leak_mb=1, device="cuda:0")
    agent.apply({"vram_leak_mb_per_s": 4})
    assert agent.vram_leak_state is None and agent._leak_task is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)")
async def test_a_vram_leak_on_a_gpu_allocates_real_cuda_memory_up_to_the_cap_and_releases_it() -> None:
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    agent = ChaosAgent(enabled=True, max_leak_mb=2, device="cuda:0")
    agent.apply({"vram_leak_mb_per_s": 1024})
    try:
        assert agent.vram_leak_state == "leaking"
        await wait_until(lambda: agent.vram_leaked_bytes >= 2 * MB)
        assert agent.vram_leaked_bytes == 2 * MB and agent.leaked_bytes == 0
        assert torch.cuda.memory_allocated() - before >= 2 * MB
        assert all(t.device.type == "cuda" for t in agent._vram_leak)
    finally:
        await stop_leak(agent)
    assert agent.vram_leaked_bytes == 0
    assert torch.cuda.memory_allocated() - before < 2 * MB
