"""``BatchStore``: the Batch API's durable state on one Redis or Valkey server (redis-py's asyncio
client): files, batches, a queue stream per model, each batch's answers, and a dead-letter
stream per model.

Keys (P = ``<batch.key_prefix>:<app_name>``):

- ``P:file:{id}`` hash (the file's record) and ``P:file:{id}:data`` (its bytes);
  ``P:files:{tenant}`` and ``P:files`` (every tenant's) sorted sets by ``created_at``;
  ``P:files-expiry`` sorted set by ``expires_at``; ``P:bytes:{tenant}`` the bytes held.
- ``P:batch:{id}`` hash (the batch's record); ``P:batches:{tenant}`` and ``P:batches``
  sorted sets by ``created_at``; ``P:inflight:{tenant}`` and ``P:inflight`` the batches
  not finished; ``P:order:{batch}`` list, one field name per input line in line order;
  ``P:out:{batch}`` / ``P:err:{batch}`` hashes, field -> the line of the output / error file;
  ``P:final:{batch}`` the finalizer's lock.
- ``P:q:{model}`` stream, consumer group ``dispatch``: one entry per line to run (batch,
  line, custom_id, model, tenant, body, attempts, not_before, queued_at);
  ``P:queued:{tenant}`` the tenant's lines on the queues and dead-letter queues.
- ``P:dlq:{model}`` stream (the line's fields, its ``dlq_id``, last ``error``, ``since``);
  ``P:dlq`` hash dlq id -> "<entry id> <model>"; ``P:dlq-models`` the models with one.

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
redelivered after its router died is run again, and its second answer is refused.

Bounds, per tenant: files held (``max_files``; a batch in flight holds room for its output
and error files, which ``finalize`` writes even past the limits, so a finished batch never
loses its lines), bytes held (``max_stored_bytes``), batches not finished
(``max_batches_in_flight``), lines queued or dead-lettered (``max_batches_in_flight`` x
``max_file_lines``; a cancelled batch's lines count until a dispatcher drops them), batch
records kept (``max_batches_kept``, the oldest finished ones deleted first); every list is
paged, at most 100 a page; a claim takes at most 100 lines; finalization reads the lines
1,000 at a time. The per-model keys are bounded by the models served, since only lines the
router validated against its catalog are queued. Consumers (routers) that left the group
with nothing pending are removed, at most once per ``claim_idle_s`` per model, in one script
that removes only those with nothing pending (removing a consumer drops its pending entries).

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
- The age of a model's queue is that of its first entry (the oldest to join the stream; a
  retried line rejoins at the end, keeping its ``queued_at``).
- Redis' own errors and timeouts surface as ``StoreUnavailable`` (503), in one place.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError, WatchError
from redis.typing import EncodableT

from ballast.batch.records import (
    STATUS_TIME_FIELD,
    STATUSES,
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
    new_dlq_id,
    new_file_id,
    result_file_id,
)
from ballast.config.batch import BatchConfig
from ballast.errors import BatchLimitExceeded, FileLimitExceeded, InvalidRequest, StoreUnavailable

GROUP = "dispatch"
MAX_PAGE = 100  # items a list call returns at most (OpenAI's batches list allows 100)
MAX_CLAIM = 100  # lines one claim hands out at most
CHUNK = 1000  # lines read per round trip when a batch is finalized
FINAL_LOCK_S = 60.0  # a finalizer that died lets go after this
WATCH_TRIES = 5  # a batch's creation, retried when a concurrent change to its tenant's counts won
MAX_CONNECTIONS = 32  # per store (per router): a call waits for a free one up to store_timeout_s
TAKES_ANSWERS: tuple[BatchStatus, ...] = ("in_progress", "cancelling")

# -- scripts ------------------------------------------------------------------------------
_FIELD = """
local function field(f, name)
  for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end
  return nil
end
"""

# KEYS: meta, data, tenant index, all index, expiry index, tenant bytes
# ARGV: id, tenant, filename, purpose, size, created_at, expires_at or '', data, max_files, max_bytes, enforce
PUT_FILE = """
local size = tonumber(ARGV[5])
if ARGV[11] == '1' then
  if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[9]) then return -1 end
  if tonumber(redis.call('GET', KEYS[6]) or '0') + size > tonumber(ARGV[10]) then return -2 end
end
local old = redis.call('HGET', KEYS[1], 'bytes')
if old then redis.call('DECRBY', KEYS[6], old) end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'tenant', ARGV[2], 'filename', ARGV[3], 'purpose', ARGV[4],
           'bytes', ARGV[5], 'created_at', ARGV[6])
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'expires_at', ARGV[7])
  redis.call('ZADD', KEYS[5], ARGV[7], ARGV[1])
else
  redis.call('HDEL', KEYS[1], 'expires_at')
  redis.call('ZREM', KEYS[5], ARGV[1])
end
redis.call('SET', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[1])
redis.call('INCRBY', KEYS[6], size)
return 1
"""

# KEYS: meta, data, all index, expiry index; ARGV: prefix, id
DELETE_FILE = """
local t = redis.call('HGET', KEYS[1], 'tenant')
if not t then return 0 end
local b = redis.call('HGET', KEYS[1], 'bytes')
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('ZREM', ARGV[1] .. ':files:' .. t, ARGV[2])
redis.call('DECRBY', ARGV[1] .. ':bytes:' .. t, b)
return 1
"""

# Compare-and-set of a batch's status. KEYS: batch, final lock, out, err, order
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

# A line's answer, first write wins, in exactly one of the two hashes. KEYS: batch, mine, other, final lock
# ARGV: field, line JSON, lock token or '', statuses that take answers...
RECORD = """
local holder = redis.call('GET', KEYS[4])
if holder and holder ~= ARGV[3] then return 0 end
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
local ok = false
for i = 4, #ARGV do if ARGV[i] == st then ok = true end end
if not ok then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
return redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
"""

# KEYS: queue; ARGV: group, entry id, prefix
ACK = (
    _FIELD
    + """
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if #e == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('DECR', ARGV[3] .. ':queued:' .. field(e[1][2], 'tenant'))
return 1
"""
)

# The entry, when ``consumer`` still owns it (else false). KEYS: queue; ARGV: group, entry id, consumer
_OWNED = """
local function owned()
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then return false end
  local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
  if #e == 0 then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
    return false
  end
  return e[1][2]
end
local function with(f, name, value)
  for i = 1, #f, 2 do if f[i] == name then f[i + 1] = value end end
end
"""

# KEYS: queue; ARGV: group, entry id, consumer, attempts, not_before
REQUEUE = (
    _OWNED
    + """
local f = owned()
if not f then return false end
with(f, 'attempts', ARGV[4])
with(f, 'not_before', ARGV[5])
local id = redis.call('XADD', KEYS[1], '*', unpack(f))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id
"""
)

# KEYS: queue, dlq, dlq index, dlq models; ARGV: group, entry id, consumer, dlq id, model, attempts, error, since
DEAD_LETTER = (
    _OWNED
    + """
local f = owned()
if not f then return false end
with(f, 'attempts', ARGV[6])
local id = redis.call('XADD', KEYS[2], '*', 'dlq_id', ARGV[4], 'error', ARGV[7], 'since', ARGV[8], unpack(f))
redis.call('HSET', KEYS[3], ARGV[4], id .. ' ' .. ARGV[5])
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id
"""
)

# Back on the queue, attempts 0. KEYS: dlq index, dlq, queue; ARGV: dlq id, index value, dlq entry id
DLQ_RETRY = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return false end
local e = redis.call('XRANGE', KEYS[2], ARGV[3], ARGV[3])
redis.call('HDEL', KEYS[1], ARGV[1])
if #e == 0 then return false end
local f = e[1][2]
local line = {}
for i = 1, #f, 2 do
  local k, v = f[i], f[i + 1]
  if k == 'attempts' then v = '0' elseif k == 'not_before' then v = '0.0' end
  if k ~= 'dlq_id' and k ~= 'error' and k ~= 'since' then
    line[#line + 1] = k
    line[#line + 1] = v
  end
end
local id = redis.call('XADD', KEYS[3], '*', unpack(line))
redis.call('XDEL', KEYS[2], ARGV[3])
return id
"""

# KEYS: dlq index, dlq; ARGV: dlq id, index value, dlq entry id, prefix
DLQ_DROP = (
    _FIELD
    + """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
local e = redis.call('XRANGE', KEYS[2], ARGV[3], ARGV[3])
redis.call('HDEL', KEYS[1], ARGV[1])
if #e == 0 then return 0 end
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('DECR', ARGV[4] .. ':queued:' .. field(e[1][2], 'tenant'))
return 1
"""
)

# Consumers idle at least ARGV[2] ms with nothing pending leave the group (one script: a consumer
# that reads between a check and its removal would lose what it read). KEYS: queue; ARGV: group, idle ms
PRUNE_CONSUMERS = """
local gone = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local name, pending, idle
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1] elseif c[i] == 'pending' then pending = c[i + 1]
    elseif c[i] == 'idle' then idle = c[i + 1] end
  end
  if pending == 0 and idle >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    gone = gone + 1
  end
end
return gone
"""

# The finalizer's lock let go, if it is still this one's. KEYS: lock; ARGV: token
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

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


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decoded(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    """A hash or stream entry's fields as text (the store writes only UTF-8 text in them)."""
    return {_s(k): _s(v) for k, v in (raw or {}).items()}


def _texts(values: Iterable[Any]) -> list[str]:
    """Members or ids of a Redis reply as text."""
    return [_s(v) for v in values]


def _entries(raw: Any) -> list[tuple[str, dict[str, str]]]:
    """A stream reply's entries, (id, fields); an entry deleted under a pending claim
    (Redis 6.2 answers it as nil) is left out."""
    return [(_s(eid), _decoded(fields)) for eid, fields in raw or [] if eid is not None and fields is not None]


def _int_or_none(value: str | None) -> int | None:
    return None if value is None or value == "" else int(float(value))


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be 1-{MAX_PAGE}", field="limit")
    return limit


def _line_field(custom_id: str | None, line: int) -> str:
    """A line's field in its batch's answer hashes and line order: its custom_id (unique in a
    batch), or its line number where it has none; prefixed so the two never meet."""
    return f"c:{custom_id}" if custom_id is not None else f"n:{line}"


@dataclass(frozen=True)
class Keys:
    """The store's key names, under ``prefix`` (``<key_prefix>:<app_name>``)."""

    prefix: str

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def file_data(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}:data"

    def files(self, tenant: str | None) -> str:
        return f"{self.prefix}:files" if tenant is None else f"{self.prefix}:files:{tenant}"

    def files_expiry(self) -> str:
        return f"{self.prefix}:files-expiry"

    def stored_bytes(self, tenant: str) -> str:
        return f"{self.prefix}:bytes:{tenant}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batches(self, tenant: str | None) -> str:
        return f"{self.prefix}:batches" if tenant is None else f"{self.prefix}:batches:{tenant}"

    def inflight(self, tenant: str | None) -> str:
        return f"{self.prefix}:inflight" if tenant is None else f"{self.prefix}:inflight:{tenant}"

    def queued(self, tenant: str) -> str:
        return f"{self.prefix}:queued:{tenant}"

    def order(self, batch_id: str) -> str:
        return f"{self.prefix}:order:{batch_id}"

    def answers(self, batch_id: str, kind: LineKind) -> str:
        return f"{self.prefix}:{'out' if kind == 'output' else 'err'}:{batch_id}"

    def final(self, batch_id: str) -> str:
        return f"{self.prefix}:final:{batch_id}"

    def queue(self, model: str) -> str:
        return f"{self.prefix}:q:{model}"

    def dlq(self, model: str) -> str:
        return f"{self.prefix}:dlq:{model}"

    def dlq_index(self) -> str:
        return f"{self.prefix}:dlq"

    def dlq_models(self) -> str:
        return f"{self.prefix}:dlq-models"


def read_password(cfg: BatchConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The store's password: ``$store_password_env``, else ``store_password_file``, else none."""
    from ballast.config.loading import read_text

    given = environ.get(cfg.store_password_env)
    if given:
        return given
    if cfg.store_password_file is not None:
        return read_text(cfg.store_password_file).strip() or None
    return None


def connect(cfg: BatchConfig, app_name: str, environ: Mapping[str, str] = os.environ) -> BatchStore:
    """A store on ``cfg.store_url`` (StoreUnavailable when none is set): a bounded connection
    pool, every connect and command within ``store_timeout_s``, tried at most twice (so a call
    gives up within about 2 x ``store_timeout_s`` when the server is gone). Connects on first use."""
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
    return BatchStore(Redis(connection_pool=pool), cfg, app_name)


class BatchStore:
    """Files, batches, queues, answers and dead letters of one app (module docstring).

    ``client`` is a redis.asyncio client that does not decode responses (file data is
    bytes); ``clock`` (monotonic seconds) paces only the removal of departed consumers.
    Times the records carry (``now``) are the caller's Unix seconds."""

    def __init__(
        self,
        client: Redis,
        cfg: BatchConfig,
        app_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._r = client
        self._cfg = cfg
        self._clock = clock
        self.keys = Keys(f"{cfg.key_prefix}:{app_name}")
        self._groups: set[str] = set()  # models whose queue has its consumer group (bounded by the models)
        self._cursor: dict[str, str] = {}  # per model: where the next XAUTOCLAIM scan starts
        self._pruned_at: dict[str, float] = {}  # per model: when departed consumers were last removed
        self._put_file = client.register_script(PUT_FILE)
        self._delete_file = client.register_script(DELETE_FILE)
        self._set_status = client.register_script(SET_STATUS)
        self._record = client.register_script(RECORD)
        self._ack = client.register_script(ACK)
        self._requeue = client.register_script(REQUEUE)
        self._dead_letter = client.register_script(DEAD_LETTER)
        self._dlq_retry = client.register_script(DLQ_RETRY)
        self._dlq_drop = client.register_script(DLQ_DROP)
        self._prune = client.register_script(PRUNE_CONSUMERS)
        self._release_lock = client.register_script(RELEASE)

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
        if expires_at is None:
            expires_at = now + self._cfg.file_expiry_s
        rec = FileRecord(
            id=new_file_id(),
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            size_bytes=len(data),
            created_at=int(now),
            expires_at=int(expires_at),
        )
        await self._write_file(rec, data, enforce=True)
        return rec

    async def _write_file(self, rec: FileRecord, data: bytes, enforce: bool) -> None:
        k = self.keys
        keys = [
            k.file(rec.id),
            k.file_data(rec.id),
            k.files(rec.tenant),
            k.files(None),
            k.files_expiry(),
            k.stored_bytes(rec.tenant),
        ]
        args: list[EncodableT] = [
            rec.id,
            rec.tenant,
            rec.filename,
            rec.purpose,
            rec.size_bytes,
            rec.created_at,
            "" if rec.expires_at is None else rec.expires_at,
            data,
            self._cfg.max_files,
            self._cfg.max_stored_bytes,
            "1" if enforce else "0",
        ]
        done = int(await self._put_file(keys=keys, args=args))
        if done == -1:
            raise FileLimitExceeded(f"tenant {rec.tenant!r} holds {self._cfg.max_files} files (batch.max_files)")
        if done == -2:
            raise FileLimitExceeded(
                f"tenant {rec.tenant!r} would hold more than {self._cfg.max_stored_bytes} bytes "
                "(batch.max_stored_bytes)"
            )

    @_guarded
    async def file(self, file_id: str) -> FileRecord | None:
        raw = await self._r.hgetall(self.keys.file(file_id))
        return _file_record(_decoded(raw)) if raw else None

    @_guarded
    async def file_data(self, file_id: str) -> bytes | None:
        data = await self._r.get(self.keys.file_data(file_id))
        return data.encode() if isinstance(data, str) else data

    @_guarded
    async def list_files(
        self, tenant: str | None, purpose: str | None = None, limit: int = 20, after: str | None = None
    ) -> Page[FileRecord]:
        """``tenant``'s files (None: every tenant's), newest first, of ``purpose`` if given."""
        rows, more = await self._page(
            self.keys.files(tenant),
            self.keys.file,
            limit,
            after,
            keep=lambda h: purpose is None or h.get("purpose") == purpose,
        )
        return Page(tuple(_file_record(h) for h in rows), more)

    @_guarded
    async def delete_file(self, file_id: str) -> bool:
        """The file and its data gone (False: there was none)."""
        k = self.keys
        keys = [k.file(file_id), k.file_data(file_id), k.files(None), k.files_expiry()]
        return bool(await self._delete_file(keys=keys, args=[k.prefix, file_id]))

    @_guarded
    async def expire_files(self, now: float, limit: int = MAX_PAGE) -> int:
        """Deletes up to ``limit`` files whose ``expires_at`` has passed; how many it deleted."""
        due = await self._r.zrangebyscore(self.keys.files_expiry(), "-inf", now, start=0, num=_limit(limit))
        gone = 0
        for file_id in _texts(due):
            gone += await self.delete_file(file_id)
        return gone

    # -- batches -------------------------------------------------------------------------
    @_guarded
    async def create_batch(
        self, rec: BatchRecord, lines: Sequence[QueuedLine], failed: Sequence[FailedLine] = ()
    ) -> None:
        """Stores ``rec`` with its index entries, every line of ``lines`` on its model's queue and
        every line of ``failed`` in its error hash, in one MULTI. Lines to run need the batch
        ``in_progress``. Refused (nothing stored) with BatchLimitExceeded past the tenant's
        batches in flight or lines queued, FileLimitExceeded when its files leave no room for
        this batch's results (module docstring)."""
        self._check_new_batch(rec, lines, failed)
        for model in sorted({line.model for line in lines}):
            await self._ensure_group(model)
        k = self.keys
        order = sorted(
            [(ln.line, _line_field(ln.custom_id, ln.line)) for ln in lines]
            + [(f.line, _line_field(f.custom_id, f.line)) for f in failed]
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
                    pipe.hset(k.batch(rec.id), mapping=_batch_fields(rec, total=len(order)))
                    pipe.zadd(k.batches(rec.tenant), {rec.id: rec.created_at})
                    pipe.zadd(k.batches(None), {rec.id: rec.created_at})
                    if rec.status not in TERMINAL:
                        pipe.sadd(k.inflight(rec.tenant), rec.id)
                        pipe.sadd(k.inflight(None), rec.id)
                    for start in range(0, len(order), CHUNK):
                        pipe.rpush(k.order(rec.id), *[f for _, f in order[start : start + CHUNK]])
                    if failed:
                        errs: dict[EncodableT, EncodableT] = {
                            _line_field(f.custom_id, f.line): f.line_json for f in failed
                        }
                        pipe.hset(k.answers(rec.id, "error"), mapping=errs)
                    if lines:
                        pipe.incrby(k.queued(rec.tenant), len(lines))
                    for line in lines:
                        pipe.xadd(k.queue(line.model), _stream_fields(line))
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
        fields = [_line_field(ln.custom_id, ln.line) for ln in lines] + [
            _line_field(f.custom_id, f.line) for f in failed
        ]
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
        for batch_id in _texts(oldest):
            status = await self._r.hget(k.batch(batch_id), "status")
            if status is not None and _s(status) not in TERMINAL:
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

    @_guarded
    async def batch(self, batch_id: str) -> BatchRecord | None:
        """The batch, its request counts as they stand now."""
        raw = await self._r.hgetall(self.keys.batch(batch_id))
        found = await self._counted([_decoded(raw)] if raw else [])
        return found[0] if found else None

    @_guarded
    async def list_batches(self, tenant: str | None, limit: int = 20, after: str | None = None) -> Page[BatchRecord]:
        """``tenant``'s batches (None: every tenant's), newest first."""
        rows, more = await self._page(self.keys.batches(tenant), self.keys.batch, limit, after)
        return Page(tuple(await self._counted(rows)), more)

    async def _counted(self, rows: Sequence[dict[str, str]]) -> list[BatchRecord]:
        """Batch records from their hashes, with the answers counted so far."""
        k = self.keys
        async with self._r.pipeline(transaction=False) as pipe:
            for h in rows:
                pipe.hlen(k.answers(h["id"], "output"))
                pipe.hlen(k.answers(h["id"], "error"))
            lengths = [int(n) for n in await pipe.execute()] if rows else []
        return [_batch_record(h, lengths[2 * i], lengths[2 * i + 1]) for i, h in enumerate(rows)]

    async def _page(
        self,
        index: str,
        record_key: Callable[[str], str],
        limit: int,
        after: str | None,
        keep: Callable[[dict[str, str]], bool] | None = None,
    ) -> tuple[list[dict[str, str]], bool]:
        """Up to ``limit`` records of the sorted set ``index``, newest first, after the id
        ``after``, those ``keep`` keeps; and whether more follow. Reads at most the index."""
        limit = _limit(limit)
        start = 0
        if after is not None:
            rank = await self._r.zrevrank(index, after)
            if not isinstance(rank, int):
                raise InvalidRequest(f"after: {after!r} is not in this list", field="after")
            start = rank + 1
        found: list[dict[str, str]] = []
        while True:
            ids = _texts(await self._r.zrevrange(index, start, start + MAX_PAGE - 1))
            if not ids:
                return found, False
            start += len(ids)
            async with self._r.pipeline(transaction=False) as pipe:
                for record_id in ids:
                    pipe.hgetall(record_key(record_id))
                rows = [_decoded(raw) for raw in await pipe.execute()]
            for h in rows:
                if h and (keep is None or keep(h)):
                    found.append(h)
                    if len(found) > limit:
                        return found[:limit], True

    @_guarded
    async def in_flight(self) -> list[str]:
        """The ids of every batch not finished (what a finalizer looks at)."""
        return sorted(_texts(await self._r.smembers(self.keys.inflight(None))))

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
        return await self._cas(batch_id, from_statuses, to, now, fields, token="")

    async def _cas(
        self,
        batch_id: str,
        from_statuses: Sequence[BatchStatus],
        to: BatchStatus,
        now: float,
        fields: Mapping[str, str | int | None],
        token: str,
    ) -> bool:
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

    @_guarded
    async def cancel(self, batch_id: str, now: float) -> bool:
        """``validating`` or ``in_progress`` -> ``cancelling``: dispatchers drop its lines not yet
        run, and its finalization makes it ``cancelled`` with what was answered."""
        return await self._cas(batch_id, ("validating", "in_progress"), "cancelling", now, {}, token="")

    # -- answers -------------------------------------------------------------------------
    @_guarded
    async def record(self, batch_id: str, custom_id: str, kind: LineKind, line_json: str) -> bool:
        """The line's answer written to the output or error hash: True when this write was the
        first. False: the line needs nothing more (answered already, in either hash, or its
        batch finished or finishing, which decides the line itself); ack it either way.
        ``custom_id`` is one of the batch's lines, as its ``Delivery`` carries it (the counts
        that say a batch is done count the hashes)."""
        return await self._record_line(batch_id, _line_field(custom_id, 0), kind, line_json, token="")

    async def _record_line(self, batch_id: str, field: str, kind: LineKind, line_json: str, token: str) -> bool:
        k = self.keys
        other: LineKind = "error" if kind == "output" else "output"
        keys = [k.batch(batch_id), k.answers(batch_id, kind), k.answers(batch_id, other), k.final(batch_id)]
        statuses: tuple[BatchStatus, ...] = TAKES_ANSWERS + (("finalizing",) if token else ())
        return bool(await self._record(keys=keys, args=[field, line_json, token, *statuses]))

    @_guarded
    async def answered(self, batch_id: str, custom_id: str) -> bool:
        """Whether the line has its answer (output or error)."""
        k, field = self.keys, _line_field(custom_id, 0)
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.hexists(k.answers(batch_id, "output"), field)
            pipe.hexists(k.answers(batch_id, "error"), field)
            return any(await pipe.execute())

    @_guarded
    async def progress(self, batch_id: str) -> RequestCounts | None:
        """(total, completed, failed): the answers so far (a finished batch's, as it ended)."""
        rec = await self.batch(batch_id)
        return None if rec is None else rec.request_counts

    # -- the queue -----------------------------------------------------------------------
    async def _ensure_group(self, model: str) -> None:
        if model in self._groups:
            return
        try:
            await self._r.xgroup_create(self.keys.queue(model), GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._groups.add(model)

    @_guarded
    async def claim(self, model: str, consumer: str, count: int) -> list[Delivery]:
        """Up to ``count`` (at most 100) lines of ``model`` for ``consumer``: first lines another
        consumer has held unacknowledged for ``claim_idle_s`` (XAUTOCLAIM: a dead router's),
        then new ones (XREADGROUP, not blocking)."""
        count = min(count, MAX_CLAIM)
        if count < 1:
            return []
        try:
            got = await self._claim(model, consumer, count)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._groups.discard(model)  # the server lost its data: the group again, once
            got = await self._claim(model, consumer, count)
        await self._prune_departed(model)
        return got

    async def _claim(self, model: str, consumer: str, count: int) -> list[Delivery]:
        await self._ensure_group(model)
        key = self.keys.queue(model)
        idle_ms = int(self._cfg.claim_idle_s * 1000)
        start = self._cursor.get(model, "0-0")
        taken = await self._r.xautoclaim(key, GROUP, consumer, idle_ms, start_id=start, count=count)
        self._cursor[model] = _s(taken[0])
        entries = _entries(taken[1])[:count]
        if len(entries) < count:
            fresh: Any = await self._r.xreadgroup(GROUP, consumer, {key: ">"}, count=count - len(entries))
            for _stream, got in fresh or []:
                entries += _entries(got)
        return [Delivery(model, eid, consumer, QueuedLine.from_fields(fields)) for eid, fields in entries]

    async def _prune_departed(self, model: str) -> None:
        now = self._clock()
        if now - self._pruned_at.get(model, -float("inf")) < self._cfg.claim_idle_s:
            return
        self._pruned_at[model] = now
        await self._prune(keys=[self.keys.queue(model)], args=[GROUP, int(self._cfg.claim_idle_s * 1000)])

    @_guarded
    async def ack(self, model: str, entry_id: str) -> bool:
        """The entry acknowledged and deleted (after its answer was recorded); False when it
        was gone already."""
        return bool(await self._ack(keys=[self.keys.queue(model)], args=[GROUP, entry_id, self.keys.prefix]))

    @_guarded
    async def requeue(self, delivery: Delivery, attempts: int, not_before: float) -> str | None:
        """A fresh entry for the line, with ``attempts`` (the attempts made so far) and
        ``not_before`` (the dispatcher does not send it earlier), and the old one acknowledged;
        its id. None: the delivery is no longer this consumer's (another claimed it)."""
        args: list[EncodableT] = [GROUP, delivery.entry_id, delivery.consumer, attempts, repr(not_before)]
        new = await self._requeue(keys=[self.keys.queue(delivery.model)], args=args)
        return None if new is None else _s(new)

    @_guarded
    async def queue_depth(self, model: str) -> int:
        """Lines of ``model`` queued or being run."""
        return int(await self._r.xlen(self.keys.queue(model)))

    @_guarded
    async def oldest_age_s(self, model: str, now: float) -> float:
        """How long the first line on ``model``'s queue has waited since it joined (0: none)."""
        first = _entries(await self._r.xrange(self.keys.queue(model), count=1))
        if not first:
            return 0.0
        return max(0.0, now - float(first[0][1]["queued_at"]))

    # -- dead letters --------------------------------------------------------------------
    @_guarded
    async def dead_letter(self, delivery: Delivery, error: str, now: float) -> DeadLetter | None:
        """The line moved to its model's dead-letter queue with ``error`` (its attempts as
        ``delivery`` carries them) and the queue entry acknowledged; None: the delivery is no
        longer this consumer's."""
        k, model = self.keys, delivery.model
        dlq_id = new_dlq_id()
        error = error[:1000]
        keys = [k.queue(model), k.dlq(model), k.dlq_index(), k.dlq_models()]
        args: list[EncodableT] = [
            GROUP,
            delivery.entry_id,
            delivery.consumer,
            dlq_id,
            model,
            delivery.line.attempts,
            error,
            repr(now),
        ]
        if await self._dead_letter(keys=keys, args=args) is None:
            return None
        return DeadLetter(dlq_id, model, delivery.line, error, now)

    async def _dlq_entry(self, dlq_id: str) -> tuple[str, str, DeadLetter] | None:
        """(index value, stream entry id, the dead letter)."""
        where = await self._r.hget(self.keys.dlq_index(), dlq_id)
        if where is None:
            return None
        entry_id, model = _s(where).split(" ", 1)
        got = _entries(await self._r.xrange(self.keys.dlq(model), entry_id, entry_id))
        if not got:
            return None
        return _s(where), entry_id, _dead_letter(model, got[0][1])

    @_guarded
    async def dlq_get(self, dlq_id: str) -> DeadLetter | None:
        found = await self._dlq_entry(dlq_id)
        return None if found is None else found[2]

    @_guarded
    async def dlq_list(self, model: str | None = None, limit: int = 20, after: str | None = None) -> Page[DeadLetter]:
        """Dead letters oldest first, of ``model`` or of every model (by model name)."""
        limit = _limit(limit)
        models = [model] if model is not None else sorted(_texts(await self._r.smembers(self.keys.dlq_models())))
        start_model, start = (models[0] if models else "", "-")
        if after is not None:
            where = await self._r.hget(self.keys.dlq_index(), after)
            if where is None:
                raise InvalidRequest(f"after: {after!r} is not in this list", field="after")
            entry_id, start_model = _s(where).split(" ", 1)
            if model is not None and start_model != model:
                raise InvalidRequest(f"after: {after!r} is not in this list", field="after")
            start = f"({entry_id}"
        found: list[DeadLetter] = []
        for m in models:
            if m < start_model:
                continue
            got = await self._r.xrange(self.keys.dlq(m), start if m == start_model else "-", "+", count=limit + 1)
            found += [_dead_letter(m, fields) for _, fields in _entries(got)]
            if len(found) > limit:
                return Page(tuple(found[:limit]), True)
        return Page(tuple(found), False)

    @_guarded
    async def dlq_retry(self, dlq_id: str) -> str | None:
        """The dead letter back on its model's queue with attempts 0, gone from the dead-letter
        queue; its new entry id (None: no such dead letter)."""
        found = await self._dlq_entry(dlq_id)
        if found is None:
            return None
        where, entry_id, dead = found
        await self._ensure_group(dead.model)
        k = self.keys
        keys = [k.dlq_index(), k.dlq(dead.model), k.queue(dead.model)]
        new = await self._dlq_retry(keys=keys, args=[dlq_id, where, entry_id])
        return None if new is None else _s(new)

    @_guarded
    async def dlq_delete(self, dlq_id: str, line_json: str) -> bool:
        """The dead letter removed, its line recorded as ``line_json`` in its batch's error
        file (unless the line has its answer, or its batch finished); False: no such one."""
        found = await self._dlq_entry(dlq_id)
        if found is None:
            return False
        where, entry_id, dead = found
        field = _line_field(dead.line.custom_id, dead.line.line)
        await self._record_line(dead.line.batch_id, field, "error", line_json, token="")
        k = self.keys
        keys = [k.dlq_index(), k.dlq(dead.model)]
        return bool(await self._dlq_drop(keys=keys, args=[dlq_id, where, entry_id, k.prefix]))

    @_guarded
    async def dlq_depth(self, model: str) -> int:
        return int(await self._r.xlen(self.keys.dlq(model)))

    # -- finalization --------------------------------------------------------------------
    @_guarded
    async def finalize(self, batch_id: str, now: float, expired_line: Callable[[str], str]) -> BatchRecord | None:
        """The batch ended, when it is due: every line answered (``completed``), cancelling
        (``cancelled``), or past ``expires_at`` (``expired``: each line not answered gets
        ``expired_line(custom_id)`` in the error file). Its output and error files written
        in input-line order (purpose ``batch_output``, the batch's tenant's, expiring after
        ``file_expiry_s``), their ids and the counts set, the status changed. Returns the
        ended batch; None when it is not due, ended already, or another router holds it."""
        rec = await self.batch(batch_id)
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
        k = self.keys
        token = secrets.token_hex(8)
        if not await self._r.set(k.final(batch_id), token, nx=True, px=int(FINAL_LOCK_S * 1000)):
            return None
        try:
            if final == "completed" and rec.status == "in_progress":
                await self._cas(batch_id, ("in_progress",), "finalizing", now, {}, token="")
            out, err = await self._result_lines(batch_id, token, expired_line if final == "expired" else None)
            ids: dict[str, str | int | None] = {"output_file_id": None, "error_file_id": None}
            results: tuple[tuple[LineKind, list[str]], ...] = (("output", out), ("error", err))
            for kind, lines in results:
                if lines:
                    ids[f"{kind}_file_id"] = await self._write_result(rec, kind, lines, now)
            fields = {**ids, "completed": len(out), "failed": len(err)}
            statuses: tuple[BatchStatus, ...] = ("in_progress", "finalizing", "cancelling")
            if not await self._cas(batch_id, statuses, final, now, fields, token=token):
                return None  # the lock lapsed: the next finalization redoes it, over the same files
        finally:
            await self._release(k.final(batch_id), token)
        return await self.batch(batch_id)

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
        await self._write_file(file, data, enforce=False)
        return file.id

    async def _result_lines(
        self, batch_id: str, token: str, expired_line: Callable[[str], str] | None
    ) -> tuple[list[str], list[str]]:
        """The output and error files' lines, in input-line order; with ``expired_line``, each
        line not answered is first recorded as expired."""
        k = self.keys
        out: list[str] = []
        err: list[str] = []
        total = int(await self._r.llen(k.order(batch_id)))
        for start in range(0, total, CHUNK):
            fields = _texts(await self._r.lrange(k.order(batch_id), start, start + CHUNK - 1))
            answers = await self._r.hmget(k.answers(batch_id, "output"), fields)
            errors = await self._r.hmget(k.answers(batch_id, "error"), fields)
            for field, answer, error in zip(fields, answers, errors):
                if answer is not None:
                    out.append(_s(answer))
                elif error is not None:
                    err.append(_s(error))
                elif expired_line is not None:
                    line = expired_line(field[2:])
                    if await self._record_line(batch_id, field, "error", line, token=token):
                        err.append(line)
        return out, err

    async def _release(self, key: str, token: str) -> None:
        await self._release_lock(keys=[key], args=[token])


def _stream_fields(line: QueuedLine) -> dict[EncodableT, EncodableT]:
    return dict(line.fields().items())


def _file_record(h: Mapping[str, str]) -> FileRecord:
    return FileRecord(
        id=h["id"],
        tenant=h["tenant"],
        filename=h["filename"],
        purpose=h["purpose"],
        size_bytes=int(h["bytes"]),
        created_at=int(h["created_at"]),
        expires_at=_int_or_none(h.get("expires_at")),
    )


def _batch_fields(rec: BatchRecord, total: int) -> dict[EncodableT, EncodableT]:
    """The batch's hash: its fields, None ones left out; the counts as ``total`` (lines)."""
    out: dict[EncodableT, EncodableT] = {}
    for name, value in rec.to_dict().items():
        if name in ("request_counts", "metadata", "errors") or value is None:
            continue
        out[name] = value
    out["metadata"] = json.dumps(dict(rec.metadata))
    out["errors"] = json.dumps(list(rec.errors))
    out["total"] = total
    return out


def _batch_record(h: Mapping[str, str], answered: int, failed: int) -> BatchRecord:
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
        in_progress_at=_int_or_none(h.get("in_progress_at")),
        finalizing_at=_int_or_none(h.get("finalizing_at")),
        completed_at=_int_or_none(h.get("completed_at")),
        failed_at=_int_or_none(h.get("failed_at")),
        expired_at=_int_or_none(h.get("expired_at")),
        cancelling_at=_int_or_none(h.get("cancelling_at")),
        cancelled_at=_int_or_none(h.get("cancelled_at")),
        request_counts=RequestCounts(int(h.get("total", 0)), answered, failed),
    )


def _dead_letter(model: str, f: Mapping[str, str]) -> DeadLetter:
    return DeadLetter(
        id=f["dlq_id"],
        model=model,
        line=QueuedLine.from_fields(dict(f)),
        last_error=f["error"],
        since=float(f["since"]),
    )
