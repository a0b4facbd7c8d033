"""vLLM's KV-cache events, read by the replica: what its engine's prefix cache holds.

With ``kv_events_config`` on, vLLM's scheduler (in its engine-core process) publishes a
``KVEventBatch`` on a ZeroMQ PUB socket after each step: ``BlockStored`` for each run of
full blocks it cached (their hashes, the parent block's hash, their token ids, the LoRA
adapter's name), ``BlockRemoved`` for blocks it evicted, ``AllBlocksCleared`` when it
reset its cache. ``KVEventFeed`` subscribes on a thread of its own, over an ``ipc://``
socket private to the replica (a file in a temporary directory, so replicas on one node
never share one), and keeps them as ``ballast.policies.prefix_cache.PrefixHoldings``
under a lock; the replica's event loop reads ``report`` for its routing stats.

Only the device tier counts (``medium`` GPU, or none): blocks an offloading connector
keeps in host memory are not what a prefill reuses for free. The zero adapter that base
rows run with on CPU with LoRA on (``BASE_ADAPTER``) is the base model's KV: it is keyed
as no adapter, as a router keys a call without one. A prompt's first block carries the
request's ``cache_salt`` (its tenant's cache group) among its ``extra_keys``, after the
adapter's name: it is keyed under that salt, as a router keys a call of that group.

vLLM symbols relied on: ``vllm.distributed.kv_events.KVEventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared`` (msgspec structs on a multipart message whose last
frame is the batch), and the engine argument ``kv_events_config`` (``enable_kv_cache_events``,
``publisher: zmq``, ``endpoint``, ``topic``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from typing import Any

from ballast.model.untyped import VLLMObject
from ballast.policies.prefix_cache import PrefixHoldings, PrefixReport

log = logging.getLogger(__name__)

TOPIC = "ballast-kv"
_POLL_MS = 200  # how often the reader looks at its stop flag while no event comes
_DEVICE_TIERS = (None, "GPU")


def events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` publishing on ``endpoint``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}


def feed_for(engine_kwargs: dict[str, Any], report_blocks: int | None, base_adapter: str) -> KVEventFeed | None:
    """A feed of the engine's KV-cache events when blocks are to be reported
    (``report_blocks``) and its prefix cache is on (``enable_prefix_caching`` in
    ``engine_kwargs``, Ballast's defaults included), its publisher added to
    ``engine_kwargs``; None otherwise, and where the operator configured vLLM's events for
    a consumer of their own (left as they are). ``base_adapter``: the zero adapter's name."""
    if report_blocks is None or not engine_kwargs.get("enable_prefix_caching"):
        return None
    if "kv_events_config" in engine_kwargs:
        log.info("engine_kwargs.kv_events_config is the operator's: no prefix report for the routers")
        return None
    feed = KVEventFeed(base_adapter=base_adapter)
    engine_kwargs["kv_events_config"] = events_config(feed.endpoint)
    return feed


def first_block_salt(event: VLLMObject) -> str | None:
    """The ``cache_salt`` a ``BlockStored`` event's first block was hashed with; None without one.

    vLLM publishes each block's extra keys untagged, in order: the LoRA adapter's name (when
    the request has one), multimodal ``(identifier, offset)`` pairs, the cache salt (first
    block only), prompt-embedding digests (bytes). Ballast sends no multimodal input or
    embeddings, so the salt is the one string after the adapter's name."""
    extra = getattr(event, "extra_keys", None)
    keys = list(extra[0] or ()) if extra else []
    if event.lora_name is not None and keys[:1] == [event.lora_name]:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), None)


class KVEventFeed:
    """The replica's subscriber to its engine's KV-cache events (module docstring).

    Made before the engine (``endpoint`` goes in its ``kv_events_config``), started once
    the engine has said its block size and count (``start``), closed with it."""

    def __init__(self, base_adapter: str | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="ballast-kv-")
        self.endpoint = f"ipc://{os.path.join(self._dir, 'events')}"
        self._base_adapter = base_adapter
        self._lock = threading.Lock()  # guards _holdings: the reader writes, the replica reads
        self._holdings: PrefixHoldings | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = 0  # batches read (the tests' and the operator's sign of life)

    def start(self, capacity_blocks: int, block_size: int, report_blocks: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._holdings = PrefixHoldings(capacity_blocks, block_size, report_blocks)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._thread = threading.Thread(target=self._read, args=(sock, decoder), name="kv-events", daemon=True)
        self._thread.start()

    def _read(self, sock: Any, decoder: VLLMObject) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
                try:
                    batch = decoder.decode(frames[-1])
                except Exception as e:  # a batch this version cannot read: skip it, keep reading
                    log.warning("kv events: a batch could not be read: %r", e)
                    continue
                self._apply(batch.events)
        finally:
            sock.close(0)

    def _apply(self, events: list[VLLMObject]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            self.events += 1
            held = self._holdings
            if held is None:
                return
            for e in events:
                if isinstance(e, BlockStored) and e.medium in _DEVICE_TIERS:
                    adapter = None if e.lora_name == self._base_adapter else e.lora_name
                    salt = first_block_salt(e) if e.parent_block_hash is None else None
                    held.stored(e.block_hashes, e.parent_block_hash, e.token_ids, adapter, salt)
                elif isinstance(e, BlockRemoved) and e.medium in _DEVICE_TIERS:
                    held.removed(e.block_hashes)
                elif isinstance(e, AllBlocksCleared):
                    held.cleared()

    def report(self, now_s: float) -> PrefixReport | None:
        """What the engine holds now; None before ``start``."""
        with self._lock:
            return self._holdings.report(now_s) if self._holdings is not None else None

    def held_blocks(self) -> int | None:
        """How many blocks the engine holds now; None before ``start``."""
        with self._lock:
            return len(self._holdings) if self._holdings is not None else None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _POLL_MS / 1000)
        shutil.rmtree(self._dir, ignore_errors=True)
