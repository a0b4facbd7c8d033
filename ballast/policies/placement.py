"""A replica that spans several ranks: its placement group, and whether a cluster can hold it.

A model whose vLLM engine runs ``tensor_parallel_size`` x ``pipeline_parallel_size``
ranks (its *world*) is served by replicas that each hold a Ray placement group of one
bundle per rank (:class:`Placement`). The replica actor itself sits in the first bundle,
its own resources added to that rank's (as ``ray.serve.llm`` merges them), and asks for
no accelerator: the ranks hold them. Serve creates the group with the replica and gives
it back with it, so the group is one replica to everything that counts replicas.

vLLM runs the ranks one of two ways (its ``distributed_executor_backend``):

* ``mp``: child processes of the replica's engine core, on the replica's own node. Only
  ``STRICT_PACK`` reserves every rank's bundle on that node, so ``mp`` takes no other
  strategy. vLLM's CPU build runs its ranks this way only.
* ``ray``: Ray actors that vLLM starts in the replica's placement group (its bundles may
  lie on several nodes, as the strategy allows). vLLM takes at most one GPU per bundle.

:func:`placement_problem` is the check made when an application is deployed: whether
the nodes as they are (total resources, plain data) or a node type the cluster's
autoscaler may still add could ever hold one replica's group, and if not, a sentence
naming the model, what it needs and what the largest node or the cluster has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ballast.policies.validation import check_int, check_name, is_finite

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
EXECUTORS = ("mp", "ray")
#: Resource amounts closer than this are equal (Ray rounds its resources to 1e-4).
_EPS = 1e-6

Resources = Mapping[str, float]


@dataclass(frozen=True)
class Placement:
    """One replica's placement group: ``world`` bundles of ``rank_resources`` (the first
    also holding ``replica_resources``, the replica actor's own), placed by ``strategy``;
    vLLM runs the ranks with ``executor``. ``check``: whether deploying checks the
    cluster can hold it (:func:`placement_problem`)."""

    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    rank_resources: tuple[tuple[str, float], ...]
    strategy: str = "STRICT_PACK"
    executor: str = "mp"
    replica_resources: tuple[tuple[str, float], ...] = ()
    check: bool = True

    def __post_init__(self) -> None:
        check_name("model", self.model)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, minimum=1)
        if self.world < 2:
            raise ValueError("a placement group is for a model of more than one rank")
        _check_resources("rank_resources", self.rank_resources, some=True)
        _check_resources("replica_resources", self.replica_resources, some=False)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"distributed_executor_backend: one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        _check_executor(self)

    @property
    def world(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def gpus_per_rank(self) -> float:
        return dict(self.rank_resources).get("GPU", 0.0)

    def bundles(self) -> list[dict[str, float]]:
        """The group's bundles, one per rank; the replica's own resources added to the first."""
        rank = dict(self.rank_resources)
        first = dict(rank)
        for name, amount in self.replica_resources:
            first[name] = first.get(name, 0.0) + amount
        return [first] + [dict(rank) for _ in range(self.world - 1)]

    def describe(self) -> str:
        """The ranks as the config writes them: ``tensor_parallel_size 4 x pipeline_parallel_size 1``."""
        return (
            f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size}"
        )


def _check_resources(name: str, resources: object, some: bool) -> None:
    if not isinstance(resources, tuple) or not all(
        isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) and kv[0] for kv in resources
    ):
        raise ValueError(f"{name}: must be a tuple of (resource, amount) pairs, got {resources!r}")
    bad = [k for k, v in resources if not is_finite(v) or v < 0]
    if bad:
        raise ValueError(f"{name}: amounts are finite numbers >= 0; {bad} are not")
    if some and not any(v > 0 for _, v in resources):
        raise ValueError(f"{name}: a rank's bundle asks for some resource (a GPU, a CPU, a custom one)")


def _check_executor(p: Placement) -> None:
    """The executor's own limits: ``mp`` ranks live on the replica's node, ``ray`` takes a
    GPU or less per rank bundle."""
    if p.executor == "mp" and p.strategy != "STRICT_PACK":
        raise ValueError(
            f"strategy: {p.strategy} may put ranks on other nodes, but vLLM's 'mp' executor (the CPU "
            "default) starts every rank as a child process of the replica on its own node: only "
            "STRICT_PACK holds them there (distributed_executor_backend: ray spreads ranks as Ray actors)"
        )
    if p.executor == "mp" and p.gpus_per_rank > 0:
        raise ValueError(
            "distributed_executor_backend: 'mp' starts the ranks inside the replica's process tree, which "
            "Ray gives no GPU (the ranks' bundles hold them); on GPUs the ranks run as Ray actors: 'ray'"
        )
    if p.executor == "ray" and p.gpus_per_rank > 1:
        raise ValueError(f"num_gpus: vLLM's ray executor takes at most 1 GPU per rank, got {p.gpus_per_rank:g}")


# -- the check at deploy -----------------------------------------------------------------


def placement_problem(p: Placement, nodes: Sequence[Resources], node_types: Sequence[Resources] = ()) -> str | None:
    """Why the cluster can never hold one replica of ``p``; None when it can.

    ``nodes``: each live node's total resources; ``node_types``: the resources of each
    node type the cluster's autoscaler may still add. Against totals, not what is free:
    a group that waits for other replicas to go is pending, not impossible. STRICT_PACK
    needs one node (or node type) that holds the sum of the bundles; STRICT_SPREAD a
    distinct node for each bundle; PACK and SPREAD each bundle on some node and the sum
    within the cluster's total. A node type that holds every bundle (STRICT_PACK: their
    sum) can be added as often as needed: then nothing is refused.
    """
    bundles = p.bundles()
    if p.strategy == "STRICT_PACK":
        need = _sum(bundles)
        if any(_holds(n, need) for n in [*nodes, *node_types]):
            return None
        return _refusal(p, f"{_fmt(need)} on one node (STRICT_PACK: {_fmt_bundles(p)})", need, nodes, node_types)
    if any(all(_holds(t, b) for b in bundles) for t in node_types):
        return None
    if p.strategy == "STRICT_SPREAD":
        if _distinct_nodes(bundles, nodes):
            return None
        what = f"{len(bundles)} nodes that each hold a bundle (STRICT_SPREAD: {_fmt_bundles(p)})"
        return _refusal(p, what, bundles[0], nodes, node_types)
    alone = [b for b in bundles if not any(_holds(n, b) for n in nodes)]
    if alone:
        return _refusal(p, f"a node for each bundle ({p.strategy}: {_fmt_bundles(p)})", alone[0], nodes, node_types)
    need, total = _sum(bundles), _sum(nodes)
    if _holds(total, need):
        return None
    has = _fmt({k: total.get(k, 0.0) for k in need})
    what = f"{_fmt(need)} in all ({p.strategy}: {_fmt_bundles(p)})"
    return f"model {p.model}: {p.describe()} needs {what}; the cluster has {has}"


def _refusal(
    p: Placement, what: str, need: Resources, nodes: Sequence[Resources], node_types: Sequence[Resources]
) -> str:
    best = _closest(need, nodes)
    has = _fmt({k: best.get(k, 0.0) for k in need}) if best is not None else "nothing (no live node)"
    text = f"model {p.model}: {p.describe()} needs {what}; the largest node has {has}"
    if node_types:
        text += ", and no node type the autoscaler may add holds it"
    return text


def _closest(need: Resources, nodes: Sequence[Resources]) -> Resources | None:
    """The node that comes nearest to holding ``need`` (by the share of each resource it has)."""

    def score(n: Resources) -> float:
        return sum(min(n.get(k, 0.0) / v, 1.0) for k, v in need.items() if v > 0)

    return max(nodes, key=score, default=None)


def _holds(node: Resources, need: Resources) -> bool:
    return all(node.get(k, 0.0) + _EPS >= v for k, v in need.items() if v > 0)


def _sum(bundles: Sequence[Resources]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _distinct_nodes(bundles: Sequence[Resources], nodes: Sequence[Resources]) -> bool:
    """Whether each bundle can have a node of its own (a bipartite matching, bundles to nodes)."""
    owner: dict[int, int] = {}  # node index -> bundle index

    def place(b: int, seen: set[int]) -> bool:
        for n, node in enumerate(nodes):
            if n in seen or not _holds(node, bundles[b]):
                continue
            seen.add(n)
            if n not in owner or place(owner[n], seen):
                owner[n] = b
                return True
        return False

    return all(place(b, set()) for b in range(len(bundles)))


def _fmt(resources: Resources) -> str:
    """``{GPU: 4, CPU: 1}``: amounts as short as they are exact."""
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in resources.items()) + "}"


def _num(v: float) -> str:
    return str(int(v)) if math.isclose(v, round(v), abs_tol=_EPS) else f"{v:g}"


def _fmt_bundles(p: Placement) -> str:
    bundles = p.bundles()
    rank = dict(p.rank_resources)
    text = f"{p.world} bundles of {_fmt(rank)}"
    if bundles[0] != rank:
        text += f", the first with the replica's own {_fmt(dict(p.replica_resources))}"
    return text
