"""What the vLLM engine says of itself, step by step: its stats and its step curve.

vLLM's scheduler reports each engine step to the stat loggers registered at start: the
requests running and waiting, the KV cache's use, that step's prefix-cache queries and
hits (``SchedulerStats``), and its rows' inter-token gaps (``IterationStats``). One
logger (``stat_logger_factory``) feeds a :class:`StatsSink`: the latest
:class:`VLLMStats`, and the engine's :class:`~ballast.policies.engines.StepCurve` (each
step's time against the rows in it), from which the replica reports how many rows the
engine runs usefully. Inside Ray, vLLM's own metrics go to Prometheus beside Ballast's as
``ray.serve.llm`` exports them (``engine_metrics``).
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ballast.model.untyped import VLLMObject
from ballast.policies.engines import StepCurve

__all__ = ["StatsSink", "VLLMStats", "engine_metrics", "stat_logger_factory"]


@dataclass(frozen=True)
class VLLMStats:
    """The engine's own view, as of its last step.

    ``kv_cache_usage`` is the used fraction of the KV cache (0-1);
    ``prefix_cache_queries``/``hits`` are prompt tokens looked up in the prefix
    cache and found there, cumulative since start; ``steps`` counts the steps
    the engine reported (its heartbeat while it has work); ``useful_rows`` is where more
    rows stop buying throughput, from its steps' times (``StepCurve``; None until known)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    useful_rows: int | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class StatsSink:
    """The latest :class:`VLLMStats`, written on the engine loop, read from any thread, and
    the engine's step curve (``StepCurve``): each step's time against the rows in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = VLLMStats()
        self._curve = StepCurve()

    def get(self) -> VLLMStats:
        """The last step's stats, with the curve's ``useful_rows`` as of now (fitted here,
        when read, not at every step)."""
        with self._lock:
            return replace(self._stats, useful_rows=self._curve.rows())

    def curve(self) -> dict[str, Any]:
        with self._lock:
            return self._curve.snapshot()

    def record(self, s: VLLMObject, token_gaps: Sequence[float] = ()) -> None:
        """One step's ``SchedulerStats`` (its prefix-cache figures are that step's delta) and
        its rows' inter-token gaps (``IterationStats.inter_token_latencies_iter``: the engine's
        own timestamps, so the step's time whatever the loop that reads it; a row that waited
        to run again, a gap from before it idled, is as long as that wait: the median is the
        step's time)."""
        with self._lock:
            old = self._stats
            rows = int(s.num_running_reqs)
            if token_gaps and rows > 0:
                self._curve.observe(rows, statistics.median(token_gaps))
            pcs = s.prefix_cache_stats
            queries, hits = (0, 0) if pcs.reset else (old.prefix_cache_queries, old.prefix_cache_hits)
            self._stats = VLLMStats(
                running=rows,
                waiting=int(s.num_waiting_reqs),
                kv_cache_usage=float(s.kv_cache_usage),
                prefix_cache_queries=queries + int(pcs.queries),
                prefix_cache_hits=hits + int(pcs.hits),
                steps=old.steps + 1,
            )


def stat_logger_factory(sink: StatsSink) -> VLLMObject:
    """A ``StatLoggerBase`` class feeding ``sink`` (vLLM calls it as ``cls(vllm_config, engine_index)``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):
        def __init__(self, vllm_config: VLLMObject, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: VLLMObject,
            iteration_stats: VLLMObject,
            mm_cache_stats: VLLMObject = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                sink.record(scheduler_stats, getattr(iteration_stats, "inter_token_latencies_iter", None) or ())

        def log_engine_initialized(self) -> None:
            pass

    return _SinkLogger


def engine_metrics() -> list[VLLMObject]:
    """vLLM's own metrics (TTFT, inter-token latency, preemptions, ... as ``vllm_*``) through
    Ray's metrics, as ``ray.serve.llm`` exports them (``log_engine_metrics``), in a replica;
    none outside Ray (a test's engine)."""
    import ray

    if not ray.is_initialized():
        return []
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]
