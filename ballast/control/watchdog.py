"""One watchdog actor per model replica: samples it, judges leaks and hangs, reports.

The replica spawns its watchdog (``spawn_watchdog``) on its own node with
``num_cpus=0``. The watchdog is an ordinary (non-detached) actor owned by the
replica, so it shares the replica's fate: when the replica dies, Ray kills it.

Every ``watchdog.interval_s`` the watchdog

- samples the replica *process* from outside (psutil: RSS, threads, open fds, CPU),
  with every process of its engine (vLLM's engine core and one worker per rank), and,
  where the replica or its ranks have GPUs, those GPUs through NVML (device utilization,
  these processes' memory, total memory);
- watches the engine's processes by name (``WatchedReplica.engine_processes``: at most
  ``MAX_ENGINE_PROCESSES``, the first ones the replica lists, checked again on arrival):
  one that exits (or is stopped) makes the replica hung at once, the reason naming it ("engine
  process VLLM::Worker_TP1 (pid 123) exited", ``ballast.policies.leak.engine_lost_reason``),
  as does the replica's own word that its engine is dead: an engine of several ranks
  serves only whole, so the replica goes as a whole (the controller kills it, its
  requests are sent elsewhere, Serve starts another);
- feeds the series (after ``warmup_s``) to ``ballast.policies.leak.LeakDetector``: robust
  trends over a short (fast-burn) and a long (slow-burn) window, time to limit;
  the usage ratios act on absolute ceilings from the first sample, warm-up or not;
  and walks ``ballast.policies.leak.assess``'s action ladder: gc.collect → empty the CUDA
  cache → stop taking new work → ask the controller for a recycle;
- checks the replica's heartbeats: the replica calls ``beat(inflight, stalled_s)``
  every interval, where ``stalled_s`` is how long, on its own clock, its work loop
  has not moved with work in flight. A stall past ``hang_missed_heartbeats``
  intervals, or no heartbeat for ``silent_missed_heartbeats`` intervals with work
  last seen in flight, is a hang (``ballast.policies.leak.hang_reason``), reported so
  the controller kills the replica;
- reports all of it to the controller and exports it as metrics, tagged by replica.

The actions that must run inside the replica (gc, empty_cache, readiness) go back
in the reply to ``beat`` (``ballast.policies.reports.WatchdogOrders``); the watchdog never
reaches into the replica otherwise. Its report to the controller is a
``ballast.policies.reports.WatchdogReport`` about the ``WatchedReplica`` it was spawned with.
``WatchdogCore`` is the logic without Ray, tested with fake samplers and clocks; this
module imports Ray only where the actor is made (``spawn_watchdog``) or runs, so that the
core imports on a machine without Ray (a GPU benchmark's, ``loadtest.bench_gpu``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from ballast.config import BallastConfig, WatchdogSettings, load_config
from ballast.control.gpu import make_process_gpu_probe
from ballast.policies.leak import (
    Action,
    LadderState,
    LeakDetector,
    SeriesSpec,
    Trend,
    Usage,
    Verdict,
    assess,
    engine_lost_reason,
    hang_reason,
)
from ballast.policies.reports import SeriesTrend, WatchdogOrders, WatchdogReport, WatchedReplica

log = logging.getLogger("ballast.watchdog")

MB = 1024 * 1024
MAX_PENDING_ACTIONS = 16
SERIES = ("rss_bytes", "vram_bytes", "threads", "fds")


class ProcessSampler(Protocol):
    def sample(self) -> dict[str, float | None]: ...  # rss_bytes, threads, fds, cpu_pct

    def engine_gone(self) -> list[str]: ...  # the engine processes gone, "NAME (pid N) exited"


class PsutilSampler:
    """The replica's processes as psutil sees them from the watchdog's process: the
    replica and every process under it (an engine that runs its core in child
    processes, as vLLM does, is watched whole), and its engine's processes that are not
    under it (vLLM's rank actors under its ray executor, on this node). Threads, fds and
    CPU are summed. ``engine_gone()`` names the engine's processes that went away.

    Memory: a lone replica's RSS. With child processes, the sum of each one's PSS
    (proportional set size): the libraries they all map (torch, CUDA) are counted once
    between them, where summed RSS would count them in every process (a vLLM replica
    on CPU here: 1.93 GB of RSS, 1.53 GB of PSS). PSS is read every ``pss_every``
    samples (``_Pss``)."""

    def __init__(self, pid: int, engine_processes: tuple[tuple[int, str], ...] = (), pss_every: int = 1):
        import psutil

        self._pss = _Pss(pss_every)
        self._p = psutil.Process(pid)
        self._p.cpu_percent(None)  # the first call only starts the measurement
        self._children: dict[int, Any] = {}  # pid -> psutil.Process, kept for cpu_percent's baseline
        self._engine = dict(engine_processes)  # pid -> the name it gave itself
        self._engine_procs: dict[int, Any] = {}  # pid -> psutil.Process; None: gone before the first look
        for epid in self._engine:
            try:
                self._engine_procs[epid] = psutil.Process(epid)
            except psutil.Error:
                self._engine_procs[epid] = None
        try:
            soft, _ = self._p.rlimit(psutil.RLIMIT_NOFILE)
            self.fd_limit: int | None = soft if soft > 0 else None
        except (AttributeError, OSError, psutil.Error):
            self.fd_limit = None

    def sample(self) -> dict[str, float | None]:
        import psutil

        try:
            children = self._p.children(recursive=True)
            children += self._outside({c.pid for c in children} | {self._p.pid})
            out = _usage(self._p, self._pss if children else None)
        except psutil.Error:  # the replica is gone: its fate-shared watchdog follows shortly
            return {}
        self._children = {c.pid: self._children.get(c.pid, c) for c in children}
        self._pss.keep({self._p.pid, *self._children})
        for child in self._children.values():
            try:
                for k, v in _usage(child, self._pss).items():
                    out[k] += v
            except psutil.Error:  # a child that ended between the listing and now
                continue
        sampled: dict[str, float | None] = {**out}
        return sampled

    def _outside(self, under: set[int]) -> list[Any]:
        """The engine's processes not ``under`` the replica (rank actors), with theirs."""
        import psutil

        out = []
        for epid, proc in self._engine_procs.items():
            if epid in under or proc is None:
                continue
            try:
                out += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
        return out

    def pids(self) -> set[int]:
        """Every process sampled: the replica, those under it, the engine's (for the GPU probe)."""
        return {self._p.pid, *self._children, *self._engine}

    def engine_gone(self) -> list[str]:
        """Each engine process that exited (or exited and waits to be reaped) or is stopped,
        as "NAME (pid N) exited"; [] while the replica itself is gone or going (its own
        end takes its engine with it: no rank is to blame then)."""
        if _ended(self._p) is not None:
            return []
        out = []
        for epid, name in self._engine.items():
            state = _ended(self._engine_procs.get(epid))
            if state is not None:
                out.append(f"{name} (pid {epid}) {state}")
        return out


def _ended(p: Any) -> str | None:
    """How a process ended ("exited", "is stopped"); None while it runs."""
    import psutil

    if p is None:
        return "exited"
    try:
        if not p.is_running():
            return "exited"
        status = p.status()
    except psutil.Error:
        return "exited"
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return "exited"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "is stopped"
    return None


class _Pss:
    """Each process's PSS, read from smaps every ``every`` samples: a read walks the
    process's page tables (16-22 ms per vLLM process on a 2-core host, 0.06 of a core
    for a vLLM replica sampled each second). Between reads, the last PSS plus what the
    process's RSS grew since: a leak's pages are its own, and count the same in both."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"pss_every: must be >= 1, got {every}")
        self._every = every
        self._last: dict[int, tuple[float, float, int]] = {}  # pid -> (PSS, RSS then, samples since)

    def of(self, p: Any, rss: float) -> float:
        import psutil

        last = self._last.get(p.pid)
        if last is not None and last[2] + 1 < self._every:
            pss, rss_then, since = last
            self._last[p.pid] = (pss, rss_then, since + 1)
            return max(0.0, pss + rss - rss_then)
        try:
            pss = float(p.memory_full_info().pss)
        except (psutil.AccessDenied, AttributeError):  # no smaps to read: RSS stands
            return rss
        self._last[p.pid] = (pss, rss, 0)
        return pss

    def keep(self, pids: set[int]) -> None:
        """Forget the processes no longer sampled (bounded by the processes watched)."""
        for pid in set(self._last) - pids:
            del self._last[pid]


def _usage(p: Any, pss: _Pss | None) -> dict[str, float]:
    """One process: memory (its PSS where ``pss`` is given and smaps readable, else RSS),
    threads, fds, CPU %."""
    with p.oneshot():
        memory = float(p.memory_info().rss)
        if pss is not None:
            memory = pss.of(p, memory)
        return {
            "rss_bytes": memory,
            "threads": float(p.num_threads()),
            "fds": float(p.num_fds()),
            "cpu_pct": float(p.cpu_percent(None)),
        }


def node_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def leak_specs(
    w: WatchdogSettings, rss_limit: float | None, vram_limit: float | None, fd_limit: float | None
) -> list[SeriesSpec]:
    return [
        SeriesSpec("rss_bytes", w.rss_leak_mb_per_h * MB, rss_limit),
        SeriesSpec("vram_bytes", w.vram_leak_mb_per_h * MB, vram_limit),
        SeriesSpec("threads", w.threads_leak_per_h, float(w.threads_limit)),
        SeriesSpec("fds", w.fds_leak_per_h, fd_limit),
    ]


class WatchdogCore:
    """Sampling, leak trends, the action ladder and hang detection for one replica."""

    def __init__(
        self,
        settings: WatchdogSettings,
        info: WatchedReplica,
        process: ProcessSampler,
        gpu: Any = None,  # a ProcessGpuProbe, or None without a GPU
        memory_total_bytes: int | None = None,
        fd_limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self.info = info
        self._process = process
        self._gpu = gpu
        self._clock = clock
        self._rss_limit = settings.rss_limit_mb * MB if settings.rss_limit_mb else memory_total_bytes
        self._fd_limit = fd_limit
        self._vram_limit: float | None = None
        self._leak_cfg = settings.leak_config()
        self._ladder_cfg = settings.ladder_config()
        self._detector: LeakDetector | None = None  # built at the first sample (VRAM limit known then)
        self._ladder = LadderState()
        self.ready = True
        self.recycle_requested = False
        self.hung = False
        self.hung_reason: str | None = None
        self._pending: deque[str] = deque(maxlen=MAX_PENDING_ACTIONS)
        self.actions_total: dict[str, int] = {a.value: 0 for a in Action}
        now = clock()
        self._created_s = now
        self._last_beat_s: float | None = None
        self._stalled_s = 0.0  # the replica's own figure, from its last heartbeat
        self._inflight = 0
        self._engine_lost: str | None = None  # the replica's word that its engine is dead
        self._lost_reason: str | None = None  # the first engine loss seen: it stands
        self.last_report: WatchdogReport | None = None

    # -- heartbeats from the replica -----------------------------------------------------
    def beat(self, inflight: int, stalled_s: float, engine_lost: str | None = None) -> WatchdogOrders:
        """The replica's heartbeat: its work in flight, how long its work loop has not moved
        with that work (its own clock), and why its engine is dead, if it is. The reply
        carries what it must do now."""
        self._last_beat_s = self._clock()
        self._inflight = max(0, int(inflight))
        self._stalled_s = max(0.0, float(stalled_s))
        if isinstance(engine_lost, str) and engine_lost:
            self._engine_lost = engine_lost[:500]
        actions = tuple(self._pending)
        self._pending.clear()
        return WatchdogOrders(actions=actions, ready=self.ready, recycle=self.recycle_requested, hung=self.hung)

    def heartbeat_age_s(self) -> float | None:
        """Since the last heartbeat arrived; None before the first."""
        return None if self._last_beat_s is None else self._clock() - self._last_beat_s

    # -- one sampling round ----------------------------------------------------------------
    def sample(self, wall_s: float | None = None) -> WatchdogReport:
        """One sample: the replica's usage, its trends and the ladder's verdict, the hang
        check, and the report for the controller."""
        now = self._clock()
        proc = self._process.sample()
        g = self._gpu.sample() if self._gpu is not None else None
        values: dict[str, float | None] = {
            "rss_bytes": proc.get("rss_bytes"),
            "threads": proc.get("threads"),
            "fds": proc.get("fds"),
            "vram_bytes": float(g.process_vram_bytes) if g is not None and g.process_vram_bytes is not None else None,
        }
        if g is not None:
            self._vram_limit = float(g.vram_total_bytes)
        warming_up = now - self._created_s < self.settings.warmup_s
        trends, verdict = self._judge(now, values, warming_up)
        age = self.heartbeat_age_s()
        self.hung_reason = self._hang(age)
        self.hung = self.hung_reason is not None
        self.last_report = WatchdogReport.of(
            self.info,
            at_s=wall_s if wall_s is not None else time.time(),
            **{k: values[k] for k in SERIES},
            rss_limit_bytes=self._rss_limit,
            vram_total_bytes=self._vram_limit,
            fd_limit=self._fd_limit,
            gpu_util_pct=g.util_pct if g is not None else None,
            cpu_pct=proc.get("cpu_pct"),
            heartbeat_age_s=None if age is None else round(age, 3),
            stalled_s=round(self._stalled_s, 3),
            warming_up=warming_up,
            inflight=self._inflight,
            hung=self.hung,
            hung_reason=self.hung_reason,
            severity=verdict.severity,
            reason=verdict.reason,  # what this sample found
            action_reason=self._ladder.reason,  # what made the ladder take its last rung (sticks)
            ready=self.ready,
            recycle_requested=self.recycle_requested,
            critical=verdict.severity == "critical",
            trends={
                name: SeriesTrend(
                    slope_per_h=t.slope_per_h,
                    r2=t.r2,
                    leaking=t.leaking,
                    time_to_limit_s=t.time_to_limit_s,
                    short_window=t.short,
                )
                for name, t in trends.items()
            },
            actions_total=dict(self.actions_total),
        )
        return self.last_report

    def _hang(self, age: float | None) -> str | None:
        """Why the replica is hung: its engine lost a process (the first loss seen stands:
        the rank that went first is the one named), else a stall or silence."""
        gone = getattr(self._process, "engine_gone", None)
        if self._lost_reason is None:
            self._lost_reason = engine_lost_reason(gone() if gone is not None else [], self._engine_lost)
        if self._lost_reason is not None:
            return self._lost_reason
        s = self.settings
        return hang_reason(
            self._stalled_s, age, self._inflight, s.interval_s, s.hang_missed_heartbeats, s.silent_missed_heartbeats
        )

    def _judge(self, now: float, values: dict[str, float | None], warming_up: bool) -> tuple[dict[str, Trend], Verdict]:
        """The trends (fed this sample unless warming up) and the ladder's verdict on them and
        the usage; its actions queued for the replica."""
        if self._detector is None:
            self._detector = LeakDetector(
                leak_specs(self.settings, self._rss_limit, self._vram_limit, self._fd_limit), self._leak_cfg
            )
        if not warming_up:
            self._detector.observe(now, values)
        trends = self._detector.trends(now)
        limits = {
            "rss_bytes": self._rss_limit,
            "vram_bytes": self._vram_limit,
            "threads": float(self.settings.threads_limit),
            "fds": self._fd_limit,
        }
        usage = [Usage(k, float(v), limits[k]) for k, v in values.items() if v is not None]
        verdict, self._ladder = assess(trends, usage, self._gpu is not None, self._ladder, self._ladder_cfg, now)
        for a in verdict.actions:
            self._pending.append(a.value)
            self.actions_total[a.value] += 1
            log.warning("watchdog %s: %s (%s)", self.info.replica_id, a.value, verdict.reason)
        self.ready = verdict.ready
        self.recycle_requested = verdict.recycle
        return trends, verdict


class Watchdog:
    """Ray actor around ``WatchdogCore``: a sampling loop and a ``beat`` endpoint (made an
    actor class by ``_watchdog_actor``)."""

    def __init__(self, cfg: dict[str, Any], info: WatchedReplica):
        # Ray unpickled ``info`` without its checks (``__post_init__``): run them again, so a
        # list of engine processes past its bounds is refused here, naming the field.
        info = replace(info)
        self._cfg: BallastConfig = load_config(cfg)
        if info.pid is None:  # spawn_watchdog sets it: the process this actor samples
            raise ValueError("pid: the watchdog needs its replica's process id")
        pid = info.pid
        w = self._cfg.watchdog
        proc = PsutilSampler(pid, info.engine_processes, pss_every=max(1, round(w.pss_interval_s / w.interval_s)))
        self._core = WatchdogCore(
            self._cfg.watchdog,
            info,
            proc,
            gpu=make_process_gpu_probe(info.gpu_uuid, pid, pids=proc.pids, rank_gpus=info.rank_gpus),
            memory_total_bytes=node_memory_bytes(),
            fd_limit=proc.fd_limit,
        )
        from ballast.control.link import ControllerLink  # imports Ray: only where the actor runs

        self._link = ControllerLink(self._cfg)
        self._task: asyncio.Task[None] | None = None
        self._replica_actor = str(info.actor_name)
        from ray.util import metrics  # created once, here (STYLE 8)

        tags = ("replica", "deployment")
        self._tags = {"replica": info.replica_id, "deployment": info.deployment}
        self._g = {
            k: metrics.Gauge(
                f"ballast_replica_{k}", f"Replica {k.replace('_', ' ')}, sampled by its watchdog.", tag_keys=tags
            )
            for k in ("rss_bytes", "vram_bytes", "threads", "fds", "heartbeat_age_seconds", "stalled_seconds", "ready")
        }
        self._slope = metrics.Gauge(
            "ballast_replica_leak_slope_per_hour",
            "Robust trend of a series (units per hour).",
            tag_keys=tags + ("series",),
        )
        self._leaking = metrics.Gauge(
            "ballast_replica_leaking", "1 when the series' trend is a leak.", tag_keys=tags + ("series",)
        )
        self._tto = metrics.Gauge(
            "ballast_replica_time_to_limit_seconds",
            "Time until the series reaches its limit at its trend; -1 when it is not rising credibly.",
            tag_keys=tags + ("series",),
        )
        self._actions = metrics.Counter(
            "ballast_watchdog_actions_total", "Watchdog ladder actions.", tag_keys=tags + ("action",)
        )
        self._hung = metrics.Gauge("ballast_replica_hung", "1 while the replica is hung.", tag_keys=tags)
        self._actions_seen = dict(self._core.actions_total)

    def _export(self, r: WatchdogReport) -> None:
        for k in SERIES:
            value = getattr(r, k)
            if value is not None:
                self._g[k].set(float(value), tags=self._tags)
        self._g["heartbeat_age_seconds"].set(float(r.heartbeat_age_s or 0.0), tags=self._tags)
        self._g["stalled_seconds"].set(r.stalled_s, tags=self._tags)
        self._g["ready"].set(1.0 if r.ready else 0.0, tags=self._tags)
        self._hung.set(1.0 if r.hung else 0.0, tags=self._tags)
        for series, t in r.trends.items():
            tags = {**self._tags, "series": series}
            self._slope.set(float(t.slope_per_h), tags=tags)
            self._leaking.set(1.0 if t.leaking else 0.0, tags=tags)
            tto = t.time_to_limit_s
            self._tto.set(float(tto) if tto is not None else -1.0, tags=tags)
        for action, n in r.actions_total.items():
            if n > self._actions_seen.get(action, 0):
                self._actions.inc(n - self._actions_seen.get(action, 0), tags={**self._tags, "action": action})
                self._actions_seen[action] = n

    def __repr__(self) -> str:
        # Ray's state API shows it (repr_name): which replica actor this watchdog watches.
        return f"Watchdog({self._replica_actor})"

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        interval = self._cfg.watchdog.interval_s
        timeout = self._cfg.controller.call_timeout_s
        while True:
            try:
                report = self._core.sample()
                self._export(report)
                await asyncio.wait_for(self._link.call("report_watchdog", report), timeout)
            except Exception as e:  # the controller may be restarting: keep sampling
                log.debug("watchdog report failed: %r", e)
            await asyncio.sleep(interval)

    async def start(self) -> None:
        self._ensure_loop()

    async def beat(self, inflight: int, stalled_s: float, engine_lost: str | None = None) -> WatchdogOrders:
        self._ensure_loop()
        return self._core.beat(inflight, stalled_s, engine_lost)

    async def report(self) -> WatchdogReport | None:
        return self._core.last_report


@functools.cache
def _watchdog_actor() -> Any:
    """``Watchdog`` as a Ray actor class, made once, at the first spawn."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(Watchdog)


def spawn_watchdog(cfg: BallastConfig, info: WatchedReplica) -> Any:
    """Start this replica's watchdog on its node, owned by (so fate-shared with) the caller.

    ``info`` names the replica (replica_id, deployment, started_at_s, gpu_uuid); the
    pid, actor name and namespace are added here. None outside a Ray worker.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not cfg.watchdog.enabled or not ray.is_initialized():
        return None
    from ray.serve._private.constants import SERVE_NAMESPACE  # replicas are named actors there

    ctx = ray.get_runtime_context()
    info = replace(info, pid=os.getpid(), actor_name=ctx.get_actor_name(), actor_namespace=SERVE_NAMESPACE)
    return (
        _watchdog_actor()
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ctx.get_node_id(), soft=False))
        .remote(cfg.model_dump(mode="json"), info)
    )
