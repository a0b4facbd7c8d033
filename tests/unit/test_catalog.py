"""ballast.policies.catalog: names, grants, listing, cost and run-time adapters, on plain data."""

from __future__ import annotations

import pickle

import pytest

from ballast.policies.catalog import AdapterEntry, Catalog, CatalogError, Listed, ModelEntry, Target, name_problem

TENANTS: dict[str, list[str] | None] = {"gold": None, "silver": None, "free": None}


def llama(tenants: frozenset[str] | None = None, *adapters: AdapterEntry) -> ModelEntry:
    return ModelEntry("llama", "vllm", cost_per_token=4.0, tenants=tenants, adapters=adapters)


QWEN = ModelEntry("qwen", "transformers")
SQL = AdapterEntry("sql", "/adapters/sql")
SUPPORT = AdapterEntry("support", "/adapters/support", frozenset({"gold"}))


def catalog(tenant_models: dict[str, list[str] | None] | None = None, **kw: frozenset[str] | None) -> Catalog:
    return Catalog.build([llama(kw.get("tenants"), SQL, SUPPORT), QWEN], {**TENANTS, **(tenant_models or {})})


ALL_NAMES = ["llama", "sql", "llama:sql", "support", "llama:support", "qwen"]


class TestResolve:
    def test_models_adapters_and_model_colon_adapter(self) -> None:
        c = catalog()
        assert c.resolve("llama") == Target("llama")
        assert c.resolve("qwen") == Target("qwen")
        assert c.resolve("sql") == Target("llama", "sql")
        assert c.resolve("llama:sql") == c.resolve("sql")
        assert c.resolve("sql").name == "sql" and Target("llama").name == "llama"  # type: ignore[union-attr]

    @pytest.mark.parametrize("name", ["", "nope", "qwen:sql", "llama:", ":sql", "llama:qwen", "sql:llama", "LLAMA"])
    def test_anything_else_is_none(self, name: str) -> None:
        assert catalog().resolve(name) is None

    def test_the_primary_is_the_first(self) -> None:
        assert catalog().primary.name == "llama"


class TestGrants:
    def test_nothing_written_everyone_uses_everything(self) -> None:
        c = catalog({"gold": None})
        for tenant in ("free", "someone-not-declared"):
            for name in ALL_NAMES:
                if name in ("support", "llama:support"):
                    continue  # support names gold alone
                assert c.may_use(tenant, name), (tenant, name)

    def test_adapter_tenants(self) -> None:
        c = catalog()
        assert c.may_use("gold", "support") and c.may_use("gold", "llama:support")
        assert not c.may_use("free", "support") and not c.may_use("free", "llama:support")
        assert c.may_use("free", "llama")  # the base stays open

    def test_model_tenants_cover_its_adapters(self) -> None:
        c = catalog(tenants=frozenset({"gold", "silver"}))
        assert c.may_use("silver", "llama") and c.may_use("silver", "sql")
        assert not c.may_use("silver", "support")  # the adapter's own list: gold alone
        assert not any(c.may_use("free", n) for n in ALL_NAMES if n != "qwen")
        assert c.may_use("free", "qwen")

    def test_tenant_list_naming_a_model_covers_its_adapters(self) -> None:
        c = catalog({"silver": ["llama"]})
        assert c.may_use("silver", "llama") and c.may_use("silver", "sql") and c.may_use("silver", "llama:sql")
        assert not c.may_use("silver", "qwen")
        assert not c.may_use("silver", "support")  # still gold's alone

    def test_tenant_list_naming_an_adapter_covers_it_alone(self) -> None:
        c = catalog({"free": ["llama:sql"], "gold": ["support"]})
        assert c.may_use("free", "sql") and c.may_use("free", "llama:sql")
        assert not c.may_use("free", "llama") and not c.may_use("free", "qwen")
        assert c.may_use("gold", "support") and not c.may_use("gold", "sql")

    def test_three_lists_intersect(self) -> None:
        c = catalog({"silver": ["support"]}, tenants=frozenset({"gold", "silver"}))
        assert not c.may_use("silver", "support")  # its own list names it, the adapter's does not
        assert c.may_use("gold", "support")

    def test_unknown_and_forbidden_answer_alike(self) -> None:
        c = catalog({"free": ["qwen"]})
        forbidden, unknown = "llama", "no-such-model"
        assert c.resolve(forbidden) is not None and c.resolve(unknown) is None
        assert c.may_use("free", forbidden) is c.may_use("free", unknown) is False
        assert c.target_for("free", forbidden) is c.target_for("free", unknown) is None
        assert [x.id for x in c.listed_for("free")] == ["qwen"]

    def test_target_for_gives_what_may_be_used(self) -> None:
        assert catalog().target_for("free", "llama:sql") == Target("llama", "sql")


class TestOpenNames:
    """What HAProxy's edge may act on by name before a key is checked: only what every caller may use."""

    def test_nothing_written_every_name_is_open_with_its_alias(self) -> None:
        assert catalog(tenant_models={}).open_names() == {
            "llama": "llama",
            "sql": "llama",
            "llama:sql": "llama",
            "qwen": "qwen",
        }  # support names gold alone

    def test_a_model_some_tenants_may_not_use_is_not_open_nor_its_adapters(self) -> None:
        assert catalog(tenants=frozenset({"gold", "silver"})).open_names() == {"qwen": "qwen"}

    def test_a_tenants_own_list_closes_what_it_leaves_out(self) -> None:
        assert catalog({"free": ["qwen"]}).open_names() == {"qwen": "qwen"}
        assert catalog({"free": ["llama", "qwen"]}).open_names() == {
            "llama": "llama",
            "sql": "llama",
            "llama:sql": "llama",
            "qwen": "qwen",
        }
        assert catalog({"free": ["sql", "qwen"]}).open_names() == {"sql": "llama", "llama:sql": "llama", "qwen": "qwen"}


class TestListed:
    def test_config_order_adapters_after_their_model_with_parent(self) -> None:
        assert catalog().listed_for("gold") == (
            Listed("llama"),
            Listed("sql", "llama"),
            Listed("support", "llama"),
            Listed("qwen"),
        )

    def test_only_what_the_caller_may_use(self) -> None:
        assert catalog().listed_for("free") == (Listed("llama"), Listed("sql", "llama"), Listed("qwen"))
        assert catalog({"free": ["sql"]}).listed_for("free") == (Listed("sql", "llama"),)


class TestCost:
    def test_an_adapter_costs_its_model(self) -> None:
        c = catalog()
        assert c.cost_per_token("llama") == c.cost_per_token("sql") == c.cost_per_token("llama:support") == 4.0
        assert c.cost_per_token("qwen") == 1.0

    def test_unknown_is_refused(self) -> None:
        with pytest.raises(CatalogError, match="model: 'x' is no model"):
            catalog().cost_per_token("x")


class TestBuildRefuses:
    @pytest.mark.parametrize(
        ("models", "match"),
        [
            ([], "models: at least one model"),
            ([QWEN, QWEN], "'qwen' is taken"),
            ([llama(None, AdapterEntry("qwen", "/a")), QWEN], "qwen.*is taken"),
            ([llama(None, SQL, SQL)], "llama.adapters: 'sql' is taken"),
            ([ModelEntry("qwen", "transformers", adapters=(SQL,))], "qwen.adapters: LoRA adapters are vLLM's"),
            ([ModelEntry("q:1", "builtin")], "may not hold ':'"),
            ([ModelEntry("q 1", "builtin")], "may hold only letters, digits"),
            ([ModelEntry("qé", "builtin")], "not 'é'"),
            ([ModelEntry("q;shutdown", "builtin")], "not ';'"),
            ([ModelEntry("x" * 65, "builtin")], "1-64 characters"),
            ([ModelEntry("q", "builtin", cost_per_token=0)], "q.cost_per_token: must be > 0"),
            ([llama(None, AdapterEntry("a", ""))], "llama.adapters.a.path"),
            ([llama(frozenset({"nobody"}))], r"llama.tenants: \['nobody'\] are not declared"),
            ([llama(frozenset())], "llama.tenants: names no tenant"),
            ([llama(frozenset({"free"}), SUPPORT)], r"support.tenants: \['gold'\] may not use model 'llama'"),
        ],
    )
    def test_invalid_catalogs(self, models: list[ModelEntry], match: str) -> None:
        with pytest.raises(CatalogError, match=match):
            Catalog.build(models, TENANTS)

    def test_a_tenant_list_naming_nothing_served(self) -> None:
        with pytest.raises(CatalogError, match="tenants.free.models: 'qwen:sql' is no model or adapter"):
            catalog({"free": ["qwen:sql"]})

    def test_name_problem(self) -> None:
        assert name_problem("Qwen/Qwen2-0.5B_v1.2") is None
        assert name_problem("org/m-1.5B_v2+fp8@rev=3") is None
        assert name_problem("a:b") is not None and name_problem("") is not None

    @pytest.mark.parametrize("name", ["a;b", "#a", "a\\b", "a\tb", "a'b", 'a"b', "a,b", "a%b", "a~b", "é"])
    def test_a_name_the_edge_could_not_hold_whole_is_refused(self, name: str) -> None:
        """A name goes whole into HAProxy's maps and admin-socket commands (ballast/router/edge.py)."""
        problem = name_problem(name)
        assert problem is not None and "may hold only letters, digits and . _ - / + @ =" in problem

    def test_errors_pickle_with_their_fields(self) -> None:
        e = pickle.loads(pickle.dumps(CatalogError("name", "taken")))
        assert (e.field, e.reason, str(e)) == ("name", "taken", "name: taken")


class TestRunTimeAdapters:
    def test_add_then_use_list_and_remove(self) -> None:
        before = catalog({"silver": ["llama"]})
        after = before.with_adapter("llama", "chat", "/adapters/chat", ["silver"])
        assert before.resolve("chat") is None  # the old catalog is unchanged
        assert after.resolve("llama:chat") == Target("llama", "chat")
        assert after.may_use("silver", "chat")  # its list names the model
        assert not after.may_use("gold", "chat")  # the admin call's tenants
        assert after.listed_for("silver")[-1] == Listed("chat", "llama")
        assert after.cost_per_token("chat") == 4.0
        gone = after.without_adapter("llama:chat")
        assert gone.resolve("chat") is None and gone == before

    def test_tenants_none_means_every_tenant_the_model_admits(self) -> None:
        c = catalog(tenants=frozenset({"gold"})).with_adapter("llama", "chat", "/c")
        assert c.may_use("gold", "chat") and not c.may_use("free", "chat")

    @pytest.mark.parametrize(
        ("args", "match"),
        [
            (("nope", "x", "/x", None), "model: 'nope' is no model"),
            (("sql", "x", "/x", None), "model: 'sql' is no model"),
            (("qwen", "x", "/x", None), "model: 'qwen' is served by 'transformers'"),
            (("llama", "sql", "/x", None), "name: 'sql' is taken"),
            (("llama", "qwen", "/x", None), "name: 'qwen' is taken"),
            (("llama", "a:b", "/x", None), "name: .*':'"),
            (("llama", "a;clear", "/x", None), "name: .*not ';'"),
            (("llama", "#a", "/x", None), "name: .*not '#'"),
            (("llama", "x", "", None), "path: a local directory"),
            (("llama", "x", "/x", ["nobody"]), "tenants: .*not declared"),
            (("llama", "x", "/x", []), "tenants: names no tenant"),
        ],
    )
    def test_refused_additions(self, args: tuple[str, str, str, list[str] | None], match: str) -> None:
        with pytest.raises(CatalogError, match=match):
            catalog().with_adapter(*args)

    def test_an_addition_cannot_widen_its_model(self) -> None:
        with pytest.raises(CatalogError, match=r"tenants: \['free'\] may not use model 'llama'"):
            catalog(tenants=frozenset({"gold"})).with_adapter("llama", "x", "/x", ["free"])

    @pytest.mark.parametrize("name", ["llama", "qwen", "nope", "qwen:sql"])
    def test_only_an_adapter_is_removed(self, name: str) -> None:
        with pytest.raises(CatalogError, match="name: .* is no adapter"):
            catalog().without_adapter(name)

    def test_removal_leaves_tenant_lists_granting_less_never_more(self) -> None:
        c = catalog({"free": ["sql"]}).without_adapter("sql")
        assert c.listed_for("free") == ()  # its list named only sql: now nothing, not everything
        back = c.with_adapter("llama", "sql", "/adapters/sql")
        assert not back.may_use("free", "sql")
