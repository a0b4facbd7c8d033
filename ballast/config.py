"""Ballast configuration: one pydantic model, loadable from YAML, validated where it is built.

The same model is carried by ``cluster/local.yaml`` (embedded local Ray) and by the
Serve config for ``serve deploy`` (``cluster/serve_config.yaml``, under the
application's ``args``). Policies get frozen dataclasses built from it, one way
only: the settings model that holds a policy's fields has a ``<policy>_config()``
method returning that policy's config (``BallastConfig.degradation_config()``,
``GateSettings.limiter_config()``, ``BreakerSettings.breaker_config()``, ...); they
never see pydantic, and nothing else builds a policy config from settings.

Secrets (API keys, admin token) never need to sit in a config file: they come
from the environment or from a file named here. ``demo_keys`` / ``demo_admin_token``
exist for the local demo only and are refused when ``environment`` is
``production``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Optional, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from ballast.policies.adapters import MAX_PATH_CHARS
from ballast.policies.autoscale import AutoscaleConfig
from ballast.policies.catalog import AdapterEntry, Catalog, ModelEntry, name_problem
from ballast.policies.breaker import BreakerConfig
from ballast.policies.retry import RetryConfig
from ballast.policies.limiter import LimiterConfig
from ballast.policies.criticality import Criticality
from ballast.policies.degradation import DEFAULT_CONSTRAINTS, DegradationConfig, LevelConstraints
from ballast.policies.fairness import FairnessConfig
from ballast.policies.leak import LadderConfig, LeakConfig
from ballast.policies.placement import Placement
from ballast.policies.recycle import RecycleConfig
from ballast.policies.schema import SchemaBounds

from ballast.errors import ConfigError
from ballast.names import fallback_deployment_name, model_deployment_name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _ordered(settings: BaseModel, *names: str) -> None:
    """Raise ValueError ("a must be <= b") unless the named settings do not decrease."""
    for low, high in zip(names, names[1:]):
        if getattr(settings, low) > getattr(settings, high):
            raise ValueError(f"{low} must be <= {high}")


FrozenConfig = TypeVar("FrozenConfig")
#: Engines that batch and schedule their rows themselves: the replica only bounds how many
#: are in them (ballast/model/engine.py).
SELF_SCHEDULING = frozenset({"vllm"})


def frozen_config(config_cls: "type[FrozenConfig]", settings: BaseModel, **given: Any) -> FrozenConfig:
    """A frozen config dataclass (a policy's, an engine's) from ``settings``: each of its
    fields that ``given`` does not name (renamed or derived values) is the setting of the
    same name, a list made a tuple; a field with no such setting keeps its default."""
    taken = {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(config_cls)  # type: ignore[arg-type]
        if f.name not in given and f.name in type(settings).model_fields
    }
    taken = {name: tuple(v) if isinstance(v, list) else v for name, v in taken.items()}
    return config_cls(**taken, **given)


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # What listens on host:port. "haproxy": Serve's HAProxy mode (an HAProxy per node in
    # front of the router replicas, which serve HTTP themselves); "proxy": Serve's
    # Python HTTP proxy actor. Fixed when Ray starts (environment of Ray's processes).
    ingress: Literal["haproxy", "proxy"] = "haproxy"
    # Serve's per-request access log lines from the router and model replicas. Ballast's
    # own metrics count every request by tenant, criticality and code; the lines cost
    # CPU on every request (docs/benchmarks.md), so they are off by default.
    access_log: bool = False
    # GET /docs, the browsable page of the contract; GET /openapi.json is always served.
    docs_page: bool = True
    # Serve's replica fast path: user code and the handles' request routing run on the
    # replica's own event loop instead of threads of their own, and replica logs go to
    # their files only, not also to stderr. Fixed when Ray starts, like ``ingress``.
    fast_path: bool = True
    # HAProxy refuses the classes the degradation level sheds (by the request's
    # X-Ballast-Criticality header) before Python runs: ballast/router/edge.py. Only
    # with ingress "haproxy"; fixed when Ray starts, like ``ingress``.
    edge: bool = True
    # With ingress "haproxy": how long a stopping router replica stays reachable so that
    # HAProxy drops it before it refuses new connections (HAProxy then retries another);
    # None: Serve's default, 30 s. Every redeploy, recycle and stop of a router waits
    # this long. Fixed when Ray starts, like ``ingress``.
    router_drain_s: Optional[float] = Field(None, ge=0)
    # /health and /healthz/ready answer from the router's cached readiness: the model is
    # pinged at most once per this interval, one ping in flight however many callers,
    # a failed ping cached as well (ballast/router/readiness.py).
    ready_probe_interval_s: float = Field(1.0, gt=0, le=60)
    # When set, /admin/* and /v1/status are served only on 127.0.0.1:<admin_port> by
    # each router replica (the public port answers 404 for them); the CLI's pid file
    # names this URL. None: the admin routes share the public port.
    admin_port: Optional[int] = Field(None, ge=1, le=65535)

    @model_validator(mode="after")
    def _admin_port_apart(self) -> "HttpConfig":
        if self.admin_port is not None and self.admin_port == self.port:
            raise ValueError(f"admin_port: must differ from port ({self.port})")
        return self


class ModelArchitecture(_Strict):
    d_model: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    d_ff: PositiveInt = 1024
    max_seq_len: PositiveInt = 512


class PlacementSettings(_Strict):
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
    rank_resources: Optional[dict[str, float]] = None
    # Deploying refuses a model whose group no node of the cluster (or node type its
    # autoscaler may add) could hold, with what it needs and what the largest node has;
    # false: deploy it anyway (its replicas wait, pending, for such a node).
    check: bool = True

    @field_validator("rank_resources")
    @classmethod
    def _amounts(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if v is None:
            return v
        bad = sorted(k for k, amount in v.items() if not k or not amount >= 0 or amount == float("inf"))
        if bad:
            raise ValueError(f"rank_resources: amounts are finite numbers >= 0; {bad} are not")
        if not any(amount > 0 for amount in v.values()):
            raise ValueError("rank_resources: a rank's bundle asks for some resource (GPU, CPU or a custom one)")
        return v


class RoutingSettings(_Strict):
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
    load_bound_ratio: float = Field(1.25, ge=1.0, le=10.0)
    min_slack: int = Field(2, ge=1, le=1024)
    # From this degradation level up requests go to the least loaded ready replicas (power
    # of two) and no longer by what they hold. 3: the model is short of capacity for all but
    # critical_plus (which is routed among the least loaded at every level). Below it a
    # prefix hit is capacity (the prefill it saves), and the load bound keeps the spread.
    balance_from_level: int = Field(3, ge=0, le=5)
    # The most KV blocks one replica reports (its most recently stored; 4 bytes each in
    # Serve's routing stats, which every router polls).
    report_blocks: int = Field(16384, ge=16, le=1 << 16)


def parallel_sizes(engine_kwargs: dict[str, Any]) -> tuple[int, int]:
    """(tensor_parallel_size, pipeline_parallel_size) as ``engine_kwargs`` give them (1 when absent)."""
    sizes = []
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        n = engine_kwargs.get(key, 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"engine_kwargs.{key}: a whole number >= 1, got {n!r}")
        sizes.append(n)
    return sizes[0], sizes[1]


class ModelConfig(_Strict):
    name: str = Field("tiny-decoder", min_length=1, max_length=64)
    # Which engine serves the model. "builtin": the random-weight byte-level decoder
    # (architecture, seed, checkpoint_path below), the fast default for tests and the
    # embedded `make serve`. "transformers": a local Hugging Face causal-LM directory at
    # `path` (config.json, safetensors, tokenizer, chat template), never downloaded.
    # "vllm": the same kind of directory served by vLLM (its CPU build here, the `vllm`
    # package on CUDA), which schedules its own batch and KV cache.
    backend: Literal["builtin", "transformers", "vllm"] = "builtin"
    path: Optional[str] = None
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
    tool_parser: Optional[str] = Field(None, min_length=1)
    # vllm only: vLLM's reasoning parser for this model (e.g. qwen3, deepseek_r1): the
    # answer's thinking goes to reasoning_content, and nothing in it is taken for a tool
    # call. Loaded when the router starts.
    reasoning_parser: Optional[str] = Field(None, min_length=1)
    # transformers only: the weights' dtype; null is bfloat16 on CUDA, float32 on CPU.
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    # The KV-cache budget of one replica, in tokens: a request joins the batch only while
    # every row's prompt + max_tokens together stay within it, and the replica reports
    # its use as kv_util_pct (a degradation input). null: max_batch_size x the context.
    kv_cache_tokens: Optional[PositiveInt] = None
    seed: int = 0
    checkpoint_path: Optional[str] = None
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
    batch_wait_timeout_s: float = Field(0.005, ge=0, le=1)
    # Torch intra-op threads for a replica on CPU (GPU replicas are not affected). One per
    # replica: the replica shares its cores with Serve's proxy and the routers, and
    # spinning torch threads multiply the CPU a request costs under load (docs/benchmarks.md).
    cpu_threads: Optional[PositiveInt] = 1
    # The replica's CPU priority (Unix niceness, 0..19). Ballast starts Ray's workers at
    # the host's normal priority (ballast/model/niceness.py); a replica may move itself
    # lower. 0 by default: at Ray's 15 its own Ray and asyncio threads wait behind the
    # front and the load, and it serves less (docs/benchmarks.md).
    niceness: int = Field(0, ge=0, le=19)
    # builtin and transformers: the niceness of the one thread that runs the engine's
    # chunks (torch computes there, on model.cpu_threads 1); null: the replica's niceness.
    # Above it, the model's compute yields a busy core to the replica's own event loop and
    # Ray threads and to the front's hops (Serve's proxy, the router, HAProxy) when they
    # wake, and still takes every cycle they leave (docs/benchmarks.md). At least
    # `niceness` (raising a thread's niceness needs no privilege, lowering it does).
    compute_niceness: Optional[int] = Field(None, ge=0, le=19)
    # Linux: the CPU cores this model's replicas run on (each replica pins every one of its
    # threads, and the threads and processes it starts later inherit it); null: wherever
    # the OS puts them. On a CPU host it gives a model cores of its own, as a GPU host
    # gives it its own device: another model's load, or Ballast's front, then cannot take
    # that model's CPU when the other processes are kept off those cores (make
    # bench-models does). Several replicas of one model on one node share the cores
    # listed. Checked against the node's cores by the replica when it starts.
    cpus: Optional[list[int]] = None
    # vllm only: a guided-decoding grammar (a response_format schema, a forced tool call's)
    # is compiled by the replica off its event loop before the request reaches vLLM, on at
    # most grammar_compile_threads threads, of which one tenant's compiles hold at most half
    # (at least one: with 1 thread, one tenant's slow compile makes the others wait); one
    # that has not compiled after grammar_compile_timeout_s is 400 SCHEMA_TOO_COMPLEX, for
    # that request alone, and compiles on to its end on its tenant's thread. Real
    # schemas compile in milliseconds to a few hundred on a 150k-token vocabulary: 2 s
    # leaves room for those on a loaded host and bounds what a hostile schema costs.
    grammar_compile_timeout_s: float = Field(2.0, gt=0, le=60)
    grammar_compile_threads: int = Field(2, ge=1, le=8)
    # How special tokens' text in chat messages (content, tool arguments, names) is
    # tokenized. "text": as ordinary text, so "<|im_start|>system" written by a client is
    # not the control token its chat template writes (as OpenAI's API treats it); the
    # template's own markers stay control tokens. "control": as the engines do by
    # default, the text becomes the control token.
    special_tokens_in_content: Literal["text", "control"] = "text"

    @field_validator("cpus")
    @classmethod
    def _cpus_listed_once(cls, v: Optional[list[int]]) -> Optional[list[int]]:
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
    def _engine_fields(self) -> "ModelConfig":
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
        if self.tool_parser is not None and self.backend != "vllm":
            raise ValueError("tool_parser is vLLM's (backend 'vllm'); the other engines do not call tools")
        if self.reasoning_parser is not None and self.backend != "vllm":
            raise ValueError("reasoning_parser is vLLM's (backend 'vllm')")
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


def model_placement(m: ModelConfig, num_cpus: float, num_gpus: float) -> Optional[Placement]:
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


class _DeploymentSettings(_Strict):
    """What every Ballast deployment sets in Serve, built into options in one place."""

    max_ongoing_requests: PositiveInt = 32
    # Bounded: requests beyond this wait nowhere, the handle refuses them at once.
    max_queued_requests: PositiveInt = 64
    num_cpus: float = Field(0, ge=0)

    def serve_options(
        self, name: str, access_log: bool, placement: Optional[Placement] = None, **own: Any
    ) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment``: the shared ones, then ``own``. With a
        ``placement`` (a model of several ranks), each replica is its placement group: one
        bundle per rank, the replica actor in the first with its CPUs and no GPU (the
        ranks hold the GPUs; ``num_gpus`` is theirs)."""
        resources = {"num_cpus": self.num_cpus}
        if hasattr(self, "num_gpus"):
            resources["num_gpus"] = 0 if placement is not None else self.num_gpus  # type: ignore[attr-defined]
        if placement is not None:
            own = dict(own, placement_group_bundles=placement.bundles(), placement_group_strategy=placement.strategy)
        return dict(
            name=name,
            max_ongoing_requests=self.max_ongoing_requests,
            max_queued_requests=self.max_queued_requests,
            ray_actor_options=resources,
            logging_config={"enable_access_log": access_log},
            **own,
        )


class ModelDeploymentConfig(_DeploymentSettings):
    min_replicas: int = Field(1, ge=1)
    max_replicas: PositiveInt = 2
    initial_replicas: Optional[PositiveInt] = None
    num_gpus: float = Field(0, ge=0)
    health_check_period_s: PositiveFloat = 2.0
    health_check_timeout_s: PositiveFloat = 10.0
    graceful_shutdown_timeout_s: PositiveFloat = 10.0

    @model_validator(mode="after")
    def _bounds(self) -> "ModelDeploymentConfig":
        _ordered(self, "min_replicas", "max_replicas")
        if self.initial_replicas is not None and not (self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("initial_replicas must lie within [min_replicas, max_replicas]")
        return self


class RouterDeploymentConfig(_DeploymentSettings):
    num_replicas: PositiveInt = 1
    max_ongoing_requests: PositiveInt = 512
    max_queued_requests: PositiveInt = 256
    # 1: at most one router per node, so num_replicas routers sit on as many nodes. Serve
    # starts its proxy (and HAProxy) only on nodes that run a replica: a node that lost
    # its router, or one that replaces a lost node, serves HTTP again once a router lands
    # there. A router for which no node has room waits, pending, for one.
    max_replicas_per_node: Optional[PositiveInt] = None


class DeploymentsConfig(_Strict):
    model: ModelDeploymentConfig = ModelDeploymentConfig()
    router: RouterDeploymentConfig = RouterDeploymentConfig()


class ControllerConfig(_Strict):
    name: str = "ballast-controller"
    namespace: str = "ballast"
    tick_s: float = Field(0.5, gt=0, le=1.0)
    # How often routers and replicas push a report (and pull the snapshot back).
    report_interval_s: float = Field(0.5, gt=0, le=5)
    # A report older than this no longer counts (its sender is gone or stuck).
    report_expiry_s: PositiveFloat = 3.0
    # A snapshot older than this is stale: keep it up to max_stale_s, then fail static.
    snapshot_stale_s: PositiveFloat = 3.0
    snapshot_max_stale_s: PositiveFloat = 15.0
    # The conservative level used once the snapshot is older than snapshot_max_stale_s.
    fail_static_level: int = Field(1, ge=0, le=4)
    # Outcome window for the error rate.
    error_window_s: PositiveFloat = 10.0
    call_timeout_s: PositiveFloat = 1.0
    # Ray CPUs the controller and the shared idempotency key table ask for. Above 0 they
    # cannot land on a head started with --num-cpus=0 (cluster/cluster.yaml), so they
    # live on a worker and keep working while the head is down.
    num_cpus: float = Field(0, ge=0)

    @model_validator(mode="after")
    def _stale_order(self) -> "ControllerConfig":
        _ordered(self, "snapshot_stale_s", "snapshot_max_stale_s")
        return self


class LevelConstraintsModel(_Strict):
    max_tokens: PositiveInt
    max_batch_size: PositiveInt
    streaming: bool
    admitted: list[Criticality]


def _default_levels() -> list[LevelConstraintsModel]:
    return [LevelConstraintsModel(**c.to_dict()) for c in DEFAULT_CONSTRAINTS]


class DegradationSettings(_Strict):
    queue_length_thresholds: tuple[int, int, int, int] = (50, 100, 200, 500)
    queue_wait_ms_thresholds: tuple[float, float, float, float] = (250.0, 500.0, 1000.0, 2000.0)
    # The primary replicas' KV token budget reserved, percent (llm-d sheds at 80).
    kv_util_pct_thresholds: tuple[Optional[float], Optional[float], Optional[float], Optional[float]] = (
        80.0,
        90.0,
        97.0,
        None,
    )
    gpu_util_pct_thresholds: tuple[Optional[float], Optional[float], Optional[float], Optional[float]] = (
        85.0,
        92.0,
        97.0,
        None,
    )
    vram_pct_thresholds: tuple[Optional[float], Optional[float], Optional[float], Optional[float]] = (
        None,
        None,
        97.0,
        99.0,
    )
    error_rate_threshold: float = Field(0.1, gt=0, le=1)
    error_rate_min_requests: PositiveInt = 20
    # Shed a whole class at the door only when the classes kept fill the model by
    # themselves: level k when the demand of what it admits >= ratio x capacity
    # (ballast/policies/degradation.py). null: demand never asks for a level.
    demand_shed_ratio: Optional[float] = Field(1.1, gt=0)
    # Routers measure demand by criticality and the gate's throughput over this window.
    demand_window_s: PositiveFloat = 5.0
    # The capacity demand is held against: the most the gates answered while full over this
    # long, so a host's stall of a few seconds does not read as a smaller model. 0: the
    # latest window alone.
    capacity_window_s: float = Field(30.0, ge=0)
    stable_window_s: PositiveFloat = 30.0  # a lower target must hold this long; then the level drops to it
    # One report moves the level one up; a higher target asked for this long moves it all the way.
    up_confirm_s: PositiveFloat = 1.0
    # While fewer primary replicas serve than wanted (recycle, kill, crash, scale-up), queue
    # length, queue wait and demand hold the level but do not raise it, for at most
    # capacity_gap_max_s and capacity_gap_settle_s after (ballast/policies/degradation.py).
    capacity_gap_max_s: float = Field(120.0, ge=0)
    capacity_gap_settle_s: float = Field(10.0, ge=0)
    levels: list[LevelConstraintsModel] = Field(default_factory=_default_levels, min_length=5, max_length=5)


class AutoscaleSettings(_Strict):
    target_ongoing_requests: PositiveFloat = 8.0
    target_gpu_util_pct: Optional[float] = Field(80.0, gt=0, le=100)
    stable_window_s: PositiveFloat = 60.0
    panic_window_s: PositiveFloat = 6.0
    panic_threshold_ratio: PositiveFloat = 2.0
    scale_down_delay_s: float = Field(30.0, ge=0)
    max_scale_down_step: PositiveInt = 1
    # The Serve policy adapter trusts the controller's decision while it is younger than this.
    decision_max_age_s: PositiveFloat = 5.0


class LimitsConfig(_Strict):
    """What one request may ask (docs/api.md, "Limits"); past a bound, a 4xx naming the field."""

    max_body_bytes: PositiveInt = 64 * 1024
    max_prompt_bytes: PositiveInt = 16 * 1024
    max_tokens_limit: PositiveInt = 8192
    # Arrays and objects nested in a body. The deepest real body is a schema inside
    # response_format or a tool (4-5 levels down, itself at most max_schema_depth);
    # the parse, validation and serializers recurse once per level, Python's limit is 1000.
    max_json_depth: int = Field(64, ge=8, le=256)
    # Characters in one stop string (at most 4 strings, OpenAI's limit). Stops are
    # markers ("\n\n", "</answer>", "User:"); the held-back check on each streamed piece
    # grows with the square of the longest stop, on the router's and the replica's loops.
    max_stop_chars: int = Field(256, ge=1, le=4096)
    # A schema guided decoding compiles (response_format, a tool's parameters, the array
    # tool_choice "required" builds over every tool): its nesting, and its nodes (every
    # object, array and value). OpenAI allows 10 levels of nested objects (~20 JSON levels).
    # 4096 nodes take ~0.4 s to compile on one core with a 32k vocabulary.
    max_schema_depth: int = Field(32, ge=2, le=128)
    max_schema_nodes: int = Field(4096, ge=16, le=1_000_000)
    # What else the grammar spells out (ballast/policies/schema.py): each pattern, as written
    # and with its counted repetitions unrolled ("(.{1,16}){1,16}" is 256); the counts the
    # schema asks (minLength, maxLength, minItems, maxItems, min/maxProperties; each schema
    # object its largest), summed; the characters of its property and definition names, enum
    # and const strings and patterns, summed (OpenAI's own bound on names and values is 120,000).
    # The tools' schemas count together. Within these a schema can still compile slowly (an
    # ambiguous pattern grows much faster than its size): the replica's compile time limit
    # and its threads' share per tenant (model.grammar_compile_*) answer for that.
    max_schema_pattern_chars: int = Field(128, ge=8, le=4096)
    max_schema_repeat: int = Field(1024, ge=16, le=1_000_000)
    max_schema_literal_chars: int = Field(32768, ge=256, le=1 << 20)

    def schema_bounds(self) -> SchemaBounds:
        return SchemaBounds(
            max_depth=self.max_schema_depth,
            max_nodes=self.max_schema_nodes,
            max_repeat=self.max_schema_repeat,
            max_pattern_chars=self.max_schema_pattern_chars,
            max_literal_chars=self.max_schema_literal_chars,
        )


class BreakerSettings(_Strict):
    """Defaults: 50 % failures over 100 calls / 60 s, at least 10 calls, open 30 s, 5 probes."""

    window_kind: Literal["count", "time"] = "count"
    window_size: PositiveInt = 100
    window_s: PositiveFloat = 60.0
    min_calls: PositiveInt = 10
    failure_rate_threshold: float = Field(0.5, gt=0, le=1)
    slow_call_duration_s: PositiveFloat = 10.0
    slow_call_rate_threshold: float = Field(1.0, gt=0, le=1)
    open_duration_s: PositiveFloat = 30.0
    open_jitter_ratio: float = Field(0.1, ge=0, lt=1)
    half_open_max_probes: PositiveInt = 5
    half_open_success_threshold: float = Field(0.8, gt=0, le=1)
    # Once a half-open period has handed out its first probe it must decide within
    # this long, else back to open: a lost probe cannot wedge the breaker half-open.
    # At least resilience.max_deadline_s, so no probe that could still answer is cut.
    half_open_max_wait_s: PositiveFloat = 120.0

    def breaker_config(self) -> BreakerConfig:
        return BreakerConfig(**self.model_dump())


class RetrySettings(_Strict):
    max_attempts: int = Field(3, ge=1, le=10)
    base_backoff_s: float = Field(0.05, ge=0)
    max_backoff_s: float = Field(1.0, ge=0)
    budget_ratio: float = Field(0.2, ge=0, le=1)
    budget_min_concurrent: int = Field(3, ge=0)

    def retry_config(self) -> RetryConfig:
        return RetryConfig(**self.model_dump())


class BulkheadSettings(_Strict):
    # Concurrent calls per backend from one router: a hung fallback cannot starve the primary.
    primary: PositiveInt = 256
    fallback: PositiveInt = 64
    # Concurrent requests per tenant in one router (429 CONCURRENCY_LIMIT beyond it).
    per_tenant: PositiveInt = 128


class GateSettings(_Strict):
    """Per router: an adaptive limit on requests at the primary model, and a priority
    wait line for the rest (ballast/router/gate.py, ballast/policies/limiter.py)."""

    enabled: bool = True
    # A slow start: the limit climbs from here (one per window while reached), so the
    # first burst after a quiet spell meets a batch the model can answer in time.
    initial_limit: PositiveInt = 16
    min_limit: PositiveInt = 4
    max_limit: PositiveInt = 256
    # The wait for the model (router to compute start: Serve's queue and the batch queue)
    # the limit steers to, as the p90 of a window. Below degradation's second queue-wait
    # threshold, so that the gate, not a whole criticality class, takes the overflow.
    target_wait_ms: PositiveFloat = 300.0
    # Back off when the p90 answered request spent more than this share of its own time
    # budget (arrival to deadline) at the model: before its deadlines are missed. null: off.
    # 0.4: past the model's knee a bigger batch is only slower, and the wait line, where
    # criticality orders requests, keeps the rest of the budget.
    target_service_ratio: Optional[float] = Field(0.4, gt=0, le=1)
    # A slow cut is a trial: the window after next, the median service time per generated
    # token must have fallen by this share of the cut's share of rows (0.8: a 10 % cut, 8 %
    # faster; then the cut cost at most 2 % of throughput), else the cut is undone and the
    # slow rule rests (an engine whose step time is the host's, a burst of long prompts).
    # null: every slow cut stands.
    slow_cut_min_gain: Optional[float] = Field(0.8, gt=0, le=1)
    # For an engine that schedules itself (backend vllm) the slow rule is off: the limit
    # follows the rows curve instead, capped where the answers' service per token against
    # the rows at the model says throughput reaches this share of its asymptote (0.85: past
    # it, more rows make every answer slower and few more of them). null: vLLM takes the
    # slow rule, as Ballast's own engines do.
    rows_curve_gain: Optional[float] = Field(0.85, gt=0, lt=1)
    adjust_interval_s: PositiveFloat = 0.5
    decrease_factor: float = Field(0.9, gt=0, lt=1)  # gentle: each cut below the knee costs throughput
    # The wait line: bounded in count; each waiter by its deadline (less the expected
    # service time) and by this.
    max_waiting: PositiveInt = 512
    max_wait_s: PositiveFloat = 30.0
    # Slots kept for critical traffic: while critical requests lately needed the top of
    # the limit (within the last hold), sheddable classes fill at most limit - ceil(ratio x limit).
    critical_reserve_ratio: float = Field(0.25, ge=0, lt=1)
    critical_reserve_hold_s: PositiveFloat = 1.0
    # A deadline missed at the model cuts the limit only when the model held the request
    # longer than this x the recent p90 service time; one admitted near its deadline and
    # served in the usual time missed because it waited. null: every miss cuts the limit.
    miss_service_factor: Optional[PositiveFloat] = 1.5

    @model_validator(mode="after")
    def _bounds(self) -> "GateSettings":
        self.limiter_config()  # the policy's own checks, with their message
        return self

    def limiter_config(self, backend: str = "builtin") -> LimiterConfig:
        """The limit for a model on ``backend``: an engine that schedules itself (vLLM)
        takes the rows curve where ``rows_curve_gain`` is set, and then not the slow rule."""
        by_curve = backend in SELF_SCHEDULING and self.rows_curve_gain is not None
        rule: dict[str, Any] = {"target_service_ratio": None} if by_curve else {"rows_curve_gain": None}
        return frozen_config(LimiterConfig, self, initial=self.initial_limit, interval_s=self.adjust_interval_s, **rule)


class CacheSettings(_Strict):
    """Bounded cache of answers to identical requests: the last fallback before a 503.
    Keyed by tenant: a tenant gets only its own earlier answers."""

    enabled: bool = False
    max_entries: PositiveInt = 1024
    # A tenant past it loses its own least recently used answers, never another's
    # (max_entries stays the bound over all tenants).
    max_entries_per_tenant: PositiveInt = 256
    ttl_s: PositiveFloat = 300.0


class IdempotencySettings(_Strict):
    """The Idempotency-Key stores (each router's, and the key table they share)."""

    ttl_s: PositiveFloat = 600.0
    # The backstop over all tenants.
    max_entries: PositiveInt = 10000
    # Per tenant: keys held (a tenant at the bound loses its own oldest answers; with
    # all of them still running, a new key is refused 429), and bytes of answers kept.
    # 1000 keys cover a tenant sending 1.6 keyed requests/s over the default ttl_s; 8 MiB
    # keeps about 1000 answers of 2000 tokens' text, and ten such tenants fill the
    # backstop, so a tenant's flood of new keys ages out only its own.
    max_entries_per_tenant: PositiveInt = 1000
    max_answer_bytes_per_tenant: PositiveInt = 8 * 1024 * 1024
    max_key_chars: PositiveInt = 200


class ResilienceConfig(_Strict):
    # Overall deadline per request; a client may lower it with X-Request-Timeout-Ms,
    # never raise it past max_deadline_s.
    deadline_s: PositiveFloat = 30.0
    max_deadline_s: PositiveFloat = 120.0
    # Each attempt's own timeout (bounded by what is left of the deadline).
    attempt_timeout_s: PositiveFloat = 15.0
    # Times a request whose replica or node went away is sent again (unary) or carried on
    # elsewhere from the tokens already delivered (streams), within its deadline.
    migration_limit: int = Field(3, ge=0, le=10)
    breaker: BreakerSettings = BreakerSettings()
    retry: RetrySettings = RetrySettings()
    bulkhead: BulkheadSettings = BulkheadSettings()
    gate: GateSettings = GateSettings()
    cache: CacheSettings = CacheSettings()
    idempotency: IdempotencySettings = IdempotencySettings()

    @model_validator(mode="after")
    def _deadlines(self) -> "ResilienceConfig":
        _ordered(self, "deadline_s", "max_deadline_s")
        return self


class FallbackDeploymentConfig(_DeploymentSettings):
    replicas: PositiveInt = 1
    num_gpus: float = Field(0, ge=0)


class FallbackConfig(_Strict):
    """A smaller model in its own deployment, with its own breaker."""

    model: ModelConfig = ModelConfig(
        name="tiny-decoder-small", architecture=ModelArchitecture(d_model=64, n_layers=2, n_heads=4, d_ff=256)
    )
    deployment: FallbackDeploymentConfig = FallbackDeploymentConfig()


class AdapterConfig(_Strict):
    """A LoRA adapter of a vLLM model: a local directory (never downloaded) and who may use it."""

    path: str = Field(min_length=1)
    # The tenants that may use it (within its model's); null: every tenant its model admits.
    tenants: Optional[list[str]] = Field(None, min_length=1)


class ServedModelConfig(ModelConfig):
    """One entry of ``models``: a model as ``model`` takes it, and what serving several adds."""

    # LoRA adapters (vLLM only): name -> a directory, or {path, tenants}. A request names
    # one as "<adapter>" or "<model>:<adapter>".
    adapters: dict[str, AdapterConfig] = Field(default_factory=dict)
    # The tenants that may use this model and its adapters; null: every tenant.
    tenants: Optional[list[str]] = Field(None, min_length=1)
    # What one of its tokens costs in a tenant's token bucket and fair share (an adapter's
    # token costs its model's).
    cost_per_token: PositiveFloat = 1.0
    # Its Serve deployment; null: deployments.model.
    deployment: Optional[ModelDeploymentConfig] = None
    # Its fallback model; null: none, but the first model's is the top-level ``fallback``.
    fallback: Optional[FallbackConfig] = None

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_paths(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {name: {"path": a} if isinstance(a, str) else a for name, a in v.items()}
        return v

    @model_validator(mode="after")
    def _adapters_on_vllm(self) -> "ServedModelConfig":
        if self.adapters and self.backend != "vllm":
            raise ValueError(f"adapters: LoRA adapters are vLLM's (backend 'vllm'); this model is {self.backend!r}")
        for name in self.adapters:
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(f"adapters: adapter name {problem}")
        return self

    def has_extras(self) -> bool:
        """Whether it says more than ``model`` can (so that only ``models`` writes it)."""
        return any(
            getattr(self, f) != ServedModelConfig.model_fields[f].get_default(call_default_factory=True)
            for f in _SERVED_ONLY
        )


_SERVED_ONLY = tuple(f for f in ServedModelConfig.model_fields if f not in ModelConfig.model_fields)


class ChaosConfig(_Strict):
    """Fault injection in the model deployments: compiled in, off unless enabled here."""

    enabled: bool = False
    max_leak_mb: PositiveInt = 1024  # the injected leak stops growing here


class WatchdogSettings(_Strict):
    """One watchdog actor per model replica: memory, threads, fds, heartbeats."""

    enabled: bool = True
    interval_s: PositiveFloat = 1.0  # sampling and heartbeat interval
    # A replica with child processes (vLLM) is measured by their PSS, read from smaps at most
    # this often per process (a read walks the process's page tables: 16-22 ms per vLLM
    # process on a 2-core host); between reads, the last PSS plus what RSS grew since.
    pss_interval_s: PositiveFloat = 10.0
    # Growth while a replica loads and serves its first batches is not a leak: trends
    # start after this many seconds of the replica's life.
    warmup_s: float = Field(120.0, ge=0)
    # Hung: the replica's work loop has not moved for this many intervals with work in
    # flight (measured by the replica on its own clock) ...
    hang_missed_heartbeats: PositiveInt = 3
    # ... or no heartbeat arrived for this many intervals, work last seen in flight (an
    # event loop blocked solid). More: a heartbeat crosses processes, and on a busy node
    # it can arrive late while the replica is still working.
    silent_missed_heartbeats: PositiveInt = 10
    leak_window_s: PositiveFloat = 3600.0  # trend window for leak slopes
    leak_min_span_ratio: float = Field(0.5, gt=0, le=1)  # no leak verdict before samples span this much of the window
    leak_r2_threshold: float = Field(0.7, gt=0, le=1)  # fit quality below which a slope is noise
    # Fast burn (SRE's short window): a leak that would reach its limit within
    # leak_short_horizon_s is named once leak_short_min_span_s of samples after warm-up
    # show it rising, instead of waiting for half the long window. Clamped to the long
    # window where that is shorter (test and compressed configs).
    leak_short_window_s: PositiveFloat = 300.0
    leak_short_min_span_s: PositiveFloat = 90.0  # evidence needed; longer than a GC tooth
    leak_short_horizon_s: PositiveFloat = 3600.0
    # Slopes (per hour) at or above which a credible trend is a leak. RSS/VRAM in MB.
    rss_leak_mb_per_h: PositiveFloat = 30.0
    vram_leak_mb_per_h: PositiveFloat = 30.0
    threads_leak_per_h: PositiveFloat = 60.0
    fds_leak_per_h: PositiveFloat = 120.0
    rss_limit_mb: Optional[PositiveFloat] = None  # default: the node's total memory
    threads_limit: PositiveInt = 4096
    # The fd limit is the replica process's own RLIMIT_NOFILE soft limit; VRAM's is the GPU's total.
    step_interval_s: PositiveFloat = 60.0  # time one rung of the action ladder gets before the next
    warn_tto_s: PositiveFloat = 6 * 3600.0  # a leak reaching its limit sooner starts the ladder
    critical_tto_s: PositiveFloat = 3600.0  # sooner than this: stop intake and ask for a recycle at once
    warning_ratio: float = Field(0.90, gt=0, le=1)  # usage / limit (seed: VRAM warning 90 %)
    critical_ratio: float = Field(0.97, gt=0, le=1)  # usage / limit (seed: VRAM critical 97 %)

    @model_validator(mode="after")
    def _order(self) -> "WatchdogSettings":
        _ordered(self, "warning_ratio", "critical_ratio")
        _ordered(self, "critical_tto_s", "warn_tto_s")
        return self

    def leak_config(self) -> LeakConfig:
        short_window_s = min(self.leak_short_window_s, self.leak_window_s)
        return LeakConfig(
            window_s=self.leak_window_s,
            min_span_ratio=self.leak_min_span_ratio,
            r2_threshold=self.leak_r2_threshold,
            short_window_s=short_window_s,
            short_min_span_s=min(self.leak_short_min_span_s, short_window_s),
            short_horizon_s=self.leak_short_horizon_s,
        )

    def ladder_config(self) -> LadderConfig:
        return frozen_config(LadderConfig, self)


class RecycleSettings(_Strict):
    """Staggered replica recycling run by the controller: a rolling restart, each recycle under a lease."""

    enabled: bool = True
    max_age_s: Optional[PositiveFloat] = 6 * 3600.0  # null: no age trigger
    jitter_ratio: float = Field(0.1, ge=0, lt=1)  # each replica's age threshold spread by ± this
    window_start_hour: Optional[float] = Field(
        2.0, ge=0, lt=24
    )  # preferred low-traffic window (local time); null: any time
    window_end_hour: Optional[float] = Field(5.0, ge=0, lt=24)
    forced_max_age_s: Optional[PositiveFloat] = 24 * 3600.0  # recycled at this age whatever the window or level
    max_unavailable: PositiveInt = 1
    min_available: int = Field(1, ge=0)
    # One replica more (within max_replicas) while a recycle of the primary waits on
    # min_available or is in flight: a lone replica can then be recycled, never leaving none.
    surge: bool = True
    block_at_level: int = Field(3, ge=0, le=5)  # no scheduled recycles at this level or above
    recycle_timeout_s: PositiveFloat = 600.0  # a recycle not complete by then is stuck (alert), its slot freed
    lease_ttl_s: PositiveFloat = 1800.0  # hard TTL of a recycle lease
    lease_heartbeat_s: PositiveFloat = 2.0  # the controller heartbeats its lease; 3 missed: expired
    restart_estimate_s: PositiveFloat = 60.0  # T_restart for the expected availability until one is measured

    @model_validator(mode="after")
    def _ages(self) -> "RecycleSettings":
        if self.max_age_s and self.forced_max_age_s and self.forced_max_age_s < self.max_age_s:
            raise ValueError("forced_max_age_s must be >= max_age_s")
        if (self.window_start_hour is None) != (self.window_end_hour is None):
            raise ValueError("window_start_hour and window_end_hour are set together (or both null)")
        if self.window_start_hour is not None and self.window_start_hour == self.window_end_hour:
            raise ValueError("window_start_hour must differ from window_end_hour (null both for any time)")
        return self

    def recycle_config(self) -> RecycleConfig:
        """The planner's config; with ``enabled: false`` no age triggers (requested recycles still go)."""
        return frozen_config(
            RecycleConfig,
            self,
            max_age_s=self.max_age_s if self.enabled else None,
            forced_max_age_s=self.forced_max_age_s if self.enabled else None,
        )


class TenantConfig(_Strict):
    """A tenant's quota, in tokens (prompt + generated): a resource unit, not requests.

    What is not written grants the least: a tenant's claims are capped at ``critical``
    unless ``max_criticality`` says more, and in production a tenant needs a rate, or
    ``unlimited: true`` to have no token quota at all (the concurrency cap still
    applies). Locally a tenant without a rate has no token quota. The sum of all
    tenants' rates may exceed what the model can do (overcommit).
    """

    description: str = ""
    rate_tokens_per_s: Optional[PositiveFloat] = None
    burst_tokens: Optional[PositiveFloat] = None  # default: 2 s of rate
    # No token quota, said explicitly (production refuses a tenant with neither this nor a rate).
    unlimited: bool = False
    max_concurrent: Optional[PositiveInt] = None  # default: resilience.bulkhead.per_tenant
    # A higher claim is lowered to this; critical_plus (ahead of critical at the gate,
    # admitted at every level but 4) is granted only where written.
    max_criticality: Criticality = Criticality.CRITICAL
    # Share of idle capacity lent at level 0, and of the model among tenants waiting in
    # the same class (fairness).
    weight: PositiveFloat = 1.0
    sheddable: bool = False  # its rate shrinks with the degradation level
    # The models and adapters this tenant may use (a model's name covers its adapters,
    # one added at run time included); null: any that the models' own tenants allow.
    models: Optional[list[str]] = Field(None, min_length=1)
    # The prefix-cache group its prompts are cached in (ballast/policies/cache_groups.py):
    # null, the tenant alone; tenants naming one group share cached prefixes (and can tell,
    # by timing, what the others in it sent). Letters, digits, '-' or '_'.
    cache_group: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")

    @model_validator(mode="after")
    def _rate_or_unlimited(self) -> "TenantConfig":
        if self.unlimited and (self.rate_tokens_per_s is not None or self.burst_tokens is not None):
            raise ValueError("unlimited: a tenant with no token quota takes no rate_tokens_per_s or burst_tokens")
        return self

    @property
    def burst(self) -> Optional[float]:
        if self.rate_tokens_per_s is None:
            return None
        return self.burst_tokens if self.burst_tokens is not None else 2.0 * self.rate_tokens_per_s


class QuotaSettings(_Strict):
    # A router's share of a tenant's rate, granted by the controller, lapses after this.
    lease_ttl_s: PositiveFloat = 3.0
    # Sheddable tenants' rate multiplier per degradation level 0..4.
    level_factors: tuple[float, float, float, float, float] = (1.0, 0.75, 0.5, 0.25, 0.0)
    # Levels at which idle tenants' unused rate is lent to busy ones, by weight ([] = never).
    lend_at_levels: list[int] = Field(default_factory=lambda: [0])
    # A tenant borrows at most this multiple of its own rate (so a small quota stays small).
    max_borrow_ratio: float = Field(1.0, ge=0)
    # Every router keeps at least this fraction of an equal share (so it can admit a first request).
    min_share_ratio: float = Field(0.1, ge=0, le=1)


class FairnessSettings(_Strict):
    """Fair shares among tenants inside a criticality class (ballast/policies/fairness.py):
    at the gate, the tenant with the lowest virtual token counter goes first."""

    enabled: bool = True
    # A request's cost on its tenant's counter: these weights x its prompt and output
    # tokens, over the tenant's ``weight``.
    input_weight: float = Field(1.0, ge=0)
    output_weight: float = Field(2.0, ge=0)
    # Routers report what they charged each tenant and order by the controller's merged,
    # cluster-wide counters, and the model's slots are apportioned among routers by the
    # tenants waiting at each; false: each router orders by its own view and takes an
    # even split of the model.
    shared: bool = True
    # How far (weighted tokens) a waiting tenant's counter may lead the lowest waiting one
    # before its routers' share of the model falls by a factor e.
    lag_tokens: PositiveFloat = 2048.0
    # The share of the model every router keeps, split evenly, whoever waits where.
    router_floor_ratio: float = Field(0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _bounds(self) -> "FairnessSettings":
        self.policy_config()  # the policy's own checks, with their message
        return self

    def policy_config(self) -> FairnessConfig:
        return frozen_config(FairnessConfig, self)


class AuthConfig(_Strict):
    # "key=tenant" entries separated by commas or newlines; a key may be given as
    # "sha256:<hex>" so that plaintext keys never sit anywhere.
    api_keys_env: str = "BALLAST_API_KEYS"
    api_keys_file: Optional[str] = None
    admin_token_env: str = "BALLAST_ADMIN_TOKEN"
    admin_token_file: Optional[str] = None
    # Local demo only; refused in production.
    demo_keys: dict[str, str] = Field(default_factory=dict)
    demo_admin_token: Optional[str] = None
    # The secret prefix-cache salts are made with (HMAC of each tenant's cache group); the
    # same on every router. Unset: derived from the admin token.
    cache_salt_secret_env: str = "BALLAST_CACHE_SALT_SECRET"
    cache_salt_secret_file: Optional[str] = None


class BallastConfig(_Strict):
    environment: Literal["local", "production"] = "local"
    app_name: str = "ballast"
    route_prefix: str = "/"
    http: HttpConfig = HttpConfig()
    # The one model served (the one-model form of ``models``); with ``models`` written,
    # its first entry (the primary), as every reader of ``model`` takes it.
    model: ModelConfig = ModelConfig()
    # The models served, in place of ``model``; the first is the primary. Not written: [model].
    models: list[ServedModelConfig] = Field(default_factory=list)
    # LoRA adapters added at run time (POST /admin/adapters) load only from directories
    # under this one, checked on the node that loads them: symlinks resolved, and the root,
    # each directory down to the adapter and its files owned by the service user (or root)
    # and writable by no one else. A relative path is taken from each process's working
    # directory, as models' paths are. None: no adapter may be added at run time (409
    # ADAPTERS_DISABLED). The config's own models[].adapters are the operator's, as the
    # models' paths are, and are not held to it.
    adapters_root: Optional[str] = Field(None, min_length=1, max_length=MAX_PATH_CHARS)
    deployments: DeploymentsConfig = DeploymentsConfig()
    controller: ControllerConfig = ControllerConfig()
    degradation: DegradationSettings = DegradationSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    limits: LimitsConfig = LimitsConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    fallback: Optional[FallbackConfig] = None
    chaos: ChaosConfig = ChaosConfig()
    watchdog: WatchdogSettings = WatchdogSettings()
    recycle: RecycleSettings = RecycleSettings()
    auth: AuthConfig = AuthConfig()
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    quota: QuotaSettings = QuotaSettings()
    fairness: FairnessSettings = FairnessSettings()

    @model_validator(mode="before")
    @classmethod
    def _one_model_form(cls, data: Any) -> Any:
        """``model`` alone means ``models: [model]``; ``models`` alone sets ``model`` to its first."""
        if not isinstance(data, dict):
            return data
        models = data.get("models")
        if models is None:
            model = data.get("model", {})
            return {**data, "models": [_as_dict(model)]}
        if not isinstance(models, list) or not models or not isinstance(models[0], (dict, BaseModel)):
            return data  # the field's own validation says what is wrong
        first = _as_dict(models[0])
        primary = {k: v for k, v in first.items() if k in ModelConfig.model_fields}
        if data.get("model") is not None and not _same_model(data["model"], primary):
            raise ValueError("model and models: write the models list alone (model is the one-model form of models)")
        return {**data, "model": primary}

    @model_serializer(mode="wrap")
    def _dump_one_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A dump writes ``model`` or ``models``, whichever says it all (so it loads back)."""
        out: dict[str, Any] = handler(self)
        one = len(self.models) == 1 and not self.models[0].has_extras()
        out.pop("models" if one else "model", None)
        return out

    @field_validator("adapters_root")
    @classmethod
    def _a_root(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and ("\x00" in v or v.startswith("~") or v.rstrip("/") == ""):
            raise ValueError("write a directory other than / (no ~, no NUL), or null for no run-time adapters")
        return v

    @model_validator(mode="after")
    def _catalog_rules(self) -> "BallastConfig":
        _check_catalog_names(self)
        _check_grants(self)
        if self.fallback is not None and self.models[0].fallback is not None:
            raise ValueError("fallback and models[0].fallback: the first model's fallback is written twice")
        try:
            self.catalog()  # the policy's own checks
        except ValueError as e:
            raise ValueError(f"models: {e}") from None
        return self

    @model_validator(mode="after")
    def _placements(self) -> "BallastConfig":
        """Each model's (and fallback's) ranks, its placement and its deployment go together."""
        for i, m in enumerate(self.models):
            for where, build in (
                (f"models[{i}]", lambda: self.placement_of(m.name)),
                (f"models[{i}].fallback.model", lambda: self.fallback_placement_of(m.name)),
            ):
                try:
                    build()
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
        return self

    @model_validator(mode="after")
    def _production_has_no_demo_secrets(self) -> "BallastConfig":
        if self.environment == "production" and self.chaos.enabled:
            raise ValueError("chaos.enabled: fault injection is for local and test stacks, never production")
        if self.fallback is not None and self.fallback.model.name == self.model.name:
            raise ValueError(
                "fallback.model.name must differ from model.name (kill switches and metrics tell them apart)"
            )
        if self.environment == "production" and (self.auth.demo_keys or self.auth.demo_admin_token):
            raise ValueError(
                "auth.demo_keys / auth.demo_admin_token are for local use only; "
                "production takes keys from the environment or a file"
            )
        unquoted = sorted(t for t, tc in self.tenants.items() if tc.rate_tokens_per_s is None and not tc.unlimited)
        if self.environment == "production" and unquoted:
            raise ValueError(
                f"tenants: {unquoted} have no rate_tokens_per_s; production grants no unlimited quota "
                "unless the tenant says unlimited: true"
            )
        unknown = sorted(set(self.auth.demo_keys.values()) - set(self.tenants))
        if unknown:
            raise ValueError(f"auth.demo_keys name tenants not in tenants: {unknown}")
        return self

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in v:
            if not name or len(name) > 64 or not (name.isascii() and name.replace("-", "").replace("_", "").isalnum()):
                raise ValueError(f"tenant name {name!r} must be 1-64 letters, digits, '-' or '_'")
        return v

    # -- the models served -------------------------------------------------------------
    def served_model(self, name: str) -> ServedModelConfig:
        """The entry of ``models`` called ``name`` (KeyError when there is none)."""
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def deployment_name(self, name: str) -> str:
        """Model ``name``'s Serve deployment (the first model's is ``BallastModel``)."""
        return model_deployment_name(name, self.models[0].name)

    def fallback_deployment_name(self, name: str) -> str:
        """Model ``name``'s fallback's Serve deployment (the first's is ``BallastFallbackModel``)."""
        return fallback_deployment_name(name, self.models[0].name)

    def deployment_of(self, name: str) -> ModelDeploymentConfig:
        """Model ``name``'s Serve deployment settings: its own, else ``deployments.model``."""
        return self.served_model(name).deployment or self.deployments.model

    def placement_of(self, name: str) -> Optional[Placement]:
        """Model ``name``'s replica placement group (None: one rank, no group)."""
        d = self.deployment_of(name)
        return model_placement(self.served_model(name), d.num_cpus, d.num_gpus)

    def fallback_placement_of(self, name: str) -> Optional[Placement]:
        """The placement group of a replica of model ``name``'s fallback (None: one rank or no fallback)."""
        fallback = self.fallback_of(name)
        if fallback is None:
            return None
        return model_placement(fallback.model, fallback.deployment.num_cpus, fallback.deployment.num_gpus)

    def fallback_of(self, name: str) -> Optional[FallbackConfig]:
        """Model ``name``'s fallback: its own, else (the first model only) ``fallback``."""
        m = self.served_model(name)
        return m.fallback if m.fallback is not None or m is not self.models[0] else self.fallback

    def catalog(self) -> Catalog:
        """The catalog policy: models, adapters, grants and costs, as plain data."""
        entries = [
            ModelEntry(
                name=m.name,
                backend=m.backend,
                cost_per_token=m.cost_per_token,
                tenants=_frozen(m.tenants),
                adapters=tuple(AdapterEntry(n, a.path, _frozen(a.tenants)) for n, a in m.adapters.items()),
            )
            for m in self.models
        ]
        return Catalog.build(entries, {t: tc.models for t, tc in self.tenants.items()})

    # -- conversions to the pure policies' frozen configs ------------------------------
    def degradation_config(self) -> DegradationConfig:
        d = self.degradation
        constraints = tuple(LevelConstraints.from_dict(lv.model_dump(mode="json")) for lv in d.levels)
        return frozen_config(DegradationConfig, d, constraints=constraints)

    def autoscale_config(self, name: Optional[str] = None) -> AutoscaleConfig:
        """Model ``name``'s autoscaler (None: the first model's), within its deployment's bounds."""
        m = self.deployment_of(self.models[0].name if name is None else name)
        return frozen_config(AutoscaleConfig, self.autoscale, min_replicas=m.min_replicas, max_replicas=m.max_replicas)


def _as_dict(model: Any) -> Any:
    return model.model_dump() if isinstance(model, BaseModel) else model


def _same_model(written: Any, primary: dict[str, Any]) -> bool:
    """Whether ``model``, written beside ``models``, says nothing (defaults) or the first entry."""
    try:
        given = ModelConfig.model_validate(_as_dict(written))
        return given == ModelConfig() or given == ModelConfig.model_validate(primary)
    except ValueError:
        return False


def _frozen(names: Optional[list[str]]) -> Optional[frozenset[str]]:
    return None if names is None else frozenset(names)


def _check_catalog_names(cfg: BallastConfig) -> None:
    """Model, adapter and fallback names: valid, and unique across all of them."""
    seen: dict[str, str] = {}

    def take(where: str, name: str) -> None:
        if name in seen:
            raise ValueError(f"{where}: {name!r} is already {seen[name]} (names are unique across models and adapters)")
        seen[name] = where

    for i, m in enumerate(cfg.models):
        problem = name_problem(m.name)
        if problem is not None:
            raise ValueError(f"models[{i}].name: {problem}")
        take(f"models[{i}].name", m.name)
    for i, m in enumerate(cfg.models):
        for adapter in m.adapters:
            take(f"models[{i}].adapters.{adapter}", adapter)
    fallbacks = [("fallback.model.name", cfg.fallback)] + [
        (f"models[{i}].fallback.model.name", m.fallback) for i, m in enumerate(cfg.models)
    ]
    for where, fallback in fallbacks:
        if fallback is not None and fallback.model.name != cfg.model.name:  # the same: refused below, as before
            take(where, fallback.model.name)


def _check_grants(cfg: BallastConfig) -> None:
    """Grants name declared tenants, adapters' within their model's; tenants' lists name what exists."""
    for i, m in enumerate(cfg.models):
        grants = [(f"models[{i}].tenants", m.tenants)]
        grants += [(f"models[{i}].adapters.{n}.tenants", a.tenants) for n, a in m.adapters.items()]
        for where, tenants in grants:
            unknown = sorted(set(tenants or ()) - set(cfg.tenants))
            if unknown:
                raise ValueError(f"{where}: {unknown} are not in tenants")
            outside = sorted(set(tenants or ()) - set(m.tenants or tenants or ()))
            if outside:
                raise ValueError(f"{where}: {outside} are not in models[{i}].tenants")
    names = {m.name for m in cfg.models} | {a for m in cfg.models for a in m.adapters}
    names |= {f"{m.name}:{a}" for m in cfg.models for a in m.adapters}
    for tenant, tc in cfg.tenants.items():
        unknown = sorted(set(tc.models or ()) - names)
        if unknown:
            raise ValueError(f"tenants.{tenant}.models: {unknown} are no model or adapter served")


def load_config(
    source: "str | Path | dict[str, Any] | BallastConfig | None" = None,
    *,
    model_dir: "str | Path | None" = None,
    engine: str = "transformers",
) -> BallastConfig:
    """Build the config from a YAML path, a dict, or defaults; errors name the field.

    ``model_dir`` (``ballast serve --model DIR``, ``make serve MODEL=DIR``) serves that
    Hugging Face directory as the primary model, named after the directory, by ``engine``
    (``--engine``, ``ENGINE=``), with the rest of the config as it is (the fallback
    keeps its own model)."""
    if isinstance(source, BallastConfig) and model_dir is None:
        return source
    if isinstance(source, BallastConfig):
        source = source.model_dump(mode="json")
    data: dict[str, Any]
    where = "config"
    if source is None:
        data = {}
    elif isinstance(source, dict):
        data = source
    else:
        where = str(source)
        try:
            data = yaml.safe_load(read_text(source)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(where, f"not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(where, "top level must be a mapping")
    if model_dir is not None:
        data = with_model_dir(data, model_dir, engine)
    try:
        cfg = BallastConfig.model_validate(data)
        cfg.degradation_config()
        cfg.autoscale_config()
        cfg.recycle.recycle_config()
        cfg.watchdog.leak_config()
        cfg.watchdog.ladder_config()
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise ConfigError(where, str(e)) from None
    return cfg


def with_model_dir(data: dict[str, Any], model_dir: "str | Path", engine: str = "transformers") -> dict[str, Any]:
    """``data`` with its primary model replaced by the Hugging Face directory ``model_dir``,
    served by ``engine`` ("transformers" or "vllm")."""
    path = Path(model_dir).expanduser().resolve()
    models = data.get("models")
    first = models[0] if isinstance(models, list) and models else data.get("model")
    model = {k: v for k, v in (first or {}).items() if k not in ("checkpoint_path", "checkpoint_format", "seed")}
    if engine != "vllm":
        model.pop("engine_kwargs", None)
        model.pop("adapters", None)
    model.update(backend=engine, path=str(path), name=path.name[:64] or "model")
    if isinstance(models, list) and models:
        return {**{k: v for k, v in data.items() if k != "model"}, "models": [model, *models[1:]]}
    return {**data, "model": model}


def read_text(path: "str | Path", what: str = "") -> str:
    """A config or secret file as UTF-8 text; any failure is a ConfigError naming the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(path), f"cannot read {what or 'file'}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), f"{what or 'file'} is not UTF-8 text") from None
