"""``LineQueue``: the batch store's queues (``BatchStore`` holds one): a stream per model that
routers claim lines from in consumer group ``dispatch``, and a dead-letter stream per model
with its index by dlq id.

Every change that moves a line (acknowledged, requeued, dead-lettered, retried or dropped from
a dead-letter queue) is one Lua script, so the tenant's count of lines queued
(``P:queued:{tenant}``) and the streams never disagree. Only the consumer that still owns an
entry may requeue or dead-letter it (``_OWNED``): another router may have claimed it since.
Consumers that left the group with nothing pending are removed, at most once per
``claim_idle_s`` per model, in one script that removes only those with nothing pending
(removing a consumer drops its pending entries).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.typing import EncodableT

from ballast.batch.records import DeadLetter, Delivery, Page, QueuedLine, new_dlq_id
from ballast.batch.store_layout import Keys, entries, page_limit, text, texts
from ballast.config.batch import BatchConfig
from ballast.errors import InvalidRequest

GROUP = "dispatch"
MAX_CLAIM = 100  # lines one claim hands out at most

# A field of a stream entry's flat [name, value, ...] list (nil: none).
_FIELD = """
local function field(f, name)
  for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end
  return nil
end
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


class LineQueue:
    """The queues and dead-letter queues of one app, under ``keys``; Redis' errors pass through
    (``BatchStore`` maps them). ``clock`` (monotonic seconds) paces only the removal of
    departed consumers."""

    def __init__(
        self, client: Redis, cfg: BatchConfig, keys: Keys, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._r = client
        self._cfg = cfg
        self._clock = clock
        self.keys = keys
        self._groups: set[str] = set()  # models whose queue has its consumer group (bounded by the models)
        self._cursor: dict[str, str] = {}  # per model: where the next XAUTOCLAIM scan starts
        self._pruned_at: dict[str, float] = {}  # per model: when departed consumers were last removed
        self._ack = client.register_script(ACK)
        self._requeue = client.register_script(REQUEUE)
        self._dead_letter = client.register_script(DEAD_LETTER)
        self._dlq_retry = client.register_script(DLQ_RETRY)
        self._dlq_drop = client.register_script(DLQ_DROP)
        self._prune = client.register_script(PRUNE_CONSUMERS)

    async def ensure_group(self, model: str) -> None:
        if model in self._groups:
            return
        try:
            await self._r.xgroup_create(self.keys.queue(model), GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._groups.add(model)

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
        await self.ensure_group(model)
        key = self.keys.queue(model)
        idle_ms = int(self._cfg.claim_idle_s * 1000)
        start = self._cursor.get(model, "0-0")
        taken = await self._r.xautoclaim(key, GROUP, consumer, idle_ms, start_id=start, count=count)
        self._cursor[model] = text(taken[0])
        lines = entries(taken[1])[:count]
        if len(lines) < count:
            fresh: Any = await self._r.xreadgroup(GROUP, consumer, {key: ">"}, count=count - len(lines))
            for _stream, got in fresh or []:
                lines += entries(got)
        return [Delivery(model, eid, consumer, QueuedLine.from_fields(fields)) for eid, fields in lines]

    async def _prune_departed(self, model: str) -> None:
        now = self._clock()
        if now - self._pruned_at.get(model, -float("inf")) < self._cfg.claim_idle_s:
            return
        self._pruned_at[model] = now
        await self._prune(keys=[self.keys.queue(model)], args=[GROUP, int(self._cfg.claim_idle_s * 1000)])

    async def ack(self, model: str, entry_id: str) -> bool:
        """The entry acknowledged and deleted (after its answer was recorded); False when it
        was gone already."""
        return bool(await self._ack(keys=[self.keys.queue(model)], args=[GROUP, entry_id, self.keys.prefix]))

    async def requeue(self, delivery: Delivery, attempts: int, not_before: float) -> str | None:
        """A fresh entry for the line, with ``attempts`` (the attempts made so far) and
        ``not_before`` (the dispatcher does not send it earlier), and the old one acknowledged;
        its id. None: the delivery is no longer this consumer's (another claimed it)."""
        args: list[EncodableT] = [GROUP, delivery.entry_id, delivery.consumer, attempts, repr(not_before)]
        new = await self._requeue(keys=[self.keys.queue(delivery.model)], args=args)
        return None if new is None else text(new)

    async def queue_depth(self, model: str) -> int:
        """Lines of ``model`` queued or being run."""
        return int(await self._r.xlen(self.keys.queue(model)))

    async def oldest_age_s(self, model: str, now: float) -> float:
        """How long the first line on ``model``'s queue has waited since it joined (0: none)."""
        first = entries(await self._r.xrange(self.keys.queue(model), count=1))
        if not first:
            return 0.0
        return max(0.0, now - float(first[0][1]["queued_at"]))

    # -- dead letters --------------------------------------------------------------------
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

    async def dlq_entry(self, dlq_id: str) -> tuple[str, str, DeadLetter] | None:
        """(index value, stream entry id, the dead letter)."""
        where = await self._r.hget(self.keys.dlq_index(), dlq_id)
        if where is None:
            return None
        entry_id, model = text(where).split(" ", 1)
        got = entries(await self._r.xrange(self.keys.dlq(model), entry_id, entry_id))
        if not got:
            return None
        return text(where), entry_id, dead_letter_record(model, got[0][1])

    async def dlq_get(self, dlq_id: str) -> DeadLetter | None:
        found = await self.dlq_entry(dlq_id)
        return None if found is None else found[2]

    async def dlq_list(self, model: str | None = None, limit: int = 20, after: str | None = None) -> Page[DeadLetter]:
        """Dead letters oldest first, of ``model`` or of every model (by model name)."""
        limit = page_limit(limit)
        models = [model] if model is not None else sorted(texts(await self._r.smembers(self.keys.dlq_models())))
        start_model, start = (models[0] if models else "", "-")
        if after is not None:
            where = await self._r.hget(self.keys.dlq_index(), after)
            if where is None:
                raise InvalidRequest(f"after: {after!r} is not in this list", field="after")
            entry_id, start_model = text(where).split(" ", 1)
            if model is not None and start_model != model:
                raise InvalidRequest(f"after: {after!r} is not in this list", field="after")
            start = f"({entry_id}"
        found: list[DeadLetter] = []
        for m in models:
            if m < start_model:
                continue
            got = await self._r.xrange(self.keys.dlq(m), start if m == start_model else "-", "+", count=limit + 1)
            found += [dead_letter_record(m, fields) for _, fields in entries(got)]
            if len(found) > limit:
                return Page(tuple(found[:limit]), True)
        return Page(tuple(found), False)

    async def dlq_retry(self, dlq_id: str) -> str | None:
        """The dead letter back on its model's queue with attempts 0, gone from the dead-letter
        queue; its new entry id (None: no such dead letter)."""
        found = await self.dlq_entry(dlq_id)
        if found is None:
            return None
        where, entry_id, dead = found
        await self.ensure_group(dead.model)
        k = self.keys
        keys = [k.dlq_index(), k.dlq(dead.model), k.queue(dead.model)]
        new = await self._dlq_retry(keys=keys, args=[dlq_id, where, entry_id])
        return None if new is None else text(new)

    async def dlq_drop(self, dlq_id: str, where: str, entry_id: str, model: str) -> bool:
        """The dead letter removed (its line no longer counted as queued), if the index still
        says ``where`` as ``dlq_entry`` found it; False when another call moved or removed it."""
        k = self.keys
        keys = [k.dlq_index(), k.dlq(model)]
        return bool(await self._dlq_drop(keys=keys, args=[dlq_id, where, entry_id, k.prefix]))

    async def dlq_depth(self, model: str) -> int:
        return int(await self._r.xlen(self.keys.dlq(model)))


def dead_letter_record(model: str, f: Mapping[str, str]) -> DeadLetter:
    return DeadLetter(
        id=f["dlq_id"],
        model=model,
        line=QueuedLine.from_fields(dict(f)),
        last_error=f["error"],
        since=float(f["since"]),
    )
