"""The Hugging Face engine: iteration-level batching over a transformers causal LM.

:func:`ballast.model.hf_checkpoint.load_checkpoint` gives a model and its tokenizer; this
module serves them the way the built-in model is served (``builtin_batch.LiveBatch``):
a request joins the running batch at the next chunk boundary and leaves it when
it is done, and the KV cache is kept across steps.

**Which batching path.** transformers 5 has its own continuous batching
(``generate_batch`` / ``ContinuousBatchingManager``, a paged cache), but it runs
its own thread and scheduler, takes whole requests rather than one step at a
time, and on CPU falls back to eager attention over the paged cache; the
replica needs to admit, drop and bound rows between steps itself (deadlines,
clients that leave, the KV budget, the level's batch limit). So the batch loop
here is the project's own, over the model's ``forward`` and a transformers
``DynamicCache``: the same loop on CPU and CUDA, and the model's own attention
kernels (SDPA; on CUDA not cuDNN's, see
:func:`~ballast.model.hf_checkpoint.attention_kernels`). ``make bench-model``
measures it against ``generate``.

**Layout.** One ``DynamicCache`` for the rows in the batch, ``[B, H_kv, W, D]``
per layer. Every row's real tokens are a suffix of the W columns (left padding,
``mask[b, j] == 0`` on padding), so with explicit position ids a row computes
the same alone or batched. Joining rows are prefilled as their own left-padded
batch, then both caches are left-padded to a common width and stacked; leaving
rows are dropped and columns no row uses any more are trimmed. Each row holds
its last sampled token, not yet fed to the model.

**Sampling** is per row: greedy at temperature 0, else temperature, top_k and
top_p with the row's own ``torch.Generator`` seeded from its ``seed``, so the same
seed gives the same text whatever else is in the batch. A row ends at its
``max_new_tokens`` or when it samples an end-of-sequence token (which is
emitted, so it is counted, and decodes to no text); with ``ignore_eos`` only at its
``max_new_tokens``; before ``min_tokens`` tokens it cannot pick one.
``protocol.RowSampling`` bounds what a request sends (a seed is an int64, a
temperature below ``GREEDY_BELOW_TEMPERATURE`` is greedy, NaN and infinities are refused).

**One row's fault.** A join whose ids are outside the vocabulary is refused before its
prefill; a row whose logits are not finite (``RowFailed``), or whose own draw fails
(``EngineRefused``; a distribution that is not finite never reaches ``multinomial``),
leaves the batch alone. :meth:`HFBatch.take_failed` hands those rows to the replica;
the other rows go on. An exception out of ``run_chunk`` is the step's own (the
forward pass) and fails the batch.

**Log-probabilities** (``take_logprobs``), for the rows that asked, come from the logits
each step computes anyway, before ``_pick`` applies any rule (``batching.ChunkLogprobs``).
A row that asks for its prompt's needs the logits of every prompt position, which the
shared prefill does not keep (``logits_to_keep=1``): that row is prefilled alone, in
pieces of at most ``prompt_logits_per_forward // vocab_size`` positions against its own
growing cache, each forward keeping all its positions' logits, so the memory it takes is
bounded by that many floats whatever the prompt's length; then it joins the batch as any
row does. A row with ``max_new_tokens`` 0 is prefilled only when it asks for its prompt's,
and leaves with no token.

**Pooled rows** (``Join.pool``, ``take_embeddings``) run the model's base (``base_model``:
the decoder without its LM head, whose ``last_hidden_state`` is after the final norm, what
vLLM's pooler reads of a ``*ForCausalLM`` converted to embed) over their prompts, as their
own left-padded batch without a cache, and are pooled over their own positions
(``batching.pool_rows``); they keep no KV and leave in the chunk they joined. A chunk
without such rows runs nothing for them.

**The KV budget.** A row reserves its whole context (prompt + max_new_tokens)
when it joins; :attr:`HFBatch.reserved_tokens` is what the replica bounds and
reports (``kv_cache_tokens``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ballast.model.batching import (
    ChunkLogprobs,
    check_context,
    check_joins,
    describe_engine,
    ids_by_row,
    left_pad,
    pool_rows,
    raw_logprobs,
    refuse_adapter,
    refuse_bad_ids,
    refuse_pool,
    rows_to_keep,
    warm_up,
)
from ballast.model.hf_checkpoint import LoadedModel, attention_kernels, tokenizer_id
from ballast.model.hf_text import TokenizerText
from ballast.model.protocol import GREEDY, Join, RowLogprobs, RowSampling

__all__ = ["HFBackend", "HFBatch", "RowFailed", "RowSampling"]


#: The most logits (floats) one forward of a prompt scored for its log-probabilities keeps
#: at once (128 MiB in float32): its positions per forward are this over the vocabulary.
PROMPT_LOGITS_PER_FORWARD = 1 << 25


class RowFailed(RuntimeError):
    """A step failed for one row alone (the model's logits for it are not finite): that
    row fails as a model failure, the other rows of the batch go on."""


class HFBackend:
    """A loaded Hugging Face causal LM, served with :class:`HFBatch`.

    Thread safety as the built-in backend: the module is only read; each batch
    is used by one thread at a time (the replica's engine loop).
    """

    engine_name = "transformers"  # its row in ballast.policies.engines.ENGINES
    lost: str | None = None  # it runs in the replica's own process: never lost apart from it

    def __init__(
        self, loaded: LoadedModel, *, name: str, prompt_logits_per_forward: int = PROMPT_LOGITS_PER_FORWARD
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        n = prompt_logits_per_forward
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"prompt_logits_per_forward must be an int >= 1, got {n!r}")
        self.name = name
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_seq_len = int(loaded.info.context_length)
        self.parameter_count = sum(p.numel() for p in self.model.parameters())
        self.eos_ids = frozenset(int(i) for i in loaded.eos_token_ids)
        self.source = str(loaded.info.path)
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0))
        self._logits_to_keep = "logits_to_keep" in _forward_parameters(self.model)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.hidden_size = int(self.model.get_input_embeddings().embedding_dim)
        # The decoder under the LM head, which pooled rows run (None: the model has no
        # separate base, and pools no rows).
        base = getattr(self.model, "base_model", None)
        self.base: Any = base if base is not None and base is not self.model else None
        # positions a prompt scored for its log-probabilities runs per forward (at least one)
        self.prompt_positions_per_forward = max(1, prompt_logits_per_forward // self.vocab_size)
        self.tokenizer_id = tokenizer_id(loaded.info.path)
        self.text = TokenizerText(self.tokenizer, self.max_seq_len)

    def engine_processes(self) -> tuple[tuple[int, str], ...]:
        """None of its own: it runs in the replica's process."""
        return ()

    async def check(self, sampling: RowSampling | None, tenant: str = "") -> RowSampling | None:
        """``sampling`` for this model (a top_k past the vocabulary is every token); the
        router refuses what this engine cannot honour."""
        return sampling.for_vocab(self.vocab_size) if sampling is not None else None

    # ------------------------------------------------------------------ batches

    def open_batch(self) -> HFBatch:
        return HFBatch(self)

    def warmup(self, batch_sizes: Sequence[int] = (1,)) -> None:
        """Short generations at these batch sizes (``batching.warm_up``)."""
        with torch.inference_mode():
            warm_up(self, batch_sizes)

    def describe(self) -> dict[str, Any]:
        return {
            **describe_engine(self),
            "backend": "transformers",
            "architecture": self.loaded.info.architecture,
            "dtype": str(self.loaded.dtype).replace("torch.", ""),
        }

    def generate_chunks(
        self, prompts: list[str], max_new_tokens: list[int], chunk_tokens: int = 4
    ) -> Iterator[list[str]]:
        """Every prompt joins at once; yields one text piece per prompt per chunk (ModelBackend)."""
        batch = self.open_batch()
        decoders = [self.text.stream_decoder() for _ in prompts]
        joins = [Join(i, self.text.encode(p, n), n) for i, (p, n) in enumerate(zip(prompts, max_new_tokens))]
        while joins or batch.size:
            with torch.inference_mode():
                out = batch.run_chunk(joins, chunk_tokens)
            joins = []
            live = set(batch.keys())
            yield [decoders[i].feed(out.get(i, []), final=i not in live) for i in range(len(prompts))]


def _forward_parameters(model: Any) -> frozenset[str]:
    import inspect

    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


class _Row:
    __slots__ = ("key", "remaining", "reserved", "sampling", "logprobs", "gen", "made")

    def __init__(
        self, key: Any, remaining: int, reserved: int, sampling: RowSampling, device: str, logprobs: int | None = None
    ) -> None:
        self.key = key
        self.remaining = remaining
        self.reserved = reserved
        self.sampling = sampling
        self.logprobs = logprobs  # its join's: k for each token it emits, None: none
        self.gen: torch.Generator | None = None
        self.made = 0  # tokens picked so far
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            self.gen = torch.Generator(device=device).manual_seed(seed)


class HFBatch:
    """The running batch of an :class:`HFBackend` (see the module docstring for its layout).

    ``run_chunk(joins, steps)`` has ``builtin_batch.LiveBatch``'s contract, each row
    sampled by its join's :class:`RowSampling` (None: greedy).
    Not thread-safe: one caller at a time, under ``torch.inference_mode()``.
    """

    def __init__(self, backend: HFBackend) -> None:
        self._b = backend
        self._rows: list[_Row] = []
        self._cache: Any = None  # transformers DynamicCache, None while empty
        dev = backend.device
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=dev)
        self._lengths = torch.zeros(0, dtype=torch.long, device=dev)
        self._last = torch.zeros(0, dtype=torch.long, device=dev)
        self._failed: dict[Any, BaseException] = {}  # rows failed alone, until take_failed
        self._chunk_logprobs = ChunkLogprobs()  # the running chunk's
        self._logprobs: dict[Any, RowLogprobs] = {}  # the last chunk's, until take_logprobs
        self._vectors: dict[Any, bytes] = {}  # the last chunk's pooled rows', until take_embeddings

    @property
    def size(self) -> int:
        return len(self._rows)

    def take_failed(self) -> dict[Any, BaseException]:
        """Rows that failed alone since the last call, with their errors: a join refused
        before its prefill (an id outside the vocabulary), a row whose own sampling failed
        or whose logits were not finite. They left the batch; the others went on."""
        out, self._failed = self._failed, {}
        return out

    def cached_tokens(self, key: Any) -> int | None:
        """None: the transformers engine keeps no prefix cache."""
        return None

    def take_embeddings(self) -> dict[Any, bytes]:
        """The last chunk's vectors of its pooled rows (``engine.Batch``), once: a second
        call before the next chunk gets none."""
        out, self._vectors = self._vectors, {}
        return out

    def take_logprobs(self) -> dict[Any, RowLogprobs]:
        """The last chunk's log-probabilities for the rows that asked (``engine.Batch``),
        once: a second call before the next chunk gets none. A row that failed has none."""
        out, self._logprobs = self._logprobs, {}
        return out

    @property
    def width(self) -> int:
        """Columns in the KV cache (the longest row's tokens so far)."""
        return int(self._mask.shape[1])

    @property
    def reserved_tokens(self) -> int:
        """Tokens the rows in the batch may reach: each row's prompt + max_new_tokens."""
        return sum(r.reserved for r in self._rows)

    def keys(self) -> list[Any]:
        return [r.key for r in self._rows]

    def remove(self, keys: Sequence[Any] | set[Any]) -> None:
        keep = rows_to_keep(self.keys(), keys)
        if keep is not None:
            self._select(keep)

    def run_chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        check_joins(joins, self.keys())
        check_context(joins, self._b.max_seq_len)
        admitted = []
        for join in joins:
            refused = (
                refuse_adapter(join)
                or refuse_bad_ids(join.key, join.ids, self._b.vocab_size)
                or self._refuse_pool(join)
            )
            if refused is not None:
                self._failed[join.key] = refused
            else:
                admitted.append(join)
        self._chunk_logprobs = ChunkLogprobs()
        emitted: list[tuple[list[Any], Tensor]] = []
        if self._rows:
            emitted.append((self.keys(), self._decode()))
        shared = [join for join in admitted if join.max_new_tokens > 0 and join.prompt_logprobs is None]
        if shared:
            emitted.append(self._prefill(shared))
        pooled = [join for join in admitted if join.pool is not None]
        self._vectors = self._pool(pooled) if pooled else {}
        for join in admitted:
            if join.prompt_logprobs is not None:
                alone = self._prefill_scored(join, join.prompt_logprobs)
                if alone is not None:
                    emitted.append(alone)
        self._drop_finished(emitted)
        for _ in range(steps - 1):
            if not self._rows:
                break
            emitted.append((self.keys(), self._decode()))
            self._drop_finished(emitted)
        out = ids_by_row(emitted, {join.key: [] for join in admitted})
        for key in self._failed:
            out.pop(key, None)  # a failed row's ids are not an answer
        self._logprobs = self._chunk_logprobs.rows(out)
        return out

    # ------------------------------------------------------------------ internals

    def _refuse_pool(self, join: Join) -> BaseException | None:
        """A pooled join's refusal: a model without a base to pool, or more dimensions than
        its hidden states have; None for a join this engine pools (or that does not pool)."""
        if join.pool is None:
            return None
        if self._b.base is None:
            from ballast.errors import EngineRefused

            return EngineRefused(f"model: {self._b.name!r} has no base model to pool rows with", field="model")
        return refuse_pool(join, self._b.hidden_size)

    def _pool(self, joins: list[Join]) -> dict[Any, bytes]:
        """The pooled ``joins``' vectors: their prompts through the model's base as their own
        left-padded batch (explicit positions, so a row computes as it would alone), no cache
        kept; pooled over each row's own positions."""
        ids, mask, positions = self._left_padded(joins)
        with attention_kernels(self._b.device):
            out = self._b.base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        lengths = [len(join.ids) for join in joins]
        pools = [join.pool for join in joins if join.pool is not None]
        return dict(zip((join.key for join in joins), pool_rows(out.last_hidden_state, lengths, pools)))

    def _row(self, join: Join) -> _Row:
        """A joining row: its first token comes from the prefill, and it reserves its whole context."""
        n = join.max_new_tokens
        sampling = join.sampling if join.sampling is not None else GREEDY
        return _Row(join.key, n - 1, len(join.ids) + n, sampling, self._b.device, join.logprobs)

    def _forward(
        self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any, every_position: bool = False
    ) -> Tensor:
        """The model's logits: the last position's [B, V], or with ``every_position`` each
        position's [B, S, V]."""
        kwargs = {"logits_to_keep": 0 if every_position else 1} if self._b._logits_to_keep else {}
        with attention_kernels(self._b.device):
            out = self._b.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                **kwargs,
            )
        logits: Tensor = out.logits if every_position else out.logits[:, -1, :]
        return logits

    def _decode(self) -> Tensor:
        """One step for every row: feed its last token; the new tokens [B]."""
        b = self.size
        mask = torch.cat([self._mask, torch.ones(b, 1, dtype=torch.long, device=self._b.device)], dim=1)
        logits = self._forward(self._last[:, None], mask, self._lengths[:, None], self._cache)
        self._mask = mask
        self._lengths = self._lengths + 1
        raw = raw_logprobs(logits, [r.logprobs for r in self._rows])
        self._last = self._pick(logits, self._rows)
        self._chunk_logprobs.add_tokens(self.keys(), raw, self._last)
        for r in self._rows:
            r.remaining -= 1
        return self._last

    def _prefill(self, joins: list[Join]) -> tuple[list[Any], Tensor]:
        """Prefill the joiners as their own left-padded batch, keeping the last position's
        logits, then stack them under the running rows: (their keys, their first ids)."""
        from ballast.model.untyped import transformers

        dev = self._b.device
        rows = [self._row(join) for join in joins]
        ids, mask, positions = self._left_padded(joins)
        cache = transformers().DynamicCache()  # its layers: one kind, keys and values
        logits = self._forward(ids, mask, positions, cache)
        lengths = torch.tensor([len(join.ids) for join in joins], dtype=torch.long, device=dev)
        return [r.key for r in rows], self._stack(rows, logits, cache, mask, lengths)

    def _left_padded(self, joins: list[Join]) -> tuple[Tensor, Tensor, Tensor]:
        """The joins' prompts right-aligned in one batch: (ids, mask, positions) [B, W],
        ``mask`` 0 on padding, each row's positions counting from 0 at its first id."""
        dev = self._b.device
        width = max(len(join.ids) for join in joins)
        ids = torch.full((len(joins), width), self._b._pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros(len(joins), width, dtype=torch.long, device=dev)
        for i, join in enumerate(joins):
            ids[i, width - len(join.ids) :] = torch.tensor(join.ids, dtype=torch.long, device=dev)
            mask[i, width - len(join.ids) :] = 1
        return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)

    def _prefill_scored(self, join: Join, k: int) -> tuple[list[Any], Tensor] | None:
        """Prefill a row that asked for its prompt's log-probabilities (with the ``k``
        likeliest) alone, in pieces of ``prompt_positions_per_forward`` positions each keeping
        every position's logits (position i's give the logprob of prompt id i + 1); then it
        joins the running rows, unless it has no token to emit: (its key, its first id), or
        None. Its cache lives only as long as this call when it does not join."""
        from ballast.model.untyped import transformers

        dev = self._b.device
        prompt = torch.tensor([join.ids], dtype=torch.long, device=dev)
        n = len(join.ids)
        cache = transformers().DynamicCache()
        step = self._b.prompt_positions_per_forward
        for start in range(0, n, step):
            end = min(n, start + step)
            positions = torch.arange(start, end, dtype=torch.long, device=dev)[None]
            mask = torch.ones(1, end, dtype=torch.long, device=dev)
            logits = self._forward(prompt[:, start:end], mask, positions, cache, every_position=True)
            self._chunk_logprobs.add_prompt(join.key, logits[0], join.ids[start + 1 : end + 1], k)
        if join.max_new_tokens == 0:
            return None
        row = self._row(join)
        lengths = torch.tensor([n], dtype=torch.long, device=dev)
        return [row.key], self._stack(
            [row], logits[:, -1, :], cache, torch.ones(1, n, dtype=torch.long, device=dev), lengths
        )

    def _stack(self, rows: list[_Row], logits: Tensor, cache: Any, mask: Tensor, lengths: Tensor) -> Tensor:
        """Pick the prefilled ``rows``' first ids from their last position's ``logits`` [B, V],
        then stack their ``cache`` (``mask``, ``lengths``) under the running rows' (both left
        padded to the wider); their first ids."""
        raw = raw_logprobs(logits, [r.logprobs for r in rows])
        first = self._pick(logits, rows)
        self._chunk_logprobs.add_tokens([r.key for r in rows], raw, first)
        width = int(mask.shape[1])
        if not self._rows:
            self._cache, self._mask, self._lengths, self._last = cache, mask, lengths, first
        else:
            w = max(self.width, width)
            for mine, theirs in zip(self._cache.layers, cache.layers):
                mine.keys = torch.cat([left_pad(mine.keys, w, 2), left_pad(theirs.keys, w, 2)], dim=0)
                mine.values = torch.cat([left_pad(mine.values, w, 2), left_pad(theirs.values, w, 2)], dim=0)
            self._mask = torch.cat([left_pad(self._mask, w, 1), left_pad(mask, w, 1)], dim=0)
            self._lengths = torch.cat([self._lengths, lengths])
            self._last = torch.cat([self._last, first])
        self._rows += rows
        return first

    def _pick(self, logits: Tensor, rows: Sequence[_Row]) -> Tensor:
        """One id per row from last-position logits [B, V]: argmax, or the row's own draw;
        end-of-sequence ids are out of reach of a row short of its ``min_tokens``.

        A row fails alone here (``_fail``; it leaves at the next ``_drop_finished``) when
        its logits are not finite (``RowFailed``: the model's fault), or when its own draw
        raises (``EngineRefused``: its parameters). The finite check runs before any draw,
        so ``multinomial`` never sees a NaN (on CUDA a device assert, fatal to the
        process)."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # one device->host copy per step
        for i, r in enumerate(rows):
            if r.made < r.sampling.min_tokens and self._b.eos_ids:
                logits[i, list(self._b.eos_ids)] = float("-inf")
            r.made += 1
        picked = logits.argmax(dim=-1)
        for i, r in enumerate(rows):
            if not finite[i]:
                self._fail(r, RowFailed(f"row {r.key!r}: the model's logits are not finite"))
                continue
            if r.gen is None:
                continue
            try:
                picked[i] = _draw(logits[i], r)
            except (RuntimeError, ValueError) as e:
                from ballast.errors import EngineRefused

                self._fail(
                    r, EngineRefused(f"temperature: sampling failed for these parameters: {e}", field="temperature")
                )
        return picked

    def _fail(self, row: _Row, error: BaseException) -> None:
        """``row`` fails alone: it leaves the batch at the next ``_drop_finished``."""
        self._failed[row.key] = error
        row.remaining = 0

    def _drop_finished(self, emitted: list[tuple[list[Any], Tensor]]) -> None:
        """Rows out of tokens, or whose last token was an end-of-sequence, leave now."""
        eos = self._b.eos_ids
        if eos and self._rows:
            last = self._last.tolist()
            for r, tok in zip(self._rows, last):
                if tok in eos and not r.sampling.ignore_eos:
                    r.remaining = 0
        if any(r.remaining <= 0 for r in self._rows):
            self._select([i for i, r in enumerate(self._rows) if r.remaining > 0])

    def _select(self, keep: list[int]) -> None:
        """Keep these rows, then trim leading columns no remaining row uses."""
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._cache = None
            dev = self._b.device
            self._mask = torch.zeros(0, 0, dtype=torch.long, device=dev)
            self._lengths = torch.zeros(0, dtype=torch.long, device=dev)
            self._last = torch.zeros(0, dtype=torch.long, device=dev)
            return
        index = torch.tensor(keep, dtype=torch.long, device=self._b.device)
        self._mask = self._mask.index_select(0, index)
        self._lengths = self._lengths.index_select(0, index)
        self._last = self._last.index_select(0, index)
        used = self._mask.any(dim=0)
        start = int(used.long().argmax())
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self._mask = self._mask[:, start:]


def _draw(logits: Tensor, r: _Row) -> Tensor:
    """The row's own draw from its logits [V]: top_k, temperature, top_p, its generator."""
    scores = logits.float()
    if r.sampling.top_k is not None and r.sampling.top_k < scores.shape[-1]:
        scores = _top_k(scores, r.sampling.top_k)
    probs = torch.softmax(scores / r.sampling.temperature, dim=-1)
    if r.sampling.top_p < 1.0:
        probs = _top_p(probs, r.sampling.top_p)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:  # never a NaN into multinomial
        raise ValueError(f"no distribution to draw from (temperature {r.sampling.temperature!r})")
    return torch.multinomial(probs, 1, generator=r.gen)[0]


def _top_k(scores: Tensor, k: int) -> Tensor:
    """``scores`` with all but the ``k`` highest set to -inf."""
    kth = torch.topk(scores, k).values[-1]
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(probs: Tensor, top_p: float) -> Tensor:
    """``probs`` with the tail beyond the smallest set of mass >= top_p zeroed (renormalised by multinomial)."""
    sorted_p, order = probs.sort(descending=True)
    outside = sorted_p.cumsum(dim=-1) - sorted_p >= top_p  # the first token always stays
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
