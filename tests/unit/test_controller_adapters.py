"""LoRA adapters added at run time on the controller (ControllerCore, no Ray): checked
against the catalog and ``adapters_root``, one add of a name at a time (a reservation,
walked tick by tick), bounded, audited with the operator as claimed, published in the
snapshot and persisted with the kill switches so a restarted controller takes them back,
each persisted record checked as a new admin call would be. Fake clocks in whole seconds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fakes import FakeClock

from ballast.config import BallastConfig
from ballast.control.admin_state import ADAPTER_RESERVE_S
from ballast.control.controller import ControllerCore
from ballast.errors import AdapterConflict
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


EVERY = ["*"]


def cfg(models: list[dict[str, Any]] | None = None, root: str | None = "/adapters") -> BallastConfig:
    # BallastConfig itself: load_config serves one model yet; the controller takes the list.
    return BallastConfig.model_validate({"tenants": TENANTS, "models": models or [LLAMA, QWEN], "adapters_root": root})


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
    entry = c.core.admin.set_adapter("llama", "late", "/adapters/late", ["gold"], "alice")
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
    assert c.core.admin.adapters() == [entry]
    assert c.core.admin.dirty  # the actor persists it before the call answers
    assert c.core.admin.kill_switches()["audit"][-1] == {
        "at_s": 1_000_005.0,
        "action": "adapter_added",
        "by": "admin_token",  # what the call proved; the name is the header's claim
        "operator_claimed": "alice",
        "adapter": entry,
    }
    assert c.core.admin.runtime_catalog().resolve("llama:late") is not None


def test_every_tenant_the_model_admits_when_tenants_says_so(c: Core) -> None:
    entry = c.core.admin.set_adapter("llama", "late", "/adapters/late", EVERY, "")
    assert entry["tenants"] == ["*"]
    assert c.core.admin.kill_switches()["audit"][-1]["operator_claimed"] is None  # no header: no claim
    catalog = c.core.admin.runtime_catalog()
    assert catalog.may_use("gold", "late") and catalog.may_use("free", "late")
    assert not catalog.may_use("other", "late")  # not the model's


@pytest.mark.parametrize(
    "model,name,tenants,field",
    [
        ("nope", "late", EVERY, "model"),  # no such model
        ("qwen", "late", EVERY, "model"),  # not vLLM
        ("llama", "sql", EVERY, "name"),  # the config's adapter
        ("llama", "qwen", EVERY, "name"),  # a model's name
        ("llama", "a:b", EVERY, "name"),
        ("llama", "a b", EVERY, "name"),
        ("llama", "late", ["nobody"], "tenants"),  # not declared
        ("llama", "late", ["other"], "tenants"),  # outside the model's grant
        ("llama", "late", [], "tenants"),  # written out: "*" or names
        ("llama", "late", ["*", "gold"], "tenants"),
    ],
)
def test_the_catalog_refuses_naming_the_field_and_nothing_is_set(
    c: Core, model: str, name: str, tenants: list[str], field: str
) -> None:
    for method in (c.core.admin.reserve_adapter, c.core.admin.set_adapter):
        with pytest.raises(ValueError, match=f"^{field}: "):
            method(model, name, "/adapters/late", tenants, *(["ops"] if method == c.core.admin.set_adapter else []))
    assert c.core.admin.adapters() == [] and c.core.snapshot()["adapters"] == []
    assert not c.core.admin.dirty
    assert [e["action"] for e in c.core.admin.kill_switches()["audit"]] == []


@pytest.mark.parametrize("path", ["/adapters/elsewhere/../../etc", "/etc/late", "../late"])
def test_a_path_outside_adapters_root_is_refused_and_none_without_it(c: Core, path: str) -> None:
    with pytest.raises(ValueError, match="^path: .* is not under adapters_root '/adapters'"):
        c.core.admin.set_adapter("llama", "late", path, EVERY, "ops")
    off = Core(cfg(root=None)).core
    with pytest.raises(ValueError, match="^path: adapters may not be added at run time here"):
        off.admin.reserve_adapter("llama", "late", "/adapters/late", EVERY)
    assert c.core.admin.adapters() == [] == off.admin.adapters()


def test_a_name_added_at_run_time_is_a_conflict_until_deleted(c: Core) -> None:
    c.core.admin.set_adapter("llama", "late", "/adapters/late", EVERY, "ops")
    for path in ("/adapters/other", "/adapters/late"):  # another directory, or the same: deleted first
        with pytest.raises(AdapterConflict, match="^name: 'late' is an adapter added at run time; delete it first"):
            c.core.admin.reserve_adapter("llama", "late", path, EVERY)
        with pytest.raises(AdapterConflict):
            c.core.admin.set_adapter("llama", "late", path, EVERY, "ops")
    assert [a["path"] for a in c.core.admin.adapters()] == ["/adapters/late"]
    c.wall.advance(1)
    assert c.core.admin.delete_adapter("late", "bob")
    assert not c.core.admin.delete_adapter("late", "bob")  # gone
    assert not c.core.admin.delete_adapter("sql", "bob")  # the config's: none to delete here
    assert c.core.snapshot()["adapters"] == [] and c.core.admin.adapters() == []
    audit = c.core.admin.kill_switches()["audit"]
    assert [(e["action"], e["operator_claimed"]) for e in audit] == [
        ("adapter_added", "ops"),
        ("adapter_deleted", "bob"),
    ]
    assert audit[-1]["adapter"]["name"] == "late" and audit[-1]["at_s"] == 1_000_001.0
    assert c.core.admin.set_adapter("llama", "late", "/adapters/other", EVERY, "ops")["path"] == "/adapters/other"


def test_at_most_the_bound_and_one_more_is_refused(c: Core) -> None:
    for i in range(MAX_RUNTIME_ADAPTERS):
        c.core.admin.set_adapter("llama", f"a{i}", f"/adapters/a{i}", EVERY, "ops")
    with pytest.raises(ValueError, match=f"^name: at most {MAX_RUNTIME_ADAPTERS}"):
        c.core.admin.set_adapter("llama", "one-more", "/adapters/x", EVERY, "ops")
    assert len(c.core.snapshot()["adapters"]) == MAX_RUNTIME_ADAPTERS
    assert c.core.admin.delete_adapter("a0", "ops")
    c.core.admin.set_adapter("llama", "one-more", "/adapters/x", EVERY, "ops")  # room again


def test_adapters_survive_a_restart_through_the_persisted_state(c: Core) -> None:
    c.core.admin.set_kill_switch("global", None, "maintenance", 600, "ops")
    kept = c.core.admin.set_adapter("llama", "late", "/adapters/late", ["free"], "ops")
    state = json.loads(json.dumps(c.core.admin.to_dict()))  # through Ray's KV store
    assert state["adapters"] == [kept]

    c.wall.advance(10)
    again = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    assert again.admin.adopt(state) == 1
    assert again.snapshot()["adapters"] == [kept] and again.admin.adapters() == [kept]
    audit = again.admin.kill_switches()["audit"]
    assert [e["action"] for e in audit] == ["kill_switch_set", "adapter_added", "admin_state_adopted"]
    assert audit[-1]["adapters"] == 1
    # ... and survive a redeploy (configure) as kill switches do; each tick's snapshot carries them.
    again.configure(cfg())
    assert again.tick().adapters == [kept]


def test_a_state_persisted_before_adapters_loads_with_none_and_bad_entries_are_dropped(c: Core) -> None:
    old = {"kill_switches": [], "chaos": {}, "audit": []}  # no "adapters" key
    again = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    again.admin.adopt(old)
    assert again.admin.adapters() == []
    good = c.core.admin.set_adapter("llama", "late", "/adapters/late", EVERY, "ops")
    state = c.core.admin.to_dict()
    state["adapters"] += [{"name": "x"}, "junk", {**good, "name": "n2", "tenants": "gold"}]
    third = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    third.admin.adopt(state)
    assert third.admin.adapters() == [good]
    third.admin.adopt({"adapters": "not a list"})
    assert third.admin.adapters() == [good]


def test_an_adapter_whose_model_a_redeploy_removed_is_kept_but_leaves_the_catalog(c: Core) -> None:
    c.core.admin.set_adapter("llama", "late", "/adapters/late", EVERY, "ops")
    c.core.configure(cfg([QWEN]))
    assert [a["name"] for a in c.core.admin.adapters()] == ["late"]  # an operator may delete it
    assert c.core.admin.runtime_catalog().resolve("late") is None  # nothing routes to it
    with pytest.raises(AdapterConflict, match="^name: 'late' is an adapter added at run time"):
        c.core.admin.set_adapter("llama", "late", "/adapters/x", EVERY, "ops")
    assert c.core.admin.delete_adapter("late", "ops")


# ------------------------------------------------------------------ one add of a name at a time


def test_a_reserved_name_is_a_conflict_for_any_other_add_until_set_released_or_expired(c: Core) -> None:
    """Two admins add "late" at once, with different directories: the first reserves it,
    the second is 409 at every step until the first ends, tick by tick on the controller's
    clock; a reservation nobody ends lapses after ADAPTER_RESERVE_S."""
    c.core.admin.reserve_adapter("llama", "late", "/adapters/a", EVERY)
    for _ in range(3):  # the first's trial load runs
        c.clock.advance()
        with pytest.raises(AdapterConflict, match="another add of 'late' is in flight"):
            c.core.admin.reserve_adapter("llama", "late", "/adapters/b", EVERY)
        with pytest.raises(AdapterConflict):
            c.core.admin.set_adapter("llama", "late", "/adapters/b", EVERY, "bob")
    assert c.core.snapshot()["adapters"] == [] and not c.core.admin.dirty  # a reservation publishes nothing
    assert c.core.admin.set_adapter("llama", "late", "/adapters/a", EVERY, "alice")["path"] == "/adapters/a"
    with pytest.raises(AdapterConflict, match="delete it first"):  # ... then as the adapter it is
        c.core.admin.reserve_adapter("llama", "late", "/adapters/b", EVERY)

    # A trial load that failed gives the name back (only its own path does).
    c.core.admin.reserve_adapter("llama", "other", "/adapters/a", EVERY)
    assert not c.core.admin.release_adapter("other", "/adapters/b")
    assert not c.core.admin.release_adapter("nope", "/adapters/a")
    assert c.core.admin.release_adapter("other", "/adapters/a")
    c.core.admin.reserve_adapter("llama", "other", "/adapters/b", EVERY)

    # A router that died mid-add: the name is held for ADAPTER_RESERVE_S, then free.
    held_until = c.clock.now_s + int(ADAPTER_RESERVE_S)
    while c.clock.now_s < held_until:
        with pytest.raises(AdapterConflict):
            c.core.admin.reserve_adapter("llama", "other", "/adapters/c", EVERY)
        c.clock.advance(30)
    c.core.admin.reserve_adapter("llama", "other", "/adapters/c", EVERY)  # lapsed: a new add may run
    with pytest.raises(AdapterConflict):  # and the old add's late record is refused
        c.core.admin.set_adapter("llama", "other", "/adapters/b", EVERY, "ops")


def test_reservations_count_against_the_bound(c: Core) -> None:
    for i in range(MAX_RUNTIME_ADAPTERS - 1):
        c.core.admin.set_adapter("llama", f"a{i}", f"/adapters/a{i}", EVERY, "ops")
    c.core.admin.reserve_adapter("llama", "last", "/adapters/last", EVERY)
    with pytest.raises(ValueError, match=f"^name: at most {MAX_RUNTIME_ADAPTERS}"):
        c.core.admin.reserve_adapter("llama", "one-more", "/adapters/x", EVERY)
    c.core.admin.set_adapter("llama", "last", "/adapters/last", EVERY, "ops")  # its own reservation fits


# ------------------------------------------------------------------ read back as a new call would be


def test_persisted_adapters_are_checked_as_a_new_admin_call_would_be(c: Core, caplog) -> None:
    good = c.core.admin.set_adapter("llama", "late", "/adapters/late", ["gold"], "ops")
    planted = [
        {**good, "name": "out", "path": "/tmp/planted"},  # outside adapters_root
        {**good, "name": "up", "path": "/adapters/../etc"},
        {**good, "name": "open", "tenants": None},  # tenants implied: never
        {**good, "name": "wide", "tenants": ["other"]},  # outside the model's grant
        {**good, "name": "gone", "model": "mistral"},  # no such model
        {**good, "name": "sql"},  # the config's name
        {**good, "path": "/adapters/twice"},  # its name adopted already
    ]
    state = c.core.admin.to_dict()
    state["adapters"] += planted
    again = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    with caplog.at_level("WARNING", logger="ballast.controller"):
        again.admin.adopt(state)
    assert again.admin.adapters() == [good] and again.snapshot()["adapters"] == [good]
    assert caplog.text.count("dropped a persisted adapter") == len(planted)
    assert "is not under adapters_root" in caplog.text and "tenants: want a list" in caplog.text

    # A config without adapters_root takes back none.
    assert ControllerCore(cfg(root=None), clock=c.clock, wall_clock=c.wall).admin.adopt(state) == 0
    off = ControllerCore(cfg(root=None), clock=c.clock, wall_clock=c.wall)
    off.admin.adopt(state)
    assert off.admin.adapters() == []


def test_persisted_kill_switches_are_checked_as_a_new_admin_call_would_be(c: Core, caplog) -> None:
    c.core.admin.set_adapter("llama", "late", "/adapters/late", EVERY, "ops")
    on_adapter = c.core.admin.set_kill_switch("model", "late", "bad outputs", 600, "ops")  # names a run-time adapter
    on_tenant = c.core.admin.set_kill_switch("tenant", "free", "abuse", 600, "ops")
    state = json.loads(json.dumps(c.core.admin.to_dict()))
    week = 7 * 24 * 3600
    planted = [
        {**on_tenant, "id": "aaaaaaaaaaaa", "value": "nobody"},  # names no tenant: blocks nothing, misleads
        {**on_tenant, "id": "bbbbbbbbbbbb", "created_at_s": 2e9, "expires_at_s": 2e9 + week},  # for decades
        {**on_tenant, "id": "not-an-id"},
        {**on_tenant, "id": "cccccccccccc", "set_by": "x" * 65},
        {**on_tenant, "id": "dddddddddddd", "scope": "galaxy"},
        {**on_tenant, "id": "eeeeeeeeeeee", "extra": 1},
    ]
    state["kill_switches"] += planted
    again = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    with caplog.at_level("WARNING", logger="ballast.controller"):
        assert again.admin.adopt(state) == 2
    assert [e["id"] for e in again.snapshot()["kill_switches"]] == [on_adapter["id"], on_tenant["id"]]
    assert caplog.text.count("dropped a persisted kill switch") == len(planted)

    # The switch on "late" holds only because "late" was adopted first; without it, it names nothing.
    state["adapters"] = []
    bare = ControllerCore(cfg(), clock=c.clock, wall_clock=c.wall)
    assert bare.admin.adopt(state) == 1
    assert [e["id"] for e in bare.snapshot()["kill_switches"]] == [on_tenant["id"]]
