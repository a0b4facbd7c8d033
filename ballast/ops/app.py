"""Application builder: each model's deployment (and its fallback's) behind the router ingress, plus the controller.

``build(cfg)`` is for code that already holds a config (the CLI, tests, benchmarks).
``build_app(args)`` is the import path for ``serve run`` / ``serve deploy``
(``ballast.ops.app:build_app``); ``args`` carries ``config_path`` or an inline ``config``.

Both refuse, before anything is deployed, a model of several ranks whose replica's
placement group the cluster can never hold (``check_placements``): a ConfigError naming
the model, what it needs and what the largest node has, rather than a replica pending
without a word.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve import Application

from ballast.config import BallastConfig, load_config
from ballast.control.controller import ensure_controller
from ballast.errors import ConfigError
from ballast.model.server import fallback_deployment, model_deployment
from ballast.policies.placement import Placement, placement_problem
from ballast.router.app import router_deployment


def build(cfg: BallastConfig) -> Application:
    """The router bound to each model's deployment and each fallback's (by model name);
    a ConfigError first for a placement the cluster cannot hold (``check_placements``)."""
    check_placements(cfg)
    data = cfg.model_dump(mode="json")
    models, fallbacks = {}, {}
    for m in cfg.models:
        models[m.name] = model_deployment(cfg, m.name).bind(data, "primary", m.name)
        if cfg.fallback_of(m.name) is not None:
            fallbacks[m.name] = fallback_deployment(cfg, m.name).bind(data, "fallback", m.name)
    app: Application = router_deployment(cfg).bind(models, data, fallbacks)
    return app


def build_app(args: dict[str, Any]) -> Application:
    if "config" in args:
        cfg = load_config(args["config"])
    else:
        cfg = load_config(args.get("config_path", "cluster/local.yaml"))
    app = build(cfg)  # refused here, before the controller takes the config
    # The controller is a detached actor: created here once, found by name afterwards.
    ensure_controller(cfg)
    return app


def placements(cfg: BallastConfig) -> list[Placement]:
    """The placement group of every model of several ranks, and of every such fallback."""
    found = [cfg.placement_of(m.name) for m in cfg.models] + [cfg.fallback_placement_of(m.name) for m in cfg.models]
    return [p for p in found if p is not None]


def check_placements(
    cfg: BallastConfig,
    nodes: Sequence[Mapping[str, float]] | None = None,
    node_types: Sequence[Mapping[str, float]] = (),
) -> None:
    """ConfigError for the first model whose replica's placement group the cluster can never
    hold (``ballast.policies.placement.placement_problem``): ``nodes`` (each live node's
    total resources) and ``node_types`` (what the autoscaler may add) as given, else read
    from Ray when it is up; without Ray nothing is checked. A model whose
    ``placement.check`` is false is not checked."""
    checked = [p for p in placements(cfg) if p.check]
    if not checked:
        return
    if nodes is None:
        import ray

        if not ray.is_initialized():
            return
        nodes, node_types = cluster_nodes()
    for p in checked:
        problem = placement_problem(p, nodes, node_types)
        if problem is not None:
            raise ConfigError("placement", problem)


def cluster_nodes() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(each live node's total resources, each node type the autoscaler may still add).

    The node types come from the cluster config the autoscaler publishes in Ray's GCS
    (what Ray Data reads for the same purpose); a cluster without an autoscaler (a local
    Ray, ``ray start`` by hand) has none, and only its live nodes count."""
    import ray

    ray_api: Any = ray  # ray.nodes() carries no annotations
    nodes = [dict(n["Resources"]) for n in ray_api.nodes() if n.get("Alive")]
    types: list[dict[str, float]] = []
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
        for group in config.node_group_configs if config is not None else ():
            if group.max_count != 0:
                types.append({k: float(v) for k, v in group.resources.items()})
    except Exception:  # an older or newer Ray without it: the live nodes alone
        pass
    return nodes, types


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

    app = build(cfg)  # a placement the cluster cannot hold is refused here, before the controller takes cfg
    ray.get(ensure_controller(cfg).start.remote())  # after its configure: one caller's calls run in order
    serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)


def shutdown(cfg: BallastConfig) -> None:
    """Serve down, then the detached controller and key table (they would outlive Serve otherwise)."""
    import ray
    from ray import serve

    from ballast.control.keys import lookup_keys
    from ballast.control.link import lookup_controller

    serve_api: Any = serve  # serve.shutdown() carries no annotations
    serve_api.shutdown()
    for handle in (lookup_controller(cfg), lookup_keys(cfg)):
        if handle is not None:
            ray.kill(handle, no_restart=True)
