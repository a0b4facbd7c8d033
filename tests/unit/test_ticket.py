"""The admission ticket (serve_app/router/ticket.py): everything given back exactly once."""

from __future__ import annotations

import gc

from fakes import FakeClock

from policies.deadline import Deadline
from policies.limiter import AimdLimit, LimiterConfig
from policies.quota import TokenBucket
from serve_app.router.gate import GateSlot, PriorityGate
from serve_app.router.ticket import Outcome, Ticket


def make(inflight: dict[str, int], seen: list):
    return Ticket("gold", "critical", Deadline(0.0, 10.0), inflight, lambda t, o: seen.append((t.tenant, o.code)))


def test_the_tenant_place_is_taken_at_once_and_given_back_once() -> None:
    inflight: dict[str, int] = {}
    seen: list = []
    t = make(inflight, seen)
    assert inflight == {"gold": 1}
    assert t.finish(Outcome("OK", generated=5))
    assert not t.finish(Outcome("INTERNAL"))  # a second settlement does nothing
    assert inflight == {"gold": 0} and seen == [("gold", "OK")]
    assert t.outcome.code == "OK"


def test_quota_settles_to_the_tokens_used() -> None:
    clock = FakeClock(0)
    bucket = TokenBucket(0.0, 100.0, clock=clock)  # no refill: every token is visible
    inflight: dict[str, int] = {}
    t = make(inflight, [])
    assert t.charge(bucket, cost=40, prompt_tokens=8)  # the estimate: prompt + max_tokens
    assert bucket.tokens == 60
    t.finish(Outcome("OK", generated=12))  # used 8 + 12 = 20: 20 back
    assert bucket.tokens == 80
    over = make(inflight, [])
    assert over.charge(bucket, cost=10, prompt_tokens=8)
    over.finish(Outcome("OK", generated=12))  # used 20 > 10: 10 more charged
    assert bucket.tokens == 60
    refused = make(inflight, [])
    assert not refused.charge(bucket, cost=61, prompt_tokens=1)  # cannot cover it: nothing charged
    refused.refuse("QUOTA_EXCEEDED")
    assert bucket.tokens == 60 and inflight == {"gold": 0}
    assert refused.outcome == Outcome("QUOTA_EXCEEDED", model_called=False)


def test_a_failed_or_replayed_request_uses_no_quota() -> None:
    bucket = TokenBucket(0.0, 100.0, clock=FakeClock(0))
    for outcome in (Outcome("MODEL_UNAVAILABLE", error=True), Outcome("OK", generated=None), Outcome("CANCELLED")):
        t = make({}, [])
        t.charge(bucket, cost=30, prompt_tokens=4)
        t.finish(outcome)
        assert bucket.tokens == 100, outcome


async def test_the_gate_slot_goes_back_with_its_sample_once() -> None:
    clock = FakeClock(0)
    gate = PriorityGate(AimdLimit(LimiterConfig(initial=1, min_limit=1, max_limit=4)), max_waiting=4, max_wait_s=1.0, clock=clock)
    await gate.acquire(0, 10.0)
    assert gate.in_flight == 1
    t = make({}, [])
    t.slot = GateSlot(gate)
    t.finish(Outcome("OK", generated=3, service_s=0.5))
    t.finish(Outcome("OK", generated=3, service_s=0.5))
    assert gate.in_flight == 0 and gate.served == 1


def test_a_ticket_dropped_unfinished_settles_as_cancelled() -> None:
    # A streaming response whose generator never started: its ticket is collected.
    bucket = TokenBucket(0.0, 100.0, clock=FakeClock(0))
    inflight: dict[str, int] = {}
    seen: list = []
    t = make(inflight, seen)
    t.charge(bucket, cost=30, prompt_tokens=4)
    del t
    gc.collect()
    assert inflight == {"gold": 0} and bucket.tokens == 100 and seen == [("gold", "CANCELLED")]
