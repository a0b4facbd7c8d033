"""serve_app.control.watchdog.WatchdogCore: sampling, leak verdicts, the ladder and hangs, without Ray.

The replica process is a ``FakeProcess`` (it cannot be a real leaking process in a
unit test) and the GPU a ``FakeGpu`` (this machine has no GPU); time is a
``FakeClock``. The real psutil sampler is exercised against this test's own process.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

from serve_app.config import WatchdogSettings
from serve_app.model.gpu import ProcessGpuSample
from serve_app.control.watchdog import MB, PsutilSampler, WatchdogCore

from fakes import FakeClock

GIB = 1 << 30


class FakeProcess:
    """A replica process whose RSS grows at ``leak_mb_per_s`` (threads and fds flat)."""

    def __init__(self, clock: FakeClock, rss_mb: float = 700.0, leak_mb_per_s: float = 0.0) -> None:
        self.clock = clock
        self.rss0 = rss_mb * MB
        self.leak = leak_mb_per_s * MB
        self.gone = False

    def sample(self) -> dict[str, Optional[float]]:
        if self.gone:
            return {}
        return {"rss_bytes": self.rss0 + self.leak * self.clock(), "threads": 40.0, "fds": 90.0, "cpu_pct": 12.0}


class FakeGpu:
    """Stands in for serve_app.model.gpu.ProcessGpuProbe: a fixed share of an 80 GiB device."""

    def __init__(self, used_bytes: int, total_bytes: int = 80 * GIB) -> None:
        self.used, self.total = used_bytes, total_bytes

    def sample(self) -> ProcessGpuSample:
        return ProcessGpuSample(util_pct=55.0, process_vram_bytes=self.used, vram_total_bytes=self.total)


SETTINGS = WatchdogSettings(interval_s=1.0, leak_window_s=60, step_interval_s=5, warmup_s=0)
INFO = {"replica_id": "r1", "deployment": "BallastModel", "started_at_s": 1000.0}


def core(process=None, gpu=None, clock: Optional[FakeClock] = None, settings: WatchdogSettings = SETTINGS) -> tuple[WatchdogCore, FakeClock]:
    clock = clock or FakeClock()
    proc = process or FakeProcess(clock)
    proc.clock = clock
    return WatchdogCore(settings, INFO, proc, gpu=gpu, memory_total_bytes=24 * GIB, fd_limit=1024, clock=clock), clock


def run(c: WatchdogCore, clock: FakeClock, seconds: int) -> list[dict]:
    reports = []
    for _ in range(seconds):
        clock.advance(1)
        reports.append(c.sample(wall_s=float(clock())))
    return reports


def test_a_flat_replica_stays_ready_with_no_actions() -> None:
    c, clock = core()
    reports = run(c, clock, 120)
    last = reports[-1]
    assert last["severity"] == "ok" and last["ready"] and not last["recycle_requested"]
    assert last["trends"]["rss_bytes"]["leaking"] is False
    assert sum(last["actions_total"].values()) == 0
    assert c.beat(0, 0)["actions"] == []
    assert last["rss_bytes"] == 700 * MB and last["threads"] == 40 and last["fds"] == 90
    assert last["vram_bytes"] is None and last["gpu_util_pct"] is None  # no GPU: absent, not 0


def test_a_fast_leak_is_critical_and_the_replica_is_told_once() -> None:
    # 20 MB/s against 24 GiB: minutes to the limit, well under critical_tto_s (1 h).
    c, clock = core(FakeProcess(FakeClock(), leak_mb_per_s=20.0))
    reports = run(c, clock, 29)
    assert all(r["severity"] == "ok" for r in reports), "no verdict before half the window"
    reports = run(c, clock, 2)
    last = reports[-1]
    assert last["severity"] == "critical" and last["critical"]
    assert last["trends"]["rss_bytes"]["leaking"]
    tto = last["trends"]["rss_bytes"]["time_to_limit_s"]
    expected = (24 * GIB - (700 * MB + 20 * MB * clock())) / (20 * MB)
    assert tto == pytest.approx(expected, rel=0.1)
    assert last["trends"]["rss_bytes"]["slope_per_h"] == pytest.approx(20 * MB * 3600, rel=0.05)
    reply = c.beat(0, 0)
    assert reply["actions"] == ["gc_collect", "stop_intake", "request_recycle"]  # no GPU: no empty_cache
    assert reply["ready"] is False and reply["recycle"] is True
    assert c.beat(0, 0)["actions"] == [], "actions are delivered once"
    assert last["actions_total"]["request_recycle"] == 1


def test_vram_near_the_device_total_is_critical_and_empties_the_cache() -> None:
    c, clock = core(gpu=FakeGpu(int(79 * GIB)))  # 98.75 % of 80 GiB
    last = run(c, clock, 1)[-1]
    assert last["severity"] == "critical"
    assert last["vram_bytes"] == 79 * GIB and last["vram_total_bytes"] == 80 * GIB and last["gpu_util_pct"] == 55.0
    assert c.beat(0, 0)["actions"] == ["gc_collect", "empty_cache", "stop_intake", "request_recycle"]


def test_no_progress_with_work_in_flight_is_a_hang_after_three_intervals() -> None:
    c, clock = core()
    c.beat(inflight=2, progress=10)
    for _ in range(3):
        clock.advance(1)
        c.beat(inflight=2, progress=10)  # heartbeats arrive, the work loop does not move
        assert not c.sample()["hung"]
    clock.advance(1)
    r = c.sample()
    assert r["hung"] and r["heartbeat_age_s"] == 4.0


def test_progress_or_idleness_is_not_a_hang() -> None:
    c, clock = core()
    for i in range(10):
        clock.advance(1)
        c.beat(inflight=3, progress=i)  # moving
        assert not c.sample()["hung"]
    for _ in range(10):
        clock.advance(1)
        c.beat(inflight=0, progress=9)  # idle: nothing to be stuck on
        assert not c.sample()["hung"]


def test_silence_with_work_last_seen_in_flight_is_a_hang() -> None:
    # An event loop blocked solid sends no beats at all; the last known in-flight count stands.
    c, clock = core()
    c.beat(inflight=1, progress=5)
    clock.advance(4)
    assert c.sample()["hung"]


def test_a_replica_that_is_gone_samples_as_absent() -> None:
    proc = FakeProcess(FakeClock())
    c, clock = core(proc)
    run(c, clock, 5)
    proc.gone = True
    last = run(c, clock, 1)[-1]
    assert last["rss_bytes"] is None and last["severity"] == "ok"


def test_psutil_sampler_reads_a_real_process() -> None:
    s = PsutilSampler(os.getpid())
    r = s.sample()
    assert r["rss_bytes"] > 10 * MB and r["threads"] >= 1 and r["fds"] >= 3
    assert s.fd_limit is None or s.fd_limit >= 64


def test_growth_during_warm_up_is_not_sampled() -> None:
    # A replica loading and serving its first batches grows fast; after warm-up it is flat.
    clock = FakeClock()

    class WarmingUp(FakeProcess):
        def sample(self):
            t = self.clock()
            rss = 300 * MB + min(t, 20) * 20 * MB  # +400 MB over the first 20 s, then flat
            return {"rss_bytes": float(rss), "threads": 40.0, "fds": 90.0}

    c, clock = core(WarmingUp(clock), clock=clock, settings=SETTINGS.model_copy(update={"warmup_s": 30}))
    reports = run(c, clock, 120)
    assert all(r["warming_up"] for r in reports[:29]) and not reports[-1]["warming_up"]
    assert all(r["severity"] == "ok" and not r["trends"].get("rss_bytes", {}).get("leaking") for r in reports)
    c2, clock2 = core(WarmingUp(FakeClock()), settings=SETTINGS)  # no warm-up: the same growth reads as a leak
    assert any(r["trends"]["rss_bytes"]["leaking"] for r in run(c2, clock2, 40))
