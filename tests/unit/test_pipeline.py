"""The shared request pipeline (ballast/router/pipeline.py): one acquire gives a whole
ticket or a refusal, and every way out settles it exactly once.

The ``Pipeline`` a real router builds (tests/unit/routerkit.py), driven through its
public face (``serve``, ``acquire``, ``Stream``) with scripted Serve handles. After each
outcome the tenant's places, its token bucket and the gate are checked: what the
request took is back, and the quota holds exactly the tokens it used. Nothing waits
for garbage collection.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import RayTaskError
from routerkit import at_level, build_router, only_lane
from starlette.requests import ClientDisconnect
from test_resilient_caller import FakeHandle, FakeResponse, FakeStream, fails

from ballast.control.snapshot import Snapshot
from ballast.errors import (
    ConcurrencyLimited,
    DeadlineExceeded,
    InvalidRequest,
    ModelUnavailable,
    Overloaded,
    QuotaExceeded,
)
from ballast.model.protocol import BATCH_PRIORITY, ModelCall, ModelChunk, ModelResult
from ballast.model.special_tokens import BYTES_TOKENIZER, encode_bytes
from ballast.names import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT
from ballast.policies.criticality import Criticality
from ballast.policies.deadline import Deadline
from ballast.router.accounts import Outcome
from ballast.router.answered import Answer, Stream
from ballast.router.api import StreamResponse
from ballast.router.pipeline import Caller, ModelRequest

PROMPT = "hello"  # 5 prompt tokens (bytes)
CALL = ModelCall(PROMPT, tuple(encode_bytes(PROMPT)), BYTES_TOKENIZER)  # as the front tokenizes it
CFG = {
    "tenants": {"gold": {"rate_tokens_per_s": 0.001, "burst_tokens": 1000, "max_concurrent": 2}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}},
    "resilience": {"gate": {"initial_limit": 1, "min_limit": 1, "max_limit": 1, "critical_reserve_ratio": 0}},
}


def reply(tokens: int) -> FakeResponse:
    return FakeResponse(0, result=ModelResult("x" * tokens, tokens, None))


def piece(tokens: int) -> FakeResponse:
    """A stream's piece of ``tokens`` tokens."""
    return FakeResponse(0, result=ModelChunk("x" * tokens, tuple(range(tokens))))


@pytest.fixture()
def router():
    r = build_router(CFG, FakeHandle())
    at_level(r, 0)
    return r


@pytest.fixture()
def pipeline(router):
    return router.pipeline


def primary(pipeline) -> FakeHandle:
    return only_lane(pipeline).caller.backends[0].handle


def bucket_tokens(pipeline) -> float:
    return pipeline.quotas.buckets["gold"].tokens


def settled(pipeline, full: float, used: int) -> None:
    """The tenant holds nothing, the gate is free, the bucket is short exactly ``used``."""
    assert pipeline.places.held.get("gold", 0) == 0
    assert only_lane(pipeline).gate.in_flight == 0
    assert bucket_tokens(pipeline) == pytest.approx(full - used, abs=0.01)


def request(
    max_tokens: int = 20, stream: bool = False, key: str | None = None, deadline: Deadline | None = None
) -> ModelRequest:
    caller = Caller("gold", deadline or Deadline.starting(asyncio.get_running_loop().time(), 30), key)
    return ModelRequest(caller, Criticality.CRITICAL, max_tokens, stream, CALL)


async def test_an_answer_settles_the_quota_to_the_tokens_used(pipeline, router) -> None:
    full = bucket_tokens(pipeline)
    primary(pipeline).generate.script.append(reply(7))
    answer = await pipeline.serve(request())
    assert isinstance(answer, Answer)
    assert (answer.settled.tokens, answer.settled.fallback, answer.replayed, answer.admission.max_tokens) == (
        7,
        None,
        False,
        20,
    )
    assert primary(pipeline).generate.calls[0].max_tokens == 20  # the admitted length is sent
    settled(pipeline, full, 5 + 7)
    assert only_lane(router).tally.requests == 1


async def test_the_call_names_the_tenant_its_key_says(pipeline) -> None:
    """The replica shares its grammar compile threads by tenant: every call the pipeline
    sends (unary, with an Idempotency-Key, streamed) names the caller's tenant."""
    handle = primary(pipeline)
    handle.generate.script.extend([reply(2), reply(2)])
    handle.generate_stream.script.append(FakeStream(piece(2)))
    await pipeline.serve(request())
    await pipeline.serve(request(key="key-t"))
    stream = await pipeline.serve(request(stream=True))
    assert isinstance(stream, Stream)
    assert [c.text async for c in stream] == ["xx"]
    await stream.aclose()
    assert [c.tenant for c in handle.generate.calls + handle.generate_stream.calls] == ["gold"] * 3
    assert CALL.tenant == "" and CALL.admitted(5, tenant="gold") == CALL.admitted(5)  # not part of what it asks


async def test_an_admitted_request_holds_its_place_its_estimate_and_a_gate_slot(pipeline) -> None:
    full = bucket_tokens(pipeline)
    admission, ticket = await pipeline.acquire(request())
    assert pipeline.places.held["gold"] == 1 and only_lane(pipeline).gate.in_flight == 1
    assert bucket_tokens(pipeline) == pytest.approx(full - 25, abs=0.01)  # the estimate: 5 + 20
    assert admission.prompt_tokens == 5 and ticket.prompt_tokens == 5
    assert ticket.finish(Outcome("CANCELLED")) and not ticket.finish(Outcome("OK"))
    settled(pipeline, full, 0)


async def test_a_model_error_gives_everything_back(pipeline, router) -> None:
    full = bucket_tokens(pipeline)
    primary(pipeline).generate.script.append(
        fails(RayTaskError("generate", "tb", RuntimeError("cuda error")), takes_s=0)
    )
    with pytest.raises(ModelUnavailable):
        await pipeline.serve(request())
    settled(pipeline, full, 0)
    assert only_lane(router).tally.errors == 1


async def test_the_replicas_deadline_is_a_gate_miss_and_uses_no_quota(pipeline) -> None:
    full = bucket_tokens(pipeline)
    primary(pipeline).generate.script.append(fails(DeadlineExceeded("past its deadline"), takes_s=0))
    with pytest.raises(DeadlineExceeded):
        await pipeline.serve(request())
    settled(pipeline, full, 0)
    assert sum(only_lane(pipeline).gate.snapshot()["misses"].values()) == 1  # the gate learnt of the miss


async def test_a_replay_costs_nothing(pipeline) -> None:
    full = bucket_tokens(pipeline)
    primary(pipeline).generate.script.append(reply(4))
    await pipeline.serve(request(key="key-1"))
    again = await pipeline.serve(request(key="key-1"))
    assert again.replayed and again.settled.tokens == 4
    settled(pipeline, full, 5 + 4)  # only the first answer's tokens
    assert len(primary(pipeline).generate.calls) == 1


class Blocked(FakeResponse):
    """A reply that comes only once the test sets ``go``: the first attempt of a key, running."""

    def __init__(self, tokens: int) -> None:
        super().__init__(0, result=ModelResult("x" * tokens, tokens, None))
        self.go = asyncio.Event()

    def __await__(self):
        yield from self.go.wait().__await__()
        return self.result


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_repeats_of_a_running_key_hold_no_place_quota_or_gate_slot(pipeline, router) -> None:
    full = bucket_tokens(pipeline)
    first_reply = Blocked(7)
    primary(pipeline).generate.script.append(first_reply)
    first = asyncio.ensure_future(pipeline.serve(request(key="key-1")))
    await settle()
    assert (pipeline.places.held["gold"], only_lane(pipeline).gate.in_flight) == (1, 1)
    assert bucket_tokens(pipeline) == pytest.approx(full - 25, abs=0.01)
    repeats = [asyncio.ensure_future(pipeline.serve(request(key="key-1"))) for _ in range(5)]  # the tenant's cap is 2
    await settle()
    assert not any(r.done() for r in repeats)  # waiting for the first ...
    assert (pipeline.places.held["gold"], only_lane(pipeline).gate.in_flight, only_lane(pipeline).gate.waiting) == (
        1,
        1,
        0,
    )  # ... holding nothing
    assert bucket_tokens(pipeline) == pytest.approx(full - 25, abs=0.01)
    first_reply.go.set()
    answers = [await first] + [await r for r in repeats]
    assert [(a.settled.tokens, a.replayed) for a in answers] == [(7, False)] + [(7, True)] * 5
    settled(pipeline, full, 5 + 7)
    assert len(primary(pipeline).generate.calls) == 1
    assert only_lane(router).tally.requests == 1  # repeats asked nothing of the model: not in the level's counts


async def test_a_repeat_waits_no_longer_than_its_own_deadline_and_the_first_goes_on(pipeline) -> None:
    full = bucket_tokens(pipeline)
    first_reply = Blocked(3)
    primary(pipeline).generate.script.append(first_reply)
    first = asyncio.ensure_future(pipeline.serve(request(key="key-1")))
    await settle()
    spent = Deadline.starting(asyncio.get_running_loop().time() - 2, 1)  # its deadline has passed
    with pytest.raises(DeadlineExceeded):
        await pipeline.serve(request(key="key-1", deadline=spent))
    assert not first.done()
    first_reply.go.set()
    assert (await first).settled.tokens == 3
    settled(pipeline, full, 5 + 3)


async def test_the_same_key_with_another_body_is_refused_422(pipeline) -> None:
    full = bucket_tokens(pipeline)
    first_reply = Blocked(3)
    primary(pipeline).generate.script.append(first_reply)
    first = asyncio.ensure_future(pipeline.serve(request(max_tokens=20, key="key-1")))
    await settle()
    with pytest.raises(InvalidRequest) as refused:
        await pipeline.serve(request(max_tokens=1, key="key-1"))
    assert refused.value.field == "Idempotency-Key"
    first_reply.go.set()
    await first
    with pytest.raises(InvalidRequest):  # answered: still another request's key
        await pipeline.serve(request(max_tokens=1, key="key-1"))
    assert (await pipeline.serve(request(max_tokens=20, key="key-1"))).replayed
    settled(pipeline, full, 5 + 3)


async def test_a_first_attempt_refused_at_the_gate_frees_its_key_so_the_retry_runs(pipeline) -> None:
    full = bucket_tokens(pipeline)
    await only_lane(pipeline).gate.acquire(0, asyncio.get_running_loop().time() + 60)  # the one slot is taken
    short = Deadline.starting(asyncio.get_running_loop().time(), 0.001)
    with pytest.raises(Overloaded):
        await pipeline.serve(request(key="key-1", deadline=short))
    only_lane(pipeline).gate.release(None)
    primary(pipeline).generate.script.append(reply(4))
    again = await pipeline.serve(request(key="key-1"))
    assert (again.settled.tokens, again.replayed) == (4, False)
    settled(pipeline, full, 5 + 4)


async def test_over_quota_is_refused_with_nothing_held(pipeline) -> None:
    pipeline.quotas.buckets["gold"].try_charge(bucket_tokens(pipeline) - 10)  # 10 tokens left
    full = bucket_tokens(pipeline)
    with pytest.raises(QuotaExceeded):
        await pipeline.serve(request())
    settled(pipeline, full, 0)


async def test_a_gate_refusal_gives_back_the_place_and_the_charge(pipeline) -> None:
    full = bucket_tokens(pipeline)
    await only_lane(pipeline).gate.acquire(0, asyncio.get_running_loop().time() + 60)  # the one slot is taken
    short = ModelRequest(
        Caller("gold", Deadline.starting(asyncio.get_running_loop().time(), 0.001)),
        Criticality.CRITICAL,
        20,
        False,
        CALL,
    )
    with pytest.raises(Overloaded):
        await pipeline.serve(short)  # no time left to wait for the slot
    only_lane(pipeline).gate.release(None)
    settled(pipeline, full, 0)


async def test_the_tenant_cap_counts_requests_waiting_at_the_gate(pipeline) -> None:
    # The gate's one slot is taken; the tenant's first two requests wait in its line.
    # They count against the tenant's cap (2) while they wait, so a third is refused
    # at once (the cap used to be counted only after the wait).
    full = bucket_tokens(pipeline)
    await only_lane(pipeline).gate.acquire(0, asyncio.get_running_loop().time() + 60)
    waiting = [asyncio.ensure_future(pipeline.serve(request())) for _ in range(2)]
    await asyncio.sleep(0)
    assert pipeline.places.held["gold"] == 2 and only_lane(pipeline).gate.waiting == 2
    with pytest.raises(ConcurrencyLimited):
        await pipeline.serve(request())
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    only_lane(pipeline).gate.release(None)
    settled(pipeline, full, 0)


async def test_a_stream_settles_for_the_tokens_it_produced(pipeline) -> None:
    full = bucket_tokens(pipeline)
    primary(pipeline).generate_stream.script.append(FakeStream(piece(3), piece(2)))
    stream = await pipeline.serve(request(stream=True))
    assert isinstance(stream, Stream)
    chunks = [c async for c in stream]
    assert [c.tokens for c in chunks] == [3, 2] and stream.tokens == 5 and stream.fallback is None
    settled(pipeline, full, 5 + 5)


async def test_a_client_leaving_mid_stream_settles_what_was_produced(pipeline, router) -> None:
    full = bucket_tokens(pipeline)
    primary(pipeline).generate_stream.script.append(FakeStream(piece(3), piece(2), piece(4)))
    stream = await pipeline.serve(request(stream=True))
    chunks = stream.__aiter__()
    assert (await chunks.__anext__()).tokens == 3
    await stream.aclose()  # the client went away
    settled(pipeline, full, 5 + 3)
    assert only_lane(router).tally.requests == 1


async def test_a_stream_that_never_begins_is_settled_by_its_close(pipeline, router) -> None:
    full = bucket_tokens(pipeline)
    stream = await pipeline.serve(request(stream=True))
    assert pipeline.places.held["gold"] == 1
    await stream.aclose()  # the response closes it; nothing was read
    await stream.aclose()  # a second close does nothing
    settled(pipeline, full, 0)
    assert only_lane(router).tally.requests == 1 and primary(pipeline).generate_stream.calls == []


async def test_the_response_closes_a_stream_whose_client_left_before_the_first_event(pipeline) -> None:
    full = bucket_tokens(pipeline)
    stream = await pipeline.serve(request(stream=True))

    async def events():
        async for chunk in stream:
            yield chunk.text.encode()

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")  # before the response could start

    response = StreamResponse(events(), stream)
    with pytest.raises(ClientDisconnect):  # how Starlette says it
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    settled(pipeline, full, 0)


async def test_the_gate_counts_a_request_in_the_report_it_was_decided_in(pipeline, router) -> None:
    # What the edge's throttle learns from: per class, [decided at the gate, let through]
    # since the last report. A request that waits across a report is counted once, when
    # the gate lets it through (it used to count as reached in one report and its
    # admission was lost: the throttle read it as a refusal of a class taken whole).
    primary(pipeline).generate.script.append(reply(1))
    await only_lane(pipeline).gate.acquire(0, asyncio.get_running_loop().time() + 60)
    waiting = asyncio.ensure_future(pipeline.serve(request()))
    await asyncio.sleep(0)
    assert only_lane(pipeline).gate.waiting == 1 and only_lane(router).tally.gate_decided == {}
    router.reporter.report()  # a report: the counts start afresh
    only_lane(pipeline).gate.release(None)
    await waiting
    assert only_lane(router).tally.gate_decided == {"critical": [1, 1]}


# -- fair shares ---------------------------------------------------------------------------

FAIR_CFG = {
    "tenants": {"gold": {"weight": 2.0}, "free": {"weight": 1.0}},
    "auth": {"demo_keys": {"dev-key-gold": "gold", "dev-key-free": "free"}},
    "deployments": {"model": {"max_ongoing_requests": 10}},
    "resilience": {"gate": {"initial_limit": 64, "min_limit": 1, "max_limit": 64}},
}


async def test_an_answer_charges_its_tenant_and_the_reports_carry_it_to_the_controller() -> None:
    """The router's own wiring: an answered request is on its tenant's counter as prompt +
    2 x generated over the weight; the report carries that charge; the controller's reply
    (cluster counters and this router's share of the model) is adopted and sets the
    gate's ceiling."""
    router = build_router(FAIR_CFG, FakeHandle())
    at_level(router, 0)
    pipeline = router.pipeline
    primary(pipeline).generate.script.append(reply(7))
    await pipeline.serve(request(max_tokens=20))
    fair = only_lane(pipeline).gate.fair
    assert fair.counter("gold") == pytest.approx((5 + 2 * 7) / 2.0)  # the upfront 20 settled to 7
    report = router.reporter.report()
    assert report.fair_charged == pytest.approx({"gold": 9.5})
    assert report.fair_backlogged == ()
    snap = Snapshot(
        epoch="e",
        version=2,
        created_at_s=time.time(),
        models=router.snapshots.snapshot.models,
        running_replicas={MODEL_DEPLOYMENT: 2, ROUTER_DEPLOYMENT: 2},
    )
    router.snapshots.offer(snap)
    router.reporter.on_snapshot(snap)
    assert only_lane(pipeline).gate.limit.value == 10  # 2 replicas x 10, split evenly between 2 routers
    router.reporter.on_reply({"fair_counters": {"gold": 100.0, "free": 40.0}, "fair_share": 0.25})
    assert fair.shared and fair.counters() == {"gold": 100.0, "free": 40.0}
    assert only_lane(pipeline).gate.limit.value == 5  # a quarter of 2 x 10
    router.reporter.on_reply({})  # nobody waits anywhere: the even split again
    assert only_lane(pipeline).gate.limit.value == 10


@pytest.mark.parametrize(
    ("level", "criticality", "route"),
    [
        (0, Criticality.CRITICAL, "affinity"),
        (2, Criticality.CRITICAL, "affinity"),  # a queue wait alone can raise level 2: affinity holds
        (0, Criticality.CRITICAL_PLUS, "least_loaded"),  # never waits behind a holder
        (3, Criticality.CRITICAL_PLUS, "balance"),  # short of capacity: load alone
    ],
)
async def test_the_call_says_how_the_model_router_may_place_it(level, criticality, route) -> None:
    cfg = {**CFG, "tenants": {"gold": {**CFG["tenants"]["gold"], "max_criticality": "critical_plus"}}}
    router = build_router(cfg, FakeHandle())
    pipeline = router.pipeline
    at_level(router, level)
    primary(pipeline).generate.script.append(reply(3))
    req = request()
    await pipeline.serve(ModelRequest(req.caller, criticality, req.max_tokens, False, CALL))
    assert primary(pipeline).generate.calls[0].route == route


async def test_each_call_carries_its_tenants_cache_salt_and_a_group_shares_one(monkeypatch) -> None:
    # Prefix caches are shared within a cache group only: the call of gold (its own group)
    # and of two tenants of one group carry the salts the secret makes of their groups, and
    # the answer's cached prompt tokens come back as the engine said.
    from ballast.policies.cache_groups import cache_group, cache_salt

    monkeypatch.setenv("BALLAST_CACHE_SALT_SECRET", "salt-secret")
    team = {"rate_tokens_per_s": None, "cache_group": "team"}
    cfg = {**CFG, "tenants": {**CFG["tenants"], "ann": team, "bob": team}}
    router = build_router(cfg, FakeHandle())
    pipeline = router.pipeline
    at_level(router, 0)
    for tenant in ("gold", "ann", "bob"):
        primary(pipeline).generate.script.append(FakeResponse(0, result=ModelResult("xxx", 3, None, cached_tokens=2)))
        caller = Caller(tenant, Deadline.starting(asyncio.get_running_loop().time(), 30))
        answer = await pipeline.serve(ModelRequest(caller, Criticality.CRITICAL, 20, False, CALL))
        assert answer.settled.cached_tokens == 2
    gold, ann, bob = (c.cache_salt for c in primary(pipeline).generate.calls)
    assert gold == cache_salt(b"salt-secret", cache_group("gold", None))
    assert ann == bob == cache_salt(b"salt-secret", "team") != gold


async def test_a_batch_lines_call_goes_at_the_engines_lowest_priority_an_interactive_one_at_0(pipeline) -> None:
    # vLLM starts the rows waiting in it by priority, a lower value first: a batch line's
    # call must never go before an interactive one's.
    handle = primary(pipeline)
    handle.generate.script.extend([reply(2), reply(2)])
    await pipeline.serve(request())
    slot = only_lane(pipeline).gate.try_batch()
    assert slot is not None
    await pipeline.serve_batch(request(), slot)
    assert [c.priority for c in handle.generate.calls] == [0, BATCH_PRIORITY]
    assert BATCH_PRIORITY > 0
