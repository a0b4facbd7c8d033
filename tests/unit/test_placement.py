"""A model of several ranks: its replica's placement group built from the config, the
refusals, and the check at deploy against node lists given as plain data (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from ballast.config import BallastConfig, load_config
from ballast.errors import ConfigError
from ballast.ops.app import check_placements, placements
from ballast.policies.placement import Placement, placement_problem


def vllm(name: str = "llama-70b", **engine_kwargs: Any) -> dict[str, Any]:
    return {"name": name, "backend": "vllm", "path": f"/models/{name}", "engine_kwargs": engine_kwargs}


def config(model: dict[str, Any], **deployment: Any) -> BallastConfig:
    return load_config({"model": model, "deployments": {"model": deployment}})


def refused(model: dict[str, Any], **deployment: Any) -> str:
    with pytest.raises(ConfigError) as e:
        config(model, **deployment)
    return str(e.value)


def serve_options(cfg: BallastConfig) -> dict[str, Any]:
    d = cfg.deployment_of(cfg.model.name)
    return d.serve_options("BallastModel", False, placement=cfg.placement_of(cfg.model.name))


class TestTheGroupFromTheConfig:
    def test_one_rank_has_no_group_and_its_options_are_as_before(self) -> None:
        cfg = config(vllm(max_model_len=4096), num_gpus=1, num_cpus=2)
        assert cfg.placement_of("llama-70b") is None and cfg.model.world_size == 1
        opts = serve_options(cfg)
        assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
        assert "placement_group_bundles" not in opts and "placement_group_strategy" not in opts

    def test_tensor_parallel_on_gpus_is_a_bundle_per_rank_the_replica_in_the_first(self) -> None:
        cfg = config(vllm(tensor_parallel_size=4), num_gpus=1, num_cpus=1)
        p = cfg.placement_of("llama-70b")
        assert p is not None and (p.world, p.executor, p.strategy) == (4, "ray", "STRICT_PACK")
        opts = serve_options(cfg)
        assert opts["placement_group_bundles"] == [{"GPU": 1, "CPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
        assert opts["placement_group_strategy"] == "STRICT_PACK"
        assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}  # the ranks hold the GPUs

    def test_pipeline_and_tensor_parallel_multiply(self) -> None:
        p = config(vllm(pipeline_parallel_size=2), num_gpus=1).placement_of("llama-70b")
        assert p is not None and p.world == 2 and p.bundles() == [{"GPU": 1}, {"GPU": 1}]
        both = config(vllm(tensor_parallel_size=2, pipeline_parallel_size=3), num_gpus=1).placement_of("llama-70b")
        assert both is not None and both.world == 6 and len(both.bundles()) == 6
        assert both.describe() == "tensor_parallel_size 2 x pipeline_parallel_size 3"

    def test_on_cpu_each_rank_is_one_logical_cpu_run_by_mp(self) -> None:
        cfg = config(vllm(tensor_parallel_size=2), num_gpus=0, num_cpus=0)
        p = cfg.placement_of("llama-70b")
        assert p is not None and p.executor == "mp" and p.bundles() == [{"CPU": 1}, {"CPU": 1}]
        assert serve_options(cfg)["ray_actor_options"] == {"num_cpus": 0, "num_gpus": 0}

    def test_a_custom_rank_resource_and_an_accelerator_type(self) -> None:
        acc = {**vllm(tensor_parallel_size=2), "placement": {"rank_resources": {"accelerator": 1}}}
        p = config(acc).placement_of("llama-70b")
        assert p is not None and p.bundles() == [{"accelerator": 1}, {"accelerator": 1}] and p.executor == "mp"
        h100 = {
            **vllm(tensor_parallel_size=2),
            "placement": {"rank_resources": {"GPU": 1, "accelerator_type:H100": 0.001}},
        }
        p = config(h100, num_gpus=1).placement_of("llama-70b")
        assert p is not None and p.bundles()[1] == {"GPU": 1, "accelerator_type:H100": 0.001}

    def test_the_strategy_defaults_to_strict_pack_and_may_be_set_with_ray_ranks(self) -> None:
        spread = {**vllm(tensor_parallel_size=2), "placement": {"strategy": "SPREAD"}}
        p = config(spread, num_gpus=1).placement_of("llama-70b")
        assert (
            p is not None
            and p.strategy == "SPREAD"
            and serve_options(config(spread, num_gpus=1))["placement_group_strategy"] == "SPREAD"
        )

    def test_an_entry_of_models_with_its_own_deployment_and_a_fallback(self) -> None:
        cfg = load_config(
            {
                "models": [
                    {**vllm("big", tensor_parallel_size=2), "deployment": {"num_gpus": 1}},
                    {**vllm("small"), "deployment": {"num_gpus": 1}},
                ]
            }
        )
        big, small = cfg.placement_of("big"), cfg.placement_of("small")
        assert big is not None and big.bundles() == [{"GPU": 1}, {"GPU": 1}] and small is None
        assert [p.model for p in placements(cfg)] == ["big"]


class TestRefusals:
    def test_more_than_one_rank_is_vllms_alone(self) -> None:
        for backend in ("transformers", "builtin"):
            model = {"name": "m", "backend": backend, "engine_kwargs": {"tensor_parallel_size": 2}}
            if backend == "transformers":
                model["path"] = "/models/m"
            assert "engine_kwargs.tensor_parallel_size: tensor and pipeline parallelism are vLLM's" in refused(model)
            assert f"this model's backend is '{backend}'" in refused(model)

    @pytest.mark.parametrize("size", [0, -1, True, "2", 1.5])
    def test_a_size_is_a_whole_number_of_one_or_more(self, size: Any) -> None:
        assert "engine_kwargs.tensor_parallel_size: a whole number >= 1" in refused(vllm(tensor_parallel_size=size))

    def test_mp_ranks_live_on_the_replicas_node_so_only_strict_pack(self) -> None:
        for strategy in ("PACK", "SPREAD", "STRICT_SPREAD"):
            why = refused({**vllm(tensor_parallel_size=2), "placement": {"strategy": strategy}})
            assert f"placement.strategy: {strategy} may put ranks on other nodes" in why
            assert "only STRICT_PACK holds them there" in why

    def test_mp_on_gpus_is_refused_the_replica_holds_none(self) -> None:
        why = refused(vllm(tensor_parallel_size=2, distributed_executor_backend="mp"), num_gpus=1)
        assert "engine_kwargs.distributed_executor_backend: 'mp' starts the ranks inside the replica's" in why

    def test_other_executors_and_big_gpu_ranks_are_refused(self) -> None:
        assert "'mp' or 'ray' for a model of 2 ranks, got 'uni'" in refused(
            vllm(tensor_parallel_size=2, distributed_executor_backend="uni")
        )
        assert "at most 1 GPU per rank, got 2" in refused(vllm(tensor_parallel_size=2), num_gpus=2)

    def test_rank_gpus_and_num_gpus_say_the_same(self) -> None:
        model = {**vllm(tensor_parallel_size=2), "placement": {"rank_resources": {"accelerator": 1}}}
        assert "placement.rank_resources: GPU 0 per rank, but the deployment's num_gpus" in refused(model, num_gpus=1)
        bad = {**vllm(tensor_parallel_size=2), "placement": {"rank_resources": {"GPU": -1}}}
        assert "rank_resources: amounts are finite numbers >= 0" in refused(bad)

    def test_a_placement_on_a_model_of_one_rank_is_refused(self) -> None:
        assert "placement: for a model of more than one rank" in refused({**vllm(), "placement": {"strategy": "PACK"}})

    def test_the_placement_itself_checks_its_fields(self) -> None:
        with pytest.raises(ValueError, match="a placement group is for a model of more than one rank"):
            Placement("m", 1, 1, (("GPU", 1.0),))
        with pytest.raises(ValueError, match="rank_resources: a rank's bundle asks for some resource"):
            Placement("m", 2, 1, (("GPU", 0.0),))
        with pytest.raises(ValueError, match="strategy: one of"):
            Placement("m", 2, 1, (("CPU", 1.0),), strategy="ANYWHERE")


# -- the check at deploy, against node lists as plain data --------------------------------

GPU_NODE = {"CPU": 16.0, "GPU": 1.0, "memory": 64e9}
TP4 = Placement("llama-70b", 4, 1, (("GPU", 1.0),), strategy="STRICT_PACK", executor="ray")


class TestTheCheckAtDeploy:
    def test_strict_pack_needs_one_node_that_holds_every_bundle(self) -> None:
        assert placement_problem(TP4, [GPU_NODE, GPU_NODE, {"CPU": 8.0}]) == (
            "model llama-70b: tensor_parallel_size 4 x pipeline_parallel_size 1 needs {GPU: 4} on one node "
            "(STRICT_PACK: 4 bundles of {GPU: 1}); the largest node has {GPU: 1}"
        )
        assert placement_problem(TP4, [GPU_NODE, {"CPU": 32.0, "GPU": 8.0}]) is None

    def test_the_replicas_own_cpus_count_in_the_first_bundle(self) -> None:
        p = Placement("m", 2, 1, (("CPU", 1.0),), replica_resources=(("CPU", 2.0),))
        assert placement_problem(p, [{"CPU": 3.0}]) == (
            "model m: tensor_parallel_size 2 x pipeline_parallel_size 1 needs {CPU: 4} on one node (STRICT_PACK: "
            "2 bundles of {CPU: 1}, the first with the replica's own {CPU: 2}); the largest node has {CPU: 3}"
        )
        assert placement_problem(p, [{"CPU": 4.0}]) is None

    def test_pack_and_spread_may_use_several_nodes(self) -> None:
        for strategy in ("PACK", "SPREAD"):
            p = Placement("m", 4, 1, (("GPU", 1.0),), strategy=strategy, executor="ray")
            assert placement_problem(p, [GPU_NODE] * 4) is None
            assert placement_problem(p, [GPU_NODE] * 3) == (
                f"model m: tensor_parallel_size 4 x pipeline_parallel_size 1 needs {{GPU: 4}} in all ({strategy}: "
                "4 bundles of {GPU: 1}); the cluster has {GPU: 3}"
            )
        big = Placement("m", 2, 1, (("GPU", 1.0), ("CPU", 32.0)), strategy="PACK", executor="ray")
        assert "needs a node for each bundle" in (placement_problem(big, [GPU_NODE] * 8) or "")

    def test_strict_spread_needs_a_node_per_bundle(self) -> None:
        p = Placement("m", 2, 1, (("GPU", 1.0),), strategy="STRICT_SPREAD", executor="ray")
        assert placement_problem(p, [{"CPU": 8.0, "GPU": 2.0}]) == (
            "model m: tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2 nodes that each hold a bundle "
            "(STRICT_SPREAD: 2 bundles of {GPU: 1}); the largest node has {GPU: 2}"
        )
        assert placement_problem(p, [GPU_NODE, {"CPU": 4.0}, GPU_NODE]) is None

    def test_a_node_type_the_autoscaler_may_add_is_enough(self) -> None:
        eight = {"CPU": 96.0, "GPU": 8.0}
        assert placement_problem(TP4, [{"CPU": 4.0}], node_types=[eight]) is None
        assert placement_problem(TP4, [{"CPU": 4.0}], node_types=[GPU_NODE]) == (
            "model llama-70b: tensor_parallel_size 4 x pipeline_parallel_size 1 needs {GPU: 4} on one node "
            "(STRICT_PACK: 4 bundles of {GPU: 1}); the largest node has {GPU: 0}, and no node type the "
            "autoscaler may add holds it"
        )
        spread = Placement("m", 4, 1, (("GPU", 1.0),), strategy="SPREAD", executor="ray")
        assert placement_problem(spread, [{"CPU": 4.0}], node_types=[GPU_NODE]) is None  # added four times

    def test_a_custom_resource_no_node_has(self) -> None:
        p = Placement("m", 2, 1, (("accelerator", 1.0),))
        assert placement_problem(p, [{"CPU": 4.0}]) == (
            "model m: tensor_parallel_size 2 x pipeline_parallel_size 1 needs {accelerator: 2} on one node "
            "(STRICT_PACK: 2 bundles of {accelerator: 1}); the largest node has {accelerator: 0}"
        )
        assert placement_problem(p, [{"CPU": 4.0, "accelerator": 2.0}]) is None

    def test_check_placements_refuses_with_the_models_reason_or_lets_it_go(self, monkeypatch) -> None:
        import ray

        cfg = config(vllm(tensor_parallel_size=8))
        with pytest.raises(ConfigError) as e:
            check_placements(cfg, nodes=[{"CPU": 4.0}])
        assert str(e.value) == (
            "placement: model llama-70b: tensor_parallel_size 8 x pipeline_parallel_size 1 needs {CPU: 8} on one "
            "node (STRICT_PACK: 8 bundles of {CPU: 1}); the largest node has {CPU: 4}"
        )
        check_placements(cfg, nodes=[{"CPU": 8.0}])  # one node holds it
        check_placements(config({**vllm(tensor_parallel_size=8), "placement": {"check": False}}), nodes=[{"CPU": 4.0}])
        check_placements(config(vllm()), nodes=[])  # one rank: nothing to check
        # No Ray in this process (`make test` runs the unit tests after the integration
        # session's Ray: it is taken away here, not assumed absent): nothing read, nothing refused.
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        check_placements(cfg)
