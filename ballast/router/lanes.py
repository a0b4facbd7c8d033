"""One lane per model: what a router keeps apart for each model it serves.

A model is the unit of protection (docs/operations.md, "Several models"): each has its
own gate (its concurrency limit and wait line), its own resilient caller (breaker,
bulkheads, retry budget, fallback), its own tally for the controller (its level is
computed from it) and its own text (tokenizer, template, context). What a router
shares across its lanes is what belongs to the tenant (places, quota buckets, the
Idempotency-Key store) and the router's own CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ballast.errors import InvalidRequest
from ballast.policies.fairness import TenantCounters
from ballast.policies.gate import PlusReserve
from ballast.policies.limiter import AimdLimit
from ballast.router.accounts import Accounts
from ballast.router.calls import CallHooks
from ballast.router.gate import PriorityGate
from ballast.router.metrics import RouterMetrics
from ballast.router.resilience import ResilientCaller
from ballast.router.tally import Tally
from ballast.router.tokens import ModelText, model_text


def priority_gate(cfg: Any, backend: str = "builtin") -> PriorityGate | None:
    """The gate to a model on ``backend`` as ``resilience.gate`` describes it (its limit's
    rule is the engine's: ``GateSettings.limiter_config``), ordering tenants inside a class
    by ``fairness``; None when the gate is off."""
    g = cfg.resilience.gate
    if not g.enabled:
        return None
    fair = None
    if cfg.fairness.enabled:
        fair = TenantCounters({t: tc.weight for t, tc in cfg.tenants.items()}, cfg.fairness.policy_config())
    return PriorityGate(
        AimdLimit(g.limiter_config(backend)),
        g.max_waiting,
        g.max_wait_s,
        reserve_ratio=g.critical_reserve_ratio,
        reserve_hold_s=g.critical_reserve_hold_s,
        miss_service_factor=g.miss_service_factor,
        fair=fair,
        plus=plus_reserve(g),
    )


def plus_reserve(g: Any) -> PlusReserve | None:
    """critical_plus's own rows as ``resilience.gate`` sizes them; None with a ratio of 0."""
    if g.plus_reserve_max_ratio == 0:
        return None
    return PlusReserve(
        g.plus_reserve_max_ratio, g.plus_reserve_window_s, g.plus_reserve_idle_s, g.plus_max_wait_ms / 1000
    )


@dataclass(eq=False)
class Lane:
    """A model as one router serves it."""

    name: str  # the model's name: the request's ``model`` field, the metrics' ``model`` tag
    kind: str  # what it serves: "generate" (text) or "embed" (vectors, /v1/embeddings alone)
    backend: str  # its engine: "builtin", "transformers" or "vllm"
    deployment: str  # its Serve deployment (the controller's reports and replica counts)
    cost_per_token: float  # what one of its tokens costs in a tenant's bucket
    text: ModelText  # its tokenizer, chat template and context
    caller: ResilientCaller
    gate: PriorityGate | None
    tally: Tally
    accounts: Accounts

    def serves(self, kind: str, asked: str, error: type[InvalidRequest]) -> None:
        """Nothing when the model is of ``kind``; else ``error`` naming ``model``: an
        embeddings model answers no text request, a generating model no embeddings request."""
        if self.kind == kind:
            return
        if self.kind == "embed":
            what = "an embeddings model: it answers POST /v1/embeddings alone"
        else:
            what = "a generating model: POST /v1/embeddings takes a model of kind 'embed'"
        raise error(f"model: {asked!r} is {what}", field="model")

    @property
    def max_tokens(self) -> int:
        """The longest answer the model can give (its context less one prompt token)."""
        return self.text.context - 1


def build_lanes(
    cfg: Any,
    handles: dict[str, Any],
    fallbacks: dict[str, Any],
    metrics: RouterMetrics,
    hooks: Callable[[str], CallHooks],
) -> dict[str, Lane]:
    """One lane per served model, in the config's order (the first is the default lane):
    ``handles``/``fallbacks`` are the models' Serve handles by model name, ``hooks(name)``
    the caller's hooks for model ``name``."""
    lanes: dict[str, Lane] = {}
    for m in cfg.models:
        gate, tally = priority_gate(cfg, m.backend), Tally()
        lanes[m.name] = Lane(
            name=m.name,
            kind=m.kind,
            backend=m.backend,
            deployment=cfg.deployment_name(m.name),
            cost_per_token=m.cost_per_token,
            text=model_text(m),
            caller=ResilientCaller(cfg, handles[m.name], fallbacks.get(m.name), hooks=hooks(m.name), model=m.name),
            gate=gate,
            tally=tally,
            accounts=Accounts(cfg, gate, metrics, tally, model=m.name),
        )
    return lanes
