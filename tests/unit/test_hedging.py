"""Hedged attempts and silent replicas in ResilientCaller (ballast/router/resilience.py), on the
fake clock of test_resilient_caller.py: each response says how long it takes after it was
sent and which replica took it (``replica``); ``FakeReplicas`` says which replicas went silent.

Settings as there (attempt timeout 4 s, 3 attempts, backoff 1 s then 2 s); the hedge delay is
learned from 20 waits of 0.5 s each (factor 3: 1.5 s for a stream's chunks; a unary call of
CALL's 8 tokens waits 9 units of 0.5 / 9 s, so 1.5 s too).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_resilient_caller import (
    CALL,
    HANG,
    WALL_S,
    FakeHandle,
    FakeReplicas,
    FakeResponse,
    FakeStream,
    answered,
    breaker_of,
    collect,
    make,
    ok,
    piece,
    result,
)

from ballast.model.protocol import ModelChunk, Resume
from ballast.policies.hedge import FIRST_CHUNK, NEXT_CHUNK, UNARY
from ballast.router.calls import CallSpec
from ballast.router.resilience import ResilientCaller

HEDGE = {"min_delay_s": 0.1, "factor": 3}


def learned(caller: ResilientCaller, wait_s: float = 0.5) -> None:
    """The model's last 20 waits of each kind took ``wait_s`` (a unary's for CALL's length)."""
    for _ in range(20):
        caller.hedge_delay.observe(UNARY, wait_s, CALL.max_tokens)
        caller.hedge_delay.observe(FIRST_CHUNK, wait_s)
        caller.hedge_delay.observe(NEXT_CHUNK, wait_s)


def spec(clock, hedge: bool = True, deadline_in_s: float = 30) -> CallSpec:
    return CallSpec(CALL, clock() + deadline_in_s, [], WALL_S, tenant="acme", hedge=hedge)


async def test_a_silent_replica_is_hedged_at_its_delay_and_the_hedge_answers() -> None:
    silent = FakeResponse(HANG, replica="r1")
    hedge = FakeResponse(1, result=result("hi"), replica="r2")
    primary = FakeHandle(silent, hedge)
    caller, clock, _, events = make(primary, hedge=HEDGE)
    learned(caller)
    assert await caller.unary(spec(clock)) == answered("hi")
    # t=100 sent to r1; t=101.5 (3 × 0.5 s) nothing: the hedge goes out, passing r1 over; it answers at 102.5.
    assert clock() == 102.5
    first, second = primary.generate.calls
    assert first.avoid == () and second.avoid == ("r1",)
    assert second.deadline.budget_s == 30 - 1.5  # what is left of the deadline when it is sent
    assert silent.cancelled and not hedge.cancelled  # the slower one aborted
    assert events == [("hedge", "primary")]
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)  # the hedge's success; the loser is neither
    assert caller.hedges.snapshot(0) == {"in_flight": 0, "limit": 1, "sent": 1, "denied": 0, "won": 1}
    assert caller.budget.snapshot()["retries_in_flight"] == 0  # a hedge is not a retry


async def test_the_first_answer_wins_when_it_comes_before_the_hedges() -> None:
    slow = FakeResponse(2, result=result("first"), replica="r1")
    hedge = FakeResponse(2, result=result("hedge"), replica="r2")
    primary = FakeHandle(slow, hedge)
    caller, clock, _, events = make(primary, hedge=HEDGE)
    learned(caller)
    assert await caller.unary(spec(clock)) == answered("first")
    assert clock() == 102 and hedge.cancelled and not slow.cancelled  # the hedge (due 103.5) aborted
    assert caller.hedges.won == 0 and caller.hedges.in_flight == 0


async def test_no_hedge_before_the_delay_is_learned_past_the_budget_or_when_the_level_sheds() -> None:
    # Not learned: the attempt runs to its 4 s timeout, then an ordinary retry.
    for setup in ("unlearned", "no_budget", "sheds"):
        hung = FakeResponse(HANG, replica="r1")
        primary = FakeHandle(hung, ok("retried"))
        budget = {"budget_ratio": 0, "budget_min_concurrent": 0} if setup == "no_budget" else {}
        caller, clock, _, events = make(primary, hedge={**HEDGE, **budget})
        if setup != "unlearned":
            learned(caller)
        assert await caller.unary(spec(clock, hedge=setup != "sheds")) == answered("retried"), setup
        assert clock() == 100 + 4 + 1 + 1, setup
        assert events == [("retry", "primary", "attempt_timeout")], setup
        assert caller.hedges.denied == (1 if setup == "no_budget" else 0), setup


async def test_a_replica_that_answers_slowly_but_steadily_is_not_hedged() -> None:
    primary = FakeHandle(*(FakeResponse(3, result=result(f"a{i}"), replica="r1") for i in range(5)))
    caller, clock, _, events = make(primary, hedge=HEDGE)
    learned(caller, wait_s=3)  # its waits are 3 s: the delay is 9 s, past the 4 s attempt timeout
    for i in range(5):
        assert await caller.unary(spec(clock)) == answered(f"a{i}")
    assert clock() == 115 and events == [] and len(primary.generate.calls) == 5


async def test_a_silent_replicas_timeout_is_lost_capacity_not_an_error() -> None:
    silent = FakeResponse(HANG, replica="r1")
    primary = FakeHandle(silent, ok("elsewhere"))
    caller, clock, timer, events = make(primary, replicas=FakeReplicas("r1"))
    assert await caller.unary(spec(clock, hedge=False)) == answered("elsewhere")
    # t=104: the attempt timed out on r1, whose heartbeat stopped too: sent again at once
    # (the migration pause), passing r1 over.
    assert silent.cancelled and primary.generate.calls[1].avoid == ("r1",)
    assert events == [("lost", "primary", "migrated")]
    assert caller.backends[0].failed == {"replica_silent": 1}
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)  # the breaker never heard of the silent one


async def test_a_timeout_on_a_replica_still_beating_is_a_timeout() -> None:
    hung = FakeResponse(HANG, replica="r1")
    primary = FakeHandle(hung, ok("retried"))
    caller, clock, _, events = make(primary, replicas=FakeReplicas("r9"))
    assert await caller.unary(spec(clock, hedge=False)) == answered("retried")
    assert events == [("retry", "primary", "attempt_timeout")]
    assert caller.backends[0].failed == {"attempt_timeout": 1}
    assert breaker_of(caller, "primary")["failures"] == 1


async def test_a_stream_silent_before_its_first_chunk_is_hedged() -> None:
    silent = FakeStream(FakeResponse(HANG), replica="r1")
    hedge = FakeStream(piece("hi", [1]), piece("!", [2]), replica="r2")
    primary = FakeHandle(streams=(silent, hedge))
    caller, clock, _, events = make(primary, hedge=HEDGE)
    learned(caller)
    opened = await caller.stream(spec(clock))
    assert [c.text for c in await collect(opened.chunks)] == ["hi", "!"]
    assert silent.cancelled and not hedge.cancelled
    assert primary.generate_stream.calls[1].avoid == ("r1",)
    assert events == [("hedge", "primary")] and caller.backends[0].bulkhead.in_flight == 0


async def test_a_stream_that_stalls_mid_way_is_carried_on_by_a_hedge_from_what_was_delivered() -> None:
    stalled = FakeStream(piece("he", [104, 101]), FakeResponse(HANG), replica="r1")
    hedge = FakeStream(
        FakeResponse(1, result=ModelChunk("llo", (108, 108, 111), queue_wait_ms=3.0)), piece("!", [33]), replica="r2"
    )
    primary = FakeHandle(streams=(stalled, hedge))
    caller, clock, _, events = make(primary, hedge=HEDGE)
    learned(caller)
    opened = await caller.stream(spec(clock))
    chunks = await collect(opened.chunks)
    assert "".join(c.text for c in chunks) == "hello!"
    assert chunks[1].queue_wait_ms is None  # a continuation is not a new request's wait
    # t=101 "he"; t=102.5 no next chunk for 1.5 s: the hedge resumes after "he" on another replica.
    resumed = primary.generate_stream.calls[1]
    assert replace(resumed, deadline=None, avoid=()) == replace(CALL, resume=Resume((104, 101), text_chars=2))
    assert resumed.avoid == ("r1",) and clock() == 104.5
    assert stalled.cancelled and not hedge.cancelled
    assert events == [("hedge", "primary")] and caller.hedges.won == 1
    b = breaker_of(caller, "primary")
    assert (b["calls"], b["failures"]) == (1, 0)  # the hedge's stream succeeded; the stalled one lost the race


async def test_a_stream_whose_hedge_fails_waits_for_its_own_replica() -> None:
    slow = FakeStream(piece("a", [1]), FakeResponse(3, result=ModelChunk("b", (2,))), replica="r1")
    broken = FakeStream(FakeResponse(0.5, error=RuntimeError("boom")), replica="r2")
    primary = FakeHandle(streams=(slow, broken))
    caller, clock, _, events = make(primary, hedge=HEDGE)
    learned(caller)
    opened = await caller.stream(spec(clock))
    assert [c.text for c in await collect(opened.chunks)] == ["a", "b"]
    assert clock() == 104 and broken.cancelled and not slow.cancelled
    assert caller.backends[0].failed == {"model_error": 1}  # the hedge's failure is counted as what it is
    assert caller.hedges.in_flight == 0


async def test_an_unhedged_stream_whose_replica_goes_silent_mid_way_is_carried_on_elsewhere() -> None:
    stalled = FakeStream(piece("he", [104, 101]), FakeResponse(HANG), replica="r1")
    resumed = FakeStream(piece("llo", [108, 108, 111]), replica="r2")
    primary = FakeHandle(streams=(stalled, resumed))
    replicas = FakeReplicas()
    caller, clock, _, events = make(primary, replicas=replicas)
    opened = await caller.stream(spec(clock, hedge=False))
    chunks = opened.chunks
    assert (await chunks.__anext__()).text == "he"  # t=101
    # r1's heartbeat stops: at the first look, a quarter of silent_after_s (1 s) after the
    # wait began, the stream is carried on elsewhere from what it delivered.
    replicas.silent_ones.add("r1")
    rest = [c.text async for c in chunks]
    assert rest == ["llo"] and stalled.cancelled
    carried = primary.generate_stream.calls[1]
    assert carried.avoid == ("r1",) and carried.resume == Resume((104, 101), text_chars=2)
    assert clock() == 101 + 1 + 0.025 + 1  # the look at t=102 found r1 silent; the pause; "llo"
    assert events == [("lost", "primary", "migrated")]
    assert caller.backends[0].failed == {"replica_silent": 1}
    assert breaker_of(caller, "primary")["failures"] == 0


async def test_an_attempt_is_given_up_as_soon_as_its_replica_is_found_silent() -> None:
    silent = FakeResponse(HANG, replica="r1")
    primary = FakeHandle(silent, ok("elsewhere"))
    # The wait looks every quarter of silent_after_s (here 0.625 s), not only at the 4 s
    # attempt timeout: a request with a short deadline still has time to be sent again.
    replicas = FakeReplicas(silent_from={"r1": 101.5})  # r1's heartbeat is found stopped from t=101.5 on
    caller, clock, _, events = make(primary, hedge={"silent_after_s": 2.5}, replicas=replicas)
    replicas.clock = clock
    assert await caller.unary(spec(clock, hedge=False, deadline_in_s=5)) == answered("elsewhere")
    # Looks at 100.625 and 101.25 (still beating), 101.875 (silent): given up; the migration
    # pause; the answer 1 s later.
    assert clock() == pytest.approx(101.875 + 0.025 + 1)
    assert silent.cancelled and primary.generate.calls[1].avoid == ("r1",)
    assert events == [("lost", "primary", "migrated")]
    assert caller.backends[0].failed == {"replica_silent": 1}
    assert breaker_of(caller, "primary")["failures"] == 0


async def test_a_replica_still_beating_is_waited_on_to_the_attempt_timeout() -> None:
    slow = FakeResponse(3.5, result=result("late"), replica="r1")
    primary = FakeHandle(slow)
    caller, clock, _, events = make(primary, hedge={"silent_after_s": 2.5}, replicas=FakeReplicas("r9"))
    assert await caller.unary(spec(clock, hedge=False)) == answered("late")
    assert clock() == 103.5 and events == [] and not slow.cancelled  # looked at every 0.625 s: not silent


async def test_no_hedge_when_no_other_replica_is_heard_from_or_the_attempt_is_not_placed() -> None:
    for replica, others in (("r1", 0), (None, 1)):
        hung = FakeResponse(HANG, replica=replica)
        primary = FakeHandle(hung, ok("retried"))
        replicas = FakeReplicas()
        replicas.other_replicas = others  # 0: the model's only replica (a hedge would land on it again)
        caller, clock, _, events = make(primary, hedge=HEDGE, replicas=replicas)
        learned(caller)
        assert await caller.unary(spec(clock)) == answered("retried")
        assert events == [("retry", "primary", "attempt_timeout")] and caller.hedges.sent == 0, (replica, others)


async def test_an_attempt_on_a_models_only_replica_is_not_given_up_when_it_goes_silent() -> None:
    slow = FakeResponse(3.5, result=result("late"), replica="r1")
    replicas = FakeReplicas("r1")
    replicas.other_replicas = 0  # nowhere else to send it: its progress there is kept
    caller, clock, _, events = make(FakeHandle(slow), hedge={"silent_after_s": 2.5}, replicas=replicas)
    assert await caller.unary(spec(clock, hedge=False)) == answered("late")
    assert clock() == 103.5 and events == [] and not slow.cancelled


async def test_a_re_send_after_a_silent_attempt_takes_no_retry_slot() -> None:
    # No retry budget at all: a dead replica's unary re-send would be refused; a silent one's
    # was cancelled, so sending it again adds no load.
    silent = FakeResponse(HANG, replica="r1")
    primary = FakeHandle(silent, ok("elsewhere"))
    caller, clock, _, events = make(
        primary, retry={"budget_ratio": 0, "budget_min_concurrent": 0}, replicas=FakeReplicas("r1")
    )
    assert await caller.unary(spec(clock, hedge=False)) == answered("elsewhere")
    assert events == [("lost", "primary", "migrated")] and caller.budget.retries_denied == 0
