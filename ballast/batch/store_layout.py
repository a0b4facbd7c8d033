"""The batch store's layout on its server, shared by every part of ``BatchStore``: the key
names (``Keys``), how a batch's line is named in them, and how replies read back as text and
as pages.

Keys (P = ``<batch.key_prefix>:<app_name>``):

- ``P:file:{id}`` hash (the file's record) and ``P:file:{id}:data`` (its bytes);
  ``P:files:{tenant}`` and ``P:files`` (every tenant's) sorted sets by ``created_at``;
  ``P:files-expiry`` sorted set by ``expires_at``; ``P:bytes:{tenant}`` the bytes held.
- ``P:batch:{id}`` hash (the batch's record); ``P:batches:{tenant}`` and ``P:batches``
  sorted sets by ``created_at``; ``P:inflight:{tenant}`` and ``P:inflight`` the batches
  not finished; ``P:order:{batch}`` list, one field name per input line in line order;
  ``P:out:{batch}`` / ``P:err:{batch}`` hashes, field -> the line of the output / error file;
  ``P:final:{batch}`` the finalizer's lock.
- ``P:q:{model}:{tenant}`` stream, consumer group ``dispatch``: one entry per line of the
  tenant's to run on the model (batch, line, custom_id, model, tenant, body, attempts,
  not_before, queued_at); ``P:q-tenants:{model}`` set, the tenants whose stream of the model
  holds entries (the claim's fair share runs over it; bounded by the configured tenants);
  ``P:queued:{tenant}`` the tenant's lines on the queues and dead-letter queues. A line's
  ``Delivery.entry_id`` is ``<tenant>/<stream entry id>`` (``entry_ref``): unique per model,
  where the same stream id can stand in two tenants' streams.
- ``P:dlq:{model}`` stream (the line's fields, its ``dlq_id``, last ``error``, ``since``);
  ``P:dlq`` hash dlq id -> "<entry id> <model>"; ``P:dlq-models`` the models with one.
- ``P:resp:{tenant}:{id}`` hash (a stored response: its record, ``created_at``, ``depth``),
  expiring; ``P:resps:{tenant}`` sorted set by expiry on the server's clock;
  ``P:resp-sizes:{tenant}`` hash id -> bytes; ``P:resp-bytes:{tenant}`` their sum
  (``store_responses``).

Lua scripts build some keys from the prefix and the tenant or model they read (``Keys``
names them the same way): the store is one server (or a primary with replicas), not a Redis
Cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ballast.batch.records import LineKind
from ballast.errors import InvalidRequest

MAX_PAGE = 100  # items a list call returns at most (OpenAI's batches list allows 100)
CHUNK = 1000  # lines written or read per round trip when a batch is created or finalized


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

    def queue(self, model: str, tenant: str) -> str:
        # One stream per (model, tenant), so a claim can share the model among tenants. The
        # store is new with the Batch API and unreleased: no data was ever written under the
        # one stream per model it replaces (``P:q:{model}``), so nothing is migrated. A tenant
        # name holds no ':' (config), so the key names its model and its tenant unambiguously.
        return f"{self.prefix}:q:{model}:{tenant}"

    def queue_tenants(self, model: str) -> str:
        return f"{self.prefix}:q-tenants:{model}"

    def dlq(self, model: str) -> str:
        return f"{self.prefix}:dlq:{model}"

    def dlq_index(self) -> str:
        return f"{self.prefix}:dlq"

    def dlq_models(self) -> str:
        return f"{self.prefix}:dlq-models"

    def response(self, tenant: str, response_id: str) -> str:
        # A tenant name holds no ':' (config), so another tenant's key is never this one.
        return f"{self.prefix}:resp:{tenant}:{response_id}"

    def responses(self, tenant: str) -> str:
        return f"{self.prefix}:resps:{tenant}"

    def response_sizes(self, tenant: str) -> str:
        return f"{self.prefix}:resp-sizes:{tenant}"

    def response_bytes(self, tenant: str) -> str:
        return f"{self.prefix}:resp-bytes:{tenant}"


def line_field(custom_id: str | None, line: int) -> str:
    """A line's field in its batch's answer hashes and line order: its custom_id (unique in a
    batch), or its line number where it has none; prefixed so the two never meet."""
    return f"c:{custom_id}" if custom_id is not None else f"n:{line}"


def entry_ref(tenant: str, stream_id: str) -> str:
    """A queued line's id as its ``Delivery`` carries it: its tenant's stream and its entry id there."""
    return f"{tenant}/{stream_id}"


def entry_parts(entry_id: str) -> tuple[str, str]:
    """(tenant, stream entry id) of an ``entry_ref``; ValueError for an id the store never made."""
    tenant, sep, stream_id = entry_id.rpartition("/")
    if not sep or not tenant or not stream_id:
        raise ValueError(f"{entry_id!r} is not a queue entry id (<tenant>/<stream id>)")
    return tenant, stream_id


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def decoded(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    """A hash or stream entry's fields as text (the store writes only UTF-8 text in them)."""
    return {text(k): text(v) for k, v in (raw or {}).items()}


def texts(values: Iterable[Any]) -> list[str]:
    """Members or ids of a Redis reply as text."""
    return [text(v) for v in values]


def entries(raw: Any) -> list[tuple[str, dict[str, str]]]:
    """A stream reply's entries, (id, fields); an entry deleted under a pending claim
    (Redis 6.2 answers it as nil) is left out."""
    return [(text(eid), decoded(fields)) for eid, fields in raw or [] if eid is not None and fields is not None]


def int_or_none(value: str | None) -> int | None:
    return None if value is None or value == "" else int(float(value))


def page_limit(limit: int) -> int:
    """``limit``, when a page may hold it (1 to ``MAX_PAGE``); else InvalidRequest naming it."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be 1-{MAX_PAGE}", field="limit")
    return limit


async def read_page(
    r: Redis,
    index: str,
    record_key: Callable[[str], str],
    limit: int,
    after: str | None,
    keep: Callable[[dict[str, str]], bool] | None = None,
) -> tuple[list[dict[str, str]], bool]:
    """Up to ``limit`` records of the sorted set ``index``, newest first, after the id
    ``after``, those ``keep`` keeps; and whether more follow. Reads at most the index."""
    limit = page_limit(limit)
    start = 0
    if after is not None:
        rank = await r.zrevrank(index, after)
        if not isinstance(rank, int):
            raise InvalidRequest(f"after: {after!r} is not in this list", field="after")
        start = rank + 1
    found: list[dict[str, str]] = []
    while True:
        ids = texts(await r.zrevrange(index, start, start + MAX_PAGE - 1))
        if not ids:
            return found, False
        start += len(ids)
        async with r.pipeline(transaction=False) as pipe:
            for record_id in ids:
                pipe.hgetall(record_key(record_id))
            rows = [decoded(raw) for raw in await pipe.execute()]
        for h in rows:
            if h and (keep is None or keep(h)):
                found.append(h)
                if len(found) > limit:
                    return found[:limit], True
