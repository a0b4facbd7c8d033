"""What each engine does itself, and how many rows it runs usefully: one module.

Three facts about engines, each written here once:

* **What an engine does itself** (``ENGINES``): one frozen :class:`Engine` per engine a
  config names (``model.backend``: ``builtin``, ``transformers``, ``vllm``): whether it
  schedules its own rows, reports its prefix cache's blocks, serves LoRA adapters, parses
  tool calls in the model's own format, and which call fields it honours beyond what
  every engine does (``ASKED_BY`` says which request fields ask for each). A default
  grants the least: an engine does none of these unless its row says so.
* **How many rows it runs usefully** (:class:`StepCurve`): the knee of its step time
  against the rows in a step, fitted once, where the engine's stats are read (the vLLM
  replica) and where the limit is set (``ballast.policies.limiter``).
* **What one router may send a model at once** (:func:`model_ceiling`): the model's
  replicas' slots, bounded by the rows its engines run usefully, this router's share.

Readers of the table: the fronts refuse a request field that asks for what a model's
engine cannot honour, with 400 naming it (``unhonoured_request_fields``); the resilient
caller keeps a call off any backend whose engine would ignore part of it (``honours``),
so a fallback model never answers a JSON-schema request with free text; the replica
leaves the KV cache to an engine that schedules itself and reads that engine's own stats,
reports the blocks of one that reports prefix events, and takes adapters only for one that
serves LoRA (``ballast.model.server``, through ``ballast.model.engine.serving_lora``,
``reporting_prefix`` and ``scheduling_itself``: an engine object is never asked what it has).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ballast.policies.validation import check_int, check_positive, check_ratio

# ------------------------------------------------------------------ what an engine does

#: The call fields (``ballast.model.protocol.ModelCall.asks``) that only some engines
#: honour, each with the request fields that ask for it and their neutral values (sent at
#: that value, a field asks for nothing), in the order the fronts check them. Every other
#: call field, every engine honours. ``adapter`` (a LoRA adapter, named by the request's
#: ``model``: the router resolves that field itself) is asked by no request field here;
#: ``chat_template`` is no call field: the router renders the chat through the model's own
#: template (the transformers and vLLM engines'), and the built-in one takes no variables.
ASKED_BY: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        field: MappingProxyType(asked)
        for field, asked in (
            ("repetition_penalty", {"repetition_penalty": 1.0}),
            ("presence_penalty", {"presence_penalty": 0}),
            ("frequency_penalty", {"frequency_penalty": 0}),
            ("logit_bias", {"logit_bias": None}),
            ("json_schema", {"response_format": None, "tools": None}),  # from response_format, forced tool calls
            ("structural_tag", {"tools": None}),  # tool calls in the model's own format
            ("keep_special_tokens", {"tools": None}),  # the tool parser reads the model's markers
            ("adapter", {}),
            ("chat_template", {"reasoning_effort": None, "chat_template_kwargs": None}),
        )
    }
)


@dataclass(frozen=True)
class Engine:
    """What one engine does itself; each field defaults to what grants the least.

    ``honours``: the call fields of ``ASKED_BY`` it honours. ``self_scheduling``: it batches
    and schedules the rows it holds (the replica only bounds how many are in it and leaves
    its KV cache to it; the gate's limit follows its ``StepCurve``). ``prefix_events``: it
    reports the blocks its prefix cache holds (KV events), for prefix-aware routing.
    ``lora``: it serves LoRA adapters. ``tool_parsing``: its parsers find tool calls and
    reasoning in the model's own format (``model.tool_parser``, ``model.reasoning_parser``)."""

    name: str
    honours: frozenset[str] = frozenset()
    self_scheduling: bool = False
    prefix_events: bool = False
    lora: bool = False
    tool_parsing: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(self.honours - ASKED_BY.keys())
        if unknown:
            raise ValueError(f"honours: {unknown} are not call fields that only some engines honour")


#: Every engine a config can name, by ``model.backend``.
ENGINES: Mapping[str, Engine] = MappingProxyType(
    {
        "builtin": Engine("builtin"),
        "transformers": Engine("transformers", honours=frozenset({"chat_template"})),
        "vllm": Engine(
            "vllm",
            honours=frozenset(ASKED_BY),
            self_scheduling=True,
            prefix_events=True,
            lora=True,
            tool_parsing=True,
        ),
    }
)


def capabilities(name: str) -> Engine:
    """The table's row for ``name``; ValueError naming the engines for any other name."""
    got = ENGINES.get(name)
    if got is None:
        raise ValueError(f"engine {name!r}: must be one of {sorted(ENGINES)}")
    return got


def honours(engine_name: str, asks: Iterable[str]) -> bool:
    """Whether the engine honours every call field in ``asks`` (``ModelCall.asks``)."""
    own = capabilities(engine_name).honours
    return all(f in own for f in asks if f in ASKED_BY)


@functools.cache  # a few engine names; read on every OpenAI request
def unhonoured_request_fields(engine_name: str) -> Mapping[str, Any]:
    """The request fields that ask for something the engine cannot honour, each with its
    neutral value, in ``ASKED_BY``'s order (each field once); read-only."""
    own = capabilities(engine_name).honours
    fields: dict[str, Any] = {}
    for call_field, asked in ASKED_BY.items():
        if call_field not in own:
            for name, neutral in asked.items():
                fields.setdefault(name, neutral)
    return MappingProxyType(fields)


# ------------------------------------------------------------- how many rows it runs usefully

MIN_WEIGHT = 50.0  # steps (decayed) before a fit is given
MIN_SPREAD = 1.0  # variance of the steps' rows: a fit needs rows that vary
DEFAULT_GAIN = 0.85  # the knee: where throughput reaches this share of its asymptote
MIN_ROWS = 4  # the knee is never put below this (by default): a noisy fit must not close the engine


class StepCurve:
    """How many rows an engine that schedules itself runs usefully, from its own steps; a
    decayed least-squares line through (rows, step time), bounded state (five sums).

    An engine such as vLLM batches every row it holds into each step. A step's time grows
    with the rows in it, ``step(rows) = a + b x rows``: ``a`` is what a step costs whatever
    its size (the weights read, the scheduler, the host's share of the CPU), ``b`` what each
    row adds. Each step makes one token per row, so the engine's throughput is
    ``rows / (a + b x rows)``: it rises steeply while ``a`` dominates and flattens toward
    ``1 / b``. Past the knee, more rows buy almost no throughput and every row's tokens come
    slower: the same answers per second, each one later.

    ``observe`` takes the steps the engine reports (rows running in the step and the step's
    time), older steps weighing less (``horizon`` steps), and ``rows`` gives where
    throughput reaches ``gain`` of its asymptote: ``rows / (a + b x rows) = gain / b`` at
    ``rows = gain / (1 - gain) x a / b``; with the default 0.85, 5.7 x a / b rows, where a
    step takes 6.7 x ``a``. The replica reports it; the routers' gates take no more rows
    than that to the engine (``model_ceiling``), and what does not fit waits at the gate in
    order of criticality, where a deadline can still be judged, instead of inside the
    engine, where every row slows every other.

    A host that is slower makes ``a`` and ``b`` larger together: the knee stays where the
    engine's shape puts it, not where a fixed latency threshold would. A fit is only given
    once the steps have spread over rows (``MIN_SPREAD``) and weigh ``min_weight``; a line
    whose rows cost nothing (``b <= 0``) gives no knee: more rows are free.
    """

    def __init__(
        self,
        horizon: int = 2000,
        gain: float = DEFAULT_GAIN,
        min_weight: float = MIN_WEIGHT,
        min_rows: int = MIN_ROWS,
    ) -> None:
        check_int("horizon", horizon, minimum=2)
        check_ratio("gain", gain)
        if gain == 1:  # the asymptote itself is never reached
            raise ValueError("gain: must be in (0, 1), got 1")
        check_int("min_rows", min_rows, minimum=1)
        check_positive("min_weight", min_weight)
        self._keep = 1.0 - 1.0 / horizon
        self._gain = gain
        self._min_weight = min_weight
        self._min_rows = min_rows
        self._w = self._r = self._rr = self._t = self._rt = 0.0

    def observe(self, rows: float, step_s: float) -> None:
        """One step of ``rows`` rows (a mean, where it varied) took ``step_s`` seconds."""
        if not (rows > 0 and math.isfinite(rows) and step_s > 0 and math.isfinite(step_s)):
            return
        k = self._keep
        self._w = self._w * k + 1.0
        self._r = self._r * k + rows
        self._rr = self._rr * k + rows * rows
        self._t = self._t * k + step_s
        self._rt = self._rt * k + rows * step_s

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds and seconds per row; None until the steps say enough."""
        if self._w < self._min_weight:
            return None
        mean_r, mean_t = self._r / self._w, self._t / self._w
        var = self._rr / self._w - mean_r * mean_r
        if var < MIN_SPREAD:
            return None
        b = (self._rt / self._w - mean_r * mean_t) / var
        return mean_t - b * mean_r, b

    def rows(self) -> int | None:
        """Rows at which throughput reaches ``gain`` of the asymptote (at least ``min_rows``);
        None without a fit, or where rows cost nothing."""
        got = self.fit()
        if got is None:
            return None
        a, b = got
        if b <= 0:
            return None
        knee = self._gain / (1.0 - self._gain) * max(a, 0.0) / b
        return max(self._min_rows, math.ceil(round(knee, 6))) if math.isfinite(knee) else None

    def snapshot(self) -> dict[str, float | None]:
        got = self.fit()
        return {
            "step_base_ms": round(1000.0 * got[0], 3) if got else None,
            "step_per_row_ms": round(1000.0 * got[1], 4) if got else None,
            "rows": self.rows(),
        }


# ------------------------------------------------------- what one router sends a model at once


def model_ceiling(
    model_replicas: int,
    router_replicas: int,
    max_ongoing_per_replica: int,
    share: float | None = None,
    engine_rows: int | None = None,
) -> int | None:
    """This router's share of what a model's replicas take at once (None: unknown yet).

    Replicas x ``max_ongoing_requests``, or fewer where the model's engines say they run
    fewer rows usefully (``engine_rows``, their ``StepCurve`` knees summed: more would buy
    no throughput, only slower answers), times ``share`` where the controller apportions the
    model among routers (fair shares), else split evenly among the routers it hears from;
    at least one each: a ceiling of 0 would close the gate for good.
    """
    if model_replicas <= 0:
        return None
    slots = model_replicas * max_ongoing_per_replica
    if engine_rows is not None:
        slots = max(1, min(slots, engine_rows))
    if share is not None:
        return max(1, int(slots * share))
    return max(1, slots // max(1, router_replicas))
