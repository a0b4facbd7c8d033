"""Fault injection for the model deployments: compiled in, inert unless the config enables it.

The settings travel in the controller's snapshot (``POST /admin/chaos`` sets them,
``DELETE /admin/chaos`` clears them), so every replica of the targeted deployment
applies them within one report interval. With ``chaos.enabled: false`` (every
production config) the replica ignores whatever the snapshot says.

Faults: fail a fraction of requests, add latency, hang (never answer until the
caller gives up), stall (the replica's work loop stops mid-batch, as a wedged
kernel would: the watchdog sees no progress with work in flight), and leak
memory at a rate — the leak is capped at
``chaos.max_leak_mb`` so that even an injected leak stays bounded.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import BallastError

MB = 1024 * 1024


class InjectedFault(BallastError):
    """A failure chaos asked for: to the router it is a model error like any other."""

    status, code = 500, "MODEL_ERROR"


@dataclass(frozen=True)
class ChaosSettings:
    error_ratio: float = 0.0
    latency_ms: int = 0
    hang: bool = False
    stall: bool = False
    leak_mb_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_ratio <= 1.0:
            raise ValueError("error_ratio: must be within [0, 1]")
        if not 0 <= self.latency_ms <= 600_000:
            raise ValueError("latency_ms: must be within [0, 600000]")
        if not 0.0 <= self.leak_mb_per_s <= 1024:
            raise ValueError("leak_mb_per_s: must be within [0, 1024]")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChaosSettings":
        known = {k: d[k] for k in ("error_ratio", "latency_ms", "hang", "stall", "leak_mb_per_s") if k in d}
        return cls(**known)

    @property
    def active(self) -> bool:
        return self != ChaosSettings()


class ChaosAgent:
    """Applies the current settings inside one replica."""

    def __init__(self, enabled: bool, max_leak_mb: int, rand: Callable[[], float] = random.random):
        self._enabled = enabled
        self._max_leak_bytes = max_leak_mb * MB
        self._rand = rand
        self.settings = ChaosSettings()
        self._leak: list[bytearray] = []  # the injected leak itself, capped
        self._leak_task: Optional[asyncio.Task] = None

    @property
    def leaked_bytes(self) -> int:
        return sum(len(b) for b in self._leak)

    def apply(self, raw: Optional[dict[str, Any]]) -> None:
        if not self._enabled:
            return
        self.settings = ChaosSettings.from_dict(raw or {})
        if self.settings.leak_mb_per_s > 0 and (self._leak_task is None or self._leak_task.done()):
            self._leak_task = asyncio.get_running_loop().create_task(self._leak_loop())
        if self.settings.leak_mb_per_s == 0:
            self._leak.clear()  # chaos lifted: the "leak" is released

    async def before_request(self) -> None:
        """Called by each request before it joins a batch."""
        s = self.settings
        if not self._enabled or not s.active:
            return
        if s.latency_ms:
            await asyncio.sleep(s.latency_ms / 1000.0)
        if s.hang:
            await asyncio.Event().wait()  # until the caller cancels us
        if s.error_ratio and self._rand() < s.error_ratio:
            raise InjectedFault("injected failure (chaos)")

    async def stall_point(self) -> None:
        """Called by the work loop before each decode step: waits while ``stall`` is set."""
        while self._enabled and self.settings.stall:
            await asyncio.sleep(0.05)

    async def _leak_loop(self) -> None:
        while self.settings.leak_mb_per_s > 0:
            if self.leaked_bytes < self._max_leak_bytes:
                chunk = min(int(self.settings.leak_mb_per_s * MB / 10), self._max_leak_bytes - self.leaked_bytes)
                if chunk > 0:  # a rate too small for one byte per tick leaks nothing, not empty entries
                    self._leak.append(bytearray(b"\x01" * chunk))  # touched, so it is resident
            await asyncio.sleep(0.1)
