"""Ray Serve custom autoscaling policy that follows the Ballast controller.

Serve instantiates ``ControllerDrivenPolicy(**policy_kwargs)`` once inside the Serve
controller and calls it ~10 times a second with an ``AutoscalingContext``. It must
never block there, so a daemon thread polls the Ballast controller's snapshot
(``get_snapshot``) and the policy only reads the latest copy.

While the controller's decision is younger than ``decision_max_age_s`` the policy
returns it; otherwise (controller dead, restarting, not yet started) it falls back
to plain queue-length math on Serve's own request counts
(``ballast.policies.autoscale.queue_length_fallback``), so scaling never stops.

Serve's own ``upscale_delay_s`` / ``downscale_delay_s`` are set to 0 in
``autoscaling_config``: the stable / panic windows and the scale-down delay live in
``ballast.policies.autoscale`` and are applied once, by the controller.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ballast.config import BallastConfig
from ballast.policies.autoscale import AutoscaleConfig, queue_length_fallback

log = logging.getLogger("ballast.autoscaling")


class _SnapshotPoller:
    """Daemon thread: fetch the controller's snapshot every ``interval_s``."""

    def __init__(self, name: str, namespace: str, interval_s: float, timeout_s: float):
        self._name, self._namespace = name, namespace
        self._interval_s, self._timeout_s = interval_s, timeout_s
        # Guards _latest/_fetched_at: written by the thread, read by the policy call.
        self._lock = threading.Lock()
        self._latest: dict[str, Any] | None = None
        self._fetched_at = 0.0
        self._thread = threading.Thread(target=self._run, name="ballast-autoscale-poller", daemon=True)
        self._thread.start()

    def latest(self) -> tuple[dict[str, Any] | None, float]:
        with self._lock:
            return self._latest, self._fetched_at

    def _run(self) -> None:
        import ray

        handle: Any = None  # the controller's actor handle (Ray's API, untyped here)
        while True:
            try:
                if handle is None:
                    handle = ray.get_actor(self._name, namespace=self._namespace)
                snap: dict[str, Any] = ray.get(handle.get_snapshot.remote(), timeout=self._timeout_s)
                with self._lock:
                    self._latest, self._fetched_at = snap, time.time()
            except Exception:  # absent or restarting controller: the policy falls back
                handle = None
            time.sleep(self._interval_s)


class ControllerDrivenPolicy:
    def __init__(
        self,
        controller_name: str,
        namespace: str,
        decision_max_age_s: float,
        min_replicas: int,
        max_replicas: int,
        target_ongoing_requests: float,
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = 2.0,
        start_poller: bool = True,
    ):
        self._max_age_s = decision_max_age_s
        self._fallback_cfg = AutoscaleConfig(
            min_replicas=min_replicas, max_replicas=max_replicas, target_ongoing_requests=target_ongoing_requests
        )
        self._poller = (
            _SnapshotPoller(controller_name, namespace, poll_interval_s, poll_timeout_s) if start_poller else None
        )

    def decide(self, snapshot: dict[str, Any] | None, now_s: float, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Pure part: the controller's decision when fresh, else queue-length math."""
        if snapshot is not None and now_s - float(snapshot["created_at_s"]) <= self._max_age_s:
            desired = snapshot["desired_replicas"].get(ctx.deployment_name)
            if desired is not None:
                return int(desired), {"source": "controller", "version": snapshot["version"]}
        # Serve's target, not the running count: a scale-up still starting must not shrink.
        current = int(getattr(ctx, "target_num_replicas", None) or ctx.current_num_replicas)
        desired = queue_length_fallback(float(ctx.total_num_requests), current, self._fallback_cfg)
        return desired, {"source": "fallback"}

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        snapshot = self._poller.latest()[0] if self._poller is not None else None
        desired, info = self.decide(snapshot, time.time(), ctx)
        return desired, {**ctx.policy_state, "ballast": info}


def autoscaling_config(cfg: BallastConfig, model: str | None = None) -> dict[str, Any]:
    """Serve's autoscaling config for model ``model``'s deployment (None: the first model's).

    The policy reads the controller's desired replicas for the deployment Serve calls it
    for (``ctx.deployment_name``); the bounds and its fallback math are this model's own."""
    d, c = cfg.deployment_of(cfg.models[0].name if model is None else model), cfg.controller
    return {
        "min_replicas": d.min_replicas,
        "max_replicas": d.max_replicas,
        "initial_replicas": d.initial_replicas or d.min_replicas,
        "target_ongoing_requests": cfg.autoscale.target_ongoing_requests,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "policy": {
            "policy_function": "ballast.control.autoscaling:ControllerDrivenPolicy",
            "policy_kwargs": {
                "controller_name": c.name,
                "namespace": c.namespace,
                "decision_max_age_s": cfg.autoscale.decision_max_age_s,
                "min_replicas": d.min_replicas,
                "max_replicas": d.max_replicas,
                "target_ongoing_requests": cfg.autoscale.target_ongoing_requests,
            },
        },
    }
