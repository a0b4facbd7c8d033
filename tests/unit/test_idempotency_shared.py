"""Idempotency keys across routers: ballast.policies.idempotency.KeyTable tick by tick, and two
routers' IdempotencyStores sharing one key service (the actor's own body, called
in-process through FakeActorHandle: Ray's actor call is what is faked)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeClock
from test_idempotency import Counted, settle, spawn

from ballast.config import IdempotencySettings
from ballast.control.keys import KeyService
from ballast.errors import ConcurrencyLimited, DeadlineExceeded, InvalidRequest
from ballast.policies.idempotency import DONE, FULL, MINE, RUNNING, KeyTable
from ballast.router.idempotency import SETTLE_ATTEMPTS, IdempotencyStore, SharedKeys

S = ("gold", "k1")


def table(ttl_s: float = 60, max_entries: int = 10, per_tenant: int = 10, bytes_per_tenant: int = 1 << 20) -> KeyTable:
    return KeyTable(ttl_s, max_entries, per_tenant, bytes_per_tenant)


# -- the table ------------------------------------------------------------------------


def test_the_first_claim_wins_and_the_others_wait_for_its_answer() -> None:
    t = table()
    assert t.claim(S, "a", lease_s=5, now_s=0).state == MINE
    assert t.claim(S, "b", lease_s=5, now_s=1).state == RUNNING
    assert t.claim(S, "a", lease_s=5, now_s=1).state == MINE  # its own claim, still
    assert t.complete(S, "b", {"text": "no"}, now_s=2) is False  # not b's to complete
    assert t.complete(S, "a", {"text": "x"}, now_s=2) is True
    c = t.claim(S, "b", lease_s=5, now_s=3)
    assert (c.state, c.owner, c.result) == (DONE, "a", {"text": "x"})
    assert t.claim(("free", "k1"), "b", lease_s=5, now_s=3).state == MINE  # keys are per tenant


def test_a_failed_attempt_frees_the_key_for_the_retry() -> None:
    t = table()
    t.claim(S, "a", 5, 0)
    assert t.release(S, "b", 1) is False and t.peek(S, 1).state == RUNNING
    assert t.release(S, "a", 1) is True and t.peek(S, 1) is None
    assert t.claim(S, "b", 5, 2).state == MINE


def test_a_lease_that_runs_out_frees_the_key_second_by_second() -> None:
    t = table()
    t.claim(S, "a", lease_s=3, now_s=0)  # a's router dies with the request
    for now in (1, 2):
        assert t.claim(S, "b", 3, now).state == RUNNING, now
    assert t.claim(S, "b", 3, now_s=3).state == MINE
    assert t.complete(S, "a", {"text": "late"}, now_s=4) is False  # a lost it


def test_answers_are_kept_ttl_s_after_they_complete() -> None:
    t = table(ttl_s=10)
    t.claim(S, "a", 5, 0)
    t.complete(S, "a", {"text": "x"}, 4)
    assert t.peek(S, 14).state == DONE
    assert t.peek(S, 14.5) is None


def test_the_table_is_bounded_finished_answers_evicted_claims_never() -> None:
    t = table(ttl_s=600, max_entries=3)
    t.claim(("t", "running"), "a", 60, 0)
    t.claim(("t", "done"), "a", 60, 1)
    t.complete(("t", "done"), "a", {"text": "x"}, 1)
    t.claim(("t", "c"), "a", 60, 2)
    t.claim(("t", "d"), "a", 60, 3)  # full: the finished one goes, not the older claim
    assert len(t) == 3 and t.peek(("t", "done"), 3) is None and t.peek(("t", "running"), 3) is not None
    assert t.claim(("t", "e"), "a", 60, 4).state == FULL  # no finished one left: refused
    assert len(t) == 3 and t.peek(("t", "running"), 4).state == RUNNING
    assert t.claim(("t", "e"), "a", 60, 60).state == MINE  # the leases ran out: room again


def test_a_tenants_flood_of_keys_evicts_only_its_own_answers() -> None:
    t = table(ttl_s=600, max_entries=10_000, per_tenant=100)
    t.claim(("quiet", "q"), "a", 60, 0)
    t.complete(("quiet", "q"), "a", {"text": "mine"}, 0)
    for i in range(10_000):
        assert t.claim(("loud", f"k{i}"), "a", 60, 1).state == MINE
        t.complete(("loud", f"k{i}"), "a", {"text": "x"}, 1)
    assert len(t) == 101 and t.peek(("quiet", "q"), 1).result == {"text": "mine"}


def test_a_tenant_whose_claims_all_run_is_full_the_others_are_not() -> None:
    t = table(per_tenant=2)
    t.claim(("loud", "a"), "r", 60, 0)
    t.claim(("loud", "b"), "r", 60, 0)
    assert t.claim(("loud", "c"), "r", 60, 0).state == FULL
    assert t.claim(("quiet", "c"), "r", 60, 0).state == MINE
    assert t.peek(("loud", "a"), 0).state == RUNNING  # none evicted


def test_a_tenants_answers_are_bounded_in_bytes_an_answer_alone_over_frees_its_key() -> None:
    t = table(bytes_per_tenant=40)
    for key in ("a", "b"):
        t.claim(("loud", key), "r", 60, 0)
        assert t.complete(("loud", key), "r", {"text": "x" * 10}, 0)  # 21 bytes as JSON
    assert t.peek(("loud", "a"), 0) is None and t.peek(("loud", "b"), 0).state == DONE
    t.claim(("loud", "big"), "r", 60, 0)
    assert t.complete(("loud", "big"), "r", {"text": "x" * 100}, 0)
    assert t.peek(("loud", "big"), 0) is None  # not kept: the next claim runs it again


def test_every_claim_carries_the_first_requests_fingerprint() -> None:
    t = table()
    assert t.claim(S, "a", 5, 0, "long").fingerprint == "long"
    running = t.claim(S, "b", 5, 1, "short")
    assert (running.state, running.fingerprint) == (RUNNING, "long")
    t.complete(S, "a", {"text": "x"}, 2)
    assert (t.claim(S, "b", 5, 3, "short").fingerprint, t.peek(S, 3).fingerprint) == ("long", "long")


def test_a_claim_into_a_full_table_visits_a_bounded_number_of_entries() -> None:
    """10,000 live keys, half of them claims still running: each new claim looks at the
    head of the finish order and of the lease heap and evicts one answer, however many
    keys are held (the table used to sweep all of them per claim when full)."""
    n = 10_000
    t = table(ttl_s=600, max_entries=n, per_tenant=n)
    for i in range(n // 2):
        t.claim(("t", f"run{i}"), "a", 60, 0)
        t.claim(("t", f"done{i}"), "a", 60, 0)
        t.complete(("t", f"done{i}"), "a", {"text": "x"}, 0)
    costs = []
    for i in range(100):
        before = t.visited
        assert t.claim(("t", f"new{i}"), "a", 60, 1).state == MINE
        costs.append(t.visited - before)
    assert len(t) == n and max(costs) <= 2


@pytest.mark.parametrize(
    ("kw", "field"), [({"ttl_s": 0, "max_entries": 1}, "ttl_s"), ({"ttl_s": 1, "max_entries": 0}, "max_entries")]
)
def test_bad_settings_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KeyTable(max_entries_per_tenant=1, max_answer_bytes_per_tenant=1, **kw)


# -- two routers over one key service -----------------------------------------------------


class FakeActorHandle:
    """Stands in for a Ray actor handle: ``handle.method.remote(*a)`` runs the service's
    coroutine in this loop (``down`` makes every call fail, as an unreachable actor)."""

    def __init__(self, service: KeyService) -> None:
        self.service = service
        self.down = False
        self.calls: list[str] = []
        # method -> how many of its next calls fail: "drop" never reaches the service,
        # "late" runs there but its reply is lost (the caller's timeout fired first).
        self.drop: dict[str, int] = {}
        self.late: dict[str, int] = {}

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _M:
            @staticmethod
            def remote(*args: Any) -> Any:
                handle.calls.append(method)
                if handle.down or handle.drop.get(method, 0) > 0:
                    handle.drop[method] = handle.drop.get(method, 1) - 1
                    raise ConnectionError("actor unreachable")
                call = asyncio.ensure_future(getattr(handle.service, method)(*args))
                if handle.late.get(method, 0) > 0:
                    handle.late[method] -= 1
                    return _reply_lost(call)
                return call

        return _M()


async def _reply_lost(call: asyncio.Future[Any]) -> Any:
    await call  # the table did it ...
    raise asyncio.TimeoutError()  # ... but the caller never heard


def routers(clock: FakeClock, **shared_settings: int) -> tuple[IdempotencyStore, IdempotencyStore, FakeActorHandle]:
    actor = FakeActorHandle(KeyService(IdempotencySettings(ttl_s=60, max_entries=100, **shared_settings), clock=clock))
    settings = IdempotencySettings(ttl_s=60, max_entries=100)
    a = IdempotencyStore(settings, clock=clock, shared=SharedKeys(lambda: actor, "router-a"))
    b = IdempotencyStore(settings, clock=clock, shared=SharedKeys(lambda: actor, "router-b"))
    return a, b, actor


async def test_a_retry_through_another_router_gets_the_first_answer_once_generated() -> None:
    clock = FakeClock()
    a, b, _ = routers(clock)
    gate = asyncio.Event()
    first, second = Counted(gate), Counted()
    ta = spawn(a.run("gold", "k1", first, within_s=30))
    await settle()
    tb = spawn(b.run("gold", "k1", second, within_s=30))  # the client retried elsewhere
    await settle()
    assert (first.calls, second.calls) == (1, 0)  # b waits for a's attempt
    gate.set()
    assert await ta == ({"text": "answer 1"}, False)
    assert await tb == ({"text": "answer 1"}, True)
    assert second.calls == 0
    # Later repeats at b are served from the shared answer, then from b's own store.
    assert await b.run("gold", "k1", Counted(), within_s=30) == ({"text": "answer 1"}, True)


async def test_a_typed_answer_reaches_the_other_router_as_it_was_given() -> None:
    # The table keeps the router's answer (pipeline.Settled) whole: a claim is a typed
    # message, not a dict made of it (asdict would have turned the answer into a dict).
    from ballast.router.answered import Settled

    clock = FakeClock()
    a, b, actor = routers(clock)
    answer = Settled("answered", 2, "length", fallback=None, model="m")

    async def first() -> Settled:
        return answer

    assert await a.run("gold", "k1", first, within_s=30) == (answer, False)
    await settle()  # the answer reaches the table after the client has it
    claim = await actor.service.claim("gold", "k1", "router-c", 5.0, "")
    assert claim.state == DONE and claim.result == answer and isinstance(claim.result, Settled)
    replayed, was_replay = await b.run("gold", "k1", Counted(), within_s=30)
    assert was_replay and replayed == answer and isinstance(replayed, Settled)


async def test_when_the_first_attempt_fails_the_retry_elsewhere_runs_for_real() -> None:
    clock = FakeClock()
    a, b, _ = routers(clock)
    gate = asyncio.Event()
    first = Counted(gate, fail=RuntimeError("model down"))
    ta = spawn(a.run("gold", "k1", first, within_s=30))
    await settle()
    second = Counted()
    tb = spawn(b.run("gold", "k1", second, within_s=30))
    await settle()
    gate.set()
    with pytest.raises(RuntimeError):
        await ta
    assert await tb == ({"text": "answer 1"}, False) and second.calls == 1


async def test_an_unreachable_key_service_leaves_each_router_honouring_keys_alone() -> None:
    clock = FakeClock()
    a, b, actor = routers(clock)
    actor.down = True
    assert await a.run("gold", "k1", Counted(), within_s=30) == ({"text": "answer 1"}, False)
    assert await a.run("gold", "k1", Counted(), within_s=30) == ({"text": "answer 1"}, True)  # a's own store
    await settle()
    assert a._shared.unreachable == 2 * SETTLE_ATTEMPTS  # the claim, then the answer, each tried 3 times


async def test_an_answer_the_table_missed_is_handed_to_it_again_and_a_retry_elsewhere_gets_it() -> None:
    clock = FakeClock()
    a, b, actor = routers(clock)
    gate = asyncio.Event()
    actor.drop["complete"] = 1  # a's answer does not reach the table the first time
    ta = spawn(a.run("gold", "k1", Counted(gate), within_s=30))
    await settle()
    second = Counted()
    tb = spawn(b.run("gold", "k1", second, within_s=30))
    await settle()
    gate.set()
    assert await ta == ({"text": "answer 1"}, False)
    assert await tb == ({"text": "answer 1"}, True) and second.calls == 0
    assert actor.calls.count("complete") == 2


async def test_a_claim_whose_reply_was_lost_is_settled_so_a_retry_elsewhere_is_not_stranded() -> None:
    clock = FakeClock()
    a, b, actor = routers(clock)
    gate = asyncio.Event()
    actor.late["claim"] = 1  # the table gives a the claim, a's call times out
    ta = spawn(a.run("gold", "k1", Counted(gate), within_s=30))
    await settle()
    second = Counted()
    tb = spawn(b.run("gold", "k1", second, within_s=30))
    await settle()
    assert second.calls == 0  # b sees a's claim in the table and waits for it
    gate.set()
    assert await ta == ({"text": "answer 1"}, False)  # a ran it alone ...
    assert await tb == ({"text": "answer 1"}, True)  # ... and its answer reached the table


async def test_a_retry_waits_no_longer_than_its_deadline() -> None:
    clock = FakeClock()
    a, b, _ = routers(clock)
    gate = asyncio.Event()
    ta = spawn(a.run("gold", "k1", Counted(gate), within_s=30))
    await settle()
    with pytest.raises(DeadlineExceeded):
        await b.run("gold", "k1", Counted(), within_s=0)
    gate.set()
    await ta


async def test_two_routers_whose_claims_got_no_reply_ask_again_and_only_one_runs() -> None:
    # A loaded host: both routers' first claims reach the table but their replies come
    # too late. Each asks again (the same owner's repeat is still its claim): the first
    # claim's owner runs the request, the other waits for its answer.
    clock = FakeClock()
    a, b, actor = routers(clock)
    gate = asyncio.Event()
    actor.late["claim"] = 2
    first, second = Counted(gate), Counted()
    ta = spawn(a.run("gold", "k1", first, within_s=30))
    await settle()
    tb = spawn(b.run("gold", "k1", second, within_s=30))
    await settle()
    gate.set()
    assert await ta == ({"text": "answer 1"}, False)
    assert await tb == ({"text": "answer 1"}, True)
    assert (first.calls, second.calls) == (1, 0)
    assert actor.calls.count("claim") == 4  # each router's lost claim and its repeat


async def test_the_same_key_for_another_request_at_another_router_is_refused() -> None:
    clock = FakeClock()
    a, b, _ = routers(clock)
    gate = asyncio.Event()
    ta = spawn(a.run("gold", "k1", Counted(gate), within_s=30, fingerprint="long"))
    await settle()
    other = Counted()
    with pytest.raises(InvalidRequest):  # running at a
        await b.run("gold", "k1", other, within_s=30, fingerprint="short")
    gate.set()
    await ta
    with pytest.raises(InvalidRequest):  # answered at a
        await b.run("gold", "k1", other, within_s=30, fingerprint="short")
    assert other.calls == 0 and len(b) == 0  # b holds nothing of it
    assert await b.run("gold", "k1", other, within_s=30, fingerprint="long") == ({"text": "answer 1"}, True)


async def test_a_tenant_whose_keys_all_run_across_routers_is_refused_and_its_key_freed() -> None:
    clock = FakeClock()
    a, b, _ = routers(clock, max_entries_per_tenant=1)
    gate = asyncio.Event()
    ta = spawn(a.run("gold", "k1", Counted(gate), within_s=30))
    await settle()
    refused = Counted()
    with pytest.raises(ConcurrencyLimited):
        await b.run("gold", "k2", refused, within_s=30)
    assert refused.calls == 0 and len(b) == 0
    assert await b.run("free", "k2", Counted(), within_s=30) == ({"text": "answer 1"}, False)
    gate.set()
    await ta
    assert (await b.run("gold", "k2", Counted(), within_s=30))[1] is False  # a's answer made room
