"""Application builder: each model's deployment (and its fallback's) behind the router ingress, plus the controller.

``build(cfg)`` is for code that already holds a config (the CLI, tests, benchmarks).
``build_app(args)`` is the import path for ``serve run`` / ``serve deploy``
(``ballast.ops.app:build_app``); ``args`` carries ``config_path`` or an inline ``config``.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from ballast.config import BallastConfig, load_config
from ballast.control.controller import ensure_controller
from ballast.model.server import fallback_deployment, model_deployment
from ballast.router.app import router_deployment


def build(cfg: BallastConfig) -> Application:
    """The router bound to each model's deployment and each fallback's (by model name)."""
    data = cfg.model_dump(mode="json")
    models, fallbacks = {}, {}
    for m in cfg.models:
        models[m.name] = model_deployment(cfg, m.name).bind(data, "primary", m.name)
        if cfg.fallback_of(m.name) is not None:
            fallbacks[m.name] = fallback_deployment(cfg, m.name).bind(data, "fallback", m.name)
    return router_deployment(cfg).bind(models, data, fallbacks)


def build_app(args: dict[str, Any]) -> Application:
    if "config" in args:
        cfg = load_config(args["config"])
    else:
        cfg = load_config(args.get("config_path", "cluster/local.yaml"))
    # The controller is a detached actor: created here once, found by name afterwards.
    ensure_controller(cfg)
    return build(cfg)


def start(cfg: BallastConfig, host: str, port: int) -> None:
    """Serve's HTTP proxy, the controller and the app, on an already initialised Ray."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    deploy(cfg)


def deploy(cfg: BallastConfig) -> None:
    """The controller takes ``cfg`` (created if absent), then the app is (re)deployed with
    it. A redeploy through ``build`` alone would leave the controller planning recycles
    and replica counts by the config it had."""
    import ray
    from ray import serve

    ray.get(ensure_controller(cfg).start.remote())  # after its configure: one caller's calls run in order
    serve.run(build(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)


def shutdown(cfg: BallastConfig) -> None:
    """Serve down, then the detached controller and key table (they would outlive Serve otherwise)."""
    import ray
    from ray import serve

    from ballast.control.link import lookup_controller

    from ballast.control.keys import lookup_keys

    serve.shutdown()
    for handle in (lookup_controller(cfg), lookup_keys(cfg)):
        if handle is not None:
            ray.kill(handle, no_restart=True)
