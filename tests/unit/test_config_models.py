"""ballast.config's ``models`` list: parsing, every refusal naming its field, and one-model
configs exactly as before (``model:`` is the one-model form of ``models:``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ballast.config import BallastConfig, BatchConfig, ModelConfig, ResponsesConfig, load_config, with_model_dir
from ballast.config.model import EmbedSettings
from ballast.errors import ConfigError
from ballast.policies.catalog import Listed, Target

ROOT = Path(__file__).resolve().parents[2]
# The dumps of the cluster's one-model configs before ``models`` existed.
BEFORE = json.loads((ROOT / "tests/unit/data/one_model_configs.json").read_text())

LLAMA = {
    "name": "llama",
    "backend": "vllm",
    "path": "/models/llama",
    "engine_kwargs": {"max_model_len": 4096},
    "adapters": {"sql": "/adapters/sql", "support": {"path": "/adapters/support", "tenants": ["gold"]}},
    "cost_per_token": 4.0,
}
QWEN = {"name": "qwen", "backend": "transformers", "path": "/models/qwen"}
TENANTS: dict[str, Any] = {"gold": {}, "free": {}}


def two(**over: Any) -> dict[str, Any]:
    return {"tenants": TENANTS, "models": [LLAMA, QWEN], **over}


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as e:
        BallastConfig.model_validate(data)
    return str(e.value)


def cluster_configs() -> dict[str, dict[str, Any]]:
    """The one-model configs: cluster/local.yaml, and the production config as it was before
    it served vLLM models (cluster/serve_config.yaml now writes ``models``)."""
    return {
        "cluster/local.yaml": yaml.safe_load((ROOT / "cluster/local.yaml").read_text()),
        "cluster/serve_config.yaml": BEFORE["cluster/serve_config.yaml"],
    }


class TestOneModelConfigsUnchanged:
    @pytest.mark.parametrize("name", ["cluster/local.yaml", "cluster/serve_config.yaml"])
    def test_loaded_as_before(self, name: str) -> None:
        cfg = load_config(cluster_configs()[name])
        assert cfg == load_config(BEFORE[name])  # the old dump loads to the same config
        dump = cfg.model_dump(mode="json")
        for tenant in dump["tenants"].values():
            assert tenant.pop("models") is None  # the fields added to a tenant: the models it may use,
            assert tenant.pop("cache_group") is None  # and its prefix-cache group (its own)
            assert tenant.pop("batch_cost") is None  # and its batch tokens' cost (batch.cost)
        # the prefix-cache salts' secret, where it is read from
        assert dump["auth"].pop("cache_salt_secret_env") == "BALLAST_CACHE_SALT_SECRET"
        assert dump["auth"].pop("cache_salt_secret_file") is None
        assert dump["resilience"]["gate"].pop("slow_cut_min_gain") == 0.8  # the gate's slow cuts on trial
        assert dump["resilience"]["gate"].pop("rows_curve_gain") == 0.85  # vLLM's limit: the rows curve
        assert dump["watchdog"].pop("pss_interval_s") == 10.0  # PSS read every 10 s, not every sample
        assert dump["degradation"].pop("capacity_window_s") == 30.0  # demand against a 30 s peak, not one window
        assert dump.pop("adapters_root") is None  # no adapter added at run time unless a root is written
        assert dump.pop("batch") == BatchConfig().model_dump(mode="json")  # the Batch API's section, defaults
        assert dump.pop("responses") == ResponsesConfig().model_dump(mode="json")  # stored responses, defaults
        # a schema's patterns, counts and literals bounded (ballast/policies/schema.py)
        assert dump["limits"].pop("max_schema_pattern_chars") == 128
        assert dump["limits"].pop("max_schema_repeat") == 1024
        assert dump["limits"].pop("max_schema_literal_chars") == 32768
        assert dump["limits"].pop("max_choices") == 8  # OpenAI's n, bounded
        models = [dump["model"]] + ([dump["fallback"]["model"]] if dump.get("fallback") else [])
        for model in models:
            assert model.pop("cpus") is None  # fields added to a model: not pinned,
            assert model.pop("compute_niceness") is None  # the compute at the replica's niceness,
            assert model.pop("reasoning_parser") is None  # no reasoning parser (vLLM's, by name),
            assert model.pop("kind") == "generate"  # a generating model, not an embeddings one,
            assert model.pop("embed") == EmbedSettings().model_dump(mode="json")
            # and where a model of several ranks places them (the default, unused with one)
            assert model.pop("placement") == {"strategy": "STRICT_PACK", "rank_resources": None, "check": True}
            # and how a replica is chosen (by what it holds: the defaults)
            assert model.pop("routing") == {
                "prefix_affinity": True,
                "load_bound_ratio": 1.25,
                "min_slack": 2,
                "balance_from_level": 3,
                "report_blocks": 16384,
            }
        assert dump == BEFORE[name]  # no `models` key: the one-model form dumps as model
        assert len(cfg.models) == 1 and not cfg.models[0].has_extras()
        assert cfg.models[0].model_dump(include=set(ModelConfig.model_fields)) == cfg.model.model_dump()

    def test_model_means_a_list_of_it(self) -> None:
        cfg = load_config({"model": {"name": "m1", "max_batch_size": 3}, "tenants": TENANTS})
        assert [m.name for m in cfg.models] == ["m1"] and cfg.models[0].max_batch_size == 3
        assert cfg.catalog().listed_for("free") == (Listed("m1"),)
        assert cfg.deployment_of("m1") == cfg.deployments.model
        assert cfg.fallback_of("m1") is None

    def test_a_model_instance_still_builds_a_config(self) -> None:
        cfg = BallastConfig(model=ModelConfig(name="x"))
        assert cfg.models[0].name == "x" and cfg.model.name == "x"

    def test_the_fallback_is_the_primarys(self) -> None:
        cfg = load_config(ROOT / "cluster/local.yaml")
        assert cfg.fallback is not None and cfg.fallback_of(cfg.model.name) == cfg.fallback

    def test_a_one_entry_list_is_the_same_config(self) -> None:
        assert load_config({"models": [{"name": "m1"}]}) == load_config({"model": {"name": "m1"}})


class TestModelsList:
    def test_parsed(self) -> None:
        cfg = BallastConfig.model_validate(two())
        assert [m.name for m in cfg.models] == ["llama", "qwen"]
        assert cfg.model.name == "llama" and cfg.model.engine_kwargs == {"max_model_len": 4096}
        assert type(cfg.model) is ModelConfig  # every reader of model sees the primary, as before
        llama = cfg.models[0]
        assert llama.adapters["sql"].path == "/adapters/sql" and llama.adapters["sql"].tenants is None
        assert llama.adapters["support"].tenants == ["gold"]
        assert (llama.cost_per_token, cfg.models[1].cost_per_token) == (4.0, 1.0)

    def test_the_catalog_it_builds(self) -> None:
        c = BallastConfig.model_validate(two(tenants={"gold": {}, "free": {"models": ["llama:sql", "qwen"]}})).catalog()
        assert c.resolve("llama:sql") == c.resolve("sql") == Target("llama", "sql")
        assert c.listed_for("free") == (Listed("sql", "llama"), Listed("qwen"))
        assert c.listed_for("gold")[:3] == (Listed("llama"), Listed("sql", "llama"), Listed("support", "llama"))
        assert c.cost_per_token("support") == 4.0

    def test_dump_loads_back(self) -> None:
        cfg = BallastConfig.model_validate(two())
        dump = cfg.model_dump(mode="json")
        assert "model" not in dump and len(dump["models"]) == 2
        assert BallastConfig.model_validate(dump) == cfg

    def test_per_model_deployment_and_fallback(self) -> None:
        fb = {"model": {"name": "small"}}
        cfg = BallastConfig.model_validate(
            two(models=[{**LLAMA, "fallback": fb}, {**QWEN, "deployment": {"max_replicas": 5}}])
        )
        assert cfg.deployment_of("llama") == cfg.deployments.model
        assert cfg.deployment_of("qwen").max_replicas == 5
        assert cfg.fallback_of("llama") is not None and cfg.fallback_of("llama").model.name == "small"  # type: ignore[union-attr]
        assert cfg.fallback_of("qwen") is None  # the top-level fallback is the first model's alone
        with pytest.raises(KeyError):
            cfg.deployment_of("sql")

    def test_load_config_takes_several_models_and_names_their_deployments(self) -> None:
        cfg = load_config(two())
        assert [m.name for m in cfg.models] == ["llama", "qwen"] and cfg.model.name == "llama"
        assert cfg.deployment_name("llama") == "BallastModel"  # the first keeps the one-model name
        assert cfg.deployment_name("qwen") == "BallastModel-qwen"
        assert cfg.fallback_deployment_name("qwen") == "BallastFallbackModel-qwen"

    def test_load_config_takes_one_model_with_adapters(self) -> None:
        cfg = load_config({"tenants": TENANTS, "models": [LLAMA]})
        assert [x.id for x in cfg.catalog().listed_for("free")] == ["llama", "sql"]
        assert "models" in cfg.model_dump(mode="json")  # adapters: only models can say it

    def test_model_dir_replaces_the_first_entry(self, tmp_path: Path) -> None:
        data = with_model_dir(two(), tmp_path / "my-llama", "vllm")
        assert "model" not in data and data["models"][0]["name"] == "my-llama"
        assert data["models"][0]["adapters"] == LLAMA["adapters"] and data["models"][1] == QWEN
        data = with_model_dir({"models": [LLAMA]}, tmp_path / "hf", "transformers")
        assert "adapters" not in data["models"][0] and "engine_kwargs" not in data["models"][0]


class TestRefusals:
    @pytest.mark.parametrize(
        ("change", "fields"),
        [
            ({"model": {"name": "other"}}, ["model and models"]),
            ({"models": []}, ["models"]),
            ({"models": [LLAMA, {**QWEN, "adapters": {"a": "/a"}}]}, ["models.1", "adapters", "'transformers'"]),
            ({"models": [LLAMA, {**QWEN, "name": "llama"}]}, ["models[1].name", "already models[0].name"]),
            ({"models": [LLAMA, {**QWEN, "name": "sql"}]}, ["models[0].adapters.sql", "already models[1].name"]),
            (
                {"models": [LLAMA, {**LLAMA, "name": "l2", "adapters": {"sql": "/b"}}]},
                ["models[1].adapters.sql", "already models[0].adapters.sql"],
            ),
            ({"models": [{**QWEN, "name": "q:1"}]}, ["models[0].name", "':'"]),
            ({"models": [{**QWEN, "name": "qwén"}]}, ["models[0].name", "may hold only letters, digits", "'é'"]),
            ({"models": [{**QWEN, "name": "q;show"}]}, ["models[0].name", "not ';'", "HAProxy"]),
            ({"models": [{**QWEN, "name": "#q"}]}, ["models[0].name", "not '#'"]),
            ({"models": [{**QWEN, "name": "q\\n"}]}, ["models[0].name", "not '\\\\'"]),
            ({"models": [{**LLAMA, "adapters": {"a:b": "/a"}}]}, ["adapters", "':'"]),
            ({"models": [{**LLAMA, "adapters": {"a;b": "/a"}}]}, ["adapters", "adapter name", "not ';'"]),
            ({"models": [{**LLAMA, "adapters": {"a": ""}}]}, ["adapters.a", "path"]),
            ({"models": [{**LLAMA, "adapters": {"a": {"path": "/a", "x": 1}}}]}, ["adapters.a.x"]),
            ({"models": [{**QWEN, "cost_per_token": 0}]}, ["models.0.cost_per_token"]),
            ({"models": [{**QWEN, "tenants": []}]}, ["models.0.tenants"]),
            ({"models": [{**QWEN, "tenants": ["nobody"]}]}, ["models[0].tenants", "['nobody'] are not in tenants"]),
            (
                {"models": [{**LLAMA, "tenants": ["free"]}]},
                ["models[0].adapters.support.tenants", "['gold'] are not in models[0].tenants"],
            ),
            ({"tenants": {"gold": {}, "free": {"models": ["nope"]}}}, ["tenants.free.models", "'nope'"]),
            ({"tenants": {"gold": {}, "free": {"models": ["qwen:sql"]}}}, ["tenants.free.models", "'qwen:sql'"]),
            ({"tenants": {"gold": {}, "free": {"models": []}}}, ["tenants.free.models"]),
            (
                {"fallback": {"model": {"name": "sql"}}},
                ["fallback.model.name", "'sql' is already models[0].adapters.sql"],
            ),
            (
                {"fallback": {}, "models": [{**LLAMA, "fallback": {"model": {"name": "f2"}}}]},
                ["fallback and models[0].fallback"],
            ),
        ],
    )
    def test_each_names_its_field(self, change: dict[str, Any], fields: list[str]) -> None:
        message = refused(two(**change))
        for part in fields:
            assert part in message, (part, message)

    def test_model_beside_models_default_or_the_same_is_taken(self) -> None:
        base = BallastConfig.model_validate(two())
        assert BallastConfig.model_validate(two(model={})) == base
        primary = {k: v for k, v in LLAMA.items() if k not in ("adapters", "cost_per_token")}
        assert BallastConfig.model_validate(two(model=primary)) == base

    def test_load_config_error_names_the_field(self) -> None:
        with pytest.raises(ConfigError, match=r"models\.0\n.*adapters: LoRA adapters are vLLM's"):
            load_config({"models": [{"name": "m", "adapters": {"a": "/a"}}]})


class TestAdaptersRoot:
    @pytest.mark.parametrize("root", ["/mnt/models/adapters", "models", None])
    def test_a_directory_or_none(self, root: Any) -> None:
        assert BallastConfig.model_validate(two(adapters_root=root)).adapters_root == root

    @pytest.mark.parametrize("root", ["/", "//", "~/adapters", "~", "a\x00b", ""])
    def test_the_whole_file_system_a_home_or_nothing_is_refused(self, root: str) -> None:
        assert "adapters_root" in refused(two(adapters_root=root))
