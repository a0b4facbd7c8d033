"""The controller's published snapshot, and the fail-static cache routers and replicas keep.

A ``Snapshot`` is plain data (it crosses process boundaries as a dict). A
``SnapshotCache`` lives in every router and replica: it holds the newest snapshot
it has seen and answers "what level and constraints apply now" without I/O, so
the hot path never waits on the controller.

A snapshot carries one level per model (``models``: name -> level, target level,
reason, constraints, inputs, deployment); its top-level level and constraints are the
first model's, so a reader that knows one model reads them as before.
``SnapshotCache.effective(model)`` gives that model's.

Fail-static: while the newest snapshot is younger than ``max_stale_s`` it is used
as is (even if the controller is briefly gone — a restarting controller must not
fail a request). Past that, the cache serves a conservative level
(``ballast.policies.degradation.conservative_level``) until a fresh snapshot arrives.

The ``SnapshotExchange`` loop is the only thing that talks to the controller: one
call per interval that pushes this process's report and pulls the snapshot back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Awaitable, Callable, Optional

from ballast.policies.degradation import DegradationConfig, LevelConstraints, conservative_level
from ballast.policies.reports import ReplicaReport, RouterReport

log = logging.getLogger("ballast.snapshot")


@dataclass(frozen=True)
class Snapshot:
    epoch: str  # changes when the controller restarts; versions restart with it
    version: int
    created_at_s: float  # wall clock (time.time()): compared across processes
    # The first model's level, why, and its inputs (every model's is in ``models``).
    level: int
    target_level: int
    reason: str
    constraints: dict[str, Any]
    inputs: dict[str, Any] = field(default_factory=dict)
    # Every model's, the first included: name -> {"level", "target_level", "reason",
    # "constraints", "inputs", "deployment", "engine_rows" (the rows its engines run
    # usefully together, None where not known), "routing"}. Empty from a controller that
    # predates it.
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    desired_replicas: dict[str, int] = field(default_factory=dict)
    running_replicas: dict[str, int] = field(default_factory=dict)
    autoscale: dict[str, dict[str, Any]] = field(default_factory=dict)
    kill_switches: list[dict[str, Any]] = field(default_factory=list)
    # LoRA adapters added at run time (ballast.policies.adapters.RuntimeAdapter.to_dict): model,
    # name, path, tenants (a list, or None: every tenant the model admits), added_at_s, added_by.
    adapters: list[dict[str, Any]] = field(default_factory=list)
    chaos: dict[str, dict[str, Any]] = field(default_factory=dict)  # target -> settings
    # replica_id -> {"reason", "lease_id", "expires_at_s"}: these replicas drain (fail their
    # health check) until the order's lease expires or the order disappears.
    recycle_orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    recycle: dict[str, Any] = field(default_factory=dict)  # in flight, availability: for /v1/status

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Snapshot":
        # Unknown keys are ignored: a newer controller (rolling upgrade) may add fields,
        # and replies may carry per-sender extras next to the snapshot (router leases).
        return cls(**{k: v for k, v in d.items() if k in _SNAPSHOT_FIELDS})

    def is_newer_than(self, other: "Optional[Snapshot]") -> bool:
        if other is None:
            return True
        if other.epoch != self.epoch:  # a restarted controller: its versions start over
            return self.created_at_s >= other.created_at_s
        return self.version > other.version


_SNAPSHOT_FIELDS = frozenset(f.name for f in fields(Snapshot))


@dataclass(frozen=True)
class EffectiveState:
    """What the hot path acts on: level, its constraints, and why."""

    level: int
    constraints: LevelConstraints
    source: str  # "snapshot" | "stale-snapshot" | "fail-static"
    snapshot_age_s: Optional[float]
    version: Optional[int]


class SnapshotCache:
    def __init__(
        self,
        degradation: DegradationConfig,
        stale_s: float,
        max_stale_s: float,
        fail_static_level: int,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._deg = degradation
        self._stale_s = stale_s
        self._max_stale_s = max_stale_s
        self._floor = fail_static_level
        self._clock = wall_clock
        self._snapshot: Optional[Snapshot] = None

    @property
    def snapshot(self) -> Optional[Snapshot]:
        return self._snapshot

    def offer(self, snap: Snapshot) -> bool:
        """Keep ``snap`` if it is newer than what we hold; True when kept."""
        if snap.is_newer_than(self._snapshot):
            self._snapshot = snap
            return True
        return False

    def age_s(self) -> Optional[float]:
        if self._snapshot is None:
            return None
        return max(0.0, self._clock() - self._snapshot.created_at_s)

    def is_fresh(self) -> bool:
        age = self.age_s()
        return age is not None and age <= self._stale_s

    def effective(self, model: Optional[str] = None) -> EffectiveState:
        """The level and constraints to act on for ``model`` (None, or a model the snapshot
        does not name: the top level, the first model's). Fail-static from that model's
        last level once the snapshot is older than ``max_stale_s``."""
        snap, age = self._snapshot, self.age_s()
        last = _level_of(snap, model) if snap is not None else None
        if snap is not None and last is not None and age is not None and age <= self._max_stale_s:
            source = "snapshot" if age <= self._stale_s else "stale-snapshot"
            return EffectiveState(last, self._deg.constraints[last], source, age, snap.version)
        level = conservative_level(last, self._floor)
        return EffectiveState(level, self._deg.constraints[level], "fail-static", age, snap.version if snap else None)


def _level_of(snap: Snapshot, model: Optional[str]) -> int:
    """``model``'s level in ``snap``, else the top-level one. The level's constraints are this
    process's own config's (the controller publishes a level, the cache maps it)."""
    entry = snap.models.get(model) if model is not None else None
    return int(entry["level"]) if isinstance(entry, dict) and "level" in entry else snap.level


#: What a router or a replica sends in each exchange (ballast.policies.reports).
Report = RouterReport | ReplicaReport


@dataclass(eq=False)
class SnapshotExchange:
    """Background loop: push ``make_report()`` to the controller, take the snapshot back.

    ``call`` is ``async (report) -> snapshot dict``; it is given a timeout here, and
    any failure (controller dead, restarting, slow) only means this tick's snapshot
    is skipped — the cache keeps serving fail-static.
    """

    cache: SnapshotCache
    call: Callable[[Report], Awaitable[dict[str, Any]]]
    make_report: Callable[[], Report]
    interval_s: float
    timeout_s: float
    on_snapshot: Optional[Callable[[Snapshot], None]] = None
    #: Sees every reply, for per-sender extras (leases).
    on_reply: Optional[Callable[[dict[str, Any]], None]] = None
    failures: int = field(default=0, init=False)
    _task: Optional[asyncio.Task] = field(default=None, init=False, repr=False)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def exchange_once(self) -> bool:
        try:
            raw = await asyncio.wait_for(self.call(self.make_report()), self.timeout_s)
            snap = Snapshot.from_dict(raw)
            if self.cache.offer(snap) and self.on_snapshot is not None:
                self.on_snapshot(snap)
            if self.on_reply is not None:
                self.on_reply(raw)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure (dead controller, bad reply): keep the last snapshot
            self.failures += 1
            if self.failures in (1, 10) or self.failures % 100 == 0:
                log.warning("controller exchange failed (%d so far): %r", self.failures, e)
            return False
        return True

    async def _run(self) -> None:
        while True:
            await self.exchange_once()
            await asyncio.sleep(self.interval_s)
