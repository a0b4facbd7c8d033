"""The built-in engine's live batch: rows join and leave a KV-cached batch between chunks.

:class:`LiveBatch` is what a replica runs (``TorchDecoderBackend.open_batch``);
:class:`ReferenceDecode` is its no-cache reference, recomputing the whole batch
every step, which the cache must reproduce token for token. Both build their
prefill attention from the one :func:`_prefill_mask`, so a comparison between
them tests the cache and not two masks.

Invariants: a row's real tokens are a suffix of the cache's columns (left
padding), so its positions and its greedy output are the same alone or batched;
a join whose ids are not bytes is refused alone, before its prefill. A row that asked
for log-probabilities gets them from the logits its steps computed anyway
(``batching.ChunkLogprobs``): its tokens' from each step's last position, its prompt's
from the prefill's every position; a row with ``max_new_tokens`` 0 that asked for its
prompt's is prefilled for them alone and never joins the cache. A pooled row
(``Join.pool``) runs the decoder's hidden states (after its final norm) over its prompt, with
the chunk's other pooled rows as their own left-padded batch and no cache, is pooled over its
own positions (``batching.pool_rows``), and never joins the cache either. The engine
is a parameter here, seen through its public face (:class:`DecoderSteps`: one
forward, one draw, the cache's shape), so this module does not import
:mod:`ballast.model.builtin_engine`, which imports this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ballast.errors import EngineRefused
from ballast.model.batching import (
    ChunkLogprobs,
    check_context,
    check_joins,
    ids_by_row,
    left_pad,
    pool_rows,
    raw_logprobs,
    refuse_adapter,
    refuse_bad_ids,
    refuse_pool,
    rows_to_keep,
)
from ballast.model.builtin_decoder import BYTE_VOCAB_SIZE
from ballast.model.protocol import Join, RowLogprobs

__all__ = ["DecoderSteps", "LiveBatch", "ReferenceDecode"]


class DecoderSteps(Protocol):
    """What a live batch runs on: the built-in engine's public face for its steps
    (``builtin_engine.TorchDecoderBackend``)."""

    device: str
    max_seq_len: int
    hidden_size: int
    pools: bool  # whether ``hidden`` can run (a module that gives its hidden states)

    def forward(
        self, ids: Tensor, positions: Tensor, mask: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The decoder over ``ids`` [B, S] at ``positions`` [B, S], attending by ``mask``
        [B, S, T] to the cache ``k``, ``v`` and themselves: (logits, k, v), the cache grown by S."""
        ...

    def hidden(self, ids: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """The decoder's hidden states after its final norm [B, S, D] over ``ids`` [B, S],
        attending by ``mask`` [B, S, S] to themselves only."""
        ...

    def sample(self, logits: Tensor, gen: torch.Generator | None) -> Tensor:
        """One id per row from last-position logits [B, V] -> [B]."""
        ...

    def empty_kv_cache(self, rows: int) -> Tensor:
        """A KV cache of ``rows`` rows and no positions yet: [L, rows, H, 0, Dh]."""
        ...

    def left_padded(self, prompts: Sequence[Sequence[int]], extra: int = 0) -> tuple[Tensor, Tensor]:
        """(ids, valid) [B, P + extra]: prompts right-aligned in P columns, ``valid`` False on padding."""
        ...

    def sampler(self) -> torch.Generator | None:
        """A generator for one batch's draws, seeded from the engine's config; None when greedy."""
        ...


def _split_refused(
    joins: Sequence[Join], vocab_size: int, backend: DecoderSteps
) -> tuple[list[Join], dict[Any, BaseException]]:
    """The joins whose ids are all in the vocabulary, that name no adapter and pool (if
    they do) what ``backend`` can, and the others' refusals by key."""
    ok: list[Join] = []
    refused: dict[Any, BaseException] = {}
    for join in joins:
        why = refuse_adapter(join) or refuse_bad_ids(join.key, join.ids, vocab_size) or _refuse_pool(join, backend)
        if why is None:
            ok.append(join)
        else:
            refused[join.key] = why
    return ok, refused


def _refuse_pool(join: Join, backend: DecoderSteps) -> BaseException | None:
    if join.pool is None:
        return None
    if not backend.pools:
        return EngineRefused("model: this model's archive gives no hidden states to pool rows with", field="model")
    return refuse_pool(join, backend.hidden_size)


class LiveBatch:
    """Iteration-level ("continuous") batching: sequences join and leave between chunks.

    A request that arrives while others are generating joins at the next chunk
    instead of waiting for the whole batch to finish, and a finished sequence
    leaves at once instead of idling to the batch's longest member. That is what
    keeps a short request's latency independent of the long ones beside it.

    Layout: one KV cache ``[L, B, H, T, Dh]`` for the rows in the batch. Every row's
    real tokens are a *suffix* of the T columns (left padding, ``valid[b, j]``
    False on padding), and ``lengths[b]`` counts them, so a row's positions are
    the same alone or batched. Joining rows are prefilled on their own, then both
    caches are left-padded to a common width and stacked; leaving rows are
    dropped and columns no row uses are trimmed, so T never exceeds the longest
    row (≤ ``max_seq_len``). Each row also holds its last sampled token, not yet
    fed to the model; a decode step feeds it at position ``lengths[b]``.

    Greedy output of a row equals generating it alone. With temperature > 0 the
    draws come from one generator per batch, seeded once, so samples depend on
    what else is in the batch. A join whose ids are not bytes (0-255) is refused
    alone before its prefill and handed back by ``take_failed``; the other rows go
    on. Not thread-safe: one caller at a time (the replica's engine loop runs one
    chunk at a time in a worker thread).
    """

    def __init__(self, backend: DecoderSteps) -> None:
        self._backend = backend
        self._keys: list[Any] = []
        self._remaining: list[int] = []  # tokens each row still has to emit
        self._asks: list[int | None] = []  # each row's Join.logprobs
        dev = backend.device
        self._k = backend.empty_kv_cache(0)
        self._v = self._k
        self._valid = torch.zeros(0, 0, dtype=torch.bool, device=dev)
        self._lengths = torch.zeros(0, dtype=torch.long, device=dev)
        self._last = torch.zeros(0, dtype=torch.long, device=dev)
        self._gen = backend.sampler()
        self._failed: dict[Any, BaseException] = {}  # rows refused alone, until take_failed
        self._chunk_logprobs = ChunkLogprobs()  # the running chunk's
        self._logprobs: dict[Any, RowLogprobs] = {}  # the last chunk's, until take_logprobs
        self._vectors: dict[Any, bytes] = {}  # the last chunk's pooled rows', until take_embeddings

    @property
    def size(self) -> int:
        """Rows generating now."""
        return len(self._keys)

    @property
    def width(self) -> int:
        """Columns in the KV cache (the longest row)."""
        return int(self._valid.shape[1])

    def keys(self) -> list[Any]:
        return list(self._keys)

    def remove(self, keys: Sequence[Any] | set[Any]) -> None:
        """Drop these rows (cancelled, past their deadline); unknown keys are ignored."""
        keep = rows_to_keep(self._keys, keys)
        if keep is not None:
            self._select(keep)

    def run_chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        """Admit ``joins``, then up to ``steps`` tokens per row (``engine.Batch``); a join's
        sampling is the engine's config, whatever the row's own says.

        Returns the ids each row emitted in this chunk, for every row that was in
        the batch or joined (a joiner's first token comes from its prefill). Rows
        that emitted their last token have left the batch when this returns; a join
        with ``max_new_tokens`` 0 emits nothing and is prefilled only when it asked
        for its prompt's log-probabilities. Call under ``torch.inference_mode()``.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        check_joins(joins, self._keys)
        check_context(joins, self._backend.max_seq_len)
        admitted, refused = _split_refused(joins, BYTE_VOCAB_SIZE, self._backend)
        self._failed.update(refused)
        self._chunk_logprobs = ChunkLogprobs()
        emitted: list[tuple[list[Any], Tensor]] = []  # (rows, [B] ids) per forward
        if self._keys:
            emitted.append((list(self._keys), self._decode()))
        prefill = [join for join in admitted if join.max_new_tokens > 0 or join.prompt_logprobs is not None]
        if prefill:
            part = self._prefill(prefill)
            live = [i for i, join in enumerate(prefill) if join.max_new_tokens > 0]
            if live:
                first = part[-1] if len(live) == len(prefill) else part[-1][torch.tensor(live, device=part[-1].device)]
                emitted.append(([prefill[i].key for i in live], first))
            self._drop_finished()
            # A prefill-only row joins with nothing left to emit: the next line drops it.
            self._append(prefill, part)
        self._drop_finished()
        pooled = [join for join in admitted if join.pool is not None]
        self._vectors = self._pool(pooled) if pooled else {}
        for _ in range(steps - 1):
            if not self._keys:
                break
            emitted.append((list(self._keys), self._decode()))
            self._drop_finished()
        out = ids_by_row(emitted, {join.key: [] for join in admitted})
        self._logprobs = self._chunk_logprobs.rows(out)
        return out

    def take_failed(self) -> dict[Any, BaseException]:
        """Rows refused alone since the last call (a prompt id outside the vocabulary),
        with their errors; they never shared a step with the other rows."""
        out, self._failed = self._failed, {}
        return out

    def cached_tokens(self, key: Any) -> int | None:
        """None: the built-in engine keeps no prefix cache."""
        return None

    def take_embeddings(self) -> dict[Any, bytes]:
        """The last chunk's vectors of its pooled rows (``engine.Batch``), once: a second
        call before the next chunk gets none."""
        out, self._vectors = self._vectors, {}
        return out

    def take_logprobs(self) -> dict[Any, RowLogprobs]:
        """The last chunk's log-probabilities for the rows that asked (``engine.Batch``),
        once: a second call before the next chunk gets none."""
        out, self._logprobs = self._logprobs, {}
        return out

    # ------------------------------------------------------------------ internals

    def _decode(self) -> Tensor:
        """One decode step for every row: feed each row's last token; returns the new ones [B]."""
        dev = self._backend.device
        batch = len(self._keys)
        valid = torch.cat([self._valid, torch.ones(batch, 1, dtype=torch.bool, device=dev)], dim=1)
        logits, self._k, self._v = self._backend.forward(
            self._last[:, None], self._lengths[:, None], valid[:, None, :], self._k, self._v
        )
        self._valid = valid
        self._lengths = self._lengths + 1
        raw = raw_logprobs(logits[:, -1, :], self._asks)
        self._last = self._backend.sample(logits[:, -1, :], self._gen)
        self._chunk_logprobs.add_tokens(self._keys, raw, self._last)
        for i in range(batch):
            self._remaining[i] -= 1
        return self._last

    def _prefill(self, joins: list[Join]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Prefill new rows as their own left-padded batch: (k, v, valid, lengths, first ids).

        The forward gives every position's logits: a row asking for its prompt's
        log-probabilities reads its own columns (its prompt is their suffix, so column
        ``width - len + i`` predicts its id ``i + 1``); a row that emits and asked for its
        tokens' reads the last column's, as its first id is drawn from it."""
        backend = self._backend
        prompts = [join.ids for join in joins]
        ids, valid = backend.left_padded(prompts)
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        empty = backend.empty_kv_cache(len(prompts))
        logits, k, v = backend.forward(ids, positions, _prefill_mask(valid), empty, empty)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=backend.device)
        raw = raw_logprobs(logits[:, -1, :], [join.logprobs if join.max_new_tokens > 0 else None for join in joins])
        first = backend.sample(logits[:, -1, :], self._gen)
        self._chunk_logprobs.add_tokens([join.key for join in joins], raw, first)
        width = int(ids.shape[1])
        for b, join in enumerate(joins):
            if join.prompt_logprobs is not None:
                start = width - len(join.ids)
                self._chunk_logprobs.add_prompt(join.key, logits[b, start:], join.ids[1:], join.prompt_logprobs)
        return k, v, valid, lengths, first

    def _pool(self, joins: list[Join]) -> dict[Any, bytes]:
        """The pooled ``joins``' vectors: the decoder's hidden states over their prompts as
        their own left-padded batch (the prefill's mask and positions, so a row computes as it
        would alone), pooled over each row's own positions; nothing is cached."""
        backend = self._backend
        ids, valid = backend.left_padded([join.ids for join in joins])
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        hidden = backend.hidden(ids, positions, _prefill_mask(valid))
        pools = [join.pool for join in joins if join.pool is not None]
        return dict(zip((join.key for join in joins), pool_rows(hidden, [len(join.ids) for join in joins], pools)))

    def _append(self, joins: list[Join], part: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]) -> None:
        """Stack the prefilled rows of ``joins`` under the running ones; each has its
        ``max_new_tokens - 1`` left to emit (its first came from the prefill)."""
        k, v, valid, lengths, last = part
        width = max(self.width, int(valid.shape[1]))
        self._k = torch.cat([left_pad(self._k, width, 3), left_pad(k, width, 3)], dim=1)
        self._v = torch.cat([left_pad(self._v, width, 3), left_pad(v, width, 3)], dim=1)
        self._valid = torch.cat([left_pad(self._valid, width, 1), left_pad(valid, width, 1)], dim=0)
        self._lengths = torch.cat([self._lengths, lengths])
        self._last = torch.cat([self._last, last])
        self._keys += [join.key for join in joins]
        self._remaining += [join.max_new_tokens - 1 for join in joins]
        self._asks += [join.logprobs for join in joins]

    def _drop_finished(self) -> None:
        if any(r <= 0 for r in self._remaining):
            self._select([i for i, r in enumerate(self._remaining) if r > 0])

    def _select(self, keep: list[int]) -> None:
        """Keep these rows, then trim leading columns that no remaining row uses."""
        index = torch.tensor(keep, dtype=torch.long, device=self._backend.device)
        self._k = self._k.index_select(1, index)
        self._v = self._v.index_select(1, index)
        self._valid = self._valid.index_select(0, index)
        self._lengths = self._lengths.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._keys = [self._keys[i] for i in keep]
        self._remaining = [self._remaining[i] for i in keep]
        self._asks = [self._asks[i] for i in keep]
        used = self._valid.any(dim=0)
        start = int(used.long().argmax()) if bool(used.any()) else self.width
        if start:
            self._k = self._k[:, :, :, start:]
            self._v = self._v[:, :, :, start:]
            self._valid = self._valid[:, start:]


def _prefill_mask(valid: Tensor) -> Tensor:
    """[B, T, T]: causal, no padding keys, and the diagonal always open.

    The diagonal keeps padding queries from having an all-False row. torch
    2.13's CPU kernel returns zeros for such a row, but other SDPA kernels
    and versions return NaN, and a NaN in a padded row's K/V would poison
    real rows through 0 * NaN in the attention matmul. The padded rows'
    outputs are never used, so letting them see themselves costs nothing.
    """
    upto = valid.shape[1]
    dev = valid.device
    causal = torch.ones(upto, upto, dtype=torch.bool, device=dev).tril()
    mask = causal.unsqueeze(0) & valid[:, None, :]
    return mask | torch.eye(upto, dtype=torch.bool, device=dev).unsqueeze(0)


class ReferenceDecode:
    """The no-cache reference: every step recomputes the whole left-padded batch.

    Quadratic, for tests and debugging only (``use_cache=False``): it is what the
    live batch's KV cache must reproduce. Prompts are left-padded to a common
    width P; generated tokens fill columns P, P+1, ... for every row.
    """

    def __init__(self, backend: DecoderSteps, encoded: list[list[int]], total_steps: int) -> None:
        ids, valid = backend.left_padded(encoded, extra=total_steps)
        self.backend = backend
        self.width = max(len(e) for e in encoded)
        self.ids = ids
        self.key_valid = valid
        # Rows that already finished keep decoding (the batch runs to the longest
        # request) and could run past the position table; their output is
        # discarded, so clamping them is harmless.
        self.positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0, max=backend.max_seq_len - 1)
        self.gen = backend.sampler()

    def step(self, s: int) -> Tensor:
        """Recompute through decode step ``s`` (0 = prefill); the new token per row [B]."""
        upto = self.width + s
        b = self.backend
        empty = b.empty_kv_cache(self.ids.shape[0])
        logits, _, _ = b.forward(
            self.ids[:, :upto], self.positions[:, :upto], _prefill_mask(self.key_valid[:, :upto]), empty, empty
        )
        token = b.sample(logits[:, -1, :], self.gen)
        self.ids[:, upto] = token
        return token
