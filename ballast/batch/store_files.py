"""``FileStore``: the batch store's files (``BatchStore`` holds one): a record and the bytes
of each, the tenant's and everyone's indexes by creation, the expiry index and the bytes each
tenant holds, changed together by one Lua script per write or deletion.

A tenant's ``max_files`` and ``max_stored_bytes`` are checked in the same script that writes
the file, so two uploads at once cannot both pass; a batch's output and error files are
written past them (``enforce=False``: the batch held their room when it was created).
"""

from __future__ import annotations

from collections.abc import Mapping

from redis.asyncio import Redis
from redis.typing import EncodableT

from ballast.batch.records import FileRecord, Page, new_file_id
from ballast.batch.store_layout import MAX_PAGE, Keys, decoded, int_or_none, page_limit, read_page, texts
from ballast.config.batch import BatchConfig
from ballast.errors import FileLimitExceeded

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


class FileStore:
    """Files of one app, under ``keys``; Redis' errors pass through (``BatchStore`` maps them)."""

    def __init__(self, client: Redis, cfg: BatchConfig, keys: Keys) -> None:
        self._r = client
        self._cfg = cfg
        self.keys = keys
        self._put_file = client.register_script(PUT_FILE)
        self._delete_file = client.register_script(DELETE_FILE)

    async def put_file(
        self, tenant: str, filename: str, purpose: str, data: bytes, expires_at: float | None, now: float
    ) -> FileRecord:
        """A new file of ``tenant``'s, within the tenant's limits (``BatchStore.put_file``)."""
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
        await self.write_file(rec, data, enforce=True)
        return rec

    async def write_file(self, rec: FileRecord, data: bytes, enforce: bool) -> None:
        """``rec`` and ``data`` stored (replacing a file of the same id); with ``enforce``,
        FileLimitExceeded and nothing stored past the tenant's ``max_files`` or
        ``max_stored_bytes``."""
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

    async def file(self, file_id: str) -> FileRecord | None:
        raw = await self._r.hgetall(self.keys.file(file_id))
        return file_record(decoded(raw)) if raw else None

    async def file_data(self, file_id: str) -> bytes | None:
        data = await self._r.get(self.keys.file_data(file_id))
        return data.encode() if isinstance(data, str) else data

    async def list_files(
        self, tenant: str | None, purpose: str | None = None, limit: int = 20, after: str | None = None
    ) -> Page[FileRecord]:
        rows, more = await read_page(
            self._r,
            self.keys.files(tenant),
            self.keys.file,
            limit,
            after,
            keep=lambda h: purpose is None or h.get("purpose") == purpose,
        )
        return Page(tuple(file_record(h) for h in rows), more)

    async def delete_file(self, file_id: str) -> bool:
        k = self.keys
        keys = [k.file(file_id), k.file_data(file_id), k.files(None), k.files_expiry()]
        return bool(await self._delete_file(keys=keys, args=[k.prefix, file_id]))

    async def expire_files(self, now: float, limit: int = MAX_PAGE) -> int:
        due = await self._r.zrangebyscore(self.keys.files_expiry(), "-inf", now, start=0, num=page_limit(limit))
        gone = 0
        for file_id in texts(due):
            gone += await self.delete_file(file_id)
        return gone


def file_record(h: Mapping[str, str]) -> FileRecord:
    return FileRecord(
        id=h["id"],
        tenant=h["tenant"],
        filename=h["filename"],
        purpose=h["purpose"],
        size_bytes=int(h["bytes"]),
        created_at=int(h["created_at"]),
        expires_at=int_or_none(h.get("expires_at")),
    )
