"""A lost replica is a capacity gap, not a model error: router to controller, tick by tick.

A real ``Router`` object (tests/unit/routerkit.py) answers requests whose replicas go
away (``ActorDiedError`` from the scripted Serve handle) or whose model fails; its
reports go to a real ``ControllerCore`` on a fake clock. The same burst moves the
level only when the model itself failed.
"""

from __future__ import annotations

import pytest
from fakes import FakeClock
from ray.exceptions import ActorDiedError, RayTaskError
from routerkit import at_level, build_router, only_lane, routed
from test_resilient_caller import FakeHandle, FakeResponse, fails

from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.model.protocol import ModelResult
from ballast.names import MODEL_DEPLOYMENT
from ballast.policies.reports import ReplicaReport, RouterReport

GOLD = {"authorization": "Bearer dev-key-gold"}
CFG = {
    "tenants": {"gold": {"max_criticality": "critical_plus"}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}, "demo_admin_token": "admin-token"},
    "resilience": {"gate": {"enabled": False}},
}
MODEL = "tiny-decoder"  # the config's one model
BURST = 30  # past degradation.error_rate_min_requests (20)


async def no_pause(seconds: float) -> None:
    """The caller's pause before a migration, taken at once (the fake has no replica to wait for)."""


@pytest.fixture()
def stack():
    primary = FakeHandle()
    router = build_router(CFG, primary)
    only_lane(router).caller._sleep = no_pause
    at_level(router, 0)
    with routed(router) as client:
        yield router, primary, client


def burst(router, primary, client, failure) -> list:
    """BURST requests whose every attempt fails with ``failure()``; their answers."""
    primary.generate.script.extend(fails(failure(), takes_s=0) for _ in range(BURST * 4))
    return [client.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 4}) for _ in range(BURST)]


def levels_after(report: RouterReport, seconds: int) -> list[int]:
    """The controller's level, tick by tick, after one router report carrying ``report``."""
    clock, wall = FakeClock(0), FakeClock(1_000_000)
    core = ControllerCore(load_config({}), clock=clock, wall_clock=wall)
    out = []
    for t in range(seconds):
        core.report_replica(ReplicaReport(replica_id="m1", deployment=MODEL_DEPLOYMENT, queued=0, running=0))
        if t == 0:
            core.report_router(report)
        out.append(core.tick().models[MODEL].level)
        clock.advance(1)
        wall.advance(1)
    return out


def test_a_burst_of_lost_replicas_leaves_the_level_alone(stack) -> None:
    router, primary, client = stack
    answers = burst(router, primary, client, ActorDiedError)
    assert {(r.status_code, r.json()["error"]["code"]) for r in answers} == {(503, "REPLICA_LOST")}
    assert all(r.headers.get("retry-after") for r in answers)
    report = router.reporter.report()
    load = report.load(MODEL)
    assert (load.requests, load.errors, load.lost_capacity) == (BURST, 0, BURST * 4)
    assert len(primary.generate.calls) == BURST * 4  # each sent again three times (the limit)
    assert only_lane(router).caller.lost == {"migrated": BURST * 3, "not_migrated": BURST, "streams_carried_on": 0}
    assert only_lane(router).caller.backends[0].breaker.snapshot()["state"] == "closed"
    assert levels_after(report, 4) == [0, 0, 0, 0]


def test_the_same_burst_of_model_errors_raises_the_level_as_before(stack) -> None:
    router, primary, client = stack
    answers = burst(router, primary, client, lambda: RayTaskError("generate", "tb", RuntimeError("cuda error")))
    assert {r.json()["error"]["code"] for r in answers} == {"MODEL_UNAVAILABLE"}
    report = router.reporter.report()
    load = report.load(MODEL)
    assert (load.requests, load.errors, load.lost_capacity) == (BURST, BURST, 0)
    # One level on the first sample; the error rate still asks a second later: level 3.
    assert levels_after(report, 3) == [1, 3, 3]


def test_a_request_sent_again_after_a_lost_replica_says_so_and_counts_no_error(stack) -> None:
    router, primary, client = stack
    primary.generate.script.extend(
        [fails(ActorDiedError(), takes_s=0), FakeResponse(0, result=ModelResult("answered", 3, None))]
    )
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["text"] == "answered"
    assert r.headers["x-ballast-migrations"] == "1"
    report = router.reporter.report()
    load = report.load(MODEL)
    assert (load.requests, load.errors, load.lost_capacity) == (1, 0, 1)
    status = client.get("/v1/status", headers={"authorization": "Bearer admin-token"})
    lost = status.json()["models"][MODEL]["lost_capacity"]
    assert lost == {"migrated": 1, "not_migrated": 0, "streams_carried_on": 0}
