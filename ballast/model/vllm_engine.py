"""The vLLM engine: a local checkpoint served by vLLM's ``AsyncLLM`` behind the model replica.

**Who schedules.** The other two engines are batched by Ballast's own loop, a
decode step at a time. vLLM schedules itself (continuous batching, a paged KV
cache, prefix caching, chunked prefill): the replica hands it requests and
reads their tokens back; how many requests are in the engine at once is the
one thing the replica bounds (``max_num_seqs`` caps it from vLLM's side).

**Threads.** :class:`VLLMBackend` owns one ``AsyncLLM`` and the event loop it runs
on, in a daemon thread of its own; vLLM's engine core runs in a child process
(and on CPU a worker process under it per rank), see :meth:`VLLMBackend.engine_pids`.
The replica drives a batch from a worker thread (``asyncio.to_thread``); each
batch call is a coroutine handed to the engine loop with
``asyncio.run_coroutine_threadsafe`` and waited for with a bound.

**A batch.** Every row is one vLLM request whose outputs (``DELTA``: the new
token ids only) a task on the engine loop appends to the row's buffer, setting
an event the batch waits on, so nothing polls. ``run_chunk`` submits the joins,
then waits until every row that has produced tokens has ``steps`` unread ones or
has finished, bounded by ``max_wait_s``; a row still queued in vLLM (no token
yet) does not hold back the rows that have tokens to hand over. A row's buffer
holds at most its ``max_new_tokens`` ids. ``remove`` cancels the row's task,
which makes vLLM abort the request: its slot and KV blocks are free at the
engine's next step. A request vLLM fails (its validation refusing the row's
parameters or prompt ids, or any error of that request alone) leaves the batch by
itself and is handed to the replica by ``take_failed`` (``EngineRefused`` when vLLM
refused it as sent, a 400 that is no model failure; ``VLLMRequestError`` otherwise);
the other rows go on. A dead engine (vLLM's ``EngineDeadError``: a rank or the engine
core went away) fails no row: the rows wait, the backend says why (:attr:`VLLMBackend.lost`)
and the replica goes as a whole, its requests sent elsewhere (``ballast.model.server``).

**Guided decoding.** A row's JSON schema is checked and compiled by the replica
before the row joins (:meth:`VLLMBackend.check`, ``ballast.model.grammar``): off the
event loop, on a bounded pool of which one tenant holds at most half, within
``model.grammar_compile_timeout_s``.

**Tokens.** Prompts arrive as token ids (the replica tokenizes with the
checkpoint's tokenizer, :func:`ballast.model.hf_checkpoint.load_tokenizer`), and
the replica turns ids back into text (``stream_decoder``), so vLLM is told not
to detokenize. An end-of-sequence token is emitted (counted) as with the other
engines; vLLM stops at the tokenizer's and ``generation_config.json``'s eos ids.

**LoRA adapters.** A backend started with ``enable_lora`` serves named adapters (local
directories in PEFT's format) beside its base model: :meth:`VLLMBackend.add_adapter`
loads one into vLLM at once (``AsyncLLM.add_lora``), so that a bad directory is refused
there with vLLM's reason (``AdapterRefused``), never on a request;
:meth:`~VLLMBackend.remove_adapter` unloads it. Each adapter keeps one ``LoRARequest``
(its name, an int id never reused by this backend, its directory); a row whose join names
an adapter runs with it, and a row naming one that is not loaded is refused alone
(``EngineRefused`` naming ``model``). vLLM keeps at most ``max_cpu_loras`` adapters in
memory and ``max_loras`` in one step; one it evicted is read again from its directory
when a row needs it. A removed adapter's rows already in the engine finish with it.
On CPU, vLLM's LoRA ops (``vllm/lora/ops/torch_ops``) index a row without an adapter
(index -1) as the last adapter slot, so a base-model row that shares a step with adapter
rows would run with an adapter there (vllm PR #48421): there, base rows run with a zero
adapter instead (``_base_adapter``), which gives the base model's output exactly.

**Stats** come from vLLM's own scheduler through a ``StatLoggerBase`` registered
at start (one record per engine step): running and waiting requests, KV-cache
usage, cumulative prefix-cache queries and hits (:class:`VLLMStats`). Inside Ray, vLLM's
own metrics go to Prometheus beside Ballast's as ``ray.serve.llm`` exports them
(``RayPrometheusStatLogger``: ``ray_vllm_time_to_first_token_seconds``,
``ray_vllm_inter_token_latency_seconds``, ``ray_vllm_num_preemptions_total``, ...,
labelled ``model_name`` with the model's name).

Written here rather than taken from vLLM's OpenAI server: the replica needs
token-level chunks, aborts and admission under its own control, which
``AsyncLLM`` gives directly.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ballast.model.batching import check_joins, describe_engine
from ballast.errors import AdapterRefused, EngineRefused, ModelLoadError
from ballast.model.grammar import GrammarCompiles
from ballast.model.kv_events import KVEventFeed, events_config
from ballast.policies.engines import StepCurve
from ballast.policies.prefix_cache import PrefixReport
from ballast.model.hf_text import ContextTooLong, IncrementalDetokenizer, TokenizerText
from ballast.model.protocol import GREEDY, Join, RowSampling

__all__ = ["VLLMBackend", "VLLMBatch", "VLLMRequestError", "VLLMStats"]

# vLLM options Ballast sets unless engine_kwargs says otherwise.
log = logging.getLogger("ballast.vllm")

_DEFAULT_ENGINE_KWARGS = {"enable_prefix_caching": True}
#: The zero adapter base-model rows run with on CPU (``VLLMBackend._base_adapter``); not a
#: name a request or an operator can give (names are checked: ``_check_adapter_name``).
BASE_ADAPTER = "ballast:base"
_CALL_SLACK_S = 30.0  # beyond a call's own bound: the engine loop itself is stuck
_ADAPTER_LOAD_S = 120.0  # one adapter's load into vLLM (read from disk, checked, copied in)
# LoRA settings Ballast sets when a model has adapters and leaves them out: vLLM's own
# max_lora_rank (16, which covers the common r <= 16 fine-tunes; the LoRA buffers vLLM
# allocates at start grow with it), raised to the largest rank among the adapters loaded at
# start; an adapter added later above it is refused with vLLM's reason.
_DEFAULT_MAX_LORA_RANK = 16
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's max_lora_rank accepts
_MAX_ADAPTER_NAME = 128
_SHUTDOWN_WAIT_S = 15.0


class VLLMRequestError(RuntimeError):
    """vLLM failed a request of the batch alone (not its validation, not a dead engine)."""


@dataclass(frozen=True)
class VLLMStats:
    """The engine's own view, as of its last step.

    ``kv_cache_usage`` is the used fraction of the KV cache (0-1);
    ``prefix_cache_queries``/``hits`` are prompt tokens looked up in the prefix
    cache and found there, cumulative since start; ``steps`` counts the steps
    the engine reported (its heartbeat while it has work); ``useful_rows`` is where more
    rows stop buying throughput, from its steps' times (``StepCurve``; None until known)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    useful_rows: Optional[int] = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class _StatsSink:
    """The latest :class:`VLLMStats`, written on the engine loop, read from any thread, and
    the engine's step curve (``StepCurve``): each step's time against the rows in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = VLLMStats()
        self._curve = StepCurve()

    def get(self) -> VLLMStats:
        """The last step's stats, with the curve's ``useful_rows`` as of now (fitted here,
        when read, not at every step)."""
        with self._lock:
            return replace(self._stats, useful_rows=self._curve.rows())

    def curve(self) -> dict[str, Any]:
        with self._lock:
            return self._curve.snapshot()

    def record(self, s: Any, token_gaps: Sequence[float] = ()) -> None:
        """One step's ``SchedulerStats`` (its prefix-cache figures are that step's delta) and
        its rows' inter-token gaps (``IterationStats.inter_token_latencies_iter``: the engine's
        own timestamps, so the step's time whatever the loop that reads it; a row that waited
        to run again, a gap from before it idled, is as long as that wait: the median is the
        step's time)."""
        with self._lock:
            old = self._stats
            rows = int(s.num_running_reqs)
            if token_gaps and rows > 0:
                self._curve.observe(rows, statistics.median(token_gaps))
            pcs = s.prefix_cache_stats
            queries, hits = (0, 0) if pcs.reset else (old.prefix_cache_queries, old.prefix_cache_hits)
            self._stats = VLLMStats(
                running=rows,
                waiting=int(s.num_waiting_reqs),
                kv_cache_usage=float(s.kv_cache_usage),
                prefix_cache_queries=queries + int(pcs.queries),
                prefix_cache_hits=hits + int(pcs.hits),
                steps=old.steps + 1,
            )


def _stat_logger_factory(sink: _StatsSink) -> Any:
    """A ``StatLoggerBase`` class feeding ``sink`` (vLLM calls it as ``cls(vllm_config, engine_index)``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                sink.record(scheduler_stats, getattr(iteration_stats, "inter_token_latencies_iter", None) or ())

        def log_engine_initialized(self) -> None:
            pass

    return _SinkLogger


def _parameter_count(weight_files: Sequence[Path]) -> Optional[int]:
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


def default_engine_kwargs(
    path: str, engine_kwargs: dict[str, Any], rows: int, adapters: Optional[Mapping[str, str]] = None
) -> dict[str, Any]:
    """``engine_kwargs`` with Ballast's defaults for what it leaves out: room in the engine
    for ``rows`` requests (``max_num_seqs``, the replica bounds them), LoRA when the model
    has ``adapters`` (:func:`lora_engine_kwargs`), guided JSON without whitespace between
    its tokens (``structured_outputs_config``: backend xgrammar, ``disable_any_whitespace``;
    vLLM's default lets a small model fill ``max_tokens`` with whitespace; another backend
    named is left as it is), and on CPU a KV cache
    with room for ``rows`` rows that each fill the context, as Ballast's own engines are
    sized (vLLM's size is each rank's: with tensor or pipeline parallelism, that share of
    it). vLLM's CPU default (``gpu_memory_utilization`` 0.92 of the host's memory) is
    refused by a host that runs anything else; an explicit size, or
    ``VLLM_CPU_KVCACHE_SPACE``, is kept."""
    import json
    import os

    out = lora_engine_kwargs({"max_num_seqs": rows, **engine_kwargs}, adapters or {}, base_slot=not _cuda_visible())
    so = out.get("structured_outputs_config")
    if so is None or isinstance(so, dict):  # compact JSON: a small model fills max_tokens with whitespace
        so = dict(so or {})
        if so.get("backend", "xgrammar") == "xgrammar":  # vLLM takes the setting with a named backend only
            so = {"backend": "xgrammar", "disable_any_whitespace": True, **so}
        out["structured_outputs_config"] = so
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(out) or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if sized or _cuda_visible():
        return out
    try:
        c = json.loads((Path(path) / "config.json").read_text())
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        context = int(out.get("max_model_len") or c.get("max_position_embeddings") or 2048)
        per_token = (
            2
            * int(c["num_hidden_layers"])
            * kv_heads
            * head_dim
            * (2 if out.get("dtype") in ("bfloat16", "float16", "half") else 4)
        )
    except (OSError, ValueError, KeyError, TypeError):  # vLLM names what is wrong with the directory at start
        return out
    out["kv_cache_memory_bytes"] = max(64 << 20, rows * context * per_token // _ranks_sharing_kv(out, c))
    return out


def _ranks_sharing_kv(engine_kwargs: Mapping[str, Any], c: Mapping[str, Any]) -> int:
    """How many ranks share one token's KV (vLLM's size is per rank): tensor parallel ranks
    split the KV heads (each keeps at least one), pipeline ranks the layers."""
    tp = int(engine_kwargs.get("tensor_parallel_size") or 1)
    pp = int(engine_kwargs.get("pipeline_parallel_size") or 1)
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    return min(tp, heads) * min(pp, int(c["num_hidden_layers"]))


def lora_engine_kwargs(
    engine_kwargs: dict[str, Any], adapters: Mapping[str, str], base_slot: bool = False
) -> dict[str, Any]:
    """``engine_kwargs`` with LoRA turned on when there are ``adapters`` (unless it says
    ``enable_lora``), ``max_loras`` (adapters in one step) as many as the adapters up to 4
    (one more with ``base_slot``: on CPU, the zero adapter base rows run with,
    ``VLLMBackend._base_adapter``), and ``max_lora_rank`` vLLM's 16 or the smallest rank
    vLLM takes that holds the largest adapter's (read from its ``adapter_config.json``; one
    that cannot be read is vLLM's to refuse when it is loaded)."""
    out = dict(engine_kwargs)
    if not adapters or out.get("enable_lora") is False:
        return out
    out["enable_lora"] = True
    out.setdefault("max_loras", max(1, min(len(adapters), 4)) + int(base_slot))
    if "max_lora_rank" not in out:
        rank = max([_DEFAULT_MAX_LORA_RANK, *(_adapter_rank(p) for p in adapters.values())])
        out["max_lora_rank"] = next((r for r in _LORA_RANKS if r >= rank), _LORA_RANKS[-1])
    return out


def _adapter_rank(path: str) -> int:
    """The largest rank in a PEFT adapter's ``adapter_config.json`` (0: none readable)."""
    import json

    try:
        c = json.loads((Path(path) / "adapter_config.json").read_text())
        return max([int(c.get("r") or 0), *(int(v) for v in (c.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _cuda_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def sampling_params(s: RowSampling, n: int) -> Any:
    """vLLM's parameters for a row of ``n`` new tokens sampled as ``s``."""
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
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,  # the replica decodes ids itself
    )


def _engine_metrics() -> list[Any]:
    """vLLM's own metrics (TTFT, inter-token latency, preemptions, ... as ``vllm_*``) through
    Ray's metrics, as ``ray.serve.llm`` exports them (``log_engine_metrics``), in a replica;
    none outside Ray (a test's engine)."""
    import ray

    if not ray.is_initialized():
        return []
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]


def _grammar_key(s: RowSampling) -> Optional[str]:
    """The grammar a row decodes by, as ``GrammarCompiles`` remembers it: ``kind:text``."""
    if s.structural_tag is not None:
        return f"structural_tag:{s.structural_tag}"
    if s.json_schema is not None:
        return f"json_schema:{s.json_schema}"
    return None


def _config_sections(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the config sections that ``AsyncEngineArgs`` takes only as objects
    built from the mappings a YAML config gives (it builds the others itself)."""
    from vllm.config import StructuredOutputsConfig

    out = dict(kwargs)
    if isinstance(out.get("structured_outputs_config"), dict):
        out["structured_outputs_config"] = StructuredOutputsConfig(**out["structured_outputs_config"])
    return out


class VLLMBackend:
    """A local checkpoint served by one vLLM ``AsyncLLM`` (see the module docstring).

    ``engine_kwargs`` go to ``vllm.engine.arg_utils.AsyncEngineArgs`` (dtype,
    max_model_len, max_num_seqs, enable_prefix_caching, enforce_eager,
    gpu_memory_utilization, ...); ``model`` and ``tokenizer`` are ``path``.
    A directory vLLM cannot serve raises :class:`ModelLoadError` here, naming the
    file and vLLM's reason. ``max_wait_s`` bounds one ``run_chunk``'s wait.
    ``adapters`` (name: local directory) are loaded at start (``enable_lora`` in
    ``engine_kwargs``); one vLLM refuses is a :class:`ModelLoadError` naming its directory.
    """

    def __init__(
        self,
        path: str,
        *,
        name: str,
        engine_kwargs: Optional[dict[str, Any]] = None,
        max_wait_s: float = 0.5,
        grammar_compile_timeout_s: float = 2.0,
        grammar_compile_threads: int = 2,
        adapters: Optional[Mapping[str, str]] = None,
        prefix_report_blocks: Optional[int] = None,
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
        _precheck_adapters(adapters or {}, name)  # a name or path refused before vLLM starts
        self._stats, self._batches, self._closed = _StatsSink(), 0, False
        self._lost: Optional[str] = None  # why the engine is dead (vLLM said so); None while it serves
        # Guards _adapters and _lora_ids: add/remove run on any thread, batches read the
        # table on the engine loop. An adapter enters the table only once vLLM loaded it
        # and leaves it before vLLM unloads it, so a row never runs with one vLLM refused.
        self._adapter_lock = threading.Lock()
        self._adapters: dict[str, Any] = {}  # name -> vLLM's LoRARequest
        self._lora_ids = 0  # the last LoRARequest id handed out; ids are never reused
        self._base_lora: Any = None  # on CPU with LoRA on: the zero adapter base rows run with
        self._base_lora_dir: Optional[str] = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"vllm-{name}", daemon=True)
        self._thread.start()
        started = time.monotonic()
        self._llm = self._launch(dict(engine_kwargs or {}), prefix_report_blocks)
        self.start_s = time.monotonic() - started
        cfg = self._llm.vllm_config
        self.max_seq_len = int(cfg.model_config.max_model_len)
        self.text = TokenizerText(self.tokenizer, self.max_seq_len)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        self.device = _device_name(cfg)
        self._xgr_lock = threading.Lock()
        self._xgr_compiler: Any = None  # built at the first schema, in a grammar thread
        self.grammars = GrammarCompiles(
            self._compile_schema, threads=grammar_compile_threads, timeout_s=grammar_compile_timeout_s
        )
        self._load_adapters(adapters or {})
        self._base_adapter()

    # ---------------------------------------------------------------- start, stop

    def _launch(self, engine_kwargs: dict[str, Any], report_blocks: Optional[int]) -> Any:
        """The engine, started on the engine loop, and with ``report_blocks`` the feed of its
        KV-cache events (``_kv_feed``); a failure stops the loop and the feed."""
        self._kv_feed = _kv_feed(engine_kwargs, report_blocks)
        try:
            llm = self._call(self._start(engine_kwargs), None)
        except BaseException:
            self._stop_loop()
            if self._kv_feed is not None:
                self._kv_feed.close()
            raise
        if self._kv_feed is not None and report_blocks is not None:
            cache = llm.vllm_config.cache_config
            self._kv_feed.start(int(cache.num_gpu_blocks), int(cache.block_size), report_blocks)
        return llm

    async def _start(self, engine_kwargs: dict[str, Any]) -> Any:
        """The engine config (faults blamed on config.json), then the engine itself."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = {**_DEFAULT_ENGINE_KWARGS, **engine_kwargs, "model": self.source, "tokenizer": self.source}
        kwargs.setdefault("disable_log_stats", True)  # no default loggers; ours still turns stats on
        kwargs.setdefault("served_model_name", self.name)  # the model_name label of vLLM's own metrics
        try:
            args = AsyncEngineArgs(**_config_sections(kwargs))
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
                stat_loggers=[_stat_logger_factory(self._stats), *_engine_metrics()],
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
            self._call(self._shutdown_llm(), _SHUTDOWN_WAIT_S)
        finally:
            self._stop_loop()
            self._llm = None
            _reap(pids, _SHUTDOWN_WAIT_S)
            if self._base_lora_dir is not None:
                shutil.rmtree(self._base_lora_dir, ignore_errors=True)
            if self._kv_feed is not None:
                self._kv_feed.close()

    async def _shutdown_llm(self) -> None:
        self._llm.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_SHUTDOWN_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: Optional[float]) -> Any:
        """Run ``coro`` on the engine loop and wait for its result (at most ``timeout`` s)."""
        if self._closed and self._llm is None:
            coro.close()
            raise RuntimeError(f"engine {self.name!r} is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---------------------------------------------------------------- LoRA adapters

    def add_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in the local directory ``path`` into vLLM now, served as
        ``name``. AdapterRefused (nothing loaded) for a name that is not a plain one or is
        taken by another directory, a path that is not a local directory, LoRA off, or
        vLLM's own refusal, with its reason. Adding a loaded adapter again is a no-op."""
        from vllm.lora.request import LoRARequest

        _check_adapter_name(name, self.name, path)
        where = _adapter_dir(name, path)
        if self._llm.vllm_config.lora_config is None:
            raise AdapterRefused(name, path, f"model {self.name!r} was started without enable_lora")
        with self._adapter_lock:
            held = self._adapters.get(name)
            if held is not None:
                if held.lora_path != where:
                    raise AdapterRefused(name, path, f"the name is taken by {held.lora_path}; remove it first")
                return
            self._lora_ids += 1
            req = LoRARequest(lora_name=name, lora_int_id=self._lora_ids, lora_path=where)
        try:
            self._call(self._llm.add_lora(req), _ADAPTER_LOAD_S)
        except Exception as e:  # vLLM's reason, from its engine core (the adapter alone: the engine goes on)
            raise AdapterRefused(name, path, f"vLLM refuses it: {e}") from None
        with self._adapter_lock:
            kept = self._adapters.setdefault(name, req)
        if kept is not req:  # a concurrent add of the same name won: unload this copy
            self._call(self._llm.remove_lora(req.lora_int_id), _CALL_SLACK_S)
        if self._base_lora is None and not self._closed:
            self._base_adapter()

    def _base_adapter(self) -> None:
        """On CPU with LoRA on, load a zero adapter (every LoRA weight 0: exactly the base
        model's output) that base-model rows run with, so that no row in a step runs without
        an adapter: vLLM's CPU LoRA ops take such a row's index (-1) for the last slot and
        give it that adapter's output (vllm PR #48421). Its shapes are a loaded adapter's;
        none loaded yet: the first one added makes it. Not on GPU, where rows without an
        adapter are right. It takes one of the step's ``max_loras`` slots when base rows
        share a step with adapter rows (``lora_engine_kwargs`` leaves one for it)."""
        from vllm.lora.request import LoRARequest

        if self.device != "cpu" or self._llm is None or self._llm.vllm_config.lora_config is None:
            return
        with self._adapter_lock:
            source = next((req.lora_path for req in self._adapters.values()), None)
        if source is None:
            return
        where = tempfile.mkdtemp(prefix="ballast-base-lora-")
        if not _write_zero_adapter(Path(source), Path(where)):
            shutil.rmtree(where, ignore_errors=True)
            log.warning("model %r: no safetensors in %s to shape a zero adapter from", self.name, source)
            return
        with self._adapter_lock:
            self._lora_ids += 1
            req = LoRARequest(lora_name=BASE_ADAPTER, lora_int_id=self._lora_ids, lora_path=where)
        self._call(self._llm.add_lora(req), _ADAPTER_LOAD_S)
        self._base_lora, self._base_lora_dir = req, where

    def _load_adapters(self, adapters: Mapping[str, str]) -> None:
        """The adapters served from the start; one vLLM refuses stops the engine and is a
        ModelLoadError naming its directory."""
        try:
            for name, path in adapters.items():
                self.add_adapter(name, path)
        except AdapterRefused as e:
            self.shutdown()
            raise ModelLoadError(e.path, f"adapter {e.name!r}: {e.reason}") from e

    def remove_adapter(self, name: str) -> bool:
        """Stop serving ``name`` and unload it from vLLM; False when it was not loaded. Rows
        already in the engine with it finish; a row that joins after is refused."""
        with self._adapter_lock:
            req = self._adapters.pop(name, None)
        if req is None:
            return False
        self._call(self._llm.remove_lora(req.lora_int_id), _CALL_SLACK_S)
        return True

    def adapters(self) -> dict[str, str]:
        """The adapters served, by name: their directories."""
        with self._adapter_lock:
            return {name: req.lora_path for name, req in self._adapters.items()}

    @property
    def lora_slots(self) -> int:
        """Adapters vLLM keeps in its batch slots (``max_loras``); 0 without LoRA."""
        lora = self._llm.vllm_config.lora_config
        return int(lora.max_loras) if lora is not None else 0

    def serves_adapter(self, name: str) -> bool:
        with self._adapter_lock:
            return name in self._adapters

    def _lora_request(self, name: str) -> Any:
        """The adapter's ``LoRARequest``; None when it is not loaded."""
        with self._adapter_lock:
            return self._adapters.get(name)

    # ------------------------------------------------- text side (``hf_text.TokenizerText``)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.text.tokenize(prompt, add_special_tokens)

    def fit(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], int]:
        return self.text.fit(ids, max_new_tokens)

    def encode(self, prompt: str, max_new_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids for a row of ``max_new_tokens`` (the benchmarks' and warmup's
        joins); ContextTooLong when they do not fit together."""
        return self.text.encode(prompt, max_new_tokens, add_special_tokens)

    async def check(self, sampling: Optional[RowSampling], tenant: str = "") -> Optional[RowSampling]:
        """``sampling`` for this model once vLLM's own validation passes, run here so that
        the request fails alone (``EngineRefused``), before it joins the batch.

        A JSON schema (``response_format``, a forced tool call's) is compiled to its
        grammar by :attr:`grammars` (``ballast.model.grammar``): off the event loop, on a
        bounded pool of which ``tenant`` holds at most its share, within
        ``grammar_compile_timeout_s`` (``SchemaTooComplex`` past it). Only a schema that
        compiled in time reaches vLLM, whose engine compiles it again in its own process
        (vLLM's own compile has no time limit)."""
        from vllm.exceptions import VLLMClientError

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

    def _verify(self, params: Any) -> None:
        cfg = self._llm.vllm_config
        params.verify(cfg.model_config, cfg.speculative_config, cfg.structured_outputs_config, self._llm.tokenizer)

    def _compile_schema(self, key: str) -> None:
        """vLLM's validation of a row's grammar (``_grammar_key``: a JSON schema or a
        structural tag), then the grammar compiled as vLLM's xgrammar backend compiles it
        (in a grammar thread); ValueError: vLLM refuses it."""
        from vllm.exceptions import VLLMClientError

        kind, text = key.split(":", 1)
        params = sampling_params(RowSampling(**{kind: text}), 1)
        try:
            self._verify(params)
        except (VLLMClientError, ValueError) as e:
            raise ValueError(str(e)) from None
        if str(params.structured_outputs._backend or "").startswith("xgrammar"):
            so = self._llm.vllm_config.structured_outputs_config
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

    def stream_decoder(self, keep_special_tokens: bool = False) -> IncrementalDetokenizer:
        return self.text.stream_decoder(keep_special_tokens)

    # ------------------------------------------------------------------ engine side

    def open_batch(self) -> "VLLMBatch":
        self._batches += 1
        return VLLMBatch(self, f"{self.name}-b{self._batches}")

    def warmup(self, batch_sizes: Sequence[int] = (1,)) -> None:
        """Short generations at these batch sizes, through a batch as the replica runs one;
        and the grammar compiler's view of the vocabulary (seconds on a large one), so
        that no request's compile limit pays for it."""
        self._xgrammar()
        steps = max(1, min(4, self.max_seq_len - 2))
        for n in batch_sizes:
            batch = self.open_batch()
            joins = [Join(i, self.encode("Hello", steps), steps) for i in range(n)]
            batch.run_chunk(joins, steps)
            while batch.keys():
                batch.run_chunk([], steps)

    def prefix_report(self, now_s: float) -> Optional[PrefixReport]:
        """The blocks this engine's prefix cache holds, from its KV events (``KVEventFeed``);
        None without the feed (prefix caching off, or no ``prefix_report_blocks``)."""
        return self._kv_feed.report(now_s) if self._kv_feed is not None else None

    def prefix_blocks(self) -> Optional[int]:
        """How many blocks this engine's prefix cache holds, as its KV events say; None without the feed."""
        return self._kv_feed.held_blocks() if self._kv_feed is not None else None

    def stats(self) -> VLLMStats:
        return self._stats.get()

    def engine_pids(self) -> list[int]:
        """The engine-core process(es) and every process under them (on CPU, the worker)."""
        import psutil

        manager = getattr(getattr(self._llm, "engine_core", None), "resources", None)
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
        if self._llm.vllm_config.parallel_config.distributed_executor_backend != "ray":
            return own
        return own + engine_processes([p for p in placement_group_actor_pids() if p not in tree])

    @property
    def lost(self) -> Optional[str]:
        """Why the engine can serve no more (vLLM reported it dead: a rank or its core went
        away); None while it serves. Its rows are held, not failed, from then on: the replica
        goes as a whole (its watchdog has it killed) and the router sends them elsewhere."""
        return self._lost

    def describe(self) -> dict[str, Any]:
        import vllm

        cfg = self._llm.vllm_config if self._llm is not None else None
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


def _kv_feed(engine_kwargs: dict[str, Any], report_blocks: Optional[int]) -> Optional[KVEventFeed]:
    """A feed of the engine's KV-cache events when blocks are to be reported and the prefix
    cache is on, its publisher added to ``engine_kwargs``; None otherwise, and where the
    operator configured vLLM's events for a consumer of their own (left as they are)."""
    caching = {**_DEFAULT_ENGINE_KWARGS, **engine_kwargs}.get("enable_prefix_caching")
    if report_blocks is None or not caching:
        return None
    if "kv_events_config" in engine_kwargs:
        log.info("engine_kwargs.kv_events_config is the operator's: no prefix report for the routers")
        return None
    feed = KVEventFeed(base_adapter=BASE_ADAPTER)
    engine_kwargs["kv_events_config"] = events_config(feed.endpoint)
    return feed


def _precheck_adapters(adapters: Mapping[str, str], model: str) -> None:
    """ModelLoadError for an adapter whose name or directory :meth:`VLLMBackend.add_adapter` refuses."""
    for name, path in adapters.items():
        try:
            _check_adapter_name(name, model, path)
            _adapter_dir(name, path)
        except AdapterRefused as e:
            raise ModelLoadError(e.path, f"adapter {e.name!r}: {e.reason}") from None


def _adapter_dir(name: str, path: str) -> str:
    """``path`` as an absolute local directory (vLLM would take anything else for a
    Hugging Face repository id and download it: nothing is downloaded here)."""
    p = Path(path).expanduser() if isinstance(path, str) and path else None
    if p is None or not p.is_dir():
        raise AdapterRefused(name, str(path), "not a local directory")
    return str(p.resolve())


def _check_adapter_name(name: str, model: str, path: str) -> None:
    """A name a request can give as its ``model`` (alone or as ``<model>:<name>``): printable,
    no whitespace or colon, at most ``_MAX_ADAPTER_NAME`` characters, not the model's own."""
    ok = isinstance(name, str) and 0 < len(name) <= _MAX_ADAPTER_NAME and name.isprintable()
    if not ok or name == model or any(c.isspace() or c == ":" for c in name):
        raise AdapterRefused(
            str(name),
            path,
            f"an adapter's name is 1-{_MAX_ADAPTER_NAME} printable characters, no whitespace or ':', "
            f"and not the model's own name {model!r}",
        )


def _write_zero_adapter(source: Path, out: Path) -> bool:
    """A PEFT adapter in ``out`` shaped as the one in ``source``, every weight zero; False
    when ``source`` holds no ``adapter_model.safetensors`` to shape it from."""
    from safetensors.torch import load_file, save_file
    import torch

    weights = source / "adapter_model.safetensors"
    if not weights.is_file():
        return False
    shutil.copyfile(source / "adapter_config.json", out / "adapter_config.json")
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(weights)).items()}, str(out / weights.name))
    return True


def _in_replica_group(parallel_config: Any) -> None:
    """vLLM's ray executor runs its ranks in the placement group it is handed: the replica's
    own (Serve's), found here in the replica. The engine core that starts the ranks is a
    child process, outside the replica's Ray worker, so it could not find the group itself."""
    if parallel_config.distributed_executor_backend != "ray" or parallel_config.placement_group is not None:
        return
    import ray

    if ray.is_initialized():
        parallel_config.placement_group = ray.util.get_current_placement_group()


def _device_name(vllm_config: Any) -> str:
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


def _row_error(row: "_Row", e: BaseException) -> BaseException:
    """What a row vLLM failed alone answers: ``EngineRefused`` when vLLM refused the request
    as sent (its validation: a client error, a ValueError), naming the schema's field when
    the row has one and vLLM blamed structured outputs; else ``VLLMRequestError``."""
    from vllm.exceptions import VLLMClientError

    if isinstance(e, (VLLMClientError, ValueError)):
        field = str(getattr(e, "parameter", None) or "prompt")
        if row.sampling.json_schema is not None and ("structured" in str(e) or "schema" in str(e)):
            field = row.sampling.json_schema_of
        return EngineRefused(f"{field}: vLLM refuses the request: {e}", field=field)
    return VLLMRequestError(f"vLLM failed request {row.rid}: {type(e).__name__}: {e}")


def _engine_dead(e: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(e, EngineDeadError)


class _Row:
    __slots__ = ("key", "rid", "sampling", "adapter", "unread", "made", "finished", "error", "task", "cached")

    def __init__(self, key: Any, rid: str, sampling: RowSampling, adapter: Optional[str] = None) -> None:
        self.key = key
        self.rid = rid
        self.sampling = sampling
        self.adapter = adapter
        self.cached: Optional[int] = None  # prompt tokens vLLM took from its prefix cache (its first output)
        self.unread: list[int] = []  # ids not yet returned by run_chunk; at most max_new_tokens
        self.made = 0
        self.finished = False
        self.error: Optional[BaseException] = None
        self.task: Optional[asyncio.Task] = None


def chunk_ready(rows: Sequence[_Row], steps: int) -> bool:
    """Whether a chunk can end: a row failed; a row has its first tokens (none returned
    yet: its time to first token is not held for a whole chunk, as vLLM's own server sends
    the first token when it comes); or every row with tokens has ``steps`` unread or
    finished (and at least one row has something)."""
    if not rows or any(r.error is not None for r in rows):
        return True
    if any(r.unread and r.made == len(r.unread) for r in rows):
        return True
    done = [r.finished or len(r.unread) >= steps for r in rows]
    if all(done):
        return True
    return any(done) and all(d for r, d in zip(rows, done) if r.made > 0)


class VLLMBatch:
    """The rows one replica loop has in the engine (see the module docstring).

    ``run_chunk`` and ``remove`` have the contract of ``ballast.model.engine.Batch``; a
    row runs with its join's :class:`RowSampling` (None: greedy), its LoRA adapter (None:
    the base model) and its ``cache_salt`` (vLLM shares prefix blocks only among requests
    of one salt). One caller at a time; the state lives on the backend's engine loop and
    is only touched there.
    """

    def __init__(self, backend: VLLMBackend, prefix: str) -> None:
        self._b = backend
        self._prefix = prefix
        self._rows: dict[Any, _Row] = {}
        self._changed = asyncio.Event()  # created here, only waited on the engine loop
        self._failed: dict[Any, BaseException] = {}  # rows failed alone, until take_failed
        self._cached: dict[Any, int] = {}  # the last chunk's rows' cached prompt tokens

    def keys(self) -> list[Any]:
        return list(self._rows)

    def take_failed(self) -> dict[Any, BaseException]:
        """Rows vLLM failed alone since the last call, with their errors: ``EngineRefused``
        for a request vLLM refused as sent (its validation), ``VLLMRequestError`` for any
        other failure of that request. The other rows went on."""
        out, self._failed = self._failed, {}
        return out

    def cached_tokens(self, key: Any) -> Optional[int]:
        """How many of the row's prompt tokens vLLM took from its prefix cache, for a row
        that had tokens in the last chunk; None when vLLM has not said."""
        return self._cached.get(key)

    def remove(self, keys: "Sequence[Any] | set[Any]") -> None:
        """Abort these rows in vLLM and drop them."""
        gone = [self._rows.pop(k) for k in keys if k in self._rows]
        if gone:
            self._b._call(self._abort(gone), _CALL_SLACK_S)

    def run_chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self._check(joins)
        return self._b._call(self._chunk(joins, steps), self._b.max_wait_s + _CALL_SLACK_S)

    # ------------------------------------------------------------------ internals

    def _check(self, joins: Sequence[Join]) -> None:
        """Raises before the chunk runs: not a Join, a key already in the batch, a row that
        does not fit the context (``ContextTooLong``)."""
        check_joins(joins, self._rows)
        limit = self._b.max_seq_len
        for join in joins:
            if not join.ids or len(join.ids) + join.max_new_tokens > limit:
                raise ContextTooLong(
                    f"row {join.key!r}: {len(join.ids)} prompt ids + {join.max_new_tokens} new tokens must fit "
                    f"the context of {limit}"
                )

    async def _chunk(self, joins: Sequence[Join], steps: int) -> dict[Any, list[int]]:
        out: dict[Any, list[int]] = {join.key: [] for join in joins}
        for join in joins:
            if join.max_new_tokens > 0:
                self._submit(join)
        for key in self._failed:
            out.pop(key, None)
        deadline = time.monotonic() + self._b.max_wait_s
        while not self._ready(steps):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        failed = [r for r in self._rows.values() if r.error is not None]
        for row in failed:  # each alone: the other rows go on
            del self._rows[row.key]
            out.pop(row.key, None)
            self._failed[row.key] = _row_error(row, row.error)
        await self._abort(failed)
        self._cached = {}
        for key, row in list(self._rows.items()):
            if row.unread and row.cached is not None:
                self._cached[key] = row.cached
            out[key] = row.unread
            row.unread = []
            if row.finished:
                del self._rows[key]
        return out

    def _ready(self, steps: int) -> bool:
        return chunk_ready(list(self._rows.values()), steps)

    def _submit(self, join: Join) -> None:
        """``join`` into vLLM as a request of its own, or into ``take_failed`` when it is refused alone."""
        from vllm.inputs import TokensPrompt

        from vllm.exceptions import VLLMClientError

        llm = self._b._llm
        key, adapter, salt = join.key, join.adapter, join.cache_salt
        s = join.sampling if join.sampling is not None else GREEDY
        row = _Row(key, f"{self._prefix}-{key}", s, adapter)
        lora = self._b._lora_request(adapter) if adapter is not None else self._b._base_lora
        if adapter is not None and lora is None:  # removed (or never added): this row alone
            self._failed[key] = EngineRefused(
                f"model: adapter {adapter!r} is not loaded on model {self._b.name!r}", field="model"
            )
            return
        try:
            params = sampling_params(s, join.max_new_tokens)
            ids = [int(i) for i in join.ids]
            tokens = (
                TokensPrompt(prompt_token_ids=ids)
                if salt is None
                else TokensPrompt(prompt_token_ids=ids, cache_salt=salt)
            )
            prompt = llm.renderer.render_cmpl([tokens])[0]
        except (VLLMClientError, ValueError) as e:  # this row's own: it fails alone
            self._failed[key] = _row_error(row, e)
            return
        row.task = asyncio.get_running_loop().create_task(self._pump(row, prompt, params, lora))
        self._rows[key] = row

    async def _pump(self, row: _Row, prompt: Any, params: Any, lora: Any) -> None:
        """Append the request's new ids to ``row`` as vLLM produces them (with the adapter's
        ``LoRARequest`` ``lora``, None: the base model)."""
        try:
            async for output in self._b._llm.generate(prompt, params, row.rid, lora_request=lora):
                new = output.outputs[0].token_ids
                if row.cached is None and output.num_cached_tokens is not None:
                    row.cached = output.num_cached_tokens
                row.unread.extend(new)
                row.made += len(new)
                if output.finished:
                    row.finished = True
                self._changed.set()
        except asyncio.CancelledError:
            raise  # remove(): generate() aborts the request in vLLM on the way out
        except Exception as e:
            if _engine_dead(e):  # the engine's fault, not the row's: held until the replica goes
                self._b._lost = self._b._lost or f"{type(e).__name__}: {e}"
                log.error("engine of %r is dead (%s): its rows wait for the replica to go", self._b.name, e)
                return
            row.error = e
        row.finished = True
        self._changed.set()

    async def _abort(self, rows: Sequence[_Row]) -> None:
        """Cancel the rows' tasks and wait for them: each one's abort has reached vLLM."""
        tasks = [r.task for r in rows if r.task is not None and not r.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
