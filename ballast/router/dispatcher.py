"""A router's batch dispatch: one loop per model that runs batch lines on spare capacity,
and one finalizer loop that ends batches, both on the router's event loop.

Per model (``ModelDispatcher.step``, once per ``interval_s``, the snapshot interval: the
level can change no faster):

1. the room: ``spare.batch_rows`` from the model's level (``SnapshotCache.heading``: the
   effective level, or the controller's target where higher; 0 unless both are 0), its
   gate's limit, the interactive rows in flight (the gate's slots less the batch ones),
   the interactive arrival rate measured since the last step times the gate's expected
   service time, ``RESERVE_ROWS``, the batch rows already held, and the engine's step
   (``spare.step_cap``: the gate's rows curve, ``batch.step_slack``, and the rows this
   model's interactive traffic would hold by itself at their high over
   ``batch.reference_s``, ``spare.RowsReference``, sampled every ``REFERENCE_EVERY_S`` from
   the interactive arrival rate and answers' tokens, ``spare.rows_alone``); none while any
   interactive request waits at the gate;
2. lines held here whose ``not_before`` has passed start first, each on a gate slot taken
   with ``PriorityGate.try_batch`` in the same stretch of the event loop as the room was
   read (no await between): a batch line never waits at the gate, never joins its line,
   and is offered to no tally (``Pipeline.serve_batch``);
3. with room left, more lines are claimed (``BatchStore.claim``: a dead router's first,
   by XAUTOCLAIM after ``batch.claim_idle_s``, then new ones), at most ``MAX_HELD`` held
   here; a line this router holds or runs already (handed to it again by XAUTOCLAIM while
   it waits out a retry's backoff) is not taken twice; the room is read again after the
   claim's await before any starts.

A line's life (``_run_line``), on its slot:

- its batch gone, cancelling or ended: acknowledged, not run (a cancelled batch's lines
  not run are in neither file, as OpenAI's);
- answered already (a redelivery after its router died): acknowledged, not run;
- past its batch's ``expires_at``: ``batch_expired`` to the error file, acknowledged;
- else run (``BatchFront.run_line``: its endpoint's front, within ``resilience.deadline_s``): the answer to the
  output file; a client error (4xx) to the error file; both recorded (``BatchStore.record``)
  BEFORE the acknowledgement, so a router that dies between the two leaves a line that
  is answered and is recognised when redelivered. A quota or kill-switch refusal puts the
  line back, its attempts unchanged, until the refusal's Retry-After; a retryable failure
  (5xx, timeout, the engine lost, anything unexpected) puts it back after
  ``spare.full_jitter_s`` with one more attempt, or dead-letters it on its
  ``batch.max_attempts``-th.

The finalizer (``Finalizer.step``, every ``FINALIZE_INTERVAL_S``) asks the store to finalize
every batch in flight (``BatchStore.finalize`` is idempotent, under a lock, and does
nothing until a batch is due: every line placed, cancelling, or past its window), deletes
expired files, and reads each model's queue depth, age and dead letters for the metrics.

Store failures (``StoreUnavailable``) leave a claimed line pending: it is claimed again
after ``claim_idle_s``, by this router or another. Clocks (monotonic for the rate, Unix
for the records), the random source and the sleep are injected: tests step the loops on
a fake clock.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from ballast.batch import shapes
from ballast.batch.records import Delivery
from ballast.batch.store import BatchStore
from ballast.errors import BallastError, StoreUnavailable
from ballast.policies.deadline import Deadline
from ballast.policies.spare import RowsReference, batch_rows, full_jitter_s, rows_alone, step_cap
from ballast.router.batches import expired_line
from ballast.router.gate import BatchSlot, GateSlot, PriorityGate
from ballast.router.openai_answers import openai_error_body
from ballast.router.pipeline import Caller

log = logging.getLogger("ballast.router")

RESERVE_ROWS = 1  # gate slots kept for what the arrival forecast misses (spare.batch_rows)
MAX_HELD = 100  # claimed lines a model's dispatcher holds before they start (store.MAX_CLAIM)
FINALIZE_INTERVAL_S = 1.0
#: The reference's sample interval: arrivals counted over it (at 30 req/s, 150 of them: a
#: Poisson count within 8 % where one interval's 15 would be within 25 %).
REFERENCE_EVERY_S = 5.0
#: Refusals that say "not now" rather than "never": the line goes back, its attempts unchanged.
#: A lost replica is capacity that went away, not the line's failure (a batch line is never
#: answered by the fallback model: it waits for its own).
DEFERRED = frozenset({"QUOTA_EXCEEDED", "KILL_SWITCH", "REPLICA_LOST"})
#: What became of a line, as ``ballast_batch_lines_total{outcome}`` counts it.
OUTCOMES = ("completed", "failed", "expired", "retried", "deferred", "dead_lettered", "skipped")

#: A batch line's run: (caller, body, the batch's endpoint, slot) -> the answer's body
#: (``BatchFront.run_line``).
RunLine = Callable[[Caller, dict[str, Any], str, GateSlot | BatchSlot], Awaitable[Any]]


@dataclass(frozen=True)
class BatchHooks:
    """What the dispatch tells the metrics (each does nothing by default)."""

    on_line: Callable[[str, str], None] = lambda model, outcome: None
    on_depths: Callable[[str, int, float, int], None] = lambda model, queued, age_s, dlq: None


class ModelDispatcher:
    """One model's batch lines at one router (module docstring)."""

    def __init__(
        self,
        model: str,
        gate: PriorityGate | None,
        level: Callable[[], int],
        run: RunLine,
        store: BatchStore,
        cfg: Any,
        consumer: str,
        hooks: BatchHooks = BatchHooks(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.model = model
        self.gate = gate  # the model's gate at this router (None: the gate is off)
        self._level = level  # the model's effective level (the snapshot's)
        self._run = run
        self._store = store
        self._cfg = cfg
        self.consumer = consumer  # this router's name in the queue's consumer group
        self._hooks = hooks
        self._clock = clock
        self._wall = wall
        self._rng = rng
        # Claimed lines not started: waiting for a slot or their not_before (at most MAX_HELD).
        self.held: deque[Delivery] = deque()
        self.running: set[asyncio.Task[None]] = set()  # bounded by the gate's limit
        # The entry ids held or running here: a line held past claim_idle_s (a retry's
        # backoff) is handed to this consumer again by XAUTOCLAIM, and must not run twice here.
        self._mine: set[str] = set()
        self.outcomes: Counter[str] = Counter()
        self._arrivals = gate.arrivals if gate is not None else 0
        self._measured_at = clock()
        self.rate_per_s = 0.0  # interactive arrivals per second over the last step
        # Set when a line ends: its loop steps again at once, not at the next interval, so a
        # freed row is refilled while the room lasts (the measures still move once an interval).
        self.wake = asyncio.Event()
        self.reference = RowsReference(cfg.batch.reference_s, clock)  # interactive rows alone, at their high
        self._ref_at = clock()
        self._ref_counts = self._counts()

    # -- the decision ----------------------------------------------------------------------
    def measure(self) -> None:
        """The interactive arrival rate since the last measure (the gate's count), at most
        once per ``controller.report_interval_s`` (a step woken by a line's end measures
        nothing); every ``REFERENCE_EVERY_S`` a sample for the reference."""
        now = self._clock()
        gate = self.gate
        if gate is None or now - self._measured_at < self._cfg.controller.report_interval_s:
            return
        self.rate_per_s = (gate.arrivals - self._arrivals) / (now - self._measured_at)
        self._arrivals, self._measured_at = gate.arrivals, now
        if now - self._ref_at >= REFERENCE_EVERY_S:
            self._sample_reference(gate, now)

    def _counts(self) -> tuple[int, int, int]:
        gate = self.gate
        return (0, 0, 0) if gate is None else (gate.arrivals, gate.answered, gate.tokens_answered)

    def _sample_reference(self, gate: PriorityGate, now: float) -> None:
        """The rows the interactive traffic since the last sample would hold by itself
        (``spare.rows_alone``: its rate, its answers' mean tokens, the rows curve); before
        the curve is fitted or an answer's tokens are known, the interactive rows in flight."""
        counts = self._counts()
        arrived, answered, tokens = (c - c0 for c, c0 in zip(counts, self._ref_counts))
        fit = gate.limit.curve_fit()
        if fit is not None and answered > 0:
            rows = rows_alone(arrived / (now - self._ref_at), tokens / answered, fit, gate.limit.value)
        else:
            rows = gate.in_flight - gate.batch_in_flight
        self.reference.sample(rows)
        self._ref_at, self._ref_counts = now, counts

    def room(self) -> int:
        """How many more batch lines may start now (``spare.batch_rows``; 0 while any
        interactive request waits). Without a gate: one line at a time at level 0."""
        gate = self.gate
        if gate is None:
            return batch_rows(self._level(), 1, 0, 0.0, 0.0, 0, len(self.running))
        if gate.waiting:
            return 0
        limit, interactive = gate.limit.value, gate.in_flight - gate.batch_in_flight
        return batch_rows(
            self._level(),
            limit,
            interactive,
            self.rate_per_s,
            gate.expected_service_s,
            RESERVE_ROWS,
            gate.batch_in_flight,
            self.rows_cap(limit, interactive),
        )

    def rows_cap(self, limit: int, interactive: int) -> int:
        """The engine's step bound on interactive + batch rows (``spare.step_cap``)."""
        assert self.gate is not None
        fit = self.gate.limit.curve_fit()
        return step_cap(fit, interactive, self.reference.value(), self._cfg.batch.step_slack, limit)

    def _slot(self) -> GateSlot | BatchSlot | None:
        gate = self.gate
        return GateSlot(None) if gate is None else gate.try_batch()

    async def step(self) -> int:
        """One turn (module docstring, steps 1-3); the lines started."""
        self.measure()
        started = self._start_ready()
        room = self.room()
        if room > 0 and len(self.held) < MAX_HELD:
            got = await self._store.claim(self.model, self.consumer, min(room, MAX_HELD - len(self.held)))
            fresh = [d for d in got if d.entry_id not in self._mine]
            self._mine.update(d.entry_id for d in fresh)
            self.held.extend(fresh)
            started += self._start_ready()
        return started

    def _start_ready(self) -> int:
        """Start the held lines that may go now, as many as the room and the gate allow;
        no await between reading the room and taking each slot."""
        now = self._wall()
        room = self.room()
        started = 0
        for delivery in [d for d in self.held if d.line.not_before <= now]:
            if started >= room:
                break
            slot = self._slot()
            if slot is None:
                break
            self.held.remove(delivery)
            task = asyncio.get_running_loop().create_task(self._run_line(delivery, slot))
            self.running.add(task)
            task.add_done_callback(self.running.discard)
            task.add_done_callback(functools.partial(self._forget, delivery.entry_id))
            task.add_done_callback(lambda _task: self.wake.set())
            started += 1
        return started

    def _forget(self, entry_id: str, _task: asyncio.Task[None]) -> None:
        self._mine.discard(entry_id)

    # -- a line's life ----------------------------------------------------------------------
    async def _run_line(self, delivery: Delivery, slot: GateSlot | BatchSlot) -> None:
        """One line on its slot (module docstring); never raises (a store failure leaves the
        line pending, to be claimed again)."""
        outcome = "skipped"
        owned: GateSlot | BatchSlot | None = slot  # released here unless the run took it
        try:
            outcome, owned = await self._line(delivery, slot)
        except StoreUnavailable as e:
            log.warning("batch line %s/%s: the store failed (%s); it is claimed again later", *_where(delivery), e)
            return
        except Exception:
            log.exception("batch line %s/%s: unexpected failure", *_where(delivery))
            return
        finally:
            if owned is not None:
                owned.release()
        self.outcomes[outcome] += 1
        self._hooks.on_line(self.model, outcome)

    async def _line(self, delivery: Delivery, slot: GateSlot | BatchSlot) -> tuple[str, GateSlot | BatchSlot | None]:
        """(outcome, the slot if still this code's to release)."""
        line, store = delivery.line, self._store
        rec = await store.batch(line.batch_id)
        if rec is None or rec.status != "in_progress" or await store.answered(line.batch_id, line.custom_id):
            await store.ack(self.model, delivery.entry_id)
            return "skipped", slot
        if self._wall() >= rec.expires_at:
            await self._answer(delivery, "error", expired_line(line.custom_id))
            return "expired", slot
        caller = Caller(line.tenant, Deadline.starting(self._clock(), self._cfg.resilience.deadline_s))
        try:
            body = await self._run(caller, line.body(), rec.endpoint, slot)
        except BallastError as err:
            return await self._failed(delivery, err.code, err.status, err.message, err), None
        except Exception as e:  # not a refusal of the line: retried, then dead-lettered
            return await self._failed(delivery, "INTERNAL", 500, f"{type(e).__name__}: {e}", None), None
        answer = shapes.output_line(shapes.new_line_id(), line.custom_id, 200, _request_id(body), body)
        await self._answer(delivery, "output", _compact(answer))
        return "completed", None

    async def _answer(self, delivery: Delivery, kind: Any, line_json: str) -> None:
        """The line's answer recorded, THEN its entry acknowledged (answer before ack)."""
        await self._store.record(delivery.line.batch_id, delivery.line.custom_id, kind, line_json)
        await self._store.ack(self.model, delivery.entry_id)

    async def _failed(self, delivery: Delivery, code: str, status: int, message: str, err: BallastError | None) -> str:
        """A line its run refused or failed: back later (deferred, retried), to the dead-letter
        queue, or to the error file (a client error)."""
        line, now = delivery.line, self._wall()
        if code in DEFERRED:
            wait_s = max(1.0, err.retry_after_s or 1.0) if err is not None else 1.0
            await self._store.requeue(delivery, line.attempts, now + wait_s)
            return "deferred"
        if status >= 500:
            attempts = line.attempts + 1
            b = self._cfg.batch
            if attempts >= b.max_attempts:
                tried = replace(delivery, line=replace(line, attempts=attempts))
                await self._store.dead_letter(tried, f"{code}: {message}", now)
                return "dead_lettered"
            wait_s = full_jitter_s(attempts - 1, b.backoff_base_s, b.backoff_cap_s, self._rng)
            await self._store.requeue(delivery, attempts, now + wait_s)
            return "retried"
        assert err is not None  # a status under 500 comes from a BallastError
        refused = shapes.error_line(
            shapes.new_line_id(), line.custom_id, code, message, status, None, openai_error_body(err)
        )
        await self._answer(delivery, "error", _compact(refused))
        return "failed"

    def status(self) -> dict[str, Any]:
        """What ``/v1/status`` shows of this model's batch dispatch at this router."""
        gate = self.gate
        cap = None if gate is None else self.rows_cap(gate.limit.value, gate.in_flight - gate.batch_in_flight)
        return {
            "room": self.room(),
            # interactive rows at their high (None: none in the window), and the step's bound
            "reference_rows": self.reference.value(),
            "rows_cap": cap,
            "held": len(self.held),
            "running": len(self.running),
            "interactive_rate_per_s": round(self.rate_per_s, 3),
            "lines": dict(self.outcomes),
        }

    def close(self) -> None:
        for task in list(self.running):
            task.cancel()


class Finalizer:
    """Ends the batches that are due, deletes expired files, reads the queues' depths
    (module docstring). One per router; ``BatchStore.finalize`` is idempotent."""

    def __init__(
        self,
        store: BatchStore,
        models: list[str],
        hooks: BatchHooks = BatchHooks(),
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._models = models
        self._hooks = hooks
        self._wall = wall
        self.finalized = 0  # batches this router ended, ever
        self.in_progress: int | None = None  # batches not ended at the last pass (every tenant's); None: not read yet
        self.depths: dict[str, dict[str, float]] = {}  # per model: queued, age_s, dlq (the last read)

    async def step(self) -> int:
        """One pass; the batches it ended."""
        ended = 0
        in_flight = await self._store.in_flight()
        for batch_id in in_flight:
            if await self._store.finalize(batch_id, self._wall(), expired_line) is not None:
                ended += 1
        self.finalized += ended
        self.in_progress = len(in_flight) - ended
        await self._store.expire_files(self._wall())
        for model in self._models:
            queued = await self._store.queue_depth(model)
            age_s = await self._store.oldest_age_s(model, self._wall())
            dlq = await self._store.dlq_depth(model)
            self.depths[model] = {"queued": queued, "age_s": round(age_s, 3), "dlq": dlq}
            self._hooks.on_depths(model, queued, age_s, dlq)
        return ended


class BatchDispatch:
    """Every model's dispatcher and the finalizer of one router, and their loops."""

    def __init__(
        self,
        dispatchers: dict[str, ModelDispatcher],
        finalizer: Finalizer,
        interval_s: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.dispatchers = dispatchers
        self.finalizer = finalizer
        self._interval_s = interval_s
        self._sleep = sleep
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """The loops on the running event loop (idempotent)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._loop(d.step, self._interval_s, d.wake)) for d in self.dispatchers.values()
        ]
        self._tasks.append(loop.create_task(self._loop(self.finalizer.step, FINALIZE_INTERVAL_S)))

    async def _loop(
        self, step: Callable[[], Awaitable[int]], interval_s: float, wake: asyncio.Event | None = None
    ) -> None:
        """``step`` once per ``interval_s``, and at once whenever ``wake`` is set."""
        failing = False
        while True:
            if wake is not None:
                wake.clear()
            try:
                await step()
                failing = False
            except StoreUnavailable as e:
                if not failing:  # said once per outage, not once per step
                    log.warning("batch dispatch: %s", e)
                failing = True
            except Exception:
                log.exception("batch dispatch: a step failed")
            await self._pause(interval_s, None if failing else wake)

    async def _pause(self, interval_s: float, wake: asyncio.Event | None) -> None:
        """The interval, or less where ``wake`` is set first (a store that fails waits it out)."""
        if wake is None:
            await self._sleep(interval_s)
            return
        sleeping = asyncio.ensure_future(self._sleep(interval_s))
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({sleeping, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeping.cancel()
            woken.cancel()

    def status(self) -> dict[str, Any]:
        """Per model: the dispatcher's state and the queue's depth, age and dead letters as
        last read; the batches this router finalized, and those in progress (every tenant's, as
        last read; None before the first read)."""
        models = {name: {**d.status(), **self.finalizer.depths.get(name, {})} for name, d in self.dispatchers.items()}
        return {"models": models, "finalized": self.finalizer.finalized, "in_progress": self.finalizer.in_progress}

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for d in self.dispatchers.values():
            d.close()


def _where(delivery: Delivery) -> tuple[str, str]:
    return delivery.line.batch_id, delivery.line.custom_id


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _request_id(body: Any) -> str:
    """The answer's own id as the output line's ``request_id``."""
    return str(body.get("id", "")) if isinstance(body, dict) else ""
