"""A replica that stops answering, on real Serve: hedged, passed over, and never a model error.

Two replicas of a small deployment routed by Ballast's own request router
(``ballast.model.routing``), reporting the same routing stats (readiness and heartbeat) as
a model replica does, and called through the router's ``ResilientCaller``. One replica then
blocks its event loop for 9 s, as a GC pause or a stalled kernel would: it answers nothing,
its heartbeat stops. What holds:

* calls already placed on it are hedged on the other replica after the learned delay, and
  answered there long before it wakes;
* once its heartbeat has stood still ``silent_after_s``, new calls are not sent to it;
* a call that may not be hedged and waits on it out its attempt timeout is sent again to the
  other replica as lost capacity: the breaker counts no failure.

This is what the unit tests (stand-ins for Serve's replicas) cannot show: that Serve hands the
heartbeats and placements to the caller's process at all.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from ray import serve

from ballast.config import load_config
from ballast.model.protocol import ModelCall, ModelResult
from ballast.model.routing import replica_routing_stats, request_router_config
from ballast.model.routing_state import is_silent
from ballast.router.calls import CallSpec
from ballast.router.resilience import ResilientCaller

pytestmark = pytest.mark.integration

MODEL = "silence-probe"
FREEZE_S = 9.0
SILENT_AFTER_S = 2.5


@serve.deployment(
    num_replicas=2,
    ray_actor_options={"num_cpus": 0},
    request_router_config=request_router_config(0.5, None, MODEL, SILENT_AFTER_S),
)
class Probe:
    def __init__(self) -> None:
        self.id = serve.get_replica_context().replica_id.unique_id

    def record_routing_stats(self) -> dict:
        return replica_routing_stats(True, None, time.time())

    async def generate(self, call: ModelCall) -> ModelResult:
        return ModelResult(self.id, 1, "stop")

    async def whoami(self) -> str:
        return self.id

    async def freeze(self, seconds: float) -> str:
        """Block this replica's event loop for ``seconds``, just after answering."""
        asyncio.get_running_loop().call_later(0.05, time.sleep, seconds)
        return self.id


@pytest.fixture(scope="module")
def probe(ballast):
    handle = serve.run(Probe.bind(), name=MODEL, route_prefix=None)
    try:
        yield handle
    finally:
        serve.delete(MODEL)


def test_a_silent_replica_is_hedged_passed_over_and_not_counted_as_an_error(probe) -> None:
    cfg = load_config(
        {
            "model": {"name": MODEL},
            "resilience": {
                "attempt_timeout_s": 5,
                "hedge": {"min_samples": 5, "min_delay_s": 0.3, "silent_after_s": SILENT_AFTER_S},
            },
        }
    )
    caller = ResilientCaller(cfg, probe, model=MODEL)

    def spec(call: ModelCall, hedge: bool = True) -> CallSpec:
        return CallSpec(call, time.monotonic() + 20, [], time.time(), hedge=hedge)

    async def walk() -> None:
        replicas = {await probe.whoami.remote() for _ in range(20)}
        assert len(replicas) == 2
        for _ in range(10):  # the delay is learned from these
            await caller.unary(spec(ModelCall("warm", max_tokens=1)))
        assert caller.hedge_delay.delay_s("unary", 1) is not None
        frozen = await probe.freeze.remote(FREEZE_S)
        (awake,) = replicas - {frozen}
        t0 = time.monotonic()
        await asyncio.sleep(0.3)  # its loop blocks 0.05 s after it answered
        # Placed on the frozen replica (the other avoided while it is still ready): hedged
        # there after the delay, answered by the other, long before the frozen one wakes.
        hedged = await caller.unary(spec(ModelCall("hedged", max_tokens=1, avoid=(awake,))))
        assert hedged.result.text == awake and time.monotonic() - t0 < 3
        assert caller.hedges.won == 1
        # Not hedged: it waits out its 5 s attempt timeout there; by then the frozen replica's
        # heartbeat has stood still past silent_after_s, so it is sent again to the other as
        # lost capacity.
        lost = await caller.unary(spec(ModelCall("unhedged", max_tokens=1, avoid=(awake,)), hedge=False))
        assert lost.result.text == awake and time.monotonic() - t0 < FREEZE_S
        assert is_silent(MODEL, frozen, SILENT_AFTER_S, time.time())
        # New calls go to the awake replica alone while the other is silent.
        answers = await asyncio.gather(*(caller.unary(spec(ModelCall(f"n{i}", max_tokens=1))) for i in range(6)))
        assert {a.result.text for a in answers} == {awake} and time.monotonic() - t0 < FREEZE_S
        primary = caller.backends[0]
        assert primary.failed == {"replica_silent": 1}
        assert primary.breaker.snapshot()["failures"] == 0
        assert caller.lost["migrated"] == 1

    asyncio.run(walk())
