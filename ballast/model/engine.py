"""Where an engine is plugged in: the interface the model replica calls, and
``build_engine``, which turns ``model.backend`` into an engine.

An engine turns prompts into token ids and runs batches: its text side (``text``,
one object each engine holds: ``hf_text.TokenizerText`` for the transformers and vLLM
engines, ``builtin_engine.ByteText`` for the built-in one) ``tokenize``s a prompt (the
router tokenizes it with the same function, so a replica whose ``tokenizer_id`` is
the call's takes the router's ids as they are) and ``fit``s the ids to the context;
then ``open_batch``, and the replica's loop (``replica_loop.py``) drives the batch a chunk
at a time with the rows the scheduler (``ballast/policies/scheduler.py``) admits, each
handed over as one ``protocol.Join``. Three engines exist:

- ``builtin``: ``builtin_engine.TorchDecoderBackend``, a random-weight byte-level
  decoder built from a seed (no download, the cost profile of a real decoder);
- ``transformers``: ``hf_engine.HFBackend`` over a local Hugging Face directory
  (``hf_checkpoint.load_checkpoint``), with its tokenizer and chat template;
- ``vllm``: ``vllm_engine.VLLMBackend``, the same kind of directory served by vLLM, which
  batches and manages its KV cache itself: the replica only bounds how many rows are in
  the engine and aborts the ones that leave.

What an engine does beyond that is its row in the engine table
(``ballast.policies.engines.ENGINES``, named by ``ModelBackend.engine_name``), never a
method looked up on the object: an engine whose row says it serves LoRA adapters
(``Engine.lora``) implements ``ServesLoRA``, one that reports its prefix cache's blocks
(``Engine.prefix_events``) ``ReportsPrefix``, one that schedules itself
(``Engine.self_scheduling``) ``SchedulesItself``; the replica reaches each through
``serving_lora``, ``reporting_prefix`` and ``scheduling_itself``, which read the row.

A new engine implements ``ModelBackend`` (and its ``TextSide``, ``Batch`` and ``StreamDecoder``),
the faces its row claims, and gets a branch in ``build_engine``; a directory it cannot load
fails there, at the replica's start, with a ``ModelLoadError`` naming the file and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast, runtime_checkable

from ballast.errors import ModelLoadError  # what a directory an engine cannot load raises
from ballast.model.protocol import Join, RowLogprobs
from ballast.model.vllm_stats import VLLMStats
from ballast.policies.engines import capabilities
from ballast.policies.prefix_cache import PrefixReport

__all__ = [
    "Batch",
    "ModelBackend",
    "ModelLoadError",
    "ReportsPrefix",
    "SchedulesItself",
    "ServesLoRA",
    "StreamDecoder",
    "TextSide",
    "build_engine",
    "reporting_prefix",
    "scheduling_itself",
    "serving_lora",
]


class StreamDecoder(Protocol):
    """Token ids to text as they come, holding back what is not yet whole."""

    def feed(self, token_ids: Sequence[int], final: bool = False) -> str: ...


class TextSide(Protocol):
    """An engine's text side: prompts to token ids within its context, ids back to text."""

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, by the function the router uses for this tokenizer
        (``special_tokens.encode_bytes`` / ``encode_text``)."""
        ...

    def fit(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], int]:
        """A row's prompt ids and max new tokens within the context: max_new_tokens is
        shortened to what the context leaves, never lengthened; the built-in engine keeps
        the prompt's end, the others refuse a prompt that leaves no room
        (``hf_text.ContextTooLong``)."""
        ...

    def encode(self, prompt: str, max_new_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """``tokenize`` for a row that must fit whole with ``max_new_tokens`` (warm-up's and
        the benchmarks' joins)."""
        ...

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id as the text a log-probability names it by, alone (vLLM's
        ``convert_ids_list_to_tokens``: the token decoded by itself, special tokens kept)."""
        ...

    def stream_decoder(self, keep_special_tokens: bool = False) -> StreamDecoder:
        """Text for one row's ids, piece by piece; ``keep_special_tokens``: their text too."""
        ...


class Batch(Protocol):
    """One live batch the replica's engine loop drives a chunk at a time."""

    def keys(self) -> list[Any]:
        """The rows in the batch."""
        ...

    def remove(self, keys: Sequence[Any] | set[Any]) -> None:
        """Rows that leave before the next chunk."""
        ...

    def run_chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        """Admit ``joins`` (a TypeError for anything but a ``Join``, a ValueError for a
        key already in the batch, and the engine's own error for a row that does not fit
        its context: the chunk does not run), then up to ``steps`` tokens per row; the ids
        each row emitted. What it raises is a fault of the step itself, and fails every
        row; a row's own fault (an id outside the vocabulary, an adapter the engine does
        not serve, its own draw) is in ``take_failed``."""
        ...

    def take_failed(self) -> dict[Any, BaseException]:
        """Rows that failed alone since the last call (refused at their join, or their own
        step failed), with the error each request gets; they have left the batch, the
        other rows went on."""
        ...

    def cached_tokens(self, key: Any) -> int | None:
        """How many of the row's prompt tokens its engine took from a prefix cache, for a
        row that had tokens in the last chunk; None for an engine without one."""
        ...

    def take_embeddings(self) -> dict[Any, bytes]:
        """The vectors the last chunk pooled, for the rows whose join asked (``Join.pool``),
        by key: float32, little-endian. Such a row leaves in the chunk its vector comes in
        (the chunk it joined on the engines Ballast batches; vLLM's may come later), and
        ``run_chunk`` gives it no id."""
        ...

    def take_logprobs(self) -> dict[Any, RowLogprobs]:
        """The log-probabilities the last chunk computed, for the rows whose join asked
        (``Join.logprobs`` / ``Join.prompt_logprobs``), by key; empty when none asked. A
        row's ``tokens`` are aligned with the ids ``run_chunk`` returned for it."""
        ...


@runtime_checkable
class ModelBackend(Protocol):
    """What the model replica (``replica_loop.py``, ``server.py``) calls on an engine: the
    built-in decoder (``builtin_engine.TorchDecoderBackend``), the Hugging Face one
    (``hf_engine.HFBackend``) and vLLM (``vllm_engine.VLLMBackend``)."""

    name: str
    device: str  # "cpu" or "cuda:N"
    max_seq_len: int
    vocab_size: int
    eos_ids: frozenset[int]

    @property
    def engine_name(self) -> str:
        """Its row in ``ballast.policies.engines.ENGINES`` (``model.backend``): what it does itself."""
        ...

    @property
    def lost(self) -> str | None:
        """Why the engine can serve no more (a rank or its core went away); None while it
        serves, and always for an engine in the replica's own process."""
        ...

    def engine_processes(self) -> tuple[tuple[int, str], ...]:
        """(pid, name) of the engine's own processes, for the replica's watchdog to watch by
        name; none for an engine in the replica's own process."""
        ...

    @property
    def text(self) -> TextSide:
        """Its text side, held for its life: the replica tokenizes, fits and decodes with it."""
        ...

    @property
    def tokenizer_id(self) -> str:
        """Whose token ids this engine takes (``protocol.ModelCall.tokenizer``): a call whose
        ids are this tokenizer's is not tokenized again."""
        ...

    async def check(self, sampling: Any, tenant: str = "") -> Any:
        """``sampling`` as this engine runs it (a top_k past the vocabulary is every token),
        or ``ballast.errors.EngineRefused`` / ``SchemaTooComplex`` for a request this
        engine refuses as sent: before it joins a batch, so that it fails alone, and
        without blocking the event loop; the router refuses what an engine cannot honour
        at all. ``tenant``: whose request it is (what the engine shares among tenants)."""
        ...

    def open_batch(self) -> Batch: ...

    def warmup(self, batch_sizes: Sequence[int] = (1,)) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class ServesLoRA(Protocol):
    """An engine whose row says ``lora``: the LoRA adapters it serves beside the base model."""

    @property
    def lora_slots(self) -> int:
        """Adapters it keeps in its batch slots at once; 0 with LoRA off."""
        ...

    def serves_adapter(self, name: str) -> bool: ...

    def adapters(self) -> dict[str, str]:
        """The adapters served, by name: their directories."""
        ...

    def add_adapter(self, name: str, path: str) -> None:
        """Serve the adapter in the local directory ``path`` as ``name`` (blocking; AdapterRefused
        with the reason for what the engine refuses)."""
        ...

    def remove_adapter(self, name: str) -> bool:
        """Stop serving ``name``; False when it was not loaded."""
        ...


class ReportsPrefix(Protocol):
    """An engine whose row says ``prefix_events``: the blocks its prefix cache holds."""

    def prefix_report(self, now_s: float) -> PrefixReport | None:
        """The blocks held, for prefix-aware routing; None while it reports none (the feed off)."""
        ...

    def prefix_blocks(self) -> int | None:
        """How many blocks it holds; None while it reports none."""
        ...


class SchedulesItself(Protocol):
    """An engine whose row says ``self_scheduling``: its own view of the rows it holds."""

    def stats(self) -> VLLMStats: ...


def serving_lora(engine: ModelBackend) -> ServesLoRA | None:
    """``engine``'s LoRA face where its row says it serves adapters; None otherwise."""
    return cast(ServesLoRA, engine) if capabilities(engine.engine_name).lora else None


def reporting_prefix(engine: ModelBackend) -> ReportsPrefix | None:
    """``engine``'s prefix-cache face where its row says it reports prefix events; None otherwise."""
    return cast(ReportsPrefix, engine) if capabilities(engine.engine_name).prefix_events else None


def scheduling_itself(engine: ModelBackend) -> SchedulesItself | None:
    """``engine``'s own scheduler's face where its row says it schedules itself; None otherwise."""
    return cast(SchedulesItself, engine) if capabilities(engine.engine_name).self_scheduling else None


def build_engine(m: Any, placement: Any = None) -> ModelBackend:
    """The engine the model config ``m`` names, loaded on its device; a vLLM model of several
    ranks runs them as its ``placement`` (``ballast.policies.placement.Placement``) says.

    An embeddings model (``kind: embed``) runs on vLLM's pooling runner with a pooler as
    ``model.embed`` says (``vllm_args.pooling_engine_kwargs``); the transformers and built-in
    engines pool any row that asks (``Join.pool``), and one that cannot give its hidden states
    (a transformers model without a separate base, a built-in archive scripted without
    ``hidden``) is a ``ModelLoadError`` for such a model."""
    embed = getattr(m, "kind", "generate") == "embed"
    if m.backend == "vllm":
        from ballast.model.ranks import with_executor
        from ballast.model.vllm_engine import VLLMBackend, default_engine_kwargs

        # LoRA: name -> local directory (a ``models`` entry's adapters are {path, tenants}).
        adapters = {n: getattr(a, "path", a) for n, a in (getattr(m, "adapters", None) or {}).items()}
        kwargs = with_executor(m.engine_kwargs, placement)
        if getattr(m, "reasoning_parser", None):  # the engine's grammar waits for the thinking to end
            kwargs = {"reasoning_parser": m.reasoning_parser, **kwargs}
        if embed:
            from ballast.model.vllm_args import pooling_engine_kwargs

            kwargs = pooling_engine_kwargs(kwargs, m.embed.pooling, m.embed.normalize, m.embed.dimensions)
        return VLLMBackend(
            m.path,
            name=m.name,
            engine_kwargs=default_engine_kwargs(m.path, kwargs, m.max_batch_size, adapters),
            grammar_compile_timeout_s=m.grammar_compile_timeout_s,
            grammar_compile_threads=m.grammar_compile_threads,
            adapters=adapters,
            prefix_report_blocks=m.routing.report_blocks if m.routing.prefix_affinity else None,
        )
    if m.backend == "transformers":
        import torch

        from ballast.model.hf_checkpoint import load_checkpoint
        from ballast.model.hf_engine import HFBackend

        device = m.device if m.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu" and m.cpu_threads is not None:
            torch.set_num_threads(m.cpu_threads)
        hf = HFBackend(load_checkpoint(m.path, device, m.dtype), name=m.name)
        if embed and hf.base is None:
            raise ModelLoadError(m.path, "kind embed: the model has no base (decoder without its LM head) to pool")
        return hf
    from ballast.config import frozen_config
    from ballast.model.builtin_checkpoint import BackendSpec, load_backend
    from ballast.model.builtin_decoder import TinyDecoderConfig

    backend = load_backend(frozen_config(BackendSpec, m, config=frozen_config(TinyDecoderConfig, m.architecture)))
    if embed and not backend.pools:
        raise ModelLoadError(
            backend.source, "kind embed: this archive gives no hidden states (scripted before TinyDecoder.hidden)"
        )
    if backend.device == "cpu" and m.cpu_threads is not None:
        import torch

        torch.set_num_threads(m.cpu_threads)  # per process: this replica's own setting
    return backend
