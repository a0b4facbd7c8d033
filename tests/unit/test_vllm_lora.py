"""LoRA adapters on the vLLM engine (CPU), built here with peft on a tiny random Llama: a
base and two adapters give three greedy outputs, each the same every time, and adapter rows
give theirs in a mixed batch, a base row beside them the base output (on CPU it runs with a
zero adapter: vLLM's CPU LoRA ops take a row without one for the last slot's); an adapter
added at run time serves, and once removed its row alone is refused; a bad adapter is
refused when it is added, with vLLM's reason; the replica loop runs a call's adapter; a
replica follows the snapshot's run-time adapters (ballast.model.adapters), loading only
directories under its ``adapters_root`` that no one else may write, and the admin route's
trial load refuses a bad directory with vLLM's reason. One engine for the module."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import types

import pytest
from fakes import FakeClock

pytest.importorskip("vllm")
pytest.importorskip("peft")

from ballast.errors import AdapterRefused, EngineRefused  # noqa: E402
from ballast.model.adapters import ReplicaAdapters  # noqa: E402
from ballast.model.demo import VLLM_GEOMETRY, make_llama  # noqa: E402
from ballast.model.engine import ModelLoadError  # noqa: E402
from ballast.model.protocol import Join, ModelCall, RowSampling  # noqa: E402
from ballast.model.replica_loop import ReplicaLoop  # noqa: E402
from ballast.model.vllm_engine import VLLMBackend, lora_engine_kwargs  # noqa: E402
from ballast.policies.adapters import RuntimeAdapter  # noqa: E402
from ballast.policies.catalog import AdapterEntry, Catalog, ModelEntry  # noqa: E402
from ballast.policies.scheduler import SchedulerConfig  # noqa: E402
from tests.unit.hf_fixture import make_lora_adapter  # noqa: E402

ENGINE_KWARGS = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, max_cpu_loras=4)
N = 16
LONG = RowSampling(ignore_eos=True)  # random weights: every row runs its N tokens
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    base = make_llama(root / "base", **VLLM_GEOMETRY)
    out = {"root": root, "base": base, "empty": root / "empty"}
    out["empty"].mkdir()
    for name, seed, rank in (("sql", 1, 8), ("support", 2, 8), ("late", 3, 8), ("wide", 4, 32)):
        out[name] = make_lora_adapter(base, root / name, seed, r=rank)
    return out


@pytest.fixture(scope="module")
def backend(dirs):
    adapters = {"sql": str(dirs["sql"]), "support": str(dirs["support"])}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of CPU KV cache
        b = VLLMBackend(
            str(dirs["base"]),
            name="tiny",
            engine_kwargs=lora_engine_kwargs(ENGINE_KWARGS, adapters, base_slot=True),
            adapters=adapters,
            prefix_report_blocks=4096,
        )
    yield b
    b.shutdown()


def run(backend, rows: dict, steps: int = 4) -> tuple[dict, dict]:
    """Every row (key: adapter or None) joins one batch with the same prompt and runs N
    greedy tokens: the ids each row got, and the rows refused alone."""
    ids = backend.text.encode(PROMPT, N)
    batch, out, failed = backend.open_batch(), {k: [] for k in rows}, {}
    joins = [Join(k, ids, N, LONG, adapter) for k, adapter in rows.items()]
    for _ in range(200):
        for key, got in batch.run_chunk(joins, steps).items():
            out[key] += got
        failed.update(batch.take_failed())
        joins = []
        if not batch.keys():
            break
    return {k: v for k, v in out.items() if k not in failed}, failed


@pytest.fixture(scope="module")
def alone(backend):
    """Each of the base and the two adapters in a batch of its own, twice."""
    return {a: [run(backend, {0: a})[0][0] for _ in range(2)] for a in (None, "sql", "support")}


def test_an_adapters_blocks_are_keyed_with_its_name_and_the_base_rows_as_the_base_model(backend, alone):
    # vLLM keys a block with the adapter that computed it; the report does too, and the zero
    # adapter base rows run with on CPU is the base model: keyed with no adapter, as a router keys it.
    import time

    from ballast.policies.prefix_cache import block_keys, matched_blocks

    ids, size = backend.text.tokenize(" ".join([PROMPT] * 120))[:300], backend.describe()["kv_block_size"]
    batch, joins = backend.open_batch(), [Join(k, ids, 2, LONG, adapter) for k, adapter in enumerate((None, "sql"))]
    for _ in range(50):
        batch.run_chunk(joins, 4)
        joins = []
        if not batch.keys():
            break
    keys = {a: block_keys(ids, size, a) for a in (None, "sql", "support")}
    deadline = time.monotonic() + 10  # the events cross from the engine's process on their own socket
    while matched_blocks(keys["sql"], backend.prefix_report(time.time()).keys) < len(ids) // size:
        assert time.monotonic() < deadline, "the adapter's blocks were never reported"
        time.sleep(0.05)
    held = backend.prefix_report(time.time()).keys
    assert len(ids) // size >= 2
    assert matched_blocks(keys[None], held) == matched_blocks(keys["sql"], held) == len(ids) // size
    assert matched_blocks(keys["support"], held) == 0  # the same tokens under another adapter: another KV


def test_lora_settings_follow_the_adapters(dirs):
    kw = lora_engine_kwargs({}, {"sql": str(dirs["sql"])})
    assert kw == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 16}
    assert lora_engine_kwargs({}, {"sql": str(dirs["sql"])}, base_slot=True)["max_loras"] == 2  # + the zero adapter
    assert lora_engine_kwargs({}, {"w": str(dirs["wide"])})["max_lora_rank"] == 32  # the widest adapter's
    assert lora_engine_kwargs({"max_lora_rank": 8}, {"w": str(dirs["wide"])})["max_lora_rank"] == 8  # as written
    assert lora_engine_kwargs({"dtype": "float32"}, {}) == {"dtype": "float32"}  # no adapters: LoRA stays off


def test_a_base_and_two_adapters_give_their_own_output_each_time(backend, alone):
    assert backend.adapters().keys() == {"sql", "support"}
    for adapter, (first, second) in alone.items():
        assert len(first) == N and first == second, adapter
    outputs = {tuple(first) for first, _ in alone.values()}
    assert len(outputs) == 3


def test_rows_of_two_adapters_share_a_batch(backend, alone):
    out, failed = run(backend, {"s": "sql", "t": "support", "s2": "sql"})
    assert not failed
    assert out == {"s": alone["sql"][0], "t": alone["support"][0], "s2": alone["sql"][0]}


def test_a_base_row_beside_adapter_rows_gets_the_base_output(backend, alone):
    # vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops: lora_weights[lora_indices]) take a row
    # without an adapter (-1) for the last slot's adapter: on CPU a base row runs with the
    # zero adapter instead, and gets the base output beside adapter rows.
    assert backend.lora.base is not None and backend.device == "cpu"
    out, failed = run(backend, {"b": None, "s": "sql", "t": "support", "b2": None})
    assert not failed and out["s"] == alone["sql"][0] and out["t"] == alone["support"][0]
    assert out["b"] == out["b2"] == alone[None][0]
    assert "ballast:base" not in backend.adapters()  # not an adapter a request or an operator can name


def test_an_adapter_added_at_run_time_serves_until_removed(backend, dirs, alone):
    backend.add_adapter("late", str(dirs["late"]))
    backend.add_adapter("late", str(dirs["late"]))  # again, the same directory: nothing changes
    assert backend.adapters()["late"] == str(dirs["late"].resolve())
    late = run(backend, {0: "late"})[0][0]
    assert len(late) == N and late not in [first for first, _ in alone.values()]

    assert backend.remove_adapter("late") and not backend.remove_adapter("late")
    assert "late" not in backend.adapters()
    out, failed = run(backend, {"gone": "late", "sql": "sql", "support": "support"})
    assert out == {"sql": alone["sql"][0], "support": alone["support"][0]}  # the others went on
    err = failed["gone"]
    assert isinstance(err, EngineRefused) and err.field == "model" and err.status == 400 and "'late'" in str(err)


def test_a_bad_adapter_is_refused_when_added_with_vllms_reason(backend, dirs, alone):
    with pytest.raises(AdapterRefused, match="greater than max_lora_rank 16") as wide:
        backend.add_adapter("wide", str(dirs["wide"]))
    assert wide.value.status == 400 and wide.value.name == "wide" and "vLLM refuses it" in wide.value.reason
    with pytest.raises(AdapterRefused, match="vLLM refuses it") as empty:
        backend.add_adapter("empty", str(dirs["empty"]))
    assert "No adapter found" in empty.value.reason
    with pytest.raises(AdapterRefused, match="not a local directory"):
        backend.add_adapter("nowhere", str(dirs["empty"] / "missing"))
    for name in ("llama:sql", "", "a b", "tiny"):
        with pytest.raises(AdapterRefused, match="an adapter's name"):
            backend.add_adapter(name, str(dirs["sql"]))
    with pytest.raises(AdapterRefused, match="taken by"):
        backend.add_adapter("sql", str(dirs["support"]))
    assert backend.adapters().keys() == {"sql", "support"}
    assert run(backend, {0: None})[0][0] == alone[None][0]  # the engine goes on


def test_a_bad_adapter_at_start_fails_the_load_before_vllm_starts(dirs):
    with pytest.raises(ModelLoadError, match="not a local directory"):
        VLLMBackend(str(dirs["base"]), name="x", adapters={"a": str(dirs["empty"] / "missing")})


async def test_the_replica_loop_runs_a_calls_adapter(backend, alone):
    loop = ReplicaLoop(
        backend,
        SchedulerConfig(kv_budget_tokens=8 * 512, context_tokens=512),
        chunk_tokens=4,
        batch_limit=4,
        max_deadline_s=120.0,
        max_tokens_limit=N,
    )

    async def ids(adapter):
        call = ModelCall(prompt=PROMPT, max_tokens=N, sampling=LONG, adapter=adapter)
        return [i async for chunk in loop.stream(call) for i in chunk.ids]

    try:
        got = await asyncio.gather(ids("sql"), ids("support"), ids(None))  # in one batch
        assert got == [alone["sql"][0], alone["support"][0], alone[None][0]]
        assert await ids(None) == alone[None][0]
        with pytest.raises(EngineRefused, match="'nope' is not served") as refused:
            await ids("nope")
        assert refused.value.field == "model"
    finally:
        loop.stop()


# ---------------------------------------------------------------- run-time adapters on a replica


def base_catalog(dirs) -> Catalog:
    """The catalog of the engine's config: model "tiny" with its two adapters."""
    configured = (AdapterEntry("sql", str(dirs["sql"])), AdapterEntry("support", str(dirs["support"])))
    return Catalog.build([ModelEntry("tiny", "vllm", adapters=configured)], {"gold": None})


def listing(*entries: tuple) -> list[dict]:
    """A snapshot's ``adapters``: (name, directory[, model])."""
    return [
        RuntimeAdapter.create(e[2] if len(e) > 2 else "tiny", e[0], str(e[1]), ["*"], 0, "ops").to_dict()
        for e in entries
    ]


async def test_a_replica_follows_the_snapshots_run_time_adapters_tick_by_tick(backend, dirs):
    clock = FakeClock(0)
    replica = ReplicaAdapters(backend, "tiny", base_catalog(dirs), str(dirs["root"]), clock=clock, grace_s=3, retry_s=5)
    late, wide = str(dirs["late"]), str(dirs["wide"])

    # The admin API's trial load: kept for the grace while no snapshot lists it yet, then unloaded.
    assert (await replica.add("late", late))["name"] == "late"
    for _ in range(3):
        assert not await replica.reconcile([])
        assert backend.serves_adapter("late")
        clock.advance()
    assert (await replica.reconcile([])).remove == ("late",)
    assert not backend.serves_adapter("late") and replica.added == {}

    # Listed: loaded; a bad one beside it is logged and counted, and tried again after retry_s.
    changes = await replica.reconcile(listing(("late", late), ("wide", wide)))
    assert changes.add == (("late", late), ("wide", wide))
    assert backend.serves_adapter("late") and not backend.serves_adapter("wide") and replica.failures == 1
    for _ in range(4):
        clock.advance()
        assert not await replica.reconcile(listing(("late", late), ("wide", wide)))
    clock.advance()
    assert (await replica.reconcile(listing(("late", late), ("wide", wide)))).add == (("wide", wide),)
    assert replica.failures == 2

    # Entries that do not fit are skipped (another model's, the config's name); the config's
    # adapters are never unloaded, not by a listing and not by remove_adapter.
    assert not await replica.reconcile(listing(("late", late), ("other", late, "llama"), ("sql", late)))
    assert not await replica.remove("sql")
    with pytest.raises(AdapterRefused, match="the config serves"):
        await replica.add("sql", str(dirs["sql"]))
    assert (await replica.reconcile([])).remove == ("late",)  # listed once: no grace any more
    assert backend.adapters().keys() == {"sql", "support"}


def test_the_admin_route_refuses_a_bad_directory_with_vllms_reason_and_adds_a_good_one(backend, dirs):
    """POST /admin/adapters on a real router object: the trial load goes to a stand-in handle
    whose ``add_adapter.remote`` is the real replica's side (ReplicaAdapters on this engine)."""
    from fakes import FakeClock as Clock
    from routerkit import build_router, routed
    from test_admin_adapters import ADMIN, CoreLink
    from test_resilient_caller import FakeHandle

    from ballast.control.snapshot import SnapshotExchange
    from ballast.policies.reports import RouterReport

    replica = ReplicaAdapters(backend, "tiny", base_catalog(dirs), str(dirs["root"]), clock=Clock(0))
    model = {"name": "tiny", "backend": "vllm", "path": str(dirs["base"]), "adapters": {"sql": str(dirs["sql"])}}
    cfg = {"auth": {"demo_admin_token": "admin-token"}, "models": [model], "adapters_root": str(dirs["root"])}
    router = build_router(cfg, FakeHandle())
    link = CoreLink(router._cfg)
    admin = router._admin
    admin._link = link
    admin._handle_for = lambda name: types.SimpleNamespace(add_adapter=types.SimpleNamespace(remote=replica.add))
    admin._exchange = SnapshotExchange(
        router.snapshots, link.report, lambda: RouterReport(router_id="r"), 1, 5, router.reporter.on_snapshot
    )
    with routed(router) as client:
        for name, reason in (("wide", "greater than max_lora_rank 16"), ("empty", "No adapter found")):
            body = {"model": "tiny", "name": name, "path": str(dirs[name]), "tenants": ["*"]}
            r = client.post("/admin/adapters", headers=ADMIN, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "ADAPTER_REFUSED", r.text
            assert reason in r.json()["error"]["message"]
        assert link.core.admin.adapters() == [] and replica.added == {}
        body = {"model": "tiny", "name": "late", "path": "late", "tenants": ["*"]}  # relative: under the root
        r = client.post("/admin/adapters", headers=ADMIN, json=body)
        assert r.status_code == 201 and backend.serves_adapter("late")
        assert router.pipeline.catalog.resolve("tiny:late") is not None
        # The replica's next snapshot lists it (it holds it already), then no longer does.
        assert not asyncio.run(replica.reconcile(link.core.snapshot()["adapters"]))
        assert client.delete("/admin/adapters/late", headers=ADMIN).status_code == 200
    assert asyncio.run(replica.reconcile(link.core.snapshot()["adapters"])).remove == ("late",)
    assert backend.adapters().keys() == {"sql", "support"}


async def test_a_replica_loads_only_what_its_node_finds_under_the_root_and_no_one_else_may_write(
    backend, dirs, tmp_path
):
    """The check runs where the adapter is read, for a trial load and for a listing alike
    (a record planted in the snapshot included): outside the root, a symlink out of it, a
    directory others may write are refused and vLLM never sees them; fixed, it loads."""
    root = dirs["root"]
    replica = ReplicaAdapters(backend, "tiny", base_catalog(dirs), str(root), clock=FakeClock(0), retry_s=5)
    outside = shutil.copytree(dirs["late"], tmp_path / "planted")
    (root / "link-out").symlink_to(outside)
    shared = shutil.copytree(dirs["late"], root / "shared")
    shared.chmod(0o775)
    for path, why in (
        (str(outside), "is not under adapters_root"),
        ("link-out", "resolves outside adapters_root (a symlink out of it)"),
        ("shared", "shared: writable by its group or by others"),
    ):
        with pytest.raises(AdapterRefused, match=re.escape(why)) as e:
            await replica.add("x", path)
        assert e.value.field == "path"
        assert str(tmp_path) not in e.value.reason.replace(repr(path), "")  # beyond the path sent, none outside
        assert not backend.serves_adapter("x") and replica.added == {}

    changes = await replica.reconcile(listing(("x", outside)))  # listed: refused on this node too
    assert changes.add == (("x", str(outside)),) and not backend.serves_adapter("x") and replica.failures == 1

    shared.chmod(0o755)
    assert (await replica.add("x", "shared"))["path"] == "shared"
    assert backend.adapters()["x"] == str(shared)  # the engine reads the resolved directory
    # A trial load never listed (its add failed after it) gives way to the next add of the name.
    assert (await replica.add("x", "late"))["path"] == "late"
    assert backend.adapters()["x"] == str(dirs["late"]) and replica.added == {"x": "late"}
    assert await replica.remove("x") and not backend.serves_adapter("x")

    off = ReplicaAdapters(backend, "tiny", base_catalog(dirs), None)
    with pytest.raises(AdapterRefused, match="adapters_root is not set"):
        await off.add("x", str(shared))
    assert os.path.isdir(outside)  # nothing here touched the planted copy
