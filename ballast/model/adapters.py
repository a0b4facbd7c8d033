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
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Sequence

from ballast.policies.adapters import (
    AdapterChanges,
    parse_runtime,
    replica_changes,
    runtime_adapters_of,
    with_runtime,
)
from ballast.policies.catalog import Catalog

from ballast.errors import AdapterRefused

log = logging.getLogger("ballast.model")

#: An adapter loaded by a trial load stays this long while the controller does not list it yet.
TRIAL_GRACE_S = 60.0
#: A load that failed in a reconcile is tried again no sooner than this.
RETRY_S = 30.0


class ReplicaAdapters:
    """The run-time adapters of one replica's engine (``backend``) serving ``model``."""

    def __init__(
        self,
        backend: Any,
        model: str,
        base: Catalog,
        clock: Callable[[], float] = time.monotonic,
        grace_s: float = TRIAL_GRACE_S,
        retry_s: float = RETRY_S,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._backend = backend
        self._model = model
        self._base = base
        self._clock = clock
        self._grace_s = grace_s
        self._retry_s = retry_s
        self._on_failure = on_failure
        self.added: dict[str, str] = {}  # name -> directory: what this replica loaded at run time
        self._loaded_at: dict[str, float] = {}  # name -> when (clock) it was loaded
        self._failed_at: dict[str, float] = {}  # name -> when a load of it last failed (listed names only)
        self.failures = 0
        self._lock = asyncio.Lock()
        self._latest: Optional[Sequence[Any]] = None  # the newest listing not reconciled yet
        self._task: Optional[asyncio.Task[None]] = None

    @property
    def serves_adapters(self) -> bool:
        return hasattr(self._backend, "add_adapter")

    async def add(self, name: str, path: str) -> dict[str, Any]:
        """Load ``name`` from ``path`` now; AdapterRefused (nothing loaded) when the engine
        serves no adapters or refuses this one, with its reason."""
        if not self.serves_adapters:
            raise AdapterRefused(name, path, f"model {self._model!r} runs an engine that serves no LoRA adapters")
        async with self._lock:
            if name not in self.added and name in self._backend.adapters():
                raise AdapterRefused(name, path, "the config serves an adapter of that name", "name")
            await asyncio.to_thread(self._backend.add_adapter, name, path)
            self.added[name] = path
            self._loaded_at[name] = self._clock()
        return {"model": self._model, "name": name, "path": path}

    async def remove(self, name: str) -> bool:
        """Unload ``name`` if this replica loaded it at run time; False otherwise (an adapter
        from the config stays)."""
        async with self._lock:
            return await self._unload(name)

    async def _unload(self, name: str) -> bool:
        if name not in self.added:
            return False
        del self.added[name]
        self._loaded_at.pop(name, None)
        return bool(await asyncio.to_thread(self._backend.remove_adapter, name))

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
        """Unload, then load, what ``replica_changes`` says for ``entries``; returns it."""
        listed = self.listed(entries)
        async with self._lock:
            now = self._clock()
            for name, path in list(self.added.items()):
                if listed.get(name) == path:
                    self._loaded_at.pop(name, None)  # listed: no longer a trial load
            self._failed_at = {n: t for n, t in self._failed_at.items() if n in listed}
            held = frozenset(self._backend.adapters())
            changes = replica_changes(
                listed, self.added, held, self._loaded_at, self._failed_at, now, self._grace_s, self._retry_s
            )
            for name in changes.remove:
                await self._unload(name)
            for name, path in changes.add:
                await self._load(name, path)
        return changes

    async def _load(self, name: str, path: str) -> None:
        try:
            await asyncio.to_thread(self._backend.add_adapter, name, path)
        except Exception as e:  # AdapterRefused, or the engine's own failure: logged, counted
            self._failed_at[name] = self._clock()
            self.failures += 1
            self._on_failure()
            log.warning("could not load run-time adapter %r (%s) on %r: %s", name, path, self._model, e)
            return
        self.added[name] = path
