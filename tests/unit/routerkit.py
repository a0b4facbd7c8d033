"""A real ``Router`` object without Ray, for tests of its request path.

Everything the router builds is real (config, key store, gate, quota buckets, the
resilient caller, metrics objects); the Serve handles are the scripted fakes of
test_resilient_caller.py, and the controller link is replaced: snapshots are offered
to the router's own ``SnapshotCache`` with ``at_level``.
"""

from __future__ import annotations

import inspect
import time
import types
import uuid
from typing import Any

from fastapi.testclient import TestClient
from ray.serve._private.http_util import _walk_fastapi_routes

from ballast.config import load_config
from ballast.control.snapshot import ModelState, Snapshot
from ballast.router import app as router_app


def build_router(cfg: dict[str, Any], primary: Any, fallback: Any = None) -> Any:
    # Serve's ingress wraps the class (its wrapper serves ASGI inside a replica); the
    # class app.py defines holds the routes and builds the state.
    cls = next(
        c
        for c in router_app.Router.__mro__
        if "__init__" in c.__dict__ and c.__dict__["__init__"].__qualname__ == "Router.__init__"
    )
    router = cls.__new__(cls)
    # No shared key table: each router object keeps its Idempotency-Keys alone, as a router
    # outside Ray does. A Ray left running by an earlier test (the integration session's)
    # would otherwise give every router object of the run one detached table, and a key
    # one test used would answer in the next.
    router._keys_handle = _no_key_table
    cls.__init__(router, primary, cfg, fallback)
    router._exchange = types.SimpleNamespace(start=lambda: None)  # no controller: snapshots are offered
    return router


def _no_key_table() -> Any:
    raise RuntimeError("no Ray here: the shared key table is unreachable")


def build_pipeline(cfg: dict[str, Any], primary: Any, fallback: Any = None) -> Any:
    """A router's ``Pipeline`` alone, as the router builds it (the router holds the rest)."""
    return build_router(cfg, primary, fallback).pipeline


def only_lane(router_or_pipeline: Any) -> Any:
    """The one lane of a router (or pipeline) serving one model: its gate, caller, tally."""
    pipeline = getattr(router_or_pipeline, "pipeline", router_or_pipeline)
    (lane,) = pipeline.lanes.values()
    return lane


def at_level(router: Any, level: int, models: dict[str, int] | None = None) -> None:
    """A snapshot with every model the router serves at ``level``, but ``models``' own
    levels by name."""
    constraints = load_config({}).degradation_config().constraints
    levels = {name: level for name in router.pipeline.lanes} | (models or {})
    states = {
        name: ModelState(
            deployment=router.pipeline.lanes[name].deployment,
            constraints=constraints[lv],
            level=lv,
            target_level=lv,
            reason="test",
        )
        for name, lv in levels.items()
    }
    router.snapshots.offer(Snapshot(epoch=uuid.uuid4().hex[:12], version=1, created_at_s=time.time(), models=states))


class routed:
    """``with routed(router) as client``: FastAPI's TestClient on this router object."""

    def __init__(self, router: Any) -> None:
        self.router = router
        routes = [route for route, _, _ in _walk_fastapi_routes(router_app.app)]
        self.dep = inspect.signature(routes[0].endpoint).parameters["self"].default.dependency

    def __enter__(self) -> TestClient:
        router_app.app.dependency_overrides[self.dep] = lambda: self.router
        return TestClient(router_app.app, raise_server_exceptions=False)

    def __exit__(self, *exc: Any) -> None:
        router_app.app.dependency_overrides.clear()
