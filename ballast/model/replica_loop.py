"""The replica's loop: the rows it holds and the engine it drives, apart from Serve.

A :class:`ReplicaLoop` takes one ``ModelCall`` at a time (``stream``) and answers it
with ``ModelChunk``s. It owns:

* **the rows**: a line of waiting rows and a batch of running ones, moved between the
  two as the scheduler (``ballast.policies.scheduler``) decides at each chunk
  boundary (``step``), with each row's KV reservation (prompt + max_tokens) taken when
  it joins and given back when it leaves;
* **the engine task**: one task runs the engine's live batch chunk by chunk
  (``stream_chunk_tokens`` decode steps each, in a worker thread so the event loop
  stays free), while anything waits or runs; a row joins at the next chunk boundary
  and leaves as soon as it has its tokens, so a short request never waits for the
  longest one in a batch;
* **delivery**: each row's ids as text to its caller as soon as a chunk brings them
  (its stream decoder, then its stop strings: a stop string ends the row there), the
  last chunk saying why the row ended;
* **resume**: a stream carried on from another replica prefills the ids it delivered
  and sends only the text its caller does not have (``resume``);
* **faults**: a row the batch fails alone (``Batch.take_failed``) fails its request
  only; an exception out of a chunk is the step's own and fails every row in the batch.

**Each decision once.** The router admits ``max_tokens`` (level, model, context) and
tokenizes the prompt; the loop checks, it does not decide again:
``1 <= max_tokens <= max_tokens_limit`` (else ``EngineRefused`` naming
``max_tokens``; ``max_tokens_limit`` None: a fallback model, whose context may be
shorter than the primary's the router admitted for, takes any length and the
engine's ``fit`` shortens it); ``prompt_ids`` are taken as they are when they are the
engine's tokenizer's (``call.tokenizer == engine.tokenizer_id``), checked against the
vocabulary, else the engine tokenizes ``prompt`` itself. The engine's ``fit`` may
shorten max_tokens to the context, never lengthen it. A call naming a LoRA adapter
(``call.adapter``) is refused (``EngineRefused`` naming ``model``) unless the engine
serves it now (``serves_adapter``: vLLM's only); its row joins with the adapter's name,
and the batch refuses it alone if the adapter was removed in between.

**Deadline.** A call's time is ``call.deadline.left_s(wall clock)`` (no deadline:
``max_deadline_s``); the row's own deadline ends ``REPLICA_LEAD_S`` before it
(``replica_deadline_s``), on the loop's monotonic ``clock``. The scheduler drops rows
past it; a caller still waiting when it passes gets ``ModelStalled`` when the engine
made no step for the scheduler's ``stall_s`` (a hung model), else ``DeadlineExceeded``.

**Queues.** Each row's queue carries ``ModelChunk`` (text for the caller), a
``BaseException`` (the row failed: raised to its caller) or None (the stream ended);
it holds at most ceil(max_tokens / chunk_tokens) + 1 entries.

Invariants: a row is in at most one of the line and the batch; ``queued`` and
``running`` count them; ``kv_reserved_tokens`` is the sum of the running rows'
reservations; a cancelled row gets nothing more in its queue; a row's queue receives
exactly one ending (None after its last chunk, or one exception).

What the loop observes goes out through hooks (``on_chunk``: rows and tokens per
chunk); the replica owns the metrics objects (STYLE 8). Chaos reaches it as two
awaitables (``before_request`` for each call, ``stall_point`` before each chunk).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from ballast.errors import DeadlineExceeded, EngineRefused
from ballast.model.engine import Batch, ModelBackend, StreamDecoder, TextSide, serving_lora
from ballast.model.protocol import (
    IdLogprobs,
    Join,
    ModelCall,
    ModelChunk,
    Pooling,
    RowLogprobs,
    RowSampling,
    TokenLogprob,
)
from ballast.policies.deadline import replica_deadline_s
from ballast.policies.gate import SERVICE_SAMPLES, ServiceTime, StallSpans
from ballast.policies.sampling import MAX_SEED, MIN_SEED
from ballast.policies.scheduler import DEADLINE, STALLED, SchedulerConfig, schedule, timeout_reason
from ballast.policies.stats import nearest_rank
from ballast.policies.window import CountWindow
from ballast.stops import StopScanner

__all__ = [
    "WAIT_WINDOW_S",
    "WINDOW",
    "ModelStalled",
    "ReplicaLoop",
    "ReplicaRow",
    "recent_percentile",
    "resume",
    "row_text",
    "token_ids",
]

log = logging.getLogger("ballast.model")

WINDOW = 512  # bounded windows for batch sizes and queue waits
# Queue waits count for this long. Without an age bound, a replica that saw a burst of
# long waits would keep reporting them while the level it caused sheds everything (no new
# waits arrive at level 4), and the level could not come down until the replica died.
# Short, too: a report is one sample for the level (one sample moves it one level,
# ballast/policies/degradation.py), so one slow request must not be reported for ten seconds.
WAIT_WINDOW_S = 2.0

Out = ModelChunk | BaseException | None


class ModelStalled(RuntimeError):
    """The replica's work loop made no progress while a request waited for it.

    Raised instead of DeadlineExceeded when a request's deadline passes with the
    engine stuck (``ballast.policies.scheduler.timeout_reason``), so the router's breaker can
    tell a hung model (a health failure) from a busy one (the request's own time ran
    out: not the model's fault, and not counted against it).
    """


@dataclass
class ReplicaRow:
    """One request in the replica: its prompt ids and length, its times, its text state."""

    ids: list[int]  # the prompt's tokens (and, resumed, the ones already delivered)
    max_tokens: int  # tokens still to generate
    enqueued_at_s: float
    deadline_s: float  # on the loop's clock: the caller's remaining budget, less the replica's lead
    decoder: StreamDecoder  # the engine's stream decoder: text piece by piece
    timeout_s: float = 0.0  # the time the call had when it arrived (for its error's message)
    sampling: RowSampling | None = None  # None: greedy
    adapter: str | None = None  # the LoRA adapter the row runs with (None: the base model)
    cache_salt: str | None = None  # its tenant's cache group's salt (ModelCall.cache_salt)
    priority: int = 0  # its order among rows waiting in the engine (ModelCall.priority)
    cached_tokens: int | None = None  # prompt tokens the engine took from its prefix cache
    logprobs: int | None = None  # k likeliest for each token (ModelCall.logprobs; None: none)
    prompt_logprobs: int | None = None  # k likeliest for each prompt position (echo; None: none)
    pool: Pooling | None = None  # an embeddings row: its prompt pooled into one vector
    stops: StopScanner | None = None
    key: int = 0
    # The call it belongs to: rows of one call (its choices, an embeddings call's inputs)
    # share it, and the line counts them as one request waiting (``queued``); only the
    # call's first row's wait is a queue wait (``counts_wait``): the others wait for their
    # own call's rows, which is its service, not a backlog.
    group: int = 0
    counts_wait: bool = True
    started: bool = False
    cancelled: bool = False
    queue_wait_ms: float = 0.0
    emitted: int = 0
    resumed: bool = False
    # A continuation (a migrated stream): text its caller does not have yet from the
    # tokens it was given, sent before this row's first chunk; and how much of what
    # follows the caller already has (see ``resume``).
    pending: str = ""
    skip_chars: int = 0
    out: asyncio.Queue[Out] = field(default_factory=asyncio.Queue)

    @property
    def reserved_tokens(self) -> int:
        """KV-cache tokens this row may reach: its prompt and every token it may generate."""
        return len(self.ids) + self.max_tokens


async def _nothing() -> None:
    return None


def _ignore(rows: int, tokens: int) -> None:
    return None


class ReplicaLoop:
    """The rows and the engine task of one replica (see the module docstring).

    ``engine``: a :class:`~ballast.model.engine.ModelBackend`; ``sched``: the scheduler's
    limits; ``chunk_tokens``: decode steps per chunk; ``batch_limit``: rows the batch may
    hold (``limit_rows`` changes it); ``max_deadline_s``: a call's time when it carries no
    deadline; ``max_tokens_limit``: the largest max_tokens a call may ask (None: any, the
    engine's ``fit`` shortens it); ``batch_wait_s``: an idle loop's wait for more rows
    before its first chunk. ``clock`` (monotonic) and ``wall_clock`` are injected.
    """

    def __init__(
        self,
        engine: ModelBackend,
        sched: SchedulerConfig,
        *,
        chunk_tokens: int,
        batch_limit: int,
        max_deadline_s: float,
        max_tokens_limit: int | None,
        batch_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        before_request: Callable[[], Awaitable[None]] = _nothing,
        stall_point: Callable[[], Awaitable[None]] = _nothing,
        on_chunk: Callable[[int, int], None] = _ignore,
        compute: Executor | None = None,
    ) -> None:
        self._engine = engine
        self._compute = compute  # where chunks run (None: asyncio's default thread pool)
        self._sched = sched
        self._chunk_tokens = chunk_tokens
        self._batch_limit = batch_limit
        self._max_deadline_s = max_deadline_s
        self._max_tokens_limit = max_tokens_limit
        self._batch_wait_s = batch_wait_s
        self._clock, self._wall_clock = clock, wall_clock
        self._before_request, self._stall_point, self._on_chunk = before_request, stall_point, on_chunk
        self._batch: Batch = engine.open_batch()
        # The line, in arrival order, by key: bounded by the deployment's max_ongoing_requests.
        self._waiting: dict[int, ReplicaRow] = {}
        self._active: dict[int, ReplicaRow] = {}  # rows in the live batch, by key
        self._evict: list[int] = []  # rows gone from the bookkeeping, still in the batch until its next chunk
        self._next_key = 0
        self._kv_reserved = 0  # tokens the rows in the batch may reach (each row's prompt + max_tokens)
        self._batches = 0
        self._batch_sizes: CountWindow[int] = CountWindow(WINDOW)
        self._waits_ms: CountWindow[float] = CountWindow(WINDOW)  # stamped with the loop's clock
        self.progress_at_s = clock()  # when the engine last moved (a chunk brought tokens)
        # Spans the engine made no progress in while rows ran, judged against the p90 of the
        # time between its progress (ballast/policies/gate.py's rule): a stall of the host or
        # the engine, taken out of the queue waits the level reads.
        self._stalls = StallSpans()
        self._progress_gaps = ServiceTime()
        self._busy_since_s = self.progress_at_s  # when work last arrived at an idle loop
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # -- what the replica reads and sets ---------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests waiting in the line: the rows of one call (its choices, an embeddings
        call's inputs) count once, as the level's queue is requests, not rows (one request
        of 2,048 inputs is not a backlog of 2,048)."""
        return len({row.group or row.key for row in self._waiting.values()})

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._active)

    @property
    def batches(self) -> int:
        return self._batches

    @property
    def batch_limit(self) -> int:
        return self._batch_limit

    @property
    def kv_reserved_tokens(self) -> int:
        return self._kv_reserved

    @property
    def kv_budget_tokens(self) -> int | None:
        return self._sched.kv_budget_tokens

    def limit_rows(self, batch_limit: int) -> None:
        """The batch's row limit from now on (rows already running finish)."""
        self._batch_limit = batch_limit

    def batch_size_avg(self) -> float | None:
        sizes = list(self._batch_sizes)
        return sum(sizes) / len(sizes) if sizes else None

    def recent_batch_sizes(self) -> list[int]:
        return list(self._batch_sizes)

    def queue_wait_p95_ms(self) -> float | None:
        """The 95th percentile of the queue waits of the last ``WAIT_WINDOW_S``."""
        return recent_percentile(self._waits_ms, self._clock(), WAIT_WINDOW_S, 0.95)

    def stalled_s(self) -> float:
        """How long the engine has not moved with work in flight, on the loop's clock (the
        watchdog judges a hang from it; a late heartbeat does not add to it)."""
        if self.in_flight == 0:
            return 0.0
        return max(0.0, self._clock() - max(self.progress_at_s, self._busy_since_s))

    def start(self) -> None:
        """The engine task, started on the running event loop if it is not running (an
        engine task that ended by an error is logged and started again)."""
        if self._task is None or self._task.done():
            if self._task is not None and not self._task.cancelled():
                log.error("engine loop ended: %r; restarting it", self._task.exception())
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- one call ---------------------------------------------------------------------------
    async def stream(
        self, call: ModelCall, group: int = 0, counts_wait: bool = True
    ) -> AsyncGenerator[ModelChunk, None]:
        """The call's chunks: checked and prepared (``prepare``), in the line, then each
        chunk as the engine brings it; the first chunk of a new request carries its queue
        wait and max_tokens. A resumed call with no token left answers at once. ``group``:
        the call this row is one of (``_choices``), 0 for a call of its own; ``counts_wait``:
        its wait is a sample of the queue waits the replica reports."""
        self.start()
        if call.n > 1 or call.inputs:
            async for chunk in self._choices(call):
                yield chunk
            return
        await self._before_request()
        row = await self.prepare(call)
        row.group, row.counts_wait = group, counts_wait
        if row.resumed and row.max_tokens <= 0:  # the lost replica had delivered every token
            yield ModelChunk(row.pending, (), finish_reason="length")
            return
        self.enqueue(row)
        async for chunk in self.chunks(row):
            yield chunk

    async def _choices(self, call: ModelCall) -> AsyncGenerator[ModelChunk, None]:
        """A call of ``n`` choices: n rows, each a call of one choice (``choice_call``: its
        own seed, as vLLM's parallel sampling), their chunks interleaved as they come, each
        stamped with its index; an embeddings call likewise, a row per input
        (``input_call``). One row's error ends them all (the others are cancelled); so does
        the caller leaving."""
        out: asyncio.Queue[tuple[int, ModelChunk | BaseException | None]] = asyncio.Queue()

        self._next_key += 1
        group = -self._next_key  # apart from every row's own key

        async def run(i: int) -> None:
            try:
                row_call = rows[i] if rows is not None else choice_call(call, i)
                async for chunk in self.stream(row_call, group, counts_wait=i == 0):
                    out.put_nowait((i, replace(chunk, index=i)))
                out.put_nowait((i, None))
            except Exception as exc:  # the whole call fails with it
                out.put_nowait((i, exc))

        rows = [input_call(call, i) for i in range(len(call.inputs))] if call.inputs else None
        count = len(rows) if rows is not None else call.n
        tasks = [asyncio.ensure_future(run(i)) for i in range(count)]
        try:
            left = count
            while left:
                _, got = await out.get()
                if got is None:
                    left -= 1
                elif isinstance(got, BaseException):
                    raise got
                else:
                    yield got
        finally:
            for task in tasks:
                task.cancel()

    async def prepare(self, call: ModelCall) -> ReplicaRow:
        """The row for ``call``, not yet in the line: its max_tokens checked, its prompt ids
        (the router's, or tokenized here) fitted to the context, its sampling checked by the
        engine within the call's deadline, and a resume applied. EngineRefused (a 400) or
        the engine's own refusal for a call refused as sent."""
        prompt_only = call.prompt_logprobs is not None or call.pool is not None
        max_tokens = self._checked_max_tokens(call.max_tokens, prompt_only=prompt_only)
        if call.pool is not None and max_tokens:
            raise EngineRefused("max_tokens: an embeddings row generates no token", field="max_tokens")
        self._check_adapter(call.adapter)
        now = self._clock()
        timeout_s = call.deadline.left_s(self._wall_clock()) if call.deadline is not None else self._max_deadline_s
        ids, max_tokens = self._engine.text.fit(self._prompt_ids(call), max_tokens)
        deadline_s = replica_deadline_s(now, timeout_s)
        sampling = await self._checked_sampling(call.sampling, call.tenant, deadline_s - now, timeout_s)
        self._next_key += 1
        row = ReplicaRow(
            ids,
            max_tokens,
            enqueued_at_s=now,
            deadline_s=deadline_s,
            decoder=self._engine.text.stream_decoder(
                keep_special_tokens=bool(sampling and sampling.keep_special_tokens)
            ),
            timeout_s=timeout_s,
            sampling=sampling,
            adapter=call.adapter,
            cache_salt=call.cache_salt,
            priority=call.priority,
            logprobs=call.logprobs,
            prompt_logprobs=call.prompt_logprobs,
            pool=call.pool,
            stops=StopScanner(call.stops) if call.stops else None,
            key=self._next_key,
        )
        if call.resume is not None and call.resume.ids:
            resume(row, token_ids(call.resume.ids, self._engine.vocab_size, "resume.ids"), call.resume.text_chars)
            row.prompt_logprobs = None  # its caller had them with its first chunk
        return row

    def _checked_max_tokens(self, max_tokens: int, prompt_only: bool = False) -> int:
        """The call's max_tokens, which the router admitted: within [1, max_tokens_limit]
        (0 too for a call of the prompt's log-probabilities, ``prompt_only``)."""
        limit = self._max_tokens_limit
        least = 0 if prompt_only else 1
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < least:
            raise EngineRefused(f"max_tokens must be an int >= {least}, got {max_tokens!r}", field="max_tokens")
        if limit is not None and max_tokens > limit:
            raise EngineRefused(
                f"max_tokens must be at most {limit} for this model, got {max_tokens}", field="max_tokens"
            )
        return max_tokens

    def _check_adapter(self, adapter: str | None) -> None:
        """A call's adapter, which this engine must serve now; else EngineRefused naming ``model``."""
        if adapter is None:
            return
        lora = serving_lora(self._engine)  # None: its row in the engine table serves no LoRA
        if lora is None or not lora.serves_adapter(adapter):
            raise EngineRefused(
                f"model: adapter {adapter!r} is not served by model {self._engine.name!r}", field="model"
            )

    def _prompt_ids(self, call: ModelCall) -> list[int]:
        """The router's ids when they are this engine's tokenizer's, checked against the
        vocabulary; else the prompt tokenized by the engine."""
        if call.prompt_ids and call.tokenizer == self._engine.tokenizer_id:
            return token_ids(call.prompt_ids, self._engine.vocab_size, "prompt")
        return self._engine.text.tokenize(call.prompt, call.add_special_tokens)

    async def _checked_sampling(
        self, sampling: RowSampling | None, tenant: str, left_s: float, timeout_s: float
    ) -> RowSampling | None:
        """The call's sampling as the engine checked and normalised it (a grammar compile
        counted to the call's ``tenant``). EngineRefused / SchemaTooComplex: this request
        alone, before any work; a grammar compile waits for its thread no longer than the
        request's own deadline (``left_s``)."""
        try:
            return await asyncio.wait_for(self._engine.check(sampling, tenant), max(0.0, left_s))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"deadline of {timeout_s:.3f}s passed before its schema compiled") from None

    def enqueue(self, row: ReplicaRow) -> None:
        """``row`` joins the line and the engine task is woken."""
        if self.in_flight == 0:
            self._busy_since_s = row.enqueued_at_s
            self._stalls.busy(row.enqueued_at_s)
        self._waiting[row.key] = row
        if self._wake is not None:
            self._wake.set()

    async def chunks(self, row: ReplicaRow) -> AsyncGenerator[ModelChunk, None]:
        """``row``'s chunks as its queue brings them, until None; an exception in the queue,
        or the row's deadline passing first, is raised. However the caller leaves, the row
        is cancelled: out of the line at once, out of the batch at the next chunk."""
        first = not row.resumed
        try:
            while True:
                try:
                    got = await asyncio.wait_for(row.out.get(), max(0.0, row.deadline_s - self._clock()))
                except asyncio.TimeoutError:
                    raise self.timed_out(row) from None
                if got is None:
                    return
                if isinstance(got, BaseException):
                    raise got
                if first:
                    got = replace(
                        got,
                        queue_wait_ms=round(row.queue_wait_ms, 3),
                        max_tokens=row.max_tokens,
                        cached_tokens=row.cached_tokens,
                    )
                    first = False
                yield got
        finally:
            row.cancelled = True  # a caller that left: the engine drops the row at the next chunk
            if not row.started:
                self._waiting.pop(row.key, None)
            elif row.key in self._active and self._wake is not None:
                self._wake.set()

    def timed_out(self, row: ReplicaRow) -> Exception:
        """The error for a request whose deadline passed before its last chunk: the
        scheduler tells a stalled engine (ModelStalled) from time that ran out."""
        reason, idle_s = timeout_reason(self._sched, self._clock(), row.enqueued_at_s, self.progress_at_s)
        if reason == STALLED:
            return ModelStalled(f"no decode step for {idle_s:.1f}s while this request waited")
        return _past_deadline(row)

    # -- the engine task: iteration-level batching -------------------------------------------
    async def _run(self) -> None:
        """Run the live batch chunk by chunk while anything is waiting or decoding; at each
        chunk boundary the scheduler's decision is carried out first (``step``)."""
        assert self._wake is not None
        while True:
            if not self._waiting and not self._active:
                self._wake.clear()
                await self._wake.wait()
                if self._batch_wait_s > 0:  # an idle loop gathers its first rows
                    await asyncio.sleep(self._batch_wait_s)
            await self._stall_point()
            leaving, joins = self.step()
            if not joins and not self._active:
                self._evict = leaving  # no chunk runs now: the batch drops these rows before the next
                continue
            try:
                # Torch runs in a worker thread: the event loop stays free for new
                # requests, health checks and the report loop.
                out = await asyncio.get_running_loop().run_in_executor(
                    self._compute, self._run_chunk, leaving, joins, self._chunk_tokens
                )
            except Exception as exc:  # the step itself (e.g. CUDA OOM): every row in the batch fails with it
                log.exception("a chunk failed; failing the %d rows in the batch", len(self._active))
                for row in list(self._active.values()):
                    self._finish(row, exc)
                self._batch = self._engine.open_batch()
                continue
            self._after_chunk(out)

    def _run_chunk(self, leaving: list[int], joins: list[Join], steps: int) -> dict[int, list[int]]:
        import torch

        with torch.inference_mode():  # the worker thread's own mode, entered per chunk
            self._batch.remove(leaving)
            return self._batch.run_chunk(joins, steps)

    def _after_chunk(self, out: dict[int, list[int]]) -> None:
        """A chunk's outcome carried out: the rows it failed alone, the progress time, the
        batch-size window and hook, and each row's ids delivered."""
        self._fail_rows(self._batch.take_failed())
        logprobs = self._batch.take_logprobs()
        vectors = self._batch.take_embeddings()
        if any(out.values()) or vectors:  # tokens came: the engine made progress (vLLM may return none within its wait)
            self.progress_at_s = self._clock()
            gaps = self._progress_gaps
            known = gaps.served >= SERVICE_SAMPLES // 4  # a p90 worth judging by
            gap = self._stalls.answered(self.progress_at_s, len(self._active), gaps.p90_s if known else 0.0)
            if gap is not None:
                gaps.add(gap)
        self._batches += 1
        rows = len(self._active)
        self._batch_sizes.add(rows)
        tokens = 0
        in_batch = set(self._batch.keys())
        for key, ids in out.items():
            row = self._active.get(key)
            if row is None:
                continue
            if row.cached_tokens is None and ids:
                row.cached_tokens = self._batch.cached_tokens(key)
            row.emitted += len(ids)
            tokens += len(ids)
            if row.pool is not None:
                self._pooled(row, vectors.get(key))
                continue
            self._deliver(row, ids, done=key not in in_batch, logprobs=logprobs.get(key))
        self._on_chunk(rows, tokens)

    def _fail_rows(self, failed: dict[int, BaseException]) -> None:
        """Rows the batch failed alone (its per-row checks, a row's own step): each request
        gets its own error (``EngineRefused``: a 400, no model failure; any other: a model
        failure of that request); the other rows go on."""
        for key, exc in failed.items():
            row = self._active.get(key)
            if row is not None:
                log.warning("row %s failed alone: %s: %s", key, type(exc).__name__, exc)
                self._finish(row, exc)

    def _deliver(self, row: ReplicaRow, ids: list[int], done: bool, logprobs: RowLogprobs | None = None) -> None:
        """A row's ids of this chunk as text to its caller; the last chunk says why it ended.

        ``done``: the row left the batch (its max_tokens, or an end-of-sequence token).
        A stop string ends it here, and the batch drops it at the next chunk. The ids go
        with the text: the router carries the stream on elsewhere from them if this
        replica goes away."""
        text, stopped = row_text(row, ids, done)
        named = self._named(row, logprobs)
        if not (stopped or done):
            row.out.put_nowait(
                replace(ModelChunk(text, tuple(ids)), **named) if named else ModelChunk(text, tuple(ids))
            )
            return
        ignore_eos = row.sampling is not None and row.sampling.ignore_eos
        eos = bool(ids) and ids[-1] in self._engine.eos_ids and not ignore_eos
        if not done:
            self._evict.append(row.key)
        last = ModelChunk(text, tuple(ids), finish_reason="stop" if stopped or eos else "length")
        self._finish(row, replace(last, **named) if named else last)

    def _pooled(self, row: ReplicaRow, vector: bytes | None) -> None:
        """An embeddings row's one chunk: its vector; an engine that gave none pools no rows
        (EngineRefused: the request is refused, the model not counted at fault)."""
        if vector is None:
            self._finish(row, EngineRefused(f"model: {self._engine.name!r} does not pool rows", field="model"))
            return
        self._finish(row, ModelChunk("", (), finish_reason="stop", embedding=vector))

    def _named(self, row: ReplicaRow, logprobs: RowLogprobs | None) -> dict[str, Any]:
        """A chunk's log-probabilities for ``row`` with their tokens named by the engine's
        text side: ``logprobs`` when the row asked (one per id), ``prompt_logprobs`` on the
        chunk that brought them (the prompt's first token first, with no logprob)."""
        if logprobs is None or (row.logprobs is None and row.prompt_logprobs is None):
            return {}
        named: dict[str, Any] = {}
        if row.logprobs is not None:
            named["logprobs"] = named_logprobs(self._engine.text, logprobs.tokens)
        if row.prompt_logprobs is not None and logprobs.prompt is not None:
            first = TokenLogprob(self._engine.text.token_texts(row.ids[:1])[0], None)
            named["prompt_logprobs"] = (first, *named_logprobs(self._engine.text, logprobs.prompt))
        return named

    def step(self) -> tuple[list[int], list[Join]]:
        """Carry out the scheduler's decision at a chunk boundary (``ballast.policies.scheduler``).

        Running rows it takes out are answered as past their deadline (nothing is sent
        to a caller that left) and free their KV; waiting rows it drops leave the line,
        answered the same way; the rows it admits join. Returns the keys the batch
        drops before the chunk (those rows and the ones a stop string ended) and the
        joins to prefill, as ``Batch.run_chunk`` takes them."""
        now = self._clock()
        decision = schedule(self._sched, now, self._waiting.values(), self._active.values(), self._batch_limit)
        for gone in decision.finished:
            self._finish(gone.row, _past_deadline(gone.row))
        for gone in decision.dropped:
            self._waiting.pop(gone.row.key, None)
            if gone.reason == DEADLINE:  # no prefill spent on it
                gone.row.out.put_nowait(_past_deadline(gone.row))
        leaving = [gone.row.key for gone in decision.finished] + self._evict
        self._evict = []
        return leaving, [self._join(row, now) for row in decision.admitted]

    def _join(self, row: ReplicaRow, now: float) -> Join:
        """``row`` leaves the line for the batch: its queue wait is counted, its KV reserved."""
        self._waiting.pop(row.key, None)
        row.started = True
        row.queue_wait_ms = (now - row.enqueued_at_s) * 1000.0
        if row.counts_wait:  # the level's sample: a stall in the wait is not load
            self._waits_ms.add(1000.0 * self._stalls.not_stalled_s(row.enqueued_at_s, now), now)
        self._kv_reserved += row.reserved_tokens
        self._active[row.key] = row
        return Join(
            row.key,
            row.ids,
            row.max_tokens,
            row.sampling,
            row.adapter,
            row.cache_salt,
            row.priority,
            logprobs=row.logprobs,
            prompt_logprobs=row.prompt_logprobs,
            pool=row.pool,
        )

    def _finish(self, row: ReplicaRow, last: ModelChunk | BaseException) -> None:
        """The row leaves the batch's bookkeeping (its tensors leave at the next chunk) and,
        unless its caller left, gets its ending: its last chunk then None, or the error."""
        if self._active.pop(row.key, None) is not None:
            self._kv_reserved -= row.reserved_tokens
        if not row.cancelled:
            row.out.put_nowait(last)
            if isinstance(last, ModelChunk):
                row.out.put_nowait(None)


def choice_call(call: ModelCall, i: int) -> ModelCall:
    """Choice ``i`` of a call of several as a call of one: its own seed (the call's + i,
    wrapped within int64, as vLLM's parallel sampling seeds its children); each choice's
    first chunk carries the prompt's log-probabilities when asked (an echoed stream's
    choices each start with the prompt)."""
    sampling = call.sampling
    if sampling is not None and sampling.seed is not None and i:
        seed = (sampling.seed + i - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED
        sampling = replace(sampling, seed=seed)
    return replace(call, n=1, sampling=sampling)


def input_call(call: ModelCall, i: int) -> ModelCall:
    """Input ``i`` of an embeddings call as a row of its own: its ids as the prompt."""
    return replace(call, prompt_ids=call.inputs[i], inputs=(), n=1)


def named_logprobs(text: TextSide, positions: Sequence[IdLogprobs]) -> tuple[TokenLogprob, ...]:
    """``positions`` with their tokens (and their likeliest tokens) named by ``text``, in
    one call of its ``token_texts``."""
    ids = [i for p in positions for i in (p.id, *(t for t, _ in p.top))]
    names = iter(text.token_texts(ids))
    out = []
    for p in positions:
        token = next(names)
        out.append(TokenLogprob(token, p.logprob, tuple((next(names), lp) for _, lp in p.top)))
    return tuple(out)


def _past_deadline(row: ReplicaRow) -> DeadlineExceeded:
    return DeadlineExceeded(f"deadline of {row.timeout_s:.3f}s passed while generating")


def recent_percentile(samples: CountWindow[float], now_s: float, window_s: float, q: float) -> float | None:
    """The q-quantile of the samples stamped no longer than ``window_s`` ago; older ones are dropped."""
    samples.expire(now_s - window_s)
    return nearest_rank(samples, q)


def row_text(row: ReplicaRow, ids: list[int], done: bool) -> tuple[str, bool]:
    """The text of a row's next ``ids`` that its caller does not have yet, and whether a
    stop string ended the row there (``done``: the row left the batch after these ids)."""
    text = row.decoder.feed(ids, final=done and bool(ids))
    stopped = False
    if row.stops is not None:
        text = row.stops.feed(text)
        stopped = row.stops.stopped
        if done and not stopped:
            text += row.stops.finish()
    return _unsent(row, text), stopped


def resume(row: ReplicaRow, delivered: list[int], delivered_chars: int) -> None:
    """Make ``row`` the continuation of a stream whose replica went away after it had
    delivered the token ids ``delivered`` (``delivered_chars`` characters of text).

    The row prefills its prompt and those ids and generates what is left of its
    max_tokens. Its decoder and stop scanner are fed the delivered ids first, so that
    they stand where the lost replica's stood; the text that gives which the caller
    does not have yet (held back for a partial character or a possible stop string)
    goes out first, and the first ``delivered_chars`` characters are not sent again
    (the lost replica may have sent more or less of that text than the new one's
    decoder would give for the same ids: the characters, not the ids, decide).
    """
    row.resumed = True
    row.ids = [*row.ids, *delivered]
    row.max_tokens -= len(delivered)
    text = row.decoder.feed(delivered)
    if row.stops is not None:
        text = row.stops.feed(text)
    row.skip_chars = delivered_chars
    row.pending = _unsent(row, text)


def _unsent(row: ReplicaRow, text: str) -> str:
    """The part of a row's next ``text`` that its caller does not have: any continuation
    text still pending first, less the characters the caller already has."""
    text, row.pending = row.pending + text, ""
    if row.skip_chars:
        cut = min(row.skip_chars, len(text))
        row.skip_chars -= cut
        text = text[cut:]
    return text


def token_ids(ids: Sequence[Any], vocab_size: int, field: str) -> list[int]:
    """``ids`` (a call's ``field``) as a list, each an int in the vocabulary; else EngineRefused."""
    if not isinstance(ids, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in ids
    ):
        raise EngineRefused(f"{field}: must be token ids in [0, {vocab_size})", field=field)
    return list(ids)
