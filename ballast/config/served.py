"""An entry of ``models``: a model as ``model`` takes it, with what serving several adds
(adapters, grants, cost, its own deployment and fallback)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveFloat, field_validator, model_validator

from ballast.config.base import Strict
from ballast.config.deployments import FallbackDeploymentConfig, ModelDeploymentConfig
from ballast.config.model import ModelArchitecture, ModelConfig
from ballast.policies.catalog import name_problem
from ballast.policies.engines import capabilities


class FallbackConfig(Strict):
    """A smaller model in its own deployment, with its own breaker."""

    model: ModelConfig = ModelConfig(
        name="tiny-decoder-small", architecture=ModelArchitecture(d_model=64, n_layers=2, n_heads=4, d_ff=256)
    )
    deployment: FallbackDeploymentConfig = FallbackDeploymentConfig()


class AdapterConfig(Strict):
    """A LoRA adapter of a vLLM model: a local directory (never downloaded) and who may use it."""

    path: str = Field(min_length=1)
    # The tenants that may use it (within its model's); null: every tenant its model admits.
    tenants: list[str] | None = Field(default=None, min_length=1)


class ServedModelConfig(ModelConfig):
    """One entry of ``models``: a model as ``model`` takes it, and what serving several adds."""

    # LoRA adapters (vLLM only): name -> a directory, or {path, tenants}. A request names
    # one as "<adapter>" or "<model>:<adapter>".
    adapters: dict[str, AdapterConfig] = Field(default_factory=dict)
    # The tenants that may use this model and its adapters; null: every tenant.
    tenants: list[str] | None = Field(default=None, min_length=1)
    # What one of its tokens costs in a tenant's token bucket and fair share (an adapter's
    # token costs its model's).
    cost_per_token: PositiveFloat = 1.0
    # Its Serve deployment; null: deployments.model.
    deployment: ModelDeploymentConfig | None = None
    # Its fallback model; null: none, but the first model's is the top-level ``fallback``.
    fallback: FallbackConfig | None = None

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_paths(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {name: {"path": a} if isinstance(a, str) else a for name, a in v.items()}
        return v

    @model_validator(mode="after")
    def _adapters_on_vllm(self) -> ServedModelConfig:
        if self.adapters and not capabilities(self.backend).lora:
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
