"""``BallastConfig``: the sections together, the rules across them (catalog names, grants,
placements, production's refusals), and the conversions to the policies' configs."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from ballast.config.auth import AuthConfig
from ballast.config.base import Strict, frozen_config
from ballast.config.batch import BatchConfig
from ballast.config.control import AutoscaleSettings, ControllerConfig, DegradationSettings, RecycleSettings
from ballast.config.deployments import DeploymentsConfig, ModelDeploymentConfig
from ballast.config.http import HttpConfig
from ballast.config.limits import LimitsConfig
from ballast.config.model import ModelConfig, model_placement
from ballast.config.resilience import ResilienceConfig
from ballast.config.responses import ResponsesConfig
from ballast.config.served import FallbackConfig, ServedModelConfig
from ballast.config.tenants import FairnessSettings, QuotaSettings, TenantConfig
from ballast.config.watchdog import ChaosConfig, WatchdogSettings
from ballast.names import fallback_deployment_name, model_deployment_name
from ballast.policies.adapters import MAX_PATH_CHARS
from ballast.policies.autoscale import AutoscaleConfig
from ballast.policies.catalog import AdapterEntry, Catalog, ModelEntry, name_problem
from ballast.policies.degradation import DegradationConfig, LevelConstraints
from ballast.policies.placement import Placement


class BallastConfig(Strict):
    environment: Literal["local", "production"] = "local"
    app_name: str = "ballast"
    route_prefix: str = "/"
    http: HttpConfig = HttpConfig()
    # The one model served (the one-model form of ``models``); with ``models`` written,
    # its first entry (the default model: a request naming none gets it).
    model: ModelConfig = ModelConfig()
    # The models served, in place of ``model``; the first is the default. Not written: [model].
    models: list[ServedModelConfig] = Field(default_factory=list)
    # LoRA adapters added at run time (POST /admin/adapters) load only from directories
    # under this one, checked on the node that loads them: symlinks resolved, and the root,
    # each directory down to the adapter and its files owned by the service user (or root)
    # and writable by no one else. A relative path is taken from each process's working
    # directory, as models' paths are. None: no adapter may be added at run time (409
    # ADAPTERS_DISABLED). The config's own models[].adapters are the operator's, as the
    # models' paths are, and are not held to it.
    adapters_root: str | None = Field(default=None, min_length=1, max_length=MAX_PATH_CHARS)
    deployments: DeploymentsConfig = DeploymentsConfig()
    controller: ControllerConfig = ControllerConfig()
    degradation: DegradationSettings = DegradationSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    limits: LimitsConfig = LimitsConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    fallback: FallbackConfig | None = None
    chaos: ChaosConfig = ChaosConfig()
    watchdog: WatchdogSettings = WatchdogSettings()
    recycle: RecycleSettings = RecycleSettings()
    auth: AuthConfig = AuthConfig()
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    quota: QuotaSettings = QuotaSettings()
    fairness: FairnessSettings = FairnessSettings()
    # OpenAI's Batch API and the flex tier, on a durable queue.
    batch: BatchConfig = BatchConfig()
    # OpenAI's Responses API: its stored responses (in the batch store) and their bounds.
    responses: ResponsesConfig = ResponsesConfig()

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
        first_model = {k: v for k, v in first.items() if k in ModelConfig.model_fields}
        if data.get("model") is not None and not _same_model(data["model"], first_model):
            raise ValueError("model and models: write the models list alone (model is the one-model form of models)")
        return {**data, "model": first_model}

    @model_serializer(mode="wrap")
    def _dump_one_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A dump writes ``model`` or ``models``, whichever says it all (so it loads back)."""
        out: dict[str, Any] = handler(self)
        one = len(self.models) == 1 and not self.models[0].has_extras()
        out.pop("models" if one else "model", None)
        return out

    @field_validator("adapters_root")
    @classmethod
    def _a_root(cls, v: str | None) -> str | None:
        if v is not None and ("\x00" in v or v.startswith("~") or v.rstrip("/") == ""):
            raise ValueError("write a directory other than / (no ~, no NUL), or null for no run-time adapters")
        return v

    @model_validator(mode="after")
    def _catalog_rules(self) -> BallastConfig:
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
    def _fallbacks_answer_as_their_model(self) -> BallastConfig:
        """A fallback answers its model's requests in its stead (``_fallback_problem``)."""
        for i, m in enumerate(self.models):
            fallback = self.fallback_of(m.name)
            problem = None if fallback is None else _fallback_problem(m, fallback.model)
            if problem is not None:
                where = f"models[{i}].fallback" if m.fallback is not None else "fallback"
                raise ValueError(f"{where}.model: {problem}")
        return self

    @model_validator(mode="after")
    def _placements(self) -> BallastConfig:
        """Each model's (and fallback's) ranks, its placement and its deployment go together."""
        placements: tuple[tuple[str, Callable[[str], Placement | None]], ...] = (
            ("", self.placement_of),
            (".fallback.model", self.fallback_placement_of),
        )
        for i, m in enumerate(self.models):
            for where, placement_of in placements:
                try:
                    placement_of(m.name)
                except ValueError as e:
                    raise ValueError(f"models[{i}]{where}: {e}") from None
        return self

    @model_validator(mode="after")
    def _batch_lines_fit_their_claim(self) -> BallastConfig:
        """A batch line runs within ``resilience.deadline_s`` (its deadline, router/dispatcher.py);
        a line held longer than ``batch.claim_idle_s`` is taken by another router and run
        twice, so the claim must outlast the deadline."""
        if self.batch.enabled and self.batch.claim_idle_s <= self.resilience.deadline_s:
            raise ValueError(
                f"batch.claim_idle_s ({self.batch.claim_idle_s:g}) must be above resilience.deadline_s "
                f"({self.resilience.deadline_s:g}), the longest a batch line's attempt runs: a line "
                "still running when its claim lapses is run again by another router"
            )
        return self

    @model_validator(mode="after")
    def _silence_outlasts_the_polls(self) -> BallastConfig:
        """Serve polls each replica's routing stats (its heartbeat) every ``watchdog.interval_s``,
        at a random point of 0.5-1.5 periods: a replica is silent only after more than two."""
        if self.resilience.hedge.silent_after_s <= 2 * self.watchdog.interval_s:
            raise ValueError(
                f"resilience.hedge.silent_after_s ({self.resilience.hedge.silent_after_s:g}) must be above twice "
                f"watchdog.interval_s ({self.watchdog.interval_s:g}), how often a replica's heartbeat is polled: "
                "a replica between two polls would be taken for silent"
            )
        return self

    @model_validator(mode="after")
    def _production_has_no_demo_secrets(self) -> BallastConfig:
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

    def placement_of(self, name: str) -> Placement | None:
        """Model ``name``'s replica placement group (None: one rank, no group)."""
        d = self.deployment_of(name)
        return model_placement(self.served_model(name), d.num_cpus, d.num_gpus)

    def fallback_placement_of(self, name: str) -> Placement | None:
        """The placement group of a replica of model ``name``'s fallback (None: one rank or no fallback)."""
        fallback = self.fallback_of(name)
        if fallback is None:
            return None
        return model_placement(fallback.model, fallback.deployment.num_cpus, fallback.deployment.num_gpus)

    def fallback_of(self, name: str) -> FallbackConfig | None:
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

    def autoscale_config(self, name: str | None = None) -> AutoscaleConfig:
        """Model ``name``'s autoscaler (None: the first model's), within its deployment's bounds."""
        m = self.deployment_of(self.models[0].name if name is None else name)
        return frozen_config(AutoscaleConfig, self.autoscale, min_replicas=m.min_replicas, max_replicas=m.max_replicas)


def _as_dict(model: Any) -> Any:
    return model.model_dump() if isinstance(model, BaseModel) else model


def _same_model(written: Any, first_model: dict[str, Any]) -> bool:
    """Whether ``model``, written beside ``models``, says nothing (defaults) or the first entry."""
    try:
        given = ModelConfig.model_validate(_as_dict(written))
        return given == ModelConfig() or given == ModelConfig.model_validate(first_model)
    except ValueError:
        return False


def _frozen(names: list[str] | None) -> frozenset[str] | None:
    return None if names is None else frozenset(names)


def _fallback_problem(m: ModelConfig, fallback: ModelConfig) -> str | None:
    """What keeps ``fallback`` from answering in model ``m``'s stead (None: nothing). It is of
    the same kind; an embeddings model's fallback embeds with the same weights, pooling,
    normalisation and sizes, since a vector is of use only beside the vectors a client
    already holds from the model (its index): another model's are in another space."""
    if fallback.kind != m.kind:
        return f"kind {fallback.kind!r}, its model's is {m.kind!r}: a fallback answers what its model answers"
    if m.kind != "embed":
        return None
    if _weights(fallback) != _weights(m):
        return (
            "an embeddings model's fallback serves the same weights as its model (the same path; the builtin "
            "model's: the same checkpoint_path, seed and architecture): another model's vectors do not match "
            "the vectors a client has indexed"
        )
    if fallback.embed.model_dump(include=_EMBEDS_ALIKE) != m.embed.model_dump(include=_EMBEDS_ALIKE):
        return f"embed: {', '.join(sorted(_EMBEDS_ALIKE))} as its model's (the vectors differ otherwise)"
    return None


_EMBEDS_ALIKE = {"pooling", "normalize", "dimensions"}


def _weights(m: ModelConfig) -> tuple[Any, ...]:
    """What names a model's weights: its directory, or the builtin model's checkpoint, seed and shape."""
    if m.path is not None:
        return (os.path.normpath(m.path),)
    return (m.checkpoint_path, m.seed, m.architecture)


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
