"""Run-time LoRA adapters as plain data (ballast/policies/adapters.py): the record, the
catalog they make on top of the config's (and the router's ``runtime_catalog``), and what
a replica loads and unloads to match, walked tick by tick on a fake clock."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ballast.policies.adapters import (
    RuntimeAdapter,
    parse_runtime,
    replica_changes,
    runtime_adapters_of,
    with_runtime,
)
from ballast.policies.catalog import AdapterEntry, Catalog, ModelEntry
from ballast.router.adapters import runtime_catalog

BASE = Catalog.build(
    [
        ModelEntry("llama", "vllm", tenants=frozenset({"gold", "free"}), adapters=(AdapterEntry("sql", "/a/sql"),)),
        ModelEntry("qwen", "transformers"),
    ],
    {"gold": None, "free": ["llama"], "other": None},
)


def entry(name: str, model: str = "llama", path: str = "", tenants: Any = None) -> dict[str, Any]:
    return RuntimeAdapter.create(model, name, path or f"/a/{name}", tenants, 1000.0, "ops").to_dict()


class TestRecord:
    def test_round_trip_with_tenants_sorted_and_unique(self) -> None:
        e = RuntimeAdapter.create("llama", "late", "/a/late", ["gold", "free", "gold"], 5, "ops")
        assert e.tenants == ("free", "gold")
        d = e.to_dict()
        assert d == {
            "model": "llama",
            "name": "late",
            "path": "/a/late",
            "tenants": ["free", "gold"],
            "added_at_s": 5.0,
            "added_by": "ops",
        }
        assert RuntimeAdapter.from_dict(d) == e

    @pytest.mark.parametrize(
        "bad",
        [
            "junk",
            {},
            {**entry("x"), "name": 7},
            {**entry("x"), "tenants": "gold"},
            {**entry("x"), "tenants": [1]},
            {**entry("x"), "path": ""},
            {**entry("x"), "path": "p" * 5000},
            {**entry("x"), "added_at_s": "soon"},
            {**entry("x"), "added_by": "b" * 65},
        ],
    )
    def test_a_malformed_record_is_refused(self, bad: Any) -> None:
        with pytest.raises((TypeError, ValueError)):
            RuntimeAdapter.from_dict(bad)
        parsed, malformed = parse_runtime([bad, entry("ok")])
        assert [p.name for p in parsed] == ["ok"] and malformed[0][0] is bad


class TestCatalog:
    def test_entries_that_fit_are_added_in_order_on_their_model(self) -> None:
        entries = [RuntimeAdapter.from_dict(entry(n, tenants=t)) for n, t in (("late", None), ("b", ["gold"]))]
        catalog, skipped = with_runtime(BASE, entries)
        assert skipped == []
        assert [a.name for a in catalog.models[0].adapters] == ["sql", "late", "b"]
        assert catalog.may_use("free", "llama:late")  # free's list names the model: its adapters too
        assert catalog.may_use("gold", "b") and not catalog.may_use("free", "b")
        assert runtime_adapters_of(catalog, BASE, "llama") == {"late": "/a/late", "b": "/a/b"}
        assert runtime_adapters_of(catalog, BASE, "qwen") == {}
        # One by one gives the same catalog as all at once.
        one_by_one = BASE.with_adapter("llama", "late", "/a/late").with_adapter("llama", "b", "/a/b", ["gold"])
        assert catalog == one_by_one

    def test_entries_that_no_longer_fit_are_skipped_with_the_catalogs_reason(self) -> None:
        entries = [
            RuntimeAdapter.from_dict(e)
            for e in (
                entry("gone", model="mistral"),  # a redeploy removed its model
                entry("sql"),  # the config now declares the name
                entry("late"),
                entry("late", path="/a/late2"),  # the same name twice: the first stays
                entry("t", model="qwen"),  # not vLLM
                entry("w", tenants=["other"]),  # outside the model's grant
            )
        ]
        catalog, skipped = with_runtime(BASE, entries)
        assert [(e.name, why.field) for e, why in skipped] == [
            ("gone", "model"),
            ("sql", "name"),
            ("late", "name"),
            ("t", "model"),
            ("w", "tenants"),
        ]
        assert runtime_adapters_of(catalog, BASE, "llama") == {"late": "/a/late"}

    def test_the_router_skips_what_does_not_fit_with_a_warning_and_never_raises(self, caplog) -> None:
        with caplog.at_level(logging.WARNING, logger="ballast.router"):
            catalog = runtime_catalog(BASE, [entry("late"), entry("x", model="mistral"), {"bad": 1}])
        assert catalog.resolve("late") is not None and catalog.resolve("x") is None
        assert runtime_catalog(BASE, []) is BASE
        text = caplog.text
        assert "'x' on 'mistral' skipped: model:" in text and "malformed" in text


GRACE, RETRY = 3, 5


def changes(listed, added, held, loaded_at=None, failed_at=None, now=0):
    c = replica_changes(listed, added, frozenset(held), loaded_at or {}, failed_at or {}, now, GRACE, RETRY)
    return list(c.remove), list(c.add)


class TestReplicaChanges:
    def test_listed_and_not_served_is_loaded_and_served_is_left(self) -> None:
        assert changes({"a": "/a", "b": "/b"}, {"b": "/b"}, {"sql", "b"}) == ([], [("a", "/a")])
        assert not replica_changes({}, {}, frozenset(), {}, {}, 0, GRACE, RETRY)

    def test_the_configs_adapters_are_never_unloaded_nor_loaded_again(self) -> None:
        # "sql" is served from the config: not in ``added``; listed or not, it stays as it is.
        assert changes({}, {}, {"sql"}) == ([], [])
        assert changes({"sql": "/elsewhere"}, {}, {"sql"}) == ([], [])

    def test_an_unlisted_run_time_adapter_is_unloaded(self) -> None:
        assert changes({}, {"a": "/a"}, {"sql", "a"}) == (["a"], [])

    def test_a_trial_load_is_kept_for_the_grace_then_unloaded_if_never_listed(self) -> None:
        loaded_at = {"a": 10}
        for now in (10, 11, 12):  # within the grace: a snapshot that predates the listing
            assert changes({}, {"a": "/a"}, {"a"}, loaded_at, now=now) == ([], []), now
        assert changes({}, {"a": "/a"}, {"a"}, loaded_at, now=13) == (["a"], [])

    def test_a_new_directory_under_the_same_name_is_unloaded_then_loaded(self) -> None:
        assert changes({"a": "/a2"}, {"a": "/a"}, {"a"}) == (["a"], [("a", "/a2")])

    def test_a_failed_load_is_tried_again_no_sooner_than_retry_s(self) -> None:
        failed_at = {"a": 100}
        for now in range(100, 105):
            assert changes({"a": "/a"}, {}, set(), failed_at=failed_at, now=now) == ([], []), now
        assert changes({"a": "/a"}, {}, set(), failed_at=failed_at, now=105) == ([], [("a", "/a")])
