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

One module per section of the file, the root (``BallastConfig``, the rules across
sections) and the loading on top; every name is imported from here:

- ``base``: what every section shares (``Strict``, ``frozen_config``)
- ``http``: ``http``
- ``model``: ``model`` and what every entry of ``models`` shares (engine, placement, routing)
- ``served``: what an entry of ``models`` adds (adapters, grants, cost, fallback)
- ``deployments``: ``deployments`` and a model's or fallback's own Serve options
- ``control``: ``controller``, ``degradation``, ``autoscale``, ``recycle``
- ``watchdog``: ``watchdog``, ``chaos``
- ``limits``: ``limits``
- ``resilience``: ``resilience`` (breaker, retry, bulkhead, gate, cache, idempotency)
- ``tenants``: ``tenants``, ``quota``, ``fairness``
- ``auth``: ``auth``
- ``batch``: ``batch`` (the Batch API, the flex tier, their durable store)
- ``responses``: ``responses`` (the Responses API's stored responses)
- ``root``: ``BallastConfig``
- ``loading``: ``load_config``, ``with_model_dir``, ``read_text``
"""

from ballast.config.auth import AuthConfig
from ballast.config.base import frozen_config
from ballast.config.batch import BatchConfig
from ballast.config.control import (
    AutoscaleSettings,
    ControllerConfig,
    DegradationSettings,
    LevelConstraintsModel,
    RecycleSettings,
)
from ballast.config.deployments import (
    DeploymentsConfig,
    FallbackDeploymentConfig,
    ModelDeploymentConfig,
    RouterDeploymentConfig,
)
from ballast.config.http import HttpConfig
from ballast.config.limits import LimitsConfig
from ballast.config.loading import load_config, read_text, with_model_dir
from ballast.config.model import (
    ModelArchitecture,
    ModelConfig,
    PlacementSettings,
    RoutingSettings,
    model_placement,
    parallel_sizes,
)
from ballast.config.resilience import (
    BreakerSettings,
    BulkheadSettings,
    CacheSettings,
    GateSettings,
    IdempotencySettings,
    ResilienceConfig,
    RetrySettings,
)
from ballast.config.responses import ResponsesConfig
from ballast.config.root import BallastConfig
from ballast.config.served import AdapterConfig, FallbackConfig, ServedModelConfig
from ballast.config.tenants import FairnessSettings, QuotaSettings, TenantConfig
from ballast.config.watchdog import ChaosConfig, WatchdogSettings

__all__ = [
    "AdapterConfig",
    "AuthConfig",
    "AutoscaleSettings",
    "BatchConfig",
    "BallastConfig",
    "BreakerSettings",
    "BulkheadSettings",
    "CacheSettings",
    "ChaosConfig",
    "ControllerConfig",
    "DegradationSettings",
    "DeploymentsConfig",
    "FairnessSettings",
    "FallbackConfig",
    "FallbackDeploymentConfig",
    "GateSettings",
    "HttpConfig",
    "IdempotencySettings",
    "LevelConstraintsModel",
    "LimitsConfig",
    "ModelArchitecture",
    "ModelConfig",
    "ModelDeploymentConfig",
    "PlacementSettings",
    "QuotaSettings",
    "RecycleSettings",
    "ResilienceConfig",
    "ResponsesConfig",
    "RetrySettings",
    "RouterDeploymentConfig",
    "RoutingSettings",
    "ServedModelConfig",
    "TenantConfig",
    "WatchdogSettings",
    "frozen_config",
    "load_config",
    "model_placement",
    "parallel_sizes",
    "read_text",
    "with_model_dir",
]
