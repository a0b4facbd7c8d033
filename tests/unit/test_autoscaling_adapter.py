"""ballast.control.autoscaling: the Serve policy that follows the controller, and its config.

``ControllerDrivenPolicy(..., start_poller=False)`` starts no thread and touches no
Ray; ``decide(snapshot, now_s, ctx)`` takes the time as an argument, so freshness
is walked in whole seconds. Contexts are Ray's own ``AutoscalingContext`` (plain
constructor, no cluster) so that attribute names are checked against Serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from ballast.config import load_config
from ballast.control.autoscaling import ControllerDrivenPolicy, autoscaling_config
from ballast.names import MODEL_DEPLOYMENT
from ballast.policies.autoscale import AutoscaleConfig, queue_length_fallback

MAX_AGE_S = 5
CREATED_AT_S = 1_000
FALLBACK = AutoscaleConfig(min_replicas=1, max_replicas=6, target_ongoing_requests=4)


def make_policy() -> ControllerDrivenPolicy:
    return ControllerDrivenPolicy(
        controller_name="ctl",
        namespace="ns",
        decision_max_age_s=MAX_AGE_S,
        min_replicas=1,
        max_replicas=6,
        target_ongoing_requests=4,
        start_poller=False,
    )


def make_ctx(
    total_num_requests: float = 0.0,
    current_num_replicas: int = 1,
    target_num_replicas: int | None = None,
    policy_state: dict[str, Any] | None = None,
    deployment_name: str = MODEL_DEPLOYMENT,
) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DeploymentID(name=deployment_name, app_name="ballast"),
        deployment_name=deployment_name,
        app_name="ballast",
        current_num_replicas=current_num_replicas,
        target_num_replicas=current_num_replicas if target_num_replicas is None else target_num_replicas,
        running_replicas=[],
        total_num_requests=total_num_requests,
        total_queued_requests=None,
        aggregated_metrics=None,
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=6,
        policy_state=dict(policy_state or {}),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=None,
    )


def snapshot(desired: dict[str, int] | None = None, version: int = 7) -> dict[str, Any]:
    return {
        "created_at_s": CREATED_AT_S,
        "version": version,
        "desired_replicas": {MODEL_DEPLOYMENT: 3} if desired is None else desired,
    }


class TestDecide:
    def test_fresh_snapshot_gives_the_controllers_decision(self) -> None:
        desired, info = make_policy().decide(snapshot(), CREATED_AT_S + 1, make_ctx(total_num_requests=100))
        assert desired == 3  # not the fallback's ceil(100 / 4) = 25 -> 6
        assert info == {"source": "controller", "version": 7}

    def test_controller_may_scale_down_where_the_fallback_would_not(self) -> None:
        desired, info = make_policy().decide(
            snapshot({MODEL_DEPLOYMENT: 1}), CREATED_AT_S, make_ctx(total_num_requests=0, current_num_replicas=4)
        )
        assert (desired, info["source"]) == (1, "controller")

    def test_freshness_walked_second_by_second(self) -> None:
        policy = make_policy()
        ctx = make_ctx(total_num_requests=10, current_num_replicas=1)  # fallback: ceil(10 / 4) = 3
        seen = []
        for age_s in range(0, MAX_AGE_S + 3):
            desired, info = policy.decide(snapshot({MODEL_DEPLOYMENT: 5}), CREATED_AT_S + age_s, ctx)
            seen.append((age_s, desired, info["source"]))
        expected = [(a, 5, "controller") for a in range(0, MAX_AGE_S + 1)] + [
            (a, 3, "fallback") for a in range(MAX_AGE_S + 1, MAX_AGE_S + 3)
        ]
        assert seen == expected

    def test_absent_snapshot_falls_back(self) -> None:
        desired, info = make_policy().decide(
            None, CREATED_AT_S, make_ctx(total_num_requests=17, current_num_replicas=2)
        )
        assert desired == 5  # ceil(17 / 4)
        assert info == {"source": "fallback"}

    def test_snapshot_without_this_deployment_falls_back(self) -> None:
        desired, info = make_policy().decide(
            snapshot({"SomethingElse": 6}), CREATED_AT_S, make_ctx(total_num_requests=9, current_num_replicas=1)
        )
        assert (desired, info) == (3, {"source": "fallback"})

    def test_other_deployment_name_falls_back(self) -> None:
        desired, info = make_policy().decide(
            snapshot(), CREATED_AT_S, make_ctx(total_num_requests=0, current_num_replicas=2, deployment_name="Router")
        )
        assert (desired, info) == (2, {"source": "fallback"})

    @pytest.mark.parametrize(
        "total, current, expected",
        [(0, 1, 1), (4, 1, 1), (5, 1, 2), (24, 2, 6), (1_000, 3, 6), (0, 4, 4), (3, 0, 1)],
    )
    def test_fallback_is_the_queue_length_math(self, total: float, current: int, expected: int) -> None:
        desired, _ = make_policy().decide(None, CREATED_AT_S, make_ctx(total, current))
        assert desired == expected
        assert desired == queue_length_fallback(total, current, FALLBACK)

    def test_fallback_never_scales_down(self) -> None:
        desired, _ = make_policy().decide(None, CREATED_AT_S, make_ctx(total_num_requests=0, current_num_replicas=5))
        assert desired == 5

    def test_works_with_a_plain_context_object(self) -> None:
        @dataclass
        class FakeContext:
            """Stands in for AutoscalingContext with only what the policy reads."""

            deployment_name: str
            total_num_requests: float
            current_num_replicas: int
            # Serve's target; equal to current here.
            target_num_replicas: int
            policy_state: dict[str, Any] = field(default_factory=dict)

        ctx = FakeContext(MODEL_DEPLOYMENT, total_num_requests=8, current_num_replicas=1, target_num_replicas=1)
        assert make_policy().decide(None, CREATED_AT_S, ctx) == (2, {"source": "fallback"})
        assert make_policy().decide(snapshot(), CREATED_AT_S, ctx) == (3, {"source": "controller", "version": 7})

    def test_lazy_total_num_requests_is_read(self) -> None:
        ctx = make_ctx(total_num_requests=0.0)
        ctx._total_num_requests_value = lambda: 20.0  # how Serve passes it: a callable
        assert make_policy().decide(None, CREATED_AT_S, ctx)[0] == 5

    def test_fallback_does_not_cut_replicas_that_are_still_starting(self) -> None:
        # Serve's target is 4, only 2 are running yet, the controller is unreachable.
        ctx = make_ctx(total_num_requests=8, current_num_replicas=2, target_num_replicas=4)
        desired, info = make_policy().decide(None, CREATED_AT_S, ctx)
        assert info == {"source": "fallback"}
        assert desired == 4


class TestCall:
    def test_without_poller_falls_back_and_keeps_policy_state(self) -> None:
        ctx = make_ctx(total_num_requests=12, current_num_replicas=1, policy_state={"mine": 1, "ballast": "old"})
        desired, state = make_policy()(ctx)
        assert desired == 3
        assert state == {"mine": 1, "ballast": {"source": "fallback"}}
        assert ctx.policy_state == {"mine": 1, "ballast": "old"}  # the input is not mutated

    def test_result_is_what_serve_expects(self) -> None:
        desired, state = make_policy()(make_ctx(total_num_requests=0, current_num_replicas=1))
        assert isinstance(desired, int)
        assert isinstance(state, dict)


# --------------------------------------------------------------------------- autoscaling_config


class TestAutoscalingConfig:
    def cfg(self):
        return load_config(
            {
                "deployments": {"model": {"min_replicas": 2, "max_replicas": 5, "initial_replicas": 3}},
                "controller": {"name": "ctl-x", "namespace": "ns-x"},
                "autoscale": {"target_ongoing_requests": 6, "decision_max_age_s": 4},
            }
        )

    def test_serve_delays_are_zero_and_the_policy_is_named(self) -> None:
        d = autoscaling_config(self.cfg())
        assert d["upscale_delay_s"] == 0
        assert d["downscale_delay_s"] == 0
        assert d["policy"]["policy_function"] == "ballast.control.autoscaling:ControllerDrivenPolicy"

    def test_values_are_carried_through(self) -> None:
        d = autoscaling_config(self.cfg())
        assert (d["min_replicas"], d["max_replicas"], d["initial_replicas"]) == (2, 5, 3)
        assert d["target_ongoing_requests"] == 6
        assert d["policy"]["policy_kwargs"] == {
            "controller_name": "ctl-x",
            "namespace": "ns-x",
            "decision_max_age_s": 4,
            "min_replicas": 2,
            "max_replicas": 5,
            "target_ongoing_requests": 6,
        }

    def test_initial_replicas_defaults_to_min(self) -> None:
        d = autoscaling_config(load_config({"deployments": {"model": {"min_replicas": 2, "max_replicas": 3}}}))
        assert d["initial_replicas"] == 2

    def test_ray_validates_it(self) -> None:
        ac = AutoscalingConfig(**autoscaling_config(self.cfg()))
        assert (ac.min_replicas, ac.max_replicas, ac.initial_replicas) == (2, 5, 3)
        assert ac.upscale_delay_s == 0
        assert ac.downscale_delay_s == 0
        assert ac.policy.policy_function == "ballast.control.autoscaling:ControllerDrivenPolicy"

    def test_ray_resolves_the_policy_to_our_class(self) -> None:
        ac = AutoscalingConfig(**autoscaling_config(self.cfg()))
        assert ac.policy.get_policy() is ControllerDrivenPolicy

    def test_policy_kwargs_fit_the_constructor(self) -> None:
        kwargs = autoscaling_config(self.cfg())["policy"]["policy_kwargs"]
        policy = ControllerDrivenPolicy(**kwargs, start_poller=False)
        # Its fallback uses the same bounds and target: 1000 requests -> max 5.
        assert policy.decide(None, CREATED_AT_S, make_ctx(total_num_requests=1000, current_num_replicas=2))[0] == 5
        assert policy.decide(None, CREATED_AT_S, make_ctx(total_num_requests=13, current_num_replicas=2))[0] == 3

    def test_local_yaml_config_validates(self) -> None:
        from pathlib import Path

        cfg = load_config(Path(__file__).resolve().parents[2] / "cluster" / "local.yaml")
        ac = AutoscalingConfig(**autoscaling_config(cfg))
        assert (ac.min_replicas, ac.max_replicas) == (1, 2)
