"""A replica whose engine runs several ranks is one replica: its watchdog samples every
rank's process (and their GPU memory) and names one that goes away; the whole replica is
killed for it, once; and recycling, the surge, autoscaling and the level count it once.

The watchdog's core runs on fake samplers (``FakeRankedProcess``) and a fake clock; the
psutil sampler on real stand-in processes (``sleep`` children named ``FakeRank_TP<i>``);
the GPU probes on test_gpu's ``FakeNvml``; the controller on test_controller_recycling's
fleet harness. No Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
from fakes import FakeClock
from test_controller_recycling import WALL0, Fleet, events
from test_gpu import FakeNvml, _Proc

from ballast.config import load_config
from ballast.control.autoscaling import autoscaling_config
from ballast.control.controller import ControllerCore
from ballast.control.gpu import ProcessGpuSample, RanksGpuProbe, make_process_gpu_probe
from ballast.control.watchdog import PsutilSampler, WatchdogCore
from ballast.names import MODEL_DEPLOYMENT
from ballast.policies.control import fold_reports, serving_replicas
from ballast.policies.reports import ReplicaReport, WatchedReplica

RANKS = ((101, "VLLM::EngineCore"), (102, "VLLM::Worker_TP0"), (103, "VLLM::Worker_TP1"))
INFO = WatchedReplica(replica_id="r1", deployment=MODEL_DEPLOYMENT, started_at_s=1000.0, engine_processes=RANKS)


class FakeRankedProcess:
    """A replica and its engine's rank processes, flat; ranks leave when told (``lose``)."""

    def __init__(self) -> None:
        self.gone: list[str] = []

    def lose(self, *what: str) -> None:
        self.gone += list(what)

    def sample(self) -> dict[str, float | None]:
        return {"rss_bytes": 2e9, "threads": 120.0, "fds": 300.0, "cpu_pct": 30.0}

    def engine_gone(self) -> list[str]:
        return list(self.gone)


def core(process: FakeRankedProcess, clock: FakeClock) -> WatchdogCore:
    settings = load_config({}).watchdog.model_copy(update={"interval_s": 1.0, "warmup_s": 0})
    return WatchdogCore(settings, INFO, process, memory_total_bytes=64 << 30, fd_limit=1024, clock=clock)


class TestTheWatchdogNamesTheRank:
    def test_a_rank_that_goes_makes_the_replica_hung_at_once_idle_or_not_named_first(self) -> None:
        clock, proc = FakeClock(), FakeRankedProcess()
        c = core(proc, clock)
        for _ in range(3):
            clock.advance(1)
            c.beat(inflight=0, stalled_s=0.0)
            r = c.sample(wall_s=float(clock()))
            assert (r.hung, r.hung_reason) == (False, None)
        proc.lose("VLLM::Worker_TP1 (pid 103) exited")
        clock.advance(1)
        r = c.sample(wall_s=float(clock()))
        assert r.hung and r.hung_reason == "engine process VLLM::Worker_TP1 (pid 103) exited"
        assert c.beat(0, 0.0).hung
        # vLLM then stops the other rank and its core: the rank that went first stays named.
        proc.lose("VLLM::Worker_TP0 (pid 102) exited", "VLLM::EngineCore (pid 101) exited")
        clock.advance(1)
        assert c.sample(wall_s=float(clock())).hung_reason == "engine process VLLM::Worker_TP1 (pid 103) exited"

    def test_the_replicas_word_that_its_engine_is_dead_is_a_hang_too(self) -> None:
        clock, proc = FakeClock(), FakeRankedProcess()
        c = core(proc, clock)
        clock.advance(1)
        c.beat(inflight=2, stalled_s=0.5, engine_lost="EngineDeadError: EngineCore encountered an issue")
        r = c.sample(wall_s=float(clock()))
        assert r.hung and r.hung_reason == "engine dead: EngineDeadError: EngineCore encountered an issue"

    def test_a_stall_without_a_loss_is_still_a_stall(self) -> None:
        clock, proc = FakeClock(), FakeRankedProcess()
        c = core(proc, clock)
        clock.advance(1)
        c.beat(inflight=1, stalled_s=10.0)
        assert c.sample(wall_s=float(clock())).hung_reason == "stalled"


@pytest.fixture
def fake_ranks():
    """Two stand-in rank processes under this test process (its "replica"), named as fakes."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


class TestThePsutilSampler:
    def test_every_rank_is_sampled_with_the_replica_and_a_killed_one_is_named(self, fake_ranks) -> None:
        ranks = tuple((p.pid, f"FakeRank_TP{i}") for i, p in enumerate(fake_ranks))
        sampler = PsutilSampler(os.getpid(), ranks)
        assert sampler.sample()["threads"] >= psutil.Process().num_threads() + 2  # one thread each at least
        assert {p.pid for p in fake_ranks} <= sampler.pids()
        assert sampler.engine_gone() == []
        os.kill(fake_ranks[1].pid, signal.SIGKILL)
        gone = wait_for(sampler.engine_gone)  # exited, not yet reaped: a zombie reads as exited
        assert gone == [f"FakeRank_TP1 (pid {fake_ranks[1].pid}) exited"]
        fake_ranks[1].wait()
        assert sampler.engine_gone() == [f"FakeRank_TP1 (pid {fake_ranks[1].pid}) exited"]

    def test_a_stopped_rank_is_named_and_one_outside_the_replica_is_sampled(self, fake_ranks) -> None:
        # The "replica" here is the first stand-in; the second is not under it, as a rank
        # actor of vLLM's ray executor is not: still sampled, and watched.
        replica, rank = fake_ranks
        sampler = PsutilSampler(replica.pid, ((rank.pid, "FakeRank_TP1"),))
        assert rank.pid in sampler.pids() and sampler.sample()["threads"] >= 2
        os.kill(rank.pid, signal.SIGSTOP)
        try:
            assert wait_for(sampler.engine_gone) == [f"FakeRank_TP1 (pid {rank.pid}) is stopped"]
        finally:
            os.kill(rank.pid, signal.SIGCONT)

    def test_no_rank_is_blamed_when_the_replica_itself_is_gone(self, fake_ranks) -> None:
        replica, rank = fake_ranks
        sampler = PsutilSampler(replica.pid, ((rank.pid, "FakeRank_TP0"),))
        replica.kill()
        replica.wait()
        rank.kill()
        rank.wait()
        assert sampler.sample() == {} and sampler.engine_gone() == []


def wait_for(read, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = read()
        if got:
            return got
        time.sleep(0.01)
    return read()


class FakeNvmlWithCount(FakeNvml):
    """test_gpu's FakeNvml, counting its GPUs as pynvml does."""

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml's name
        return len(self.gpus)


class TestVramOfEveryRank:
    def test_ranks_on_several_gpus_sum_their_memory_and_the_gpus_they_use(self) -> None:
        nvml = FakeNvmlWithCount()
        gib = FakeNvml.GIB
        nvml.processes = [_Proc(102, 30 * gib, device=1), _Proc(103, 31 * gib, device=2), _Proc(999, gib, device=0)]
        probe = make_process_gpu_probe(None, 100, nvml=nvml, pids=lambda: {100, 101, 102, 103}, rank_gpus=True)
        assert isinstance(probe, RanksGpuProbe)
        # GPUs 1 and 2 (55 % and 97 % busy, 80 GiB each); GPU 0's process is another's.
        assert probe.sample() == ProcessGpuSample(
            util_pct=97.0, process_vram_bytes=61 * gib, vram_total_bytes=160 * gib
        )
        nvml.processes = []
        assert probe.sample() is None  # no rank on any GPU: absent, not 0

    def test_one_gpu_counts_the_replicas_engine_processes_too(self) -> None:
        nvml = FakeNvmlWithCount()
        nvml.processes = [_Proc(100, 1 << 30, device=0), _Proc(101, 5 << 30, device=0)]
        probe = make_process_gpu_probe("GPU-aaaa-0000", 100, nvml=nvml, pids=lambda: {100, 101})
        assert probe is not None and probe.sample().process_vram_bytes == 6 << 30
        alone = make_process_gpu_probe("GPU-aaaa-0000", 100, nvml=nvml)
        assert alone is not None and alone.sample().process_vram_bytes == 1 << 30
        assert make_process_gpu_probe(None, 100, nvml=nvml) is None  # a CPU replica: none


# -- one replica to everything that counts replicas ---------------------------------------

TP4 = {
    "model": {"name": "llama-70b", "backend": "vllm", "path": "/models/llama-70b"},
    "controller": {"report_expiry_s": 3},
    "recycle": {"max_age_s": None, "forced_max_age_s": None, "window_start_hour": None, "window_end_hour": None},
}


def tp_cfg(replicas: tuple[int, int], **recycle):
    data = {
        **TP4,
        "model": {**TP4["model"], "engine_kwargs": {"tensor_parallel_size": 4}},
        "deployments": {"model": {"min_replicas": replicas[0], "max_replicas": replicas[1], "num_gpus": 1}},
        "recycle": {**TP4["recycle"], "lease_heartbeat_s": 2, "recycle_timeout_s": 120, **recycle},
    }
    return load_config(data)


def tp_fleet(config, n: int) -> Fleet:
    """The controller harness with replicas of four ranks: each reports once, its watchdog
    once, the ranks listed in its watchdog's report."""
    clock, wall = FakeClock(0), FakeClock(WALL0)
    f = Fleet(ControllerCore(config, clock=clock, wall_clock=wall), clock, wall, n)
    for rid in list(f.watchdogs):
        ranks = tuple((1000 + i, f"VLLM::Worker_TP{i}") for i in range(4))
        f.set(rid, engine_processes=((999, "VLLM::EngineCore"), *ranks), rank_gpus=True)
    return f


class TestCountedOnce:
    def test_a_lost_rank_kills_its_replica_once_naming_the_rank(self) -> None:
        f = tp_fleet(tp_cfg((2, 2)), n=2)
        f.step()
        f.set("r1", hung=True, hung_reason="engine process VLLM::Worker_TP3 (pid 1003) exited")
        f.step(4)
        assert [o["replica_id"] for o in f.core.recycler.kill_orders] == ["r1"]  # the replica, once
        (e,) = events(f.core, "killed_hung")
        assert (e["replica_id"], e["reason"]) == ("r1", "engine process VLLM::Worker_TP3 (pid 1003) exited")

    def test_recycling_every_replica_goes_one_group_at_a_time(self) -> None:
        f = tp_fleet(tp_cfg((2, 2)), n=2)
        f.step()
        assert sorted(f.core.request_recycle(None, MODEL_DEPLOYMENT, True, "ops")) == ["r0", "r1"]
        snap = f.step()
        assert len(snap["recycle_orders"]) == 1  # max_unavailable 1: one replica of four ranks, not four

    def test_the_surge_for_a_lone_replica_is_one_more_group(self) -> None:
        f = tp_fleet(tp_cfg((1, 2), min_available=1, max_age_s=100, forced_max_age_s=None), n=1)
        f.step(50)
        snap = f.step(60)
        assert snap["desired_replicas"][MODEL_DEPLOYMENT] == 2  # one replica more: one placement group

    def test_autoscaling_bounds_and_the_level_read_replicas_not_ranks(self) -> None:
        cfg = tp_cfg((1, 3))
        auto = autoscaling_config(cfg)
        assert (auto["min_replicas"], auto["max_replicas"]) == (1, 3)
        assert auto["policy"]["policy_kwargs"]["max_replicas"] == 3
        # Each replica reports its engine's queue and KV once, whatever its ranks.
        tp = ReplicaReport(replica_id="a", deployment=MODEL_DEPLOYMENT, queued=3, running=8, kv_util_pct=40.0)
        other = ReplicaReport(replica_id="b", deployment=MODEL_DEPLOYMENT, queued=1, running=2, kv_util_pct=60.0)
        signals = fold_reports([], [tp, other], MODEL_DEPLOYMENT)
        assert (signals.queue_length, signals.kv_util_pct) == (4, 50.0)
        assert serving_replicas([tp, other], {}, MODEL_DEPLOYMENT) == 2
