"""The rows one replica loop has in a vLLM engine: :class:`VLLMBatch`.

Every row is one vLLM request whose outputs (``DELTA``: the new token ids only) a task
on the engine loop appends to the row's buffer, setting an event the batch waits on, so
nothing polls. ``run_chunk`` submits the joins, then waits until every row that has
produced tokens has ``steps`` unread ones or has finished, bounded by ``max_wait_s``; a
row still queued in vLLM (no token yet) does not hold back the rows that have tokens to
hand over. A row's buffer holds at most its ``max_new_tokens`` ids. ``remove`` cancels
the row's task, which makes vLLM abort the request: its slot and KV blocks are free at
the engine's next step.

**One row's fault.** A request vLLM fails (its validation refusing the row's parameters
or prompt ids, or any error of that request alone) leaves the batch by itself and is
handed to the replica by ``take_failed`` (``EngineRefused`` when vLLM refused it as sent,
a 400 that is no model failure; ``VLLMRequestError`` otherwise); the other rows go on. A
dead engine (vLLM's ``EngineDeadError``: a rank or the engine core went away) fails no
row: the rows wait, the engine is told why (``RowEngine.engine_died``) and the replica
goes as a whole, its requests sent elsewhere (``ballast.model.server``).

**Log-probabilities.** A row whose join asks (``Join.logprobs`` / ``prompt_logprobs``) runs
with vLLM's ``SamplingParams(logprobs=k, prompt_logprobs=k)``: raw (vLLM's default
``logprobs_mode``, before any sampling rule). In ``DELTA`` mode each output's
``logprobs`` holds the positions of its new ids only, and ``prompt_logprobs`` comes once,
with the first tokens (vLLM's output processor pops them at the end of prefill; outputs
it merges for a slow reader keep the first one's). Each vLLM position (a dict of id:
``Logprob``, the chosen id plus the k of rank 1..k) becomes an ``IdLogprobs``; the row
keeps them beside its unread ids, so ``take_logprobs`` gives the last chunk's aligned
with the ids ``run_chunk`` returned. A row with ``max_new_tokens`` 0 asking its prompt's
runs with ``max_tokens`` 1 (vLLM refuses 0; its own server does the same for ``echo``),
greedy and without a grammar: that token is dropped, the row returns no id and leaves
with its prompt's log-probabilities. A k above the engine's ``max_logprobs`` is refused
alone (``check_logprobs``).

**Pooled rows.** On an embeddings engine (vLLM's pooling runner, ``RowEngine.pooling``) a
row whose join pools (``Join.pool``) is one ``AsyncLLM.encode`` request with vLLM's
``PoolingParams(task="embed")`` (``use_activation``: the join's ``normalize``;
``dimensions``: its cut, which vLLM allows only to a Matryoshka model); its one output's
``outputs.data`` is the vector (``take_embeddings``). Unlike the other engines' rows it may
take more than the chunk it joined: it is in ``run_chunk``'s answer (with no id) only in the
chunk its vector came, and a chunk ends as soon as one comes. A pooling engine refuses a row
that generates, and a generating engine one that pools, each alone (``EngineRefused``), as it
does a row asking another pooling than the engine's own (vLLM's pooler is set at start).

The batch sees its engine through :class:`RowEngine`, the public face of
``vllm_engine.VLLMBackend`` it needs, so this module does not import that one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ballast.errors import EngineRefused
from ballast.model.batching import check_context, check_joins, refuse_pool, vector_bytes
from ballast.model.protocol import GREEDY, IdLogprobs, Join, Pooling, RowLogprobs, RowSampling
from ballast.model.untyped import VLLMObject
from ballast.model.vllm_loop import CALL_SLACK_S, EngineLoop
from ballast.model.vllm_lora import LoRATable

__all__ = [
    "RowEngine",
    "VLLMBatch",
    "VLLMRequestError",
    "check_logprobs",
    "chunk_ready",
    "pooling_params",
    "position_logprobs",
    "sampling_params",
]

log = logging.getLogger("ballast.vllm")


class VLLMRequestError(RuntimeError):
    """vLLM failed a request of the batch alone (not its validation, not a dead engine)."""


class RowEngine(Protocol):
    """What a batch runs on: its engine's name, context, most log-probabilities per
    position and wait bound, the loop its ``AsyncLLM`` (``llm``) runs on, its adapters,
    and whom to tell that it died; on an embeddings engine its pooler's kind (``pooling``,
    ``Pooling.kind``; None: a generating engine) and its vectors' size."""

    name: str
    max_seq_len: int
    max_logprobs: int
    pooling: str | None
    hidden_size: int
    max_wait_s: float
    loop: EngineLoop
    lora: LoRATable

    @property
    def llm(self) -> VLLMObject:
        """vLLM's ``AsyncLLM``."""
        ...

    def engine_died(self, reason: str) -> None:
        """vLLM reported the engine dead (``reason``): it serves no more."""
        ...


class Row:
    """One row in the engine: its vLLM request id, how it samples, the ids it made that
    ``run_chunk`` has not returned yet (with their log-probabilities when it asked), and
    how it ended. ``prefill_only``: a row of no new token that asked its prompt's
    log-probabilities (its one id is dropped when the chunk returns). ``pool``: a pooled
    row's, whose ``vector`` comes with its one output."""

    __slots__ = (
        "key",
        "rid",
        "sampling",
        "adapter",
        "unread",
        "made",
        "finished",
        "error",
        "task",
        "cached",
        "logprobs",
        "prompt_logprobs",
        "prefill_only",
        "unread_logprobs",
        "prompt",
        "pool",
        "vector",
    )

    def __init__(
        self,
        key: Any,
        rid: str,
        sampling: RowSampling,
        adapter: str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        prefill_only: bool = False,
        pool: Pooling | None = None,
    ) -> None:
        self.key = key
        self.rid = rid
        self.sampling = sampling
        self.adapter = adapter
        self.cached: int | None = None  # prompt tokens vLLM took from its prefix cache (its first output)
        self.unread: list[int] = []  # ids not yet returned by run_chunk; at most max_new_tokens
        self.made = 0
        self.finished = False
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None
        self.logprobs = logprobs  # k asked for each new id (None: none)
        self.prompt_logprobs = prompt_logprobs  # k asked for each prompt position (None: none)
        self.prefill_only = prefill_only
        self.unread_logprobs: list[IdLogprobs] = []  # one per unread id when logprobs is asked
        self.prompt: tuple[IdLogprobs, ...] | None = None  # the prompt's, until a chunk returns them
        self.pool = pool
        self.vector: bytes | None = None  # a pooled row's, from its output

    @property
    def asks_logprobs(self) -> bool:
        return self.logprobs is not None or self.prompt_logprobs is not None

    def read(self, output: VLLMObject) -> None:
        """One vLLM output (``DELTA``) into the row: its new ids, their log-probabilities
        when asked, and the prompt's when this output carries them; a pooled row's output
        (vLLM's ``PoolingRequestOutput``) its vector."""
        if self.pool is not None:
            self.vector = vector_bytes(output.outputs.data)
            self.finished = self.finished or bool(output.finished)
            return
        completion = output.outputs[0]
        new = list(completion.token_ids)
        if self.cached is None and output.num_cached_tokens is not None:
            self.cached = output.num_cached_tokens
        if self.logprobs is not None:
            positions = completion.logprobs or ()
            if len(positions) != len(new):  # vLLM's contract: one position per new id
                raise VLLMRequestError(f"vLLM gave {len(positions)} log-probabilities for {len(new)} ids")
            self.unread_logprobs += [position_logprobs(i, p, self.logprobs) for i, p in zip(new, positions)]
        if self.prompt_logprobs is not None and output.prompt_logprobs:
            ids = output.prompt_token_ids
            k = self.prompt_logprobs
            # vLLM's first position is None (no context): ours start at the second.
            self.prompt = tuple(position_logprobs(ids[i], p, k) for i, p in enumerate(output.prompt_logprobs) if i)
        self.unread.extend(new)
        self.made += len(new)
        if output.finished:
            self.finished = True


def position_logprobs(token_id: int, position: Mapping[int, Any], k: int) -> IdLogprobs:
    """One vLLM position (id: ``Logprob``, holding ``token_id`` and the k likeliest of rank
    1..k; an id among both carries its rank among the k) as ``IdLogprobs``: ``token_id``'s
    logprob and the k of rank 1..k, likeliest first."""
    top = sorted(
        (lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None and 1 <= lp.rank <= k
    )
    return IdLogprobs(int(token_id), float(position[token_id].logprob), tuple((tid, float(v)) for _, tid, v in top))


def check_logprobs(logprobs: int | None, prompt_logprobs: int | None, max_logprobs: int, model: str) -> None:
    """``EngineRefused`` naming ``logprobs`` when a row asks more log-probabilities per
    position (for its new tokens or its prompt's) than the engine's ``max_logprobs``."""
    for k in (logprobs, prompt_logprobs):
        if k is not None and k > max_logprobs:
            raise EngineRefused(
                f"logprobs: model {model!r} gives at most {max_logprobs} log-probabilities per position "
                f"(its engine's max_logprobs), asked {k} (logprobs / top_logprobs)",
                field="logprobs",
            )


def chunk_ready(rows: Sequence[Row], steps: int) -> bool:
    """Whether a chunk can end: a row failed; a pooled row has its vector, or a row its first
    tokens (none returned yet: its time to first token is not held for a whole chunk, as
    vLLM's own server sends the first token when it comes); or every row with tokens has
    ``steps`` unread or finished (and at least one row has something)."""
    if not rows or any(r.error is not None or r.vector is not None for r in rows):
        return True
    if any(r.unread and r.made == len(r.unread) for r in rows):
        return True
    done = [r.finished or len(r.unread) >= steps for r in rows]
    if all(done):
        return True
    return any(done) and all(d for r, d in zip(rows, done) if r.made > 0)


def sampling_params(
    s: RowSampling, n: int, logprobs: int | None = None, prompt_logprobs: int | None = None
) -> VLLMObject:
    """vLLM's parameters for a row of ``n`` new tokens sampled as ``s``, with ``logprobs``
    (k for each new token, 0: the chosen one's only) and ``prompt_logprobs`` (k for each
    prompt position); None: none."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    return SamplingParams(
        max_tokens=n,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=int(s.top_k or 0),  # 0: every token
        seed=s.seed,
        min_tokens=min(int(s.min_tokens), n),
        ignore_eos=bool(s.ignore_eos),
        repetition_penalty=float(s.repetition_penalty),
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        logit_bias=dict(s.logit_bias) or None,
        structured_outputs=(
            StructuredOutputsParams(structural_tag=s.structural_tag)
            if s.structural_tag
            else StructuredOutputsParams(json=s.json_schema)
            if s.json_schema
            else None
        ),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,  # the replica decodes ids and names tokens itself
    )


def pooling_params(pool: Pooling) -> VLLMObject:
    """vLLM's parameters for a pooled row: an embedding, normalised as ``pool`` says, cut to
    its ``dimensions`` (None: the whole vector)."""
    from vllm import PoolingParams

    return PoolingParams(task="embed", use_activation=bool(pool.normalize), dimensions=pool.dimensions)


def row_error(row: Row, e: BaseException) -> BaseException:
    """What a row vLLM failed alone answers: ``EngineRefused`` when vLLM refused the request
    as sent (its validation: a client error, a ValueError), naming the schema's field when
    the row has one and vLLM blamed structured outputs; else ``VLLMRequestError``."""
    from vllm.exceptions import VLLMClientError

    if isinstance(e, (VLLMClientError, ValueError)):
        field = str(getattr(e, "parameter", None) or "prompt")
        if row.pool is not None and "dimensions" in str(e):
            field = "dimensions"
        if row.sampling.json_schema is not None and ("structured" in str(e) or "schema" in str(e)):
            field = row.sampling.json_schema_of
        return EngineRefused(f"{field}: vLLM refuses the request: {e}", field=field)
    return VLLMRequestError(f"vLLM failed request {row.rid}: {type(e).__name__}: {e}")


def engine_dead(e: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(e, EngineDeadError)


class VLLMBatch:
    """The rows one replica loop has in the engine (see the module docstring).

    ``run_chunk`` and ``remove`` have the contract of ``ballast.model.engine.Batch``; a
    row runs with its join's :class:`RowSampling` (None: greedy), its LoRA adapter (None:
    the base model) and its ``cache_salt`` (vLLM shares prefix blocks only among requests
    of one salt). One caller at a time; the state lives on the backend's engine loop and
    is only touched there.
    """

    def __init__(self, engine: RowEngine, prefix: str) -> None:
        self._engine = engine
        self._prefix = prefix
        self._rows: dict[Any, Row] = {}
        self._changed = asyncio.Event()  # created here, only waited on the engine loop
        self._failed: dict[Any, BaseException] = {}  # rows failed alone, until take_failed
        self._cached: dict[Any, int] = {}  # the last chunk's rows' cached prompt tokens
        self._logprobs: dict[Any, RowLogprobs] = {}  # the last chunk's, for the rows that asked
        self._vectors: dict[Any, bytes] = {}  # the last chunk's, for the pooled rows whose vector came

    def keys(self) -> list[Any]:
        return list(self._rows)

    def take_failed(self) -> dict[Any, BaseException]:
        """Rows vLLM failed alone since the last call, with their errors: ``EngineRefused``
        for a request vLLM refused as sent (its validation), ``VLLMRequestError`` for any
        other failure of that request. The other rows went on."""
        out, self._failed = self._failed, {}
        return out

    def cached_tokens(self, key: Any) -> int | None:
        """How many of the row's prompt tokens vLLM took from its prefix cache, for a row
        that had tokens in the last chunk; None when vLLM has not said."""
        return self._cached.get(key)

    def take_embeddings(self) -> dict[Any, bytes]:
        """The vectors that came in the last chunk, for its pooled rows (the module
        docstring), by key. Taken once."""
        out, self._vectors = self._vectors, {}
        return out

    def take_logprobs(self) -> dict[Any, RowLogprobs]:
        """The last chunk's log-probabilities for the rows that asked and had ids or their
        prompt's in it: ``tokens`` one per id ``run_chunk`` returned for the row, ``prompt``
        on the chunk of its first tokens (see the module docstring). Taken once."""
        out, self._logprobs = self._logprobs, {}
        return out

    def remove(self, keys: Sequence[Any] | set[Any]) -> None:
        """Abort these rows in vLLM and drop them."""
        gone = [self._rows.pop(k) for k in keys if k in self._rows]
        if gone:
            self._engine.loop.call(self._abort(gone), CALL_SLACK_S)

    def run_chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self._check(joins)
        return self._engine.loop.call(self._chunk(joins, steps), self._engine.max_wait_s + CALL_SLACK_S)

    # ------------------------------------------------------------------ internals

    def _check(self, joins: Sequence[Join]) -> None:
        """Raises before the chunk runs: not a Join, a key already in the batch, a row that
        does not fit the context (``ContextTooLong``)."""
        check_joins(joins, self._rows)
        check_context(joins, self._engine.max_seq_len)

    async def _chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        # A pooled row is answered in the chunk its vector comes (below), not the one it joined.
        out: dict[Any, list[int]] = {join.key: [] for join in joins if join.pool is None}
        for join in joins:
            if join.max_new_tokens > 0 or join.prompt_logprobs is not None or join.pool is not None:
                self._submit(join)
        for key in self._failed:
            out.pop(key, None)
        deadline = time.monotonic() + self._engine.max_wait_s
        while not self._ready(steps):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        failed = [(r, r.error) for r in self._rows.values() if r.error is not None]
        for row, error in failed:  # each alone: the other rows go on
            del self._rows[row.key]
            out.pop(row.key, None)
            self._failed[row.key] = row_error(row, error)
        await self._abort([row for row, _ in failed])
        self._cached, self._logprobs, self._vectors = {}, {}, {}
        for key, row in list(self._rows.items()):
            if row.pool is not None:
                if row.vector is not None:
                    self._vectors[key], out[key] = row.vector, []
                    del self._rows[key]
                elif row.finished:  # ended with no vector: this row's own failure
                    del self._rows[key]
                    self._failed[key] = VLLMRequestError(f"vLLM ended request {row.rid} with no vector")
                continue
            if row.unread and row.cached is not None:
                self._cached[key] = row.cached
            if row.asks_logprobs and (row.unread or row.prompt is not None):
                tokens = () if row.prefill_only else tuple(row.unread_logprobs)
                self._logprobs[key] = RowLogprobs(tokens, row.prompt)
            out[key] = [] if row.prefill_only else row.unread
            row.unread, row.unread_logprobs, row.prompt = [], [], None
            if row.finished:
                del self._rows[key]
        return out

    def _ready(self, steps: int) -> bool:
        return chunk_ready(list(self._rows.values()), steps)

    def _submit(self, join: Join) -> None:
        """``join`` into vLLM as a request of its own, or into ``take_failed`` when it is refused alone."""
        from vllm.exceptions import VLLMClientError

        llm = self._engine.llm
        key, adapter, salt = join.key, join.adapter, join.cache_salt
        refused = self._refuse_kind(join)
        if refused is not None:
            self._failed[key] = refused
            return
        prefill_only = join.max_new_tokens == 0 and join.pool is None  # asks its prompt's log-probabilities only
        # A prefill-only row's one token is dropped: greedy, no grammar, no penalty (least work).
        s = GREEDY if prefill_only or join.sampling is None else join.sampling
        logprobs = None if prefill_only else join.logprobs
        row = Row(key, f"{self._prefix}-{key}", s, adapter, logprobs, join.prompt_logprobs, prefill_only, join.pool)
        lora = self._engine.lora.request(adapter) if adapter is not None else self._engine.lora.base
        if adapter is not None and lora is None:  # removed (or never added): this row alone
            self._failed[key] = EngineRefused(
                f"model: adapter {adapter!r} is not loaded on model {self._engine.name!r}", field="model"
            )
            return
        try:
            check_logprobs(logprobs, join.prompt_logprobs, self._engine.max_logprobs, self._engine.name)
        except EngineRefused as e:
            self._failed[key] = e
            return
        try:
            if join.pool is not None:
                params = pooling_params(join.pool)
            else:
                params = sampling_params(s, max(join.max_new_tokens, 1), logprobs, join.prompt_logprobs)
            ids = [int(i) for i in join.ids]
            # vLLM's TokensPrompt, a TypedDict: built as the dict it is (its NotRequired keys
            # come from Python 3.11's typing, which a check at 3.10 reads as required).
            tokens: dict[str, Any] = {"prompt_token_ids": ids}
            if salt is not None:
                tokens["cache_salt"] = salt
            prompt = llm.renderer.render_cmpl([tokens])[0]
        except (VLLMClientError, ValueError) as e:  # this row's own: it fails alone
            self._failed[key] = row_error(row, e)
            return
        row.task = asyncio.get_running_loop().create_task(self._pump(row, prompt, params, lora, join.priority))
        self._rows[key] = row

    def _refuse_kind(self, join: Join) -> BaseException | None:
        """A join this engine cannot run at all, refused alone: a pooled row on a generating
        engine, a generating row on a pooling one, another pooling than the engine's, more
        dimensions than its vectors have."""
        name, pooling = self._engine.name, self._engine.pooling
        if join.pool is None and pooling is not None:
            return EngineRefused(f"model: {name!r} is an embeddings model; it generates no text", field="model")
        if join.pool is None:
            return None
        if pooling is None:
            return EngineRefused(f"model: {name!r} is not an embeddings model; it pools no rows", field="model")
        if join.pool.kind != pooling:
            return EngineRefused(
                f"model: {name!r} pools by {pooling!r} (its engine's pooler), row {join.key!r} asks {join.pool.kind!r}",
                field="model",
            )
        return refuse_pool(join, self._engine.hidden_size)

    async def _pump(self, row: Row, prompt: VLLMObject, params: VLLMObject, lora: VLLMObject, priority: int) -> None:
        """Append the request's new ids (a pooled row: its vector) to ``row`` as vLLM produces
        them (with the adapter's ``LoRARequest`` ``lora``, None: the base model; at
        ``priority``, the join's: vLLM's priority policy starts a lower value first among the
        requests waiting in it)."""
        llm = self._engine.llm
        run = llm.encode if row.pool is not None else llm.generate
        try:
            async for output in run(prompt, params, row.rid, lora_request=lora, priority=priority):
                row.read(output)
                self._changed.set()
        except asyncio.CancelledError:
            raise  # remove(): generate() aborts the request in vLLM on the way out
        except Exception as e:
            if engine_dead(e):  # the engine's fault, not the row's: held until the replica goes
                log.error("engine of %r is dead (%s): its rows wait for the replica to go", self._engine.name, e)
                self._engine.engine_died(f"{type(e).__name__}: {e}")
                return
            row.error = e
        row.finished = True
        self._changed.set()

    async def _abort(self, rows: Sequence[Row]) -> None:
        """Cancel the rows' tasks and wait for them: each one's abort has reached vLLM."""
        tasks = [r.task for r in rows if r.task is not None and not r.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
