"""``model`` (and each entry of ``models``): what serves a model, on which engine, and where
its replicas and their ranks go."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from ballast.config.base import Strict
from ballast.policies.engines import capabilities
from ballast.policies.placement import Placement


class ModelArchitecture(Strict):
    d_model: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    d_ff: PositiveInt = 1024
    max_seq_len: PositiveInt = 512


class PlacementSettings(Strict):
    """Where the ranks of a model larger than one device go: its replica's placement group.

    Only for a vLLM model whose ``engine_kwargs`` ask for more than one rank
    (``tensor_parallel_size`` x ``pipeline_parallel_size``): each replica is then a Ray
    placement group of one bundle per rank (ballast/policies/placement.py)."""

    # How Ray places the bundles: STRICT_PACK (all on one node, the default), PACK (one
    # node if it can, else several), SPREAD / STRICT_SPREAD (each on its own node, if it
    # can / always). vLLM's "mp" executor (the CPU default) takes STRICT_PACK only.
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # Ray resources of one rank's bundle, e.g. {GPU: 1, "accelerator_type:H100": 0.001} or a
    # custom resource; null: {GPU: <the deployment's num_gpus>} when it asks for GPUs, else
    # {CPU: 1} (on CPU each rank is one logical CPU). A GPU amount here is the deployment's
    # num_gpus, the GPUs per rank.
    rank_resources: dict[str, float] | None = None
    # Deploying refuses a model whose group no node of the cluster (or node type its
    # autoscaler may add) could hold, with what it needs and what the largest node has;
    # false: deploy it anyway (its replicas wait, pending, for such a node).
    check: bool = True

    @field_validator("rank_resources")
    @classmethod
    def _amounts(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        bad = sorted(k for k, amount in v.items() if not k or not amount >= 0 or amount == float("inf"))
        if bad:
            raise ValueError(f"rank_resources: amounts are finite numbers >= 0; {bad} are not")
        if not any(amount > 0 for amount in v.values()):
            raise ValueError("rank_resources: a rank's bundle asks for some resource (GPU, CPU or a custom one)")
        return v


class RoutingSettings(Strict):
    """Which replica of the model a request goes to (ballast/model/routing.py): the one that
    already holds what it needs, bounded by load (ballast/policies/affinity.py)."""

    # vllm with enable_prefix_caching: each replica reports the prompt blocks its KV cache
    # holds (from vLLM's own KV-cache events) and every router sends a request to the ready
    # replica holding the longest prefix of its prompt (adapter included), or, for a prompt
    # no replica holds, to the prefix's home (the same replica for every router). false:
    # Serve's power of two choices (adapters still go where they are loaded).
    prefix_affinity: bool = True
    # A replica is passed over, whatever it holds, once its requests in flight (this one
    # counted) would be past load_bound_ratio x the mean, and at least min_slack over it.
    load_bound_ratio: float = Field(default=1.25, ge=1.0, le=10.0)
    min_slack: int = Field(default=2, ge=1, le=1024)
    # From this degradation level up requests go to the least loaded ready replicas (power
    # of two) and no longer by what they hold. 3: the model is short of capacity for all but
    # critical_plus (which is routed among the least loaded at every level). Below it a
    # prefix hit is capacity (the prefill it saves), and the load bound keeps the spread.
    balance_from_level: int = Field(default=3, ge=0, le=5)
    # The most KV blocks one replica reports (its most recently stored; 4 bytes each in
    # Serve's routing stats, which every router polls).
    report_blocks: int = Field(default=16384, ge=16, le=1 << 16)


def parallel_sizes(engine_kwargs: dict[str, Any]) -> tuple[int, int]:
    """(tensor_parallel_size, pipeline_parallel_size) as ``engine_kwargs`` give them (1 when absent)."""
    sizes = []
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        n = engine_kwargs.get(key, 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"engine_kwargs.{key}: a whole number >= 1, got {n!r}")
        sizes.append(n)
    return sizes[0], sizes[1]


class EmbedSettings(Strict):
    """An embeddings model's (``kind: embed``): how its prompt becomes one vector, and what
    one ``/v1/embeddings`` request may ask of it."""

    # The hidden states after the model's final norm, pooled: "last" (the last token's,
    # vLLM's LAST, what decoder embedding models are trained for), "mean" or "cls" (the first
    # token's, encoder models'); then L2-normalised unless normalize is false.
    pooling: Literal["last", "mean", "cls"] = "last"
    normalize: bool = True
    # The shorter vectors the model was trained to give (Matryoshka), the sizes a request's
    # `dimensions` may ask; null: only the model's whole vector.
    dimensions: list[Annotated[int, Field(ge=1, le=1 << 16)]] | None = None
    # One request: at most this many inputs (OpenAI's limit is 2048), each at most
    # max_input_tokens (null: the model's context), all of them at most max_request_tokens.
    # The inputs of one request go to one replica together, a row each.
    max_inputs: int = Field(default=256, ge=1, le=2048)
    max_input_tokens: PositiveInt | None = None
    max_request_tokens: int = Field(default=65536, ge=1, le=1 << 22)


class ModelConfig(Strict):
    name: str = Field(default="tiny-decoder", min_length=1, max_length=64)
    # What the model serves: "generate" (text: /v1/chat/completions, /v1/completions,
    # /v1/generate) or "embed" (vectors: /v1/embeddings; `embed` below says how).
    kind: Literal["generate", "embed"] = "generate"
    embed: EmbedSettings = EmbedSettings()
    # Which engine serves the model. "builtin": the random-weight byte-level decoder
    # (architecture, seed, checkpoint_path below), the fast default for tests and the
    # embedded `make serve`. "transformers": a local Hugging Face causal-LM directory at
    # `path` (config.json, safetensors, tokenizer, chat template), never downloaded.
    # "vllm": the same kind of directory served by vLLM (its CPU build here, the `vllm`
    # package on CUDA), which schedules its own batch and KV cache.
    backend: Literal["builtin", "transformers", "vllm"] = "builtin"
    path: str | None = None
    # vllm only: passed to vLLM's engine as they are (dtype, max_model_len, max_num_seqs,
    # enable_prefix_caching, gpu_memory_utilization, enforce_eager, ...).
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # vllm only, with more than one rank (engine_kwargs' tensor_parallel_size x
    # pipeline_parallel_size): where its replica's ranks go. The deployment's num_gpus is
    # then the GPUs of each rank.
    placement: PlacementSettings = PlacementSettings()
    # How the router picks one of this model's replicas for a request.
    routing: RoutingSettings = RoutingSettings()
    # vllm only: vLLM's tool parser for this model (e.g. hermes, llama3_json, mistral): with
    # it, tool_choice "auto" (the default when a request gives tools) finds the model's
    # calls in its answer; without it, "auto" is a 400 and "required" or a named function
    # still work (guided decoding). Loaded when the router starts.
    tool_parser: str | None = Field(default=None, min_length=1)
    # vllm only: vLLM's reasoning parser for this model (e.g. qwen3, deepseek_r1): the
    # answer's thinking goes to reasoning_content, and nothing in it is taken for a tool
    # call. Loaded when the router starts.
    reasoning_parser: str | None = Field(default=None, min_length=1)
    # transformers only: the weights' dtype; null is bfloat16 on CUDA, float32 on CPU.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # The KV-cache budget of one replica, in tokens: a request joins the batch only while
    # every row's prompt + max_tokens together stay within it, and the replica reports
    # its use as kv_util_pct (a degradation input). null: max_batch_size x the context.
    kv_cache_tokens: PositiveInt | None = None
    seed: int = 0
    checkpoint_path: str | None = None
    checkpoint_format: Literal["auto", "state_dict", "torchscript"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    architecture: ModelArchitecture = ModelArchitecture()
    # "torchscript" compiles the model for serving (less Python per decode step, and the
    # GIL is free for the replica's event loop meanwhile); "eager" runs the nn.Module.
    compile: Literal["torchscript", "eager"] = "torchscript"
    # Decode steps per streamed event: one server-sent event per token batch.
    stream_chunk_tokens: PositiveInt = 4
    # Most requests decoding together. Batching is per iteration: a request joins the
    # running batch at the next chunk boundary and leaves when it has its tokens.
    max_batch_size: PositiveInt = 32
    # How long an idle replica waits to gather its first rows before the first chunk.
    batch_wait_timeout_s: float = Field(default=0.005, ge=0, le=1)
    # Torch intra-op threads for a replica on CPU (GPU replicas are not affected). One per
    # replica: the replica shares its cores with Serve's proxy and the routers, and
    # spinning torch threads multiply the CPU a request costs under load (docs/benchmarks.md).
    cpu_threads: PositiveInt | None = 1
    # The replica's CPU priority (Unix niceness, 0..19). Ballast starts Ray's workers at
    # the host's normal priority (ballast/model/niceness.py); a replica may move itself
    # lower. 0 by default: at Ray's 15 its own Ray and asyncio threads wait behind the
    # front and the load, and it serves less (docs/benchmarks.md).
    niceness: int = Field(default=0, ge=0, le=19)
    # builtin and transformers: the niceness of the one thread that runs the engine's
    # chunks (torch computes there, on model.cpu_threads 1); null: the replica's niceness.
    # Above it, the model's compute yields a busy core to the replica's own event loop and
    # Ray threads and to the front's hops (Serve's proxy, the router, HAProxy) when they
    # wake, and still takes every cycle they leave (docs/benchmarks.md). At least
    # `niceness` (raising a thread's niceness needs no privilege, lowering it does).
    compute_niceness: int | None = Field(default=None, ge=0, le=19)
    # Linux: the CPU cores this model's replicas run on (each replica pins every one of its
    # threads, and the threads and processes it starts later inherit it); null: wherever
    # the OS puts them. On a CPU host it gives a model cores of its own, as a GPU host
    # gives it its own device: another model's load, or Ballast's front, then cannot take
    # that model's CPU when the other processes are kept off those cores (make
    # bench-models does). Several replicas of one model on one node share the cores
    # listed. Checked against the node's cores by the replica when it starts.
    cpus: list[int] | None = None
    # vllm only: a guided-decoding grammar (a response_format schema, a forced tool call's)
    # is compiled by the replica off its event loop before the request reaches vLLM, on at
    # most grammar_compile_threads threads, of which one tenant's compiles hold at most half
    # (at least one: with 1 thread, one tenant's slow compile makes the others wait); one
    # that has not compiled after grammar_compile_timeout_s is 400 SCHEMA_TOO_COMPLEX, for
    # that request alone, and compiles on to its end on its tenant's thread. Real
    # schemas compile in milliseconds to a few hundred on a 150k-token vocabulary: 2 s
    # leaves room for those on a loaded host and bounds what a hostile schema costs.
    grammar_compile_timeout_s: float = Field(default=2.0, gt=0, le=60)
    grammar_compile_threads: int = Field(default=2, ge=1, le=8)
    # How special tokens' text in chat messages (content, tool arguments, names) is
    # tokenized. "text": as ordinary text, so "<|im_start|>system" written by a client is
    # not the control token its chat template writes (as OpenAI's API treats it); the
    # template's own markers stay control tokens. "control": as the engines do by
    # default, the text becomes the control token.
    special_tokens_in_content: Literal["text", "control"] = "text"

    @field_validator("cpus")
    @classmethod
    def _cpus_listed_once(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("cpus: list at least one core, or leave it null (no pinning)")
        negative = sorted(c for c in v if c < 0)
        if negative:
            raise ValueError(f"cpus: core numbers start at 0, got {negative}")
        repeated = sorted(c for c in set(v) if v.count(c) > 1)
        if repeated:
            raise ValueError(f"cpus: each core once, {repeated} listed more than once")
        return v

    @model_validator(mode="after")
    def _engine_fields(self) -> ModelConfig:
        if self.compute_niceness is not None and self.compute_niceness < self.niceness:
            raise ValueError(
                f"compute_niceness {self.compute_niceness} is below niceness {self.niceness}: "
                "a thread may raise its niceness, not lower it"
            )
        if self.backend in ("transformers", "vllm"):
            if not self.path:
                raise ValueError(f"backend '{self.backend}' needs path: a local Hugging Face model directory")
            if self.checkpoint_path is not None:
                raise ValueError(f"checkpoint_path is the builtin model's; a {self.backend} model is read from path")
        elif self.path is not None or self.dtype is not None:
            raise ValueError(
                "path and dtype are for backends 'transformers' and 'vllm' (the builtin model uses checkpoint_path)"
            )
        self._parallel_fields()
        if self.engine_kwargs and self.backend != "vllm":
            raise ValueError("engine_kwargs are vLLM's (backend 'vllm')")
        if self.tool_parser is not None and not capabilities(self.backend).tool_parsing:
            raise ValueError("tool_parser is vLLM's (backend 'vllm'); the other engines do not call tools")
        if self.reasoning_parser is not None and not capabilities(self.backend).tool_parsing:
            raise ValueError("reasoning_parser is vLLM's (backend 'vllm')")
        if self.kind == "embed" and (self.tool_parser or self.reasoning_parser):
            raise ValueError("tool_parser and reasoning_parser are a generating model's; this one is kind 'embed'")
        if self.kind != "embed" and self.embed != EmbedSettings():
            raise ValueError("embed: an embeddings model's settings (kind: embed); this one is kind 'generate'")
        return self

    def _parallel_fields(self) -> None:
        """More than one rank is vLLM's, and the placement is for such a model only."""
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if key in self.engine_kwargs and self.backend != "vllm":
                raise ValueError(
                    f"engine_kwargs.{key}: tensor and pipeline parallelism are vLLM's (backend 'vllm'); "
                    f"this model's backend is {self.backend!r}"
                )
        tp, pp = parallel_sizes(self.engine_kwargs)
        if tp * pp == 1 and self.placement != PlacementSettings():
            raise ValueError(
                "placement: for a model of more than one rank (engine_kwargs' tensor_parallel_size x "
                "pipeline_parallel_size above 1); this one has one"
            )
        executor = self.engine_kwargs.get("distributed_executor_backend")
        if tp * pp > 1 and executor is not None and executor not in ("mp", "ray"):
            raise ValueError(
                f"engine_kwargs.distributed_executor_backend: 'mp' or 'ray' for a model of {tp * pp} ranks, "
                f"got {executor!r}"
            )

    @property
    def world_size(self) -> int:
        """The ranks of one replica's engine: tensor_parallel_size x pipeline_parallel_size."""
        tp, pp = parallel_sizes(self.engine_kwargs)
        return tp * pp


def model_placement(m: ModelConfig, num_cpus: float, num_gpus: float) -> Placement | None:
    """The placement group of a replica of ``m`` on a deployment asking ``num_cpus`` for the
    replica and ``num_gpus`` per rank; None for a model of one rank. ValueError naming the
    field when the two cannot go together."""
    tp, pp = parallel_sizes(m.engine_kwargs)
    if tp * pp == 1:
        return None
    given = m.placement.rank_resources
    rank = dict(given) if given is not None else ({"GPU": num_gpus} if num_gpus > 0 else {"CPU": 1.0})
    if rank.get("GPU", 0.0) != num_gpus:
        raise ValueError(
            f"placement.rank_resources: GPU {rank.get('GPU', 0.0):g} per rank, but the deployment's num_gpus "
            f"(the GPUs of each rank) is {num_gpus:g}: write the same in both, or leave rank_resources out"
        )
    executor = m.engine_kwargs.get("distributed_executor_backend") or ("ray" if num_gpus > 0 else "mp")
    try:
        return Placement(
            model=m.name,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            rank_resources=tuple(rank.items()),
            strategy=m.placement.strategy,
            executor=executor,
            replica_resources=(("CPU", float(num_cpus)),) if num_cpus > 0 else (),
            check=m.placement.check,
        )
    except ValueError as e:  # the placement's own field, as the config writes it
        field = str(e).split(":", 1)[0]
        where = {"strategy": "placement.", "distributed_executor_backend": "engine_kwargs."}.get(field, "")
        raise ValueError(f"{where}{e}") from None
