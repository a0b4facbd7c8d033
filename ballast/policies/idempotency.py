"""Idempotency keys shared by every router: who generates a key's answer, and the answer.

A router that sees an ``Idempotency-Key`` for the first time *claims* it here, with the
request's fingerprint (a hash of what it asks the model). The first claim wins and
holds a lease (the request's deadline, plus a margin); every other claim for the key,
from any router, gets either the answer (``done``) or ``running`` (wait for it, then
claim again), each with the first claim's fingerprint: a router refuses a request whose
fingerprint differs (the same key for another request). The owner ``complete``s with
the answer, or ``release``s the key when its attempt failed, so a retry runs for real.
A lease that runs out (the owner's router died with the request) frees the key the
same way.

Entries are bounded per tenant and overall (``ballast.policies.ttlmap``): answers are
kept ``ttl_s`` after they complete; a tenant past ``max_entries_per_tenant`` keys or
``max_answer_bytes_per_tenant`` bytes of answers loses its own oldest answers, never
another tenant's; ``max_entries`` is the backstop over all tenants. A claim is never
evicted: a claim that finds no room (its tenant's keys, or the whole table, all
running) is answered ``full``. A key evicted is simply a new key: it runs again.
Expiry visits amortised O(1) entries per call (the map's finish order and lease heap).

Pure: the caller passes the time (``now_s``, monotonic in one process).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from ballast.policies.ttlmap import Held, TTLMap
from ballast.policies.validation import check_positive

MINE, RUNNING, DONE, FULL = "mine", "running", "done", "full"


def answer_bytes(result: Any) -> int:
    """What an answer costs a tenant's store: its size as compact, ASCII-escaped JSON (a
    dataclass as its fields; at least the UTF-8 size of its text)."""
    return len(json.dumps(result, separators=(",", ":"), default=_fields))


def _fields(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else str(value)


@dataclass
class _Key:
    owner: str
    fingerprint: str
    result: Any = None  # the answer, as the router keeps it (``router.pipeline.Settled``)


@dataclass(frozen=True)
class Claim:
    state: str  # MINE, RUNNING, DONE or FULL
    owner: str  # who generates it (or generated it); "" when FULL
    fingerprint: str = ""  # the first claim's request
    result: Any = None


def _tenant(slot: tuple[str, str]) -> str:
    return slot[0]


class KeyTable:
    """Claims and answers per (tenant, key), held in a ``TTLMap`` grouped by tenant: a
    claim is a pending entry whose lease is the claim's, an answer a finished one."""

    def __init__(
        self, ttl_s: float, max_entries: int, max_entries_per_tenant: int, max_answer_bytes_per_tenant: int
    ) -> None:
        self._keys: TTLMap[tuple[str, str], _Key] = TTLMap(
            ttl_s,
            max_entries,
            max_entries_per_group=max_entries_per_tenant,
            max_bytes_per_group=max_answer_bytes_per_tenant,
            group=_tenant,
        )
        self.ttl_s = ttl_s
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def visited(self) -> int:
        """Entries the table's sweeps and evictions looked at, since it started."""
        return self._keys.visited

    def claim(self, slot: tuple[str, str], owner: str, lease_s: float, now_s: float, fingerprint: str = "") -> Claim:
        """The first live claim wins; a repeat by the same owner is still its own; FULL
        when the key is new and its tenant (or the table) has room for no other claim."""
        check_positive("lease_s", lease_s)
        e = self._keys.lookup(slot, now_s)
        if e is None:
            if self._keys.put(slot, _Key(owner, fingerprint), now_s, lease_until_s=now_s + lease_s) is None:
                return Claim(FULL, "")
            return Claim(MINE, owner, fingerprint)
        return self._state(e, owner)

    def peek(self, slot: tuple[str, str], now_s: float) -> Claim | None:
        """The key's state without claiming it; None when free."""
        e = self._keys.lookup(slot, now_s)
        return None if e is None else self._state(e, None)

    @staticmethod
    def _state(e: Held[_Key], owner: str | None) -> Claim:
        k = e.value
        if e.done:
            return Claim(DONE, k.owner, k.fingerprint, k.result)
        return Claim(MINE if k.owner == owner else RUNNING, k.owner, k.fingerprint)

    def complete(self, slot: tuple[str, str], owner: str, result: Any, now_s: float) -> bool:
        """Keep the owner's answer (unless it alone is over its tenant's bytes: then the
        key is freed, as after a release); False when the claim was no longer its own."""
        e = self._owned_claim(slot, owner, now_s)
        if e is None:
            return False
        e.value.result = result
        self._keys.finish(slot, e, now_s, answer_bytes(result))
        return True

    def release(self, slot: tuple[str, str], owner: str, now_s: float) -> bool:
        """The owner's attempt failed: the key is free for the next claim."""
        e = self._owned_claim(slot, owner, now_s)
        if e is None:
            return False
        self._keys.remove(slot)
        return True

    def _owned_claim(self, slot: tuple[str, str], owner: str, now_s: float) -> Held[_Key] | None:
        """``owner``'s live, unanswered claim on ``slot``, or None."""
        e = self._keys.lookup(slot, now_s)
        if e is None or e.value.owner != owner or e.done:
            return None
        return e
