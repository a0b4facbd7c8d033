"""``Batches``: the batch store's batches (``BatchStore`` holds one): each batch's record and
indexes, its line order, its answers (output and error hashes) and its finalizer's lock.

A batch is created in one MULTI, watched on its tenant's counts (batches in flight, lines
queued, files, bytes), so two creations at once cannot both pass a limit; its status changes
by compare-and-set (one Lua script), and a line's answer is written by one script that lets
the first write win in exactly one of the two hashes, and only while the batch takes answers;
the same script adds an output line's tokens to the batch's usage counters (fields of its
hash, kept when it finishes), so a line redelivered and answered again adds nothing.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence

from redis.asyncio import Redis
from redis.exceptions import WatchError
from redis.typing import EncodableT

from ballast.batch.records import (
    STATUS_TIME_FIELD,
    STATUSES,
    TERMINAL,
    BatchRecord,
    BatchStatus,
    FailedLine,
    LineKind,
    Page,
    QueuedLine,
    RequestCounts,
    TokenUsage,
)
from ballast.batch.store_layout import CHUNK, Keys, decoded, int_or_none, line_field, read_page, text, texts
from ballast.batch.store_queue import LineQueue
from ballast.config.batch import BatchConfig
from ballast.errors import BatchLimitExceeded, FileLimitExceeded

FINAL_LOCK_S = 60.0  # a finalizer that died lets go after this
WATCH_TRIES = 5  # a batch's creation, retried when a concurrent change to its tenant's counts won
TAKES_ANSWERS: tuple[BatchStatus, ...] = ("in_progress", "cancelling")

# ARGV: prefix, to, time field or '', now, terminal (1/0), lock token or '', n, from x n, then field, value pairs
# (value '': the field is removed). With a token: only while that token holds the lock, and the batch's
# answers, line order and lock are deleted with the change (the finalizer's last step).
SET_STATUS = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
if ARGV[6] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[6] then return 0 end
local n = tonumber(ARGV[7])
local ok = false
for i = 8, 7 + n do if ARGV[i] == st then ok = true end end
if not ok then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
for i = 8 + n, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
if ARGV[5] == '1' then
  local id = redis.call('HGET', KEYS[1], 'id')
  redis.call('SREM', ARGV[1] .. ':inflight:' .. redis.call('HGET', KEYS[1], 'tenant'), id)
  redis.call('SREM', ARGV[1] .. ':inflight', id)
end
if ARGV[6] ~= '' then redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[2]) end
return 1
"""

# The batch hash's token counters (OpenAI's usage), in ``TokenUsage.counts()`` order.
USAGE_FIELDS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")

# A line's answer, first write wins, in exactly one of the two hashes; the first write adds the
# line's tokens to the batch's counters (a batch stored without them is left uncounted), so a
# line's usage is counted once however often it is answered. KEYS: batch, mine, other, final lock
# ARGV: field, line JSON, lock token or '', 4 token counts (USAGE_FIELDS' order), statuses that take answers...
RECORD = """
local holder = redis.call('GET', KEYS[4])
if holder and holder ~= ARGV[3] then return 0 end
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
local ok = false
for i = 8, #ARGV do if ARGV[i] == st then ok = true end end
if not ok then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[1], 'input_tokens') == 1 then
  local fields = {'input_tokens', 'cached_tokens', 'output_tokens', 'reasoning_tokens'}
  for i = 1, 4 do
    if ARGV[3 + i] ~= '0' then redis.call('HINCRBY', KEYS[1], fields[i], ARGV[3 + i]) end
  end
end
return 1
"""

# The finalizer's lock let go, if it is still this one's. KEYS: lock; ARGV: token
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Batches:
    """Batches and their answers of one app, under ``keys``; a new batch's lines go on
    ``queue``'s streams. Redis' errors pass through (``BatchStore`` maps them)."""

    def __init__(self, client: Redis, cfg: BatchConfig, keys: Keys, queue: LineQueue) -> None:
        self._r = client
        self._cfg = cfg
        self.keys = keys
        self._queue = queue  # where a new batch's lines go: their streams' groups made first
        self._set_status = client.register_script(SET_STATUS)
        self._record = client.register_script(RECORD)
        self._release_lock = client.register_script(RELEASE)

    async def create_batch(
        self, rec: BatchRecord, lines: Sequence[QueuedLine], failed: Sequence[FailedLine] = ()
    ) -> None:
        """``rec``, its line order, ``lines`` queued and ``failed`` answered, in one MULTI
        watched on the tenant's counts, tried again (at most ``WATCH_TRIES``) when a concurrent
        change to them won (``BatchStore.create_batch``)."""
        self._check_new_batch(rec, lines, failed)
        models = sorted({line.model for line in lines})
        for model in models:
            await self._queue.ensure_group(model, rec.tenant)
        k = self.keys
        order = sorted(
            [(ln.line, line_field(ln.custom_id, ln.line)) for ln in lines]
            + [(f.line, line_field(f.custom_id, f.line)) for f in failed]
        )
        for attempt in range(WATCH_TRIES):
            async with self._r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(
                        k.inflight(rec.tenant), k.queued(rec.tenant), k.files(rec.tenant), k.stored_bytes(rec.tenant)
                    )
                    in_flight = int(await pipe.scard(k.inflight(rec.tenant)))
                    queued = int(await pipe.get(k.queued(rec.tenant)) or 0)
                    files = int(await pipe.zcard(k.files(rec.tenant)))
                    stored = int(await pipe.get(k.stored_bytes(rec.tenant)) or 0)
                    self._check_room(rec, len(lines), in_flight, queued, files, stored)
                    pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                    pipe.hset(k.batch(rec.id), mapping=batch_fields(rec, total=len(order)))
                    pipe.zadd(k.batches(rec.tenant), {rec.id: rec.created_at})
                    pipe.zadd(k.batches(None), {rec.id: rec.created_at})
                    if rec.status not in TERMINAL:
                        pipe.sadd(k.inflight(rec.tenant), rec.id)
                        pipe.sadd(k.inflight(None), rec.id)
                    for start in range(0, len(order), CHUNK):
                        pipe.rpush(k.order(rec.id), *[f for _, f in order[start : start + CHUNK]])
                    if failed:
                        errs: dict[EncodableT, EncodableT] = {
                            line_field(f.custom_id, f.line): f.line_json for f in failed
                        }
                        pipe.hset(k.answers(rec.id, "error"), mapping=errs)
                    if lines:
                        pipe.incrby(k.queued(rec.tenant), len(lines))
                    for line in lines:  # on its tenant's stream of its model, the tenant in the model's index
                        pipe.xadd(k.queue(line.model, rec.tenant), stream_fields(line))
                    for model in models:
                        pipe.sadd(k.queue_tenants(model), rec.tenant)
                    await pipe.execute()
                    break
                except WatchError:
                    if attempt == WATCH_TRIES - 1:
                        raise
        await self._trim_batches(rec.tenant)

    def _check_new_batch(self, rec: BatchRecord, lines: Sequence[QueuedLine], failed: Sequence[FailedLine]) -> None:
        """ValueError for what the caller built wrong (never a tenant's input)."""
        if lines and rec.status != "in_progress":
            raise ValueError(f"lines to run need the batch in_progress, not {rec.status}")
        if any(ln.batch_id != rec.id or ln.tenant != rec.tenant for ln in lines):
            raise ValueError("every line is of this batch and its tenant")
        fields = [line_field(ln.custom_id, ln.line) for ln in lines] + [line_field(f.custom_id, f.line) for f in failed]
        if len(set(fields)) != len(fields) or len(fields) > self._cfg.max_file_lines:
            raise ValueError(f"custom_ids are unique in a batch, and at most {self._cfg.max_file_lines} lines")

    def _check_room(self, rec: BatchRecord, lines: int, in_flight: int, queued: int, files: int, stored: int) -> None:
        cfg = self._cfg
        if rec.status in TERMINAL:
            return  # a batch that failed validation holds nothing
        if in_flight >= cfg.max_batches_in_flight:
            raise BatchLimitExceeded(
                f"tenant {rec.tenant!r} has {in_flight} batches not finished (batch.max_batches_in_flight)"
            )
        if queued + lines > cfg.max_queued_lines():
            raise BatchLimitExceeded(
                f"tenant {rec.tenant!r} has {queued} lines queued; {lines} more would pass "
                f"{cfg.max_queued_lines()} (batch.max_batches_in_flight x batch.max_file_lines)"
            )
        if files + 2 * (in_flight + 1) > cfg.max_files or stored >= cfg.max_stored_bytes:
            raise FileLimitExceeded(
                f"tenant {rec.tenant!r} holds {files} files and {stored} bytes: no room for this batch's output "
                "and error files (batch.max_files, batch.max_stored_bytes)"
            )

    async def _trim_batches(self, tenant: str) -> None:
        """The tenant's oldest finished batch records deleted past ``max_batches_kept``."""
        k = self.keys
        excess = int(await self._r.zcard(k.batches(tenant))) - self._cfg.max_batches_kept
        if excess <= 0:
            return
        oldest = await self._r.zrange(k.batches(tenant), 0, excess + self._cfg.max_batches_in_flight)
        for batch_id in texts(oldest):
            status = await self._r.hget(k.batch(batch_id), "status")
            if status is not None and text(status) not in TERMINAL:
                continue
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.delete(k.batch(batch_id), k.order(batch_id))
                pipe.delete(k.answers(batch_id, "output"), k.answers(batch_id, "error"))
                pipe.zrem(k.batches(tenant), batch_id)
                pipe.zrem(k.batches(None), batch_id)
                await pipe.execute()
            excess -= 1
            if excess == 0:
                return

    async def batch(self, batch_id: str) -> BatchRecord | None:
        """The batch, its request counts as they stand now."""
        raw = await self._r.hgetall(self.keys.batch(batch_id))
        found = await self._counted([decoded(raw)] if raw else [])
        return found[0] if found else None

    async def list_batches(self, tenant: str | None, limit: int = 20, after: str | None = None) -> Page[BatchRecord]:
        """``tenant``'s batches (None: every tenant's), newest first."""
        rows, more = await read_page(self._r, self.keys.batches(tenant), self.keys.batch, limit, after)
        return Page(tuple(await self._counted(rows)), more)

    async def _counted(self, rows: Sequence[dict[str, str]]) -> list[BatchRecord]:
        """Batch records from their hashes, with the answers counted so far."""
        k = self.keys
        async with self._r.pipeline(transaction=False) as pipe:
            for h in rows:
                pipe.hlen(k.answers(h["id"], "output"))
                pipe.hlen(k.answers(h["id"], "error"))
            lengths = [int(n) for n in await pipe.execute()] if rows else []
        return [batch_record(h, lengths[2 * i], lengths[2 * i + 1]) for i, h in enumerate(rows)]

    async def in_flight(self) -> list[str]:
        """The ids of every batch not finished (what a finalizer looks at)."""
        return sorted(texts(await self._r.smembers(self.keys.inflight(None))))

    async def cas(
        self,
        batch_id: str,
        from_statuses: Sequence[BatchStatus],
        to: BatchStatus,
        now: float,
        fields: Mapping[str, str | int | None],
        token: str,
    ) -> bool:
        """Compare-and-set (``BatchStore.set_status``); with ``token``, only while that token
        holds the finalizer's lock, and the batch's answers, line order and lock are deleted
        with the change (the finalizer's last step)."""
        k = self.keys
        keys = [
            k.batch(batch_id),
            k.final(batch_id),
            k.answers(batch_id, "output"),
            k.answers(batch_id, "error"),
            k.order(batch_id),
        ]
        args: list[str | int] = [
            k.prefix,
            to,
            STATUS_TIME_FIELD.get(to, ""),
            int(now),
            "1" if to in TERMINAL else "0",
            token,
            len(from_statuses),
            *from_statuses,
        ]
        for name, value in fields.items():
            args += [name, "" if value is None else value]
        return bool(await self._set_status(keys=keys, args=args))

    # -- answers -------------------------------------------------------------------------
    async def record_line(self, batch_id: str, field: str, kind: LineKind, line_json: str, token: str) -> bool:
        """The line's answer, first write wins, in exactly one of the two hashes, while the
        batch takes answers (``BatchStore.record``); with ``token``, also while ``finalizing``
        under that token's lock. An output line's usage (``TokenUsage.of_output_line``) is added
        to the batch's counters by the write that wins; an error line counts no tokens."""
        k = self.keys
        other: LineKind = "error" if kind == "output" else "output"
        keys = [k.batch(batch_id), k.answers(batch_id, kind), k.answers(batch_id, other), k.final(batch_id)]
        statuses: tuple[BatchStatus, ...] = TAKES_ANSWERS + (("finalizing",) if token else ())
        usage = TokenUsage.of_output_line(line_json) if kind == "output" else TokenUsage()
        return bool(await self._record(keys=keys, args=[field, line_json, token, *usage.counts(), *statuses]))

    async def answered(self, batch_id: str, custom_id: str) -> bool:
        """Whether the line has its answer (output or error)."""
        k, field = self.keys, line_field(custom_id, 0)
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.hexists(k.answers(batch_id, "output"), field)
            pipe.hexists(k.answers(batch_id, "error"), field)
            return any(await pipe.execute())

    # -- finalization --------------------------------------------------------------------
    async def lock(self, batch_id: str) -> str | None:
        """The batch's finalizer's lock taken for ``FINAL_LOCK_S``; its token (None: another
        holds it)."""
        token = secrets.token_hex(8)
        if not await self._r.set(self.keys.final(batch_id), token, nx=True, px=int(FINAL_LOCK_S * 1000)):
            return None
        return token

    async def unlock(self, batch_id: str, token: str) -> None:
        """The lock let go, if ``token`` still holds it."""
        await self._release_lock(keys=[self.keys.final(batch_id)], args=[token])

    async def result_lines(
        self, batch_id: str, token: str, expired_line: Callable[[str], str] | None
    ) -> tuple[list[str], list[str]]:
        """The output and error files' lines, in input-line order; with ``expired_line``, each
        line not answered is first recorded as expired."""
        k = self.keys
        out: list[str] = []
        err: list[str] = []
        total = int(await self._r.llen(k.order(batch_id)))
        for start in range(0, total, CHUNK):
            fields = texts(await self._r.lrange(k.order(batch_id), start, start + CHUNK - 1))
            answers = await self._r.hmget(k.answers(batch_id, "output"), fields)
            errors = await self._r.hmget(k.answers(batch_id, "error"), fields)
            for field, answer, error in zip(fields, answers, errors):
                if answer is not None:
                    out.append(text(answer))
                elif error is not None:
                    err.append(text(error))
                elif expired_line is not None:
                    line = expired_line(field[2:])
                    if await self.record_line(batch_id, field, "error", line, token=token):
                        err.append(line)
        return out, err


def stream_fields(line: QueuedLine) -> dict[EncodableT, EncodableT]:
    return dict(line.fields().items())


def batch_fields(rec: BatchRecord, total: int) -> dict[EncodableT, EncodableT]:
    """The batch's hash: its fields, None ones left out; the counts as ``total`` (lines)."""
    out: dict[EncodableT, EncodableT] = {}
    for name, value in rec.to_dict().items():
        if name in ("request_counts", "metadata", "errors", "usage") or value is None:
            continue
        out[name] = value
    out["metadata"] = json.dumps(dict(rec.metadata))
    out["errors"] = json.dumps(list(rec.errors))
    out["total"] = total
    if rec.usage is not None:
        out.update(zip(USAGE_FIELDS, rec.usage.counts()))
    return out


def batch_record(h: Mapping[str, str], answered: int, failed: int) -> BatchRecord:
    status = h["status"]
    if status not in STATUSES:
        raise ValueError(f"batch {h['id']}: status {status!r}")
    if status in TERMINAL:  # its answers were deleted: its counts as it ended
        answered, failed = int(h.get("completed", 0)), int(h.get("failed", 0))
    return BatchRecord(
        id=h["id"],
        tenant=h["tenant"],
        endpoint=h["endpoint"],
        input_file_id=h["input_file_id"],
        completion_window=h["completion_window"],
        created_at=int(h["created_at"]),
        expires_at=int(h["expires_at"]),
        status=status,
        model=h.get("model"),
        metadata=tuple(sorted(json.loads(h.get("metadata", "{}")).items())),
        errors=tuple(json.loads(h.get("errors", "[]"))),
        output_file_id=h.get("output_file_id"),
        error_file_id=h.get("error_file_id"),
        in_progress_at=int_or_none(h.get("in_progress_at")),
        finalizing_at=int_or_none(h.get("finalizing_at")),
        completed_at=int_or_none(h.get("completed_at")),
        failed_at=int_or_none(h.get("failed_at")),
        expired_at=int_or_none(h.get("expired_at")),
        cancelling_at=int_or_none(h.get("cancelling_at")),
        cancelled_at=int_or_none(h.get("cancelled_at")),
        request_counts=RequestCounts(int(h.get("total", 0)), answered, failed),
        usage=TokenUsage(*(int(h[name]) for name in USAGE_FIELDS)) if USAGE_FIELDS[0] in h else None,
    )
