"""GPU utilization and VRAM through NVML (nvidia-ml-py provides the ``pynvml`` module).

Where there is no GPU (or NVML cannot start) the probe is ``None`` and the
metrics are *absent*: reports carry ``None``, never 0, so the degradation policy
ignores them instead of reading "idle GPU".

The NVML module is injected (``nvml=``) so tests can drive these paths with a
fake NVML on machines without a GPU; production passes nothing and gets pynvml.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ballast.gpu")


@dataclass(frozen=True)
class GpuSample:
    util_pct: float
    vram_used_bytes: int
    vram_total_bytes: int

    @property
    def vram_pct(self) -> float | None:
        return 100.0 * self.vram_used_bytes / self.vram_total_bytes if self.vram_total_bytes else None


class NvmlGpuProbe:
    """Samples one GPU: the one this process sees as cuda:0."""

    def __init__(self, nvml: Any, handle: Any):
        self._nvml = nvml
        self._handle = handle

    def _query(self, *calls: str) -> list[Any] | None:
        """Each NVML device call's answer for this device; None (and a warning) when one fails."""
        try:
            return [getattr(self._nvml, call)(self._handle) for call in calls]
        except Exception as e:  # a GPU that falls off the bus: absent, and say so once per call
            log.warning("NVML sample failed: %r", e)
            return None

    def sample(self) -> GpuSample | None:
        got = self._query("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo")
        if got is None:
            return None
        util, mem = got
        return GpuSample(util_pct=float(util.gpu), vram_used_bytes=int(mem.used), vram_total_bytes=int(mem.total))

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def _visible_device(nvml: Any) -> Any:
    """NVML numbers physical GPUs; Ray narrows CUDA_VISIBLE_DEVICES to this replica's GPU.

    The first visible entry is this process's cuda:0; it is an index or a UUID.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not visible:
        return nvml.nvmlDeviceGetHandleByIndex(0)
    if visible.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(visible))
    return nvml.nvmlDeviceGetHandleByUUID(visible)


def _nvml(given: Any = None, warn: bool = False) -> Any:
    """``given`` (a fake in tests), else the ``pynvml`` module nvidia-ml-py installs; None without it."""
    if given is not None:
        return given
    try:
        import pynvml
    except ImportError:
        if warn:
            log.warning("nvidia-ml-py is not installed: GPU metrics absent")
        return None
    return pynvml


def make_gpu_probe(device: str, nvml: Any = None) -> NvmlGpuProbe | None:
    """A probe for ``device`` ("cuda:0", "cpu"), or None when GPU metrics are absent."""
    if not device.startswith("cuda"):
        return None
    nvml = _nvml(nvml, warn=True)
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        return NvmlGpuProbe(nvml, _visible_device(nvml))
    except Exception as e:
        log.warning("NVML unavailable, GPU metrics absent: %r", e)
        return None


@dataclass(frozen=True)
class ProcessGpuSample:
    util_pct: float  # the whole device's utilization (NVML has no per-process duty cycle)
    process_vram_bytes: int | None  # this process's memory on the device; None if NVML won't say
    vram_total_bytes: int


def _memory_of(procs: Any, pids: Collection[int]) -> tuple[bool, int | None]:
    """(whether any of ``pids`` runs on the device, the memory they use there: None when the
    driver hides per-process figures, as some containers do)."""
    found, used = False, 0
    hidden = False
    for p in procs:
        if int(p.pid) in pids:
            found = True
            if p.usedGpuMemory is None:
                hidden = True
            else:
                used += int(p.usedGpuMemory)
    return found, (None if hidden or not found else used)


class ProcessGpuProbe(NvmlGpuProbe):
    """What a process (and the processes it names: its engine's) uses of one GPU, sampled
    from outside the process (the watchdog).

    The device is named by UUID because the watchdog has no GPU of its own and so
    no CUDA_VISIBLE_DEVICES to go by; NVML enumerates physical devices regardless.
    ``pids`` (called at each sample) gives every process whose memory counts; by default
    ``pid`` alone.
    """

    def __init__(self, nvml: Any, handle: Any, pid: int, pids: Callable[[], Collection[int]] | None = None):
        super().__init__(nvml, handle)
        self._pids = pids if pids is not None else (lambda: (pid,))

    def sample(self) -> ProcessGpuSample | None:  # type: ignore[override]
        got = self._query(
            "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses"
        )
        if got is None:
            return None
        util, mem, procs = got
        _, used = _memory_of(procs, set(self._pids()))
        return ProcessGpuSample(float(util.gpu), used, int(mem.total))


class RanksGpuProbe:
    """What a replica's processes use of every GPU of the node: a replica whose engine runs
    several ranks holds no GPU itself, its ranks (processes ``pids()`` names) hold one each.
    Memory is summed over the GPUs they use, and so is the total; utilization is the
    busiest of those GPUs'. None while no GPU runs any of them."""

    def __init__(self, nvml: Any, pids: Callable[[], Collection[int]]):
        self._nvml = nvml
        self._pids = pids

    def sample(self) -> ProcessGpuSample | None:
        pids = set(self._pids())
        util, total, used = 0.0, 0, 0
        hidden = any_found = False
        try:
            for i in range(int(self._nvml.nvmlDeviceGetCount())):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
                found, mine = _memory_of(self._nvml.nvmlDeviceGetComputeRunningProcesses(handle), pids)
                if not found:
                    continue
                any_found = True
                hidden = hidden or mine is None
                used += mine or 0
                total += int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)
                util = max(util, float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        except Exception as e:  # a GPU that falls off the bus: absent, and say so
            log.warning("NVML sample failed: %r", e)
            return None
        if not any_found:
            return None
        return ProcessGpuSample(util, None if hidden else used, total)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def visible_gpu_uuid(nvml: Any = None) -> str | None:
    """The UUID of this process's cuda:0, for a watchdog to find the same device; None without one."""
    nvml = _nvml(nvml)
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        try:
            uuid = nvml.nvmlDeviceGetUUID(_visible_device(nvml))
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        finally:
            nvml.nvmlShutdown()
    except Exception as e:
        log.warning("NVML unavailable, no GPU for the watchdog: %r", e)
        return None


def make_process_gpu_probe(
    gpu_uuid: str | None,
    pid: int,
    nvml: Any = None,
    pids: Callable[[], Collection[int]] | None = None,
    rank_gpus: bool = False,
) -> ProcessGpuProbe | RanksGpuProbe | None:
    """A probe of ``pid`` (and the processes ``pids()`` names) on the GPU ``gpu_uuid``; with
    ``rank_gpus`` (a replica whose ranks hold the GPUs, it none), on every GPU of the node;
    None without a GPU (VRAM metrics absent)."""
    if not gpu_uuid and not rank_gpus:
        return None
    nvml = _nvml(nvml)
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        if rank_gpus:
            return RanksGpuProbe(nvml, pids if pids is not None else (lambda: (pid,)))
        return ProcessGpuProbe(nvml, nvml.nvmlDeviceGetHandleByUUID(gpu_uuid), pid, pids)
    except Exception as e:
        log.warning("NVML unavailable for the watchdog, VRAM metrics absent: %r", e)
        return None
