"""How routers, replicas and watchdogs reach the controller.

Kept apart from the controller actor's module so that a replica or a router that
only needs the link does not import the actor (and its policies) for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ray

from ballast.config import BallastConfig
from ballast.control.snapshot import Report, Snapshot, SnapshotCache, SnapshotExchange


def lookup_controller(cfg: BallastConfig) -> ray.actor.ActorHandle[Any] | None:
    try:
        return ray.get_actor(cfg.controller.name, namespace=cfg.controller.namespace)
    except ValueError:
        return None


class ControllerLink:
    """How routers and replicas reach the controller: lazy lookup, reset on failure.

    The blocking GCS lookup runs in a thread so the replica's event loop never waits on
    it. If the actor is gone for good (killed without restart), the next lookup
    creates it again (``get_if_exists``), so the control loop heals itself.
    """

    def __init__(self, cfg: BallastConfig):
        self._cfg = cfg
        self._handle: ray.actor.ActorHandle[Any] | None = None

    async def call(self, method: str, *args: Any) -> Any:
        if self._handle is None:
            self._handle = await asyncio.to_thread(self._get_or_create)
        try:
            return await getattr(self._handle, method).remote(*args)
        except Exception:
            self._handle = None
            raise

    def _get_or_create(self) -> ray.actor.ActorHandle[Any]:
        found = lookup_controller(self._cfg)
        if found is not None:
            return found
        # Only here, to heal a controller killed for good, is the actor's module needed.
        from ballast.control.controller import ensure_controller

        return ensure_controller(self._cfg)


def connect(
    cfg: BallastConfig,
    report_method: str,
    make_report: Callable[[], Report],
    on_snapshot: Callable[[Snapshot], None] | None = None,
    on_reply: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[ControllerLink, SnapshotCache, SnapshotExchange]:
    """What every router and replica holds: the link, the fail-static cache, the report loop."""
    c = cfg.controller
    link = ControllerLink(cfg)
    cache = SnapshotCache(cfg.degradation_config(), c.snapshot_stale_s, c.snapshot_max_stale_s, c.fail_static_level)
    exchange = SnapshotExchange(
        cache,
        call=lambda report: link.call(report_method, report),
        make_report=make_report,
        interval_s=c.report_interval_s,
        timeout_s=c.call_timeout_s,
        on_snapshot=on_snapshot,
        on_reply=on_reply,
    )
    return link, cache, exchange
