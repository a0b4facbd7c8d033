"""What operators set, off the request path: kill switches, LoRA adapters added at run
time, chaos settings, and the audit trail of every admin action.

``AdminState`` is the controller's part for them (``ControllerCore.admin``): each admin
call is checked here, as the same call would be after a restart (a kill switch's value must
name a tenant, model or class that exists, ``killswitch.check_entry``; an adapter must pass
``ballast.policies.adapters.check`` against the config's catalog), recorded in the bounded
audit trail, marks the state ``dirty`` (the actor persists it in Ray's KV store before the
admin call answers) and calls ``on_change`` (the controller publishes a new snapshot at
once: routers and replicas act on it at their next exchange). ``adopt`` takes a persisted
state back after a restart, each record checked again; a refused one is logged and dropped.

Adding a run-time adapter takes three calls: ``reserve_adapter`` holds the name while the
router tries a load on one replica (at most ``ADAPTER_RESERVE_S``; a restart drops it),
then ``set_adapter`` records it, or ``release_adapter`` frees the name.

Everything is bounded: ``MAX_KILL_SWITCHES`` entries, ``MAX_RUNTIME_ADAPTERS`` adapters and
reservations together, ``MAX_AUDIT`` audit events (oldest dropped); expired kill switches
and reservations are dropped when next looked at.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from ballast.config import BallastConfig
from ballast.errors import AdapterConflict
from ballast.names import CHAOS_TARGETS
from ballast.policies import adapters as adapter_rule
from ballast.policies import killswitch
from ballast.policies.adapters import MAX_RUNTIME_ADAPTERS, RuntimeAdapter, with_runtime
from ballast.policies.catalog import Catalog, CatalogError
from ballast.policies.criticality import Criticality
from ballast.policies.killswitch import KillSwitchEntry

log = logging.getLogger("ballast.controller")

MAX_KILL_SWITCHES = 256
MAX_AUDIT = 1000
#: How long a name stays reserved for an add in flight (``reserve_adapter``): the router's
#: trial load (150 s at most) and its calls here, with room.
ADAPTER_RESERVE_S = 180.0
#: Who an admin action is recorded as: the credential it proved (one shared admin token);
#: the operator it names (``X-Ballast-Operator``) is its claim, recorded as such.
ADMIN_CREDENTIAL = "admin_token"


class AdminState:
    """Kill switches, run-time adapters, chaos settings and the audit trail (module docstring).

    ``clock`` (monotonic) times the reservations; ``wall`` stamps entries, expiries and audit
    events (they are compared across restarts). Survives ``configure`` (a redeploy).
    """

    def __init__(
        self,
        cfg: BallastConfig,
        clock: Callable[[], float],
        wall: Callable[[], float],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._wall = wall
        self._on_change = on_change
        self.dirty = False  # changed since the actor last persisted it
        self._kill_switches: OrderedDict[str, KillSwitchEntry] = OrderedDict()
        self._adapters: OrderedDict[str, RuntimeAdapter] = OrderedDict()  # LoRA adapters added at run time
        # Names held for an add in flight: name -> (path, until, on self._clock). Bounded
        # with _adapters by MAX_RUNTIME_ADAPTERS; never persisted (a restart drops them).
        self._reserved: dict[str, tuple[str, float]] = {}
        self._audit: deque[dict[str, Any]] = deque(maxlen=MAX_AUDIT)
        self._chaos: dict[str, dict[str, Any]] = {}

    def configure(self, cfg: BallastConfig) -> None:
        """A redeploy's config: what operators set stays (checked against it when next changed)."""
        self.cfg = cfg

    # -- what the snapshot carries, and what the actor persists ---------------------------------
    def kill_switch_entries(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self._kill_switches.values()]

    def adapter_entries(self) -> list[dict[str, Any]]:
        return [a.to_dict() for a in self._adapters.values()]

    def chaos(self) -> dict[str, dict[str, Any]]:
        return dict(self._chaos)

    def to_dict(self) -> dict[str, Any]:
        """What operators set, to persist: kill switches, run-time adapters, chaos settings,
        the audit trail."""
        return {
            "kill_switches": [e.to_dict() for e in self._kill_switches.values()],
            "adapters": [a.to_dict() for a in self._adapters.values()],
            "chaos": dict(self._chaos),
            "audit": list(self._audit),
        }

    def adopt(self, state: Any) -> int:
        """Take back what a previous controller persisted, each record checked as a new
        admin call would be: run-time adapters first (``adapter_rule.check`` against this
        config), then kill switches (``killswitch.check_entry``: a value must name what
        exists, the adapters just adopted included). A refused record is logged and
        dropped, never applied; an expired kill switch is dropped quietly; a state written
        before adapters were kept has none. Returns the kill switches adopted."""
        if not isinstance(state, dict):
            raise ValueError(f"admin state: want an object, got {type(state).__name__}")
        self._adopt_adapters(state.get("adapters"))
        self._adopt_kill_switches(state.get("kill_switches"))
        for target, settings in dict(state.get("chaos") or {}).items():
            if target in CHAOS_TARGETS and isinstance(settings, dict):
                self._chaos[target] = dict(settings)
        self._audit.extend(e for e in list(state.get("audit") or [])[-MAX_AUDIT:] if isinstance(e, dict))
        self.record(
            "admin_state_adopted",
            "controller",
            kill_switches=len(self._kill_switches),
            adapters=len(self._adapters),
            chaos=sorted(self._chaos),
        )
        self._changed()
        return len(self._kill_switches)

    def _adopt_kill_switches(self, raw_entries: Any) -> None:
        if not isinstance(raw_entries, list):
            return
        now, names = self._wall(), self._kill_switch_names()
        for raw in raw_entries[:MAX_KILL_SWITCHES]:
            try:
                entry = KillSwitchEntry.from_dict(raw)
                if entry.expired(now):
                    continue
                killswitch.check_entry(entry, names, now)
            except (TypeError, ValueError) as exc:
                log.warning("dropped a persisted kill switch %r: %s", raw, exc)
                continue
            self._kill_switches[entry.id] = entry

    def _adopt_adapters(self, raw_entries: Any) -> None:
        """Take back the persisted run-time adapters (the first ``MAX_RUNTIME_ADAPTERS``),
        each checked against the config's catalog with those adopted before it."""
        if not isinstance(raw_entries, list):
            return
        for raw in raw_entries[:MAX_RUNTIME_ADAPTERS]:
            try:
                entry = RuntimeAdapter.from_dict(raw)
                adapter_rule.check(self.runtime_catalog(), entry, self.cfg.adapters_root)
            except (TypeError, ValueError) as exc:  # CatalogError is a ValueError
                log.warning("dropped a persisted adapter %r: %s", raw, exc)
                continue
            self._adapters[entry.name] = entry

    def _changed(self) -> None:
        """A change goes out at once (``on_change``: the controller republishes), and is persisted."""
        self.dirty = True
        self._on_change()

    def record(self, action: str, by: str, **fields: Any) -> dict[str, Any]:
        """An audit event of the controller's own (``by``: "controller")."""
        event = {"at_s": round(self._wall(), 3), "action": action, "by": by, **fields}
        self._audit.append(event)
        log.warning("ballast.audit %s", json.dumps(event, sort_keys=True))
        return event

    def audit_admin(self, action: str, claimed: str, **fields: Any) -> dict[str, Any]:
        """An audit event of an admin call: ``by`` the credential it proved (the admin
        token), ``operator_claimed`` the operator its ``X-Ballast-Operator`` header named
        (unverified: any holder of the token may name anyone; null when none)."""
        return self.record(action, ADMIN_CREDENTIAL, operator_claimed=claimed or None, **fields)

    def expire_kill_switches(self) -> None:
        now = self._wall()
        for entry_id in [i for i, e in self._kill_switches.items() if e.expired(now)]:
            entry = self._kill_switches.pop(entry_id)
            self.record("kill_switch_expired", "controller", entry=entry.to_dict())
            self.dirty = True

    def set_kill_switch(
        self, scope: str, value: str | None, reason: str, expires_in_s: float, set_by: str
    ) -> dict[str, Any]:
        """Add an entry; ValueError (naming the field) when it is malformed, fails
        ``killswitch.check_entry`` (the check a persisted entry is read back with) or the
        table is full."""
        killswitch.check_value(scope, value, self._kill_switch_names())  # the value first: 422 listing the names
        self.expire_kill_switches()
        if len(self._kill_switches) >= MAX_KILL_SWITCHES:
            raise ValueError(f"scope: at most {MAX_KILL_SWITCHES} kill switches may be active")
        now = self._wall()
        entry = KillSwitchEntry.create(uuid.uuid4().hex[:12], scope, value, reason, set_by, now, float(expires_in_s))
        killswitch.check_entry(entry, self._kill_switch_names(), now)
        self._kill_switches[entry.id] = entry
        self.audit_admin("kill_switch_set", set_by, entry=entry.to_dict())
        self._changed()
        return entry.to_dict()

    def _kill_switch_names(self) -> dict[str, Iterable[str]]:
        """What a valued kill switch may name: the configured tenants and classes; every
        model, its fallback's model and its adapters (the config's and the run-time ones)."""
        models: list[str] = []
        for m in self.cfg.models:
            fallback = self.cfg.fallback_of(m.name)
            models += [m.name] + ([fallback.model.name] if fallback is not None else [])
        models += [a.name for entry in self.runtime_catalog().models for a in entry.adapters]
        return {"tenant": list(self.cfg.tenants), "model": models, "criticality": [c.value for c in Criticality]}

    def delete_kill_switch(self, entry_id: str, by: str) -> bool:
        entry = self._kill_switches.pop(entry_id, None)
        if entry is not None:
            self.audit_admin("kill_switch_deleted", by, entry=entry.to_dict())
            self._changed()
        return entry is not None

    def kill_switches(self) -> dict[str, Any]:
        self.expire_kill_switches()
        return {
            "entries": [e.to_dict() for e in self._kill_switches.values()],
            "audit": list(self._audit),
        }

    # -- LoRA adapters added at run time: reserve, the router's trial load, then set -----------
    def reserve_adapter(self, model: str, name: str, path: str, tenants: list[str]) -> None:
        """Hold ``name`` for an add in flight (the router's trial load comes next, then
        ``set_adapter`` with the same path) for at most ``ADAPTER_RESERVE_S``.
        AdapterConflict while a run-time adapter or another add in flight holds the name;
        ValueError (naming the field) when ``set_adapter`` would refuse the add."""
        self._expire_reservations()
        self._check_free(name, path, reserved_ok=False)
        self._checked(model, name, path, tenants, "")
        self._reserved[name] = (path, self._clock() + ADAPTER_RESERVE_S)

    def release_adapter(self, name: str, path: str) -> bool:
        """Drop the reservation of ``name`` for ``path`` (its trial load failed); False
        when there is none (expired, or another path's)."""
        held = self._reserved.get(name)
        if held is None or held[0] != path:
            return False
        del self._reserved[name]
        return True

    def set_adapter(self, model: str, name: str, path: str, tenants: list[str], by: str) -> dict[str, Any]:
        """Add a run-time adapter to the catalog every router and replica follows, ending
        its reservation. AdapterConflict when the name is a run-time adapter's or reserved
        for another path; ValueError (naming the field) when ``adapter_rule.check`` refuses
        it (no ``adapters_root``, a path outside it, the catalog: an unknown or non-vLLM
        model, a name taken or invalid, tenants outside the model's grant) or the table is
        full. ``tenants``: the names, or ``["*"]`` for every tenant the model admits."""
        self._expire_reservations()
        self._check_free(name, path, reserved_ok=True)
        entry = self._checked(model, name, path, tenants, by)
        self._reserved.pop(name, None)
        self._adapters[name] = entry
        self.audit_admin("adapter_added", by, adapter=entry.to_dict())
        self._changed()
        return entry.to_dict()

    def _check_free(self, name: str, path: str, reserved_ok: bool) -> None:
        """AdapterConflict while ``name`` is a run-time adapter's, or reserved (for another
        path, or at all unless ``reserved_ok``)."""
        if name in self._adapters:
            raise AdapterConflict(f"name: {name!r} is an adapter added at run time; delete it first")
        held = self._reserved.get(name)
        if held is not None and not (reserved_ok and held[0] == path):
            raise AdapterConflict(f"name: another add of {name!r} is in flight; try again once it ends")

    def _checked(self, model: str, name: str, path: str, tenants: list[str], by: str) -> RuntimeAdapter:
        """The record, once ``adapter_rule.check`` and the table's bound pass; ValueError
        (naming the field) otherwise."""
        others = sum(1 for n in self._reserved if n != name)
        if len(self._adapters) + others >= MAX_RUNTIME_ADAPTERS:
            raise ValueError(f"name: at most {MAX_RUNTIME_ADAPTERS} adapters may be added at run time")
        entry = RuntimeAdapter.create(model, name, path, tenants, round(self._wall(), 3), by)
        try:
            adapter_rule.check(self.runtime_catalog(), entry, self.cfg.adapters_root)
        except CatalogError as e:
            raise ValueError(str(e)) from None  # one argument: "field: reason", as the router reads it
        return entry

    def _expire_reservations(self) -> None:
        now = self._clock()
        for name in [n for n, (_, until) in self._reserved.items() if now >= until]:
            del self._reserved[name]

    def delete_adapter(self, name: str, by: str) -> bool:
        """Remove a run-time adapter; False when none has that name (a config's adapter is
        none: it goes with the config)."""
        entry = self._adapters.pop(name, None)
        if entry is not None:
            self.audit_admin("adapter_deleted", by, adapter=entry.to_dict())
            self._changed()
        return entry is not None

    def adapters(self) -> list[dict[str, Any]]:
        return [a.to_dict() for a in self._adapters.values()]

    def runtime_catalog(self) -> Catalog:
        """The config's catalog with the run-time adapters that fit it."""
        return with_runtime(self.cfg.catalog(), list(self._adapters.values()))[0]

    def set_chaos(self, target: str, settings: dict[str, Any], by: str) -> dict[str, Any]:
        if target not in CHAOS_TARGETS:
            raise ValueError(f"target: must be one of {', '.join(CHAOS_TARGETS)}")
        self._chaos[target] = dict(settings)
        self.audit_admin("chaos_set", by, target=target, settings=settings)
        self._changed()
        return dict(self._chaos)

    def clear_chaos(self, by: str) -> None:
        self._chaos.clear()
        self.audit_admin("chaos_cleared", by)
        self._changed()
