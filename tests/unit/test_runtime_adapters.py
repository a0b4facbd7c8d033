"""Run-time LoRA adapters as plain data (ballast/policies/adapters.py): the record, the
rule a record must pass (``check``, ``trust_problem``, ``redact``), the catalog they make
on top of the config's (and the router's ``runtime_catalog``), and what a replica loads
and unloads to match, walked tick by tick on a fake clock; and the replica's look at a
directory (ballast/model/adapters.py ``trusted_dir``) on real directories made here:
outside the root, a symlink out of it, group- and world-writable, owned by another uid; and a
replica's run-time adapters (``ReplicaAdapters``) over an engine that serves none."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from ballast.model.adapters import service_uids, trusted_dir
from ballast.policies.adapters import (
    PathFacts,
    RuntimeAdapter,
    check,
    parse_runtime,
    redact,
    replica_changes,
    runtime_adapters_of,
    trust_problem,
    under_root,
    with_runtime,
)
from ballast.policies.catalog import AdapterEntry, Catalog, CatalogError, ModelEntry
from ballast.router.adapters import runtime_catalog

BASE = Catalog.build(
    [
        ModelEntry("llama", "vllm", tenants=frozenset({"gold", "free"}), adapters=(AdapterEntry("sql", "/a/sql"),)),
        ModelEntry("qwen", "transformers"),
    ],
    {"gold": None, "free": ["llama"], "other": None},
)


def entry(name: str, model: str = "llama", path: str = "", tenants: Any = ("*",)) -> dict[str, Any]:
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
            {**entry("x"), "tenants": None},  # written out, never implied
            {**entry("x"), "tenants": []},
            {**entry("x"), "tenants": ["*", "gold"]},  # "*" stands alone
            {**entry("x"), "path": "/a/x\x00y"},
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
        entries = [RuntimeAdapter.from_dict(entry(n, tenants=t)) for n, t in (("late", ["*"]), ("b", ["gold"]))]
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


class TestRule:
    """``check``: what an admin call and a persisted record must pass, before any node."""

    ROOT = "/srv/adapters"

    def record(self, path: str, name: str = "late", tenants: Any = ("gold",)) -> RuntimeAdapter:
        return RuntimeAdapter.create("llama", name, path, tenants, 0, "")

    @pytest.mark.parametrize("path", ["/srv/adapters/late", "late", "team/late", "/srv/adapters/./a/../late"])
    def test_a_path_under_the_root_passes(self, path: str) -> None:
        check(BASE, self.record(path), self.ROOT)

    @pytest.mark.parametrize(
        "path",
        [
            "/tmp/late",  # elsewhere
            "/srv/adapters",  # the root itself: no adapter directory
            "/srv/adapters/../etc",  # climbs out
            "../late",
            "/srv/adapters-evil/late",  # a sibling sharing the prefix
        ],
    )
    def test_a_path_outside_the_root_is_refused_naming_the_path_field(self, path: str) -> None:
        with pytest.raises(CatalogError) as e:
            check(BASE, self.record(path), self.ROOT)
        assert e.value.field == "path" and "not under adapters_root '/srv/adapters'" in str(e.value)

    def test_no_root_no_run_time_adapter(self) -> None:
        with pytest.raises(CatalogError, match="adapters_root is not set") as e:
            check(BASE, self.record("/srv/adapters/late"), None)
        assert e.value.field == "path"

    def test_the_path_first_then_the_catalogs_refusals_with_every_tenant_written_out(self) -> None:
        with pytest.raises(CatalogError) as e:
            check(BASE, self.record("/tmp/x", name="sql"), self.ROOT)
        assert e.value.field == "path"
        with pytest.raises(CatalogError) as e:
            check(BASE, self.record("x", name="sql"), self.ROOT)
        assert e.value.field == "name"
        with pytest.raises(CatalogError) as e:
            check(BASE, self.record("x", tenants=["other"]), self.ROOT)
        assert e.value.field == "tenants"
        every = self.record("x", tenants=["*"])
        assert every.grant is None and every.to_dict()["tenants"] == ["*"]
        check(BASE, every, self.ROOT)

    def test_under_root_is_text_alone(self) -> None:
        assert under_root("a/b/../c", "/r") == "/r/a/c"
        assert under_root("/r/a", "/r/") == "/r/a"
        assert under_root("a", "rel/root") == "rel/root/a"  # a relative root: each node's working directory
        assert under_root("..", "/r") is None and under_root("/r", "/r") is None


class TestTrust:
    UIDS = frozenset({1000, 0})

    def test_owned_by_a_trusted_uid_and_writable_by_no_one_else_passes(self) -> None:
        facts = [
            PathFacts("adapters_root", 1000, 0o40755),
            PathFacts("late", 0, 0o40700),
            PathFacts("late/w", 1000, 0o100644),
        ]
        assert trust_problem(facts, self.UIDS) is None

    @pytest.mark.parametrize(
        "uid,mode,why",
        [
            (65534, 0o100644, "late/w: owned by uid 65534, not by the service user"),
            (1000, 0o100664, "late/w: writable by its group or by others"),
            (1000, 0o100646, "late/w: writable by its group or by others"),
            (1000, 0o41777, "late/w: writable by its group or by others"),  # sticky or not
        ],
    )
    def test_the_first_path_another_may_write_is_named(self, uid: int, mode: int, why: str) -> None:
        facts = [PathFacts("adapters_root", 1000, 0o40755), PathFacts("late/w", uid, mode), PathFacts("z", 7, 0o777)]
        assert trust_problem(facts, self.UIDS).startswith(why)

    def test_redact_blanks_every_path_outside_the_roots(self) -> None:
        text = "No adapter in /srv/adapters/late; tried /home/bob/.cache/x and /srv/adapters-evil, see '/etc/passwd'"
        out = redact(text, ["/srv/adapters", "/mnt/real/adapters"])
        assert "/srv/adapters/late" in out
        for gone in ("/home/bob", "/srv/adapters-evil", "/etc/passwd"):
            assert gone not in out
        assert out.count("<path outside adapters_root>") == 3
        assert redact("rank 32 > 16 (max_lora_rank)", ["/r"]) == "rank 32 > 16 (max_lora_rank)"


def adapter_dir(root: Path, rel: str) -> Path:
    """A directory holding what a PEFT adapter holds (its contents are not read here)."""
    d = root / rel
    d.mkdir(parents=True, mode=0o755)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (d / name).write_text("{}")
        (d / name).chmod(0o644)
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "adapters"
    r.mkdir(mode=0o755)
    r.chmod(0o755)
    return r


class TestTrustedDir:
    """``trusted_dir`` on real directories, as the replica's node sees them."""

    def test_a_directory_under_the_root_resolves(self, root: Path) -> None:
        d = adapter_dir(root, "team/late")
        uids = service_uids()
        assert trusted_dir(str(root), "team/late", uids) == str(d)
        assert trusted_dir(str(root), str(d), uids) == str(d)
        (root / "alias").symlink_to(d)  # a symlink that stays under the root: its target is loaded
        assert trusted_dir(str(root), "alias", uids) == str(d)

    def test_outside_the_root_is_refused_before_any_file_is_looked_at(self, root: Path, tmp_path: Path) -> None:
        elsewhere = adapter_dir(tmp_path, "elsewhere")
        for path in (str(elsewhere), "../elsewhere", str(tmp_path / "missing")):  # there or not: one answer
            with pytest.raises(ValueError) as e:
                trusted_dir(str(root), path, service_uids())
            assert str(e.value) == f"path: {path!r} is not under adapters_root {str(root)!r}"

    def test_a_symlink_out_of_the_root_is_refused_without_saying_where(self, root: Path, tmp_path: Path) -> None:
        target = adapter_dir(tmp_path, "planted")
        (root / "late").symlink_to(target)
        (root / "nowhere").symlink_to(tmp_path / "does-not-exist")
        for name in ("late", "nowhere"):  # a target that exists or not: the same answer
            with pytest.raises(ValueError) as e:
                trusted_dir(str(root), name, service_uids())
            assert str(e.value) == f"path: {name!r} resolves outside adapters_root (a symlink out of it)"
        # An entry inside a good directory that links out is refused too.
        d = adapter_dir(root, "mixed")
        (d / "adapter_model.safetensors").unlink()
        (d / "adapter_model.safetensors").symlink_to(target / "adapter_model.safetensors")
        with pytest.raises(ValueError, match="mixed/adapter_model.safetensors resolves outside adapters_root") as e:
            trusted_dir(str(root), "mixed", service_uids())
        assert str(tmp_path) not in str(e.value)

    @pytest.mark.parametrize("what", ["root", "parent", "dir", "file"])
    @pytest.mark.parametrize("mode_bits", [0o020, 0o002], ids=["group", "world"])
    def test_anything_writable_by_others_on_the_way_is_refused(self, root: Path, what: str, mode_bits: int) -> None:
        d = adapter_dir(root, "team/late")
        target = {"root": root, "parent": root / "team", "dir": d, "file": d / "adapter_model.safetensors"}[what]
        target.chmod(target.stat().st_mode & 0o777 | mode_bits)
        where = {
            "root": "adapters_root",
            "parent": "team",
            "dir": "team/late",
            "file": "team/late/adapter_model.safetensors",
        }
        with pytest.raises(ValueError, match=f"^path: {where[what]}: writable by its group or by others"):
            trusted_dir(str(root), "team/late", service_uids())

    @pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
    @pytest.mark.parametrize("what", ["dir", "file"])
    def test_owned_by_another_uid_is_refused(self, root: Path, what: str) -> None:
        d = adapter_dir(root, "late")
        os.chown(d if what == "dir" else d / "adapter_config.json", 65534, 65534)  # nobody
        with pytest.raises(ValueError, match="owned by uid 65534, not by the service user"):
            trusted_dir(str(root), "late", service_uids())

    def test_not_a_directory_missing_and_a_missing_root(self, root: Path, tmp_path: Path) -> None:
        (root / "file").write_text("x")
        (root / "file").chmod(0o644)
        with pytest.raises(ValueError, match="^path: file under adapters_root is no directory$"):
            trusted_dir(str(root), "file", service_uids())
        for missing in ("gone", "file/below"):
            with pytest.raises(ValueError, match=f"^path: no directory {missing} under adapters_root$"):
                trusted_dir(str(root), missing, service_uids())
        (root / "loop").symlink_to(root / "loop")
        with pytest.raises(ValueError, match="loop under adapters_root cannot be read"):
            trusted_dir(str(root), "loop", service_uids())
        with pytest.raises(ValueError, match="is no directory on this node"):
            trusted_dir(str(tmp_path / "no-root"), "late", service_uids())

    def test_a_directory_with_too_many_entries_is_refused(self, root: Path) -> None:
        from ballast.policies.adapters import MAX_ADAPTER_ENTRIES

        d = adapter_dir(root, "big")
        for i in range(MAX_ADAPTER_ENTRIES - 1):
            (d / f"f{i}").touch(mode=0o644)
        with pytest.raises(ValueError, match=f"more than {MAX_ADAPTER_ENTRIES} entries"):
            trusted_dir(str(root), "big", service_uids())


def test_the_demo_leaves_its_adapters_writable_by_you_alone_whatever_the_umask(root: Path) -> None:
    """``make demo-adapters`` writes under cluster/local-models.yaml's adapters_root: a umask
    of 002 (a user's own group) would leave them group-writable, which a replica refuses."""
    from ballast.model.demo import _no_write_for_others

    d = adapter_dir(root, "demo-sql")
    for p in (root, d, *d.iterdir()):
        p.chmod(p.stat().st_mode | 0o020)
    with pytest.raises(ValueError, match="writable by its group"):
        trusted_dir(str(root), "demo-sql", service_uids())
    _no_write_for_others(d, *d.iterdir())
    _no_write_for_others(root)
    assert trusted_dir(str(root), "demo-sql", service_uids()) == str(d)


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

    def test_a_trial_load_the_listing_contradicts_is_replaced_at_once_not_after_the_grace(self) -> None:
        # Two adds of one name raced: this replica's trial load of /b lost to /a. Tick by
        # tick: unlisted, it is kept (the listing may not have arrived); the first listing
        # naming /a unloads /b and loads /a in the same step, inside the grace.
        loaded_at = {"late": 10}
        assert changes({}, {"late": "/b"}, {"late"}, loaded_at, now=10) == ([], [])
        assert changes({"late": "/a"}, {"late": "/b"}, {"late"}, loaded_at, now=11) == (["late"], [("late", "/a")])

    def test_a_failed_load_is_tried_again_no_sooner_than_retry_s(self) -> None:
        failed_at = {"a": 100}
        for now in range(100, 105):
            assert changes({"a": "/a"}, {}, set(), failed_at=failed_at, now=now) == ([], []), now
        assert changes({"a": "/a"}, {}, set(), failed_at=failed_at, now=105) == ([], [("a", "/a")])


class TestAnEngineWithoutLoRA:
    """``ReplicaAdapters`` over the built-in engine, whose row in the engine table serves no LoRA."""

    async def test_a_trial_load_is_refused_and_a_listing_loads_nothing(self, root: Path) -> None:
        from ballast.errors import AdapterRefused
        from ballast.model.adapters import ReplicaAdapters
        from ballast.model.builtin_checkpoint import BackendSpec, load_backend
        from ballast.model.builtin_decoder import TinyDecoderConfig

        cfg = TinyDecoderConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
        engine = load_backend(BackendSpec(config=cfg, device="cpu", compile="eager"))
        late = adapter_dir(root, "late")
        replica = ReplicaAdapters(engine, "llama", BASE, str(root))
        assert not replica.serves_adapters
        with pytest.raises(AdapterRefused, match="'llama' runs an engine that serves no LoRA adapters"):
            await replica.add("late", "late")
        listing = [entry("late", path=str(late))]
        assert replica.listed(listing) == {"late": str(late)}  # listed for the model, and still not loaded
        assert not await replica.reconcile(listing)
        replica.offer(listing)  # a snapshot's listing: no reconcile is even started
        assert replica._task is None
        assert not await replica.remove("late")
        assert (replica.added, replica.failures) == ({}, 0)
