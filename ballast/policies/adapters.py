"""LoRA adapters added at run time: the record the controller keeps and publishes, the
catalog they make on top of the config's, and what a replica loads and unloads to match.

The controller holds at most ``MAX_RUNTIME_ADAPTERS`` records (``RuntimeAdapter``) and
publishes them in every snapshot. Routers apply them on top of the config's catalog
(``with_runtime``); replicas load the ones of their model (``replica_changes``). A
record that no longer fits the catalog (its model gone in a redeploy, its name taken by
an adapter the config now declares) is skipped by both, never fatal: the config wins.

Invariants of ``replica_changes``: an adapter the replica did not add at run time (one
from the config) is never unloaded; one it loaded on its own (the admin API's trial
load, before the controller lists it) is kept for ``grace_s`` even while unlisted, so
a snapshot that predates the listing does not unload it; a load that failed is tried
again no sooner than ``retry_s`` later (a bad directory does not reload every snapshot).

Written by hand: a record, a loop over ``Catalog.with_adapter`` and two set differences
with Ballast's own rules; no library holds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ballast.policies.catalog import Catalog, CatalogError, ModelEntry, AdapterEntry

#: Adapters the controller holds beyond the config's; one more is refused.
MAX_RUNTIME_ADAPTERS = 256
#: Bounds of a record's fields (an admin call's body is checked against the same).
MAX_PATH_CHARS = 4096
MAX_TENANTS = 1024
MAX_BY_CHARS = 64


@dataclass(frozen=True)
class RuntimeAdapter:
    """A LoRA adapter an operator added at run time: its model, name, local directory,
    the tenants that may use it (None: every tenant its model admits), when (wall clock)
    and by whom."""

    model: str
    name: str
    path: str
    tenants: Optional[tuple[str, ...]]
    added_at_s: float
    added_by: str

    def __post_init__(self) -> None:
        for f in ("model", "name", "path", "added_by"):
            if not isinstance(getattr(self, f), str):
                raise TypeError(f"{f}: want a string, got {type(getattr(self, f)).__name__}")
        if not self.path or len(self.path) > MAX_PATH_CHARS:
            raise ValueError(f"path: 1-{MAX_PATH_CHARS} characters")
        if len(self.added_by) > MAX_BY_CHARS:
            raise ValueError(f"added_by: at most {MAX_BY_CHARS} characters")
        if self.tenants is not None:
            if not isinstance(self.tenants, tuple) or not all(isinstance(t, str) for t in self.tenants):
                raise TypeError("tenants: want a tuple of strings or None")
            if len(self.tenants) > MAX_TENANTS:
                raise ValueError(f"tenants: at most {MAX_TENANTS}")
        if isinstance(self.added_at_s, bool) or not isinstance(self.added_at_s, (int, float)):
            raise TypeError("added_at_s: want a number")

    @classmethod
    def create(
        cls, model: str, name: str, path: str, tenants: Optional[Sequence[str]], at_s: float, by: str
    ) -> "RuntimeAdapter":
        """A record with its tenants sorted and deduplicated (None stays None)."""
        return cls(model, name, path, None if tenants is None else tuple(sorted(set(tenants))), float(at_s), by)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tenants"] = None if self.tenants is None else list(self.tenants)
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> "RuntimeAdapter":
        """The record in ``raw`` (a snapshot's or a persisted one); TypeError or ValueError
        when it is not one."""
        if not isinstance(raw, dict):
            raise TypeError(f"want an object, got {type(raw).__name__}")
        tenants = raw.get("tenants")
        if tenants is not None and not isinstance(tenants, (list, tuple)):
            raise TypeError("tenants: want a list or null")
        return cls(
            model=raw.get("model"),  # type: ignore[arg-type]  # checked in __post_init__
            name=raw.get("name"),  # type: ignore[arg-type]
            path=raw.get("path"),  # type: ignore[arg-type]
            tenants=None if tenants is None else tuple(tenants),
            added_at_s=raw.get("added_at_s"),  # type: ignore[arg-type]
            added_by=raw.get("added_by"),  # type: ignore[arg-type]
        )


def parse_runtime(raw_entries: Sequence[Any]) -> tuple[list[RuntimeAdapter], list[tuple[Any, Exception]]]:
    """The records among a snapshot's ``adapters`` (the first ``MAX_RUNTIME_ADAPTERS``), and
    the malformed ones with why."""
    parsed: list[RuntimeAdapter] = []
    malformed: list[tuple[Any, Exception]] = []
    for raw in list(raw_entries)[:MAX_RUNTIME_ADAPTERS]:
        try:
            parsed.append(RuntimeAdapter.from_dict(raw))
        except (TypeError, ValueError) as e:
            malformed.append((raw, e))
    return parsed, malformed


def with_runtime(
    base: Catalog, entries: Sequence[RuntimeAdapter]
) -> tuple[Catalog, list[tuple[RuntimeAdapter, CatalogError]]]:
    """``base`` with every entry that fits it added, in order, and the entries skipped
    with the catalog's reason. One catalog is built when all fit (the common case);
    otherwise the entries are added one by one, each checked by ``Catalog.with_adapter``."""
    if not entries:
        return base, []
    try:
        return _all_at_once(base, entries), []
    except CatalogError:
        pass
    catalog, skipped = base, []
    for entry in entries:
        try:
            catalog = catalog.with_adapter(entry.model, entry.name, entry.path, entry.tenants)
        except CatalogError as e:
            skipped.append((entry, e))
    return catalog, skipped


def _all_at_once(base: Catalog, entries: Sequence[RuntimeAdapter]) -> Catalog:
    """One catalog with every entry on its model: CatalogError when any does not fit (an
    unknown model included); the catalog's construction checks the rest."""
    added: dict[str, list[AdapterEntry]] = {}
    known = {m.name for m in base.models}
    for e in entries:
        if e.model not in known:
            raise CatalogError("model", f"{e.model!r} is no model served here")
        added.setdefault(e.model, []).append(
            AdapterEntry(e.name, e.path, None if e.tenants is None else frozenset(e.tenants))
        )
    models: list[ModelEntry] = [
        dataclasses.replace(m, adapters=m.adapters + tuple(added[m.name])) if m.name in added else m
        for m in base.models
    ]
    return dataclasses.replace(base, models=tuple(models))


def runtime_adapters_of(catalog: Catalog, base: Catalog, model: str) -> dict[str, str]:
    """The adapters ``catalog`` serves on ``model`` beyond ``base``'s: name -> directory."""
    configured = {a.name for m in base.models if m.name == model for a in m.adapters}
    return {a.name: a.path for m in catalog.models if m.name == model for a in m.adapters if a.name not in configured}


@dataclass(frozen=True)
class AdapterChanges:
    """What a replica does to match the listing: unload ``remove``, then load ``add``."""

    remove: tuple[str, ...] = ()
    add: tuple[tuple[str, str], ...] = ()  # (name, directory)

    def __bool__(self) -> bool:
        return bool(self.remove or self.add)


def replica_changes(
    listed: Mapping[str, str],
    added: Mapping[str, str],
    held: frozenset[str],
    loaded_at: Mapping[str, float],
    failed_at: Mapping[str, float],
    now: float,
    grace_s: float,
    retry_s: float,
) -> AdapterChanges:
    """The loads and unloads that make a replica serve ``listed`` (its model's run-time
    adapters: name -> directory).

    ``added``: what this replica loaded at run time (name -> directory); ``held``: every
    adapter its engine serves, the config's included; ``loaded_at``: when each of
    ``added`` was loaded; ``failed_at``: when a load of each name last failed. Unloaded:
    an adapter of ``added`` that is not listed, or listed with another directory, unless
    it was loaded less than ``grace_s`` ago. Loaded: a listed adapter the engine does not
    serve, or one of ``added`` listed with another directory, unless a load of it failed
    less than ``retry_s`` ago. A name the engine serves from the config is left alone.
    """
    remove = tuple(
        name
        for name, path in sorted(added.items())
        if listed.get(name) != path and now - loaded_at.get(name, now - grace_s) >= grace_s
    )
    add = tuple(
        (name, path)
        for name, path in sorted(listed.items())
        if (name not in held or (name in remove and added.get(name) != path))
        and now - failed_at.get(name, now - retry_s) >= retry_s
    )
    return AdapterChanges(remove, add)
