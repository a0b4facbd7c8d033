"""``deployments`` (and a model's or fallback's own ``deployment``): the Serve options of
every Ballast deployment, built in one place."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from ballast.config.base import Strict, ordered
from ballast.policies.placement import Placement


class _DeploymentSettings(Strict):
    """What every Ballast deployment sets in Serve, built into options in one place."""

    max_ongoing_requests: PositiveInt = 32
    # Bounded: requests beyond this wait nowhere, the handle refuses them at once.
    max_queued_requests: PositiveInt = 64
    num_cpus: float = Field(default=0, ge=0)

    def serve_options(
        self, name: str, access_log: bool, placement: Placement | None = None, **own: Any
    ) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment``: the shared ones, then ``own``. With a
        ``placement`` (a model of several ranks), each replica is its placement group: one
        bundle per rank, the replica actor in the first with its CPUs and no GPU (the
        ranks hold the GPUs; ``num_gpus`` is theirs)."""
        resources = {"num_cpus": self.num_cpus}
        if hasattr(self, "num_gpus"):
            resources["num_gpus"] = 0 if placement is not None else self.num_gpus
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
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: PositiveInt = 2
    initial_replicas: PositiveInt | None = None
    num_gpus: float = Field(default=0, ge=0)
    health_check_period_s: PositiveFloat = 2.0
    health_check_timeout_s: PositiveFloat = 10.0
    graceful_shutdown_timeout_s: PositiveFloat = 10.0

    @model_validator(mode="after")
    def _bounds(self) -> ModelDeploymentConfig:
        ordered(self, "min_replicas", "max_replicas")
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
    max_replicas_per_node: PositiveInt | None = None


class DeploymentsConfig(Strict):
    model: ModelDeploymentConfig = ModelDeploymentConfig()
    router: RouterDeploymentConfig = RouterDeploymentConfig()


class FallbackDeploymentConfig(_DeploymentSettings):
    replicas: PositiveInt = 1
    num_gpus: float = Field(default=0, ge=0)
