"""``LineQueue``: the batch store's queues (``BatchStore`` holds one): a stream per (model,
tenant) that routers claim lines from in consumer group ``dispatch``, the index of the tenants
with lines queued per model, and a dead-letter stream per model with its index by dlq id.

A claim shares the model among tenants (``CLAIM``, one script): first the lines a dead router
left (XAUTOCLAIM, after ``claim_idle_s``), then new lines one at a time, each to the tenant
with the fewest lines in flight (its stream's pending entries, across every router) per unit of
its weight (``tenants.<name>.weight``), ties to the tenant whose next line has waited longest
(its ``queued_at``), then by name. A lone tenant gets every line (work-conserving), and the
lines one tenant queued first never hold back another's. A tenant the weights do not name
(taken out of the config while its lines wait) weighs as the lightest one named (1 when none
is).

Every change that moves a line (acknowledged, requeued, dead-lettered, retried or dropped from
a dead-letter queue) is one Lua script, so the tenant's count of lines queued
(``P:queued:{tenant}``), the streams and the tenants' index never disagree: every XADD to a
tenant's stream adds the tenant to its model's index in the same script or MULTI, and a tenant
leaves the index only in a script that finds its stream empty. Only the consumer that still
owns an entry may requeue or dead-letter it (``_OWNED``): another router may have claimed it
since. Consumers that left the group with nothing pending are removed, at most once per
``claim_idle_s`` per model, in one script over the model's streams that removes only those
with nothing pending (removing a consumer drops its pending entries).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.typing import EncodableT

from ballast.batch.records import DeadLetter, Delivery, Page, QueuedLine, new_dlq_id
from ballast.batch.store_layout import Keys, entries, entry_parts, entry_ref, page_limit, text, texts
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

# The tenant leaves its model's index once its stream is empty (an XADD adds it back, atomically).
_LEAVE = """
local function leave_if_empty(stream, index, tenant)
  if redis.call('XLEN', stream) == 0 then redis.call('SREM', index, tenant) end
end
"""

# KEYS: queue, tenants index; ARGV: group, entry id, prefix, tenant
ACK = (
    _FIELD
    + _LEAVE
    + """
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if #e == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('DECR', ARGV[3] .. ':queued:' .. field(e[1][2], 'tenant'))
leave_if_empty(KEYS[1], KEYS[2], ARGV[4])
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

# KEYS: queue, tenants index; ARGV: group, entry id, consumer, attempts, not_before, tenant
REQUEUE = (
    _OWNED
    + """
local f = owned()
if not f then return false end
with(f, 'attempts', ARGV[4])
with(f, 'not_before', ARGV[5])
local id = redis.call('XADD', KEYS[1], '*', unpack(f))
redis.call('SADD', KEYS[2], ARGV[6])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id
"""
)

# KEYS: queue, dlq, dlq index, dlq models, tenants index
# ARGV: group, entry id, consumer, dlq id, model, attempts, error, since, tenant
DEAD_LETTER = (
    _OWNED
    + _LEAVE
    + """
local f = owned()
if not f then return false end
with(f, 'attempts', ARGV[6])
local id = redis.call('XADD', KEYS[2], '*', 'dlq_id', ARGV[4], 'error', ARGV[7], 'since', ARGV[8], unpack(f))
redis.call('HSET', KEYS[3], ARGV[4], id .. ' ' .. ARGV[5])
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
leave_if_empty(KEYS[1], KEYS[5], ARGV[9])
return id
"""
)

# Back on its tenant's queue, attempts 0. KEYS: dlq index, dlq, queue, tenants index
# ARGV: dlq id, index value, dlq entry id, tenant
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
redis.call('SADD', KEYS[4], ARGV[4])
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

# Consumers idle at least ARGV[2] ms with nothing pending leave the group of each stream in KEYS
# (the model's tenants' streams; one script: a consumer that reads between a check and its removal
# would lose what it read). ARGV: group, idle ms
PRUNE_CONSUMERS = """
local gone = 0
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', key, ARGV[1])) do
      local name, pending, idle
      for i = 1, #c, 2 do
        if c[i] == 'name' then name = c[i + 1] elseif c[i] == 'pending' then pending = c[i + 1]
        elseif c[i] == 'idle' then idle = c[i + 1] end
      end
      if pending == 0 and idle >= tonumber(ARGV[2]) then
        redis.call('XGROUP', 'DELCONSUMER', key, ARGV[1], name)
        gone = gone + 1
      end
    end
  end
end
return gone
"""

# A claim, shared fairly among the model's tenants (module docstring). Ties (lines in flight per
# weight alike) go to the stream whose next line has the oldest queued_at, then to the first in
# KEYS (by tenant name). KEYS: tenants index, then the tenants' streams; ARGV: group, consumer,
# count, idle ms, then for each stream in KEYS' order: tenant, weight, XAUTOCLAIM cursor.
# Returns {cursors (one per stream), {{tenant, entry id, fields}, ...} in the order handed out}.
# The pending count is XINFO GROUPS' ``pending``: the group's pending entries, XPENDING's summary
# count, with the last delivered id in the same reply.
CLAIM = (
    _FIELD
    + """
local group, consumer, want, idle = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n = #KEYS - 1
local tenant, weight, cursor, live = {}, {}, {}, {}
for i = 1, n do
  tenant[i], weight[i], cursor[i] = ARGV[2 + 3 * i], tonumber(ARGV[3 + 3 * i]), ARGV[4 + 3 * i]
  live[i] = redis.call('XLEN', KEYS[i + 1]) > 0
  if not live[i] then redis.call('SREM', KEYS[1], tenant[i]) end
end
local got = {}

-- 1. lines another consumer has held unacknowledged for idle ms (a dead router's)
for i = 1, n do
  if live[i] and #got < want then
    local r = redis.call('XAUTOCLAIM', KEYS[i + 1], group, consumer, idle, cursor[i], 'COUNT', want - #got)
    cursor[i] = r[1]
    for _, e in ipairs(r[2]) do  -- an entry deleted under its claim (Redis 6.2 answers it nil) is left out
      if #got < want and type(e) == 'table' and type(e[2]) == 'table' then
        got[#got + 1] = {tenant[i], e[1], e[2]}
      end
    end
  end
end

-- 2. new lines, one at a time, to the tenant with the fewest in flight per unit of weight
-- head[i]: the next line of stream i not yet delivered, {entry id, queued_at} (nil: none)
local pending, head = {}, {}
local function after(key, id)
  local e = redis.call('XRANGE', key, '(' .. id, '+', 'COUNT', 1)
  if #e == 0 then return nil end
  return {e[1][1], tonumber(field(e[1][2], 'queued_at'))}
end
local function first(i, j)  -- whether stream i goes before stream j
  local lhs, rhs = pending[i] * weight[j], pending[j] * weight[i]
  if lhs ~= rhs then return lhs < rhs end
  if head[i][2] ~= head[j][2] then return head[i][2] < head[j][2] end
  return i < j
end
if #got < want then
  for i = 1, n do
    if live[i] then
      local last
      for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[i + 1])) do
        local name, p, l
        for k = 1, #g, 2 do
          if g[k] == 'name' then name = g[k + 1] elseif g[k] == 'pending' then p = g[k + 1]
          elseif g[k] == 'last-delivered-id' then l = g[k + 1] end
        end
        if name == group then pending[i], last = p, l end
      end
      if not last then return redis.error_reply('NOGROUP no group ' .. group .. ' on ' .. KEYS[i + 1]) end
      head[i] = after(KEYS[i + 1], last)
    end
  end
end
while #got < want do
  local best
  for i = 1, n do
    if head[i] and (not best or first(i, best)) then best = i end
  end
  if not best then break end
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', KEYS[best + 1], '>')
  local e = r and r[1][2][1]
  if not e then
    head[best] = nil
  else
    got[#got + 1] = {tenant[best], e[1], e[2]}
    pending[best] = pending[best] + 1
    head[best] = after(KEYS[best + 1], e[1])
  end
end
return {cursor, got}
"""
)


class LineQueue:
    """The queues and dead-letter queues of one app, under ``keys``; Redis' errors pass through
    (``BatchStore`` maps them). ``weights``: each tenant's share of a model's lines, per unit
    (``tenants.<name>.weight``; each positive and finite). ``clock`` (monotonic seconds) paces
    only the removal of departed consumers."""

    def __init__(
        self,
        client: Redis,
        cfg: BatchConfig,
        keys: Keys,
        clock: Callable[[], float] = time.monotonic,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self._r = client
        self._cfg = cfg
        self._clock = clock
        self.keys = keys
        self._weights = dict(weights or {})
        bad = sorted(t for t, w in self._weights.items() if not (math.isfinite(w) and w > 0))
        if bad:
            raise ValueError(f"tenant weights must be positive and finite: {bad}")
        # A tenant the weights do not name weighs as the lightest one named: a default grants the least.
        self._unnamed_weight = min(self._weights.values(), default=1.0)
        # (model, tenant) streams that have their consumer group (bounded by the models x the tenants)
        self._groups: set[tuple[str, str]] = set()
        # per model, per tenant with lines queued: where the next XAUTOCLAIM scan starts (rebuilt
        # from the model's tenants' index at each claim, so it holds no tenant that left it)
        self._cursor: dict[str, dict[str, str]] = {}
        self._pruned_at: dict[str, float] = {}  # per model: when departed consumers were last removed
        self._ack = client.register_script(ACK)
        self._requeue = client.register_script(REQUEUE)
        self._dead_letter = client.register_script(DEAD_LETTER)
        self._dlq_retry = client.register_script(DLQ_RETRY)
        self._dlq_drop = client.register_script(DLQ_DROP)
        self._prune = client.register_script(PRUNE_CONSUMERS)
        self._claim_fair = client.register_script(CLAIM)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._unnamed_weight)

    async def ensure_group(self, model: str, tenant: str) -> None:
        if (model, tenant) in self._groups:
            return
        try:
            await self._r.xgroup_create(self.keys.queue(model, tenant), GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._groups.add((model, tenant))

    async def tenants(self, model: str) -> list[str]:
        """The tenants with lines of ``model`` queued or running, by name."""
        return sorted(texts(await self._r.smembers(self.keys.queue_tenants(model))))

    async def claim(self, model: str, consumer: str, count: int) -> list[Delivery]:
        """Up to ``count`` (at most 100) lines of ``model`` for ``consumer``: first lines another
        consumer has held unacknowledged for ``claim_idle_s`` (XAUTOCLAIM: a dead router's),
        then new ones, one at a time to the tenant with the fewest lines in flight per unit of
        its weight (module docstring). Two round trips: the tenants' index, then one script."""
        count = min(count, MAX_CLAIM)
        if count < 1:
            return []
        try:
            got = await self._claim(model, consumer, count)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._groups = {g for g in self._groups if g[0] != model}  # the server lost its data: again, once
            got = await self._claim(model, consumer, count)
        await self._prune_departed(model)
        return got

    async def _claim(self, model: str, consumer: str, count: int) -> list[Delivery]:
        tenants = await self.tenants(model)
        if not tenants:
            return []
        for tenant in tenants:
            await self.ensure_group(model, tenant)
        cursors = self._cursor.get(model, {})
        keys = [self.keys.queue_tenants(model)] + [self.keys.queue(model, t) for t in tenants]
        args: list[EncodableT] = [GROUP, consumer, count, int(self._cfg.claim_idle_s * 1000)]
        for tenant in tenants:
            args += [tenant, repr(self.weight(tenant)), cursors.get(tenant, "0-0")]
        new_cursors, got = await self._claim_fair(keys=keys, args=args)
        self._cursor[model] = dict(zip(tenants, texts(new_cursors)))
        return [
            Delivery(model, entry_ref(text(tenant), text(eid)), consumer, QueuedLine.from_fields(flat_fields(fields)))
            for tenant, eid, fields in got
        ]

    async def _prune_departed(self, model: str) -> None:
        now = self._clock()
        if now - self._pruned_at.get(model, -float("inf")) < self._cfg.claim_idle_s:
            return
        self._pruned_at[model] = now
        streams = [self.keys.queue(model, t) for t in await self.tenants(model)]
        if streams:
            await self._prune(keys=streams, args=[GROUP, int(self._cfg.claim_idle_s * 1000)])

    async def ack(self, model: str, entry_id: str) -> bool:
        """The entry acknowledged and deleted (after its answer was recorded); False when it
        was gone already. ``entry_id`` is a ``Delivery``'s (ValueError for any other)."""
        tenant, stream_id = entry_parts(entry_id)
        keys = [self.keys.queue(model, tenant), self.keys.queue_tenants(model)]
        return bool(await self._ack(keys=keys, args=[GROUP, stream_id, self.keys.prefix, tenant]))

    async def requeue(self, delivery: Delivery, attempts: int, not_before: float) -> str | None:
        """A fresh entry for the line on its tenant's stream, with ``attempts`` (the attempts
        made so far) and ``not_before`` (the dispatcher does not send it earlier), and the old
        one acknowledged; its id. None: the delivery is no longer this consumer's (another
        claimed it)."""
        tenant, stream_id = entry_parts(delivery.entry_id)
        keys = [self.keys.queue(delivery.model, tenant), self.keys.queue_tenants(delivery.model)]
        args: list[EncodableT] = [GROUP, stream_id, delivery.consumer, attempts, repr(not_before), tenant]
        new = await self._requeue(keys=keys, args=args)
        return None if new is None else entry_ref(tenant, text(new))

    async def queue_depth(self, model: str) -> int:
        """Lines of ``model`` queued or being run, every tenant's."""
        tenants = await self.tenants(model)
        async with self._r.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.xlen(self.keys.queue(model, tenant))
            return sum(int(n) for n in await pipe.execute())

    async def oldest_age_s(self, model: str, now: float) -> float:
        """How long the line that waits longest on ``model``'s queues has waited since it
        joined them: the oldest of each tenant's first entry (0: none)."""
        tenants = await self.tenants(model)
        async with self._r.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.xrange(self.keys.queue(model, tenant), count=1)
            firsts = [entries(raw) for raw in await pipe.execute()]
        joined = [float(first[0][1]["queued_at"]) for first in firsts if first]
        return max(0.0, now - min(joined)) if joined else 0.0

    # -- dead letters --------------------------------------------------------------------
    async def dead_letter(self, delivery: Delivery, error: str, now: float) -> DeadLetter | None:
        """The line moved to its model's dead-letter queue with ``error`` (its attempts as
        ``delivery`` carries them) and the queue entry acknowledged; None: the delivery is no
        longer this consumer's."""
        k, model = self.keys, delivery.model
        tenant, stream_id = entry_parts(delivery.entry_id)
        dlq_id = new_dlq_id()
        error = error[:1000]
        keys = [k.queue(model, tenant), k.dlq(model), k.dlq_index(), k.dlq_models(), k.queue_tenants(model)]
        args: list[EncodableT] = [
            GROUP,
            stream_id,
            delivery.consumer,
            dlq_id,
            model,
            delivery.line.attempts,
            error,
            repr(now),
            tenant,
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
        """The dead letter back on its tenant's queue of its model with attempts 0, gone from
        the dead-letter queue; its new entry id (None: no such dead letter)."""
        found = await self.dlq_entry(dlq_id)
        if found is None:
            return None
        where, entry_id, dead = found
        model, tenant = dead.model, dead.line.tenant
        await self.ensure_group(model, tenant)
        k = self.keys
        keys = [k.dlq_index(), k.dlq(model), k.queue(model, tenant), k.queue_tenants(model)]
        new = await self._dlq_retry(keys=keys, args=[dlq_id, where, entry_id, tenant])
        return None if new is None else entry_ref(tenant, text(new))

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


def flat_fields(flat: Sequence[Any]) -> dict[str, str]:
    """A stream entry's fields from a script's reply (a flat [name, value, ...] list), as text."""
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}
