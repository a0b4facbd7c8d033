"""What a replica's KV cache holds, as every router sees it: its prompt blocks, by hash chain.

An engine with prefix caching (vLLM) keeps the KV of full blocks of ``block_size`` tokens
and reuses a block for a later prompt that starts with the same tokens. Which replica a
request goes to therefore decides how much of its prompt is computed again. The replica
knows what its engine holds (vLLM publishes a ``BlockStored`` event for each block it
caches and a ``BlockRemoved`` for each it evicts); the routers know each request's
prompt ids. This module is the common language between the two.

**Block keys.** A prompt's blocks are keyed by a hash chain: the first block's key
hashes the adapter's name (the same tokens under another LoRA adapter are another KV),
the call's cache salt (its tenant's cache group, ``ballast.policies.cache_groups``: vLLM
mixes the same salt into its own first block, so two groups never share a block) and its
tokens, each next block's hashes the key before it and its tokens, so a key
stands for the whole prefix up to its block. Only full blocks count, as in vLLM. The
hash is BLAKE2b (the same in every process, unlike Python's ``hash``), reported in 32
bits: a router asks whether a replica holds a key, and a false yes (odds of the keys
held over 2**32 per block) costs one misrouted request, not a wrong answer.

**Replica side** (``PrefixHoldings``): fed the engine's events, it maps the engine's
block hashes to Ballast's keys (a stored block's key is its parent's key chained with
its tokens), in least-recently-stored order, bounded by the engine's block count (an
event lost on the way only leaves a key that ages out). ``report`` gives the most
recently stored keys, at most ``report_blocks``, as a ``PrefixReport`` that goes in the
routing stats Serve polls and broadcasts to every router: one view, from the replicas.

**Router side**: ``block_keys`` of a request's prompt, and ``matched_blocks``: how many
of its leading blocks a replica's report holds (``ballast.policies.affinity`` chooses).

Plain data: the caller passes the time. ``PrefixHoldings`` is not thread-safe: one owner.
"""

from __future__ import annotations

import hashlib
import math
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ballast.policies.validation import check_int, is_finite, is_int

#: The most blocks a report may carry (4 bytes each, 256 KiB): a report past it is refused.
MAX_REPORTED_BLOCKS = 1 << 16
#: How far ahead of a router's clock a report's stamp may be (clocks a little apart across
#: nodes) and still count: a report stamped later than that is not fresh, never fresh forever.
MAX_FUTURE_S = 5.0
#: The most leading blocks of one prompt a router hashes (a longer prompt's tail is not scored).
MAX_PROMPT_BLOCKS = 1024
_SEED = b"ballast-prefix-v1"
_MASK32 = 0xFFFFFFFF


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=8).digest()


def _root(adapter: str | None, salt: str | None = None) -> bytes:
    # Length-prefixed, so that no (adapter, salt) pair reads as another.
    a, s = (adapter or "").encode(), (salt or "").encode()
    return hashlib.blake2b(_SEED + struct.pack("<II", len(a), len(s)) + a + s, digest_size=8).digest()


def _key32(digest: bytes) -> int:
    return int.from_bytes(digest[:4], "little") & _MASK32


def block_keys(
    ids: Sequence[int],
    block_size: int,
    adapter: str | None = None,
    salt: str | None = None,
    limit: int = MAX_PROMPT_BLOCKS,
) -> list[int]:
    """The keys of the full blocks of ``ids`` (at most ``limit``) under ``adapter`` and the
    cache ``salt``, first block first."""
    check_int("block_size", block_size, minimum=1)
    keys, parent = [], _root(adapter, salt)
    for start in range(0, min(len(ids) // block_size, limit) * block_size, block_size):
        parent = _chain(parent, ids[start : start + block_size])
        keys.append(_key32(parent))
    return keys


def matched_blocks(keys: Sequence[int], held: frozenset[int]) -> int:
    """How many of ``keys``, from the first, ``held`` holds: the cached prefix in blocks."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


def home_score(key: int, replica_id: str) -> int:
    """Rendezvous hashing: the replica with the highest score for ``key`` is its home, the
    same on every router, and losing a replica moves only the keys whose home it was."""
    return int.from_bytes(hashlib.blake2b(f"{key}:{replica_id}".encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class PrefixReport:
    """One replica's cached blocks as it reports them (``as_stats``) and a router reads them
    (``of``): ``blocks``, the keys packed as little-endian uint32, most recent first."""

    blocks: bytes
    block_size: int
    at_s: float = 0.0
    held_blocks: int = field(default=0)  # how many the replica holds (the report may carry fewer)

    def as_stats(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "block_size": self.block_size, "at_s": self.at_s, "held": self.held_blocks}

    @classmethod
    def of(cls, stats: object) -> PrefixReport | None:
        """The report in a replica's routing stats entry; None when absent or malformed."""
        if not isinstance(stats, Mapping):
            return None
        blocks, block_size, at_s, held = (stats.get(k) for k in ("blocks", "block_size", "at_s", "held"))
        if not (isinstance(blocks, bytes) and len(blocks) % 4 == 0 and len(blocks) <= 4 * MAX_REPORTED_BLOCKS):
            return None
        if not (is_int(block_size) and 1 <= block_size <= 1 << 16 and is_finite(at_s)):
            return None
        if not (is_int(held) and held >= 0):
            return None
        return cls(blocks, block_size, float(at_s), held)

    @cached_property
    def keys(self) -> frozenset[int]:
        a = array("I")
        a.frombytes(self.blocks)
        if a.itemsize != 4:  # pragma: no cover - every platform Ray runs on has a 4-byte "I"
            raise RuntimeError("array('I') is not 4 bytes here")
        return frozenset(a)

    @property
    def count(self) -> int:
        return len(self.blocks) // 4

    def is_fresh(self, now_s: float, max_age_s: float) -> bool:
        """Stamped within ``max_age_s`` before ``now_s``, or at most ``MAX_FUTURE_S`` after it."""
        return -MAX_FUTURE_S <= now_s - self.at_s <= max_age_s


class PrefixHoldings:
    """One replica's mirror of the blocks its engine's prefix cache holds (module docstring)."""

    def __init__(self, capacity_blocks: int, block_size: int, report_blocks: int = 16384) -> None:
        check_int("capacity_blocks", capacity_blocks, minimum=1)
        check_int("block_size", block_size, minimum=1)
        check_int("report_blocks", report_blocks, minimum=1, maximum=MAX_REPORTED_BLOCKS)
        self.capacity_blocks, self.block_size, self.report_blocks = capacity_blocks, block_size, report_blocks
        # engine hash -> (the chain digest, its 32-bit key), least recently stored first
        self._held: OrderedDict[Any, tuple[bytes, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def stored(
        self,
        engine_hashes: Sequence[Any],
        parent: Any,
        token_ids: Sequence[int],
        adapter: str | None = None,
        salt: str | None = None,
    ) -> int:
        """Blocks the engine cached: ``engine_hashes`` in order, after the block ``parent``
        (None: they start a prompt, under ``adapter`` and the cache ``salt``), holding
        ``token_ids`` (``block_size`` each). A parent
        this mirror does not know (its event was lost, or it aged out) leaves the chain
        unknowable: nothing is added. Returns the blocks added."""
        if parent is None:
            digest = _root(adapter, salt)
        elif parent in self._held:
            digest = self._held[parent][0]
        else:
            return 0
        size, added = self.block_size, 0
        for i, h in enumerate(engine_hashes):
            tokens = token_ids[i * size : (i + 1) * size]
            if len(tokens) < size:
                break
            digest = _chain(digest, tokens)
            self._held[h] = (digest, _key32(digest))
            self._held.move_to_end(h)
            added += 1
        while len(self._held) > self.capacity_blocks:
            self._held.popitem(last=False)
        return added

    def removed(self, engine_hashes: Iterable[Any]) -> None:
        for h in engine_hashes:
            self._held.pop(h, None)

    def cleared(self) -> None:
        self._held.clear()

    def report(self, now_s: float) -> PrefixReport:
        """The most recently stored keys (at most ``report_blocks``), most recent first."""
        if not math.isfinite(now_s):
            raise ValueError(f"now_s must be finite, got {now_s!r}")
        keys = array("I")
        for _, key in reversed(self._held.values()):
            if len(keys) == self.report_blocks:
                break
            keys.append(key)
        return PrefixReport(keys.tobytes(), self.block_size, now_s, len(self._held))
