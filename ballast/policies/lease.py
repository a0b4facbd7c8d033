"""Leases with a hard TTL and a heartbeat: a claim that lapses by itself.

The controller recycles replicas one at a time under a lease. The controller is
a detached actor that Ray restarts on a crash, and a restarted controller must
neither wait forever for a dead predecessor nor start a second recycle while the
first is still running. A plain lock gives one of the two; a lease gives both:

* **Hard TTL.** A lease is held at most ``ttl_s`` after it was acquired, however
  faithfully it is heartbeated. A holder stuck in a loop that still heartbeats
  cannot keep a resource forever: the TTL is the last safety net.
* **Heartbeat.** The holder renews ``last_heartbeat_s`` every
  ``heartbeat_interval_s``. After ``missed_allowed`` (default 3) missed
  heartbeats the lease is expired: a crashed holder releases its claim within
  ``missed_allowed × heartbeat_interval_s`` instead of the whole TTL.
  The comparison is strict (``elapsed > missed_allowed × interval``): at
  exactly ``missed_allowed`` intervals without a heartbeat the lease is still held; a
  heartbeat landing on that instant still counts.
* **Health** (``heartbeat_health``) shows how close a lease is to
  lapsing: ``healthy`` while the last heartbeat is at most one interval old,
  ``warning`` up to ``missed_allowed`` intervals, ``critical`` beyond (which is
  also when it has expired by heartbeat).

Times are **wall-clock** seconds passed in as ``now_s``: a lease is persisted
(``to_dict``/``from_dict``, JSON-safe) and read back by another process, possibly
a restarted controller, where a monotonic clock means nothing. A clock that
steps back yields a heartbeat age of 0, never a negative one, and a heartbeat
never moves ``last_heartbeat_s`` backwards.

``LeaseTable`` holds at most one live lease per resource. ``acquire`` returns
None while a live lease exists — even to the same holder, so a caller can never
silently stack two recycles — and replaces an expired one: that is how "a new
controller carries on" after the old one died. The table is bounded by
``max_leases`` (a memory bound).

Written by hand: the semantics (strict heartbeat grace, hard TTL, health levels,
a pure table the controller persists itself) are a few lines, and no lock
library takes an injected wall time. Not thread-safe: the controller actor calls
it from its own event loop, without an ``await`` inside any method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ballast.policies.validation import check_fields, check_finite, check_int, check_name, check_positive

MAX_DATA_ITEMS = 16  # "a small payload": the lease is persisted on every heartbeat
MAX_DATA_CHARS = 256  # per key and per value

_LEASE_FIELDS = (
    "id",
    "resource",
    "holder",
    "acquired_at_s",
    "last_heartbeat_s",
    "ttl_s",
    "heartbeat_interval_s",
    "missed_allowed",
    "data",
)


class Health(str, Enum):
    """How close a lease is to lapsing by heartbeat."""

    HEALTHY = "healthy"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(frozen=True)
class Lease:
    """One claim on ``resource`` by ``holder``. Immutable: a heartbeat makes a new one."""

    id: str
    resource: str  # what is held, e.g. "recycle/BallastModel"
    holder: str  # who holds it, e.g. a controller epoch
    acquired_at_s: float  # wall clock seconds (leases cross processes and restarts)
    last_heartbeat_s: float
    ttl_s: float  # hard TTL from acquisition, whatever the heartbeats
    heartbeat_interval_s: float
    missed_allowed: int = 3
    data: tuple[tuple[str, str], ...] = ()  # small payload, e.g. (("replica_id", "abc"), ("reason", "max_age"))

    def __post_init__(self) -> None:
        check_fields(self, check_name, "id", "resource", "holder")
        check_fields(self, check_finite, "acquired_at_s", "last_heartbeat_s")
        if self.last_heartbeat_s < self.acquired_at_s:
            raise ValueError(
                f"last_heartbeat_s: must be >= acquired_at_s ({self.acquired_at_s!r}), got {self.last_heartbeat_s!r}"
            )
        check_fields(self, check_positive, "ttl_s", "heartbeat_interval_s")
        check_fields(self, check_int, "missed_allowed", minimum=1)
        _check_data(self.data)

    # ------------------------------------------------------------------ timing

    @property
    def grace_s(self) -> float:
        """How long the lease survives without a heartbeat: ``missed_allowed × interval``."""
        return self.missed_allowed * self.heartbeat_interval_s

    def heartbeat_age(self, now_s: float) -> float:
        """Seconds since the last heartbeat; 0 if the wall clock stepped back."""
        return max(0.0, now_s - self.last_heartbeat_s)

    def health(self, now_s: float) -> Health:
        age_s = self.heartbeat_age(now_s)
        if age_s <= self.heartbeat_interval_s:
            return Health.HEALTHY
        if age_s <= self.grace_s:
            return Health.WARNING
        return Health.CRITICAL

    def expired(self, now_s: float) -> bool:
        """TTL reached (``>=``), or more than ``missed_allowed`` intervals without a heartbeat (``>``)."""
        return now_s - self.acquired_at_s >= self.ttl_s or self.heartbeat_age(now_s) > self.grace_s

    def expires_at_s(self) -> float:
        """When the lease lapses if no further heartbeat comes.

        At this instant a TTL expiry has happened (``>=``), while a heartbeat
        expiry happens just after it (``>``); either way nobody should plan on
        holding the lease past it.
        """
        return min(self.acquired_at_s + self.ttl_s, self.last_heartbeat_s + self.grace_s)

    def value_of(self, key: str, default: str | None = None) -> str | None:
        """A value from the payload, e.g. ``lease.value_of("replica_id")``."""
        for k, v in self.data:
            if k == key:
                return v
        return default

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: ``data`` becomes a list of ``[key, value]`` pairs."""
        return {
            "id": self.id,
            "resource": self.resource,
            "holder": self.holder,
            "acquired_at_s": self.acquired_at_s,
            "last_heartbeat_s": self.last_heartbeat_s,
            "ttl_s": self.ttl_s,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "missed_allowed": self.missed_allowed,
            "data": [[k, v] for k, v in self.data],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Lease:
        """Read back ``to_dict()`` output (after a JSON round trip). ValueError on anything else."""
        if not isinstance(d, Mapping):
            raise ValueError(f"lease: must be a mapping, got {type(d).__name__}")
        missing = [f for f in _LEASE_FIELDS if f not in d and f not in ("missed_allowed", "data")]
        if missing:
            raise ValueError(f"{missing[0]}: missing from the persisted lease")
        unknown = sorted(str(k) for k in d if k not in _LEASE_FIELDS)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a lease field")
        raw_data = d.get("data", ())
        if not isinstance(raw_data, (list, tuple)):
            raise ValueError(f"data: must be a list of [key, value] pairs, got {raw_data!r}")
        pairs = []
        for item in raw_data:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"data: each item must be a [key, value] pair, got {item!r}")
            pairs.append((item[0], item[1]))
        # __post_init__ validates every field and raises ValueError naming it.
        return cls(
            id=d["id"],
            resource=d["resource"],
            holder=d["holder"],
            acquired_at_s=d["acquired_at_s"],
            last_heartbeat_s=d["last_heartbeat_s"],
            ttl_s=d["ttl_s"],
            heartbeat_interval_s=d["heartbeat_interval_s"],
            missed_allowed=d.get("missed_allowed", 3),
            data=tuple(pairs),
        )


def _check_data(data: object) -> None:
    if not isinstance(data, tuple):
        raise ValueError(f"data: must be a tuple of (key, value) str pairs, got {data!r}")
    if len(data) > MAX_DATA_ITEMS:
        raise ValueError(f"data: at most {MAX_DATA_ITEMS} items, got {len(data)}")
    keys = set()
    for item in data:
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not all(isinstance(x, str) and len(x) <= MAX_DATA_CHARS for x in item)
        ):
            raise ValueError(
                f"data: each item must be a (key, value) pair of str of at most {MAX_DATA_CHARS} chars, got {item!r}"
            )
        if item[0] in keys:
            raise ValueError(f"data: duplicate key {item[0]!r}")
        keys.add(item[0])


class LeaseLost(Exception):
    """A heartbeat or release on a lease the caller does not hold (any more).

    ``reason`` is ``"unknown"`` (no such lease: released, expired and removed,
    or replaced), ``"holder"`` (someone else holds it) or ``"expired"``.
    Arguments go to ``super().__init__`` so the error pickles across a Ray
    process boundary.
    """

    def __init__(self, lease_id: str, holder: str, reason: str) -> None:
        super().__init__(lease_id, holder, reason)
        self.lease_id = lease_id
        self.holder = holder
        self.reason = reason

    def __str__(self) -> str:
        return f"lease {self.lease_id!r} lost for holder {self.holder!r}: {self.reason}"


class LeaseTable:
    """At most one live lease per resource; bounded (max_leases, default 1024).

    Invariants: ``_by_resource`` and ``_resource_of`` describe the same leases
    (one entry per lease id, one lease per resource), and the table never holds
    more than ``max_leases`` leases, live or expired. Expired leases stay until
    ``expire()`` removes and returns them (so the caller can log and alert on
    each), until ``acquire()`` replaces one on the same resource, or until
    ``acquire()`` needs the room on a full table.
    """

    def __init__(self, max_leases: int = 1024) -> None:
        check_int("max_leases", max_leases, minimum=1)
        self._max_leases = max_leases
        self._by_resource: dict[str, Lease] = {}
        self._resource_of: dict[str, str] = {}  # lease id -> resource

    @property
    def max_leases(self) -> int:
        return self._max_leases

    def __len__(self) -> int:
        return len(self._by_resource)

    def acquire(
        self,
        resource: str,
        holder: str,
        now_s: float,
        ttl_s: float,
        heartbeat_interval_s: float,
        lease_id: str,
        data: tuple[tuple[str, str], ...] = (),
        missed_allowed: int = 3,
    ) -> Lease | None:
        """A new lease on ``resource``, or None while a live one is held (by anyone).

        ValueError on invalid arguments, on a ``lease_id`` already in the table
        for another live lease, and when ``max_leases`` live leases exist.
        """
        lease = Lease(
            id=lease_id,
            resource=resource,
            holder=holder,
            acquired_at_s=now_s,
            last_heartbeat_s=now_s,
            ttl_s=ttl_s,
            heartbeat_interval_s=heartbeat_interval_s,
            missed_allowed=missed_allowed,
            data=data,
        )
        current = self._by_resource.get(resource)
        if current is not None and not current.expired(now_s):
            return None
        other_resource = self._resource_of.get(lease_id)
        if other_resource is not None and other_resource != resource:
            other = self._by_resource[other_resource]
            if not other.expired(now_s):
                raise ValueError(f"lease_id: {lease_id!r} already names a live lease on {other_resource!r}")
            self._remove(other)
        if current is not None:
            self._remove(current)  # an expired lease is replaced: the new holder carries on
        if len(self._by_resource) >= self._max_leases:
            dead = [x for x in self._by_resource.values() if x.expired(now_s)]
            if not dead:
                raise ValueError(
                    f"resource: cannot lease {resource!r}, the table already holds max_leases "
                    f"({self._max_leases}) live leases"
                )
            for x in dead:  # no longer held by anyone; dropping them keeps the bound
                self._remove(x)
        self._by_resource[resource] = lease
        self._resource_of[lease_id] = resource
        return lease

    def heartbeat(self, lease_id: str, holder: str, now_s: float) -> Lease:
        """Renew the lease; LeaseLost if it is unknown, someone else's, or expired.

        A heartbeat at exactly ``missed_allowed`` intervals still renews (the
        expiry test is strict). The TTL is not extended.
        """
        lease = self._held(lease_id, holder)
        if lease.expired(now_s):
            raise LeaseLost(lease_id, holder, "expired")
        renewed = replace(lease, last_heartbeat_s=max(lease.last_heartbeat_s, now_s))
        self._by_resource[lease.resource] = renewed
        return renewed

    def release(self, lease_id: str, holder: str) -> bool:
        """Give the lease up. True if it was removed, False if it was not in the table.

        Idempotent (a second release returns False). LeaseLost when another
        holder owns ``lease_id``. Releasing one's own lease that has already
        expired but is still in the table removes it: it was dead anyway, and a
        lease that replaced it has a different id.
        """
        if lease_id not in self._resource_of:
            return False
        lease = self._held(lease_id, holder)
        self._remove(lease)
        return True

    def get(self, resource: str) -> Lease | None:
        """The lease on ``resource``, possibly expired: check ``lease.expired(now_s)``."""
        return self._by_resource.get(resource)

    def expire(self, now_s: float) -> list[Lease]:
        """Remove and return the leases expired at ``now_s``, ordered by resource."""
        dead = [x for _, x in sorted(self._by_resource.items()) if x.expired(now_s)]
        for x in dead:
            self._remove(x)
        return dead

    def leases(self) -> list[Lease]:
        """Every lease in the table, live or not yet expired away, ordered by resource."""
        return [x for _, x in sorted(self._by_resource.items())]

    def to_dict(self) -> dict[str, Any]:
        return {"leases": [x.to_dict() for x in self.leases()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], max_leases: int = 1024) -> LeaseTable:
        """Read back ``to_dict()`` output. ValueError on malformed input, duplicate
        resources or ids, or more leases than ``max_leases``."""
        table = cls(max_leases)
        if not isinstance(d, Mapping) or not isinstance(d.get("leases"), list):
            raise ValueError("leases: must be a mapping with a list under 'leases'")
        if len(d["leases"]) > max_leases:
            raise ValueError(f"leases: {len(d['leases'])} persisted, more than max_leases ({max_leases})")
        for raw in d["leases"]:
            lease = Lease.from_dict(raw)
            if lease.resource in table._by_resource:
                raise ValueError(f"resource: {lease.resource!r} appears twice")
            if lease.id in table._resource_of:
                raise ValueError(f"id: {lease.id!r} appears twice")
            table._by_resource[lease.resource] = lease
            table._resource_of[lease.id] = lease.resource
        return table

    # ------------------------------------------------------------------ internals

    def _held(self, lease_id: str, holder: str) -> Lease:
        resource = self._resource_of.get(lease_id)
        if resource is None:
            raise LeaseLost(lease_id, holder, "unknown")
        lease = self._by_resource[resource]
        if lease.holder != holder:
            raise LeaseLost(lease_id, holder, "holder")
        return lease

    def _remove(self, lease: Lease) -> None:
        del self._by_resource[lease.resource]
        del self._resource_of[lease.id]
