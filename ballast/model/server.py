"""The model deployment: one replica of a model, its engine and its loop, as Ray Serve runs it.

A replica takes a typed call from the router (``protocol.ModelCall``) and answers a
stream with ``ModelChunk``s (``generate_stream``) or a unary call with one
``ModelResult`` (``generate``). The work itself is the replica's loop
(``ballast.model.replica_loop.ReplicaLoop``): the waiting and running rows, the engine
task that runs the live batch chunk by chunk, delivery, resume and one row's faults;
it checks what the router decided (``max_tokens`` within the model's; the prompt's
ids, taken as they are when they are this engine's tokenizer's) and decides nothing
twice: the level's ``max_tokens`` is the router's alone.

This module is the Serve glue around the loop: the config, the engine's build and
warmup, the batch-size limit the level sets (through the replica's snapshot cache),
the metrics objects (created once; the loop reports through a hook), chaos, the
watchdog, readiness, recycling and the controller report.

Each replica spawns its own watchdog actor (``ballast.control.watchdog``) and beats to it
every ``watchdog.interval_s`` with its in-flight count and how long its loop has made no
progress with work in flight; the reply carries the watchdog's ladder actions (gc,
empty the CUDA cache) and whether to keep taking work. Readiness reaches Serve's
request routing through ``record_routing_stats`` (see ``ballast.model.routing``). A
recycle order for this replica in the snapshot makes ``check_health`` fail, so Serve
drains it gracefully and starts a replacement (Serve has no restart API); the order
lapses with its lease.

A replica of a vLLM model of several ranks (``tensor_parallel_size`` x
``pipeline_parallel_size``) is a placement group of one bundle per rank
(``ballast.policies.placement``): before its engine starts it sets what the ranks need
(``ballast.model.ranks``), and it hands the watchdog its engine's processes by name, so
that a rank that goes away has the whole replica killed and its requests sent elsewhere;
an engine that died fails no request here (its rows wait) and fails the health check.

About once per ``report_interval_s`` the replica reports queue length, running
requests, batch statistics and GPU utilization / VRAM (absent — ``None`` — without
a GPU) to the controller, and takes the snapshot back in the same call.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from ray import serve

from ballast.config import BallastConfig, ModelConfig, load_config
from ballast.control.gpu import make_gpu_probe, visible_gpu_uuid
from ballast.control.link import connect
from ballast.control.snapshot import Snapshot
from ballast.model.adapters import ReplicaAdapters
from ballast.model.chaos import ChaosAgent
from ballast.model.engine import build_engine, reporting_prefix, scheduling_itself, serving_lora
from ballast.model.niceness import pin_to_cores, yield_cpu_to, yield_this_thread_to
from ballast.model.protocol import ChoiceResult, ModelCall, ModelChunk, ModelResult, TokenLogprob
from ballast.model.ranks import prepare_ranks
from ballast.model.replica_loop import ReplicaLoop
from ballast.model.routing import replica_routing_stats, request_router_config
from ballast.model.vllm_stats import VLLMStats
from ballast.policies.engines import capabilities
from ballast.policies.holdings import AdapterHoldings
from ballast.policies.prefix_cache import PrefixReport
from ballast.policies.reports import (
    MAX_PROCESS_NAME_CHARS,
    ReplicaReport,
    WatchdogOrders,
    WatchedReplica,
    bounded_processes,
)
from ballast.policies.scheduler import SchedulerConfig, batch_row_limit

__all__ = [
    "ModelServer",
    "fallback_deployment",
    "model_deployment",
    "scheduler_config",
    "warmup_batch_sizes",
]

KV_FULL = 0.95  # a self-scheduling engine's KV use at which rows waiting inside it wait for room

log = logging.getLogger("ballast.model")


def warmup_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes a replica runs before it reports ready: powers of two, and the most.

    A cold replica's first large batches are slow (TorchScript specialising its graph,
    kernels and allocator on first use); run at start, they do not count as queue wait."""
    sizes, n = [], 1
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    return [*sizes, max_batch_size]


def scheduler_config(m: ModelConfig, context_tokens: int) -> SchedulerConfig:
    """The replica's scheduling limits: ``model.kv_cache_tokens`` as its KV budget, by
    default room for ``max_batch_size`` rows that each fill the context; none for an engine
    that schedules itself (vLLM), which manages its own KV cache (the replica only bounds
    the rows in the engine)."""
    if capabilities(m.backend).self_scheduling:
        return SchedulerConfig(kv_budget_tokens=None, context_tokens=context_tokens)
    return SchedulerConfig(
        kv_budget_tokens=m.kv_cache_tokens or m.max_batch_size * context_tokens, context_tokens=context_tokens
    )


class ModelServer:
    """One model replica: of model ``model`` (None: the config's first), ``role`` "primary"
    serving the model itself, "fallback" its fallback's model."""

    def __init__(self, cfg: dict[str, Any], role: str = "primary", model: str | None = None) -> None:
        self._cfg = load_config(cfg)
        self._model = model if model is not None else self._cfg.models[0].name  # the level it acts on
        fallback = self._cfg.fallback_of(self._model)
        self._model_cfg: ModelConfig  # a served model's entry, or its fallback's model
        if role == "primary":
            self._model_cfg = self._cfg.served_model(self._model)
        elif role == "fallback" and fallback is not None:
            self._model_cfg = fallback.model
        else:
            raise ValueError(f"role: {role!r} is not served by this config")
        self._role = role
        self._deployment = (
            self._cfg.deployment_name(self._model)
            if role == "primary"
            else self._cfg.fallback_deployment_name(self._model)
        )
        yield_cpu_to(self._model_cfg.niceness)  # before torch starts its threads
        if self._model_cfg.cpus:  # likewise: torch's threads take the mask they start under
            pinned = pin_to_cores(self._model_cfg.cpus)
            log.info("%s pinned to cores %s (%d threads)", self._role, sorted(self._model_cfg.cpus), pinned)
        self._placement = (
            self._cfg.placement_of(self._model) if role == "primary" else self._cfg.fallback_placement_of(self._model)
        )
        prepare_ranks(self._placement)  # a model of several ranks: their cores (CPU), their GPU share
        self._backend = build_engine(self._model_cfg, self._placement)
        warm_started = time.monotonic()
        self._backend.warmup(warmup_batch_sizes(self._model_cfg.max_batch_size))
        log.info(
            "%s warmed over batch sizes up to %d in %.1f s",
            self._role,
            self._model_cfg.max_batch_size,
            time.monotonic() - warm_started,
        )
        self._gpu = make_gpu_probe(self._backend.device)
        self._link, self._cache, self._exchange = connect(
            self._cfg, "report_replica", self._report, on_snapshot=self._apply_snapshot
        )
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests, benchmarks)
            self._replica_id = f"local-{id(self):x}"
        self._chaos = ChaosAgent(self._cfg.chaos.enabled, self._cfg.chaos.max_leak_mb, device=self._backend.device)
        self._create_metrics()
        self._loop = self._make_loop()
        self._started_at_s = time.time()
        self._ready = True  # the watchdog's verdict: keep taking new work
        self._recycle_order: dict[str, Any] | None = None
        self._beat_task: asyncio.Task[None] | None = None
        self._watchdog = self._spawn_watchdog()

    def _make_loop(self) -> ReplicaLoop:
        """The replica's loop over its engine: the scheduler's limits, the level's row limit
        as the snapshot stands, chaos's two points and the metrics hook. The primary
        refuses a max_tokens past its model's (the router admitted it against this model);
        a fallback's context may be shorter than the primary's, and its engine's ``fit``
        shortens the length instead."""
        m = self._model_cfg

        def on_chunk(rows: int, tokens: int) -> None:
            self._m_batch.observe(rows)
            if tokens:  # a chunk may bring none (vLLM's wait, a prompt-only row): Ray's counter takes > 0 only
                self._m_tokens.inc(tokens)

        return ReplicaLoop(
            self._backend,
            scheduler_config(m, self._backend.max_seq_len),
            chunk_tokens=m.stream_chunk_tokens,
            batch_limit=self._level_batch_limit(),
            max_deadline_s=self._cfg.resilience.max_deadline_s,
            max_tokens_limit=self._backend.max_seq_len - 1 if self._role == "primary" else None,
            batch_wait_s=m.batch_wait_timeout_s,
            before_request=self._chaos.before_request,
            stall_point=self._chaos.stall_point,
            on_chunk=on_chunk,
            compute=self._compute_thread(),
        )

    def _compute_thread(self) -> ThreadPoolExecutor | None:
        """The one thread the engine's chunks run on, at ``model.compute_niceness``; None
        (asyncio's default pool) when the model sets none."""
        target = self._model_cfg.compute_niceness
        if target is None:
            return None
        return ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=yield_this_thread_to, initargs=(target,))

    def _create_metrics(self) -> None:
        """The replica's metrics, created once, at construction (STYLE 8)."""
        from ray.serve import metrics

        self._m_batch = metrics.Histogram(
            "ballast_model_batch_size",
            "Rows in the live batch per generated chunk.",
            boundaries=[1, 2, 4, 8, 16, 24, 32, 64],
        )
        self._m_tokens = metrics.Counter("ballast_model_tokens_total", "Tokens generated.")
        self._m_queue = metrics.Gauge("ballast_model_queued", "Requests in this replica waiting for a batch.")
        self._m_kv = metrics.Gauge(
            "ballast_model_kv_util_pct",
            "This replica's KV cache in use, percent: the rows' reservation against its budget, "
            "or vLLM's own KV cache.",
        )
        self._m_engine_waiting = metrics.Gauge(
            "ballast_model_engine_waiting", "Requests waiting inside a self-scheduling engine (vLLM)."
        )
        self._m_prefix_hits = metrics.Gauge(
            "ballast_model_prefix_cache_hit_pct", "Prompt tokens found in vLLM's prefix cache, percent."
        )
        self._m_prefix_queries_total = metrics.Counter(
            "ballast_model_prefix_cache_queries_total", "Prompt tokens looked up in vLLM's prefix cache."
        )
        self._m_prefix_hits_total = metrics.Counter(
            "ballast_model_prefix_cache_hits_total", "Prompt tokens found in vLLM's prefix cache."
        )
        self._prefix_counted = (0, 0)  # vLLM's (queries, hits) as last added to the counters
        self._m_adapter_failures = metrics.Counter(
            "ballast_model_adapter_load_failures_total",
            "Run-time LoRA adapters this replica could not load from the snapshot (tried again later).",
        )

    # -- watchdog, readiness and recycling ---------------------------------------------
    def _spawn_watchdog(self) -> Any:
        from ballast.control.watchdog import spawn_watchdog

        rank_gpus = self._placement is not None and self._placement.gpus_per_rank > 0  # the ranks' GPUs, not its own
        try:
            return spawn_watchdog(
                self._cfg,
                WatchedReplica(
                    replica_id=self._replica_id,
                    deployment=self._deployment,
                    started_at_s=self._started_at_s,
                    gpu_uuid=visible_gpu_uuid() if self._backend.device.startswith("cuda") and not rank_gpus else None,
                    engine_processes=self._engine_processes(),
                    rank_gpus=rank_gpus,
                ),
            )
        except Exception:  # a replica without its watchdog still serves; the gap is logged
            log.exception("could not start the watchdog for %s", self._replica_id)
            return None

    def _engine_processes(self) -> tuple[tuple[int, str], ...]:
        """The engine's own processes (pid, name) for the watchdog to watch by name: every
        rank's, where the engine runs several (an engine in this process: none); within the
        watchdog's bounds (``bounded_processes``: the first ones, names cut), a cut logged."""
        try:
            found = tuple(self._backend.engine_processes())
        except Exception:  # a view for the watchdog: never a reason not to serve
            log.exception("could not list the engine's processes")
            return ()
        kept = bounded_processes(found)
        if kept != found:
            log.warning(
                "the engine lists %d processes: its watchdog watches the first %d (names cut to %d characters)",
                len(found),
                len(kept),
                MAX_PROCESS_NAME_CHARS,
            )
        return kept

    def _engine_lost(self) -> str | None:
        """Why the engine can serve no more (a rank or its core went away); None while it serves."""
        return self._backend.lost

    def _start_loops(self) -> None:
        self._exchange.start()
        self._loop.start()
        if self._watchdog is not None and (self._beat_task is None or self._beat_task.done()):
            self._beat_task = asyncio.get_running_loop().create_task(self._beat_loop())

    async def _beat_loop(self) -> None:
        interval = self._cfg.watchdog.interval_s
        while True:
            try:
                reply = await asyncio.wait_for(
                    self._watchdog.beat.remote(self._loop.in_flight, self._loop.stalled_s(), self._engine_lost()),
                    interval * 2,
                )
                self._apply_watchdog(reply)
            except Exception as e:  # a watchdog that died with its node: keep serving
                log.debug("watchdog beat failed: %r", e)
            await asyncio.sleep(interval)

    def _apply_watchdog(self, reply: WatchdogOrders) -> None:
        for action in reply.actions:
            if action == "gc_collect":
                gc.collect()
            elif action == "empty_cache" and self._backend.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
        self._ready = reply.ready

    def _draining(self) -> str | None:
        """Why this replica is being recycled, while its order (lease) is live; else None."""
        o = self._recycle_order
        if o and time.time() < float(o.get("expires_at_s", 0)):
            return str(o.get("reason", "recycle"))
        return None

    def record_routing_stats(self) -> dict[str, Any]:
        # Serve polls this and hands it to the request router (ballast.model.routing):
        # readiness, and what this replica holds (affinity): adapters, prompt blocks.
        ready = self._ready and self._draining() is None and self._engine_lost() is None
        now_s = time.time()
        return replica_routing_stats(ready, self._adapter_holdings(), now_s, self._prefix_report(now_s))

    def _prefix_report(self, now_s: float) -> PrefixReport | None:
        """The blocks the engine's prefix cache holds, for an engine that reports them (its
        row's ``prefix_events``) with prefix affinity on; else None."""
        prefix = reporting_prefix(self._backend)
        return prefix.prefix_report(now_s) if prefix is not None else None

    def _adapter_holdings(self) -> AdapterHoldings:
        """The adapters in this engine's LoRA slots as the calls it ran say (the mirror of
        vLLM's LRU of ``max_loras`` slots, ``ballast.policies.holdings``); made at first use,
        with no slots for an engine without LoRA (its row's ``lora``: nothing is reported then)."""
        held: AdapterHoldings | None = getattr(self, "_holdings_of_adapters", None)
        if held is None:
            lora = serving_lora(self._backend)
            held = AdapterHoldings(lora.lora_slots if lora is not None else 0)
            self._holdings_of_adapters = held
        return held

    # -- control loop ------------------------------------------------------------------
    def _level_batch_limit(self) -> int:
        """Rows the batch may hold at the level the snapshot cache says (``batch_row_limit``)."""
        limit = self._cache.effective(self._model).constraints.max_batch_size
        return batch_row_limit(self._model_cfg.max_batch_size, limit)

    def _apply_snapshot(self, snap: Snapshot) -> None:
        self._loop.limit_rows(self._level_batch_limit())
        self._chaos.apply(snap.chaos.get(self._role))
        self._recycle_order = snap.recycle_orders.get(self._replica_id)
        self._runtime_adapters().offer(snap.adapters)

    # -- LoRA adapters added at run time (ballast.model.adapters) ------------------------
    def _runtime_adapters(self) -> ReplicaAdapters:
        """This replica's run-time adapters, made at first use (a trial load or a snapshot)."""
        held: ReplicaAdapters | None = getattr(self, "_adapters_at_run_time", None)
        if held is None:
            held = ReplicaAdapters(
                self._backend,
                self._model_cfg.name,
                self._cfg.catalog(),
                self._cfg.adapters_root,
                on_failure=self._m_adapter_failures.inc,
            )
            self._adapters_at_run_time = held
        return held

    async def add_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load a LoRA adapter now (the admin API's trial load, before the controller lists
        it); AdapterRefused with the engine's reason, or for an engine without adapters.
        Blocking engine work runs in a worker thread."""
        return {"replica_id": self._replica_id, **await self._runtime_adapters().add(name, path)}

    async def remove_adapter(self, name: str) -> bool:
        """Unload an adapter this replica loaded at run time; False for any other."""
        return await self._runtime_adapters().remove(name)

    def _engine_stats(self) -> VLLMStats | None:
        """The engine's own view (``VLLMStats``) for an engine that schedules itself (its row's
        ``self_scheduling``), read once per report; None for the engines Ballast batches."""
        own = scheduling_itself(self._backend)
        return own.stats() if own is not None else None

    def _engine_load(self, s: VLLMStats | None) -> tuple[int, float, int | None, float | None]:
        """(queued, KV use in percent, waiting in the engine, prefix-cache hit percent).

        An engine that schedules itself (vLLM, ``s`` its stats) reports its own KV cache use
        and its own line, which counts as queue beside the replica's; for the engines Ballast
        batches, the KV use is the rows' reservation against the replica's budget."""
        loop = self._loop
        if s is None:
            budget = loop.kv_budget_tokens or 0  # the engines Ballast batches have one
            return loop.queued, round(100.0 * loop.kv_reserved_tokens / budget, 2) if budget else 0.0, None, None
        hit_pct = round(100.0 * s.prefix_cache_hit_rate, 2)
        self._m_engine_waiting.set(s.waiting)
        self._m_prefix_hits.set(hit_pct)
        return loop.queued + s.waiting, round(100.0 * s.kv_cache_usage, 2), s.waiting, hit_pct

    @staticmethod
    def _engine_rows(s: VLLMStats | None) -> int | None:
        """The rows an engine that schedules itself runs usefully (``VLLMStats.useful_rows``);
        while requests wait inside it with its KV cache full (``KV_FULL``), no more than it
        runs now. None for the engines Ballast batches: their rows are the replica's own."""
        if s is None:
            return None
        if s.waiting > 0 and s.running > 0 and s.kv_cache_usage >= KV_FULL:
            return min(s.running, s.useful_rows) if s.useful_rows is not None else s.running
        return s.useful_rows

    def _prefix_counts(self, s: VLLMStats | None) -> dict[str, int | None]:
        """vLLM's prefix-cache counters (prompt tokens looked up and found) and the blocks
        this replica reports to the routers; empty for the engines Ballast batches."""
        if s is None:
            return {}
        prefix = reporting_prefix(self._backend)
        self._count_prefix_cache(s.prefix_cache_queries, s.prefix_cache_hits)
        return {
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_blocks": prefix.prefix_blocks() if prefix is not None else None,
        }

    def _count_prefix_cache(self, queries: int, hits: int) -> None:
        """Add what vLLM counted since the last report (its own counters restart with a
        reset of its cache: then the new counts are all new)."""
        q0, h0 = self._prefix_counted
        if queries < q0 or hits < h0:
            q0 = h0 = 0
        if queries > q0:
            self._m_prefix_queries_total.inc(queries - q0)
        if hits > h0:
            self._m_prefix_hits_total.inc(hits - h0)
        self._prefix_counted = (queries, hits)

    def _report(self) -> ReplicaReport:
        """This replica's report to the controller (every report interval)."""
        gpu = self._gpu.sample() if self._gpu is not None else None
        loop = self._loop
        engine = self._engine_stats()
        queued, kv_util, engine_waiting, prefix_hit_pct = self._engine_load(engine)
        self._m_queue.set(queued)
        self._m_kv.set(kv_util)
        return ReplicaReport(
            replica_id=self._replica_id,
            deployment=self._deployment,
            role=self._role,
            queued=queued,
            running=loop.running,
            batches=loop.batches,
            batch_size_avg=loop.batch_size_avg(),
            batch_size_limit=loop.batch_limit,
            engine_waiting=engine_waiting,
            engine_rows=self._engine_rows(engine),
            prefix_cache_hit_pct=prefix_hit_pct,
            **self._prefix_counts(engine),
            kv_util_pct=kv_util,
            kv_tokens_reserved=loop.kv_reserved_tokens,
            kv_tokens_budget=loop.kv_budget_tokens,
            queue_wait_p95_ms=loop.queue_wait_p95_ms(),
            gpu_util_pct=gpu.util_pct if gpu else None,
            vram_pct=gpu.vram_pct if gpu else None,
            vram_used_bytes=gpu.vram_used_bytes if gpu else None,
            vram_total_bytes=gpu.vram_total_bytes if gpu else None,
            device=self._backend.device,
            chaos_leaked_bytes=self._chaos.leaked_bytes,
            chaos_vram_leaked_bytes=self._chaos.vram_leaked_bytes,
            chaos_vram_leak=self._chaos.vram_leak_state,
            # The chaos settings this replica applies (None when none): tests and
            # operators wait on this rather than on a guess of when a snapshot arrived.
            chaos=asdict(self._chaos.settings) if self._chaos.settings.active else None,
            started_at_s=self._started_at_s,
            ready=self._ready,
            draining=self._draining() is not None,
        )

    async def check_health(self) -> None:
        # Serve calls this every health_check_period_s: a good place to make sure the
        # report and heartbeat loops run even before the first request.
        self._start_loops()
        lost = self._engine_lost()
        if lost is not None:  # its watchdog has it killed first; this is the backstop without one
            raise RuntimeError(f"engine lost ({lost}): the replica serves no more")
        why = self._draining()
        if why is not None:  # three failures in a row and Serve replaces this replica gracefully
            raise RuntimeError(f"recycling ({why}): draining for a replacement")

    async def ping(self) -> dict[str, Any]:
        self._start_loops()
        return {"replica_id": self._replica_id, **self._backend.describe()}

    async def stats(self) -> dict[str, Any]:
        return self._report().as_dict()

    async def generate(self, call: ModelCall) -> ModelResult:
        """Unary: the whole text at once, with what the replica ran it with and where its
        time went (the first chunk's queue wait; the rest is compute); a call of several
        choices has each in ``choices`` (``unary_result``)."""
        t0 = time.monotonic()
        chunks = [chunk async for chunk in self.generate_stream(call)]
        return unary_result(chunks, call.n, (time.monotonic() - t0) * 1000.0, self._replica_id)

    async def generate_stream(self, call: ModelCall) -> AsyncGenerator[ModelChunk, None]:
        """Streaming: one chunk per token batch (``ReplicaLoop.stream``: the first of a new
        request carries its queue wait and max_tokens)."""
        self._start_loops()
        adapter = call.adapter  # counted at the first chunk: the row ran a step with it
        async for chunk in self._loop.stream(call):
            if adapter is not None:
                self._adapter_holdings().ran(adapter)
                adapter = None
            yield chunk

    def __del__(self) -> None:
        # Serve calls a deployment's __del__ when it stops the replica: its shutdown hook.
        gpu = getattr(self, "_gpu", None)
        if gpu is not None:
            gpu.close()


def unary_result(chunks: Sequence[ModelChunk], n: int, total_ms: float, replica_id: str) -> ModelResult:
    """A stream's chunks as one unary answer: each choice's text, tokens, finish and
    log-probabilities gathered by index (choice 0's at the top, ``tokens`` every choice's);
    the queue wait, length and cached tokens of the first chunk that says them."""
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    tokens, finish = [0] * n, ["length"] * n
    wait_ms, granted, cached, prompt = 0.0, 0, 0, None
    vectors: dict[int, bytes] = {}
    for chunk in chunks:
        if chunk.queue_wait_ms is not None:
            wait_ms = max(wait_ms, chunk.queue_wait_ms)  # several rows (choices, inputs): the longest
        if chunk.cached_tokens is not None:
            cached = chunk.cached_tokens
        if chunk.max_tokens is not None:
            granted = chunk.max_tokens
        if chunk.prompt_logprobs is not None and chunk.index == 0:
            prompt = chunk.prompt_logprobs
        if chunk.embedding is not None:
            vectors[chunk.index] = chunk.embedding
            continue
        i = chunk.index
        texts[i].append(chunk.text)
        logprobs[i].extend(chunk.logprobs)
        tokens[i] += chunk.tokens
        finish[i] = chunk.finish_reason or finish[i]
    choices = tuple(ChoiceResult(i, "".join(texts[i]), tokens[i], finish[i], tuple(logprobs[i])) for i in range(n))
    return ModelResult(
        text=choices[0].text,
        tokens=sum(tokens),
        finish_reason=choices[0].finish_reason,
        max_tokens=granted,
        queue_wait_ms=wait_ms,
        compute_ms=round(max(0.0, total_ms - wait_ms), 3),
        replica_id=replica_id,
        cached_tokens=cached,
        logprobs=choices[0].logprobs,
        prompt_logprobs=prompt,
        choices=choices if n > 1 else (),
        embeddings=tuple(vectors[i] for i in sorted(vectors)),
    )


def model_deployment(cfg: BallastConfig, model: str | None = None) -> Any:
    """The Serve deployment of model ``model`` (None: the first), options from the config."""
    from ballast.control.autoscaling import autoscaling_config

    name = model if model is not None else cfg.models[0].name
    d = cfg.deployment_of(name)
    return serve.deployment(
        ModelServer,
        **d.serve_options(
            cfg.deployment_name(name),
            cfg.http.access_log,
            placement=cfg.placement_of(name),
            autoscaling_config=autoscaling_config(cfg, name),
            request_router_config=request_router_config(
                cfg.watchdog.interval_s, cfg.served_model(name).routing, name, cfg.resilience.hedge.silent_after_s
            ),
            health_check_period_s=d.health_check_period_s,
            health_check_timeout_s=d.health_check_timeout_s,
            graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
        ),
    )


def fallback_deployment(cfg: BallastConfig, model: str | None = None) -> Any:
    """Model ``model``'s (None: the first's) smaller fallback model: a fixed number of
    replicas, its own bounded queue."""
    name = model if model is not None else cfg.models[0].name
    fallback = cfg.fallback_of(name)
    assert fallback is not None
    m = cfg.deployment_of(name)  # health checks and shutdown as its model's
    return serve.deployment(
        ModelServer,
        **fallback.deployment.serve_options(
            cfg.fallback_deployment_name(name),
            cfg.http.access_log,
            placement=cfg.fallback_placement_of(name),
            num_replicas=fallback.deployment.replicas,
            request_router_config=request_router_config(
                cfg.watchdog.interval_s,
                fallback.model.routing,
                fallback.model.name,
                cfg.resilience.hedge.silent_after_s,
            ),
            health_check_period_s=m.health_check_period_s,
            health_check_timeout_s=m.health_check_timeout_s,
            graceful_shutdown_timeout_s=m.graceful_shutdown_timeout_s,
        ),
    )
