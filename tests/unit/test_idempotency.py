"""IdempotencyStore (ballast/router/idempotency.py) on a fake clock, walked tick by tick.

Concurrency is driven by hand: the first call's ``fn`` waits on an
``asyncio.Event`` the test sets, so "a repeat while the first is running" is a
state the test holds, not a race it hopes to win.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
from fakes import FakeClock, FakeSleep

from ballast.config import IdempotencySettings
from ballast.errors import ConcurrencyLimited, DeadlineExceeded, InvalidRequest
from ballast.router.idempotency import IdempotencyStore


class Counted:
    """An ``fn`` for the store: counts its calls, returns a fresh dict each time."""

    def __init__(self, gate: asyncio.Event | None = None, fail: BaseException | None = None) -> None:
        self.calls = 0
        self.gate = gate
        self.fail = fail
        self.started = asyncio.Event()

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return {"text": f"answer {self.calls}"}


def make(ttl_s: int = 10, max_entries: int = 100, **per_tenant: int) -> tuple[IdempotencyStore, FakeClock]:
    clock = FakeClock()
    settings = IdempotencySettings(ttl_s=ttl_s, max_entries=max_entries, **per_tenant)
    return IdempotencyStore(settings, clock=clock), clock


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


def spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    return asyncio.ensure_future(coro)


# -- basic replay and ttl -------------------------------------------------------------


async def test_first_call_runs_fn_and_is_not_a_replay() -> None:
    store, _ = make()
    fn = Counted()
    result, replayed = await store.run("acme", "k1", fn)
    assert result == {"text": "answer 1"}
    assert replayed is False
    assert fn.calls == 1
    assert store.replays == 0
    assert len(store) == 1


async def test_repeat_within_ttl_replays_the_same_dict_without_calling_fn() -> None:
    store, clock = make(ttl_s=10)
    fn = Counted()
    first, _ = await store.run("acme", "k1", fn)
    for _ in range(3):
        clock.advance(3)  # 3, 6, 9: all within ttl
        again, replayed = await store.run("acme", "k1", fn)
        assert again is first
        assert replayed is True
    assert fn.calls == 1
    assert store.replays == 3


async def test_ttl_boundary_walked_second_by_second() -> None:
    store, clock = make(ttl_s=3)
    fn = Counted()
    first, _ = await store.run("acme", "k1", fn)  # done at t=0
    for t in (1, 2, 3):  # age <= ttl: replayed (the boundary itself included)
        clock.now_s = t
        result, replayed = await store.run("acme", "k1", fn)
        assert (result is first, replayed, fn.calls) == (True, True, 1), t
    clock.now_s = 4  # age 4 > ttl 3: runs again
    result, replayed = await store.run("acme", "k1", fn)
    assert result == {"text": "answer 2"}
    assert replayed is False
    assert fn.calls == 2
    # and the new answer is the one replayed from now on, aged from t=4
    clock.now_s = 7
    assert await store.run("acme", "k1", fn) == (result, True)
    clock.now_s = 8
    assert (await store.run("acme", "k1", fn))[1] is False
    assert fn.calls == 3


async def test_ttl_counts_from_when_the_answer_was_ready_not_from_the_start() -> None:
    store, clock = make(ttl_s=3)
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await settle()
    clock.advance(10)  # a long generation: started at 0, done at 10
    gate.set()
    result, _ = await first
    clock.now_s = 13  # 13 from the start, 3 from the answer
    assert await store.run("acme", "k1", fn) == (result, True)
    assert fn.calls == 1


async def test_keys_are_scoped_per_tenant() -> None:
    store, _ = make()
    fn = Counted()
    a, replay_a = await store.run("acme", "same-key", fn)
    b, replay_b = await store.run("globex", "same-key", fn)
    assert (replay_a, replay_b) == (False, False)
    assert a == {"text": "answer 1"} and b == {"text": "answer 2"}
    assert fn.calls == 2
    # each tenant replays its own answer
    assert (await store.run("acme", "same-key", fn))[0] is a
    assert (await store.run("globex", "same-key", fn))[0] is b
    assert fn.calls == 2


async def test_different_keys_of_one_tenant_do_not_share() -> None:
    store, _ = make()
    fn = Counted()
    await store.run("acme", "k1", fn)
    result, replayed = await store.run("acme", "k2", fn)
    assert (result, replayed, fn.calls) == ({"text": "answer 2"}, False, 2)


# -- concurrency ----------------------------------------------------------------------


async def test_concurrent_repeat_waits_for_the_first_and_gets_its_result() -> None:
    store, _ = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await fn.started.wait()
    second = spawn(store.run("acme", "k1", fn))
    await settle()
    assert not first.done() and not second.done()  # both held by the gate
    assert fn.calls == 1
    gate.set()
    (r1, replay1), (r2, replay2) = await first, await second
    assert r1 is r2
    assert (replay1, replay2) == (False, True)
    assert fn.calls == 1
    assert store.replays == 1


async def test_failing_first_call_propagates_to_its_waiter_and_is_forgotten() -> None:
    store, _ = make()
    gate = asyncio.Event()
    boom = RuntimeError("model fell over")
    failing = Counted(gate, fail=boom)
    first = spawn(store.run("acme", "k1", failing))
    await failing.started.wait()
    waiter = spawn(store.run("acme", "k1", failing))
    await settle()
    gate.set()
    with pytest.raises(RuntimeError, match="model fell over"):
        await first
    with pytest.raises(RuntimeError, match="model fell over"):
        await waiter
    assert failing.calls == 1  # the waiter did not run fn itself
    assert len(store) == 0  # forgotten
    # the client's retry runs for real
    ok = Counted()
    result, replayed = await store.run("acme", "k1", ok)
    assert (result, replayed, ok.calls) == ({"text": "answer 1"}, False, 1)


async def test_failing_first_call_without_waiters_is_forgotten() -> None:
    store, _ = make()
    with pytest.raises(ValueError):
        await store.run("acme", "k1", Counted(fail=ValueError("bad")))
    assert len(store) == 0
    fn = Counted()
    assert await store.run("acme", "k1", fn) == ({"text": "answer 1"}, False)


async def test_cancelled_waiter_does_not_cancel_the_first_call() -> None:
    store, clock = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await fn.started.wait()
    waiter = spawn(store.run("acme", "k1", fn))
    await settle()
    waiter.cancel()  # that client gave up
    await settle()
    assert waiter.cancelled()
    assert not first.done()  # still running, not cancelled
    gate.set()
    result, replayed = await first
    assert (result, replayed) == ({"text": "answer 1"}, False)
    # and the answer is kept for later repeats
    clock.advance(1)
    assert await store.run("acme", "k1", fn) == (result, True)
    assert fn.calls == 1


async def test_a_waiter_giving_up_leaves_the_first_call_alone() -> None:
    # A caller's timeout (asyncio.wait_for) cancels its waiting task; do that directly,
    # so no real time has to pass.
    store, _ = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await fn.started.wait()
    waiter = spawn(store.run("acme", "k1", fn))
    await settle()
    assert not waiter.done()  # waiting on the first call
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not first.done()
    gate.set()
    assert (await first)[1] is False


async def test_cancelled_first_call_is_forgotten() -> None:
    store, _ = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await fn.started.wait()
    first.cancel()
    await settle()
    assert first.cancelled()
    assert len(store) == 0
    fn2 = Counted()
    assert await store.run("acme", "k1", fn2) == ({"text": "answer 1"}, False)


async def test_waiter_is_not_cancelled_when_the_first_call_is_cancelled() -> None:
    store, _ = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await fn.started.wait()
    waiter = spawn(store.run("acme", "k1", fn))
    await settle()
    first.cancel()  # the first client disconnected; the waiter's client did not
    await settle()
    gate.set()
    try:
        await waiter
        outcome = "answered"
    except asyncio.CancelledError:
        outcome = "cancelled"
    except Exception:
        outcome = "error"
    assert outcome != "cancelled"


# -- bounds ---------------------------------------------------------------------------


async def test_max_entries_is_enforced_oldest_first() -> None:
    store, clock = make(ttl_s=1000, max_entries=3)
    fn = Counted()
    for i in range(5):
        clock.advance(1)
        await store.run("acme", f"k{i}", fn)
        assert len(store) == min(i + 1, 3)
    assert fn.calls == 5
    # k0 and k1 were evicted (they run again); k2..k4 are still replayed
    calls = fn.calls
    for key in ("k2", "k3", "k4"):
        assert (await store.run("acme", key, fn))[1] is True
    assert fn.calls == calls
    assert (await store.run("acme", "k0", fn))[1] is False
    assert fn.calls == calls + 1
    assert len(store) == 3


async def test_expired_entries_are_evicted_before_the_oldest() -> None:
    # a: inserted first but finishes last (done t=8); b: inserted second, done t=0.
    # At t=11 with ttl 10, b has expired and a has not: inserting c must drop b, not
    # the older-by-insertion a.
    store, clock = make(ttl_s=10, max_entries=2)
    gate_a = asyncio.Event()
    fn_a = Counted(gate_a)
    task_a = spawn(store.run("acme", "a", fn_a))
    await fn_a.started.wait()
    fn_b = Counted()
    await store.run("acme", "b", fn_b)  # done at t=0
    clock.now_s = 8
    gate_a.set()
    result_a, _ = await task_a  # done at t=8
    clock.now_s = 11
    await store.run("acme", "c", Counted())
    assert len(store) == 2
    assert await store.run("acme", "a", fn_a) == (result_a, True)  # kept
    assert fn_a.calls == 1
    assert (await store.run("acme", "b", fn_b))[1] is False  # evicted, ran again
    assert fn_b.calls == 2


async def test_all_expired_entries_go_at_once_on_insert() -> None:
    store, clock = make(ttl_s=5, max_entries=10)
    for i in range(4):
        await store.run("acme", f"old{i}", Counted())  # all done at t=0
    assert len(store) == 4
    clock.now_s = 5
    await store.run("acme", "fresh5", Counted())  # age 5 == ttl: none expired yet
    assert len(store) == 5
    clock.now_s = 6
    await store.run("acme", "fresh6", Counted())  # the four old ones (age 6) go
    assert len(store) == 2


async def test_in_flight_entries_never_expire_by_age() -> None:
    store, clock = make(ttl_s=1, max_entries=10)
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "slow", fn))
    await fn.started.wait()
    clock.advance(100)
    await store.run("acme", "other", Counted())  # triggers eviction
    waiter = spawn(store.run("acme", "slow", fn))  # still joins the running call
    await settle()
    gate.set()
    assert (await first)[0] is (await waiter)[0]
    assert fn.calls == 1


# -- a repeat's wait is bounded by its own deadline ---------------------------------------


async def test_a_repeat_waits_for_the_first_until_its_own_deadline_second_by_second() -> None:
    clock, sleep = FakeClock(), FakeSleep()
    store = IdempotencyStore(IdempotencySettings(ttl_s=60, max_entries=100), clock=clock, sleep=sleep)
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn, within_s=120))
    await fn.started.wait()
    repeat = spawn(store.run("acme", "k1", fn, within_s=3))
    await sleep.settle()
    for now in (1, 2):
        clock.now_s = now
        await sleep.wake()
        assert not repeat.done(), now  # still within its 3 s
    clock.now_s = 3
    await sleep.wake()
    with pytest.raises(DeadlineExceeded):
        await repeat
    assert not first.done()  # the first goes on ...
    late = spawn(store.run("acme", "k1", fn, within_s=10))  # ... and a later repeat still waits for it
    await sleep.settle()
    gate.set()
    assert await first == ({"text": "answer 1"}, False)
    assert await late == ({"text": "answer 1"}, True)
    assert fn.calls == 1 and store.replays == 1


async def test_a_repeat_with_no_time_left_is_refused_at_once() -> None:
    store, _ = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn))
    await fn.started.wait()
    with pytest.raises(DeadlineExceeded):
        await store.run("acme", "k1", fn, within_s=0)
    gate.set()
    await first


# -- a key stands for one request -----------------------------------------------------------


async def test_the_same_key_for_another_request_is_refused_while_running_and_once_answered() -> None:
    store, _ = make()
    gate = asyncio.Event()
    fn = Counted(gate)
    first = spawn(store.run("acme", "k1", fn, fingerprint="long"))
    await fn.started.wait()
    for _ in range(3):
        with pytest.raises(InvalidRequest) as refused:
            await store.run("acme", "k1", fn, fingerprint="short")
        assert refused.value.field == "Idempotency-Key"
    gate.set()
    await first
    with pytest.raises(InvalidRequest):
        await store.run("acme", "k1", fn, fingerprint="short")
    assert await store.run("acme", "k1", fn, fingerprint="long") == ({"text": "answer 1"}, True)
    assert await store.run("globex", "k1", Counted(), fingerprint="short") == ({"text": "answer 1"}, False)
    assert fn.calls == 1


# -- per-tenant bounds ---------------------------------------------------------------------


async def test_one_tenants_flood_of_keys_evicts_only_its_own() -> None:
    store, clock = make(ttl_s=600, max_entries=10_000, max_entries_per_tenant=100)
    quiet = Counted()
    answer, _ = await store.run("quiet", "mine", quiet)
    for i in range(10_000):
        await store.run("loud", f"k{i}", Counted())
    assert store.tenant_len("loud") == 100 and store.tenant_len("quiet") == 1
    assert await store.run("quiet", "mine", quiet) == (answer, True)  # still replayed
    assert quiet.calls == 1


async def test_a_tenant_whose_keys_all_run_is_refused_a_new_one_and_none_is_evicted() -> None:
    store, _ = make(max_entries=100, max_entries_per_tenant=2)
    gate = asyncio.Event()
    running = [Counted(gate), Counted(gate)]
    firsts = [spawn(store.run("loud", f"k{i}", fn)) for i, fn in enumerate(running)]
    await settle()
    with pytest.raises(ConcurrencyLimited):
        await store.run("loud", "k2", Counted())
    assert (await store.run("quiet", "k2", Counted()))[1] is False  # another tenant is not held up
    gate.set()
    assert [(await f)[1] for f in firsts] == [False, False]
    assert (await store.run("loud", "k0", Counted()))[1] is True  # kept, and replayed
    assert (await store.run("loud", "k2", Counted()))[1] is False  # room again: k0 or k1's answer went


async def test_a_tenants_answers_are_bounded_in_bytes() -> None:
    store, _ = make(max_entries=100, max_answer_bytes_per_tenant=64)
    for i in range(4):
        await store.run("loud", f"k{i}", Counted())  # {"text":"answer N"}: 19 bytes each
    assert store.tenant_len("loud") == 3  # 4 x 19 > 64: the oldest went
    assert (await store.run("loud", "k0", Counted()))[1] is False
