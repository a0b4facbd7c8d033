"""The model deployment: a torch model with iteration-level batching, streaming token batches.

One replica holds one backend (GPU when present, else CPU) and one engine loop
that runs a :class:`~ballast.model.builtin_engine.LiveBatch` chunk by chunk
(``stream_chunk_tokens`` decode steps each). A request from the router waits in
the replica's line until the next chunk boundary, joins the running batch there
and leaves it as soon as it has its own tokens, so a short request never waits
for the longest one in a batch (``@serve.batch`` would run a batch to its
longest member; under a noisy tenant's long requests that doubled a quiet
tenant's p99). Each chunk is handed to its request as soon as it is decoded, so
streaming and unary calls share one code path (unary collects the chunks).

One request's fault fails that request only. Before a request joins, its sampling
is checked and normalised (``hf_engine.RowSampling.of``: a seed is an int64, a
temperature below 1e-5 is greedy, NaN and infinities are refused), its engine checks
it (``check``: vLLM's own validation; a guided-decoding grammar compiled off the event
loop within ``model.grammar_compile_timeout_s``) and a resumed stream's ids are checked
against the vocabulary: a refusal is a 400 for that request (``EngineRefused``,
``SchemaTooComplex``), no model failure. A row that fails inside the batch (refused at
its join, its own sampling, non-finite logits, vLLM failing that request) leaves alone
(``Batch.take_failed``) and the others go on; an exception out of a chunk is a fault
of the step itself and fails every row in the batch.

Degradation constraints reach the replica through its snapshot cache: the batch
size limit follows ``max_batch_size`` of the current level and ``max_tokens`` is
clamped again here (the router already clamped; a replica never trusts that).

Each replica spawns its own watchdog actor (``ballast.control.watchdog``) and beats to it
every ``watchdog.interval_s`` with its in-flight count and a progress counter the
work loop bumps once per decode step; the reply carries the watchdog's ladder
actions (gc, empty the CUDA cache) and whether to keep taking work. Readiness
reaches Serve's request routing through ``record_routing_stats`` (see
``ballast.model.routing``). A recycle order for this replica in the snapshot makes
``check_health`` fail, so Serve drains it gracefully and starts a replacement
(Serve has no restart API); the order lapses with its lease.

About once per ``report_interval_s`` the replica reports queue length, running
requests, batch statistics and GPU utilization / VRAM (absent — ``None`` — without
a GPU) to the controller, and takes the snapshot back in the same call.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncGenerator, Optional

from ray import serve

from ballast.policies.admission import clamp_max_tokens
from ballast.policies.deadline import replica_deadline_s
from ballast.policies.reports import ReplicaReport, WatchdogOrders, WatchedReplica
from ballast.policies.scheduler import DEADLINE, STALLED, SchedulerConfig, batch_row_limit, schedule, timeout_reason
from ballast.policies.stats import nearest_rank
from ballast.policies.window import CountWindow

from ballast.model.engine import build_engine
from ballast.model.chaos import ChaosAgent
from ballast.config import BallastConfig, ModelConfig, load_config
from ballast.control.link import connect
from ballast.control.names import FALLBACK_DEPLOYMENT, MODEL_DEPLOYMENT
from ballast.errors import DeadlineExceeded
from ballast.stops import StopScanner
from ballast.control.gpu import make_gpu_probe, visible_gpu_uuid
from ballast.model.niceness import yield_cpu_to
from ballast.model.routing import request_router_config
from ballast.control.snapshot import Snapshot

log = logging.getLogger("ballast.model")

WINDOW = 512  # bounded windows for batch sizes and queue waits
# Queue waits count for this long. Without an age bound, a replica that saw a burst of
# long waits would keep reporting them while the level it caused sheds everything (no new
# waits arrive at level 4), and the level could not come down until the replica died.
# Short, too: a report is one sample for the level (one sample moves it one level,
# ballast/policies/degradation.py), so one slow request must not be reported for ten seconds.
WAIT_WINDOW_S = 2.0


# What a request's queue gets when the engine drops it for its deadline.
_DEADLINE_MARK: dict[str, Any] = {"deadline_exceeded": True, "text": "", "tokens": 0}


class ModelStalled(RuntimeError):
    """The replica's work loop made no progress while a request waited for it.

    Raised instead of DeadlineExceeded when a request's deadline passes with the
    engine stuck (``ballast.policies.scheduler.timeout_reason``), so the router's breaker can
    tell a hung model (a health failure) from a busy one (the request's own time ran
    out: not the model's fault, and not counted against it).
    """


@dataclass
class _Item:
    ids: list[int]  # the prompt's tokens
    max_tokens: int
    enqueued_at_s: float
    deadline_s: float  # monotonic, this process: the caller's remaining budget
    decoder: Any  # the backend's stream decoder: text piece by piece
    sampling: Any = None  # hf_engine.RowSampling; None: greedy
    stops: Optional[StopScanner] = None
    key: int = 0
    started: bool = False
    cancelled: bool = False
    queue_wait_ms: float = 0.0
    emitted: int = 0
    # A continuation (a migrated stream): text its caller does not have yet from the
    # tokens it was given, sent before this row's first chunk; and how much of what
    # follows the caller already has (see ``resume``).
    pending: str = ""
    skip_chars: int = 0
    # Chunks for the caller; None ends the stream, an exception fails it. Bounded by
    # construction: at most ceil(max_tokens / stream_chunk_tokens) + 1 entries.
    out: "asyncio.Queue[Any]" = field(default_factory=asyncio.Queue)

    @property
    def reserved_tokens(self) -> int:
        """KV-cache tokens this row may reach: its prompt and every token it may generate."""
        return len(self.ids) + self.max_tokens


def recent_percentile(samples: CountWindow[float], now_s: float, window_s: float, q: float) -> Optional[float]:
    """The q-quantile of the samples stamped no longer than ``window_s`` ago; older ones are dropped."""
    samples.expire(now_s - window_s)
    return nearest_rank(samples, q)


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
    default room for ``max_batch_size`` rows that each fill the context; none for vLLM,
    which manages its own KV cache (the replica only bounds the rows in the engine)."""
    if m.backend == "vllm":
        return SchedulerConfig(kv_budget_tokens=None, context_tokens=context_tokens)
    return SchedulerConfig(
        kv_budget_tokens=m.kv_cache_tokens or m.max_batch_size * context_tokens, context_tokens=context_tokens
    )


class ModelServer:
    """One model replica; ``role`` "primary" serves ``model``, "fallback" serves ``fallback.model``."""

    def __init__(self, cfg: dict[str, Any], role: str = "primary"):
        self._cfg = load_config(cfg)
        if role not in ("primary", "fallback") or (role == "fallback" and self._cfg.fallback is None):
            raise ValueError(f"role: {role!r} is not served by this config")
        self._role = role
        self._model_cfg = self._cfg.model if role == "primary" else self._cfg.fallback.model
        self._deployment = MODEL_DEPLOYMENT if role == "primary" else FALLBACK_DEPLOYMENT
        yield_cpu_to(self._model_cfg.niceness)  # before torch starts its threads
        self._backend = build_engine(self._model_cfg)
        warm_started = time.monotonic()
        self._backend.warmup(warmup_batch_sizes(self._model_cfg.max_batch_size))
        log.info(
            "%s warmed over batch sizes up to %d in %.1f s",
            self._role,
            self._model_cfg.max_batch_size,
            time.monotonic() - warm_started,
        )
        self._gpu = make_gpu_probe(self._backend.device)
        self._model_max_tokens = self._backend.max_seq_len - 1
        self._sched = scheduler_config(self._model_cfg, self._backend.max_seq_len)
        self._kv_budget = self._sched.kv_budget_tokens
        self._kv_reserved = 0  # tokens the rows in the batch may reach (each row's prompt + max_tokens)
        self._evict: list[int] = []  # rows gone from the bookkeeping, still in the batch until its next chunk
        self._link, self._cache, self._exchange = connect(
            self._cfg, "report_replica", self._report, on_snapshot=self._apply_snapshot
        )
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests, benchmarks)
            self._replica_id = f"local-{id(self):x}"
        self._batch = self._backend.open_batch()
        # The line, in arrival order, by key: bounded by the deployment's max_ongoing_requests.
        self._waiting: dict[int, _Item] = {}
        self._active: dict[int, _Item] = {}  # rows in the live batch, by key
        self._next_key = 0
        self._wake: Optional[asyncio.Event] = None
        self._engine_task: Optional[asyncio.Task] = None
        self._queued = 0
        self._running = 0
        self._batches = 0
        self._batch_sizes: CountWindow[int] = CountWindow(WINDOW)
        self._waits_ms: CountWindow[float] = CountWindow(WINDOW)  # stamped with monotonic time
        self._batch_limit = 0
        self._chaos = ChaosAgent(self._cfg.chaos.enabled, self._cfg.chaos.max_leak_mb, device=self._backend.device)
        self._started_at_s = time.time()
        self._progress_at_s = time.monotonic()  # when the work loop last moved (a chunk brought tokens)
        self._busy_since_s = self._progress_at_s  # when work last arrived at an idle replica
        self._ready = True  # the watchdog's verdict: keep taking new work
        self._recycle_order: Optional[dict[str, Any]] = None
        self._beat_task: Optional[asyncio.Task] = None
        self._watchdog = self._spawn_watchdog()
        self._apply_batch_limit(self._cache.effective().constraints.max_batch_size)

        self._create_metrics()

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

    # -- watchdog, readiness and recycling ---------------------------------------------
    def _spawn_watchdog(self) -> Any:
        from ballast.control.watchdog import spawn_watchdog

        try:
            return spawn_watchdog(
                self._cfg,
                WatchedReplica(
                    replica_id=self._replica_id,
                    deployment=self._deployment,
                    started_at_s=self._started_at_s,
                    gpu_uuid=visible_gpu_uuid() if self._backend.device.startswith("cuda") else None,
                ),
            )
        except Exception:  # a replica without its watchdog still serves; the gap is logged
            log.exception("could not start the watchdog for %s", self._replica_id)
            return None

    def _start_loops(self) -> None:
        self._exchange.start()
        if self._engine_task is None or self._engine_task.done():
            if self._engine_task is not None and not self._engine_task.cancelled():
                log.error("engine loop ended: %r; restarting it", self._engine_task.exception())
            self._wake = asyncio.Event()
            self._engine_task = asyncio.get_running_loop().create_task(self._engine())
        if self._watchdog is not None and (self._beat_task is None or self._beat_task.done()):
            self._beat_task = asyncio.get_running_loop().create_task(self._beat_loop())

    async def _beat_loop(self) -> None:
        interval = self._cfg.watchdog.interval_s
        while True:
            try:
                reply = await asyncio.wait_for(
                    self._watchdog.beat.remote(self._queued + self._running, self._stalled_s(time.monotonic())),
                    interval * 2,
                )
                self._apply_watchdog(reply)
            except Exception as e:  # a watchdog that died with its node: keep serving
                log.debug("watchdog beat failed: %r", e)
            await asyncio.sleep(interval)

    def _stalled_s(self, now: float) -> float:
        """How long the work loop has not moved with work in flight, on this replica's
        clock (the watchdog judges a hang from it; a late heartbeat does not add to it)."""
        if self._queued + self._running == 0:
            return 0.0
        return max(0.0, now - max(self._progress_at_s, self._busy_since_s))

    def _apply_watchdog(self, reply: WatchdogOrders) -> None:
        for action in reply.actions:
            if action == "gc_collect":
                gc.collect()
            elif action == "empty_cache" and self._backend.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
        self._ready = reply.ready

    def _draining(self) -> Optional[str]:
        """Why this replica is being recycled, while its order (lease) is live; else None."""
        o = self._recycle_order
        if o and time.time() < float(o.get("expires_at_s", 0)):
            return str(o.get("reason", "recycle"))
        return None

    def record_routing_stats(self) -> dict[str, Any]:
        # Serve polls this and hands it to the request router (ballast.model.routing).
        return {"ready": self._ready and self._draining() is None}

    # -- control loop ------------------------------------------------------------------
    def _apply_batch_limit(self, level_limit: int) -> None:
        self._batch_limit = batch_row_limit(self._model_cfg.max_batch_size, level_limit)

    def _apply_snapshot(self, snap: Snapshot) -> None:
        self._apply_batch_limit(self._cache.effective().constraints.max_batch_size)
        self._chaos.apply(snap.chaos.get(self._role))
        self._recycle_order = snap.recycle_orders.get(self._replica_id)

    def _engine_load(self) -> tuple[int, float, Optional[int], Optional[float]]:
        """(queued, KV use in percent, waiting in the engine, prefix-cache hit percent).

        An engine that schedules itself (vLLM) reports its own KV cache use and its own
        line, which counts as queue beside the replica's; for the engines Ballast batches,
        the KV use is the rows' reservation against the replica's budget."""
        stats = getattr(self._backend, "stats", None)
        if stats is None:
            return self._queued, round(100.0 * self._kv_reserved / self._kv_budget, 2), None, None
        s = stats()
        hit_pct = round(100.0 * s.prefix_cache_hit_rate, 2)
        self._m_engine_waiting.set(s.waiting)
        self._m_prefix_hits.set(hit_pct)
        return self._queued + s.waiting, round(100.0 * s.kv_cache_usage, 2), s.waiting, hit_pct

    def _report(self) -> ReplicaReport:
        """This replica's report to the controller (every report interval)."""
        gpu = self._gpu.sample() if self._gpu is not None else None
        sizes = list(self._batch_sizes)
        queued, kv_util, engine_waiting, prefix_hit_pct = self._engine_load()
        self._m_queue.set(queued)
        self._m_kv.set(kv_util)
        return ReplicaReport(
            replica_id=self._replica_id,
            deployment=self._deployment,
            role=self._role,
            queued=queued,
            running=self._running,
            batches=self._batches,
            batch_size_avg=(sum(sizes) / len(sizes)) if sizes else None,
            batch_size_limit=self._batch_limit,
            engine_waiting=engine_waiting,
            prefix_cache_hit_pct=prefix_hit_pct,
            kv_util_pct=kv_util,
            kv_tokens_reserved=self._kv_reserved,
            kv_tokens_budget=self._kv_budget,
            queue_wait_p95_ms=recent_percentile(self._waits_ms, time.monotonic(), WAIT_WINDOW_S, 0.95),
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
        why = self._draining()
        if why is not None:  # three failures in a row and Serve replaces this replica gracefully
            raise RuntimeError(f"recycling ({why}): draining for a replacement")

    async def ping(self) -> dict[str, Any]:
        self._start_loops()
        return {"replica_id": self._replica_id, **self._backend.describe()}

    async def stats(self) -> dict[str, Any]:
        return self._report().as_dict()

    # -- the engine: iteration-level batching ------------------------------------------
    async def _engine(self) -> None:
        """Run the live batch chunk by chunk while anything is waiting or decoding; at each
        chunk boundary the scheduler's decision is carried out first (``_step``)."""
        assert self._wake is not None
        chunk_tokens = self._model_cfg.stream_chunk_tokens
        while True:
            if not self._waiting and not self._active:
                self._wake.clear()
                await self._wake.wait()
                if self._model_cfg.batch_wait_timeout_s > 0:  # an idle replica gathers its first rows
                    await asyncio.sleep(self._model_cfg.batch_wait_timeout_s)
            await self._chaos.stall_point()
            leaving, joins = self._step(time.monotonic())
            if not joins and not self._active:
                self._evict = leaving  # no chunk runs now: the batch drops these rows before the next
                continue
            try:
                # Torch runs in a worker thread: the event loop stays free for new
                # requests, health checks and the report loop.
                out = await asyncio.to_thread(self._run_chunk, leaving, joins, chunk_tokens)
            except Exception as exc:  # the step itself (e.g. CUDA OOM): every row in the batch fails with it
                log.exception("a chunk failed; failing the %d rows in the batch", len(self._active))
                for it in list(self._active.values()):
                    self._finish(it, exc)
                self._batch = self._backend.open_batch()
                continue
            self._fail_rows(self._batch.take_failed())
            if any(out.values()):  # tokens came: the engine made progress (vLLM may return none within its wait)
                self._progress_at_s = time.monotonic()
            self._batches += 1
            self._batch_sizes.add(len(self._active))
            self._m_batch.observe(len(self._active))
            tokens = 0
            in_batch = set(self._batch.keys())
            for key, ids in out.items():
                it = self._active.get(key)
                if it is None:
                    continue
                it.emitted += len(ids)
                tokens += len(ids)
                self._deliver(it, ids, done=key not in in_batch)
            self._m_tokens.inc(tokens)

    def _fail_rows(self, failed: dict[int, BaseException]) -> None:
        """Rows the batch failed alone (its per-row checks, a row's own step): each request
        gets its own error (``EngineRefused``: a 400, no model failure; any other: a model
        failure of that request); the other rows go on."""
        for key, exc in failed.items():
            it = self._active.get(key)
            if it is not None:
                log.warning("row %s failed alone: %s: %s", key, type(exc).__name__, exc)
                self._finish(it, exc)

    def _deliver(self, it: _Item, ids: list[int], done: bool) -> None:
        """A row's ids of this chunk as text to its caller; the last chunk says why it ended.

        ``done``: the row left the batch (its max_tokens, or an end-of-sequence token).
        A stop string ends it here, and the batch drops it at the next chunk."""
        text, stopped = row_text(it, ids, done)
        # The ids let the router carry the stream on elsewhere if this replica goes away.
        chunk: dict[str, Any] = {"text": text, "tokens": len(ids), "ids": ids}
        if stopped or done:
            eos = bool(ids) and ids[-1] in self._backend.eos_ids and not (it.sampling and it.sampling.ignore_eos)
            chunk["finish_reason"] = "stop" if stopped or eos else "length"
            if not done:
                self._evict.append(it.key)
            self._finish(it, chunk)
        else:
            it.out.put_nowait(chunk)

    def _step(self, now: float) -> tuple[list[int], list[tuple]]:
        """Carry out the scheduler's decision at a chunk boundary (``ballast.policies.scheduler``).

        Running rows it takes out are answered as past their deadline (nothing is sent
        to a caller that left) and free their KV; waiting rows it drops leave the line,
        answered the same way; the rows it admits join. Returns the keys the batch
        drops before the chunk (those rows and the ones a stop string ended) and the
        joins to prefill, as ``LiveBatch.run_chunk`` takes them."""
        decision = schedule(self._sched, now, self._waiting.values(), self._active.values(), self._batch_limit)
        for gone in decision.finished:
            self._finish(gone.row, _DEADLINE_MARK)
        for gone in decision.dropped:
            self._leave_line(gone.row)
            if gone.reason == DEADLINE:  # no prefill spent on it
                gone.row.out.put_nowait(_DEADLINE_MARK)
        leaving = [gone.row.key for gone in decision.finished] + self._evict
        self._evict = []
        return leaving, [self._join(it, now) for it in decision.admitted]

    def _join(self, it: _Item, now: float) -> tuple:
        """``it`` leaves the line for the batch: its queue wait is counted, its KV reserved."""
        self._leave_line(it)
        it.started = True
        it.queue_wait_ms = (now - it.enqueued_at_s) * 1000.0
        self._waits_ms.add(it.queue_wait_ms, now)
        self._running += 1
        self._kv_reserved += it.reserved_tokens
        self._active[it.key] = it
        return (it.key, it.ids, it.max_tokens, it.sampling)

    def _leave_line(self, it: _Item) -> None:
        if self._waiting.pop(it.key, None) is not None:
            self._queued -= 1

    def _run_chunk(self, leaving: list[int], joins: list[tuple], steps: int) -> dict[int, list[int]]:
        import torch

        with torch.inference_mode():  # the worker thread's own mode, entered per chunk
            self._batch.remove(leaving)
            return self._batch.run_chunk(joins, steps)

    def _finish(self, it: _Item, last: Any) -> None:
        """The row leaves the batch's bookkeeping (its tensors leave at the next chunk)."""
        if self._active.pop(it.key, None) is not None:
            self._running -= 1
            self._kv_reserved -= it.reserved_tokens
        if not it.cancelled:
            it.out.put_nowait(last)
            if isinstance(last, dict) and not last.get("deadline_exceeded"):
                it.out.put_nowait(None)

    async def _chunks(self, req: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        self._start_loops()
        await self._chaos.before_request()
        constraints = self._cache.effective().constraints
        max_tokens, _ = clamp_max_tokens(int(req["max_tokens"]), constraints, self._model_max_tokens)
        now = time.monotonic()
        timeout_s = float(req.get("timeout_s") or self._cfg.resilience.max_deadline_s)
        if req.get("deadline_at_s") is not None:  # counts the time the call took to get here
            timeout_s = min(timeout_s, float(req["deadline_at_s"]) - time.time())
        prompt_ids = self._backend.tokenize(str(req["prompt"]), bool(req.get("add_special_tokens", True)))
        ids, max_tokens = self._backend.fit(prompt_ids, max_tokens)
        deadline_s = replica_deadline_s(now, timeout_s)
        sampling = await self._checked_sampling(req, deadline_s - now, timeout_s)
        self._next_key += 1
        item = _Item(
            ids,
            max_tokens,
            enqueued_at_s=now,
            deadline_s=deadline_s,
            decoder=self._backend.stream_decoder(keep_special_tokens=bool(sampling and sampling.keep_special_tokens)),
            sampling=sampling,
            stops=StopScanner(req["stop"]) if req.get("stop") else None,
            key=self._next_key,
        )
        if req.get("continue_ids"):
            resume(
                item,
                continue_ids(req["continue_ids"], self._backend.vocab_size),
                int(req.get("continue_text_chars") or 0),
            )
            if item.max_tokens <= 0:  # the lost replica had delivered every token: nothing is left
                yield {
                    "text": item.pending,
                    "tokens": 0,
                    "ids": [],
                    "finish_reason": "length",
                    "queue_wait_ms": 0.0,
                    "max_tokens": max_tokens,
                }
                return
        self._enqueue(item, now)
        try:
            first = True
            while True:
                try:
                    chunk = await asyncio.wait_for(item.out.get(), max(0.0, item.deadline_s - time.monotonic()))
                except asyncio.TimeoutError:
                    raise self._timed_out(item, timeout_s, time.monotonic()) from None
                if chunk is None:
                    return
                if isinstance(chunk, BaseException):
                    raise chunk
                if chunk.get("deadline_exceeded"):
                    raise DeadlineExceeded(f"deadline of {timeout_s:.3f}s passed while generating")
                if first:
                    chunk = {**chunk, "queue_wait_ms": round(item.queue_wait_ms, 3), "max_tokens": max_tokens}
                    first = False
                yield chunk
        finally:
            item.cancelled = True  # a caller that left: the engine drops the row at the next chunk
            if not item.started:
                self._leave_line(item)
            elif item.key in self._active:
                self._wake.set()

    def _enqueue(self, item: _Item, now: float) -> None:
        """``item`` joins the waiting line and the engine loop is woken."""
        if self._queued + self._running == 0:
            self._busy_since_s = now
        self._waiting[item.key] = item
        self._queued += 1
        assert self._wake is not None
        self._wake.set()

    async def _checked_sampling(self, req: dict[str, Any], left_s: float, timeout_s: float) -> Any:
        """The request's sampling as the engine checked and normalised it. EngineRefused /
        SchemaTooComplex: this request alone, before any work; a grammar compile waits for
        its thread no longer than the request's own deadline (``left_s``)."""
        try:
            return await asyncio.wait_for(self._backend.check(_sampling(req)), max(0.0, left_s))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"deadline of {timeout_s:.3f}s passed before its schema compiled") from None

    def _timed_out(self, item: _Item, timeout_s: float, now: float) -> Exception:
        """The error for a request whose deadline passed before its last chunk: the
        scheduler tells a stalled engine (ModelStalled) from time that ran out."""
        reason, idle_s = timeout_reason(self._sched, now, item.enqueued_at_s, self._progress_at_s)
        if reason == STALLED:
            return ModelStalled(f"no decode step for {idle_s:.1f}s while this request waited")
        return DeadlineExceeded(f"deadline of {timeout_s:.3f}s passed while generating")

    async def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        """Unary: the whole text at once, with queue wait and compute time."""
        parts: list[str] = []
        tokens = 0
        wait_ms = 0.0
        granted = 0
        finish = "length"
        t0 = time.monotonic()
        async for chunk in self._chunks(req):
            if "queue_wait_ms" in chunk:
                wait_ms, granted = chunk["queue_wait_ms"], chunk["max_tokens"]
            parts.append(chunk["text"])
            tokens += chunk["tokens"]
            finish = chunk.get("finish_reason", finish)
        total_ms = (time.monotonic() - t0) * 1000.0
        return {
            "text": "".join(parts),
            "tokens": tokens,
            "max_tokens": granted,
            "finish_reason": finish,
            "queue_wait_ms": wait_ms,
            "compute_ms": round(max(0.0, total_ms - wait_ms), 3),
            "replica_id": self._replica_id,
        }

    async def generate_stream(self, req: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Streaming: one dict per token batch ({"text", "tokens"}, the first with queue_wait_ms)."""
        async for chunk in self._chunks(req):
            yield chunk

    def __del__(self) -> None:
        # Serve calls a deployment's __del__ when it stops the replica: its shutdown hook.
        if getattr(self, "_gpu", None) is not None:
            self._gpu.close()


def row_text(it: _Item, ids: list[int], done: bool) -> tuple[str, bool]:
    """The text of a row's next ``ids`` that its caller does not have yet, and whether a
    stop string ended the row there (``done``: the row left the batch after these ids)."""
    text = it.decoder.feed(ids, final=done and bool(ids))
    stopped = False
    if it.stops is not None:
        text = it.stops.feed(text)
        stopped = it.stops.stopped
        if done and not stopped:
            text += it.stops.finish()
    return _unsent(it, text), stopped


def resume(it: _Item, delivered: list[int], delivered_chars: int) -> None:
    """Make ``it`` the continuation of a stream whose replica went away after it had
    delivered the token ids ``delivered`` (``delivered_chars`` characters of text).

    The row prefills its prompt and those ids and generates what is left of its
    max_tokens. Its decoder and stop scanner are fed the delivered ids first, so that
    they stand where the lost replica's stood; the text that gives which the caller
    does not have yet (held back for a partial character or a possible stop string)
    goes out first, and the first ``delivered_chars`` characters are not sent again
    (the lost replica may have sent more or less of that text than the new one's
    decoder would give for the same ids: the characters, not the ids, decide).
    """
    it.ids = [*it.ids, *delivered]
    it.max_tokens -= len(delivered)
    text = it.decoder.feed(delivered)
    if it.stops is not None:
        text = it.stops.feed(text)
    it.skip_chars = delivered_chars
    it.pending = _unsent(it, text)


def _unsent(it: _Item, text: str) -> str:
    """The part of a row's next ``text`` that its caller does not have: any continuation
    text still pending first, less the characters the caller already has."""
    text, it.pending = it.pending + text, ""
    if it.skip_chars:
        cut = min(it.skip_chars, len(text))
        it.skip_chars -= cut
        text = text[cut:]
    return text


def continue_ids(ids: Any, vocab_size: int) -> list[int]:
    """A resumed stream's delivered ids, each an int in the vocabulary; else EngineRefused."""
    from ballast.errors import EngineRefused

    if not isinstance(ids, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in ids
    ):
        raise EngineRefused(f"continue_ids: must be token ids in [0, {vocab_size})", field="continue_ids")
    return list(ids)


def _sampling(req: dict[str, Any]) -> Any:
    """The request's sampling fields as the HF engine takes them, checked and normalised
    (``RowSampling.of``: EngineRefused naming a field out of range); None when it asked for
    none (the built-in model ignores sampling and decodes greedily; it has no end of
    sequence, so ``ignore_eos`` and ``min_tokens`` hold on it by themselves)."""
    if (
        all(
            not req.get(k)
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_tokens",
                "ignore_eos",
                "repetition_penalty",
                "json_schema",
                "keep_special_tokens",
            )
        )
        and req.get("seed") is None
    ):
        return None
    from ballast.model.hf_engine import RowSampling

    return RowSampling.of(req)


def model_deployment(cfg: BallastConfig):
    """The Serve deployment for ``ModelServer`` with options from the config."""
    from ballast.control.autoscaling import autoscaling_config

    d = cfg.deployments.model
    return serve.deployment(
        ModelServer,
        **d.serve_options(
            MODEL_DEPLOYMENT,
            cfg.http.access_log,
            autoscaling_config=autoscaling_config(cfg),
            request_router_config=request_router_config(cfg.watchdog.interval_s),
            health_check_period_s=d.health_check_period_s,
            health_check_timeout_s=d.health_check_timeout_s,
            graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
        ),
    )


def fallback_deployment(cfg: BallastConfig):
    """The smaller fallback model: a fixed number of replicas, its own bounded queue."""
    assert cfg.fallback is not None
    m = cfg.deployments.model  # health checks and shutdown as the primary's
    return serve.deployment(
        ModelServer,
        **cfg.fallback.deployment.serve_options(
            FALLBACK_DEPLOYMENT,
            cfg.http.access_log,
            num_replicas=cfg.fallback.deployment.replicas,
            request_router_config=request_router_config(cfg.watchdog.interval_s),
            health_check_period_s=m.health_check_period_s,
            health_check_timeout_s=m.health_check_timeout_s,
            graceful_shutdown_timeout_s=m.graceful_shutdown_timeout_s,
        ),
    )
