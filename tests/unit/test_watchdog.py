"""ballast.control.watchdog.WatchdogCore: sampling, leak verdicts, the ladder and hangs, without Ray.

The replica process is a ``FakeProcess`` or ``FakeShapedProcess`` (it cannot be a real
leaking process in a unit test) and the GPU a ``FakeGpu`` (this machine has no GPU); time is a
``FakeClock``. The real psutil sampler is exercised against this test's own process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import FakeClock

from ballast.config import WatchdogSettings, load_config
from ballast.control.gpu import ProcessGpuSample
from ballast.control.watchdog import MB, PsutilSampler, WatchdogCore
from ballast.policies.reports import SeriesTrend, WatchdogReport, WatchedReplica

GIB = 1 << 30


class FakeProcess:
    """A replica process whose RSS grows at ``leak_mb_per_s`` (threads and fds flat)."""

    def __init__(self, clock: FakeClock, rss_mb: float = 700.0, leak_mb_per_s: float = 0.0) -> None:
        self.clock = clock
        self.rss0 = rss_mb * MB
        self.leak = leak_mb_per_s * MB
        self.gone = False

    def sample(self) -> dict[str, float | None]:
        if self.gone:
            return {}
        return {"rss_bytes": self.rss0 + self.leak * self.clock(), "threads": 40.0, "fds": 90.0, "cpu_pct": 12.0}


class FakeGpu:
    """Stands in for ballast.control.gpu.ProcessGpuProbe: a fixed share of an 80 GiB device."""

    def __init__(self, used_bytes: int, total_bytes: int = 80 * GIB) -> None:
        self.used, self.total = used_bytes, total_bytes

    def sample(self) -> ProcessGpuSample:
        return ProcessGpuSample(util_pct=55.0, process_vram_bytes=self.used, vram_total_bytes=self.total)


SETTINGS = WatchdogSettings(interval_s=1.0, leak_window_s=60, step_interval_s=5, warmup_s=0)
INFO = WatchedReplica(replica_id="r1", deployment="BallastModel", started_at_s=1000.0)
NO_TREND = SeriesTrend(
    slope_per_h=0.0, r2=0.0, leaking=False, time_to_limit_s=None, short_window=False
)  # not judged yet


def core(
    process=None, gpu=None, clock: FakeClock | None = None, settings: WatchdogSettings = SETTINGS
) -> tuple[WatchdogCore, FakeClock]:
    clock = clock or FakeClock()
    proc = process or FakeProcess(clock)
    proc.clock = clock
    return WatchdogCore(settings, INFO, proc, gpu=gpu, memory_total_bytes=24 * GIB, fd_limit=1024, clock=clock), clock


def run(c: WatchdogCore, clock: FakeClock, seconds: int) -> list[WatchdogReport]:
    reports = []
    for _ in range(seconds):
        clock.advance(1)
        reports.append(c.sample(wall_s=float(clock())))
    return reports


def test_a_flat_replica_stays_ready_with_no_actions() -> None:
    c, clock = core()
    reports = run(c, clock, 120)
    last = reports[-1]
    assert last.severity == "ok" and last.ready and not last.recycle_requested
    assert last.trends["rss_bytes"].leaking is False
    assert sum(last.actions_total.values()) == 0
    assert c.beat(0, 0.0).actions == ()
    assert last.rss_bytes == 700 * MB and last.threads == 40 and last.fds == 90
    assert last.vram_bytes is None and last.gpu_util_pct is None  # no GPU: absent, not 0


def test_a_fast_leak_is_critical_and_the_replica_is_told_once() -> None:
    # 20 MB/s against 24 GiB: minutes to the limit, well under critical_tto_s (1 h).
    c, clock = core(FakeProcess(FakeClock(), leak_mb_per_s=20.0))
    reports = run(c, clock, 29)
    assert all(r.severity == "ok" for r in reports), "no verdict before half the window"
    reports = run(c, clock, 2)
    last = reports[-1]
    assert last.severity == "critical" and last.critical
    assert last.trends["rss_bytes"].leaking
    tto = last.trends["rss_bytes"].time_to_limit_s
    expected = (24 * GIB - (700 * MB + 20 * MB * clock())) / (20 * MB)
    assert tto == pytest.approx(expected, rel=0.1)
    assert last.trends["rss_bytes"].slope_per_h == pytest.approx(20 * MB * 3600, rel=0.05)
    reply = c.beat(0, 0.0)
    assert reply.actions == ("gc_collect", "stop_intake", "request_recycle")  # no GPU: no empty_cache
    assert reply.ready is False and reply.recycle is True
    assert c.beat(0, 0.0).actions == (), "actions are delivered once"
    assert last.actions_total["request_recycle"] == 1


def test_vram_near_the_device_total_is_critical_and_empties_the_cache() -> None:
    c, clock = core(gpu=FakeGpu(int(79 * GIB)))  # 98.75 % of 80 GiB
    last = run(c, clock, 1)[-1]
    assert last.severity == "critical"
    assert last.vram_bytes == 79 * GIB and last.vram_total_bytes == 80 * GIB and last.gpu_util_pct == 55.0
    assert c.beat(0, 0.0).actions == ("gc_collect", "empty_cache", "stop_intake", "request_recycle")


def test_a_stall_the_replica_reports_is_a_hang_after_three_intervals() -> None:
    c, clock = core()
    for stalled_s in (1.0, 2.0, 3.0):
        clock.advance(1)
        c.beat(inflight=2, stalled_s=stalled_s)  # heartbeats arrive, the work loop does not move
        assert not c.sample().hung
    clock.advance(1)
    c.beat(inflight=2, stalled_s=4.0)
    r = c.sample()
    assert r.hung and r.hung_reason == "stalled" and r.stalled_s == 4.0 and r.heartbeat_age_s == 0.0


def test_progress_or_idleness_is_not_a_hang() -> None:
    c, clock = core()
    for _ in range(10):
        clock.advance(1)
        c.beat(inflight=3, stalled_s=0.3)  # moving
        assert not c.sample().hung
    for _ in range(10):
        clock.advance(1)
        c.beat(inflight=0, stalled_s=0.0)  # idle: nothing to be stuck on
        assert not c.sample().hung


def test_late_heartbeats_from_a_replica_that_moves_are_not_a_hang() -> None:
    # A busy node delays the heartbeats themselves (4 s apart, past the stall limit);
    # each says the work loop moved moments ago.
    c, clock = core()
    for _ in range(5):
        c.beat(inflight=2, stalled_s=0.2)
        for _ in range(4):
            clock.advance(1)
            r = c.sample()
            assert not r.hung, r
    assert r.heartbeat_age_s == 4.0 and r.stalled_s == 0.2


def test_silence_with_work_last_seen_in_flight_is_a_hang_after_ten_intervals() -> None:
    # An event loop blocked solid sends no beats at all; the last known in-flight count stands.
    c, clock = core()
    c.beat(inflight=1, stalled_s=0.0)
    clock.advance(10)
    assert not c.sample().hung
    clock.advance(1)
    r = c.sample()
    assert r.hung and r.hung_reason == "silent" and r.heartbeat_age_s == 11.0


def test_a_replica_that_is_gone_samples_as_absent() -> None:
    proc = FakeProcess(FakeClock())
    c, clock = core(proc)
    run(c, clock, 5)
    proc.gone = True
    last = run(c, clock, 1)[-1]
    assert last.rss_bytes is None and last.severity == "ok"


def test_psutil_sampler_reads_a_real_process() -> None:
    s = PsutilSampler(os.getpid())
    r = s.sample()
    assert r["rss_bytes"] > 10 * MB and r["threads"] >= 1 and r["fds"] >= 3
    assert s.fd_limit is None or s.fd_limit >= 64


# A stand-in replica: a quiet process (one thread, a few fds) that starts a child holding
# 64 MB on "spawn" and stops it on "stop". The test samples it, not the test process,
# whose own threads, fds and RSS move with whatever ran before in the same session.
REPLICA_WITH_A_CHILD = """
import subprocess, sys
child = None
for line in sys.stdin:
    if line.strip() == "spawn":
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; b = bytearray(64 << 20); print('up', flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE,
        )
        child.stdout.readline()
        print("up", flush=True)
    elif line.strip() == "stop":
        child.kill()
        child.wait()
        child.stdout.close()
        print("gone", flush=True)
"""


def test_psutil_sampler_counts_the_processes_under_the_replica() -> None:
    # An engine that runs its core in a child process (vLLM) is watched whole: a child
    # holding 64 MB shows in the replica's RSS, threads and fds, and its exit takes it out again.
    import subprocess
    import sys

    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA_WITH_A_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def say(command: str, answer: str) -> None:
        replica.stdin.write(command + "\n")
        replica.stdin.flush()
        assert replica.stdout.readline().strip() == answer

    try:
        s = PsutilSampler(replica.pid)
        alone = s.sample()
        say("spawn", "up")
        with_child = s.sample()
        assert with_child["rss_bytes"] - alone["rss_bytes"] > 60 * MB
        assert with_child["threads"] > alone["threads"] and with_child["fds"] > alone["fds"]
        say("stop", "gone")
        assert s.sample()["rss_bytes"] - alone["rss_bytes"] < 30 * MB
    finally:
        replica.kill()
        replica.wait()


SHARES_WITH_ITS_CHILD = """
import os, sys, time
block = bytearray(256 << 20)
block[::4096] = b"x" * (len(block) // 4096)  # every page touched: resident
print("alloc", flush=True)
sys.stdin.readline()
if os.fork() == 0:  # the child maps the same pages, copy-on-write
    time.sleep(60)
    os._exit(0)
print("forked", flush=True)
time.sleep(60)
"""


def test_psutil_sampler_counts_pages_shared_with_a_child_once() -> None:
    # A replica whose child maps 256 MB of its pages (as a forked one does): summed RSS
    # would count them twice; the processes' PSS counts them once between them.
    import signal
    import subprocess
    import sys

    import psutil

    replica = subprocess.Popen(
        [sys.executable, "-c", SHARES_WITH_ITS_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert replica.stdout.readline() == b"alloc\n"
        s = PsutilSampler(replica.pid)
        alone = s.sample()
        replica.stdin.write(b"\n")
        replica.stdin.flush()
        assert replica.stdout.readline() == b"forked\n"
        (child,) = psutil.Process(replica.pid).children()
        with_child = s.sample()
        child_rss = child.memory_info().rss
    finally:
        os.killpg(replica.pid, signal.SIGKILL)
        replica.wait()
    assert alone["rss_bytes"] > 256 * MB and child_rss > 200 * MB  # summed RSS would be over 456 MB more
    assert with_child["rss_bytes"] < alone["rss_bytes"] + 64 * MB


GROWS_ON_COMMAND = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
blocks = []
print("up", flush=True)
for line in sys.stdin:
    block = bytearray(64 << 20)
    block[::4096] = b"x" * (len(block) // 4096)  # every page touched: resident
    blocks.append(block)
    print("grown", flush=True)
"""


def test_pss_is_read_every_few_samples_and_growth_shows_between_reads(monkeypatch) -> None:
    # smaps is read once per process every pss_every samples; 64 MB the replica takes
    # between two reads shows at the next sample, through its RSS.
    import signal
    import subprocess
    import sys

    import psutil

    reads: list[int] = []
    full_info = psutil.Process.memory_full_info

    def counted(self):  # the real read, counted
        reads.append(self.pid)
        return full_info(self)

    monkeypatch.setattr(psutil.Process, "memory_full_info", counted)
    replica = subprocess.Popen(
        [sys.executable, "-c", GROWS_ON_COMMAND],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert replica.stdout.readline() == "up\n"
        s = PsutilSampler(replica.pid, pss_every=4)
        first = s.sample()
        assert len(reads) == 2  # the replica and its child, once each
        replica.stdin.write("grow\n")
        replica.stdin.flush()
        assert replica.stdout.readline() == "grown\n"
        grown = s.sample()
        assert len(reads) == 2  # not read again ...
        assert grown["rss_bytes"] - first["rss_bytes"] > 60 * MB  # ... and the growth shows
        s.sample(), s.sample()
        assert len(reads) == 2
        again = s.sample()  # the fourth sample since the last read: smaps again
        assert len(reads) == 4
        assert abs(again["rss_bytes"] - grown["rss_bytes"]) < 16 * MB  # the estimate was the PSS
    finally:
        os.killpg(replica.pid, signal.SIGKILL)
        replica.wait()
    with pytest.raises(ValueError, match="pss_every"):
        PsutilSampler(os.getpid(), pss_every=0)


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
    assert all(r.warming_up for r in reports[:29]) and not reports[-1].warming_up
    assert all(r.severity == "ok" and not r.trends.get("rss_bytes", NO_TREND).leaking for r in reports)
    c2, clock2 = core(WarmingUp(FakeClock()), settings=SETTINGS)  # no warm-up: the same growth reads as a leak
    assert any(r.trends["rss_bytes"].leaking for r in run(c2, clock2, 40))


# ----------------------------------------------------------------- the default local config, tick by tick
#
# Settings as `make serve` loads them (cluster/local.yaml): 120 s warm-up, 4 GiB RSS
# budget, a 300 s short window judged after 90 s of samples, the hour-long long window.

LOCAL = load_config(Path(__file__).resolve().parents[2] / "cluster" / "local.yaml").watchdog
LIMIT_MB = 4096.0


class FakeShapedProcess:
    """A fake replica process whose RSS (MB) is ``shape(t)`` on the fake clock; threads and fds flat."""

    def __init__(self, clock: FakeClock, shape: Callable[[int], float]) -> None:
        self.clock, self.shape = clock, shape

    def sample(self) -> dict[str, float | None]:
        return {"rss_bytes": self.shape(int(self.clock())) * MB, "threads": 40.0, "fds": 90.0}


def local_core(shape: Callable[[int], float]) -> tuple[WatchdogCore, FakeClock]:
    clock = FakeClock()
    return WatchdogCore(
        LOCAL, INFO, FakeShapedProcess(clock, shape), memory_total_bytes=64 * GIB, fd_limit=1024, clock=clock
    ), clock


def walk_until_recycle(c: WatchdogCore, clock: FakeClock, ticks: int) -> tuple[int, dict]:
    """Sample once a tick; before the first verdict assert nothing was named or taken."""
    for _ in range(ticks):
        clock.advance(1)
        r = c.sample(wall_s=float(clock()))
        if r.reason is not None:
            return int(clock()), r
        assert (r.severity, r.ready, r.recycle_requested) == ("ok", True, False)
        assert sum(r.actions_total.values()) == 0
    raise AssertionError(f"nothing named in {ticks} ticks")


def test_the_local_config_has_a_short_window_inside_two_minutes_of_warm_up() -> None:
    assert (LOCAL.warmup_s, LOCAL.rss_limit_mb, LOCAL.leak_window_s) == (120.0, LIMIT_MB, 3600.0)
    cfg = LOCAL.leak_config()
    assert cfg.short_min_span_s < 120 <= cfg.min_span_ratio * cfg.window_s
    assert cfg.short_horizon_s == 3600.0


@pytest.mark.parametrize(
    ("leak_mb_per_s", "onset_s", "named_at_s"),
    [
        (3.0, 0, 214),  # the case: 700 MB + 3 MB/s reaches 4 GiB at t=1132 s
        (20.0, 120, 214),  # starts as warm-up ends: reaches 4 GiB at t=290 s
        (1.0, 0, 214),  # limit in 56 min: still inside the short window's hour
    ],
)
def test_a_leak_that_reaches_the_limit_within_the_hour_is_recycled_within_two_minutes_of_warm_up(
    leak_mb_per_s: float, onset_s: int, named_at_s: int
) -> None:
    shape = lambda t: 700.0 + leak_mb_per_s * max(0, t - onset_s)  # noqa: E731
    c, clock = local_core(shape)
    t, r = walk_until_recycle(c, clock, 600)
    # Named once 90 s of samples after warm-up show it (5 s buckets: t=214), within 2 min of warm-up.
    assert t == named_at_s and t - LOCAL.warmup_s <= 120
    assert r.severity == "critical" and r.reason.startswith("rss_bytes leak")
    assert r.reason.endswith("(short window)")
    trend = r.trends["rss_bytes"]
    assert trend.leaking and trend.short_window
    assert trend.slope_per_h == pytest.approx(leak_mb_per_s * MB * 3600, rel=0.05)
    limit_at_s = onset_s + (LIMIT_MB - 700.0) / leak_mb_per_s
    assert trend.time_to_limit_s == pytest.approx(limit_at_s - t, rel=0.05)
    # Limit within the hour: every rung at once, the recycle rung included, before the limit.
    assert (r.ready, r.recycle_requested) == (False, True) and t < limit_at_s
    assert c.beat(0, 0.0).actions == ("gc_collect", "stop_intake", "request_recycle")


def test_a_leak_faster_than_any_window_is_caught_by_the_ceiling_before_the_limit() -> None:
    # 20 MB/s from t=0 reaches 4 GiB at t=170 s, before the short window has 90 s of samples.
    c, clock = local_core(lambda t: 700.0 + 20.0 * t)
    t, r = walk_until_recycle(c, clock, 300)
    assert t == 150 and (r.severity, r.reason) == ("warning", "rss_bytes at 90% of limit")
    assert c.beat(0, 0.0).actions == ("gc_collect",)
    reports = run(c, clock, 14)  # t=164: 3980 MB, 97 % of the budget
    assert [x.recycle_requested for x in reports] == [False] * 13 + [True]
    assert reports[-1].severity == "critical" and reports[-1].rss_bytes < LIMIT_MB * MB
    assert c.beat(0, 0.0).actions == ("stop_intake", "request_recycle")


def test_the_absolute_ceiling_acts_on_a_flat_series_whatever_the_trend() -> None:
    # Flat at 3800 MB, 93 % of the budget: no trend, yet the ladder walks from the first sample.
    c, clock = local_core(lambda t: 3800.0)
    r = run(c, clock, 1)[-1]
    assert (r.severity, r.reason, r.warming_up) == ("warning", "rss_bytes at 93% of limit", True)
    assert c.beat(0, 0.0).actions == ("gc_collect",)
    for k, action in ((1, "stop_intake"), (2, "request_recycle")):
        reports = run(c, clock, 60)  # one rung per step_interval_s (60 s)
        assert all(not x.trends.get("rss_bytes", NO_TREND).leaking for x in reports)
        assert c.beat(0, 0.0).actions == (action,) and int(clock()) == 1 + 60 * k
    assert (reports[-1].ready, reports[-1].recycle_requested) == (False, True)
    # Over the critical ratio: every rung at once.
    c, clock = local_core(lambda t: 0.98 * LIMIT_MB)
    assert run(c, clock, 1)[-1].recycle_requested


def saw(period_s: int) -> Callable[[int], float]:
    return lambda t: 1000.0 + 200.0 * (t % period_s) / period_s  # +200 MB, then a GC drop


def warm_up(stop_s: int) -> Callable[[int], float]:
    return lambda t: 400.0 + 1500.0 * min(t, stop_s) / stop_s  # +1.5 GB, fast, then flat


def step(at_s: int) -> Callable[[int], float]:
    return lambda t: 1000.0 + (500.0 if t >= at_s else 0.0)  # +500 MB once


@pytest.mark.parametrize(
    "shape",
    [saw(30), saw(60), saw(90), warm_up(120), warm_up(160), warm_up(180), step(200), step(260), step(380)],
    ids=["saw30", "saw60", "saw90", "warm120", "warm160", "warm180", "step200", "step260", "step380"],
)
def test_sawtooth_warm_up_growth_and_a_one_off_step_are_no_leak(shape: Callable[[int], float]) -> None:
    c, clock = local_core(shape)
    for _ in range(700):  # the short window fills, slides past the event, and keeps sliding
        clock.advance(1)
        r = c.sample()
        assert (r.severity, r.reason, r.ready) == ("ok", None, True), f"t={clock()}"
        assert not r.trends.get("rss_bytes", NO_TREND).leaking, f"t={clock()}"
    assert sum(r.actions_total.values()) == 0 and c.beat(0, 0.0).actions == ()


def test_a_3_mb_per_s_leak_under_a_gc_sawtooth_is_still_named_within_two_minutes_of_warm_up() -> None:
    c, clock = local_core(lambda t: 700.0 + 3.0 * t + 200.0 * (t % 60) / 60)
    t, r = walk_until_recycle(c, clock, 600)
    assert t == 215 and t - LOCAL.warmup_s <= 120 and r.trends["rss_bytes"].short_window
    assert r.severity == "critical" and r.recycle_requested and r.rss_bytes < LIMIT_MB * MB


def test_a_replica_hands_its_watchdog_at_most_the_bound_of_engine_processes_and_says_so(caplog) -> None:
    """ModelServer._engine_processes, with a stand-in backend listing more processes than a
    test can start: the first MAX_ENGINE_PROCESSES go to the watchdog, names cut, the cut logged."""
    import logging
    import types

    from ballast.model.server import ModelServer
    from ballast.policies.reports import MAX_ENGINE_PROCESSES, MAX_PROCESS_NAME_CHARS

    listed = [(10, "VLLM::EngineCore")] + [(100 + i, "w" * 200) for i in range(MAX_ENGINE_PROCESSES)]
    server = ModelServer.__new__(ModelServer)  # only the backend is read
    server._backend = types.SimpleNamespace(engine_processes=lambda: tuple(listed))
    with caplog.at_level(logging.WARNING, logger="ballast.model.server"):
        handed = server._engine_processes()
    assert len(handed) == MAX_ENGINE_PROCESSES and handed[0] == (10, "VLLM::EngineCore")
    assert all(len(name) == MAX_PROCESS_NAME_CHARS for _, name in handed[1:])
    assert WatchedReplica("r1", "BallastModel", engine_processes=handed).engine_processes == handed
    (said,) = [r.getMessage() for r in caplog.records if "watchdog watches the first" in r.getMessage()]
    assert f"lists {MAX_ENGINE_PROCESSES + 1} processes" in said
    caplog.clear()
    server._backend = types.SimpleNamespace(engine_processes=lambda: ((10, "VLLM::EngineCore"),))
    assert server._engine_processes() == ((10, "VLLM::EngineCore"),) and not caplog.records
