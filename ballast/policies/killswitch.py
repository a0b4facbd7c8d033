"""Kill switch entries: who may not be served right now, why, and until when.

An entry names a scope — ``global``, ``tenant``, ``model`` or ``criticality`` — and,
except for ``global``, the value it applies to. Every entry carries a reason, who
set it, and a mandatory expiry: a kill switch nobody remembers to lift must lift
itself. Matching is pure and takes the wall time as an argument; the controller
holds the entries, routers receive them in the snapshot.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

SCOPES = ("global", "tenant", "model", "criticality")
MAX_EXPIRES_IN_S = 7 * 24 * 3600  # a week: anything longer is a config change, not a switch
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class KillSwitchEntry:
    id: str
    scope: str
    value: str | None
    reason: str
    set_by: str
    created_at_s: float  # wall clock: entries cross processes
    expires_at_s: float

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope: must be one of {', '.join(SCOPES)}")
        if self.scope == "global" and self.value is not None:
            raise ValueError("value: must be null for the global scope")
        if self.scope != "global" and not (isinstance(self.value, str) and self.value.strip()):
            raise ValueError(f"value: the {self.scope} scope needs a value")
        if not isinstance(self.reason, str) or not self.reason.strip() or len(self.reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason: required, at most {MAX_REASON_CHARS} characters")
        if not (0 < self.expires_at_s - self.created_at_s <= MAX_EXPIRES_IN_S):
            raise ValueError(f"expires_in_s: must be in (0, {MAX_EXPIRES_IN_S}]")

    @classmethod
    def create(
        cls, id: str, scope: str, value: str | None, reason: str, set_by: str, now_s: float, expires_in_s: float
    ) -> KillSwitchEntry:
        return cls(id, scope, value, reason, set_by, now_s, now_s + expires_in_s)

    def expired(self, now_s: float) -> bool:
        return now_s >= self.expires_at_s

    def matches(self, tenant: str, model: str, criticality: str) -> bool:
        if self.scope == "global":
            return True
        return self.value == {"tenant": tenant, "model": model, "criticality": criticality}[self.scope]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KillSwitchEntry:
        return cls(**d)


def check_value(scope: str, value: str | None, allowed: dict[str, Iterable[str]]) -> None:
    """Refuse a value that names nothing: ``allowed`` maps each valued scope (``tenant``,
    ``model``, ``criticality``) to the names that exist. An entry for an unknown name
    would be accepted and block nothing, while the operator believes traffic is off;
    so the value must equal a name exactly (no trimming, no case folding).
    ValueError naming the field and the allowed values."""
    if scope not in SCOPES:
        raise ValueError(f"scope: must be one of {', '.join(SCOPES)}")
    if scope == "global":
        return
    names = sorted(allowed.get(scope, ()))
    if value not in names:
        raise ValueError(f"value: no {scope} {value!r}; one of {', '.join(names) or '(none configured)'}")


#: An entry's id as ``KillSwitchEntry.create``'s caller makes it (12 hex characters).
ID_PATTERN = re.compile(r"[0-9a-f]{12}")
MAX_SET_BY_CHARS = 64


def check_entry(entry: KillSwitchEntry, allowed: dict[str, Iterable[str]], now_s: float) -> None:
    """Refuse an entry that a new admin call could not have made now: its value names
    nothing (``check_value``), its id or ``set_by`` is not one the controller writes, or
    it would last longer from ``now_s`` than ``MAX_EXPIRES_IN_S``. The controller runs it
    on the entry an admin call makes and on each one read back from Ray's KV store (the
    shape is ``KillSwitchEntry``'s own check). ValueError naming the field."""
    check_value(entry.scope, entry.value, allowed)
    if not isinstance(entry.id, str) or not ID_PATTERN.fullmatch(entry.id):
        raise ValueError("id: want 12 hex characters")
    if not isinstance(entry.set_by, str) or len(entry.set_by) > MAX_SET_BY_CHARS:
        raise ValueError(f"set_by: a string of at most {MAX_SET_BY_CHARS} characters")
    if entry.expires_at_s - now_s > MAX_EXPIRES_IN_S:
        raise ValueError(f"expires_in_s: must be in (0, {MAX_EXPIRES_IN_S}] from now")


def active(entries: Iterable[KillSwitchEntry], now_s: float) -> list[KillSwitchEntry]:
    return [e for e in entries if not e.expired(now_s)]


def blocking(entries: Iterable[KillSwitchEntry], now_s: float, tenant: str, criticality: str) -> KillSwitchEntry | None:
    """The entry that refuses this request outright (global, tenant or criticality scope)."""
    for e in entries:
        if e.scope != "model" and not e.expired(now_s) and e.matches(tenant, "", criticality):
            return e
    return None


def model_blocked(entries: Iterable[KillSwitchEntry], now_s: float, model: str) -> KillSwitchEntry | None:
    """The entry that takes ``model`` out of the fallback chain, if any."""
    for e in entries:
        if e.scope == "model" and not e.expired(now_s) and e.value == model:
            return e
    return None
