"""``StoredResponses``: the Responses API's stored responses in the batch store (``BatchStore``
holds one): per tenant, bounded in count and bytes, each expiring ``ttl_s`` after it was stored.

Keys (P = the store's prefix, ``store_layout.Keys``): ``P:resp:{tenant}:{id}`` hash (the
record's JSON, ``created_at``, ``depth``), deleted by Redis at its expiry (PEXPIREAT);
``P:resps:{tenant}`` sorted set id -> expiry in microseconds on the server's clock;
``P:resp-sizes:{tenant}`` hash id -> the record's bytes; ``P:resp-bytes:{tenant}`` their sum.
The tenant is in every key, so another tenant's id reads nothing and deletes nothing, exactly
as an id never stored.

A put is one Lua script: it reads the server's clock (TIME), drops the tenant's entries whose
record has expired, replaces the record of the same id if there is one, adds the new record,
then deletes the tenant's others, the one to expire soonest first, while the tenant holds more
than ``max_stored`` records or ``max_stored_bytes`` bytes. A delete is one script too. So the
count (the sorted set's) and the bytes counter are exactly those of the records alive after
each put; between puts, a record Redis expired stays in them until the tenant's next put or
delete of it, and a tenant's index keys expire with its last record.

Why the index is ordered by expiry on the server's clock, not by ``created_at``: expiry is
what Redis deletes a record by, so the entries of expired records are the index's lowest
scores (one ZRANGEBYSCORE finds all of them, none missed), which no caller's clock could tell.
With one ``ttl_s`` the record to expire soonest is the oldest; after ``ttl_s`` changes, the
one to expire soonest goes first, and never the one being stored.

Why the sweep misses none: a record expires at ``floor(score / 1000)`` ms, and Redis deletes a
key only once its clock in milliseconds is past that, when its clock in microseconds is past
the score; so every record Redis has deleted has a score below the server's time that the
next put reads (TIME, in microseconds, which also orders two puts in the same millisecond).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.typing import EncodableT

from ballast.batch.store_layout import Keys, decoded, text
from ballast.config.responses import ResponsesConfig
from ballast.errors import InvalidRequest, PayloadTooLarge

# A response id as the store takes it: OpenAI's are "resp_" and hex; any other text of these
# characters, up to 128 of them, is someone else's id format and stored as given.
RESPONSE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# forget(id): the record, its index entry, its size and its bytes gone. KEYS: index, sizes, bytes
# ARGV[1]: the prefix of the tenant's record keys ("P:resp:{tenant}:")
FORGET = """
local function forget(id)
  redis.call('DEL', ARGV[1] .. id)
  redis.call('ZREM', KEYS[1], id)
  local size = redis.call('HGET', KEYS[2], id)
  redis.call('HDEL', KEYS[2], id)
  if size and redis.call('DECRBY', KEYS[3], size) <= 0 then redis.call('DEL', KEYS[3]) end
end
"""

# KEYS: index, sizes, bytes
# ARGV: record key prefix, id, record JSON, created_at, depth, ttl_us, max_stored, max_bytes
# Returns -1 (the record alone is over max_bytes; nothing changed) or the records evicted.
PUT_RESPONSE = (
    FORGET
    + """
local size = string.len(ARGV[3])
local max_stored, max_bytes = tonumber(ARGV[7]), tonumber(ARGV[8])
if size > max_bytes then return -1 end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now_us))) do forget(id) end
forget(ARGV[2])
local expiry_us = now_us + tonumber(ARGV[6])
local key = ARGV[1] .. ARGV[2]
redis.call('HSET', key, 'record', ARGV[3], 'created_at', ARGV[4], 'depth', ARGV[5])
redis.call('PEXPIREAT', key, string.format('%.0f', math.floor(expiry_us / 1000)))
redis.call('ZADD', KEYS[1], string.format('%.0f', expiry_us), ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], size)
redis.call('INCRBY', KEYS[3], size)
local evicted = 0
while redis.call('ZCARD', KEYS[1]) > max_stored or tonumber(redis.call('GET', KEYS[3]) or '0') > max_bytes do
  local first = redis.call('ZRANGE', KEYS[1], 0, 1)
  local victim = first[1]
  if victim == ARGV[2] then victim = first[2] end
  forget(victim)  -- never nil: the new record alone is within both bounds
  evicted = evicted + 1
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local index_expiry_ms = string.format('%.0f', math.floor(tonumber(last[2]) / 1000))
for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], index_expiry_ms) end
return evicted
"""
)

# KEYS: index, sizes, bytes; ARGV: record key prefix, id. Returns 1 when the record was there.
DELETE_RESPONSE = (
    FORGET
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
local alive = redis.call('EXISTS', ARGV[1] .. ARGV[2])
forget(ARGV[2])
return alive
"""
)


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its record (the JSON the front stored), when it was made (the
    caller's Unix seconds) and its depth (the responses in its chain, itself included)."""

    id: str
    tenant: str
    record: bytes
    created_at: int
    depth: int


def new_response_id() -> str:
    """A fresh response id, as OpenAI writes them ("resp_" and hex)."""
    return f"resp_{secrets.token_hex(24)}"


class StoredResponses:
    """Stored responses of one app, under ``keys``; Redis' errors pass through
    (``BatchStore`` maps them)."""

    def __init__(self, client: Redis, cfg: ResponsesConfig, keys: Keys) -> None:
        self._r = client
        self._cfg = cfg
        self.keys = keys
        self._put = client.register_script(PUT_RESPONSE)
        self._delete = client.register_script(DELETE_RESPONSE)

    def _index_keys(self, tenant: str) -> list[str]:
        k = self.keys
        return [k.responses(tenant), k.response_sizes(tenant), k.response_bytes(tenant)]

    async def put_response(
        self, tenant: str, response_id: str, record: bytes | str, created_at: float, depth: int
    ) -> int:
        """The record stored under ``tenant`` (replacing one of the same id), the tenant's
        others evicted past its bounds; how many were evicted (``BatchStore.put_response``)."""
        if not RESPONSE_ID.match(response_id):
            raise InvalidRequest(f"response id {response_id[:200]!r}: 1-128 letters, digits, '_' or '-'", field="id")
        if not 1 <= depth <= self._cfg.max_chain_depth:
            raise InvalidRequest(
                f"a conversation holds at most {self._cfg.max_chain_depth} responses (responses.max_chain_depth)",
                field="previous_response_id",
            )
        data = record.encode() if isinstance(record, str) else record
        args: list[EncodableT] = [
            self.keys.response(tenant, ""),
            response_id,
            data,
            int(created_at),
            depth,
            max(1, round(self._cfg.ttl_s * 1_000_000)),
            self._cfg.max_stored,
            self._cfg.max_stored_bytes,
        ]
        evicted = int(await self._put(keys=self._index_keys(tenant), args=args))
        if evicted == -1:
            raise PayloadTooLarge(
                f"a response of {len(data)} bytes is more than a tenant may store "
                f"({self._cfg.max_stored_bytes} bytes, responses.max_stored_bytes)"
            )
        return evicted

    async def get_response(self, tenant: str, response_id: str) -> StoredResponse | None:
        if not RESPONSE_ID.match(response_id):
            return None
        raw = await self._r.hgetall(self.keys.response(tenant, response_id))
        if not raw:
            return None
        fields = {text(k): v for k, v in raw.items()}
        meta = decoded({k: v for k, v in fields.items() if k != "record"})
        record = fields["record"]
        return StoredResponse(
            id=response_id,
            tenant=tenant,
            record=record.encode() if isinstance(record, str) else record,
            created_at=int(meta["created_at"]),
            depth=int(meta["depth"]),
        )

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        if not RESPONSE_ID.match(response_id):
            return False
        args = [self.keys.response(tenant, ""), response_id]
        return bool(await self._delete(keys=self._index_keys(tenant), args=args))
