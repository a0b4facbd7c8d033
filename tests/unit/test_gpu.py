"""ballast.control.gpu: the NVML probe, driven by a FakeNvml (this machine has no GPU).

``FakeNvml`` stands in for the ``pynvml`` module (nvidia-ml-py): it knows a few
GPUs by index and UUID, answers utilization and memory per handle, and can be
told to fail at init, at the handle lookup, or at sampling. One test uses the
real pynvml to check that a machine without a GPU gets ``None``, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from ballast.control.gpu import GpuSample, NvmlGpuProbe, make_gpu_probe, make_process_gpu_probe, visible_gpu_uuid


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class _Util:
    gpu: int
    memory: int = 0


@dataclass
class _Mem:
    used: int
    total: int
    free: int = 0


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None
    device: int = 0


@dataclass(frozen=True)
class FakeHandle:
    index: int


class FakeNvml:
    """Stands in for the pynvml module: GPUs listed as (uuid, util %, used bytes, total bytes)."""

    GIB = 1 << 30

    def __init__(self, gpus: list[tuple[str, int, int, int]] | None = None) -> None:
        self.gpus = gpus or [
            ("GPU-aaaa-0000", 10, 1 * self.GIB, 80 * self.GIB),
            ("GPU-bbbb-1111", 55, 40 * self.GIB, 80 * self.GIB),
            ("GPU-cccc-2222", 97, 78 * self.GIB, 80 * self.GIB),
        ]
        self.processes: list[_Proc] = []
        self.fail_init = False
        self.fail_sample = False
        self.fail_shutdown = False
        self.calls: list[tuple[str, Any]] = []

    def nvmlInit(self) -> None:
        self.calls.append(("init", None))
        if self.fail_init:
            raise FakeNvmlError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append(("shutdown", None))
        if self.fail_shutdown:
            raise FakeNvmlError("Uninitialized")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self.calls.append(("by_index", index))
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError("Invalid Argument")
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        self.calls.append(("by_uuid", uuid))
        for i, (u, *_rest) in enumerate(self.gpus):
            if u == uuid:
                return FakeHandle(i)
        raise FakeNvmlError("Not Found")

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> _Util:
        self.calls.append(("util", handle))
        if self.fail_sample:
            raise FakeNvmlError("GPU is lost")
        return _Util(gpu=self.gpus[handle.index][1])

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> _Mem:
        self.calls.append(("mem", handle))
        if self.fail_sample:
            raise FakeNvmlError("GPU is lost")
        _, _, used, total = self.gpus[handle.index]
        return _Mem(used=used, total=total, free=total - used)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> bytes:
        return self.gpus[handle.index][0].encode()  # older pynvml returns bytes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[_Proc]:
        if self.fail_sample:
            raise FakeNvmlError("GPU is lost")
        return [p for p in self.processes if p.device == handle.index]

    def lookups(self) -> list[tuple[str, Any]]:
        return [c for c in self.calls if c[0] in ("by_index", "by_uuid")]


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml()


@pytest.fixture(autouse=True)
def no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test starts with CUDA_VISIBLE_DEVICES unset and sets it itself.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


class TestDevices:
    @pytest.mark.parametrize("device", ["cpu", "mps", ""])
    def test_non_cuda_device_has_no_probe_and_never_touches_nvml(self, nvml: FakeNvml, device: str) -> None:
        assert make_gpu_probe(device, nvml=nvml) is None
        assert nvml.calls == []

    def test_cuda_samples_util_and_vram(self, nvml: FakeNvml) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert isinstance(probe, NvmlGpuProbe)
        s = probe.sample()
        assert s == GpuSample(util_pct=10.0, vram_used_bytes=1 * FakeNvml.GIB, vram_total_bytes=80 * FakeNvml.GIB)
        assert isinstance(s.util_pct, float)
        assert s.vram_pct == pytest.approx(1.25)
        assert nvml.calls[0] == ("init", None)

    def test_each_sample_reads_nvml_again(self, nvml: FakeNvml) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert probe is not None
        assert probe.sample().util_pct == 10.0
        nvml.gpus[0] = ("GPU-aaaa-0000", 88, 60 * FakeNvml.GIB, 80 * FakeNvml.GIB)
        s = probe.sample()
        assert (s.util_pct, s.vram_pct) == (88.0, 75.0)

    def test_close_shuts_nvml_down(self, nvml: FakeNvml) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert probe is not None
        probe.close()
        assert nvml.calls[-1] == ("shutdown", None)

    def test_close_swallows_a_failing_shutdown(self, nvml: FakeNvml) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert probe is not None
        nvml.fail_shutdown = True
        probe.close()  # must not raise
        assert nvml.calls[-1] == ("shutdown", None)


class TestVisibleDevices:
    def test_unset_means_physical_index_zero(self, nvml: FakeNvml) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert nvml.lookups() == [("by_index", 0)]
        assert probe is not None and probe.sample().util_pct == 10.0

    def test_empty_means_index_zero(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        make_gpu_probe("cuda:0", nvml=nvml)
        assert nvml.lookups() == [("by_index", 0)]

    def test_index_selects_that_physical_gpu(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert nvml.lookups() == [("by_index", 2)]
        assert probe is not None
        s = probe.sample()
        assert (s.util_pct, s.vram_pct) == (97.0, 97.5)

    def test_first_of_several_indices_is_cuda_0(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 1 ,2,0")
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert nvml.lookups() == [("by_index", 1)]
        assert probe is not None and probe.sample().util_pct == 55.0

    def test_uuid_selects_by_uuid(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc-2222,GPU-aaaa-0000")
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert nvml.lookups() == [("by_uuid", "GPU-cccc-2222")]
        assert probe is not None and probe.sample().util_pct == 97.0

    def test_unknown_uuid_means_absent(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-not-here")
        assert make_gpu_probe("cuda:0", nvml=nvml) is None
        assert nvml.lookups() == [("by_uuid", "GPU-not-here")]

    def test_index_out_of_range_means_absent(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
        assert make_gpu_probe("cuda:0", nvml=nvml) is None


class TestFailures:
    def test_init_failing_means_absent(self, nvml: FakeNvml) -> None:
        nvml.fail_init = True
        assert make_gpu_probe("cuda:0", nvml=nvml) is None
        assert nvml.calls == [("init", None)]  # no handle lookup after a failed init

    def test_sample_failing_means_absent_then_recovers(self, nvml: FakeNvml) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert probe is not None
        nvml.fail_sample = True
        assert probe.sample() is None
        nvml.fail_sample = False
        assert probe.sample() == GpuSample(10.0, 1 * FakeNvml.GIB, 80 * FakeNvml.GIB)

    def test_sample_failure_is_logged(self, nvml: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
        probe = make_gpu_probe("cuda:0", nvml=nvml)
        assert probe is not None
        nvml.fail_sample = True
        with caplog.at_level("WARNING", logger="ballast.gpu"):
            assert probe.sample() is None
        assert any("NVML sample failed" in r.getMessage() for r in caplog.records)


class TestRealPynvml:
    def test_real_pynvml_without_a_gpu_gives_none_not_an_error(self) -> None:
        pynvml = pytest.importorskip("pynvml")
        try:
            pynvml.nvmlInit()
        except Exception:
            nvml_works = False
        else:
            nvml_works = True
            pynvml.nvmlShutdown()
        probe = make_gpu_probe("cuda:0")  # the real module, imported by make_gpu_probe
        if nvml_works:  # a machine with a GPU: a working probe instead
            assert probe is not None
            assert probe.sample() is not None
            probe.close()
        else:
            assert probe is None


class TestProcessProbe:
    """The watchdog's view: one process's memory on a GPU named by UUID."""

    def test_samples_this_pids_memory_on_the_named_device(self, nvml: FakeNvml) -> None:
        nvml.processes = [
            _Proc(pid=111, usedGpuMemory=5 * FakeNvml.GIB, device=1),
            _Proc(pid=222, usedGpuMemory=1, device=1),
        ]
        probe = make_process_gpu_probe("GPU-bbbb-1111", 111, nvml=nvml)
        s = probe.sample()
        assert (
            s.process_vram_bytes == 5 * FakeNvml.GIB and s.vram_total_bytes == 80 * FakeNvml.GIB and s.util_pct == 55.0
        )

    def test_a_process_nvml_does_not_list_has_absent_memory(self, nvml: FakeNvml) -> None:
        nvml.processes = [_Proc(pid=111, usedGpuMemory=None, device=0)]  # containers may hide it
        assert make_process_gpu_probe("GPU-aaaa-0000", 111, nvml=nvml).sample().process_vram_bytes is None
        assert make_process_gpu_probe("GPU-aaaa-0000", 999, nvml=nvml).sample().process_vram_bytes is None

    def test_no_uuid_or_no_nvml_means_no_probe(self, nvml: FakeNvml) -> None:
        assert make_process_gpu_probe(None, 1, nvml=nvml) is None
        assert make_process_gpu_probe("GPU-none", 1, nvml=nvml) is None
        nvml.fail_init = True
        assert make_process_gpu_probe("GPU-aaaa-0000", 1, nvml=nvml) is None

    def test_a_failed_sample_is_none(self, nvml: FakeNvml) -> None:
        probe = make_process_gpu_probe("GPU-aaaa-0000", 1, nvml=nvml)
        nvml.fail_sample = True
        assert probe.sample() is None

    def test_visible_uuid_follows_cuda_visible_devices(self, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
        assert visible_gpu_uuid(nvml) == "GPU-cccc-2222"
        assert nvml.calls[-1] == ("shutdown", None)
        nvml.fail_init = True
        assert visible_gpu_uuid(nvml) is None
