"""LoRA adapters added at run time: the record the controller keeps and publishes, the
rule a record must pass (at the admin call and when read back), the catalog they make on
top of the config's, and what a replica loads and unloads to match.

The controller holds at most ``MAX_RUNTIME_ADAPTERS`` records (``RuntimeAdapter``) and
publishes them in every snapshot. Routers apply them on top of the config's catalog
(``with_runtime``); replicas load the ones of their model (``replica_changes``). A
record that no longer fits the catalog (its model gone in a redeploy, its name taken by
an adapter the config now declares) is skipped by both, never fatal: the config wins.

The rule (``check``): a record names its tenants (``["*"]``: every tenant its model
admits, said so), its directory lies under ``adapters_root`` (none set: nothing may be
added at run time), and the catalog takes it (``Catalog.with_adapter``). The admin call
and the controller's read-back of persisted records run the same function. Where the
directory really is (symlinks followed) and who may write it is known only on the node
that loads it: the replica stats the path and its chain (``ballast.model.adapters``) and
``trust_problem`` decides on what it found. Owners trusted: the service user and root
(root can rewrite any file whatever its owner, so refusing its files protects nothing).

Invariants of ``replica_changes``: an adapter the replica did not add at run time (one
from the config) is never unloaded; one it loaded on its own (the admin API's trial
load, before the controller lists it) is kept for ``grace_s`` while unlisted, so a
snapshot that predates the listing does not unload it, but is unloaded at once when the
listing names another directory for it (an add that lost a race never serves); a load
that failed is tried again no sooner than ``retry_s`` later (a bad directory does not
reload every snapshot).

Written by hand: a record, path arithmetic, a loop over ``Catalog.with_adapter`` and two
set differences with Ballast's own rules; no library holds them.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ballast.policies.catalog import AdapterEntry, Catalog, CatalogError, ModelEntry

#: Adapters the controller holds beyond the config's; one more is refused.
MAX_RUNTIME_ADAPTERS = 256
#: Bounds of a record's fields (an admin call's body is checked against the same).
MAX_PATH_CHARS = 4096
MAX_TENANTS = 1024
MAX_BY_CHARS = 64
#: ``tenants: ["*"]``: every tenant the adapter's model admits (written out, never implied).
EVERY_TENANT = "*"
#: Entries of an adapter directory a replica checks; a directory with more is refused.
MAX_ADAPTER_ENTRIES = 256
#: Mode bits that let a path's group or anyone else write it.
_WRITABLE_BY_OTHERS = 0o022


@dataclass(frozen=True)
class RuntimeAdapter:
    """A LoRA adapter an operator added at run time: its model, name, directory (under
    ``adapters_root``; a relative one is taken under it), the tenants that may use it
    (``("*",)``: every tenant its model admits), when (wall clock) and by whom (the
    operator the admin call claimed: ``X-Ballast-Operator``, unverified)."""

    model: str
    name: str
    path: str
    tenants: tuple[str, ...]
    added_at_s: float
    added_by: str

    def __post_init__(self) -> None:
        for f in ("model", "name", "path", "added_by"):
            if not isinstance(getattr(self, f), str):
                raise TypeError(f"{f}: want a string, got {type(getattr(self, f)).__name__}")
        if not self.path or len(self.path) > MAX_PATH_CHARS or "\x00" in self.path:
            raise ValueError(f"path: 1-{MAX_PATH_CHARS} characters, no NUL")
        if len(self.added_by) > MAX_BY_CHARS:
            raise ValueError(f"added_by: at most {MAX_BY_CHARS} characters")
        if not isinstance(self.tenants, tuple) or not all(isinstance(t, str) for t in self.tenants):
            raise TypeError(f'tenants: want a list of tenants, or ["{EVERY_TENANT}"]')
        if not self.tenants or len(self.tenants) > MAX_TENANTS:
            raise ValueError(f'tenants: 1-{MAX_TENANTS} tenants, or ["{EVERY_TENANT}"] for every one the model admits')
        if EVERY_TENANT in self.tenants and len(self.tenants) > 1:
            raise ValueError(f'tenants: "{EVERY_TENANT}" stands alone (every tenant the model admits)')
        if isinstance(self.added_at_s, bool) or not isinstance(self.added_at_s, (int, float)):
            raise TypeError("added_at_s: want a number")

    @classmethod
    def create(cls, model: str, name: str, path: str, tenants: Sequence[str], at_s: float, by: str) -> RuntimeAdapter:
        """A record with its tenants sorted and deduplicated."""
        if isinstance(tenants, str) or not isinstance(tenants, Sequence):
            raise TypeError(f'tenants: want a list of tenants, or ["{EVERY_TENANT}"]')
        return cls(model, name, path, tuple(sorted(set(tenants))), float(at_s), by)

    @property
    def grant(self) -> tuple[str, ...] | None:
        """The tenants as the catalog takes them: None for every tenant the model admits."""
        return None if self.tenants == (EVERY_TENANT,) else self.tenants

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tenants"] = list(self.tenants)
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> RuntimeAdapter:
        """The record in ``raw`` (a snapshot's or a persisted one); TypeError or ValueError
        when it is not one (a record without tenants included: they are written out)."""
        if not isinstance(raw, dict):
            raise TypeError(f"want an object, got {type(raw).__name__}")
        tenants = raw.get("tenants")
        if not isinstance(tenants, (list, tuple)):
            raise TypeError(f'tenants: want a list of tenants, or ["{EVERY_TENANT}"]')
        return cls(
            model=_field(raw, "model"),  # each value's type is checked in __post_init__
            name=_field(raw, "name"),
            path=_field(raw, "path"),
            tenants=tuple(tenants),
            added_at_s=_field(raw, "added_at_s"),
            added_by=_field(raw, "added_by"),
        )


def _field(raw: dict[Any, Any], name: str) -> Any:
    """``raw[name]``, as a record carries it (checked by ``RuntimeAdapter``); TypeError naming
    the field when it is missing."""
    if name not in raw:
        raise TypeError(f"{name}: missing from the record")
    return raw[name]


# ---------------------------------------------------------------- the rule


def under_root(path: str, root: str) -> str | None:
    """``path`` (a relative one taken under ``root``) with ``.`` and ``..`` worked out,
    when it lies strictly under ``root``; None otherwise. By the text alone: where a
    symlink leads is the loading node's to find (``trust_problem``)."""
    base = posixpath.normpath(root)
    full = posixpath.normpath(posixpath.join(base, path))
    return full if inside(full, base) else None


def inside(path: str, root: str) -> bool:
    """Whether the normalised ``path`` lies strictly under the normalised ``root``."""
    return path.startswith(root.rstrip("/") + "/") and len(path) > len(root.rstrip("/")) + 1


def check(catalog: Catalog, entry: RuntimeAdapter, root: str | None) -> None:
    """CatalogError naming the field when ``entry`` may not be added to ``catalog`` (the
    config's with the run-time adapters already held): no ``adapters_root``, a path not
    under it, or the catalog's refusal (an unknown or non-vLLM model, a name taken or
    invalid, tenants undeclared or outside the model's grant). The admin call and the
    read-back of a persisted record run this same check."""
    if root is None:
        raise CatalogError("path", "adapters may not be added at run time here: adapters_root is not set")
    if under_root(entry.path, root) is None:
        raise CatalogError("path", f"{entry.path!r} is not under adapters_root {root!r}")
    catalog.with_adapter(entry.model, entry.name, entry.path, entry.grant)


@dataclass(frozen=True)
class PathFacts:
    """What the loading node's ``os.stat`` says of one path, after symlinks: where it is
    (relative to the root, for messages), its owner's uid and its mode bits."""

    where: str
    uid: int
    mode: int


def trust_problem(facts: Iterable[PathFacts], trusted_uids: frozenset[int]) -> str | None:
    """Why an adapter may not be loaded from these paths (the root, each directory down
    to the adapter's, the adapter's entries), or None: each must be owned by a trusted
    uid (the service user, root) and writable by no group and no one else, so that no
    other local user can put weights there or swap them after the check."""
    for f in facts:
        if f.uid not in trusted_uids:
            return f"{f.where}: owned by uid {f.uid}, not by the service user"
        if f.mode & _WRITABLE_BY_OTHERS:
            return f"{f.where}: writable by its group or by others (chmod go-w)"
    return None


_ABSOLUTE = re.compile(r"(?<![\w.~-])/[^\s'\"`,;:()\[\]{}<>]*")


def redact(text: str, roots: Iterable[str]) -> str:
    """``text`` (an engine's reason) with every absolute path not under one of ``roots``
    replaced: a refusal names no path outside the adapters' root."""
    bases = [posixpath.normpath(r) for r in roots]

    def keep(m: re.Match[str]) -> str:
        p = posixpath.normpath(m.group(0))
        return m.group(0) if any(p == b or inside(p, b) for b in bases) else "<path outside adapters_root>"

    return _ABSOLUTE.sub(keep, text)


# ---------------------------------------------------------------- records in a catalog


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
            catalog = catalog.with_adapter(entry.model, entry.name, entry.path, entry.grant)
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
        grant = None if e.grant is None else frozenset(e.grant)
        added.setdefault(e.model, []).append(AdapterEntry(e.name, e.path, grant))
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
    ``added`` was loaded by a trial load not listed since; ``failed_at``: when a load of
    each name last failed. Unloaded: an adapter of ``added`` listed with another directory
    (at once: the listing says which directory the name serves), or not listed and loaded
    at least ``grace_s`` ago. Loaded: a listed adapter the engine does not serve, or one of
    ``added`` listed with another directory, unless a load of it failed less than
    ``retry_s`` ago. A name the engine serves from the config is left alone.
    """
    remove = tuple(
        name
        for name, path in sorted(added.items())
        if (name in listed and listed[name] != path)
        or (name not in listed and now - loaded_at.get(name, now - grace_s) >= grace_s)
    )
    add = tuple(
        (name, path)
        for name, path in sorted(listed.items())
        if (name not in held or (name in remove and added.get(name) != path))
        and now - failed_at.get(name, now - retry_s) >= retry_s
    )
    return AdapterChanges(remove, add)
