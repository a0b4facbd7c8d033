"""Fault injection for the model deployments: compiled in, inert unless the config enables it.

The settings travel in the controller's snapshot (``POST /admin/chaos`` sets them,
``DELETE /admin/chaos`` clears them), so every replica of the targeted deployment
applies them within one report interval. With ``chaos.enabled: false`` (every
production config) the replica ignores whatever the snapshot says.

Faults: fail a fraction of requests, add latency, hang (never answer until the
caller gives up), stall (the replica's work loop stops mid-batch, as a wedged
kernel would: the watchdog sees no progress with work in flight), and leak
memory at a rate: host memory (``leak_mb_per_s``, the process's RSS) or, on a
replica whose model is on a GPU, device memory (``vram_leak_mb_per_s``, real CUDA
allocations that NVML counts against the process). Each leak is capped at
``chaos.max_leak_mb`` so that even an injected leak stays bounded. A VRAM leak asked
of a CPU replica leaks nothing; the replica's stats say so (``chaos_vram_leak``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ballast.errors import BallastError

MB = 1024 * 1024
LEAK_TICK_S = 0.1  # the leak grows once a tick: a tenth of its rate each time


class InjectedFault(BallastError):
    """A failure chaos asked for: to the router it is a model error like any other."""

    status, code = 500, "MODEL_ERROR"


@dataclass(frozen=True)
class ChaosSettings:
    error_ratio: float = 0.0
    latency_ms: int = 0
    hang: bool = False
    stall: bool = False
    # Each decode step (a chunk of stream_chunk_tokens) waits this long first: a slow device.
    step_delay_ms: int = 0
    leak_mb_per_s: float = 0.0
    vram_leak_mb_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_ratio <= 1.0:
            raise ValueError("error_ratio: must be within [0, 1]")
        if not 0 <= self.latency_ms <= 600_000:
            raise ValueError("latency_ms: must be within [0, 600000]")
        if not 0 <= self.step_delay_ms <= 10_000:
            raise ValueError("step_delay_ms: must be within [0, 10000]")
        for name in ("leak_mb_per_s", "vram_leak_mb_per_s"):
            if not 0.0 <= getattr(self, name) <= 1024:
                raise ValueError(f"{name}: must be within [0, 1024]")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChaosSettings:
        known = {
            k: d[k]
            for k in (
                "error_ratio",
                "latency_ms",
                "hang",
                "stall",
                "step_delay_ms",
                "leak_mb_per_s",
                "vram_leak_mb_per_s",
            )
            if k in d
        }
        return cls(**known)

    @property
    def active(self) -> bool:
        return self != ChaosSettings()


class ChaosAgent:
    """Applies the current settings inside one replica.

    ``sleep`` is asyncio's unless a test injects one that waits on a fake clock
    (STYLE 2): the latency, the stall's poll and the leak's tick all go through it.
    """

    def __init__(
        self,
        enabled: bool,
        max_leak_mb: int,
        rand: Callable[[], float] = random.random,
        device: str = "cpu",
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._enabled = enabled
        self._sleep = sleep
        self._max_leak_bytes = max_leak_mb * MB
        self._rand = rand
        self._cuda = device if device.startswith("cuda") else None  # where a VRAM leak goes; None: nowhere
        self.settings = ChaosSettings()
        self._leak: list[bytearray] = []  # the injected leak itself, capped
        self._vram_leak: list[Any] = []  # CUDA tensors, capped the same way
        self._leak_task: asyncio.Task[None] | None = None

    @property
    def leaked_bytes(self) -> int:
        return sum(len(b) for b in self._leak)

    @property
    def vram_leaked_bytes(self) -> int:
        return sum(int(t.numel()) for t in self._vram_leak)

    @property
    def vram_leak_state(self) -> str | None:
        """None when no VRAM leak is asked for; "leaking", or "no_gpu" on a CPU replica."""
        if not self._enabled or self.settings.vram_leak_mb_per_s == 0:
            return None
        return "leaking" if self._cuda else "no_gpu"

    def _leaking(self) -> bool:
        s = self.settings
        return s.leak_mb_per_s > 0 or (s.vram_leak_mb_per_s > 0 and self._cuda is not None)

    def apply(self, raw: dict[str, Any] | None) -> None:
        if not self._enabled:
            return
        self.settings = ChaosSettings.from_dict(raw or {})
        if self._leaking() and (self._leak_task is None or self._leak_task.done()):
            self._leak_task = asyncio.get_running_loop().create_task(self._leak_loop())
        if self.settings.leak_mb_per_s == 0:
            self._leak.clear()  # chaos lifted: the "leak" is released
        if self.settings.vram_leak_mb_per_s == 0 and self._vram_leak:
            self._vram_leak.clear()  # back to torch's cache; the watchdog's empty_cache returns it to the GPU

    async def before_request(self) -> None:
        """Called by each request before it joins a batch."""
        s = self.settings
        if not self._enabled or not s.active:
            return
        if s.latency_ms:
            await self._sleep(s.latency_ms / 1000.0)
        if s.hang:
            await asyncio.Event().wait()  # until the caller cancels us
        if s.error_ratio and self._rand() < s.error_ratio:
            raise InjectedFault("injected failure (chaos)")

    async def stall_point(self) -> None:
        """Called by the work loop before each decode step: waits while ``stall`` is set,
        then ``step_delay_ms``."""
        while self._enabled and self.settings.stall:
            await self._sleep(0.05)
        if self._enabled and self.settings.step_delay_ms:
            await self._sleep(self.settings.step_delay_ms / 1000.0)

    def _chunk(self, mb_per_s: float, leaked: int) -> int:
        """Bytes to leak this tick (ten ticks a second), within the cap; 0 for a rate below a byte a tick."""
        return max(0, min(int(mb_per_s * MB / 10), self._max_leak_bytes - leaked))

    async def _leak_loop(self) -> None:
        while self._leaking():
            s = self.settings
            chunk = self._chunk(s.leak_mb_per_s, self.leaked_bytes)
            if chunk > 0:
                self._leak.append(bytearray(b"\x01" * chunk))  # touched, so it is resident
            chunk = self._chunk(s.vram_leak_mb_per_s, self.vram_leaked_bytes) if self._cuda else 0
            if chunk > 0:
                import torch

                self._vram_leak.append(
                    torch.ones(chunk, dtype=torch.uint8, device=self._cuda)
                )  # a real cudaMalloc'd block
            await self._sleep(LEAK_TICK_S)
