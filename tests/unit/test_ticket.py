"""The admission ticket (ballast/router/ticket.py): everything given back exactly once."""

from __future__ import annotations

from fakes import FakeClock

from ballast.policies.deadline import Deadline
from ballast.policies.limiter import AimdLimit, LimiterConfig
from ballast.policies.quota import TokenBucket
from ballast.router.accounts import Outcome
from ballast.router.gate import GateSlot, PriorityGate
from ballast.router.ticket import Charge, TenantPlaces, Ticket


class Seen:
    """The ticket's ``Accounts`` as far as a ticket uses them: each settlement recorded
    (the ticket's tenant, the outcome's code) in ``seen``."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def settled(self, ticket: Ticket, outcome: Outcome) -> None:
        self.seen.append((ticket.tenant, outcome.code))


NO_CHARGE = Charge(None, 0, 0)


def make(places: TenantPlaces, seen: list, charge: Charge = NO_CHARGE, slot: GateSlot = None) -> Ticket:
    assert places.take("gold", cap=4)
    return Ticket(
        "gold",
        "critical",
        Deadline(0.0, 10.0),
        places,
        charge,
        slot or GateSlot(None),
        False,
        Seen(seen),
    )


def test_the_tenant_place_is_given_back_once() -> None:
    places = TenantPlaces()
    seen: list = []
    t = make(places, seen)
    assert places.held == {"gold": 1}
    assert t.finish(Outcome("OK", generated=5))
    assert not t.finish(Outcome("INTERNAL"))  # a second settlement does nothing
    assert places.held == {"gold": 0} and seen == [("gold", "OK")]
    assert t.outcome.code == "OK"


def test_a_tenant_at_its_cap_gets_no_place() -> None:
    places = TenantPlaces()
    assert places.take("gold", cap=2) and places.take("gold", cap=2)
    assert not places.take("gold", cap=2) and places.held == {"gold": 2}
    places.give_back("gold")
    assert places.take("gold", cap=2)


def test_quota_settles_to_the_tokens_used() -> None:
    bucket = TokenBucket(0.0, 100.0, clock=FakeClock(0))  # no refill: every token is visible
    assert bucket.try_charge(40)  # the estimate: prompt + max_tokens
    t = make(TenantPlaces(), [], Charge(bucket, cost=40, prompt_tokens=8))
    t.finish(Outcome("OK", generated=12))  # used 8 + 12 = 20: 20 back
    assert bucket.tokens == 80
    assert bucket.try_charge(10)
    over = make(TenantPlaces(), [], Charge(bucket, cost=10, prompt_tokens=8))
    over.finish(Outcome("OK", generated=12))  # used 20 > 10: 10 more charged
    assert bucket.tokens == 60


def test_a_failed_or_replayed_request_uses_no_quota() -> None:
    bucket = TokenBucket(0.0, 100.0, clock=FakeClock(0))
    for outcome in (Outcome("MODEL_UNAVAILABLE", error=True), Outcome("OK", generated=None), Outcome("CANCELLED")):
        assert bucket.try_charge(30)
        t = make(TenantPlaces(), [], Charge(bucket, cost=30, prompt_tokens=4))
        t.finish(outcome)
        assert bucket.tokens == 100, outcome


async def test_the_gate_slot_goes_back_with_its_sample_once() -> None:
    gate = PriorityGate(
        AimdLimit(LimiterConfig(initial=1, min_limit=1, max_limit=4)), max_waiting=4, max_wait_s=1.0, clock=FakeClock(0)
    )
    await gate.acquire(0, 10.0)
    assert gate.in_flight == 1
    t = make(TenantPlaces(), [], slot=GateSlot(gate))
    t.finish(Outcome("OK", generated=3, service_s=0.5))
    t.finish(Outcome("OK", generated=3, service_s=0.5))
    assert gate.in_flight == 0 and gate.served == 1
