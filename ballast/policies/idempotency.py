"""Idempotency keys shared by every router: who generates a key's answer, and the answer.

A router that sees an ``Idempotency-Key`` for the first time *claims* it here. The
first claim wins and holds a lease (the request's deadline, plus a margin); every
other claim for the key, from any router, gets either the answer (``done``) or
``running`` (wait for it, then claim again). The owner ``complete``s with the
answer, or ``release``s the key when its attempt failed, so a retry runs for real.
A lease that runs out (the owner's router died with the request) frees the key the
same way.

Entries are bounded: answers are kept ``ttl_s`` after they complete; past
``max_entries`` the oldest finished ones go first, then the oldest claims. A key
evicted is simply a new key: it runs again.

Pure: the caller passes the time (``now_s``, monotonic in one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ballast.policies.ttlmap import Held, TTLMap
from ballast.policies.validation import check_positive

MINE, RUNNING, DONE = "mine", "running", "done"


@dataclass
class _Key:
    owner: str
    result: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class Claim:
    state: str  # MINE, RUNNING or DONE
    owner: str  # who generates it (or generated it)
    result: Optional[dict[str, Any]] = None


class KeyTable:
    """Claims and answers per (tenant, key), held in a ``TTLMap``: a claim is a pending
    entry whose lease is the claim's, an answer a finished one. When full, the expired
    go first, then the oldest answers, then the oldest claims."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._keys: TTLMap[tuple[str, str], _Key] = TTLMap(ttl_s, max_entries, keep_pending=True)
        self.ttl_s = ttl_s
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self._keys)

    def claim(self, slot: tuple[str, str], owner: str, lease_s: float, now_s: float) -> Claim:
        """The first live claim wins; a repeat by the same owner is still its own."""
        check_positive("lease_s", lease_s)
        e = self._keys.lookup(slot, now_s)
        if e is None:
            if self._keys.full:
                self._keys.expire(now_s)
            self._keys.put(slot, _Key(owner), lease_until_s=now_s + lease_s)
            return Claim(MINE, owner)
        if e.done:
            return Claim(DONE, e.value.owner, e.value.result)
        return Claim(MINE if e.value.owner == owner else RUNNING, e.value.owner)

    def peek(self, slot: tuple[str, str], now_s: float) -> Optional[Claim]:
        """The key's state without claiming it; None when free."""
        e = self._keys.lookup(slot, now_s)
        if e is None:
            return None
        return Claim(DONE, e.value.owner, e.value.result) if e.done else Claim(RUNNING, e.value.owner)

    def complete(self, slot: tuple[str, str], owner: str, result: dict[str, Any], now_s: float) -> bool:
        """Keep the owner's answer; False when the claim was no longer its own (lease lost)."""
        e = self._owned_claim(slot, owner, now_s)
        if e is None:
            return False
        e.value.result = result
        e.finish(now_s)
        return True

    def release(self, slot: tuple[str, str], owner: str, now_s: float) -> bool:
        """The owner's attempt failed: the key is free for the next claim."""
        e = self._owned_claim(slot, owner, now_s)
        if e is None:
            return False
        self._keys.remove(slot)
        return True

    def _owned_claim(self, slot: tuple[str, str], owner: str, now_s: float) -> Optional[Held[_Key]]:
        """``owner``'s live, unanswered claim on ``slot``, or None."""
        e = self._keys.lookup(slot, now_s)
        if e is None or e.value.owner != owner or e.done:
            return None
        return e
