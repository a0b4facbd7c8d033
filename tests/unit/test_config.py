"""ballast.config: load_config (YAML, dicts, errors that name the field) and KeyStore.

No clock is involved; secrets come from an explicit ``environ`` dict and files
under ``tmp_path``, never from the real environment.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from ballast.config import BallastConfig, load_config
from ballast.errors import ConfigError
from ballast.policies.autoscale import AutoscaleConfig
from ballast.policies.criticality import Criticality
from ballast.policies.degradation import DegradationConfig
from ballast.router.auth import KeyStore

LOCAL_YAML = Path(__file__).resolve().parents[2] / "cluster" / "local.yaml"

TENANTS = {"gold": {}, "free": {}}
GRANTED = {"gold": {"rate_tokens_per_s": 1000}, "free": {"unlimited": True}}  # what production takes


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def cfg_with(**auth: Any) -> BallastConfig:
    return load_config({"tenants": TENANTS, "auth": auth})


def five_levels() -> list[dict[str, Any]]:
    return [
        {"max_tokens": 400, "max_batch_size": 20, "streaming": True, "admitted": [c.value for c in Criticality]},
        {"max_tokens": 300, "max_batch_size": 16, "streaming": True, "admitted": ["critical_plus", "critical"]},
        {"max_tokens": 200, "max_batch_size": 8, "streaming": False, "admitted": ["critical_plus", "critical"]},
        {"max_tokens": 100, "max_batch_size": 4, "streaming": False, "admitted": ["critical_plus"]},
        {"max_tokens": 50, "max_batch_size": 2, "streaming": False, "admitted": []},
    ]


# --------------------------------------------------------------------------- load_config


class TestLoadLocalYaml:
    def test_local_yaml_loads_with_its_values(self) -> None:
        cfg = load_config(LOCAL_YAML)
        assert cfg.environment == "local"
        assert cfg.app_name == "ballast"
        assert cfg.http.port == 8000
        assert cfg.deployments.model.min_replicas == 1
        assert cfg.deployments.model.max_replicas == 2
        assert cfg.deployments.model.max_queued_requests == 64
        assert cfg.degradation.queue_length_thresholds == (50, 100, 200, 500)
        assert cfg.degradation.stable_window_s == 30
        assert [lv.max_tokens for lv in cfg.degradation.levels] == [511, 256, 128, 64, 32]
        assert set(cfg.tenants) == {"gold", "free"}
        assert cfg.auth.demo_keys == {"dev-key-gold": "gold", "dev-key-free": "free"}

    def test_str_path_and_path_give_the_same_config(self) -> None:
        assert load_config(str(LOCAL_YAML)) == load_config(LOCAL_YAML)

    def test_local_yaml_degradation_config_carries_the_levels(self) -> None:
        deg = load_config(LOCAL_YAML).degradation_config()
        assert isinstance(deg, DegradationConfig)
        assert deg.queue_length_thresholds == (50, 100, 200, 500)
        assert deg.queue_wait_ms_thresholds == (250, 500, 1000, 2000)
        assert [c.max_tokens for c in deg.constraints] == [511, 256, 128, 64, 32]
        assert [c.max_batch_size for c in deg.constraints] == [32, 24, 16, 8, 4]
        assert [c.streaming for c in deg.constraints] == [True, True, False, False, False]
        assert deg.constraints[1].admitted == frozenset(Criticality) - {Criticality.SHEDDABLE}
        assert deg.constraints[4].admitted == frozenset()
        assert deg.stable_window_s == 30

    def test_local_yaml_autoscale_config_carries_the_values(self) -> None:
        auto = load_config(LOCAL_YAML).autoscale_config()
        assert isinstance(auto, AutoscaleConfig)
        assert (auto.min_replicas, auto.max_replicas) == (1, 2)
        assert auto.target_ongoing_requests == 8
        assert (auto.stable_window_s, auto.panic_window_s, auto.scale_down_delay_s) == (60, 6, 30)


class TestLoadDicts:
    def test_none_and_empty_dict_give_defaults(self) -> None:
        assert load_config(None) == load_config({}) == BallastConfig()

    def test_a_built_config_is_returned_as_is(self) -> None:
        cfg = load_config({"app_name": "x"})
        assert load_config(cfg) is cfg

    def test_empty_yaml_file_gives_defaults(self, tmp_path: Path) -> None:
        p = tmp_path / "empty.yaml"
        p.write_text("")
        assert load_config(p) == BallastConfig()

    def test_config_is_frozen(self) -> None:
        cfg = load_config({})
        with pytest.raises(ValueError):
            cfg.app_name = "changed"  # type: ignore[misc]

    def test_degradation_config_carries_non_default_values(self) -> None:
        cfg = load_config(
            {
                "degradation": {
                    "queue_length_thresholds": [5, 10, 20, 40],
                    "queue_wait_ms_thresholds": [10, 20, 30, 40],
                    "gpu_util_pct_thresholds": [None, 50, 60, 70],
                    "vram_pct_thresholds": [80, None, None, 90],
                    "error_rate_threshold": 0.25,
                    "error_rate_min_requests": 7,
                    "stable_window_s": 12,
                    "levels": five_levels(),
                }
            }
        )
        deg = cfg.degradation_config()
        assert deg.queue_length_thresholds == (5, 10, 20, 40)
        assert deg.queue_wait_ms_thresholds == (10, 20, 30, 40)
        assert deg.gpu_util_pct_thresholds == (None, 50, 60, 70)
        assert deg.vram_pct_thresholds == (80, None, None, 90)
        assert deg.error_rate_threshold == 0.25
        assert deg.error_rate_min_requests == 7
        assert deg.stable_window_s == 12
        assert [c.to_dict() for c in deg.constraints] == five_levels()

    def test_autoscale_config_carries_non_default_values(self) -> None:
        cfg = load_config(
            {
                "deployments": {"model": {"min_replicas": 2, "max_replicas": 7}},
                "autoscale": {
                    "target_ongoing_requests": 3,
                    "target_gpu_util_pct": None,
                    "stable_window_s": 40,
                    "panic_window_s": 4,
                    "panic_threshold_ratio": 1.5,
                    "scale_down_delay_s": 9,
                    "max_scale_down_step": 2,
                },
            }
        )
        auto = cfg.autoscale_config()
        assert (auto.min_replicas, auto.max_replicas) == (2, 7)
        assert auto.target_ongoing_requests == 3
        assert auto.target_gpu_util_pct is None
        assert (auto.stable_window_s, auto.panic_window_s) == (40, 4)
        assert auto.panic_threshold_ratio == 1.5
        assert auto.scale_down_delay_s == 9
        assert auto.max_scale_down_step == 2


class TestErrorsNameTheField:
    @pytest.mark.parametrize(
        "data, names",
        [
            ({"deployments": {"model": {"min_replicas": 3, "max_replicas": 2}}}, ["deployments.model", "min_replicas"]),
            (
                {"deployments": {"model": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5}}},
                ["deployments.model", "initial_replicas"],
            ),
            ({"bogus": 1}, ["bogus"]),
            ({"controller": {"tick_ms": 5}}, ["controller.tick_ms"]),
            ({"degradation": {"levels": five_levels()[:4]}}, ["degradation.levels"]),
            ({"degradation": {"levels": five_levels() + five_levels()[-1:]}}, ["degradation.levels"]),
            ({"degradation": {"queue_length_thresholds": [1, 2, 3]}}, ["degradation.queue_length_thresholds"]),
            ({"controller": {"snapshot_stale_s": 20, "snapshot_max_stale_s": 15}}, ["controller", "snapshot_stale_s"]),
            ({"http": {"port": 0}}, ["http.port"]),
            ({"tenants": {"bad name!": {}}}, ["tenants", "bad name!"]),
        ],
    )
    def test_bad_values_raise_config_error_naming_the_field(self, data: dict[str, Any], names: list[str]) -> None:
        with pytest.raises(ConfigError) as info:
            load_config(data)
        assert info.value.where == "config"
        for name in names:
            assert name in info.value.reason

    def test_policy_side_check_surfaces_as_config_error(self) -> None:
        # Pydantic accepts four ints; the DegradationConfig built from them refuses
        # a descending list, and load_config reports it with the field's name.
        with pytest.raises(ConfigError) as info:
            load_config({"degradation": {"queue_length_thresholds": [500, 200, 100, 50]}})
        assert "queue_length_thresholds" in info.value.reason
        assert "ascending" in info.value.reason

    def test_levels_that_get_looser_are_refused(self) -> None:
        levels = five_levels()
        levels[3]["max_tokens"] = 10_000  # level 3 allows more than level 2
        with pytest.raises(ConfigError) as info:
            load_config({"degradation": {"levels": levels}})
        assert "max_tokens" in info.value.reason

    def test_config_error_is_a_value_error_and_pickles(self) -> None:
        import pickle

        with pytest.raises(ConfigError) as info:
            load_config({"bogus": 1})
        again = pickle.loads(pickle.dumps(info.value))
        assert isinstance(again, ValueError)
        assert (again.where, again.reason) == (info.value.where, info.value.reason)
        assert str(again).startswith("config: ")

    def test_bad_yaml_file_names_the_file(self, tmp_path: Path) -> None:
        p = tmp_path / "bad.yaml"
        p.write_text("model: [1, 2\n")
        with pytest.raises(ConfigError) as info:
            load_config(p)
        assert info.value.where == str(p)
        assert "not valid YAML" in info.value.reason

    def test_yaml_whose_top_level_is_not_a_mapping(self, tmp_path: Path) -> None:
        p = tmp_path / "list.yaml"
        p.write_text("- 1\n- 2\n")
        with pytest.raises(ConfigError) as info:
            load_config(p)
        assert info.value.where == str(p)
        assert "mapping" in info.value.reason

    def test_missing_file_names_the_file(self, tmp_path: Path) -> None:
        p = tmp_path / "nope.yaml"
        with pytest.raises(ConfigError) as info:
            load_config(p)
        assert info.value.where == str(p)
        assert "cannot read" in info.value.reason

    def test_bad_value_in_a_file_names_the_file_and_the_field(self, tmp_path: Path) -> None:
        p = tmp_path / "bounds.yaml"
        p.write_text("deployments:\n  model: {min_replicas: 4, max_replicas: 2}\n")
        with pytest.raises(ConfigError) as info:
            load_config(p)
        assert info.value.where == str(p)
        assert "min_replicas" in info.value.reason

    def test_non_utf8_file_raises_config_error(self, tmp_path: Path) -> None:
        p = tmp_path / "latin1.yaml"
        p.write_bytes("app_name: caf\u00e9\n".encode("latin-1"))
        with pytest.raises(ConfigError) as info:
            load_config(p)
        assert info.value.where == str(p)


class TestDemoSecrets:
    def test_production_refuses_demo_keys(self) -> None:
        with pytest.raises(ConfigError) as info:
            load_config({"environment": "production", "tenants": TENANTS, "auth": {"demo_keys": {"k": "gold"}}})
        assert "auth.demo_keys" in info.value.reason

    def test_production_refuses_demo_admin_token(self) -> None:
        with pytest.raises(ConfigError) as info:
            load_config({"environment": "production", "auth": {"demo_admin_token": "t"}})
        assert "demo_admin_token" in info.value.reason

    def test_production_without_demo_secrets_loads(self) -> None:
        cfg = load_config({"environment": "production", "tenants": GRANTED})
        assert cfg.environment == "production"

    def test_local_yaml_switched_to_production_is_refused(self) -> None:
        import yaml

        data = yaml.safe_load(LOCAL_YAML.read_text())
        data["environment"] = "production"
        with pytest.raises(ConfigError):
            load_config(data)

    def test_demo_keys_naming_unknown_tenants_are_refused(self) -> None:
        with pytest.raises(ConfigError) as info:
            load_config({"tenants": {"gold": {}}, "auth": {"demo_keys": {"a": "gold", "b": "silver"}}})
        assert "tenants not in tenants: ['silver']" in info.value.reason


# --------------------------------------------------------------------------- KeyStore


def all_leaves(obj: Any, seen: set[int] | None = None) -> list[Any]:
    """Every str/bytes reachable from ``obj``'s attributes, containers included."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (str, bytes, bytearray)):
        return [obj]
    out: list[Any] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += all_leaves(k, seen) + all_leaves(v, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            out += all_leaves(v, seen)
    elif hasattr(obj, "__dict__"):
        out += all_leaves(vars(obj), seen)
    return out


class TestKeyStore:
    def test_demo_keys_map_to_tenants(self) -> None:
        store = KeyStore.from_config(load_config(LOCAL_YAML), environ={})
        assert store.tenant_for("dev-key-gold") == "gold"
        assert store.tenant_for("dev-key-free") == "free"
        assert len(store) == 2

    def test_unknown_key_is_none(self) -> None:
        store = KeyStore.from_config(load_config(LOCAL_YAML), environ={})
        assert store.tenant_for("dev-key-silver") is None
        assert store.tenant_for("") is None
        assert store.tenant_for("dev-key-gold ") is None  # no trimming of presented keys

    def test_env_keys_plain_and_sha256(self) -> None:
        environ = {"BALLAST_API_KEYS": f"k1=gold, k2=free\nsha256:{sha256_hex('hashed-key')}=gold"}
        store = KeyStore.from_config(cfg_with(), environ=environ)
        assert store.tenant_for("k1") == "gold"
        assert store.tenant_for("k2") == "free"
        assert store.tenant_for("hashed-key") == "gold"
        assert store.tenant_for(f"sha256:{sha256_hex('hashed-key')}") is None  # the digest is not a key
        assert len(store) == 3

    def test_sha256_hex_is_case_insensitive(self) -> None:
        environ = {"BALLAST_API_KEYS": f"sha256:{sha256_hex('K').upper()}=free"}
        assert KeyStore.from_config(cfg_with(), environ=environ).tenant_for("K") == "free"

    def test_key_with_equals_sign_splits_at_the_last_one(self) -> None:
        store = KeyStore.from_config(cfg_with(), environ={"BALLAST_API_KEYS": "abc==gold"})
        assert store.tenant_for("abc=") == "gold"

    def test_env_var_name_comes_from_config(self) -> None:
        cfg = cfg_with(api_keys_env="MY_KEYS")
        store = KeyStore.from_config(cfg, environ={"MY_KEYS": "mine=gold", "BALLAST_API_KEYS": "other=free"})
        assert store.tenant_for("mine") == "gold"
        assert store.tenant_for("other") is None

    def test_keys_file_with_comments_and_blank_lines(self, tmp_path: Path) -> None:
        p = tmp_path / "keys.txt"
        p.write_text(f"# tenant keys\n\nfile-key=gold\n  sha256:{sha256_hex('fk2')}=free  \n")
        store = KeyStore.from_config(cfg_with(api_keys_file=str(p)), environ={})
        assert store.tenant_for("file-key") == "gold"
        assert store.tenant_for("fk2") == "free"
        assert len(store) == 2

    def test_sources_merge_and_env_overrides_file_overrides_demo(self, tmp_path: Path) -> None:
        p = tmp_path / "keys.txt"
        p.write_text("shared=free\nfile-only=free\n")
        cfg = cfg_with(demo_keys={"shared": "gold", "demo-only": "gold"}, api_keys_file=str(p))
        assert KeyStore.from_config(cfg, environ={}).tenant_for("shared") == "free"
        store = KeyStore.from_config(cfg, environ={"BALLAST_API_KEYS": "shared=gold"})
        assert store.tenant_for("shared") == "gold"
        assert store.tenant_for("demo-only") == "gold"
        assert store.tenant_for("file-only") == "free"
        assert len(store) == 3

    @pytest.mark.parametrize(
        "entry",
        [
            "no-equals-sign",
            "=gold",
            "key=",
            "sha256:zz=gold",
            "sha256:abcd=gold",  # 2 bytes, not 32
            f"sha256:{sha256_hex('x')}00=gold",  # 33 bytes
        ],
    )
    def test_malformed_env_entry_raises_naming_the_variable(self, entry: str) -> None:
        with pytest.raises(ConfigError) as info:
            KeyStore.from_config(cfg_with(), environ={"BALLAST_API_KEYS": f"ok=gold,{entry}"})
        assert info.value.where == "$BALLAST_API_KEYS"

    def test_malformed_file_entry_raises_naming_the_file(self, tmp_path: Path) -> None:
        p = tmp_path / "keys.txt"
        p.write_text("ok=gold\njust-a-key\n")
        with pytest.raises(ConfigError) as info:
            KeyStore.from_config(cfg_with(api_keys_file=str(p)), environ={})
        assert info.value.where == str(p)

    def test_missing_keys_file_raises_naming_the_file(self, tmp_path: Path) -> None:
        p = tmp_path / "absent.txt"
        with pytest.raises(ConfigError) as info:
            KeyStore.from_config(cfg_with(api_keys_file=str(p)), environ={})
        assert info.value.where == str(p)

    def test_keys_for_unknown_tenants_are_refused(self) -> None:
        with pytest.raises(ConfigError) as info:
            KeyStore.from_config(cfg_with(), environ={"BALLAST_API_KEYS": "k=gold,k2=platinum"})
        assert info.value.where == "auth"
        assert "platinum" in info.value.reason

    def test_comment_with_a_comma_stays_a_comment(self, tmp_path: Path) -> None:
        p = tmp_path / "keys.txt"
        p.write_text("live=gold\n# revoked 2024-05: old-key=gold, older-key=free\n")
        store = KeyStore.from_config(cfg_with(api_keys_file=str(p)), environ={})
        assert store.tenant_for("live") == "gold"
        assert store.tenant_for("older-key") is None

    def test_non_utf8_keys_file_raises_config_error(self, tmp_path: Path) -> None:
        p = tmp_path / "keys.txt"
        p.write_bytes(b"k\xff=gold\n")
        with pytest.raises(ConfigError) as info:
            KeyStore.from_config(cfg_with(api_keys_file=str(p)), environ={})
        assert info.value.where == str(p)

    # -- admin token ----------------------------------------------------------------
    def test_demo_admin_token(self) -> None:
        store = KeyStore.from_config(load_config(LOCAL_YAML), environ={})
        assert store.is_admin("dev-admin-token")
        assert not store.is_admin("dev-key-gold")
        assert not store.is_admin("")

    def test_env_admin_token_overrides_the_demo_token(self) -> None:
        store = KeyStore.from_config(load_config(LOCAL_YAML), environ={"BALLAST_ADMIN_TOKEN": " env-admin \n"})
        assert store.is_admin("env-admin")  # stripped
        assert not store.is_admin("dev-admin-token")

    def test_admin_token_file_overrides_demo_and_env_overrides_file(self, tmp_path: Path) -> None:
        p = tmp_path / "admin.txt"
        p.write_text("file-admin\n")
        cfg = cfg_with(demo_admin_token="demo-admin", admin_token_file=str(p))
        from_file = KeyStore.from_config(cfg, environ={})
        assert from_file.is_admin("file-admin")
        assert not from_file.is_admin("demo-admin")
        from_env = KeyStore.from_config(cfg, environ={"BALLAST_ADMIN_TOKEN": "env-admin"})
        assert from_env.is_admin("env-admin")
        assert not from_env.is_admin("file-admin")

    def test_missing_admin_token_file_raises_naming_the_file(self, tmp_path: Path) -> None:
        p = tmp_path / "absent-admin.txt"
        with pytest.raises(ConfigError) as info:
            KeyStore.from_config(cfg_with(admin_token_file=str(p)), environ={})
        assert info.value.where == str(p)

    def test_no_admin_token_means_nobody_is_admin(self) -> None:
        store = KeyStore.from_config(cfg_with(), environ={})
        assert not store.is_admin("")
        assert not store.is_admin("anything")

    # -- no plaintext --------------------------------------------------------------
    def test_store_keeps_no_plaintext(self, tmp_path: Path) -> None:
        p = tmp_path / "keys.txt"
        p.write_text("file-secret-key=free\n")
        admin_file = tmp_path / "admin.txt"
        admin_file.write_text("admin-secret-token\n")
        cfg = cfg_with(demo_keys={"demo-secret-key": "gold"}, api_keys_file=str(p), admin_token_file=str(admin_file))
        store = KeyStore.from_config(cfg, environ={"BALLAST_API_KEYS": "env-secret-key=gold"})
        secrets = ["demo-secret-key", "file-secret-key", "env-secret-key", "admin-secret-token"]
        # The store does work: every secret is recognised ...
        assert [store.tenant_for(s) for s in secrets[:3]] == ["gold", "free", "gold"]
        assert store.is_admin(secrets[3])
        # ... and nothing it holds is, or contains, a plaintext secret.
        leaves = all_leaves(store)
        assert leaves, "the walk must reach the stored digests"
        for leaf in leaves:
            raw = leaf if isinstance(leaf, (bytes, bytearray)) else leaf.encode("utf-8")
            for s in secrets:
                assert s.encode("utf-8") not in raw
        # What it does hold are the SHA-256 digests.
        digests = {leaf for leaf in leaves if isinstance(leaf, bytes) and len(leaf) == 32}
        assert hashlib.sha256(b"env-secret-key").digest() in digests
        assert hashlib.sha256(b"admin-secret-token").digest() in digests


class TestTenantGrants:
    """What a tenant's config does not write grants the least (fail closed)."""

    def test_a_tenant_with_nothing_written_is_capped_at_critical(self) -> None:
        from ballast.policies.criticality import Criticality

        assert load_config({"tenants": {"free": {}}}).tenants["free"].max_criticality is Criticality.CRITICAL

    def test_critical_plus_is_granted_only_where_written(self) -> None:
        cfg = load_config({"tenants": {"gold": {"max_criticality": "critical_plus"}}})
        assert cfg.tenants["gold"].max_criticality.value == "critical_plus"

    def test_production_refuses_a_tenant_without_a_rate(self) -> None:
        with pytest.raises(ConfigError) as info:
            load_config({"environment": "production", "tenants": {**GRANTED, "free": {}}})
        assert "tenants: ['free'] have no rate_tokens_per_s" in info.value.reason

    def test_production_takes_an_explicit_unlimited_tenant(self) -> None:
        cfg = load_config({"environment": "production", "tenants": {"ops": {"unlimited": True}}})
        assert cfg.tenants["ops"].unlimited and cfg.tenants["ops"].rate_tokens_per_s is None

    def test_local_keeps_a_tenant_without_a_rate(self) -> None:
        assert load_config({"tenants": {"free": {}}}).tenants["free"].rate_tokens_per_s is None

    def test_unlimited_with_a_rate_is_refused(self) -> None:
        with pytest.raises(ConfigError) as info:
            load_config({"tenants": {"free": {"unlimited": True, "rate_tokens_per_s": 10}}})
        assert "unlimited" in info.value.reason

    def test_the_production_serve_config_grants_every_tenant_a_class_and_a_rate(self) -> None:
        import yaml

        serve_cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "cluster/serve_config.yaml").read_text())
        cfg = load_config(serve_cfg["applications"][0]["args"]["config"])
        assert cfg.environment == "production"
        grants = {t: (tc.max_criticality.value, tc.rate_tokens_per_s) for t, tc in cfg.tenants.items()}
        assert grants == {
            "gold": ("critical_plus", 20000.0),
            "free": ("sheddable_plus", 500.0),
            "batch": ("sheddable", 40000.0),
        }

    def test_a_tenant_name_is_ascii(self) -> None:
        with pytest.raises(ConfigError):
            load_config({"tenants": {"gold\u00b2": {}}})
