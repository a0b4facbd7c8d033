"""The flex tier: OpenAI's ``service_tier`` on the online routes.

Three layers, each on a fake clock advanced in whole seconds (no test sleeps):

* the policy (ballast/policies/flex.py): tiers to classes, the flex deadline, and the
  ``FlexQueue`` walked tick by tick (order by deadline, bounds, expiry);
* the hold (ballast/router/flex.py) on a real event loop: requests held, woken on the
  pump's ticks in deadline order, answered 504 when their time runs out, gone when their
  client leaves;
* the pipeline (ballast/router/pipeline.py) of a real router object (routerkit): a flex
  request at a level that sheds ``sheddable`` is held holding nothing and offered to no
  tally, and answered once the level falls; priority and default map to the tenant's
  classes; the answer says its tier.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import FakeClock, FakeSleep
from routerkit import at_level, build_router, only_lane, routed
from starlette.requests import Request
from test_gate import FakeTimer
from test_resilient_caller import FakeHandle, FakeResponse

from ballast.config import load_config
from ballast.errors import ConcurrencyLimited, DeadlineExceeded, FlexQueueFull, KillSwitchActive, Overloaded
from ballast.model.protocol import ModelCall, ModelResult
from ballast.model.special_tokens import BYTES_TOKENIZER, encode_bytes
from ballast.policies import killswitch
from ballast.policies.criticality import ClaimError, Criticality
from ballast.policies.deadline import REPLICA_LEAD_S, Deadline
from ballast.policies.flex import (
    DEFAULT_FLEX_MAX_WAIT_S,
    NO_TIME,
    QUEUE_FULL,
    TENANT_FULL,
    FlexQueue,
    FlexRefused,
    ServiceTier,
    flex_budget_s,
    refuse_claim_beside,
    tier_class,
)
from ballast.router.answered import Answer
from ballast.router.flex import FlexHold, flex_max_wait_s
from ballast.router.pipeline import Caller, ModelRequest

T0 = 1000

# ------------------------------------------------------------------------ tiers and classes


def test_each_tier_sets_the_class_as_openai_names_it():
    cap = Criticality.CRITICAL_PLUS
    assert tier_class(ServiceTier.FLEX, Criticality.CRITICAL, cap) == (Criticality.SHEDDABLE, False)
    assert tier_class(ServiceTier.PRIORITY, Criticality.CRITICAL, cap) == (cap, False)  # the tenant's cap
    assert tier_class(ServiceTier.PRIORITY, Criticality.CRITICAL, Criticality.SHEDDABLE_PLUS) == (
        Criticality.SHEDDABLE_PLUS,
        False,
    )
    for tier in (ServiceTier.DEFAULT, ServiceTier.AUTO):  # the claim, lowered to the cap as without a tier
        assert tier_class(tier, Criticality.SHEDDABLE, cap) == (Criticality.SHEDDABLE, False)
        assert tier_class(tier, Criticality.CRITICAL, Criticality.SHEDDABLE_PLUS) == (Criticality.SHEDDABLE_PLUS, True)


def test_a_tier_is_parsed_and_answered_as_openai_does():
    assert ServiceTier.parse(None) is ServiceTier.AUTO
    assert ServiceTier.parse("fast") is ServiceTier.PRIORITY  # OpenAI answers "priority" for "fast"
    assert [ServiceTier.parse(t).served.value for t in ("auto", "default", "flex", "priority")] == [
        "default",
        "default",
        "flex",
        "priority",
    ]
    with pytest.raises(ValueError, match="service_tier: 'scale' is not one of auto, default, flex, priority, fast"):
        ServiceTier.parse("scale")


def test_a_tier_that_sets_the_class_takes_no_claim_beside_it():
    for tier in (ServiceTier.FLEX, ServiceTier.PRIORITY):
        for header, body in (("sheddable", None), (None, Criticality.CRITICAL)):
            with pytest.raises(ClaimError) as e:
                refuse_claim_beside(tier, header, body)
            assert e.value.field == "service_tier"
        refuse_claim_beside(tier, None, None)
    refuse_claim_beside(ServiceTier.DEFAULT, "sheddable", Criticality.SHEDDABLE)  # the claim is the class


def test_the_flex_deadline_is_the_clients_up_to_the_flex_maximum():
    assert flex_budget_s(None, 600.0) == 600.0
    assert flex_budget_s(2.5, 600.0) == 2.5
    assert flex_budget_s(900.0, 600.0) == 600.0
    with pytest.raises(ValueError, match="client_timeout_s"):
        flex_budget_s(0.0, 600.0)


def test_the_flex_maximum_is_the_batch_sections():
    cfg = load_config({"batch": {"flex_max_wait_s": 42.0}})
    assert flex_max_wait_s(cfg) == 42.0
    assert flex_max_wait_s(load_config({})) == DEFAULT_FLEX_MAX_WAIT_S == 600.0


# ------------------------------------------------------------------------------- the queue


def queue(max_held: int = 8, clock: FakeClock | None = None) -> FlexQueue:
    return FlexQueue(max_held, clock or FakeClock(T0))


def test_the_queue_names_turns_earliest_deadline_first_then_first_come():
    q = queue()
    a = q.push("a", T0 + 30, 8)
    b = q.push("b", T0 + 10, 8)
    c = q.push("c", T0 + 20, 8)
    d = q.push("d", T0 + 10, 8)  # b's deadline, later: after b
    assert q.step(room=4).ready == (b, d, c, a)
    assert q.step(room=2).ready == (b, d)  # named, not taken: they stay until they leave
    assert len(q) == 4
    assert q.step(room=0).ready == () and q.step(room=-1).ready == ()
    assert q.leave(b) and not q.leave(b)
    assert q.step(room=1).ready == (d,)


def test_the_queue_is_bounded_overall_and_per_tenant_and_a_refusal_changes_nothing():
    q = queue(max_held=3)
    q.push("a", T0 + 5, 2)
    q.push("a", T0 + 5, 2)
    with pytest.raises(FlexRefused) as e:
        q.push("a", T0 + 5, 2)
    assert e.value.reason == TENANT_FULL
    q.push("b", T0 + 5, 2)
    with pytest.raises(FlexRefused) as e:
        q.push("c", T0 + 5, 2)
    assert e.value.reason == QUEUE_FULL
    with pytest.raises(FlexRefused) as e:
        queue().push("c", T0, 2)  # must start by now: no time to wait
    assert e.value.reason == NO_TIME
    assert (len(q), q.held_by("a"), q.held_by("b"), q.held_by("c")) == (3, 2, 1, 0)
    assert q.view()["refused"] == {QUEUE_FULL: 1, TENANT_FULL: 1, NO_TIME: 0}
    with pytest.raises(ValueError, match="max_held"):
        FlexQueue(0)


def test_entries_expire_tick_by_tick_at_their_last_instant_to_start():
    clock = FakeClock(T0)
    q = queue(clock=clock)
    one, two_a, two_b, five = (
        q.push("a", T0 + 1, 8),
        q.push("b", T0 + 2, 8),
        q.push("a", T0 + 2, 8),
        q.push("c", T0 + 5, 8),
    )
    step = q.step(room=8)
    assert step.expired == () and step.ready == (one, two_a, two_b, five)
    clock.advance(1)  # T0 + 1: the first one's instant, included
    step = q.step(room=8)
    assert step.expired == (one,) and step.ready == (two_a, two_b, five)
    clock.advance(1)
    step = q.step(room=1)
    assert step.expired == (two_a, two_b) and step.ready == (five,)
    assert (q.held_by("a"), q.held_by("b"), len(q)) == (0, 0, 1)
    assert not q.leave(one)  # taken out by the step already
    clock.advance(2)
    assert q.step(room=0) == q.step(room=0)  # nothing more until T0 + 5
    clock.advance(1)
    assert q.step(room=0).expired == (five,) and len(q) == 0


def test_the_view_says_how_many_are_held_and_since_when():
    clock = FakeClock(T0)
    q = queue(clock=clock)
    assert q.view() == {
        "held": 0,
        "max_held": 8,
        "oldest_held_s": None,
        "refused": dict.fromkeys((QUEUE_FULL, TENANT_FULL, NO_TIME), 0),
    }
    q.push("a", T0 + 60, 8)
    clock.advance(3)
    q.push("b", T0 + 60, 8)
    assert (q.view()["held"], q.view()["oldest_held_s"]) == (2, 3.0)


# -------------------------------------------------------------------------------- the hold


class Room:
    """The model's free slots as a hold sees them; a request that goes takes one."""

    def __init__(self, free: int = 0) -> None:
        self.free = free

    def __call__(self) -> int:
        return self.free


class Rig:
    """A hold on a fake clock: ``advance`` moves the clock (ending the waits it passes),
    ``tick`` lets the pump tick once after a second."""

    def __init__(self, free: int = 0, max_held: int = 8) -> None:
        self.clock = FakeClock(T0)
        self.timer = FakeTimer(self.clock)
        self.sleep = FakeSleep()
        self.room = Room(free)
        self.hold = FlexHold(
            FlexQueue(max_held, self.clock), self.room, 0.5, "m", self.clock, self.timer.wait_for, self.sleep
        )
        self.went: list[str] = []

    async def go(self, tenant: str, start_by_s: float, cap: int = 8) -> float:
        """A request through the hold; when it goes, it takes a slot."""
        held_s = await self.hold.turn(tenant, start_by_s, cap)
        self.room.free -= 1
        self.went.append(tenant)
        return held_s

    def send(self, tenant: str, start_by_s: float, cap: int = 8) -> asyncio.Task[float]:
        return asyncio.create_task(self.go(tenant, start_by_s, cap))

    async def advance(self, seconds: int = 1) -> None:
        await self.timer.advance(seconds)

    async def tick(self) -> None:
        await self.timer.advance(1)
        await self.sleep.wake()


async def test_with_room_and_nothing_held_a_request_goes_at_once():
    rig = Rig(free=1)
    assert await rig.go("a", T0 + 60) == 0.0
    assert rig.went == ["a"] and len(rig.hold.queue) == 0 and rig.sleep.slept_s == []  # no pump


async def test_held_requests_go_as_room_appears_earliest_deadline_first():
    rig = Rig(free=0)
    tasks = [rig.send("a", T0 + 30), rig.send("b", T0 + 10), rig.send("c", T0 + 20)]
    await rig.sleep.settle()
    assert not any(t.done() for t in tasks) and len(rig.hold.queue) == 3
    assert rig.sleep.slept_s == [0.5]  # one pump, ticking on the snapshot interval
    await rig.tick()
    assert rig.went == []  # no room: nobody goes
    rig.room.free = 1
    await rig.tick()
    assert rig.went == ["b"] and len(rig.hold.queue) == 2
    assert await tasks[1] == 2.0  # held two ticks
    await rig.tick()
    assert rig.went == ["b"]  # b took the one slot
    rig.room.free = 2
    await rig.tick()
    assert rig.went == ["b", "c", "a"] and len(rig.hold.queue) == 0
    await rig.sleep.wake()
    assert rig.sleep.parked == 0  # nothing held: the pump has stopped


async def test_a_woken_request_that_finds_the_room_taken_keeps_its_place():
    rig = Rig(free=0)
    first, second = rig.send("a", T0 + 10), rig.send("b", T0 + 20)
    await rig.sleep.settle()
    rig.room.free = 1
    rig.hold.tick()  # a's turn ...
    rig.room.free = 0  # ... but something else takes the slot before a runs
    await rig.sleep.settle()
    assert not first.done() and rig.hold.queue.step(room=2).ready[0].tenant == "a"
    rig.room.free = 1
    await rig.tick()
    assert rig.went == ["a"] and not second.done()
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)


async def test_a_held_request_is_answered_504_when_its_time_to_start_runs_out():
    rig = Rig(free=0)
    task = rig.send("a", T0 + 3)
    await rig.sleep.settle()
    await rig.advance(2)
    assert not task.done()
    await rig.advance(1)
    with pytest.raises(DeadlineExceeded) as e:
        await task
    assert e.value.status == 504 and "held 3.0s for spare capacity of model 'm'" in e.value.message
    assert len(rig.hold.queue) == 0 and rig.hold.view()["expired"] == 1
    rig.hold.close()


async def test_the_pumps_step_expires_a_request_whose_timer_has_not_fired_yet():
    rig = Rig(free=0)
    task = rig.send("a", T0 + 1)
    await rig.sleep.settle()
    rig.clock.advance(1)  # the clock passes its instant; its own timer is not told
    await rig.sleep.wake()  # the pump's tick finds it expired
    with pytest.raises(DeadlineExceeded):
        await task
    assert rig.hold.view()["expired"] == 1 and len(rig.hold.queue) == 0


async def test_a_client_that_leaves_while_held_leaves_the_hold():
    rig = Rig(free=0)
    task = rig.send("a", T0 + 60)
    await rig.sleep.settle()
    assert rig.hold.queue.held_by("a") == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (len(rig.hold.queue), rig.hold.queue.held_by("a"), rig.hold._wakes) == (0, 0, {})
    rig.room.free = 1
    await rig.tick()
    assert rig.went == []


async def test_the_holds_refusals_are_typed_errors_with_their_status():
    rig = Rig(free=0, max_held=3)
    held = [rig.send("a", T0 + 60, cap=1), rig.send("b", T0 + 60)]
    await rig.sleep.settle()
    with pytest.raises(ConcurrencyLimited) as tenant_full:
        await rig.go("a", T0 + 60, cap=1)
    held.append(rig.send("c", T0 + 60))
    await rig.sleep.settle()
    with pytest.raises(FlexQueueFull) as full:
        await rig.go("d", T0 + 60)
    assert (tenant_full.value.status, full.value.status, full.value.code) == (429, 503, "FLEX_QUEUE_FULL")
    assert full.value.retry_after_s == 1.0
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    with pytest.raises(DeadlineExceeded):
        await rig.go("a", T0)  # nothing left to wait with
    rig.hold.close()


# ---------------------------------------------------------------------------- the pipeline

PROMPT = "hello"  # 5 prompt tokens (bytes)
CALL = ModelCall(PROMPT, tuple(encode_bytes(PROMPT)), BYTES_TOKENIZER)
CFG = {
    "tenants": {
        "gold": {"rate_tokens_per_s": 0.001, "burst_tokens": 1000, "max_concurrent": 2},
        "capped": {"max_criticality": "sheddable_plus"},
    },
    "auth": {"demo_keys": {"dev-key-gold": "gold", "dev-key-capped": "capped"}},
    "resilience": {"gate": {"initial_limit": 1, "min_limit": 1, "max_limit": 1, "critical_reserve_ratio": 0}},
}


def reply(tokens: int) -> FakeResponse:
    return FakeResponse(0, result=ModelResult("x" * tokens, tokens, None))


class Flexed:
    """A real router at a level that sheds ``sheddable``, its hold on a fake clock that
    starts at the event loop's time (the model call's deadline is read on the real one)."""

    def __init__(self) -> None:
        self.router = build_router(CFG, FakeHandle())
        at_level(self.router, 1)
        self.pipeline = self.router.pipeline
        self.lane = only_lane(self.pipeline)
        self.clock = FakeClock(int(asyncio.get_running_loop().time()))
        self.timer, self.sleep = FakeTimer(self.clock), FakeSleep()
        self.hold = self.pipeline.holds[self.lane.name] = self.pipeline.flex_hold(
            self.lane, self.clock, self.timer.wait_for, self.sleep
        )

    def request(self, tier: ServiceTier, tenant: str = "gold", timeout_s: float | None = None) -> ModelRequest:
        caller = Caller(tenant, Deadline.starting(self.clock(), 30), timeout_s=timeout_s)
        return ModelRequest(caller, Criticality.CRITICAL, 20, False, CALL, tier)

    def answers(self, *tokens: int) -> None:
        self.lane.caller.backends[0].handle.generate.script.extend(reply(n) for n in tokens)

    async def tick(self, seconds: int = 1) -> None:
        await self.timer.advance(seconds)
        await self.sleep.wake()


@pytest.fixture()
async def flexed():
    f = Flexed()
    yield f
    f.hold.close()


async def test_a_flex_request_is_held_holding_nothing_and_answered_when_the_level_falls(flexed):
    p, lane = flexed.pipeline, flexed.lane
    bucket = p.quotas.buckets["gold"].tokens
    task = asyncio.create_task(p.serve(flexed.request(ServiceTier.FLEX)))
    await flexed.sleep.settle()
    assert not task.done() and p.status()["models"][lane.name]["flex"]["held"] == 1
    # Held, it holds nothing and is no demand: no place, quota, gate slot, nothing offered.
    assert (p.places.held.get("gold", 0), lane.gate.in_flight, lane.gate.waiting) == (0, 0, 0)
    assert p.quotas.buckets["gold"].tokens == bucket and lane.tally.offered == {} and lane.tally.shed == 0
    await flexed.tick(5)
    assert not task.done()  # still level 1
    flexed.answers(7)
    at_level(flexed.router, 0)
    await flexed.tick()
    answer = await task
    assert isinstance(answer, Answer) and answer.settled.tokens == 7
    a = answer.admission
    assert (a.tier, a.criticality, a.meta("m")["service_tier"]) == (ServiceTier.FLEX, Criticality.SHEDDABLE, "flex")
    assert lane.tally.offered == {"sheddable": 1}  # counted once it ran, as any request
    assert (p.places.held.get("gold", 0), lane.gate.in_flight) == (0, 0)
    assert p.status()["models"][lane.name]["flex"]["held"] == 0


async def test_a_flex_request_waits_for_a_free_gate_slot_at_level_0(flexed):
    p, lane = flexed.pipeline, flexed.lane
    at_level(flexed.router, 0)
    await lane.gate.acquire(0, flexed.clock() + 60)  # the gate's one slot is taken
    task = asyncio.create_task(p.serve(flexed.request(ServiceTier.FLEX)))
    await flexed.tick()
    assert not task.done() and lane.gate.waiting == 0  # held here, not in the gate's line
    flexed.answers(3)
    lane.gate.release(None)
    await flexed.tick()
    assert (await task).settled.tokens == 3


async def test_a_flex_request_past_its_deadline_is_answered_504_and_counted_nowhere_in_the_level(flexed):
    p, lane = flexed.pipeline, flexed.lane
    task = asyncio.create_task(p.serve(flexed.request(ServiceTier.FLEX, timeout_s=2.0)))
    await flexed.sleep.settle()
    await flexed.tick()
    assert not task.done()
    await flexed.timer.advance(1)  # its deadline (2 s) less the replica's lead: no time left to start
    with pytest.raises(DeadlineExceeded):
        await task
    assert lane.tally.offered == {} and lane.tally.shed == 0 and p.places.held.get("gold", 0) == 0


async def test_the_flex_deadline_may_pass_the_online_maximum_up_to_the_flex_one(flexed):
    """X-Request-Timeout-Ms of 900 s: an online request gets resilience.max_deadline_s (120 s),
    a flex one the flex maximum (600 s); its last instant to start is that less the
    replica's lead and the gate's expected service time (0 before any sample)."""
    p = flexed.pipeline
    task = asyncio.create_task(p.serve(flexed.request(ServiceTier.FLEX, timeout_s=900.0)))
    await flexed.sleep.settle()
    (held,) = flexed.hold.queue.step(room=1).ready
    assert held.start_by_s == pytest.approx(flexed.clock() + DEFAULT_FLEX_MAX_WAIT_S - REPLICA_LEAD_S)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_identify_keeps_the_clients_timeout_for_a_flex_deadline():
    """The online deadline is capped by resilience.max_deadline_s; the client's own timeout is
    kept beside it, for a flex request's deadline."""
    pipeline = build_router(CFG, FakeHandle()).pipeline

    def caller(*headers: tuple[bytes, bytes]) -> Caller:
        scope = {"type": "http", "headers": [(b"authorization", b"Bearer dev-key-gold"), *headers]}
        return pipeline.identify(Request(scope))

    long = caller((b"x-request-timeout-ms", b"900000"))
    assert long.timeout_s == 900.0
    assert long.deadline.budget_s == pytest.approx(120.0)  # the online cap: resilience.max_deadline_s
    plain = caller()
    assert plain.timeout_s is None and plain.deadline.budget_s == pytest.approx(30.0)


async def test_a_kill_switch_refuses_a_flex_request_at_once(flexed):
    p = flexed.pipeline
    now_s = time.time()
    p.kill_switches = [killswitch.KillSwitchEntry("ks-1", "criticality", "sheddable", "test", "op", now_s, now_s + 60)]
    with pytest.raises(KillSwitchActive):
        await p.serve(flexed.request(ServiceTier.FLEX))
    assert len(flexed.hold.queue) == 0


async def test_priority_is_the_tenants_cap_and_default_the_claim(flexed):
    p = flexed.pipeline
    at_level(flexed.router, 2)  # admits critical and up
    flexed.answers(1, 1)
    priority = await p.serve(flexed.request(ServiceTier.PRIORITY))  # gold's cap: critical
    assert (priority.admission.criticality, priority.admission.tier) == (Criticality.CRITICAL, ServiceTier.PRIORITY)
    capped = flexed.request(ServiceTier.PRIORITY, tenant="capped")  # its cap, sheddable_plus, is shed at level 2
    with pytest.raises(Overloaded):
        await p.serve(capped)
    default = await p.serve(flexed.request(ServiceTier.AUTO))
    assert (default.admission.criticality, default.admission.tier) == (Criticality.CRITICAL, ServiceTier.DEFAULT)


# ------------------------------------------------------------------------------- the routes


def test_the_routes_say_the_tier_and_refuse_a_claim_beside_flex():
    router = build_router(CFG, FakeHandle())
    at_level(router, 0)
    only_lane(router).caller.backends[0].handle.generate.script.extend([reply(2), reply(2), reply(2)])
    gold = {"Authorization": "Bearer dev-key-gold"}
    chat = {"model": "tiny-decoder", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with routed(router) as client:
        flex = client.post("/v1/chat/completions", headers=gold, json={**chat, "service_tier": "flex"})
        assert flex.status_code == 200, flex.text
        assert flex.json()["service_tier"] == "flex" and flex.headers["x-ballast-service-tier"] == "flex"
        assert flex.headers["x-ballast-criticality"] == "sheddable"
        plain = client.post(
            "/v1/completions", headers=gold, json={"model": "tiny-decoder", "prompt": "hi", "max_tokens": 2}
        )
        assert plain.json()["service_tier"] == "default" and plain.headers["x-ballast-service-tier"] == "default"
        native = client.post(
            "/v1/generate", headers=gold, json={"prompt": "hi", "max_tokens": 2, "service_tier": "priority"}
        )
        assert native.json()["service_tier"] == "priority" and native.headers["x-ballast-service-tier"] == "priority"
        beside = client.post(
            "/v1/chat/completions",
            headers={**gold, "X-Ballast-Criticality": "sheddable"},
            json={**chat, "service_tier": "flex"},
        )
        assert beside.status_code == 400 and beside.json()["error"]["param"] == "service_tier"
        scale = client.post("/v1/chat/completions", headers=gold, json={**chat, "service_tier": "scale"})
        assert scale.status_code == 400 and scale.json()["error"]["param"] == "service_tier"
