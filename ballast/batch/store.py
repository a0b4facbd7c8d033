"""``BatchStore``: the Batch API's durable state on one Redis or Valkey server (redis-py's asyncio
client): files, batches, a queue stream per model and tenant, each batch's answers, and a
dead-letter stream per model.

It is composed of four parts, each with its own module, Lua scripts and constructor:
``FileStore`` (``store_files``: files and their bytes), ``LineQueue`` (``store_queue``: the
queues, one per model and tenant, shared fairly among tenants by weight, and the per-model
dead-letter queues), ``Batches`` (``store_batches``: batch records,
line order, answers, the finalizer's lock) and ``StoredResponses`` (``store_responses``: the
Responses API's stored responses, per tenant, bounded and expiring). The key layout and the reply helpers they share
are in ``store_layout``. ``BatchStore`` is their one public face: every public method maps
Redis' errors in one place (below), and the steps that span parts are here (a dead letter
deleted into its batch's error file; a batch finalized into its output and error files).

Every change that must hold together is one Lua script or one MULTI (atomic on the server),
so a router killed between two calls leaves nothing half done that the next call cannot
finish. Scripts build some keys from the prefix and the tenant or model they read: the store is
one server (or a primary with replicas), not a Redis Cluster.

Exactly once in the files, at least once on the wire: a line's answer is ``record``-ed, keyed
by (batch, custom_id), before its queue entry is ``ack``-ed. ``record`` writes the output or
the error hash only when the line is in neither (one script, so a line lands in exactly one
file) and only while its batch takes answers (``in_progress`` or ``cancelling``, its finalizer's
lock not held): a False answer means the line needs nothing more (answered already, or its
batch finished or is finishing and decides the line itself), and the caller acks it. A line
redelivered after its router died is run again, and its second answer is refused. The write
that wins adds the answer's token usage to its batch's counters in the same script, so a
batch's ``usage`` is the sum over its output file's lines, each counted once.

Bounds, per tenant: files held (``max_files``; a batch in flight holds room for its output
and error files, which ``finalize`` writes even past the limits, so a finished batch never
loses its lines), bytes held (``max_stored_bytes``), batches not finished
(``max_batches_in_flight``), lines queued or dead-lettered (``max_batches_in_flight`` x
``max_file_lines``; a cancelled batch's lines count until a dispatcher drops them), batch
records kept (``max_batches_kept``, the oldest finished ones deleted first), stored responses
(``responses.max_stored`` and ``responses.max_stored_bytes``, the oldest deleted first); every list is
paged, at most 100 a page; a claim takes at most 100 lines; finalization reads the lines
1,000 at a time. The per-model keys are bounded by the models served, since only lines the
router validated against its catalog are queued, and the per-(model, tenant) streams by those
models and the configured tenants. Consumers (routers) that left the group with nothing
pending are removed, at most once per ``claim_idle_s`` per model, in one script that removes
only those with nothing pending (removing a consumer drops its pending entries).

Choices where OpenAI or the design left room:

- Batches and files are listed newest first, as OpenAI does; dead letters oldest first, by
  model. An ``after`` cursor that is not in the list is a 422 naming ``after``.
- Every file expires: a file put without ``expires_at`` gets ``file_expiry_s`` from its
  creation, as a batch's output and error files do; ``expire_files`` deletes them.
- Lines refused when the batch is created (``FailedLine``) go to its error hash at once;
  one without a usable custom_id is keyed by its line number.
- A retry's backoff (``not_before``) travels in its fresh queue entry; a dispatcher that
  claims a line before its time holds it until then. A consumer that still owns an entry is
  the only one that may requeue or dead-letter it (another router may have claimed it).
- ``finalize`` runs once per batch at a time under a lock with a TTL: a completed batch goes
  ``in_progress -> finalizing -> completed``; a cancelling one ``cancelled``, with what was
  answered (OpenAI: lines not run are in neither file); one past ``expires_at`` ``expired``,
  every line not answered written to the error file by the caller's ``expired_line``
  (OpenAI's ``batch_expired``). Output and error files get ids derived from the batch, so a
  finalization run again after its router died rewrites the same files. A finished batch's
  answers and line order are deleted with the status change; its counts stay in its record.
- A claim hands out a dead router's lines first, then new ones one at a time to the tenant
  with the fewest lines in flight per unit of its ``weight``, ties to the tenant whose next
  line has waited longest (``store_queue``); a lone tenant gets every line.
- The age of a model's queue is that of the oldest first entry of its tenants' streams (the
  oldest to join a stream; a retried line rejoins at the end, keeping its ``queued_at``).
- Redis' own errors and timeouts surface as ``StoreUnavailable`` (503), in one place.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ballast.batch.records import (
    TERMINAL,
    BatchRecord,
    BatchStatus,
    DeadLetter,
    Delivery,
    FailedLine,
    FileRecord,
    LineKind,
    Page,
    QueuedLine,
    RequestCounts,
    result_file_id,
)
from ballast.batch.store_batches import Batches
from ballast.batch.store_files import FileStore
from ballast.batch.store_layout import MAX_PAGE, Keys, line_field
from ballast.batch.store_queue import LineQueue
from ballast.batch.store_responses import StoredResponse, StoredResponses
from ballast.config.batch import BatchConfig
from ballast.config.responses import ResponsesConfig
from ballast.errors import StoreUnavailable

MAX_CONNECTIONS = 32  # per store (per router): a call waits for a free one up to store_timeout_s

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Redis' errors and timeouts, raised by ``fn``, as ``StoreUnavailable``."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except RedisError as e:
            raise StoreUnavailable(f"the batch store did not answer: {type(e).__name__}: {e}", 1.0) from e

    return call


def read_password(cfg: BatchConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The store's password: ``$store_password_env``, else ``store_password_file``, else none."""
    from ballast.config.loading import read_text

    given = environ.get(cfg.store_password_env)
    if given:
        return given
    if cfg.store_password_file is not None:
        return read_text(cfg.store_password_file).strip() or None
    return None


def connect(
    cfg: BatchConfig,
    app_name: str,
    environ: Mapping[str, str] = os.environ,
    weights: Mapping[str, float] | None = None,
    responses: ResponsesConfig | None = None,
) -> BatchStore:
    """A store on ``cfg.store_url`` (StoreUnavailable when none is set): a bounded connection
    pool, every connect and command within ``store_timeout_s``, tried at most twice (so a call
    gives up within about 2 x ``store_timeout_s`` when the server is gone). Connects on first use.
    ``weights``: each tenant's share of a model's batch lines; ``responses``: the stored
    responses' bounds (``BatchStore``)."""
    if cfg.store_url is None:
        raise StoreUnavailable("batch.store_url is not set: no batch store to use")
    pool = BlockingConnectionPool.from_url(
        cfg.store_url,
        password=read_password(cfg, environ),
        max_connections=MAX_CONNECTIONS,
        timeout=cfg.store_timeout_s,
        socket_timeout=cfg.store_timeout_s,
        socket_connect_timeout=cfg.store_timeout_s,
        retry=Retry(NoBackoff(), 1),  # once, on a new connection: a pooled one the server closed
    )
    return BatchStore(Redis(connection_pool=pool), cfg, app_name, weights=weights, responses=responses)


class BatchStore:
    """Files, batches, queues, answers and dead letters of one app (module docstring).

    ``client`` is a redis.asyncio client that does not decode responses (file data is
    bytes); ``clock`` (monotonic seconds) paces only the removal of departed consumers;
    ``weights`` are the tenants' ``tenants.<name>.weight`` (a tenant not named weighs as the
    lightest named; none named: all alike); ``responses`` bounds the stored responses (None:
    the section's defaults). Times the records carry (``now``) are the caller's Unix seconds;
    a stored response expires on the server's clock."""

    def __init__(
        self,
        client: Redis,
        cfg: BatchConfig,
        app_name: str,
        clock: Callable[[], float] = time.monotonic,
        weights: Mapping[str, float] | None = None,
        responses: ResponsesConfig | None = None,
    ) -> None:
        self._r = client
        self._cfg = cfg
        self.keys = Keys(f"{cfg.key_prefix}:{app_name}")
        self._files = FileStore(client, cfg, self.keys)
        self._queue = LineQueue(client, cfg, self.keys, clock, weights)
        self._batches = Batches(client, cfg, self.keys, self._queue)
        self._responses = StoredResponses(client, responses or ResponsesConfig(), self.keys)

    async def close(self) -> None:
        await self._r.aclose()

    @_guarded
    async def ping(self) -> bool:
        return bool(await self._r.ping())

    # -- files ---------------------------------------------------------------------------
    @_guarded
    async def put_file(
        self, tenant: str, filename: str, purpose: str, data: bytes, expires_at: float | None, now: float
    ) -> FileRecord:
        """A new file of ``tenant``'s, expiring at ``expires_at`` (None: ``file_expiry_s`` from
        ``now``; every file expires); FileLimitExceeded (429) past the tenant's ``max_files``
        or ``max_stored_bytes``, nothing stored."""
        return await self._files.put_file(tenant, filename, purpose, data, expires_at, now)

    @_guarded
    async def file(self, file_id: str) -> FileRecord | None:
        return await self._files.file(file_id)

    @_guarded
    async def file_data(self, file_id: str) -> bytes | None:
        return await self._files.file_data(file_id)

    @_guarded
    async def list_files(
        self, tenant: str | None, purpose: str | None = None, limit: int = 20, after: str | None = None
    ) -> Page[FileRecord]:
        """``tenant``'s files (None: every tenant's), newest first, of ``purpose`` if given."""
        return await self._files.list_files(tenant, purpose, limit, after)

    @_guarded
    async def delete_file(self, file_id: str) -> bool:
        """The file and its data gone (False: there was none)."""
        return await self._files.delete_file(file_id)

    @_guarded
    async def expire_files(self, now: float, limit: int = MAX_PAGE) -> int:
        """Deletes up to ``limit`` files whose ``expires_at`` has passed; how many it deleted."""
        return await self._files.expire_files(now, limit)

    # -- batches -------------------------------------------------------------------------
    @_guarded
    async def create_batch(
        self, rec: BatchRecord, lines: Sequence[QueuedLine], failed: Sequence[FailedLine] = ()
    ) -> None:
        """Stores ``rec`` with its index entries, every line of ``lines`` on its tenant's queue of
        its model and every line of ``failed`` in its error hash, in one MULTI. Lines to run need
        the batch ``in_progress``. Refused (nothing stored) with BatchLimitExceeded past the tenant's
        batches in flight or lines queued, FileLimitExceeded when its files leave no room for
        this batch's results (module docstring)."""
        await self._batches.create_batch(rec, lines, failed)

    @_guarded
    async def batch(self, batch_id: str) -> BatchRecord | None:
        """The batch, its request counts as they stand now."""
        return await self._batches.batch(batch_id)

    @_guarded
    async def list_batches(self, tenant: str | None, limit: int = 20, after: str | None = None) -> Page[BatchRecord]:
        """``tenant``'s batches (None: every tenant's), newest first."""
        return await self._batches.list_batches(tenant, limit, after)

    @_guarded
    async def in_flight(self) -> list[str]:
        """The ids of every batch not finished (what a finalizer looks at)."""
        return await self._batches.in_flight()

    @_guarded
    async def set_status(
        self,
        batch_id: str,
        from_statuses: Sequence[BatchStatus],
        to: BatchStatus,
        now: float,
        **fields: str | int | None,
    ) -> bool:
        """Compare-and-set: ``to`` (its ``<status>_at`` stamped ``now``, ``fields`` written,
        None removing one) only if the batch is in one of ``from_statuses``; whether it was."""
        return await self._batches.cas(batch_id, from_statuses, to, now, fields, token="")

    @_guarded
    async def cancel(self, batch_id: str, now: float) -> bool:
        """``validating`` or ``in_progress`` -> ``cancelling``: dispatchers drop its lines not yet
        run, and its finalization makes it ``cancelled`` with what was answered."""
        return await self._batches.cas(batch_id, ("validating", "in_progress"), "cancelling", now, {}, token="")

    # -- answers -------------------------------------------------------------------------
    @_guarded
    async def record(self, batch_id: str, custom_id: str, kind: LineKind, line_json: str) -> bool:
        """The line's answer written to the output or error hash: True when this write was the
        first. False: the line needs nothing more (answered already, in either hash, or its
        batch finished or finishing, which decides the line itself); ack it either way.
        ``custom_id`` is one of the batch's lines, as its ``Delivery`` carries it (the counts
        that say a batch is done count the hashes). The first write of an output line adds its
        answer's ``usage`` to the batch's (``TokenUsage.of_output_line``)."""
        return await self._batches.record_line(batch_id, line_field(custom_id, 0), kind, line_json, token="")

    @_guarded
    async def answered(self, batch_id: str, custom_id: str) -> bool:
        """Whether the line has its answer (output or error)."""
        return await self._batches.answered(batch_id, custom_id)

    @_guarded
    async def progress(self, batch_id: str) -> RequestCounts | None:
        """(total, completed, failed): the answers so far (a finished batch's, as it ended)."""
        rec = await self._batches.batch(batch_id)
        return None if rec is None else rec.request_counts

    # -- the queue -----------------------------------------------------------------------
    @_guarded
    async def claim(self, model: str, consumer: str, count: int) -> list[Delivery]:
        """Up to ``count`` (at most 100) lines of ``model`` for ``consumer``: first lines another
        consumer has held unacknowledged for ``claim_idle_s`` (XAUTOCLAIM: a dead router's),
        then new ones, one at a time to the tenant with the fewest lines in flight per unit of
        its weight (ties: the tenant whose next line has waited longest)."""
        return await self._queue.claim(model, consumer, count)

    @_guarded
    async def ack(self, model: str, entry_id: str) -> bool:
        """The entry acknowledged and deleted (after its answer was recorded); False when it
        was gone already."""
        return await self._queue.ack(model, entry_id)

    @_guarded
    async def requeue(self, delivery: Delivery, attempts: int, not_before: float) -> str | None:
        """A fresh entry for the line, with ``attempts`` (the attempts made so far) and
        ``not_before`` (the dispatcher does not send it earlier), and the old one acknowledged;
        its id. None: the delivery is no longer this consumer's (another claimed it)."""
        return await self._queue.requeue(delivery, attempts, not_before)

    @_guarded
    async def queue_depth(self, model: str) -> int:
        """Lines of ``model`` queued or being run, every tenant's."""
        return await self._queue.queue_depth(model)

    @_guarded
    async def oldest_age_s(self, model: str, now: float) -> float:
        """How long the line that waits longest on ``model``'s queues has waited since it joined
        them (0: none)."""
        return await self._queue.oldest_age_s(model, now)

    # -- dead letters --------------------------------------------------------------------
    @_guarded
    async def dead_letter(self, delivery: Delivery, error: str, now: float) -> DeadLetter | None:
        """The line moved to its model's dead-letter queue with ``error`` (its attempts as
        ``delivery`` carries them) and the queue entry acknowledged; None: the delivery is no
        longer this consumer's."""
        return await self._queue.dead_letter(delivery, error, now)

    @_guarded
    async def dlq_get(self, dlq_id: str) -> DeadLetter | None:
        return await self._queue.dlq_get(dlq_id)

    @_guarded
    async def dlq_list(self, model: str | None = None, limit: int = 20, after: str | None = None) -> Page[DeadLetter]:
        """Dead letters oldest first, of ``model`` or of every model (by model name)."""
        return await self._queue.dlq_list(model, limit, after)

    @_guarded
    async def dlq_retry(self, dlq_id: str) -> str | None:
        """The dead letter back on its tenant's queue of its model with attempts 0, gone from the
        dead-letter queue; its new entry id (None: no such dead letter)."""
        return await self._queue.dlq_retry(dlq_id)

    @_guarded
    async def dlq_delete(self, dlq_id: str, line_json: str) -> bool:
        """The dead letter removed, its line recorded as ``line_json`` in its batch's error
        file (unless the line has its answer, or its batch finished); False: no such one."""
        found = await self._queue.dlq_entry(dlq_id)
        if found is None:
            return False
        where, entry_id, dead = found
        field = line_field(dead.line.custom_id, dead.line.line)
        await self._batches.record_line(dead.line.batch_id, field, "error", line_json, token="")
        return await self._queue.dlq_drop(dlq_id, where, entry_id, dead.model)

    @_guarded
    async def dlq_depth(self, model: str) -> int:
        return await self._queue.dlq_depth(model)

    # -- stored responses ----------------------------------------------------------------
    @_guarded
    async def put_response(
        self, tenant: str, response_id: str, record: bytes | str, created_at: float, depth: int
    ) -> int:
        """``record`` (the response's JSON) stored as ``tenant``'s ``response_id`` (replacing
        one of that id), expiring ``responses.ttl_s`` from now on the server's clock; ``depth``:
        the responses in its chain, itself included (1 without a previous one; InvalidRequest
        on ``previous_response_id`` past ``responses.max_chain_depth``). The tenant's others go,
        the one to expire soonest first, while it holds more than ``responses.max_stored``
        responses or ``responses.max_stored_bytes`` bytes; how many went. PayloadTooLarge (413),
        nothing changed, for a record larger than ``max_stored_bytes`` alone."""
        return await self._responses.put_response(tenant, response_id, record, created_at, depth)

    @_guarded
    async def get_response(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s stored response; None when it has none of that id (never stored,
        expired, evicted, deleted, or another tenant's)."""
        return await self._responses.get_response(tenant, response_id)

    @_guarded
    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """``tenant``'s stored response gone; False when it had none of that id."""
        return await self._responses.delete_response(tenant, response_id)

    # -- finalization --------------------------------------------------------------------
    @_guarded
    async def finalize(self, batch_id: str, now: float, expired_line: Callable[[str], str]) -> BatchRecord | None:
        """The batch ended, when it is due: every line answered (``completed``), cancelling
        (``cancelled``), or past ``expires_at`` (``expired``: each line not answered gets
        ``expired_line(custom_id)`` in the error file). Its output and error files written
        in input-line order (purpose ``batch_output``, the batch's tenant's, expiring after
        ``file_expiry_s``), their ids and the counts set, the status changed. Returns the
        ended batch; None when it is not due, ended already, or another router holds it."""
        rec = await self._batches.batch(batch_id)
        if rec is None or rec.status in TERMINAL or rec.status == "validating":
            return None
        counts = rec.request_counts
        final: BatchStatus
        if rec.status == "cancelling":
            final = "cancelled"
        elif counts.completed + counts.failed >= counts.total:
            final = "completed"
        elif now >= rec.expires_at:
            final = "expired"
        else:
            return None
        token = await self._batches.lock(batch_id)
        if token is None:
            return None
        try:
            if final == "completed" and rec.status == "in_progress":
                await self._batches.cas(batch_id, ("in_progress",), "finalizing", now, {}, token="")
            expired = expired_line if final == "expired" else None
            out, err = await self._batches.result_lines(batch_id, token, expired)
            ids: dict[str, str | int | None] = {"output_file_id": None, "error_file_id": None}
            results: tuple[tuple[LineKind, list[str]], ...] = (("output", out), ("error", err))
            for kind, lines in results:
                if lines:
                    ids[f"{kind}_file_id"] = await self._write_result(rec, kind, lines, now)
            fields = {**ids, "completed": len(out), "failed": len(err)}
            statuses: tuple[BatchStatus, ...] = ("in_progress", "finalizing", "cancelling")
            if not await self._batches.cas(batch_id, statuses, final, now, fields, token=token):
                return None  # the lock lapsed: the next finalization redoes it, over the same files
        finally:
            await self._batches.unlock(batch_id, token)
        return await self._batches.batch(batch_id)

    async def _write_result(self, rec: BatchRecord, kind: LineKind, lines: Sequence[str], now: float) -> str:
        """The batch's output or error file, past the tenant's limits (its room was held)."""
        data = ("\n".join(lines) + "\n").encode()
        file = FileRecord(
            id=result_file_id(rec.id, kind),
            tenant=rec.tenant,
            filename=f"{rec.id}_{kind}.jsonl",
            purpose="batch_output",
            size_bytes=len(data),
            created_at=int(now),
            expires_at=int(now + self._cfg.file_expiry_s),
        )
        await self._files.write_file(file, data, enforce=False)
        return file.id
