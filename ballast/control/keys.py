"""The idempotency keys every router shares: a detached actor around ``ballast.policies.idempotency``.

A client that retries a request with the same ``Idempotency-Key`` through another
node's endpoint reaches another router; this actor tells that router the key is
being answered (wait) or was answered (here is the answer), so the model generates
once. Routers call it only for requests that carry a key, with a short timeout;
when it cannot be reached they honour the key on their own (per router, as before),
and count it. It keeps no durable state: restarted by Ray (``max_restarts=-1``)
after its node is lost, it starts empty, and keys in flight then may run twice.

Bounded per tenant and overall as ``resilience.idempotency`` says (the table's
``max_entries_per_tenant``, ``max_answer_bytes_per_tenant``, ``max_entries``); a claim
that finds no room answers ``full`` and the router refuses the request (429).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray

from ballast.config import BallastConfig, IdempotencySettings
from ballast.policies.idempotency import DONE, Claim, KeyTable

#: The actor's name, beside the controller's (``<controller.name>-keys-v3``). The version
#: is the claim protocol's (v2: claims carry the request's fingerprint; v3: a claim is a
#: ``Claim`` carrying the router's typed answer, the fingerprint a ``ModelCall``'s): a detached table
#: left by a router of another protocol is never called by this one, so an upgrade gets
#: a fresh table instead of calls that fail and leave keys honoured per router.
SUFFIX = "-keys-v3"


class KeyService:
    """The actor's body (``IdempotencyKeys`` is this class as a Ray actor)."""

    def __init__(self, settings: IdempotencySettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._table = KeyTable(
            settings.ttl_s, settings.max_entries, settings.max_entries_per_tenant, settings.max_answer_bytes_per_tenant
        )
        self._clock = clock
        # Routers waiting for a key another router is answering; an event per key
        # that has waiters, dropped when it fires (bounded by the requests waiting).
        self._changed: dict[tuple[str, str], asyncio.Event] = {}

    def _fire(self, slot: tuple[str, str]) -> None:
        event = self._changed.pop(slot, None)
        if event is not None:
            event.set()

    async def claim(self, tenant: str, key: str, owner: str, lease_s: float, fingerprint: str) -> Claim:
        return self._table.claim((tenant, key), owner, lease_s, self._clock(), fingerprint)

    async def wait(self, tenant: str, key: str, timeout_s: float) -> Claim | None:
        """The key's state once it is answered or freed, or after ``timeout_s``; None when free."""
        slot = (tenant, key)
        now = self._clock()
        seen = self._table.peek(slot, now)
        if seen is None or seen.state == DONE:
            return seen
        event = self._changed.setdefault(slot, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        return self._table.peek(slot, self._clock())

    async def complete(self, tenant: str, key: str, owner: str, result: Any) -> bool:
        ok = self._table.complete((tenant, key), owner, result, self._clock())
        self._fire((tenant, key))
        return ok

    async def release(self, tenant: str, key: str, owner: str) -> bool:
        ok = self._table.release((tenant, key), owner, self._clock())
        self._fire((tenant, key))
        return ok

    async def size(self) -> int:
        return len(self._table)


IdempotencyKeys = ray.remote(num_cpus=0)(KeyService)


def keys_name(cfg: BallastConfig) -> str:
    return cfg.controller.name + SUFFIX


def keys_actor(cfg: BallastConfig) -> ray.actor.ActorHandle[Any]:
    """The shared key table, created by whichever router asks first (``get_if_exists``)."""
    actor_class: Any = IdempotencyKeys  # ray.remote's actor class: Ray types its options() loosely
    handle: ray.actor.ActorHandle[Any] = actor_class.options(
        name=keys_name(cfg),
        namespace=cfg.controller.namespace,
        lifetime="detached",
        max_restarts=-1,
        get_if_exists=True,
        num_cpus=cfg.controller.num_cpus,
    ).remote(cfg.resilience.idempotency)
    return handle


def lookup_keys(cfg: BallastConfig) -> ray.actor.ActorHandle[Any] | None:
    try:
        return ray.get_actor(keys_name(cfg), namespace=cfg.controller.namespace)
    except ValueError:
        return None
