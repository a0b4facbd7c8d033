"""The vLLM engine: a local checkpoint served by vLLM's ``AsyncLLM`` behind the model replica.

**Who schedules.** The other two engines are batched by Ballast's own loop, a
decode step at a time. vLLM schedules itself (continuous batching, a paged KV
cache, prefix caching, chunked prefill): the replica hands it requests and
reads their tokens back; how many requests are in the engine at once is the
one thing the replica bounds (``max_num_seqs`` caps it from vLLM's side).

**The parts.** :class:`VLLMBackend` (here) starts and stops the engine, checks a row's
sampling and grammar before it joins, and says what the engine is and holds. Beside it:

- ``vllm_loop.EngineLoop``: the event loop ``AsyncLLM`` runs on, in a daemon thread of
  its own; the replica drives a batch from a worker thread (``asyncio.to_thread``) and
  each batch call is a coroutine handed to that loop and waited for with a bound.
  vLLM's engine core runs in a child process (and on CPU a worker process under it per
  rank), see :meth:`VLLMBackend.engine_pids`;
- ``vllm_batch.VLLMBatch``: the rows one replica loop has in the engine, one vLLM
  request each; a row vLLM fails leaves alone, a dead engine fails no row: the rows
  wait, the backend says why (:attr:`VLLMBackend.lost`) and the replica goes as a whole,
  its requests sent elsewhere (``ballast.model.server``);
- ``vllm_lora.LoRATable``: the LoRA adapters served beside the base model;
- ``vllm_stats``: the engine's own stats, step by step, and its step curve (how many
  rows it runs usefully), from vLLM's scheduler through a stat logger; inside Ray,
  vLLM's own metrics go to Prometheus beside Ballast's as ``ray.serve.llm`` exports them;
- ``vllm_args``: vLLM's engine arguments as Ballast sets them;
- ``kv_events``: what the engine's prefix cache holds, from its KV-cache events.

**Guided decoding.** A row's JSON schema is checked and compiled by the replica
before the row joins (:meth:`VLLMBackend.check`, ``ballast.model.grammar``): off the
event loop, on a bounded pool of which one tenant holds at most half, within
``model.grammar_compile_timeout_s``.

**Tokens.** Prompts arrive as token ids (the replica tokenizes with the
checkpoint's tokenizer, :func:`ballast.model.hf_checkpoint.load_tokenizer`, through the
text side it shares with the transformers engine, ``hf_text.TokenizerText``), and
the replica turns ids back into text (``text.stream_decoder``), so vLLM is told not
to detokenize. An end-of-sequence token is emitted (counted) as with the other
engines; vLLM stops at the tokenizer's and ``generation_config.json``'s eos ids.

Written here rather than taken from vLLM's OpenAI server: the replica needs
token-level chunks, aborts and admission under its own control, which
``AsyncLLM`` gives directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ballast.errors import AdapterRefused, EngineRefused, ModelLoadError
from ballast.model.batching import describe_engine, warm_up
from ballast.model.grammar import GrammarCompiles
from ballast.model.hf_text import TokenizerText
from ballast.model.kv_events import feed_for
from ballast.model.protocol import POOLING_KINDS, Pooling, RowSampling
from ballast.model.untyped import VLLMObject
from ballast.model.vllm_args import DEFAULT_ENGINE_KWARGS, config_sections, default_engine_kwargs
from ballast.model.vllm_batch import VLLMBatch, VLLMRequestError, check_logprobs, sampling_params
from ballast.model.vllm_loop import SHUTDOWN_WAIT_S, EngineLoop
from ballast.model.vllm_lora import BASE_ADAPTER, LoRATable, lora_engine_kwargs, precheck_adapters
from ballast.model.vllm_stats import StatsSink, VLLMStats, engine_metrics, stat_logger_factory
from ballast.policies.prefix_cache import PrefixReport

# What callers build a backend with (``ballast.model.engine.build_engine``, the benchmarks)
# and what it hands them, importable from here.
__all__ = [
    "VLLMBackend",
    "VLLMBatch",
    "VLLMRequestError",
    "VLLMStats",
    "default_engine_kwargs",
    "lora_engine_kwargs",
]


class VLLMBackend:
    """A local checkpoint served by one vLLM ``AsyncLLM`` (see the module docstring).

    ``engine_kwargs`` go to ``vllm.engine.arg_utils.AsyncEngineArgs`` (dtype,
    max_model_len, max_num_seqs, enable_prefix_caching, enforce_eager,
    gpu_memory_utilization, ...); ``model`` and ``tokenizer`` are ``path``.
    A directory vLLM cannot serve raises :class:`ModelLoadError` here, naming the
    file and vLLM's reason. ``max_wait_s`` bounds one ``run_chunk``'s wait.
    ``adapters`` (name: local directory) are loaded at start (``enable_lora`` in
    ``engine_kwargs``); one vLLM refuses is a :class:`ModelLoadError` naming its directory.
    ``llm`` is vLLM's ``AsyncLLM`` (None once shut down), run on ``loop``; ``lora`` the
    adapters it serves.
    """

    engine_name = "vllm"  # its row in ballast.policies.engines.ENGINES

    def __init__(
        self,
        path: str,
        *,
        name: str,
        engine_kwargs: dict[str, Any] | None = None,
        max_wait_s: float = 0.5,
        grammar_compile_timeout_s: float = 2.0,
        grammar_compile_threads: int = 2,
        adapters: Mapping[str, str] | None = None,
        prefix_report_blocks: int | None = None,
    ) -> None:
        from ballast.model.hf_checkpoint import load_tokenizer, tokenizer_id

        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not (max_wait_s > 0):
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s!r}")
        self.name = name
        self.max_wait_s = float(max_wait_s)
        self.tokenizer, self.info = load_tokenizer(path)  # ModelLoadError naming the file
        self.source = str(self.info.path)
        self.tokenizer_id = tokenizer_id(self.info.path)
        eos = set(self.info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)
        self.parameter_count = _parameter_count(self.info.weight_files)
        precheck_adapters(adapters or {}, name)  # a name or path refused before vLLM starts
        self._stats, self._batches, self._closed = StatsSink(), 0, False
        self._lost: str | None = None  # why the engine is dead (vLLM said so); None while it serves
        self.loop = EngineLoop(name)
        started = time.monotonic()
        self.llm: VLLMObject = self._launch(dict(engine_kwargs or {}), prefix_report_blocks)
        self.start_s = time.monotonic() - started
        cfg = self.llm.vllm_config
        self.max_seq_len = int(cfg.model_config.max_model_len)
        self.text = TokenizerText(self.tokenizer, self.max_seq_len)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        # The most log-probabilities per position vLLM gives (-1 in its config: the vocabulary).
        max_logprobs = int(cfg.model_config.max_logprobs)
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else max_logprobs
        # An embeddings engine (vLLM's pooling runner, ``vllm_args.pooling_engine_kwargs``):
        # its pooler's kind, which every pooled row must ask; None: a generating engine.
        self.pooling = _pooling_kind(cfg.model_config)
        self.hidden_size = int(cfg.model_config.embedding_size)
        self.device = _device_name(cfg)
        self.lora = LoRATable(self.loop, self.llm, model=name, device=self.device)
        self._xgr_lock = threading.Lock()
        self._xgr_compiler: Any = None  # built at the first schema, in a grammar thread
        self.grammars = GrammarCompiles(
            self._compile_schema, threads=grammar_compile_threads, timeout_s=grammar_compile_timeout_s
        )
        self._load_adapters(adapters or {})

    # ---------------------------------------------------------------- start, stop

    def _launch(self, engine_kwargs: dict[str, Any], report_blocks: int | None) -> VLLMObject:
        """The engine (Ballast's defaults under ``engine_kwargs``), started on the engine loop,
        and with ``report_blocks`` the feed of its KV-cache events (``kv_events.feed_for``);
        a failure stops the loop and the feed."""
        kwargs = {**DEFAULT_ENGINE_KWARGS, **engine_kwargs}
        self._kv_feed = feed_for(kwargs, report_blocks, BASE_ADAPTER)
        try:
            llm = self.loop.call(self._start(kwargs), None)
        except BaseException:
            self.loop.stop()
            if self._kv_feed is not None:
                self._kv_feed.close()
            raise
        if self._kv_feed is not None and report_blocks is not None:
            cache = llm.vllm_config.cache_config
            self._kv_feed.start(int(cache.num_gpu_blocks), int(cache.block_size), report_blocks)
        return llm

    async def _start(self, engine_kwargs: dict[str, Any]) -> VLLMObject:
        """The engine config (faults blamed on config.json), then the engine itself."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = {**engine_kwargs, "model": self.source, "tokenizer": self.source}
        kwargs.setdefault("disable_log_stats", True)  # no default loggers; ours still turns stats on
        kwargs.setdefault("served_model_name", self.name)  # the model_name label of vLLM's own metrics
        try:
            args = AsyncEngineArgs(**config_sections(kwargs))
        except (TypeError, ValueError) as e:
            raise ModelLoadError(self.source, f"engine_kwargs: {e}") from e
        try:
            vllm_config = args.create_engine_config()
        except Exception as e:  # vLLM's own validation: architecture, context, dtype, kwargs
            raise ModelLoadError(
                str(self.info.path / "config.json"), f"vLLM cannot serve it: {type(e).__name__}: {e}"
            ) from e
        _in_replica_group(vllm_config.parallel_config)
        try:
            return AsyncLLM.from_vllm_config(
                vllm_config,
                stat_loggers=[stat_logger_factory(self._stats), *engine_metrics()],
                disable_log_stats=args.disable_log_stats,
            )
        except Exception as e:  # the engine core failed to start (its log has the detail)
            raise ModelLoadError(self.source, f"vLLM's engine did not start: {type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        """Stop the engine and its processes, then the engine loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.grammars.close()
        pids = self.engine_pids()
        try:
            self.loop.call(self._shutdown_llm(), SHUTDOWN_WAIT_S)
        finally:
            self.loop.stop()
            self.llm = None
            _reap(pids, SHUTDOWN_WAIT_S)
            self.lora.close()
            if self._kv_feed is not None:
                self._kv_feed.close()

    async def _shutdown_llm(self) -> None:
        self.llm.shutdown()

    def engine_died(self, reason: str) -> None:
        """vLLM reported the engine dead (a batch saw its ``EngineDeadError``): the first
        ``reason`` is kept as :attr:`lost`."""
        self._lost = self._lost or reason

    # ---------------------------------------------------------------- LoRA adapters

    def _load_adapters(self, adapters: Mapping[str, str]) -> None:
        """The adapters served from the start; one vLLM refuses stops the engine and is a
        ModelLoadError naming its directory."""
        try:
            self.lora.load(adapters)
        except AdapterRefused as e:
            self.shutdown()
            raise ModelLoadError(e.path, f"adapter {e.name!r}: {e.reason}") from e

    def add_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in the local directory ``path`` as ``name``, loaded into
        vLLM now (``LoRATable.add``: AdapterRefused, with the reason, for what it refuses)."""
        self.lora.add(name, path)

    def remove_adapter(self, name: str) -> bool:
        """Stop serving ``name`` (``LoRATable.remove``); False when it was not loaded."""
        return self.lora.remove(name)

    def adapters(self) -> dict[str, str]:
        """The adapters served, by name: their directories."""
        return self.lora.served()

    @property
    def lora_slots(self) -> int:
        """Adapters vLLM keeps in its batch slots (``max_loras``); 0 without LoRA."""
        return self.lora.slots

    def serves_adapter(self, name: str) -> bool:
        return self.lora.serves(name)

    # ------------------------------------------------------- a row's checks and grammar

    async def check(
        self,
        sampling: RowSampling | None,
        tenant: str = "",
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> RowSampling | None:
        """``sampling`` for this model once vLLM's own validation passes, run here so that
        the request fails alone (``EngineRefused``), before it joins the batch.

        ``logprobs`` / ``prompt_logprobs`` (the call's k, ``Join.logprobs`` /
        ``prompt_logprobs``): above the engine's :attr:`max_logprobs`, ``EngineRefused``
        naming ``logprobs`` (``vllm_batch.check_logprobs``, which a row's join checks again).

        A JSON schema (``response_format``, a forced tool call's) is compiled to its
        grammar by :attr:`grammars` (``ballast.model.grammar``): off the event loop, on a
        bounded pool of which ``tenant`` holds at most its share, within
        ``grammar_compile_timeout_s`` (``SchemaTooComplex`` past it). Only a schema that
        compiled in time reaches vLLM, whose engine compiles it again in its own process
        (vLLM's own compile has no time limit)."""
        from vllm.exceptions import VLLMClientError

        check_logprobs(logprobs, prompt_logprobs, self.max_logprobs, self.name)
        if sampling is None:
            return None
        sampling = sampling.for_vocab(self.vocab_size)
        try:
            self._verify(sampling_params(replace(sampling, json_schema=None, structural_tag=None), 1))
        except (VLLMClientError, ValueError) as e:
            field = str(getattr(e, "parameter", None) or "sampling")
            raise EngineRefused(f"{field}: vLLM refuses the request's sampling parameters: {e}", field=field) from None
        grammar = _grammar_key(sampling)
        if grammar is not None:
            await self.grammars.check(grammar, sampling.json_schema_of, tenant)
        return sampling

    def _verify(self, params: VLLMObject) -> None:
        cfg = self.llm.vllm_config
        params.verify(cfg.model_config, cfg.speculative_config, cfg.structured_outputs_config, self.llm.tokenizer)

    def _compile_schema(self, key: str) -> None:
        """vLLM's validation of a row's grammar (``_grammar_key``: a JSON schema or a
        structural tag), then the grammar compiled as vLLM's xgrammar backend compiles it
        (in a grammar thread); ValueError: vLLM refuses it."""
        from vllm.exceptions import VLLMClientError

        kind, text = key.split(":", 1)
        grammar = RowSampling(structural_tag=text) if kind == "structural_tag" else RowSampling(json_schema=text)
        params = sampling_params(grammar, 1)
        try:
            self._verify(params)
        except (VLLMClientError, ValueError) as e:
            raise ValueError(str(e)) from None
        if str(params.structured_outputs._backend or "").startswith("xgrammar"):
            so = self.llm.vllm_config.structured_outputs_config
            try:
                if kind == "structural_tag":
                    self._xgrammar().compile_structural_tag(text)
                else:
                    self._xgrammar().compile_json_schema(
                        text,
                        any_whitespace=not so.disable_any_whitespace,
                        separators=(",", ":") if so.disable_any_whitespace else None,
                    )
            except RuntimeError as e:  # xgrammar's refusal of a grammar vLLM's validation took
                raise ValueError(str(e)) from None

    def _xgrammar(self) -> Any:
        """An xgrammar compiler over this model's vocabulary, as vLLM's backend builds one (no cache:
        the verdicts are remembered by ``grammars``)."""
        with self._xgr_lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    # ------------------------------------------------------------------ engine side

    def open_batch(self) -> VLLMBatch:
        self._batches += 1
        return VLLMBatch(self, f"{self.name}-b{self._batches}")

    def warmup(self, batch_sizes: Sequence[int] = (1,)) -> None:
        """Short generations at these batch sizes (``batching.warm_up``), and the grammar
        compiler's view of the vocabulary (seconds on a large one), so that no request's
        compile limit pays for it; an embeddings engine pools instead, with no grammar."""
        if self.pooling is not None:
            warm_up(self, batch_sizes, pool=Pooling(self.pooling))
            return
        self._xgrammar()
        warm_up(self, batch_sizes)

    def prefix_report(self, now_s: float) -> PrefixReport | None:
        """The blocks this engine's prefix cache holds, from its KV events (``KVEventFeed``);
        None without the feed (prefix caching off, or no ``prefix_report_blocks``)."""
        return self._kv_feed.report(now_s) if self._kv_feed is not None else None

    def prefix_blocks(self) -> int | None:
        """How many blocks this engine's prefix cache holds, as its KV events say; None without the feed."""
        return self._kv_feed.held_blocks() if self._kv_feed is not None else None

    def stats(self) -> VLLMStats:
        return self._stats.get()

    def engine_pids(self) -> list[int]:
        """The engine-core process(es) and every process under them (on CPU, the worker)."""
        import psutil

        manager = getattr(getattr(self.llm, "engine_core", None), "resources", None)
        manager = getattr(manager, "engine_manager", None)
        pids: list[int] = []
        for proc in getattr(manager, "processes", None) or []:
            if proc.pid is None:
                continue
            pids.append(proc.pid)
            try:
                pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return pids

    def engine_processes(self) -> tuple[tuple[int, str], ...]:
        """(pid, name) of the engine's own processes on this node: its core and its workers
        (one per rank: ``VLLM::Worker_TP1``, ...) by the titles vLLM gives them (a helper
        process that comes and goes under them, a compile pool say, is not one), and with
        the ray executor the rank actors of the replica's placement group on this node."""
        from ballast.model.ranks import engine_processes, placement_group_actor_pids

        tree = self.engine_pids()
        own = tuple(p for p in engine_processes(tree) if p[1].startswith("VLLM::"))
        if self.llm.vllm_config.parallel_config.distributed_executor_backend != "ray":
            return own
        return own + engine_processes([p for p in placement_group_actor_pids() if p not in tree])

    @property
    def lost(self) -> str | None:
        """Why the engine can serve no more (vLLM reported it dead: a rank or its core went
        away); None while it serves. Its rows are held, not failed, from then on: the replica
        goes as a whole (its watchdog has it killed) and the router sends them elsewhere."""
        return self._lost

    def describe(self) -> dict[str, Any]:
        import vllm

        cfg = self.llm.vllm_config if self.llm is not None else None
        out = {
            **describe_engine(self),
            "backend": "vllm",
            "architecture": self.info.architecture,
            "vllm": vllm.__version__,
        }
        if cfg is not None:
            out.update(
                dtype=str(cfg.model_config.dtype).replace("torch.", ""),
                max_num_seqs=cfg.scheduler_config.max_num_seqs,
                kv_cache_blocks=cfg.cache_config.num_gpu_blocks,
                kv_block_size=cfg.cache_config.block_size,
                prefix_caching=bool(cfg.cache_config.enable_prefix_caching),
                adapters=sorted(self.adapters()),
            )
        return out


def _parameter_count(weight_files: Sequence[Path]) -> int | None:
    """Parameters in the safetensors files, from their headers (no tensor is read)."""
    try:
        from safetensors import safe_open

        total = 0
        for f in weight_files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    n = 1
                    for d in st.get_slice(name).get_shape():
                        n *= int(d)
                    total += n
        return total
    except Exception:  # a count is descriptive only: never a reason not to serve
        return None


def _pooling_kind(model_config: VLLMObject) -> str | None:
    """The pooler's kind (``Pooling.kind``: last, mean, cls) of an engine on vLLM's pooling
    runner; None for a generating engine. A pooler of another kind is a ``ModelLoadError``:
    Ballast pools by these three only."""
    if model_config.runner_type != "pooling":
        return None
    kind = str(model_config.pooler_config.get_seq_pooling_type()).lower()
    if kind not in POOLING_KINDS:
        raise ModelLoadError(
            str(model_config.model), f"vLLM pools this model by {kind!r}; Ballast pools by {POOLING_KINDS}"
        )
    return kind


def _grammar_key(s: RowSampling) -> str | None:
    """The grammar a row decodes by, as ``GrammarCompiles`` remembers it: ``kind:text``."""
    if s.structural_tag is not None:
        return f"structural_tag:{s.structural_tag}"
    if s.json_schema is not None:
        return f"json_schema:{s.json_schema}"
    return None


def _in_replica_group(parallel_config: VLLMObject) -> None:
    """vLLM's ray executor runs its ranks in the placement group it is handed: the replica's
    own (Serve's), found here in the replica. The engine core that starts the ranks is a
    child process, outside the replica's Ray worker, so it could not find the group itself."""
    if parallel_config.distributed_executor_backend != "ray" or parallel_config.placement_group is not None:
        return
    import ray

    if ray.is_initialized():
        parallel_config.placement_group = ray.util.get_current_placement_group()


def _device_name(vllm_config: VLLMObject) -> str:
    device = getattr(vllm_config.device_config, "device_type", None) or str(vllm_config.device_config.device)
    return "cpu" if str(device).startswith("cpu") else str(device)


def _reap(pids: Sequence[int], timeout: float) -> None:
    """Wait for ``pids`` to exit; kill what is left after ``timeout``."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
