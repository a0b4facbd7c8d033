"""The controller's published snapshot, and the fail-static cache routers and replicas keep.

A ``Snapshot`` crosses process boundaries as a dict (``to_dict``/``from_dict``) and is
typed on both sides. Whatever it says about a model is that model's ``ModelState`` in
``models``, which holds every model alike: its level, target level and reason, the
constraints of its level, the inputs they came from, its deployment, the rows its
engines run usefully and how its requests spread over its replicas. Nothing about a
model is at the top level; a reader names the model it wants.

A ``SnapshotCache`` lives in every router and replica: it holds the newest snapshot
it has seen and answers "what level and constraints apply now to this model"
(``effective(model)``) without I/O, so the hot path never waits on the controller.

Fail-static: while the newest snapshot is younger than ``max_stale_s`` a model's level
in it is used as is (even if the controller is briefly gone — a restarting controller
must not fail a request). Past that, or for a model the snapshot does not name, the
cache serves a conservative level (``ballast.policies.degradation.conservative_level``)
until a fresh snapshot names it.

The ``SnapshotExchange`` loop is the only thing that talks to the controller: one
call per interval that pushes this process's report and pulls the snapshot back.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ballast.policies.control import RoutingSummary
from ballast.policies.degradation import (
    MAX_LEVEL,
    DegradationConfig,
    LevelConstraints,
    LoadSignals,
    conservative_level,
)
from ballast.policies.reports import ReplicaReport, RouterReport
from ballast.policies.validation import check_fields, check_int, check_name, check_positive

log = logging.getLogger("ballast.snapshot")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a str, got {value!r}")


def _check_ratio_or_none(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        raise ValueError(f"{name}: must be a number >= 0 or None, got {value!r}")


def _required(raw: Mapping[str, Any], name: str) -> Any:
    """``raw[name]``; a ValueError naming the field when it is missing."""
    if name not in raw:
        raise ValueError(f"{name}: missing from a model's state")
    return raw[name]


def _routing(raw: object) -> RoutingSummary:
    """A ``RoutingSummary`` from its ``as_dict`` (unknown keys ignored, each value checked)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"routing: must be a mapping, got {raw!r}")
    known = {f.name: raw.get(f.name) for f in fields(RoutingSummary)}
    for name, value in known.items():
        _check_ratio_or_none(f"routing.{name}", value)
    return RoutingSummary(**known)


@dataclass(frozen=True)
class ModelState:
    """One model as the controller saw it at its last tick: an entry of ``Snapshot.models``.

    Level 0 and reason "starting" before the model's first tick (``inputs`` None then).
    ``constraints`` are the level's under the controller's config; a router or replica
    acts on its own config's constraints for the level (``SnapshotCache.effective``).
    """

    deployment: str  # the model's Serve deployment
    constraints: LevelConstraints
    level: int = 0
    target_level: int = 0  # where the level is heading (it moves one step per sample at most)
    reason: str = "starting"
    inputs: LoadSignals | None = None  # the signals the level came from; None before the first tick
    # The rows its engines run usefully together (ballast.policies.control.engine_rows); None
    # where not every replica says (an engine Ballast batches, or one whose steps do not say yet).
    engine_rows: int | None = None
    routing: RoutingSummary = field(default_factory=RoutingSummary)  # how its requests spread
    # What HAProxy lets through of it per second (ballast.policies.edge.EdgeCeiling); None: no ceiling.
    edge_ceiling_rps: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, check_name, "deployment")
        check_fields(self, check_int, "level", "target_level", minimum=0, maximum=MAX_LEVEL)
        check_fields(self, _check_str, "reason")
        if not isinstance(self.constraints, LevelConstraints):
            raise ValueError(f"constraints: must be LevelConstraints, got {self.constraints!r}")
        if self.inputs is not None and not isinstance(self.inputs, LoadSignals):
            raise ValueError(f"inputs: must be LoadSignals or None, got {self.inputs!r}")
        if self.engine_rows is not None:
            check_fields(self, check_int, "engine_rows", minimum=0)
        if not isinstance(self.routing, RoutingSummary):
            raise ValueError(f"routing: must be a RoutingSummary, got {self.routing!r}")
        check_fields(self, check_positive, "edge_ceiling_rps", optional=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "level": self.level,
            "target_level": self.target_level,
            "reason": self.reason,
            "constraints": self.constraints.to_dict(),
            "inputs": self.inputs.to_dict() if self.inputs is not None else None,
            "engine_rows": self.engine_rows,
            "routing": self.routing.as_dict(),
            "edge_ceiling_rps": self.edge_ceiling_rps,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelState:
        """The state ``to_dict`` wrote. Unknown keys are ignored (a newer controller's); a
        malformed one raises ValueError naming the field. ``inputs`` empty (an older
        controller's "not yet") is None."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"a model's state must be a mapping, got {raw!r}")
        inputs = raw.get("inputs")
        if inputs is not None and not isinstance(inputs, Mapping):
            raise ValueError(f"inputs: must be a mapping or None, got {inputs!r}")
        constraints = raw.get("constraints")
        if not isinstance(constraints, Mapping):
            raise ValueError(f"constraints: must be a mapping, got {constraints!r}")
        return cls(
            deployment=_required(raw, "deployment"),  # each value is checked in __post_init__
            constraints=LevelConstraints.from_dict(constraints),
            level=_required(raw, "level"),
            target_level=_required(raw, "target_level"),
            reason=_required(raw, "reason"),
            inputs=LoadSignals.from_dict(inputs) if inputs else None,
            engine_rows=raw.get("engine_rows"),
            routing=_routing(raw.get("routing", {})),
            edge_ceiling_rps=raw.get("edge_ceiling_rps"),
        )


def _check_models(name: str, models: object) -> None:
    if not isinstance(models, Mapping):
        raise ValueError(f"{name}: must be a mapping of model names to ModelState, got {models!r}")
    for model, state in models.items():
        if not isinstance(model, str) or not model or not isinstance(state, ModelState):
            raise ValueError(f"{name}: {model!r} must name a ModelState, got {type(state).__name__}")


@dataclass(frozen=True)
class Snapshot:
    epoch: str  # changes when the controller restarts; versions restart with it
    version: int
    created_at_s: float  # wall clock (time.time()): compared across processes
    # Every model, alike: name -> its state. Empty from a controller that predates it.
    models: Mapping[str, ModelState] = field(default_factory=dict)
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

    def __post_init__(self) -> None:
        check_fields(self, _check_models, "models")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what crosses the process boundary): each model's ``ModelState.to_dict``,
        the rest deep-copied."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "models"}
        out["models"] = {name: state.to_dict() for name, state in self.models.items()}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Snapshot:
        """The snapshot ``to_dict`` wrote, typed again. Unknown keys are ignored: a newer
        controller (rolling upgrade) may add fields, an older one wrote the first model's
        level at the top as well, and replies carry per-sender extras next to the snapshot
        (router leases). A malformed model state raises ValueError."""
        kept = {k: v for k, v in d.items() if k in _SNAPSHOT_FIELDS and k != "models"}
        raw_models = d.get("models") or {}
        if not isinstance(raw_models, Mapping):
            raise ValueError(f"models: must be a mapping, got {raw_models!r}")
        models = {name: ModelState.from_dict(raw) for name, raw in raw_models.items()}
        return cls(**kept, models=models)

    def is_newer_than(self, other: Snapshot | None) -> bool:
        if other is None:
            return True
        if other.epoch != self.epoch:  # a restarted controller: its versions start over
            return self.created_at_s >= other.created_at_s
        return self.version > other.version


_SNAPSHOT_FIELDS = frozenset(f.name for f in fields(Snapshot))


@dataclass(frozen=True)
class EffectiveState:
    """What the hot path acts on for one model: level, its constraints, and why."""

    level: int
    constraints: LevelConstraints
    source: str  # "snapshot" | "stale-snapshot" | "fail-static"
    snapshot_age_s: float | None
    version: int | None


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
        self._snapshot: Snapshot | None = None

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def offer(self, snap: Snapshot) -> bool:
        """Keep ``snap`` if it is newer than what we hold; True when kept."""
        if snap.is_newer_than(self._snapshot):
            self._snapshot = snap
            return True
        return False

    def age_s(self) -> float | None:
        if self._snapshot is None:
            return None
        return max(0.0, self._clock() - self._snapshot.created_at_s)

    def is_fresh(self) -> bool:
        age = self.age_s()
        return age is not None and age <= self._stale_s

    def effective(self, model: str) -> EffectiveState:
        """The level and constraints to act on for ``model``: its level in the snapshot while
        the snapshot is at most ``max_stale_s`` old; fail-static past that, from that last
        level, and at once for a model the snapshot does not name (fail closed). The
        constraints are this process's own config's for the level (the controller publishes
        a level, the cache maps it)."""
        snap, age = self._snapshot, self.age_s()
        state = snap.models.get(model) if snap is not None else None
        last = state.level if state is not None else None
        if snap is not None and last is not None and age is not None and age <= self._max_stale_s:
            source = "snapshot" if age <= self._stale_s else "stale-snapshot"
            return EffectiveState(last, self._deg.constraints[last], source, age, snap.version)
        level = conservative_level(last, self._floor)
        return EffectiveState(level, self._deg.constraints[level], "fail-static", age, snap.version if snap else None)

    def heading(self, model: str) -> int:
        """The effective level, or the level the controller is heading to where that is
        higher (the target of a snapshot fresh enough to act on): what batch dispatch acts
        on, so that batch work stops as soon as the controller sees the pressure, before
        the level moves and sheds an interactive class."""
        eff = self.effective(model)
        state = self._snapshot.models.get(model) if self._snapshot is not None else None
        if state is None or eff.source != "snapshot":
            return eff.level
        return max(eff.level, state.target_level)


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
    on_snapshot: Callable[[Snapshot], None] | None = None
    #: Sees every reply, for per-sender extras (leases).
    on_reply: Callable[[dict[str, Any]], None] | None = None
    failures: int = field(default=0, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

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
