"""ReadinessAwareRouter's adapter affinity (ballast/model/routing.py), without Ray: Serve's
own request router class, driven as Serve drives it, with stand-in replicas.

``StandInReplica`` stands in for Serve's ``RunningReplica`` (which wraps a live actor
handle): the attributes the router reads (``replica_id``, ``routing_stats``,
``multiplexed_model_ids``, ``node_id``, ``availability_zone``, ``max_ongoing_requests``)
and ``get_queue_len``, the probe Serve sends. The loads are set through
``on_new_queue_len_info``, the hook Serve calls with a replica's answer."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from fakes import FakeClock
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from ballast.model import routing_state
from ballast.model.protocol import ModelCall
from ballast.model.routing import (
    MAX_REPORT_AGE_S,
    ReadinessAwareRouter,
    adapter_of,
    replica_routing_stats,
)
from ballast.policies.hedge import Heartbeats
from ballast.policies.holdings import AdapterHoldings
from ballast.policies.prefix_cache import PrefixHoldings

DEPLOYMENT = DeploymentID(name="m", app_name="ballast")


@pytest.fixture(autouse=True)
def fresh_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's routers see only its own replicas' heartbeats (the process keeps one table,
    shared by every request router in it, on each test's own fake clock)."""
    monkeypatch.setattr(routing_state, "_BEATS", Heartbeats())


class StandInReplica:
    """Stands in for Serve's RunningReplica (no actor here)."""

    def __init__(self, name: str, stats: dict[str, Any] | None, load: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats = stats or {}
        self.multiplexed_model_ids: set[str] = set()
        self.node_id = None
        self.availability_zone = None
        self.max_ongoing_requests = 100
        self.load = load

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.load


class SilentReplica(StandInReplica):
    """A replica whose queue-length probe fails (its actor gone, or too slow to answer)."""

    async def get_queue_len(self, *, deadline_s: float) -> int:
        raise TimeoutError("no answer")


def stats(held: tuple[str, ...], demand: dict[str, int], at_s: float = 100.0, ready: bool = True) -> dict[str, Any]:
    h = AdapterHoldings(slots=2, stamp_s=5.0)
    for adapter, n in demand.items():
        for _ in range(n):
            h.ran(adapter)
    for adapter in reversed(held):  # the held ones last, most recent first
        h.ran(adapter)
    return replica_routing_stats(ready, h, at_s)


def request(adapter: str | None) -> PendingRequest:
    call = ModelCall(prompt="hi", max_tokens=4, adapter=adapter)
    meta = RequestMetadata(request_id="r", internal_request_id="i", call_method="generate")
    return PendingRequest(args=[call], kwargs={}, metadata=meta)


def ids(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in group] for group in ranks]


async def router_with(clock: FakeClock, *replicas: StandInReplica, loads: dict[str, int]) -> ReadinessAwareRouter:
    router = ReadinessAwareRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
        get_curr_time_s=clock,
    )
    router.update_replicas(list(replicas))  # as Serve does; it probes the new replicas
    for _ in range(3):
        await asyncio.sleep(0)
    for r in replicas:
        if r.replica_id.unique_id in loads:
            router.on_new_queue_len_info(r.replica_id, loads[r.replica_id.unique_id])
        else:
            router.replica_queue_len_cache.invalidate_key(r.replica_id)
    return router


def test_the_adapter_is_read_from_the_model_call_alone() -> None:
    async def walk() -> None:  # a PendingRequest makes its future on the running loop
        assert adapter_of(request("sql")) == "sql"
        assert adapter_of(request(None)) is None
        assert adapter_of(None) is None
        meta = RequestMetadata(request_id="r", internal_request_id="i")
        assert adapter_of(PendingRequest(args=[{"adapter": "sql"}], kwargs={}, metadata=meta)) is None

    asyncio.run(walk())


def test_a_replica_reports_its_adapters_only_with_slots() -> None:
    assert replica_routing_stats(True, None, 1.0) == {"ready": True, "beat": 1.0}
    assert replica_routing_stats(False, AdapterHoldings(slots=0), 1.0) == {"ready": False, "beat": 1.0}
    h = AdapterHoldings(slots=2)
    h.ran("sql")
    assert replica_routing_stats(True, h, 7.0)["adapters"] == {
        "held": ["sql"],
        "slots": 2,
        "demand": {"sql": 1},
        "at_s": 5.0,
    }


def test_a_holder_within_the_bound_comes_first_then_the_rest_least_loaded() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", stats(("chat", "code"), {}))
        b = StandInReplica("b", stats(("sql", "chat"), {}))
        c = StandInReplica("c", stats(("code",), {}))
        router = await router_with(clock, a, b, c, loads={"a": 0, "b": 2, "c": 1})
        # Tick by tick on b's load: b + 1 against max(1.25 x mean, mean + 2), mean = (sum + 1) / 3.
        for b_load, first in ((2, "b"), (3, "c"), (4, "c"), (2, "b")):  # bound 3.33, 3.67, 4.0, 3.33
            router.on_new_queue_len_info(b.replica_id, b_load)
            ranks = ids(await router.choose_replicas([a, b, c], request("sql")))
            assert ranks[0] == [first], b_load  # past the bound: c, which has a free slot (a would evict)
        router.on_new_queue_len_info(b.replica_id, 2)
        assert ids(await router.choose_replicas([a, b, c], request("sql"))) == [["b"], ["a", "c"]]

    asyncio.run(walk())


def test_a_miss_evicts_the_least_demanded_adapter_across_the_fleet() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", stats(("x", "hot"), {"hot": 30}))
        b = StandInReplica("b", stats(("hot", "cold"), {"cold": 1}))
        router = await router_with(clock, a, b, loads={"a": 0, "b": 1})
        assert ids(await router.choose_replicas([a, b], request("new"))) == [["b"], ["a"]]

    asyncio.run(walk())


def test_a_replica_not_ready_is_never_preferred_even_holding_the_adapter() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", stats(("sql",), {}, ready=False))
        b = StandInReplica("b", stats(("chat",), {}))
        c = StandInReplica("c", stats((), {}))
        router = await router_with(clock, a, b, c, loads={"a": 0, "b": 1, "c": 1})
        ranks = ids(await router.choose_replicas([a, b, c], request("sql")))
        assert ranks == [["c"], ["b"]]  # a left out; both have a free slot: c, with fewer keys

    asyncio.run(walk())


def test_without_an_adapter_or_a_full_view_it_is_power_of_two() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", stats(("sql",), {}))
        b = StandInReplica("b", stats(("chat",), {}))
        router = await router_with(clock, a, b, loads={"a": 3, "b": 0})
        for req in (request(None), None):
            (pair,) = ids(await router.choose_replicas([a, b], req))
            assert sorted(pair) == ["a", "b"]  # two choices, no affinity ranking
        assert ids(await router.choose_replicas([a, b], request("sql"))) == [["a"], ["b"]]  # affinity

        # Stale: the view is dated 100; past the max age on this router's clock it is not used.
        clock.advance(int(MAX_REPORT_AGE_S))
        router.on_new_queue_len_info(a.replica_id, 3)
        router.on_new_queue_len_info(b.replica_id, 0)
        assert ids(await router.choose_replicas([a, b], request("sql"))) == [["a"], ["b"]]
        clock.advance()
        router.on_new_queue_len_info(a.replica_id, 3)
        router.on_new_queue_len_info(b.replica_id, 0)
        (pair,) = ids(await router.choose_replicas([a, b], request("sql")))
        assert sorted(pair) == ["a", "b"]

    asyncio.run(walk())


def test_a_missing_load_or_report_falls_back_to_power_of_two() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", stats(("sql",), {}))
        b = StandInReplica("b", {"ready": True})  # no adapters reported (no slots, or not polled)
        router = await router_with(clock, a, b, loads={"a": 0, "b": 0})
        (pair,) = ids(await router.choose_replicas([a, b], request("sql")))
        assert sorted(pair) == ["a", "b"]
        c = StandInReplica("c", stats(("chat",), {}), load=5)
        router = await router_with(clock, a, c, loads={"a": 0})  # c's load not cached: probed
        assert ids(await router.choose_replicas([a, c], request("sql"))) == [["a"], ["c"]]
        assert router.replica_queue_len_cache.get(c.replica_id) == 5
        d = SilentReplica("d", stats(("chat",), {}))
        router = await router_with(clock, a, d, loads={"a": 0})  # d's load not cached, and d does not answer
        (pair,) = ids(await router.choose_replicas([a, d], request("sql")))
        assert sorted(pair) == ["a", "d"]

    asyncio.run(walk())


def test_a_report_stamped_ahead_of_the_routers_clock_goes_stale_once_it_stops_changing() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", stats(("sql",), {}, at_s=10_000.0))  # its clock (or stamp) far ahead
        b = StandInReplica("b", stats(("chat",), {}))
        router = await router_with(clock, a, b, loads={"a": 3, "b": 0})

        async def by_affinity() -> bool:
            b.routing_stats = stats(("chat",), {}, at_s=float(clock()))  # b reports on: always fresh
            router.on_new_queue_len_info(a.replica_id, 3)
            router.on_new_queue_len_info(b.replica_id, 0)
            return ids(await router.choose_replicas([a, b], request("sql"))) == [["a"], ["b"]]

        # a's stamp is taken as of 100, when this router first saw it: stale MAX_REPORT_AGE_S
        # later while it stays the same (a replica gone silent), not at 10,000 + 15.
        assert await by_affinity()
        clock.advance(int(MAX_REPORT_AGE_S))
        assert await by_affinity()
        clock.advance()
        assert not await by_affinity()
        # a reports again (a new stamp, still ahead): clamped to this router's clock, fresh.
        a.routing_stats = stats(("sql",), {}, at_s=10_005.0)
        assert await by_affinity()
        clock.advance(int(MAX_REPORT_AGE_S) + 1)
        assert not await by_affinity()

    asyncio.run(walk())


def test_a_report_past_its_bounds_is_refused_and_logged_once_per_replica(caplog) -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        long_name = stats(("sql",), {})
        long_name["adapters"]["held"] = ["x" * 65]  # longer than any adapter's name
        a = StandInReplica("a", long_name)
        b = StandInReplica("b", stats(("chat",), {}))
        router = await router_with(clock, a, b, loads={"a": 0, "b": 0})
        with caplog.at_level(logging.WARNING, logger="ballast.model.routing"):
            for _ in range(3):
                (pair,) = ids(await router.choose_replicas([a, b], request("sql")))
                assert sorted(pair) == ["a", "b"]  # no view of a: by load, never refused
        refusals = [r.getMessage() for r in caplog.records if "adapter report refused" in r.getMessage()]
        assert len(refusals) == 1 and "replica a's" in refusals[0] and "held:" in refusals[0]
        a.routing_stats = stats(("sql",), {})  # a well-formed report again: affinity again
        assert ids(await router.choose_replicas([a, b], request("sql"))) == [["a"], ["b"]]

    asyncio.run(walk())


# -- prompt prefixes ----------------------------------------------------------------------
BLOCK = 4


def prefix_stats(*prompts: list[int], at_s: float = 100.0, adapter: str | None = None) -> dict[str, Any]:
    """A replica's routing stats holding ``prompts``' full blocks, as its KV events say."""
    h = PrefixHoldings(capacity_blocks=256, block_size=BLOCK)
    for n, ids in enumerate(prompts):
        hashes = [f"{n}:{i}" for i in range(len(ids) // BLOCK)]
        h.stored(hashes, None, ids, adapter)
    return replica_routing_stats(True, None, at_s, h.report(at_s))


def prompt_request(ids: list[int], route: str = "affinity", adapter: str | None = None, rid: str = "i") -> Any:
    call = ModelCall(prompt="", prompt_ids=tuple(ids), max_tokens=4, adapter=adapter, route=route)
    meta = RequestMetadata(request_id="r", internal_request_id=rid, call_method="generate")
    return PendingRequest(args=[call], kwargs={}, metadata=meta)


SYSTEM = list(range(100, 124))  # six blocks a tenant's every prompt starts with


def test_the_replica_holding_the_prompt_prefix_comes_first_while_fresh() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", prefix_stats(SYSTEM))
        b = StandInReplica("b", prefix_stats(list(range(500, 524))))
        router = await router_with(clock, a, b, loads={"a": 2, "b": 0})
        turn = SYSTEM + [7, 8, 9, 10, 11]
        assert ids(await router.choose_replicas([a, b], prompt_request(turn))) == [["a"], ["b"]]
        # Tick by tick to the report's max age: used up to it, then power of two.
        clock.advance(int(MAX_REPORT_AGE_S))
        router.on_new_queue_len_info(a.replica_id, 2)
        router.on_new_queue_len_info(b.replica_id, 0)
        assert ids(await router.choose_replicas([a, b], prompt_request(turn))) == [["a"], ["b"]]
        clock.advance()
        router.on_new_queue_len_info(a.replica_id, 2)
        router.on_new_queue_len_info(b.replica_id, 0)
        (pair,) = ids(await router.choose_replicas([a, b], prompt_request(turn)))
        assert sorted(pair) == ["a", "b"]

    asyncio.run(walk())


def test_a_holder_past_the_load_bound_gives_way_and_balance_skips_affinity() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", prefix_stats(SYSTEM))
        b = StandInReplica("b", prefix_stats())
        router = await router_with(clock, a, b, loads={"a": 3, "b": 0})
        # a + 1 = 4 against max(1.25 x 2, 2 + 2) = 4: within; at 4 it is past (4.5).
        assert ids(await router.choose_replicas([a, b], prompt_request(SYSTEM)))[0] == ["a"]
        router.on_new_queue_len_info(a.replica_id, 4)
        assert ids(await router.choose_replicas([a, b], prompt_request(SYSTEM)))[0] == ["b"]
        router.on_new_queue_len_info(a.replica_id, 1)
        assert ids(await router.choose_replicas([a, b], prompt_request(SYSTEM, "least_loaded")))[0] == ["b"]
        (pair,) = ids(await router.choose_replicas([a, b], prompt_request(SYSTEM, "balance")))
        assert sorted(pair) == ["a", "b"]  # the model short of capacity: power of two
        router.on_new_queue_len_info(a.replica_id, 0)
        assert ids(await router.choose_replicas([a, b], prompt_request(SYSTEM, "least_loaded")))[0] == ["a"]

    asyncio.run(walk())


def test_a_new_prompt_goes_to_the_same_home_on_every_router() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a, b, c = (StandInReplica(n, prefix_stats()) for n in "abc")
        routers = [await router_with(clock, a, b, c, loads={"a": 1, "b": 1, "c": 1}) for _ in range(2)]
        homes = set()
        for tenant in range(12):
            new = list(range(1000 * tenant, 1000 * tenant + 12))
            firsts = [ids(await r.choose_replicas([a, b, c], prompt_request(new)))[0] for r in routers]
            assert firsts[0] == firsts[1], tenant  # two routers, no shared state but the reports
            homes.add(firsts[0][0])
        assert homes == {"a", "b", "c"}

    asyncio.run(walk())


def test_an_adapter_call_whose_prompt_no_replica_holds_goes_where_its_adapter_is() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", {**prefix_stats(SYSTEM, adapter="sql"), "adapters": stats(("sql",), {})["adapters"]})
        b = StandInReplica("b", {**prefix_stats(), "adapters": stats(("chat",), {})["adapters"]})
        router = await router_with(clock, a, b, loads={"a": 1, "b": 0})
        assert ids(await router.choose_replicas([a, b], prompt_request(SYSTEM, adapter="sql")))[0] == ["a"]
        fresh = list(range(900, 924))
        assert ids(await router.choose_replicas([a, b], prompt_request(fresh, adapter="sql")))[0] == ["a"]
        assert ids(await router.choose_replicas([a, b], prompt_request(fresh, adapter="chat")))[0] == ["b"]
        # The base model's blocks are not the adapter's: SYSTEM under "chat" is held nowhere.
        assert ids(await router.choose_replicas([a, b], prompt_request(SYSTEM, adapter="chat")))[0] == ["b"]

    asyncio.run(walk())


def test_a_report_is_decoded_once_per_stamp() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", prefix_stats(SYSTEM))
        b = StandInReplica("b", prefix_stats())
        router = await router_with(clock, a, b, loads={"a": 0, "b": 0})
        first = router._prefix_report_of(a)
        assert first is not None and router._prefix_report_of(a) is first
        a.routing_stats = prefix_stats(SYSTEM, at_s=101.0)
        assert router._prefix_report_of(a) is not first
        a.routing_stats = {"ready": True, "prefix": {"blocks": "not bytes"}}
        assert router._prefix_report_of(a) is None

    asyncio.run(walk())


def test_the_replica_chosen_for_a_request_serves_that_request() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", prefix_stats())
        router = await router_with(clock, a, loads={"a": 0})
        older, newer = prompt_request(SYSTEM, rid="older"), prompt_request(SYSTEM, rid="newer")
        for pr in (older, newer):
            router._pending_requests_to_fulfill.append(pr)
            router._pending_requests_by_id[pr.metadata.internal_request_id] = pr
        router._fulfill_next_pending_request(a, newer.metadata)
        assert newer.future.done() and not older.future.done()  # not FIFO: by the request's id

    asyncio.run(walk())


def test_each_decision_is_counted_by_reason_for_the_controller() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a = StandInReplica("a", prefix_stats(SYSTEM))
        b = StandInReplica("b", prefix_stats())
        router = await router_with(clock, a, b, loads={"a": 0, "b": 0})
        router.initialize_state(model="counted-model", prefix_affinity=True, load_bound_ratio=1.25, min_slack=2)
        await router.choose_replicas([a, b], prompt_request(SYSTEM))  # prefix
        await router.choose_replicas([a, b], prompt_request(list(range(600, 624))))  # home
        await router.choose_replicas([a, b], prompt_request(SYSTEM, "balance"))  # balance
        assert router._decisions is not None and router._decisions.counts == {"prefix": 1, "home": 1, "balance": 1}
        router.initialize_state(model="counted-model", prefix_affinity=False)
        await router.choose_replicas([a, b], prompt_request(SYSTEM))  # affinity off: power of two
        assert router._decisions.counts == {"balance": 1}

    asyncio.run(walk())


def beating(name: str, beat: float, held: tuple[str, ...] = ()) -> StandInReplica:
    """A replica whose routing stats carry heartbeat ``beat`` (and adapters ``held``)."""
    return StandInReplica(name, {**stats(held, {}), "beat": beat})


def test_a_silent_replica_gets_nothing_new_and_one_a_call_avoids_is_passed_over() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a, b, c = beating("a", 1.0, ("sql",)), beating("b", 1.0), beating("c", 1.0)
        router = await router_with(clock, a, b, c, loads={"a": 0, "b": 1, "c": 1})
        router.model = "silence-test"
        router.update_replicas([a, b, c])  # the beats seen at t=100
        assert ids(await router.choose_replicas([a, b, c], request("sql")))[0] == ["a"]  # the holder
        # b and c beat again at t=103 and t=105; a, the adapter's holder, does not.
        clock.advance(3)
        b.routing_stats, c.routing_stats = {**b.routing_stats, "beat": 2.0}, {**c.routing_stats, "beat": 2.0}
        router.update_replicas([a, b, c])
        clock.advance(1)  # t=104: a's beat stood still 4 s, the limit: not yet silent
        assert ids(await router.choose_replicas([a, b, c], request("sql")))[0] == ["a"]
        clock.advance(1)  # t=105: silent
        b.routing_stats, c.routing_stats = {**b.routing_stats, "beat": 3.0}, {**c.routing_stats, "beat": 3.0}
        router.update_replicas([a, b, c])
        ranks = ids(await router.choose_replicas([a, b, c], request("sql")))
        assert "a" not in sum(ranks, [])
        # A call that avoids b (a hedge of an attempt there) goes to c while c is ready ...
        call = ModelCall(prompt="hi", max_tokens=4, adapter="sql", avoid=("b",))
        meta = RequestMetadata(request_id="r", internal_request_id="j", call_method="generate")
        avoiding = PendingRequest(args=[call], kwargs={}, metadata=meta)
        assert ids(await router.choose_replicas([a, b, c], avoiding)) == [["c"]]
        # ... and to b when it is the only one left.
        call_all = ModelCall(prompt="hi", max_tokens=4, adapter="sql", avoid=("b", "c"))
        both = PendingRequest(args=[call_all], kwargs={}, metadata=meta)
        assert set(sum(ids(await router.choose_replicas([a, b, c], both)), [])) == {"b", "c"}

    asyncio.run(walk())


def test_the_replica_an_attempt_went_to_is_noted_by_its_id() -> None:
    from ballast.model.routing_state import note_placed, placed

    class Response:
        def __init__(self, internal_request_id: str) -> None:
            self._request_metadata = RequestMetadata(request_id="r", internal_request_id=internal_request_id)

    note_placed("attempt-1", "replica-a")
    note_placed("attempt-1", "replica-b")  # Serve placed it again (a rejection): the last one counts
    assert placed(Response("attempt-1")) == "replica-b"
    assert placed(Response("attempt-2")) is None and placed(object()) is None


def test_a_call_that_avoids_a_replica_goes_to_another_node_first() -> None:
    async def walk() -> None:
        clock = FakeClock(100)
        a, b, c = beating("a", 1.0), beating("b", 1.0), beating("c", 1.0)
        a.node_id, b.node_id, c.node_id = "n1", "n1", "n2"  # a and b share a node
        router = await router_with(clock, a, b, c, loads={"a": 0, "b": 0, "c": 5})
        meta = RequestMetadata(request_id="r", internal_request_id="k", call_method="generate")

        def avoiding(*replicas: str) -> PendingRequest:
            return PendingRequest(args=[ModelCall("hi", max_tokens=4, avoid=replicas)], kwargs={}, metadata=meta)

        # A hedge of an attempt on a: c, on the other node, though b is idle and c is not.
        assert ids(await router.choose_replicas([a, b, c], avoiding("a"))) == [["c"]]
        # Nothing left on another node: another replica on the same one.
        assert ids(await router.choose_replicas([a, b, c], avoiding("a", "c"))) == [["b"]]

    asyncio.run(walk())
