"""The shared request pipeline (serve_app/router/pipeline.py): every way out settles the
ticket exactly once.

A real ``Router`` object (tests/unit/routerkit.py) with scripted Serve handles. After
each outcome the tenant's in-flight count, its token bucket and the gate are checked:
what the request took is back, and the quota holds exactly the tokens it used.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from ray.exceptions import RayTaskError

from policies.criticality import Criticality
from policies.deadline import Deadline
from routerkit import at_level, build_router
from serve_app.errors import ConcurrencyLimited, DeadlineExceeded, ModelUnavailable, QuotaExceeded
from serve_app.router.pipeline import StreamEnd
from test_resilient_caller import FakeHandle, FakeResponse, FakeStream, fails

PROMPT = "hello"  # 5 prompt tokens (bytes)
CFG = {
    "tenants": {"gold": {"rate_tokens_per_s": 0.001, "burst_tokens": 1000, "max_concurrent": 2}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}},
    "resilience": {"gate": {"initial_limit": 1, "min_limit": 1, "max_limit": 1, "critical_reserve_ratio": 0}},
}


def reply(tokens: int) -> FakeResponse:
    return FakeResponse(0, result={"text": "x" * tokens, "tokens": tokens})


@pytest.fixture()
def router():
    r = build_router(CFG, FakeHandle())
    at_level(r, 0)
    return r


def primary(router) -> FakeHandle:
    return router._caller.backends[0].handle


def bucket_tokens(router) -> float:
    return router._buckets["gold"].tokens


def settled(router, full: float, used: int) -> None:
    """The tenant holds nothing, the gate is free, the bucket is short exactly ``used``."""
    assert router._tenant_inflight.get("gold", 0) == 0
    assert router._gate.in_flight == 0
    assert bucket_tokens(router) == pytest.approx(full - used, abs=0.01)


async def admit(router, max_tokens: int = 20):
    return await router._admit("gold", Criticality.CRITICAL, len(PROMPT.encode()), max_tokens, False, Deadline.starting(asyncio.get_running_loop().time(), 30))


async def test_an_answer_settles_the_quota_to_the_tokens_used(router) -> None:
    full = bucket_tokens(router)
    primary(router).generate.script.append(reply(7))
    admitted = await admit(router)
    assert router._tenant_inflight["gold"] == 1 and router._gate.in_flight == 1
    assert bucket_tokens(router) == pytest.approx(full - 25, abs=0.01)  # the estimate: 5 + 20
    answer, replayed = await router._answer_unary(admitted, {"prompt": PROMPT, "max_tokens": 20}, None)
    assert (answer["tokens"], answer["fallback"], replayed) == (7, None, False)
    settled(router, full, 5 + 7)
    assert admitted.ticket.outcome.code == "OK" and router._stats.requests == 1


async def test_a_model_error_gives_everything_back(router) -> None:
    full = bucket_tokens(router)
    primary(router).generate.script.append(fails(RayTaskError("generate", "tb", RuntimeError("cuda error")), takes_s=0))
    admitted = await admit(router)
    with pytest.raises(ModelUnavailable):
        await router._answer_unary(admitted, {"prompt": PROMPT, "max_tokens": 20}, None)
    settled(router, full, 0)
    assert admitted.ticket.outcome.code == "MODEL_UNAVAILABLE" and router._stats.errors == 1


async def test_the_replicas_deadline_is_a_gate_miss_and_uses_no_quota(router) -> None:
    full = bucket_tokens(router)
    primary(router).generate.script.append(fails(DeadlineExceeded("past its deadline"), takes_s=0))
    admitted = await admit(router)
    with pytest.raises(DeadlineExceeded):
        await router._answer_unary(admitted, {"prompt": PROMPT, "max_tokens": 20}, None)
    settled(router, full, 0)
    assert admitted.ticket.outcome.timed_out


async def test_a_replay_costs_nothing(router) -> None:
    full = bucket_tokens(router)
    primary(router).generate.script.append(reply(4))
    first = await admit(router)
    await router._answer_unary(first, {"prompt": PROMPT, "max_tokens": 20}, "key-1")
    again = await admit(router)
    answer, replayed = await router._answer_unary(again, {"prompt": PROMPT, "max_tokens": 20}, "key-1")
    assert replayed and answer["tokens"] == 4
    settled(router, full, 5 + 4)  # only the first answer's tokens
    assert again.ticket.outcome.generated is None


async def test_over_quota_is_refused_with_nothing_held(router) -> None:
    router._buckets["gold"].try_charge(bucket_tokens(router) - 10)  # 10 tokens left
    full = bucket_tokens(router)
    with pytest.raises(QuotaExceeded):
        await admit(router)
    settled(router, full, 0)


async def test_the_tenant_cap_counts_requests_waiting_at_the_gate(router) -> None:
    # The gate's one slot is taken; the tenant's first two requests wait in its line.
    # They count against the tenant's cap (2) while they wait, so a third is refused
    # at once (the cap used to be counted only after the wait).
    await router._gate.acquire(0, asyncio.get_running_loop().time() + 60)
    waiting = [asyncio.ensure_future(admit(router)) for _ in range(2)]
    await asyncio.sleep(0)
    assert router._tenant_inflight["gold"] == 2 and router._gate.waiting == 2
    with pytest.raises(ConcurrencyLimited):
        await admit(router)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    router._gate.release(None)
    assert router._tenant_inflight["gold"] == 0 and router._gate.in_flight == 0


async def test_a_stream_settles_for_the_tokens_it_produced(router) -> None:
    full = bucket_tokens(router)
    primary(router).generate_stream.script.append(FakeStream(reply(3), reply(2)))
    admitted = await admit(router)
    end = StreamEnd()
    chunks = [c async for c in router._answer_stream(admitted, {"prompt": PROMPT, "max_tokens": 20}, end)]
    assert [c["tokens"] for c in chunks] == [3, 2] and end.tokens == 5
    settled(router, full, 5 + 5)


async def test_a_client_leaving_mid_stream_settles_what_was_produced(router) -> None:
    full = bucket_tokens(router)
    primary(router).generate_stream.script.append(FakeStream(reply(3), reply(2), reply(4)))
    admitted = await admit(router)
    gen = router._answer_stream(admitted, {"prompt": PROMPT, "max_tokens": 20}, StreamEnd())
    assert (await gen.__anext__())["tokens"] == 3
    await gen.aclose()  # the client went away
    settled(router, full, 5 + 3)
    assert admitted.ticket.outcome.code == "CANCELLED"


async def test_a_stream_that_never_starts_gives_back_its_quota_too(router) -> None:
    full = bucket_tokens(router)
    admitted = await admit(router)
    gen = router._answer_stream(admitted, {"prompt": PROMPT, "max_tokens": 20}, StreamEnd())
    del gen, admitted  # the response was never iterated: the client left first
    gc.collect()
    settled(router, full, 0)


async def test_the_gate_counts_a_request_in_the_report_it_was_decided_in(router) -> None:
    # What the edge's throttle learns from: per class, [decided at the gate, let through]
    # since the last report. A request that waits across a report is counted once, when
    # the gate lets it through (it used to count as reached in one report and its
    # admission was lost: the throttle read it as a refusal of a class taken whole).
    await router._gate.acquire(0, asyncio.get_running_loop().time() + 60)
    waiting = asyncio.ensure_future(admit(router))
    await asyncio.sleep(0)
    assert router._gate.waiting == 1 and router._gate_seen_by_class == {}
    router._sync_edge()  # a report: the counts start afresh
    router._gate.release(None)
    await waiting
    assert router._gate_seen_by_class == {"critical": [1, 1]}
