"""ballast.policies.affinity: a holder while it stays within the load bound, else balance."""

import pytest

from ballast.policies.affinity import AffinityConfig, ReplicaView, choose, load_bound

CFG = AffinityConfig(load_bound_ratio=1.25, min_slack=1)


def view(rid: str, load: int, *holds: str, capacity: int = 2) -> ReplicaView:
    return ReplicaView(rid, load, frozenset(holds), capacity)


def test_the_bound_is_a_ratio_over_the_mean_counting_this_request_with_a_slack() -> None:
    assert load_bound([view("a", 3), view("b", 4)], CFG) == pytest.approx(max(1.25 * 4.0, 4.0 + 1))
    assert load_bound([view("a", 30), view("b", 49)], CFG) == pytest.approx(1.25 * 40.0)
    assert load_bound([view("a", 0), view("b", 0)], CFG) == pytest.approx(1.5)  # 0.5 + the slack


def test_a_holder_within_the_bound_wins_over_a_less_loaded_replica() -> None:
    c = choose([view("a", 0), view("b", 1, "sql")], "sql", CFG)
    assert (c.replica_id, c.reason, c.loads) == ("b", "affinity", False)


def test_the_least_loaded_of_several_holders() -> None:
    c = choose([view("a", 3, "sql"), view("b", 2, "sql"), view("c", 2)], "sql", CFG)
    assert (c.replica_id, c.reason) == ("b", "affinity")


def test_a_holder_past_the_bound_gives_way_to_the_least_loaded_which_loads_the_key() -> None:
    # mean with this request (6 + 0 + 1) / 2 = 3.5, bound max(4.375, 4.5) = 4.5: 6 + 1 is past it
    c = choose([view("a", 6, "sql"), view("b", 0)], "sql", CFG)
    assert (c.replica_id, c.reason, c.loads) == ("b", "balance", True)
    # Tick by tick as the holder's load falls: (load + 1) against max(1.25 x mean, mean + 1).
    for holder_load, bound, chosen in ((3, 3.0, "b"), (2, 2.5, "b"), (1, 2.0, "a"), (0, 1.5, "a")):
        replicas = [view("a", holder_load, "sql"), view("b", 0)]
        assert load_bound(replicas, CFG) == pytest.approx(bound)
        assert choose(replicas, "sql", CFG).replica_id == chosen, holder_load


def test_no_holder_balances_preferring_room_then_fewer_keys() -> None:
    full = view("a", 1, "x", "y")
    roomy = view("b", 1, "x")
    c = choose([full, roomy], "sql", CFG)
    assert (c.replica_id, c.reason, c.loads) == ("b", "balance", True)  # equal loads: no eviction first
    assert choose([view("a", 0, "x", "y"), view("b", 1)], "sql", CFG).replica_id == "a"  # load first


def test_no_key_is_balance_alone_and_ties_go_to_the_first_listed() -> None:
    c = choose([view("a", 2, "sql"), view("b", 1), view("c", 1)], None, CFG)
    assert (c.replica_id, c.reason, c.loads) == ("b", "balance", False)


def test_the_least_loaded_replica_is_always_within_the_bound() -> None:
    for loads in ([0, 0], [5, 0, 0], [9, 9, 9], [100, 0]):
        replicas = [view(f"r{i}", n) for i, n in enumerate(loads)]
        assert min(loads) + 1 <= load_bound(replicas, CFG)


@pytest.mark.parametrize("kw", [{"load_bound_ratio": 0.9}, {"min_slack": 0}, {"load_bound_ratio": float("nan")}])
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        AffinityConfig(**kw)
    with pytest.raises(ValueError):
        choose([], "x", CFG)


def test_the_simulation_is_deterministic_and_affinity_loads_fewer_than_p2c() -> None:
    from loadtest.adapter_affinity import Workload, run

    w = Workload(requests=4000, seed=3)
    first, again = run(w), run(w)
    assert first == again  # seeded: the same figures
    ours, theirs = first
    assert ours.loads_per_1000 < 0.7 * theirs.loads_per_1000
    assert ours.max_over_mean < 1.5
