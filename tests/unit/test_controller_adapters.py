"""LoRA adapters added at run time on the controller (ControllerCore, no Ray): checked
against the catalog, bounded, audited, published in the snapshot and persisted with the
kill switches so a restarted controller takes them back. Fake clocks in whole seconds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fakes import FakeClock

from ballast.config import BallastConfig
from ballast.control.controller import ControllerCore
from ballast.policies.adapters import MAX_RUNTIME_ADAPTERS

LLAMA = {
    "name": "llama",
    "backend": "vllm",
    "path": "/models/llama",
    "adapters": {"sql": "/adapters/sql"},
    "tenants": ["gold", "free"],
}
QWEN = {"name": "qwen", "backend": "transformers", "path": "/models/qwen"}
TENANTS = {"gold": {}, "free": {}, "other": {}}


def cfg(models: list[dict[str, Any]] | None = None) -> BallastConfig:
    # BallastConfig itself: load_config serves one model yet; the controller takes the list.
    return BallastConfig.model_validate({"tenants": TENANTS, "models": models or [LLAMA, QWEN]})


class Core:
    def __init__(self, config: BallastConfig | None = None) -> None:
        self.clock = FakeClock(0)
        self.wall = FakeClock(1_000_000)
        self.core = ControllerCore(config or cfg(), clock=self.clock, wall_clock=self.wall)


@pytest.fixture
def c() -> Core:
    return Core()


def test_an_added_adapter_is_in_the_snapshot_the_list_and_the_audit(c: Core) -> None:
    version = c.core.snapshot()["version"]
    c.wall.advance(5)
    entry = c.core.set_adapter("llama", "late", "/adapters/late", ["gold"], "alice")
    assert entry == {
        "model": "llama",
        "name": "late",
        "path": "/adapters/late",
        "tenants": ["gold"],
        "added_at_s": 1_000_005.0,
        "added_by": "alice",
    }
    snap = c.core.snapshot()
    assert snap["adapters"] == [entry] and snap["version"] == version + 1  # published at once
    assert c.core.adapters() == [entry]
    assert c.core.admin_dirty  # the actor persists it before the call answers
    assert c.core.kill_switches()["audit"][-1] == {
        "at_s": 1_000_005.0,
        "action": "adapter_added",
        "by": "alice",
        "adapter": entry,
    }
    assert c.core.runtime_catalog().resolve("llama:late") is not None


def test_every_tenant_the_model_admits_when_tenants_is_null(c: Core) -> None:
    entry = c.core.set_adapter("llama", "late", "/adapters/late", None, "ops")
    assert entry["tenants"] is None
    catalog = c.core.runtime_catalog()
    assert catalog.may_use("gold", "late") and catalog.may_use("free", "late")
    assert not catalog.may_use("other", "late")  # not the model's


@pytest.mark.parametrize(
    "model,name,tenants,field",
    [
        ("nope", "late", None, "model"),  # no such model
        ("qwen", "late", None, "model"),  # not vLLM
        ("llama", "sql", None, "name"),  # the config's adapter
        ("llama", "qwen", None, "name"),  # a model's name
        ("llama", "a:b", None, "name"),
        ("llama", "a b", None, "name"),
        ("llama", "late", ["nobody"], "tenants"),  # not declared
        ("llama", "late", ["other"], "tenants"),  # outside the model's grant
    ],
)
def test_the_catalog_refuses_naming_the_field_and_nothing_is_set(
    c: Core, model: str, name: str, tenants: list[str] | None, field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        c.core.set_adapter(model, name, "/adapters/late", tenants, "ops")
    assert c.core.adapters() == [] and c.core.snapshot()["adapters"] == []
    assert not c.core.admin_dirty
    assert [e["action"] for e in c.core.kill_switches()["audit"]] == []


def test_a_name_added_at_run_time_is_taken_until_deleted(c: Core) -> None:
    c.core.set_adapter("llama", "late", "/adapters/late", None, "ops")
    with pytest.raises(ValueError, match="^name: 'late' is taken"):
        c.core.set_adapter("llama", "late", "/adapters/other", None, "ops")
    c.wall.advance(1)
    assert c.core.delete_adapter("late", "bob")
    assert not c.core.delete_adapter("late", "bob")  # gone
    assert not c.core.delete_adapter("sql", "bob")  # the config's: none to delete here
    assert c.core.snapshot()["adapters"] == [] and c.core.adapters() == []
    audit = c.core.kill_switches()["audit"]
    assert [(e["action"], e["by"]) for e in audit] == [("adapter_added", "ops"), ("adapter_deleted", "bob")]
    assert audit[-1]["adapter"]["name"] == "late" and audit[-1]["at_s"] == 1_000_001.0
    assert c.core.set_adapter("llama", "late", "/adapters/other", None, "ops")["path"] == "/adapters/other"


def test_at_most_the_bound_and_one_more_is_refused(c: Core) -> None:
    for i in range(MAX_RUNTIME_ADAPTERS):
        c.core.set_adapter("llama", f"a{i}", f"/adapters/a{i}", None, "ops")
    with pytest.raises(ValueError, match=f"^name: at most {MAX_RUNTIME_ADAPTERS}"):
        c.core.set_adapter("llama", "one-more", "/adapters/x", None, "ops")
    assert len(c.core.snapshot()["adapters"]) == MAX_RUNTIME_ADAPTERS
    assert c.core.delete_adapter("a0", "ops")
    c.core.set_adapter("llama", "one-more", "/adapters/x", None, "ops")  # room again


def test_adapters_survive_a_restart_through_the_persisted_state(c: Core) -> None:
    c.core.set_kill_switch("global", None, "maintenance", 600, "ops")
    kept = c.core.set_adapter("llama", "late", "/adapters/late", ["free"], "ops")
    state = json.loads(json.dumps(c.core.admin_state()))  # through Ray's KV store
    assert state["adapters"] == [kept]

    c.wall.advance(10)
    again = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    assert again.adopt_admin_state(state) == 1
    assert again.snapshot()["adapters"] == [kept] and again.adapters() == [kept]
    audit = again.kill_switches()["audit"]
    assert [e["action"] for e in audit] == ["kill_switch_set", "adapter_added", "admin_state_adopted"]
    assert audit[-1]["adapters"] == 1
    # ... and survive a redeploy (configure) as kill switches do; each tick's snapshot carries them.
    again.configure(cfg())
    assert again.tick().adapters == [kept]


def test_a_state_persisted_before_adapters_loads_with_none_and_bad_entries_are_dropped(c: Core) -> None:
    old = {"kill_switches": [], "chaos": {}, "audit": []}  # no "adapters" key
    again = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    again.adopt_admin_state(old)
    assert again.adapters() == []
    good = c.core.set_adapter("llama", "late", "/adapters/late", None, "ops")
    state = c.core.admin_state()
    state["adapters"] += [{"name": "x"}, "junk", {**good, "name": "n2", "tenants": "gold"}]
    third = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    third.adopt_admin_state(state)
    assert third.adapters() == [good]
    third.adopt_admin_state({"adapters": "not a list"})
    assert third.adapters() == [good]


def test_an_adapter_whose_model_a_redeploy_removed_is_kept_but_leaves_the_catalog(c: Core) -> None:
    c.core.set_adapter("llama", "late", "/adapters/late", None, "ops")
    c.core.configure(cfg([QWEN]))
    assert [a["name"] for a in c.core.adapters()] == ["late"]  # an operator may delete it
    assert c.core.runtime_catalog().resolve("late") is None  # nothing routes to it
    with pytest.raises(ValueError, match="^name: 'late' is taken"):
        c.core.set_adapter("llama", "late", "/x", None, "ops")
    assert c.core.delete_adapter("late", "ops")
