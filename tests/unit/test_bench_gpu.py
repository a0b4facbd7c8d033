"""loadtest.bench_gpu on CPU: its watchdog section on CPU tensors read through a fake NVML,
its decode timings on a CPU model, and a run without CUDA that skips each section.

``FakeNvml`` stands in for the ``pynvml`` module (this machine has no GPU): one device, on
which this process uses a fixed context plus what the case's ``Leak`` holds; the probe
that reads it, ``WatchdogCore``, psutil and the tensors are the real ones. The sections
that need CUDA run in the last test, on a machine that has it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from ballast.config import load_config
from ballast.control.gpu import make_process_gpu_probe
from ballast.model.engine import build_engine
from loadtest import bench_gpu as bg

MB = bg.MB
UUID = "GPU-fake-0000"
TOTAL_MB = 512  # the fake device's memory
CONTEXT_MB = 32  # what this process holds on it besides the leak
SAMPLES = 80
SAMPLE_S = 30.0


@dataclass
class _Util:
    gpu: int


@dataclass
class _Mem:
    used: int
    total: int


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None


class FakeNvml:
    """Stands in for the pynvml module: one GPU of ``TOTAL_MB``, whose only process is
    this one, using ``CONTEXT_MB`` plus what ``leak`` holds (CPU tensors standing in for
    device memory)."""

    def __init__(self) -> None:
        self.leak = bg.Leak("cpu")

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        assert uuid == UUID
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> _Util:
        return _Util(gpu=50)

    def _used(self) -> int:
        return CONTEXT_MB * MB + self.leak.held_bytes

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> _Mem:
        return _Mem(used=self._used(), total=TOTAL_MB * MB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[_Proc]:
        return [_Proc(os.getpid(), self._used())]


@pytest.fixture(scope="module")
def cfg():
    return load_config("cluster/local.yaml")


@pytest.fixture(scope="module")
def settings(cfg):
    # Warm-up off, as the benchmark sets it. The CPU tensors that stand in for the device's
    # memory grow this process's RSS too: with no RSS limit only the VRAM series can act,
    # as on a GPU, whatever else this process holds.
    return cfg.watchdog.model_copy(update={"warmup_s": 0.0, "rss_limit_mb": None})


@pytest.fixture(scope="module")
def cpu_model(cfg):
    """The configured built-in model, narrowed so that a test's decode steps are cheap."""
    arch = cfg.model.architecture.model_copy(update={"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64})
    return build_engine(cfg.model.model_copy(update={"device": "cpu", "architecture": arch}))


def run_case(name, settings, mb, work=lambda i: None):
    """One case as the benchmark runs it, on a fresh fake device; the result and that device."""
    nvml = FakeNvml()
    probe = make_process_gpu_probe(UUID, os.getpid(), nvml=nvml)
    return bg.watchdog_case(name, settings, probe, nvml.leak, mb, SAMPLES, SAMPLE_S, work), nvml


@pytest.fixture(scope="module")
def slow(settings):
    # 0.5 MB a sample at 30 s: 60 MB/h, over the 30 MB/h a leak needs; the limit is
    # more than warn_tto_s (6 h) away at the end, so no rung is taken.
    return run_case("slow leak", settings, 0.5)


@pytest.fixture(scope="module")
def fast(settings):
    # 2 MB a sample: 240 MB/h, the limit 1.5 h away at the verdict, 1.33 h at the end: within
    # warn_tto_s, never under critical_tto_s, so the ladder climbs a rung per step_interval_s.
    return run_case("fast leak", settings, 2.0)


def test_a_slow_leak_is_measured_at_its_rate_and_named_but_not_acted_on(settings, slow):
    r, nvml = slow
    assert r.asked_mb_per_h == 60.0
    assert r.reserved_mb_per_h is None  # no allocator count on CPU: the rate asked is the truth
    assert r.slope_mb_per_h == pytest.approx(60.0, rel=1e-3)
    assert r.r2 == pytest.approx(1.0, abs=1e-3)
    assert r.leaking
    # The long window's verdict: samples spanning half the hour-long window (the first at 30 s).
    assert r.first_leak_at_s == SAMPLE_S + settings.leak_window_s * settings.leak_min_span_ratio
    room_mb = TOTAL_MB - CONTEXT_MB - 40.0
    assert r.true_tto_s == pytest.approx(room_mb / 60.0 * 3600.0)
    assert r.tto_s == pytest.approx(r.true_tto_s, rel=1e-3)
    assert r.tto_s > settings.warn_tto_s
    assert r.rungs == ()
    assert (r.ready, r.recycle) == (True, False)
    assert r.leaked_mb == 40.0
    assert r.vram_end_mb == CONTEXT_MB + 40.0
    assert r.vram_after_free_mb == CONTEXT_MB  # freed: the probe reads the context alone
    assert nvml.leak.held_bytes == 0


def test_a_fast_leak_walks_the_whole_ladder_one_rung_per_step(settings, fast):
    r, _ = fast
    assert r.slope_mb_per_h == pytest.approx(240.0, rel=1e-3)
    assert r.leaking
    assert r.true_tto_s == pytest.approx((TOTAL_MB - CONTEXT_MB - 160.0) / 240.0 * 3600.0)
    assert r.tto_s == pytest.approx(r.true_tto_s, rel=1e-3)
    assert settings.critical_tto_s < r.tto_s < settings.warn_tto_s
    assert [a for _, a in r.rungs] == ["gc_collect", "empty_cache", "stop_intake", "request_recycle"]
    times = [t for t, _ in r.rungs]
    assert times[0] == r.first_leak_at_s  # the first rung at the verdict
    assert [b - a for a, b in zip(times, times[1:])] == [settings.step_interval_s] * 3
    assert (r.ready, r.recycle) == (False, True)
    assert "vram_bytes leak" in r.reason


def test_steady_decode_work_is_no_leak(settings, cpu_model):
    r, _ = run_case("steady", settings, 0.0, work=bg.decode_work(cpu_model))
    assert r.asked_mb_per_h == 0.0
    assert r.slope_mb_per_h == pytest.approx(0.0, abs=1e-6)
    assert not r.leaking and r.first_leak_at_s is None
    assert r.true_tto_s is None
    assert r.rungs == () and (r.ready, r.recycle) == (True, False)


def test_the_case_lines_carry_the_figures(settings, fast):
    r, _ = fast
    lines = bg.case_lines(r)
    assert len(lines) == 3
    assert "asked       240 MB/h, reserved         - MB/h | measured       240 MB/h (r2 1.000)" in lines[0]
    assert f"time-to-limit {r.tto_s / 3600:.2f} h (truth {r.true_tto_s / 3600:.2f} h)" in lines[0]
    assert (
        "rungs: gc_collect at 1830 s, empty_cache at 1890 s, stop_intake at 1950 s, request_recycle at 2010 s"
        in (lines[1])
    )
    assert "ready False, recycle True" in lines[1]
    assert "process VRAM 192 MiB at the end, 32 MiB after freeing 160 MiB; 0.67 simulated h" in lines[2]
    header = bg.watchdog_header(settings, SAMPLES, SAMPLE_S)
    assert "80 samples, 30 simulated s apart" in header and "verdict after 1800 s" in header


def test_a_case_refuses_what_it_cannot_measure(settings):
    leak = bg.Leak("cpu")
    with pytest.raises(ValueError, match="samples >= 2"):
        bg.watchdog_case("x", settings, None, leak, 1.0, 1, SAMPLE_S, lambda i: None)
    with pytest.raises(ValueError, match="mb_per_sample >= 0"):
        bg.watchdog_case("x", settings, None, leak, -1.0, 10, SAMPLE_S, lambda i: None)
    assert leak.held_bytes == 0


def test_the_leaks_must_fit_half_the_free_memory():
    free = 100_000 * MB
    assert bg.leak_room_problem(free, (25.0, 500.0), 80) is None  # 42,000 MiB of 100,000 free
    problem = bg.leak_room_problem(free, (25.0, 500.0), 200)  # 105,000 MiB
    assert problem is not None and "105,000 MiB" in problem and "--fast-mb" in problem


def test_decode_timings_run_on_the_cpu_model(cpu_model):
    costs = bg.decode_costs(cpu_model, [1, 3], reps=2, sync=lambda: None)
    assert sorted(costs) == [1, 3] and all(s > 0 for s in costs.values())
    joins = bg.join_cost(cpu_model, reps=2, sync=lambda: None)
    assert list(joins) == ["2 short rows", "2 short + 1 wide row", "2 short, wide row joins"]
    assert all(s > 0 for s in joins.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the sections run (next test)")
def test_without_cuda_each_section_says_it_is_skipped(capsys):
    assert bg.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{title}: skipped: no CUDA (torch.cuda.is_available() is False)" for title in bg.SECTIONS]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: the decode and NVML sections need a GPU")
def test_on_a_gpu_every_section_runs_to_its_end(capsys):
    assert bg.main(["--rows", "1,2", "--reps", "2", "--samples", "70", "--slow-mb", "4", "--fast-mb", "40"]) == 0
    out = capsys.readouterr().out
    for title in bg.SECTIONS:
        assert title in out
    assert "skipped" not in out and "not run" not in out
    assert out.count("rungs:") == 3
