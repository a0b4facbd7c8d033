"""What the engines share: the ids a chunk's decode steps emitted per row, the rows a
batch keeps, left padding, how an engine describes itself and warms up, and the checks a
chunk's joins pass: all of them before it runs (``check_joins``, ``check_context``), and
each row's own before it shares a step with other rows (``refuse_adapter``,
``refuse_bad_ids``).

**One row's fault fails that row only.** A batch checks each join before it runs
(ids inside the vocabulary); a join that fails the check, and a row whose own step
fails later (its sampling, non-finite logits), leaves the batch alone and is handed
to the replica by ``take_failed`` with its error, while the other rows go on. What
is left to raise out of ``run_chunk`` is a fault of the step itself (a device out of
memory, a dead engine), which fails every row as before.

**Log-probabilities** (``ChunkLogprobs``) are raw: the ``log_softmax`` in float32 of the
logits the model gave, taken before any sampling rule touches them (temperature, a mask,
penalties), as vLLM's default ``logprobs_mode``; only the rows that asked are computed.

**Pooled vectors** (``pool_rows``) are what vLLM's pooler gives for the same hidden states:
the row's hidden states after the model's final norm pooled (LAST, MEAN or CLS over its
own positions), cut to ``dimensions``, then L2-normalised when asked (vLLM's
``EmbeddingPoolerHead`` cuts before it normalises), in float32, little-endian."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ballast.errors import EngineRefused
from ballast.model.hf_text import ContextTooLong
from ballast.model.protocol import IdLogprobs, Join, Pooling, RowLogprobs


class _Chunks(Protocol):
    def keys(self) -> list[Any]: ...

    def run_chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]: ...

    def take_logprobs(self) -> Any: ...


class _Encodes(Protocol):
    def encode(self, prompt: str, max_new_tokens: int, add_special_tokens: bool = True) -> list[int]: ...


class _Warms(Protocol):
    """What ``warm_up`` runs on: an engine's batches and its text side (``engine.ModelBackend``)."""

    max_seq_len: int

    @property
    def text(self) -> _Encodes: ...

    def open_batch(self) -> _Chunks: ...


def describe_engine(engine: Any) -> dict[str, Any]:
    """What every engine says of itself (``describe``): name, device, size, context, source."""
    return {
        "name": engine.name,
        "device": engine.device,
        "params": engine.parameter_count,
        "max_seq_len": engine.max_seq_len,
        "source": engine.source,
    }


def ids_by_row(steps: Sequence[tuple[list[Any], Tensor]], out: dict[Any, list[int]]) -> dict[Any, list[int]]:
    """``out`` with each decode step's ids appended to its row's list, ``steps`` being
    (the rows' keys, their new ids [B]) per step; one device->host copy for them all."""
    if steps:
        flat = torch.cat([ids for _, ids in steps]).tolist()
        i = 0
        for keys, _ in steps:
            for key in keys:
                out.setdefault(key, []).append(flat[i])
                i += 1
    return out


def rows_to_keep(row_keys: Sequence[Any], gone: Iterable[Any]) -> list[int] | None:
    """The indices of the rows whose key is not in ``gone``; None when no row goes."""
    dropped = set(gone)
    keep = [i for i, key in enumerate(row_keys) if key not in dropped]
    return keep if len(keep) != len(row_keys) else None


def left_pad(x: Tensor, width: int, dim: int) -> Tensor:
    """``x`` padded on the left along ``dim`` to ``width`` with zeros (False for masks)."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def check_joins(joins: Sequence[Join], keys: Iterable[Any]) -> None:
    """Raises unless every join is a :class:`Join` (TypeError) whose key is neither among
    ``keys`` (the rows in the batch) nor another join's (ValueError): before the chunk runs."""
    seen = set(keys)
    for join in joins:
        if not isinstance(join, Join):
            raise TypeError(f"a batch takes Join rows, got {type(join).__name__}")
        if join.key in seen:
            raise ValueError(f"key {join.key!r} is already in the batch")
        seen.add(join.key)


def check_context(joins: Sequence[Join], context: int) -> None:
    """ContextTooLong, before the chunk runs, for a join without prompt ids or whose ids and
    ``max_new_tokens`` together exceed the engine's ``context``."""
    for join in joins:
        if not join.ids or len(join.ids) + join.max_new_tokens > context:
            raise ContextTooLong(
                f"row {join.key!r}: {len(join.ids)} prompt ids + {join.max_new_tokens} new tokens must fit "
                f"the context of {context}"
            )


def warm_up(engine: _Warms, batch_sizes: Sequence[int], pool: Pooling | None = None) -> None:
    """Short generations at these batch sizes (with ``pool``, pooled rows instead), through a
    batch as the replica runs one: the allocator, the kernels and (on CUDA) the context are
    warm before the first request."""
    steps = max(1, min(4, engine.max_seq_len - 2))
    new = 0 if pool is not None else steps
    for n in batch_sizes:
        batch = engine.open_batch()
        batch.run_chunk([Join(i, engine.text.encode("Hello", steps), new, pool=pool) for i in range(n)], steps)
        while batch.keys():
            batch.run_chunk([], steps)
    # And a row asking log-probabilities, its tokens' and its prompt's: their first use is
    # a path of its own (vLLM's CPU build took 4.5 s for it, stalled long enough for the
    # watchdog to call the replica hung).
    batch = engine.open_batch()
    ids = engine.text.encode("Hello", steps)
    batch.run_chunk([Join("logprobs", ids, steps, logprobs=1, prompt_logprobs=1)], steps)
    while batch.keys():
        batch.run_chunk([], steps)
    batch.take_logprobs()


def refuse_adapter(join: Join) -> EngineRefused | None:
    """The refusal of a join that names a LoRA adapter on an engine that serves none (the
    built-in and Hugging Face ones); None when it names none."""
    if join.adapter is None:
        return None
    return EngineRefused(
        f"model: adapter {join.adapter!r} of row {join.key!r}: this engine serves no adapters", field="model"
    )


def refuse_bad_ids(key: Any, ids: Sequence[int], vocab_size: int) -> EngineRefused | None:
    """The refusal of a join whose prompt ids are not all in ``[0, vocab_size)`` (a resumed
    stream's ids come from the client's side); None when they are."""
    bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size), None)
    if bad is None:
        return None
    return EngineRefused(
        f"prompt: token id {bad!r} of row {key!r} is outside the vocabulary of {vocab_size}", field="prompt"
    )


def refuse_pool(join: Join, width: int) -> EngineRefused | None:
    """The refusal of a pooled join that asks more ``dimensions`` than the model's hidden
    ``width``; None for a join that pools within it or does not pool."""
    d = join.pool.dimensions if join.pool is not None else None
    if d is None or d <= width:
        return None
    return EngineRefused(
        f"dimensions: row {join.key!r} asks {d} dimensions; the model's vectors have {width}", field="dimensions"
    )


def pool_rows(hidden: Tensor, lengths: Sequence[int], pools: Sequence[Pooling]) -> list[bytes]:
    """One vector per row of ``hidden`` [B, W, D], the hidden states after the final norm of
    a left-padded batch whose row b holds its ``lengths[b]`` tokens in the last columns (its
    padding never read): pooled by ``pools[b]`` (the module docstring), as float32
    little-endian bytes."""
    import torch.nn.functional as F

    width = int(hidden.shape[1])
    out = []
    for b, (n, pool) in enumerate(zip(lengths, pools)):
        own = hidden[b, width - n :].float()
        vector = own[-1] if pool.kind == "last" else own[0] if pool.kind == "cls" else own.mean(dim=0)
        if pool.dimensions is not None:
            vector = vector[: pool.dimensions]
        if pool.normalize:
            vector = F.normalize(vector, p=2.0, dim=-1)
        out.append(vector_bytes(vector))
    return out


def vector_bytes(vector: Tensor) -> bytes:
    """A vector [D] as float32 little-endian bytes (``ModelChunk.embedding``)."""
    import numpy as np

    return np.asarray(vector.detach().float().cpu().numpy(), dtype="<f4").tobytes()


@dataclass(frozen=True)
class RawLogprobs:
    """One step's log-probabilities for the rows that asked: their indices in the step's
    batch (``index`` [n]), each row's k (``ks``), and ``log_softmax`` of their logits [n, V]."""

    index: Tensor
    ks: list[int]
    logprobs: Tensor


def raw_logprobs(logits: Tensor, asks: Sequence[int | None]) -> RawLogprobs | None:
    """The log-probabilities of the rows of ``logits`` [B, V] whose ask (``asks[b]``, their
    join's k) is not None, in float32; None, and nothing computed, when no row asked. Taken
    before the step's sampling rules, which may then change ``logits`` in place."""
    rows = [i for i, k in enumerate(asks) if k is not None]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, index).float()
    return RawLogprobs(index, [k for k in asks if k is not None], torch.log_softmax(picked, dim=-1))


class ChunkLogprobs:
    """What one chunk computed for the rows that asked, by key (``Batch.take_logprobs``).

    ``add_tokens`` records a step's chosen ids with their log-probabilities and each row's
    k likeliest, kept on the device; ``rows`` copies them to the host (once per step) when
    the chunk ends. ``add_prompt`` records a row's prompt positions, possibly in several
    pieces, in order. Bounded by the chunk: a batch starts a new one per chunk."""

    def __init__(self) -> None:
        # (the asking rows' keys, their ks, chosen ids [n], their logprobs [n], top values
        # [n, k], top ids [n, k]) per step, in the order the steps ran
        self._steps: list[tuple[list[Any], list[int], Tensor, Tensor, Tensor, Tensor]] = []
        self._prompt: dict[Any, list[IdLogprobs]] = {}

    def add_tokens(self, keys: Sequence[Any], raw: RawLogprobs | None, chosen: Tensor) -> None:
        """The step whose rows are ``keys`` chose ``chosen`` [B]; ``raw`` is its
        ``raw_logprobs`` (None: no row asked, nothing to record)."""
        if raw is None:
            return
        ids = chosen.index_select(0, raw.index)
        lp = raw.logprobs.gather(1, ids[:, None]).squeeze(1)
        top = raw.logprobs.topk(max(raw.ks), dim=-1)
        rows = [keys[i] for i in raw.index.tolist()]
        self._steps.append((rows, raw.ks, ids, lp, top.values, top.indices))

    def add_prompt(self, key: Any, logits: Tensor, targets: Sequence[int], k: int) -> None:
        """Prompt positions of row ``key``: ``logits`` [N, V] are the model's at N positions
        and ``targets`` the N prompt ids that follow each (logprob of ``targets[i]`` given the
        prompt up to it), with the ``k`` likeliest; appended to what the row has."""
        got = self._prompt.setdefault(key, [])
        if not targets:
            return
        lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        ids = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
        top_v, top_i = (t.tolist() for t in lp.topk(k, dim=-1)) if k else ([[]] * len(chosen), [[]] * len(chosen))
        got += [IdLogprobs(t, c, tuple(zip(i, v))) for t, c, i, v in zip(targets, chosen, top_i, top_v)]

    def rows(self, keep: Collection[Any]) -> dict[Any, RowLogprobs]:
        """Each row's log-probabilities, for the keys in ``keep`` (a failed row's are dropped
        with its ids): a row that asked prompt log-probabilities and prefilled in this chunk
        has ``prompt`` (empty for a one-token prompt)."""
        tokens: dict[Any, list[IdLogprobs]] = {}
        for keys, ks, ids, lp, top_v, top_i in self._steps:
            for key, k, t, c, vs, js in zip(keys, ks, ids.tolist(), lp.tolist(), top_v.tolist(), top_i.tolist()):
                tokens.setdefault(key, []).append(IdLogprobs(t, c, tuple(zip(js[:k], vs[:k]))))
        out = {key: RowLogprobs(tuple(ts), _prompt_of(self._prompt, key)) for key, ts in tokens.items()}
        for key, prompt in self._prompt.items():
            if key not in out:
                out[key] = RowLogprobs((), tuple(prompt))
        return {key: rl for key, rl in out.items() if key in keep}


def _prompt_of(prompts: dict[Any, list[IdLogprobs]], key: Any) -> tuple[IdLogprobs, ...] | None:
    got = prompts.get(key)
    return tuple(got) if got is not None else None
