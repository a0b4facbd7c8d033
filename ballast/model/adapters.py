"""A replica's LoRA adapters added at run time: the admin API's trial load, and the
reconcile with the controller's list in each snapshot.

``add`` loads one adapter now (``POST /admin/adapters`` calls it on one replica before
the controller records anything, so a bad directory is refused at the admin call);
``offer`` takes each snapshot's ``adapters`` and reconciles in a task of its own: the
ones of this replica's model that fit the catalog and that its engine does not serve
are loaded, the ones it loaded at run time and that are no longer listed are unloaded
(``ballast.policies.adapters.replica_changes`` decides; adapters from the config are
never unloaded here). A load that fails is logged and counted, never raised into the
snapshot loop, and tried again no sooner than ``retry_s`` later.

Loading is blocking vLLM work (``VLLMBackend.add_adapter`` waits for the engine, up to
minutes for a large adapter): it runs in a worker thread, so the replica's event loop
goes on serving. ``_lock`` makes one load or unload run at a time, and makes a plan
and its execution one step (a trial load and a reconcile never interleave on one name).

Every load, the trial's and each reconcile's, first checks the directory here, on the
node that reads it (``trusted_dir``): under ``adapters_root`` after symlinks, and it,
the directories from the root down to it and its entries owned by the service user (or
root) and writable by no one else (``ballast.policies.adapters.trust_problem``). The
engine is handed the resolved directory. A refusal names paths only relative to the
root, and an engine's reason is passed on with any path outside the root blanked
(``redact``), so a trial load tells nothing of the node's other files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any

from ballast.errors import AdapterRefused
from ballast.model.engine import ModelBackend, ServesLoRA, serving_lora
from ballast.policies.adapters import (
    MAX_ADAPTER_ENTRIES,
    AdapterChanges,
    PathFacts,
    inside,
    parse_runtime,
    redact,
    replica_changes,
    runtime_adapters_of,
    trust_problem,
    under_root,
    with_runtime,
)
from ballast.policies.catalog import Catalog

log = logging.getLogger("ballast.model")

#: An adapter loaded by a trial load stays this long while the controller does not list it yet.
TRIAL_GRACE_S = 60.0
#: A load that failed in a reconcile is tried again no sooner than this.
RETRY_S = 30.0


def service_uids() -> frozenset[int]:
    """The owners an adapter's files may have: this process's user, and root."""
    return frozenset({os.geteuid(), 0})


def trusted_dir(root: str, path: str, uids: frozenset[int]) -> str:
    """The directory ``path`` names (a relative one under ``root``), symlinks resolved,
    when an adapter may be loaded from it; ValueError with the reason otherwise.

    In order: ``path`` under ``root`` by its text (refused before any file is looked
    at); the root a directory; the resolved path under the resolved root (a symlink out
    of it is refused without saying where it leads) and a directory; then the root,
    each directory down to the adapter's, and each of its entries (at most
    ``MAX_ADAPTER_ENTRIES``; an entry's symlink must stay under the root) as ``os.stat``
    finds them, judged by ``trust_problem``. Messages name paths relative to the root."""
    lexical = under_root(path, root)
    if lexical is None:
        raise ValueError(f"path: {path!r} is not under adapters_root {root!r}")
    real_root = os.path.realpath(root)
    if not os.path.isdir(real_root):
        raise ValueError(f"path: adapters_root {root!r} is no directory on this node")
    real = os.path.realpath(lexical)
    if not inside(real, real_root):
        raise ValueError(f"path: {path!r} resolves outside adapters_root (a symlink out of it)")
    rel = os.path.relpath(real, real_root)
    try:
        facts = _chain_facts(real_root, rel)
        if not stat.S_ISDIR(os.stat(real).st_mode):
            raise ValueError(f"path: {rel} under adapters_root is no directory")
        facts += _entry_facts(real_root, real, rel)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"path: no directory {rel} under adapters_root") from None
    except OSError as e:  # a permission refused, a symlink loop
        raise ValueError(f"path: {rel} under adapters_root cannot be read: {e.strerror}") from None
    problem = trust_problem(facts, uids)
    if problem is not None:
        raise ValueError(f"path: {problem}")
    return real


def _chain_facts(real_root: str, rel: str) -> list[PathFacts]:
    """The root and each directory from it down to ``rel`` (all resolved already)."""
    out, at = [], real_root
    for i, part in enumerate(["", *rel.split(os.sep)]):
        at = os.path.join(at, part) if part else at
        st = os.stat(at)
        out.append(PathFacts("adapters_root" if i == 0 else os.path.relpath(at, real_root), st.st_uid, st.st_mode))
    return out


def _entry_facts(real_root: str, real: str, rel: str) -> list[PathFacts]:
    """Each entry of the adapter's directory, symlinks followed (they must stay under the root)."""
    out: list[PathFacts] = []
    with os.scandir(real) as entries:
        for n, entry in enumerate(entries):
            if n >= MAX_ADAPTER_ENTRIES:
                raise ValueError(f"path: {rel} holds more than {MAX_ADAPTER_ENTRIES} entries: no adapter directory")
            where = os.path.join(rel, entry.name)
            if entry.is_symlink() and not inside(os.path.realpath(entry.path), real_root):
                raise ValueError(f"path: {where} resolves outside adapters_root (a symlink out of it)")
            try:
                st = os.stat(entry.path)
            except FileNotFoundError:
                raise ValueError(f"path: {where} is a broken link") from None
            out.append(PathFacts(where, st.st_uid, st.st_mode))
    return out


class ReplicaAdapters:
    """The run-time adapters of one replica's engine (``backend``) serving ``model``, from
    directories under ``root`` (``adapters_root``; None: none is loaded at run time). An
    engine whose row in the engine table serves no LoRA (``Engine.lora``) loads none: a
    trial load is refused, a snapshot's listing changes nothing."""

    def __init__(
        self,
        backend: ModelBackend,
        model: str,
        base: Catalog,
        root: str | None,
        clock: Callable[[], float] = time.monotonic,
        grace_s: float = TRIAL_GRACE_S,
        retry_s: float = RETRY_S,
        on_failure: Callable[[], None] = lambda: None,
        uids: frozenset[int] | None = None,
    ) -> None:
        self._lora: ServesLoRA | None = serving_lora(backend)
        self._model = model
        self._base = base
        self._root = root
        self._uids = service_uids() if uids is None else uids  # who may own an adapter's files
        self._clock = clock
        self._grace_s = grace_s
        self._retry_s = retry_s
        self._on_failure = on_failure
        self.added: dict[str, str] = {}  # name -> directory: what this replica loaded at run time
        self._loaded_at: dict[str, float] = {}  # name -> when (clock) it was loaded
        self._failed_at: dict[str, float] = {}  # name -> when a load of it last failed (listed names only)
        self.failures = 0
        self._lock = asyncio.Lock()
        self._latest: Sequence[Any] | None = None  # the newest listing not reconciled yet
        self._task: asyncio.Task[None] | None = None

    @property
    def serves_adapters(self) -> bool:
        return self._lora is not None

    async def add(self, name: str, path: str) -> dict[str, Any]:
        """Load ``name`` from ``path`` now; AdapterRefused (nothing loaded) when the engine
        serves no adapters, the directory fails ``trusted_dir`` (field ``path``) or the
        engine refuses it (its reason, paths outside the root blanked). A trial load of
        the name from another directory that the controller never listed is replaced (the
        controller lets one add of a name run at a time)."""
        lora = self._lora
        if lora is None:
            raise AdapterRefused(name, path, f"model {self._model!r} runs an engine that serves no LoRA adapters")
        async with self._lock:
            if name not in self.added and name in lora.adapters():
                raise AdapterRefused(name, path, "the config serves an adapter of that name", "name")
            if self.added.get(name, path) != path and name in self._loaded_at:
                await self._unload(lora, name)
            await asyncio.to_thread(self._checked_load, lora, name, path)
            self.added[name] = path
            self._loaded_at[name] = self._clock()
        return {"model": self._model, "name": name, "path": path}

    def _checked_load(self, lora: ServesLoRA, name: str, path: str) -> None:
        """``trusted_dir``, then the engine's load of the resolved directory (in a worker
        thread: both touch the disk); AdapterRefused when either refuses."""
        if self._root is None:
            raise AdapterRefused(name, path, "no adapter may be added at run time: adapters_root is not set", "path")
        try:
            where = trusted_dir(self._root, path, self._uids)
        except ValueError as e:
            raise AdapterRefused(name, path, str(e).removeprefix("path: "), "path") from None
        try:
            lora.add_adapter(name, where)
        except AdapterRefused as e:
            roots = (self._root, os.path.realpath(self._root))
            raise AdapterRefused(name, path, redact(e.reason, roots), e.field) from None

    async def remove(self, name: str) -> bool:
        """Unload ``name`` if this replica loaded it at run time; False otherwise (an adapter
        from the config stays)."""
        if self._lora is None:
            return False
        async with self._lock:
            return await self._unload(self._lora, name)

    async def _unload(self, lora: ServesLoRA, name: str) -> bool:
        if name not in self.added:
            return False
        del self.added[name]
        self._loaded_at.pop(name, None)
        return bool(await asyncio.to_thread(lora.remove_adapter, name))

    def listed(self, entries: Sequence[Any]) -> dict[str, str]:
        """This model's run-time adapters in a snapshot's ``adapters`` that fit the catalog."""
        parsed, malformed = parse_runtime(entries)
        for raw, why in malformed:
            log.warning("ignoring a malformed run-time adapter %r: %s", raw, why)
        catalog, _ = with_runtime(self._base, parsed)
        return runtime_adapters_of(catalog, self._base, self._model)

    def offer(self, entries: Sequence[Any]) -> None:
        """A snapshot's ``adapters``: reconciled in a task (one at a time; the newest wins)."""
        if not self.serves_adapters:
            return
        self._latest = list(entries)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._latest is not None:
            entries, self._latest = self._latest, None
            try:
                await self.reconcile(entries)
            except Exception:  # never into the snapshot loop; the next snapshot tries again
                log.exception("reconciling the run-time adapters failed")

    async def reconcile(self, entries: Sequence[Any]) -> AdapterChanges:
        """Unload, then load, what ``replica_changes`` says for ``entries``; returns it
        (nothing, for an engine without LoRA)."""
        lora = self._lora
        if lora is None:
            return AdapterChanges()
        listed = self.listed(entries)
        async with self._lock:
            now = self._clock()
            for name, path in list(self.added.items()):
                if listed.get(name) == path:
                    self._loaded_at.pop(name, None)  # listed: no longer a trial load
            self._failed_at = {n: t for n, t in self._failed_at.items() if n in listed}
            held = frozenset(lora.adapters())
            changes = replica_changes(
                listed, self.added, held, self._loaded_at, self._failed_at, now, self._grace_s, self._retry_s
            )
            for name in changes.remove:
                await self._unload(lora, name)
            for name, path in changes.add:
                await self._load(lora, name, path)
        return changes

    async def _load(self, lora: ServesLoRA, name: str, path: str) -> None:
        try:
            await asyncio.to_thread(self._checked_load, lora, name, path)
        except Exception as e:  # AdapterRefused, or the engine's own failure: logged, counted
            self._failed_at[name] = self._clock()
            self.failures += 1
            self._on_failure()
            log.warning("could not load run-time adapter %r (%s) on %r: %s", name, path, self._model, e)
            return
        self.added[name] = path
