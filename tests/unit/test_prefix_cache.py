"""The prompt-block view (ballast/policies/prefix_cache.py) and the prefix choice
(ballast/policies/affinity.py ``choose_by_prefix``): pure, no Ray, no engine."""

from __future__ import annotations

import pytest

from ballast.policies.affinity import AffinityConfig, PrefixView, choose_by_prefix, rank_by_prefix, route_mode
from ballast.policies.cache_groups import cache_group, cache_salt, salts_of, secret_of
from ballast.policies.prefix_cache import (
    MAX_FUTURE_S,
    MAX_REPORTED_BLOCKS,
    PrefixHoldings,
    PrefixReport,
    block_keys,
    home_score,
    matched_blocks,
)

BS = 4  # tokens per block


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def store_as_the_engine_does(h: PrefixHoldings, ids: list[int], adapter: str | None = None, tag: str = "") -> list:
    """Feed ``ids``' full blocks as vLLM's events do: one event per run of blocks, each
    after its parent (its engine hashes are opaque to the mirror: any hashable)."""
    hashes = [f"{tag}{adapter}:{tuple(ids[: (i + 1) * BS])}" for i in range(len(ids) // BS)]
    h.stored(hashes[:2], None, ids[: 2 * BS], adapter)
    h.stored(hashes[2:], hashes[1], ids[2 * BS : len(hashes) * BS], adapter)
    return hashes


def test_keys_chain_the_whole_prefix_and_count_full_blocks_only() -> None:
    keys = block_keys(prompt(10), BS)
    assert len(keys) == 2  # 10 tokens: two full blocks, the partial third does not count
    assert block_keys(prompt(10), BS) == keys  # the same in every call (and process: BLAKE2b)
    assert block_keys(prompt(12), BS)[:2] == keys
    changed = prompt(12)
    changed[1] = 99  # a token in the first block: every key after it changes too
    assert all(a != b for a, b in zip(block_keys(changed, BS), block_keys(prompt(12), BS)))
    tail = prompt(12)
    tail[9] = 99  # in the third block: the first two keys stay
    assert block_keys(tail, BS)[:2] == keys and block_keys(tail, BS)[2] != block_keys(prompt(12), BS)[2]
    assert block_keys(prompt(12), BS, adapter="sql")[0] != block_keys(prompt(12), BS)[0]
    assert len(block_keys(prompt(400), BS, limit=7)) == 7
    assert all(0 <= k < 2**32 for k in keys)


def test_a_cache_salt_starts_another_chain_on_both_sides() -> None:
    ids = prompt(12)
    salted = {salt: block_keys(ids, BS, salt=salt) for salt in (None, "a", "b")}
    assert len({keys[0] for keys in salted.values()}) == 3  # no block is shared across salts
    assert all(len({keys[i] for keys in salted.values()}) == 3 for i in range(3))
    assert block_keys(ids, BS, "a", None)[0] != block_keys(ids, BS, None, "a")[0]  # adapter "a" is not salt "a"
    h = PrefixHoldings(capacity_blocks=16, block_size=BS)
    hashes = [f"a:{i}" for i in range(3)]
    h.stored(hashes[:1], None, ids[:BS], None, "a")  # vLLM's first block carries the salt,
    h.stored(hashes[1:], hashes[0], ids[BS:], None)  # the blocks after it chain from it
    held = h.report(1.0).keys
    assert matched_blocks(salted["a"], held) == 3
    assert matched_blocks(salted["b"], held) == matched_blocks(salted[None], held) == 0


def test_cache_groups_and_their_salts() -> None:
    assert cache_group("acme", None) == "tenant:acme" and cache_group("acme", "shared") == "shared"
    assert cache_group("shared", None) != cache_group("acme", "shared")  # a tenant's own group is its own
    key = secret_of("s3cret", "admin", "ballast")
    salts = salts_of({"acme": "team", "beta": "team", "gamma": None}, key)
    assert salts["acme"] == salts["beta"] != salts["gamma"]  # one group, one salt
    assert len(salts["acme"]) == 32 and int(salts["acme"], 16) >= 0
    assert cache_salt(secret_of("other", "admin", "ballast"), "team") != salts["acme"]  # the secret matters
    # Without a configured secret: one derived from the admin token, else from the app's name,
    # the same on every router that shares them, and never the bare input.
    assert secret_of(None, "admin", "x") == secret_of(None, "admin", "y") != secret_of(None, "admin2", "x")
    assert secret_of(None, None, "x") != secret_of(None, None, "y") and secret_of(None, "admin", "x") != b"admin"
    with pytest.raises(ValueError):
        cache_salt(b"", "team")


def test_the_replica_mirror_keys_blocks_as_the_router_does() -> None:
    h = PrefixHoldings(capacity_blocks=64, block_size=BS)
    ids = prompt(22)
    store_as_the_engine_does(h, ids, adapter="sql")
    held = h.report(5.0).keys
    assert matched_blocks(block_keys(ids, BS, "sql"), held) == 5
    assert matched_blocks(block_keys(ids, BS), held) == 0  # the base model's KV is another
    longer = ids[:20] + [500, 501, 502, 503]
    assert matched_blocks(block_keys(longer, BS, "sql"), held) == 5  # the shared prefix
    other = [7] + ids[1:]
    assert matched_blocks(block_keys(other, BS, "sql"), held) == 0  # differs in block 1: nothing


def test_a_block_whose_parent_is_unknown_is_left_out() -> None:
    h = PrefixHoldings(capacity_blocks=64, block_size=BS)
    assert h.stored(["x", "y"], "lost-parent", prompt(8)) == 0
    assert len(h) == 0
    assert h.stored(["a"], None, prompt(3)) == 0  # not a full block


def test_removed_and_cleared_leave_the_view() -> None:
    h = PrefixHoldings(capacity_blocks=64, block_size=BS)
    ids = prompt(16)
    hashes = store_as_the_engine_does(h, ids)
    keys = block_keys(ids, BS)
    h.removed([hashes[2]])  # vLLM evicts a block: the prefix now ends before it
    assert matched_blocks(keys, h.report(1.0).keys) == 2
    h.removed(["never-stored"])
    h.cleared()
    assert len(h) == 0 and h.report(2.0).count == 0


def test_the_mirror_is_bounded_by_the_engine_blocks_and_the_report_by_report_blocks() -> None:
    h = PrefixHoldings(capacity_blocks=6, block_size=BS, report_blocks=4)
    first = prompt(16)
    store_as_the_engine_does(h, first, tag="1")
    second = prompt(16, start=100)
    store_as_the_engine_does(h, second, tag="2")
    assert len(h) == 6  # the two oldest blocks of the first prompt aged out
    r = h.report(3.0)
    assert r.count == 4 and r.held_blocks == 6 and r.block_size == BS and r.at_s == 3.0
    assert r.keys == frozenset(block_keys(second, BS))  # the most recently stored first


def test_a_report_crosses_as_stats_and_a_malformed_one_is_refused() -> None:
    h = PrefixHoldings(capacity_blocks=16, block_size=BS)
    store_as_the_engine_does(h, prompt(12))
    r = h.report(9.0)
    back = PrefixReport.of(r.as_stats())
    assert back == r and back is not None and back.keys == r.keys
    good = r.as_stats()
    for bad in (
        None,
        [],
        {**good, "blocks": b"abc"},  # not whole keys
        {**good, "blocks": "text"},
        {**good, "blocks": b"\0" * (4 * MAX_REPORTED_BLOCKS + 4)},
        {**good, "block_size": 0},
        {**good, "block_size": True},
        {**good, "at_s": float("nan")},
        {**good, "held": -1},
    ):
        assert PrefixReport.of(bad) is None, bad
    assert r.is_fresh(10.0, 1.0) and not r.is_fresh(10.5, 1.0)
    # A stamp ahead of the router's clock counts only within MAX_FUTURE_S (clocks a little
    # apart): a report stamped far in the future is never fresh, rather than fresh forever.
    assert r.is_fresh(9.0 - MAX_FUTURE_S, 1.0) and not r.is_fresh(9.0 - MAX_FUTURE_S - 0.5, 1.0)
    assert not PrefixHoldings(1, BS).report(1e12).is_fresh(9.0, 1.0)
    # The largest report is 256 KiB (MAX_REPORTED_BLOCKS keys), not megabytes.
    assert 4 * MAX_REPORTED_BLOCKS == 256 * 1024
    with pytest.raises(ValueError):
        h.report(float("inf"))
    with pytest.raises(ValueError):
        PrefixHoldings(capacity_blocks=0, block_size=BS)


CFG = AffinityConfig()  # bound: max(1.25 x mean, mean + 2), mean counting this request


def views(*rows: tuple[str, int, int]) -> list[PrefixView]:
    return [PrefixView(rid, load, matched, home_score(42, rid)) for rid, load, matched in rows]


def test_the_longest_held_prefix_wins_within_the_load_bound() -> None:
    # Tick by tick on a's load, a holding 6 blocks, b 2, c none: a + 1 against the bound
    # max(1.25 x mean, mean + 2), mean = (sum + 1) / 3: 2.67, 3.33, 3.67, 5.67.
    for a_load, first, reason in ((0, "a", "prefix"), (2, "a", "prefix"), (3, "b", "prefix"), (9, "b", "prefix")):
        vs = views(("a", a_load, 6), ("b", 1, 2), ("c", 0, 0))
        choice = choose_by_prefix(vs, CFG)
        assert (choice.replica_id, choice.reason) == (first, reason), a_load
    # b past the bound too: c, holding nothing, and it says so.
    choice = choose_by_prefix(views(("a", 9, 6), ("b", 9, 2), ("c", 0, 0)), CFG)
    assert (choice.replica_id, choice.reason) == ("c", "home")


def test_no_replica_past_the_bound_is_chosen_and_the_least_loaded_always_can_be() -> None:
    for loads in ((0, 0, 0), (5, 0, 0), (10, 9, 0), (3, 3, 3), (50, 1, 2)):
        vs = views(*((rid, load, 8 - i) for i, (rid, load) in enumerate(zip("abc", loads))))
        choice = choose_by_prefix(vs, CFG)
        mean = (sum(loads) + 1) / 3
        chosen = next(v for v in vs if v.replica_id == choice.replica_id)
        assert chosen.load + 1 <= max(1.25 * mean, mean + 2), loads


def test_ties_go_to_the_home_every_router_computes_alike() -> None:
    rows = (("a", 1, 0), ("b", 1, 0), ("c", 1, 0))
    homes = {
        choose_by_prefix([PrefixView(r, load, m, home_score(k, r)) for r, load, m in rows], CFG).replica_id
        for k in range(64)
    }
    assert homes == {"a", "b", "c"}  # keys spread over the replicas
    for k in range(16):  # and the order the replicas are listed in does not matter
        forward = [PrefixView(r, load, m, home_score(k, r)) for r, load, m in rows]
        assert choose_by_prefix(forward, CFG) == choose_by_prefix(forward[::-1], CFG)


def test_least_loaded_mode_never_waits_for_a_holder() -> None:
    vs = views(("a", 2, 6), ("b", 1, 0), ("c", 1, 3))
    assert choose_by_prefix(vs, CFG).replica_id == "a"  # within the bound: the holder
    choice = choose_by_prefix(vs, CFG, least_loaded=True)
    assert choice.replica_id == "c"  # among the least loaded, the one holding most
    choice, order = rank_by_prefix(vs, CFG, least_loaded=True)
    assert order == ["c", "b", "a"]


def test_route_mode_by_level_and_class() -> None:
    assert route_mode("critical", 0, 2) == "affinity"
    assert route_mode("sheddable", 1, 2) == "affinity"
    assert route_mode("critical_plus", 0, 2) == "least_loaded"
    for crit in ("critical_plus", "critical", "sheddable"):
        assert route_mode(crit, 2, 2) == "balance"
        assert route_mode(crit, 4, 2) == "balance"
    assert route_mode("critical", 0, 0) == "balance"  # an operator who wants load alone
