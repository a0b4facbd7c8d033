"""Prefix-cache-aware routing: Ballast with Serve's power of two choices, Ballast with prefix
affinity, and plain ray.serve.llm with its own prefix-aware router, side by side on the same
vLLM engine, model and KV cache.

Rows, each in a Ray of its own, one after the other, each torn down after:

- ``ballast-p2c``: Ballast (the config's app, ``model.backend: vllm`` on ``--vllm-model``) with
  2 model replicas and 2 router replicas, ``model.routing.prefix_affinity: false``: Serve's
  power of two choices;
- ``ballast-affinity``: the same with ``model.routing.prefix_affinity: true``; every tenant in a
  prefix-cache group of its own (the default: no tenant can time another's prefixes);
- ``ballast-one-group``: ``ballast-affinity`` with every bench tenant in one cache group
  (``tenants.<name>.cache_group``): what isolation costs is the difference between the two;
- ``serve-llm-prefix``: plain ``ray.serve.llm`` (``build_openai_app``) on the same directory and
  engine settings: 2 ``LLMServer`` replicas routed by ``PrefixCacheAffinityRouter``
  (``ray.serve.llm.request_router``, the LLMConfig's ``deployment_config``
  ``request_router_config``, its defaults) behind its OpenAI ingress with 2 replicas, so that
  a request passes two routers as in Ballast.

Engine, every row: ``PREFIX_ENGINE_KWARGS`` (float32, eager, the demo model's 1024-token context,
prefix caching, 32-token blocks: the CPU build takes multiples of 32), ``--kv-blocks`` KV blocks
per replica (``num_gpu_blocks_override``; by default ``KV_SHARE`` of the workload's working set, so
that the working set is 1.67x one replica's cache), and Ballast's ``max_num_seqs`` and
``kv_cache_memory_bytes`` (``default_engine_kwargs``: vLLM's CPU default, 0.92 of the host's
memory, is refused on a host that runs anything else).

Workload (``WorkloadSpec``, seeded; the same requests for every row): ``TENANTS`` tenants, each
with a system prompt of its own (``system_words`` words of the demo tokenizer's corpus, about 620
tokens), after ``--common-words`` words every tenant's starts with (default 0: tenants share
nothing; a shared preamble is the sharing that cache isolation gives up); per tenant
``--users-per-tenant`` closed-loop users, each in a conversation of ``--turns`` turns and pausing
``--think-ms`` after each answer (default ``THINK_MS``: light enough that
Ballast stays at level 0-1 here, so that TTFT reads prefill and scheduling more than a queue;
0: back to back). A turn's messages are the system prompt, every earlier turn (its user
message and the answer the model gave: a chat client resends its history) and a new user message;
after the last turn a new conversation starts with the same system prompt. The working set
(``working_set_blocks``) and the hit rate a perfect router with an unbounded cache would get
(``hit_ceiling``) are printed first, counted with the model's tokenizer and chat template.

Requests go to ``POST /v1/chat/completions``: both fronts render the model's own chat template
(ray.serve.llm through vLLM, Ballast through the tokenizer), which is what a chat client relies
on; each row prints the prompt tokens its answers reported (``stream_options.include_usage``) and
tenant 0's first turn, so a difference in rendering would show. Streamed, greedy,
``--max-tokens`` with ``ignore_eos`` (every answer the same length). Ballast gets one API key per
tenant; ray.serve.llm the same bodies with no key. A refused or failed turn is sent again after
``RETRY_PAUSE_S`` (the conversation goes on only with an answer). Loopback only.

Per row: start the stack and wait for it to answer; warm up (``--warmup-s``, the users starting
staggered over its first half); let every user finish its turn, Ballast step down to level 0
(``settle_level``: the warm-up's cold start raises it, and it steps down one level a stable
window) and the counters settle (``read_settled``), read them; run the users for ``--duration-s``,
their first turns spread over one think time (not a burst of every user at once), a turn started
in the span running to its end (each bounded by ``CLIENT_TIMEOUT_S``); settle and read again.
Conversations carry on from the warm-up into the span, the caches warm; the counters' difference
covers exactly the span's requests.

Figures per row (``Figures``):

- ``hit``: prompt tokens found in vLLM's prefix cache over the prompt tokens looked up, summed
  over the replicas, over the span: vLLM's own cumulative counters, read before and after.
  Ballast: ``GET /admin/replicas`` (the controller's ``replica_status`` rows, the model
  deployment's, ``prefix_cache_queries`` / ``prefix_cache_hits``); ray.serve.llm: its engines'
  metrics (``log_engine_metrics``) in Ray's Prometheus export on ``METRICS_PORT``,
  ``ray_vllm_prefix_cache_queries_total`` / ``ray_vllm_prefix_cache_hits_total`` by ``ReplicaId``;
- ``ttft_p50_ms`` / ``ttft_p99_ms``: client side, from the send to the first chunk with content,
  over the span's complete 200 answers;
- ``slo_rps``: the span's complete 200 answers (``[DONE]`` seen, text received) whose TTFT was
  within ``--ttft-slo-ms``, per second of ``--duration-s``;
- ``max_over_mean``: the replica given the most prefill work (its prompt tokens looked up: its
  queries counter's difference) over the replicas' mean.

Beside them: answers per second, the prompt tokens per answer as the stack reported them, errors
by code, each replica's queries; for Ballast its route decisions in the span by reason
(``ballast_route_decisions_total``: prefix, home, balance) and its degradation level (its
``/v1/status`` every 0.5 s: from ``model.routing.balance_from_level`` up it routes by load alone,
and at a level whose settings turn streaming off the first content comes with the whole answer,
which TTFT then measures). Every row's Ray exports its metrics on ``METRICS_PORT`` (Ray's default
interval, 10 s: a settled read waits ``METRICS_QUIET_S`` without a change).

A figure whose counters could not be read prints as ``nan``, with the reason in the table. The
report ends with the targets (informational) and one line per row a script can read::

    ballast-p2c: hit=<ratio> ttft_p50_ms=<n> ttft_p99_ms=<n> slo_rps=<n> max_over_mean=<x>

A row whose stack fails to start or to run says so in the table; the others still run and print,
and the exit status is then 1. Run: ``make bench-prefix`` (``ARGS=--rows ballast-p2c,serve-llm-prefix``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from loadtest.bench_router import _pct
from loadtest.lean_http import LeanClient, LeanHttpError, install_uvloop

ROWS = ("ballast-p2c", "ballast-affinity", "ballast-one-group", "serve-llm-prefix")
PREFIX_AFFINITY = {"ballast-p2c": False, "ballast-affinity": True, "ballast-one-group": True}  # Ballast rows' routing
ONE_GROUP = "bench-all"  # ballast-one-group's cache group, every bench tenant's
MODEL_REPLICAS = 2
ROUTER_REPLICAS = 2  # Ballast's routers; ray.serve.llm's OpenAI ingress replicas
TENANTS = 16
BLOCK_SIZE = 32  # tokens per KV block: vLLM's CPU build takes multiples of 32
CONTEXT = 1024  # the demo model's context (max_position_embeddings)
PREFIX_ENGINE_KWARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": CONTEXT,
    "enable_prefix_caching": True,
    "block_size": BLOCK_SIZE,
}
METRICS_PORT = 8139  # Ray's Prometheus export (ray.init's _metrics_export_port)
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
PREFIX_ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
VLLM_QUERIES = "ray_vllm_prefix_cache_queries"  # vLLM's vllm:prefix_cache_queries through Ray's metrics
VLLM_HITS = "ray_vllm_prefix_cache_hits"
ROUTE_DECISIONS = "ray_ballast_route_decisions"  # Ballast's ballast_route_decisions_total{model, reason}
LLM_NUM_CPUS = 16  # logical, for ray.serve.llm's placement groups and ingress
CLIENT_TIMEOUT_S = 30.0  # the longest one request is waited for
RETRY_PAUSE_S = 0.5  # a user's pause after a refused or failed turn
THINK_MS = 8000.0  # a user's pause after an answer: Ballast stays at level 0-1 here (3 s raised it to 2-3: issue 47)
KV_SHARE = 0.6  # one replica's KV cache over the working set (the working set is 1/0.6 = 1.67x one cache)
READY_MAX_S = 300.0  # the longest a stack is waited for after its deploy returned
SETTLE_MAX_S = 60.0  # the longest read_settled waits for the counters to stop moving
LEVEL_SETTLE_MAX_S = 150.0  # the longest Ballast is given to step down to level 0 before the span
BALLAST_QUIET_S = 2.0  # replicas report every 0.5 s
METRICS_QUIET_S = 12.0  # Ray's workers push their metrics every 10 s (its metrics_report_interval_ms)


# -- the workload: pure and seeded ---------------------------------------------------------------
def _corpus_words() -> tuple[str, ...]:
    """The demo tokenizer's corpus, as lower-case words: text it encodes in few tokens."""
    from ballast.model.demo import CORPUS

    return tuple(sorted({w.lower() for w in re.findall(r"[A-Za-z]+", " ".join(CORPUS))}))


WORDS = _corpus_words()


@dataclass(frozen=True)
class WorkloadSpec:
    """The conversations every row is sent; the same ``seed`` gives the same texts."""

    tenants: int = TENANTS
    users_per_tenant: int = 2
    turns: int = 3  # per conversation, then a new one
    system_words: int = 240  # ~620 tokens of the demo tokenizer
    user_words: int = 14  # ~40 tokens
    seed: int = 7
    common_words: int = 0  # a preamble every tenant's system prompt starts with

    def __post_init__(self) -> None:
        for name in ("tenants", "users_per_tenant", "turns", "system_words", "user_words"):
            if not 1 <= getattr(self, name) <= 4096:
                raise ValueError(f"{name}: 1 to 4096, got {getattr(self, name)!r}")
        if not 0 <= self.common_words <= 4096:
            raise ValueError(f"common_words: 0 to 4096, got {self.common_words!r}")

    def words(self, key: str, n: int) -> str:
        """``n`` words drawn by a generator seeded with ``seed`` and ``key`` (str seeds hash stably)."""
        rng = random.Random(f"{self.seed}:{key}")
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def system_prompt(self, tenant: int) -> str:
        """Tenant ``tenant``'s system prompt: the common preamble (if any), then words that
        differ from every other tenant's from their first."""
        common = self.words("common", self.common_words) + " " if self.common_words else ""
        return common + f"Tenant {tenant} rules. " + self.words(f"system:{tenant}", self.system_words)

    def user_message(self, tenant: int, user: int, conversation: int, turn: int) -> str:
        key = f"user:{tenant}:{user}:{conversation}:{turn}"
        return f"Question {turn + 1}. " + self.words(key, self.user_words)


@dataclass
class Conversation:
    """One user's conversation: the turns answered so far and the next user message.

    ``messages`` is what a chat client sends: the system prompt, every earlier turn as it was
    (user message, the model's answer) and the next user message; ``answered`` records the
    answer and moves on, to a new conversation (``index`` + 1) after the last turn."""

    spec: WorkloadSpec
    tenant: int
    user: int
    index: int = 0
    history: list[tuple[str, str]] = field(default_factory=list)  # (user message, answer)

    def next_user_message(self) -> str:
        return self.spec.user_message(self.tenant, self.user, self.index, len(self.history))

    def messages(self) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.spec.system_prompt(self.tenant)}]
        for asked, answer in self.history:
            out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": self.next_user_message()}]

    def answered(self, answer: str) -> None:
        self.history.append((self.next_user_message(), answer))
        if len(self.history) == self.spec.turns:
            self.index, self.history = self.index + 1, []


def conversations(spec: WorkloadSpec) -> list[Conversation]:
    """Every user's conversation, tenant by tenant."""
    return [Conversation(spec, t, u) for t in range(spec.tenants) for u in range(spec.users_per_tenant)]


def working_set_blocks(
    spec: WorkloadSpec, count: Callable[[list[dict[str, str]]], int], answer_tokens: int, block_size: int
) -> float:
    """The KV blocks of reusable prefixes live at once, over all replicas.

    Per tenant, the full blocks of its system prompt (shared by its users); per user, the full
    blocks of its conversation beyond them, averaged over the turns (a user is at any turn
    alike). A turn's prompt is ``count(messages)`` (the rendered chat, answers empty) plus
    ``answer_tokens`` per earlier answer; conversation 0 of user 0 stands for every user."""
    total = 0.0
    for tenant in range(spec.tenants):
        conv = Conversation(spec, tenant, 0)
        shared = count(conv.messages()[:1]) // block_size
        private = []
        for turn in range(spec.turns):
            tokens = count(conv.messages()) + turn * answer_tokens
            private.append(tokens // block_size - shared)
            conv.answered("")
        total += shared + spec.users_per_tenant * sum(private) / len(private)
    return total


def hit_ceiling(
    spec: WorkloadSpec, count: Callable[[list[dict[str, str]]], int], answer_tokens: int, block_size: int
) -> float:
    """The hit rate with a cache that never evicts and every turn on the replica of its last:
    the first turn finds its system prompt's full blocks, each later turn the full blocks of the
    turn before's prompt (its answer not counted: vLLM caches the tokens it generated, which the
    answer's text need not tokenize back to). Prompts as in ``working_set_blocks``."""
    found = looked_up = 0
    for tenant in range(spec.tenants):
        conv = Conversation(spec, tenant, 0)
        cached = count(conv.messages()[:1])
        for turn in range(spec.turns):
            tokens = count(conv.messages()) + turn * answer_tokens
            found += cached // block_size * block_size
            looked_up += tokens
            cached = tokens
            conv.answered("")
    return found / looked_up


def default_kv_blocks(working_set: float, context: int, block_size: int, share: float = KV_SHARE) -> int:
    """One replica's KV blocks: ``share`` of the working set, at least one full context and a block.

    Not half: vLLM evicts least recently freed blocks first, and each answer leaves blocks of
    generated tokens that no later prompt matches, so a replica whose cache is exactly its half
    of the working set thrashes even when every tenant stays on one replica (a simulation of
    vLLM's free queue with tenants split by an oracle found 0.67 of the prompt tokens at 0.5,
    0.84 at 0.6, of a ceiling of 0.88)."""
    return max(math.ceil(working_set * share), -(-context // block_size) + 1)


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy chat request of exactly ``max_tokens`` tokens (vLLM's ``ignore_eos``),
    its usage in a last chunk."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# -- one streamed answer -------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """One turn as the client saw it; ``status`` 0: no HTTP answer."""

    sent_s: float
    status: int
    code: str  # "OK", the server's error code, or why a 200 does not count
    ttft_ms: float | None = None
    prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.code == "OK"


class StreamAnswer:
    """An OpenAI chat stream read as it arrives (``feed``, each piece with its arrival time):
    server-sent events ``data: {chunk}`` up to ``data: [DONE]``. Keeps the time of the first
    chunk with content, the text, the usage's prompt tokens and any error event."""

    def __init__(self) -> None:
        self._buf = b""
        self._parts: list[str] = []
        self.first_content_s: float | None = None
        self.prompt_tokens: int | None = None
        self.done = False
        self.error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, data: bytes, now_s: float) -> None:
        """The events that ``data`` completes (a blank line ends each); the rest waits for more."""
        *events, self._buf = (self._buf + data).replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.decode("utf-8", "replace").split("\n"):
                if line.startswith("data:"):
                    self._data(line[5:].strip(), now_s)

    def _data(self, payload: str, now_s: float) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.error = "malformed_event"
            return
        if not isinstance(chunk, dict):
            self.error = "malformed_event"
            return
        if chunk.get("error") is not None:
            err = chunk["error"]
            self.error = str(err.get("code") or err.get("type") or "error") if isinstance(err, dict) else "error"
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        for choice in chunk.get("choices") or ():
            content = ((choice or {}).get("delta") or {}).get("content")
            if isinstance(content, str) and content:
                if self.first_content_s is None:
                    self.first_content_s = now_s
                self._parts.append(content)

    def outcome(self, sent_s: float, status: int, body: bytes) -> Outcome:
        """The turn's outcome: a 200 counts only complete (``[DONE]``, text, no error event);
        other statuses by the error code in their body."""
        if status != 200:
            return Outcome(sent_s, status, _error_code(body, status))
        code = self.error or ("OK" if self.done and self.first_content_s is not None else "incomplete")
        ttft = None if self.first_content_s is None else (self.first_content_s - sent_s) * 1000.0
        return Outcome(sent_s, status, code, ttft, self.prompt_tokens)


def _error_code(body: bytes, status: int) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, TypeError, KeyError):
        return f"HTTP_{status}"


# -- figures: pure ---------------------------------------------------------------------------------
Counters = dict[str, tuple[int, int]]  # replica -> (prompt tokens looked up, found) since it started


def counter_deltas(before: Counters, after: Counters) -> Counters:
    """Each replica's (queries, hits) over the span; a replica first seen after it counts from 0."""
    return {r: (q - before.get(r, (0, 0))[0], h - before.get(r, (0, 0))[1]) for r, (q, h) in after.items()}


def hit_ratio(deltas: Counters) -> float:
    """Hits over queries, summed over the replicas; nan with no query."""
    queries = sum(q for q, _ in deltas.values())
    return sum(h for _, h in deltas.values()) / queries if queries > 0 else float("nan")


def max_over_mean(deltas: Counters) -> float:
    """The largest replica's queries over the replicas' mean; nan with no query."""
    queries = [q for q, _ in deltas.values()]
    mean = sum(queries) / len(queries) if queries else 0.0
    return max(queries) / mean if mean > 0 else float("nan")


@dataclass(frozen=True)
class Figures:
    hit_ratio: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    slo_rps: float
    max_over_mean: float


@dataclass
class RowResult:
    """One row's span: its outcomes and counter differences; ``error`` where it did not run."""

    name: str
    duration_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    deltas: Counters | None = None  # None: the counters could not be read
    note: str = ""  # why a figure is missing, or what else the run showed
    levels: dict[int, int] = field(default_factory=dict)  # Ballast: /v1/status samples at each level
    reasons: dict[str, tuple[int, str]] = field(default_factory=dict)  # its level's reason: kind -> (samples, last)
    routes: dict[str, int] | None = None  # Ballast: its route decisions in the span, by reason
    error: str | None = None

    @property
    def max_level(self) -> int | None:
        return max(self.levels) if self.levels else None

    def ttfts_ms(self) -> list[float]:
        return [o.ttft_ms for o in self.outcomes if o.ok and o.ttft_ms is not None]

    def figures(self, ttft_slo_ms: float) -> Figures:
        nan = float("nan")
        if self.error is not None:
            return Figures(nan, nan, nan, nan, nan)
        ttfts = self.ttfts_ms()
        good = sum(1 for t in ttfts if t <= ttft_slo_ms)
        deltas = self.deltas or {}
        return Figures(
            hit_ratio(deltas),
            _pct(ttfts, 0.5),
            _pct(ttfts, 0.99),
            good / self.duration_s if self.duration_s > 0 else nan,
            max_over_mean(deltas),
        )


def summary_line(name: str, f: Figures) -> str:
    """The row's line for scripts: ratios to 3 decimals, milliseconds whole, slo_rps to 2."""
    return (
        f"{name}: hit={f.hit_ratio:.3f} ttft_p50_ms={f.ttft_p50_ms:.0f} ttft_p99_ms={f.ttft_p99_ms:.0f} "
        f"slo_rps={f.slo_rps:.2f} max_over_mean={f.max_over_mean:.3f}"
    )


HIT_TARGET = 0.8
HIT_OVER_P2C_TARGET = 1.5
TTFT_P50_OVER_P2C_TARGET = 0.6
MAX_OVER_MEAN_TARGET = 1.3
# Isolation (a cache group per tenant) against every tenant in one group: on a workload whose
# tenants share no prefix, within the run-to-run spread of the hit rate and of TTFT p50.
ISOLATION_HIT_GAP = 0.05
ISOLATION_TTFT_P50_RATIO = 1.15


def _target(
    what: str,
    rows: tuple[Figures | None, ...],
    values: Callable[[], list[float]],
    met: Callable[[list[float]], bool],
    detail: Callable[[list[float]], str],
) -> tuple[str, bool | None, str]:
    """One target: met or not; None where a row did not run or a figure is nan (not measured)."""
    if any(r is None for r in rows):
        return what, None, "row not run"
    v = values()
    if any(x != x for x in v):
        return what, None, "not measured: " + detail(v)
    return what, met(v), detail(v)


def target_checks(figs: dict[str, Figures]) -> list[tuple[str, bool | None, str]]:
    """ballast-affinity's targets against ballast-p2c, ballast-one-group and serve-llm-prefix:
    (target, met, figures)."""
    a, p2c, llm = figs.get("ballast-affinity"), figs.get("ballast-p2c"), figs.get("serve-llm-prefix")
    one = figs.get("ballast-one-group")
    return [
        _target(
            f"hit >= {HIT_TARGET}",
            (a,),
            lambda: [a.hit_ratio],
            lambda v: v[0] >= HIT_TARGET,
            lambda v: f"{v[0]:.3f}",
        ),
        _target(
            f"hit >= {HIT_OVER_P2C_TARGET} x ballast-p2c's",
            (a, p2c),
            lambda: [a.hit_ratio, p2c.hit_ratio],
            lambda v: v[0] >= HIT_OVER_P2C_TARGET * v[1],
            lambda v: f"{v[0]:.3f} vs {v[1]:.3f}",
        ),
        _target(
            f"TTFT p50 <= {TTFT_P50_OVER_P2C_TARGET} x ballast-p2c's",
            (a, p2c),
            lambda: [a.ttft_p50_ms, p2c.ttft_p50_ms],
            lambda v: v[0] <= TTFT_P50_OVER_P2C_TARGET * v[1],
            lambda v: f"{v[0]:.0f} ms vs {v[1]:.0f} ms",
        ),
        _target(
            "ahead of serve-llm-prefix on hit rate and TTFT p99",
            (a, llm),
            lambda: [a.hit_ratio, llm.hit_ratio, a.ttft_p99_ms, llm.ttft_p99_ms],
            lambda v: v[0] > v[1] and v[2] < v[3],
            lambda v: f"hit {v[0]:.3f} vs {v[1]:.3f}; TTFT p99 {v[2]:.0f} ms vs {v[3]:.0f} ms",
        ),
        _target(
            f"isolation: hit >= ballast-one-group's - {ISOLATION_HIT_GAP} and TTFT p50 <= "
            f"{ISOLATION_TTFT_P50_RATIO} x its (tenants sharing no prefix)",
            (a, one),
            lambda: [a.hit_ratio, one.hit_ratio, a.ttft_p50_ms, one.ttft_p50_ms],
            lambda v: v[0] >= v[1] - ISOLATION_HIT_GAP and v[2] <= ISOLATION_TTFT_P50_RATIO * v[3],
            lambda v: f"hit {v[0]:.3f} vs {v[1]:.3f}; TTFT p50 {v[2]:.0f} ms vs {v[3]:.0f} ms",
        ),
        _target(
            f"max_over_mean <= {MAX_OVER_MEAN_TARGET}",
            (a,),
            lambda: [a.max_over_mean],
            lambda v: v[0] <= MAX_OVER_MEAN_TARGET,
            lambda v: f"{v[0]:.3f}",
        ),
    ]


# -- the counters: parsed here, read over HTTP ------------------------------------------------------
def ballast_counters(doc: Any, deployment: str) -> Counters:
    """vLLM's counters in Ballast's ``GET /admin/replicas`` answer: the ``replicas`` rows of
    ``deployment`` (the model's) that carry them."""
    out: Counters = {}
    for row in (doc or {}).get("replicas") or ():
        if row.get("deployment") == deployment and row.get("prefix_cache_queries") is not None:
            out[str(row["replica_id"])] = (int(row["prefix_cache_queries"]), int(row.get("prefix_cache_hits") or 0))
    return out


def prometheus_counters(text: str, queries: str = VLLM_QUERIES, hits: str = VLLM_HITS) -> Counters:
    """Counters ``queries`` and ``hits`` per ``ReplicaId`` label in a Prometheus text export (a
    name matches with or without ``_total``; samples differing in other labels are summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in (queries, hits):
                pair = sums.setdefault(sample.labels.get("ReplicaId", ""), [0.0, 0.0])
                pair[0 if name == queries else 1] += sample.value
    return {replica: (int(q), int(h)) for replica, (q, h) in sums.items()}


def counter_series(text: str, names: tuple[str, ...] = (VLLM_QUERIES, VLLM_HITS)) -> list[str]:
    """The series of ``names`` in a Prometheus text export as ``sample_name{label,...}`` (label
    names only): what the counters were found as."""
    from prometheus_client.parser import text_string_to_metric_families

    found = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.removesuffix("_total") in names:
                found.add(f"{sample.name}{{{','.join(sorted(sample.labels))}}}")
    return sorted(found)


def route_counts(text: str, model: str, name: str = ROUTE_DECISIONS) -> dict[str, int]:
    """Ballast's route decisions for ``model`` by ``reason`` in a Prometheus text export, summed
    over its routers (a name matches with or without ``_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.removesuffix("_total") == name and sample.labels.get("model") == model:
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0) + int(sample.value)
    return out


Reader = Callable[[], Awaitable[Any | None]]  # None: the read failed


async def read_settled(
    read: Reader,
    quiet_s: float,
    max_s: float = SETTLE_MAX_S,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> Any | None:
    """``read()`` every ``poll_s`` until it has not changed for ``quiet_s`` (the replicas' last
    reports are in), at most ``max_s``; the last read. A failed read (None) restarts the wait."""
    start = since = clock()
    last = await read()
    while clock() - start < max_s:
        await sleep(poll_s)
        now = await read()
        if now is None or now != last:
            last, since = now, clock()
        elif clock() - since >= quiet_s:
            break
    return last


def http_reader(url: str, headers: dict[str, str], parse: Callable[[Any], Any], as_json: bool) -> Reader:
    """A reader of ``url``: its answer (JSON or text) through ``parse``; None where it failed."""
    import httpx

    async def read() -> Any | None:
        try:
            async with httpx.AsyncClient(timeout=5.0) as c:
                r = await c.get(url, headers=headers)
                r.raise_for_status()
                return parse(r.json() if as_json else r.text)
        except (httpx.HTTPError, ValueError):
            return None

    return read


# -- the users -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where a row's chat requests go; ``keys``: one API key per tenant (empty: none)."""

    host: str
    port: int
    path: str
    model: str
    keys: tuple[str, ...] = ()

    def headers(self, tenant: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"} if self.keys else {}


async def one_turn(
    client: LeanClient, target: Target, conv: Conversation, max_tokens: int, clock: Callable[[], float]
) -> tuple[Outcome, str]:
    """The conversation's next turn, streamed; its outcome and the answer's text."""
    answer = StreamAnswer()
    body = chat_body(target.model, conv.messages(), max_tokens)
    sent_s = clock()
    try:
        r = await client.post_json(
            target.path, body, target.headers(conv.tenant), on_chunk=lambda b: answer.feed(b, clock())
        )
    except LeanHttpError as e:
        return Outcome(sent_s, 0, e.kind), ""
    return answer.outcome(sent_s, r.status, r.body), answer.text


async def run_user(
    client: LeanClient,
    target: Target,
    conv: Conversation,
    until_s: float,
    max_tokens: int,
    into: list[Outcome],
    clock: Callable[[], float],
    start_delay_s: float = 0.0,
    think_s: float = 0.0,
) -> None:
    """A closed-loop user: turn after turn until ``until_s`` (the last one runs to its end); an
    answered turn moves the conversation on, a refused or failed one is sent again."""
    await asyncio.sleep(start_delay_s)
    while clock() < until_s:
        out, text = await one_turn(client, target, conv, max_tokens, clock)
        into.append(out)
        if out.ok:
            conv.answered(text)
        await asyncio.sleep(think_s if out.ok else RETRY_PAUSE_S)


async def drive(
    target: Target, convs: list[Conversation], seconds: float, max_tokens: int, stagger_s: float, think_s: float
) -> list[Outcome]:
    """Every user for ``seconds`` (user i starting ``i x stagger_s`` in), one connection each."""
    outcomes: list[Outcome] = []
    clock = time.perf_counter
    until_s = clock() + seconds
    async with LeanClient(target.host, target.port, max_connections=len(convs), timeout_s=CLIENT_TIMEOUT_S) as c:
        await asyncio.gather(
            *(
                run_user(c, target, conv, until_s, max_tokens, outcomes, clock, i * stagger_s, think_s)
                for i, conv in enumerate(convs)
            )
        )
    return outcomes


# -- the stacks ----------------------------------------------------------------------------------
def tenant_name(tenant: int) -> str:
    return f"prefix-{tenant:02d}"


def tenant_key(tenant: int) -> str:
    return f"bench-key-prefix-{tenant:02d}"


def prefix_engine_kwargs(model_dir: str, kv_blocks: int, rows: int) -> dict[str, Any]:
    """Every row's vLLM settings: ``PREFIX_ENGINE_KWARGS`` with ``kv_blocks`` KV blocks, and
    Ballast's defaults for ``rows`` requests (``max_num_seqs``, ``kv_cache_memory_bytes``)."""
    from ballast.model.vllm_engine import default_engine_kwargs

    return default_engine_kwargs(model_dir, {**PREFIX_ENGINE_KWARGS, "num_gpu_blocks_override": kv_blocks}, rows)


def ballast_data(
    config_path: str,
    model_dir: str,
    engine_kwargs: dict[str, Any] | None,
    prefix_affinity: bool,
    tenants: int,
    one_group: bool = False,
) -> dict[str, Any]:
    """The config at ``config_path`` as the overload benchmark takes it (``bench_data``), its
    first model ``model_dir`` on vLLM with ``engine_kwargs``, ``MODEL_REPLICAS`` fixed replicas,
    ``ROUTER_REPLICAS`` routers, ``prefix_affinity``, no fallback model (a third model process on
    the host; ray.serve.llm has none) and one quota-free tenant and key per bench tenant, each in
    a cache group of its own or, ``one_group``, all in ``ONE_GROUP``."""
    from ballast.config import with_model_dir
    from loadtest.bench_overload import VLLM_RSS_LIMIT_MB, bench_data

    data = with_model_dir(bench_data(config_path, MODEL_REPLICAS), model_dir, "vllm")
    data["fallback"] = None
    data.setdefault("watchdog", {})["rss_limit_mb"] = VLLM_RSS_LIMIT_MB
    data["deployments"].setdefault("router", {})["num_replicas"] = ROUTER_REPLICAS
    model = data["model"] if "model" in data else data["models"][0]
    if engine_kwargs is not None:
        model["engine_kwargs"] = dict(engine_kwargs)
    model["routing"] = {**(model.get("routing") or {}), "prefix_affinity": prefix_affinity}
    for t in range(tenants):
        data["tenants"][tenant_name(t)] = {"description": "prefix benchmark tenant", "max_concurrent": 100000}
        if one_group:
            data["tenants"][tenant_name(t)]["cache_group"] = ONE_GROUP
        data["auth"]["demo_keys"][tenant_key(t)] = tenant_name(t)
    return data


def serve_llm_app(model_id: str, model_dir: str, engine_kwargs: dict[str, Any]) -> Any:
    """Plain ``ray.serve.llm``: ``MODEL_REPLICAS`` LLM servers on ``engine_kwargs``, routed by its
    ``PrefixCacheAffinityRouter`` (its defaults), engine metrics on, behind ``ROUTER_REPLICAS``
    OpenAI ingress replicas."""
    from ray.serve.llm import LLMConfig, build_openai_app

    llm_config = LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_dir},
        accelerator_type=None,
        engine_kwargs=dict(engine_kwargs),
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={
            "num_replicas": MODEL_REPLICAS,
            "request_router_config": {"request_router_class": PREFIX_ROUTER},
        },
        log_engine_metrics=True,
    )
    return build_openai_app(
        {"llm_configs": [llm_config], "ingress_deployment_config": {"num_replicas": ROUTER_REPLICAS}}
    )


@dataclass(frozen=True)
class Plan:
    """The run, fixed before any stack starts: the workload, the engine and the Ballast configs."""

    args: argparse.Namespace
    spec: WorkloadSpec
    model_name: str
    model_dir: str
    engine_kwargs: dict[str, Any]
    working_set_blocks: float
    hit_ceiling_ratio: float
    kv_blocks: int
    ballast_cfgs: dict[str, Any]  # per Ballast row


def chat_token_counter(model_dir: str) -> Callable[[list[dict[str, str]]], int]:
    """The prompt tokens of a chat as vLLM counts them: the model's template rendered (the
    assistant's turn opened after a user message), then tokenized without special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def count(messages: list[dict[str, str]]) -> int:
        opened = messages[-1]["role"] == "user"
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


def make_plan(args: argparse.Namespace) -> Plan:
    """The workload and its working set, the KV size (``--kv-blocks`` or half the working set),
    the engine settings and each Ballast row's config, validated."""
    from ballast.config import load_config

    spec = WorkloadSpec(
        users_per_tenant=args.users_per_tenant, turns=args.turns, seed=args.seed, common_words=args.common_words
    )
    count = chat_token_counter(args.vllm_model)
    ws = working_set_blocks(spec, count, args.max_tokens, BLOCK_SIZE)
    ceiling = hit_ceiling(spec, count, args.max_tokens, BLOCK_SIZE)
    kv = args.kv_blocks or default_kv_blocks(ws, CONTEXT, BLOCK_SIZE)
    base = load_config(ballast_data(args.config, args.vllm_model, None, False, spec.tenants)).model
    kwargs = prefix_engine_kwargs(str(base.path), kv, base.max_batch_size)
    cfgs = {
        row: load_config(
            ballast_data(args.config, args.vllm_model, kwargs, affinity, spec.tenants, row == "ballast-one-group")
        )
        for row, affinity in PREFIX_AFFINITY.items()
    }
    return Plan(args, spec, base.name, str(base.path), kwargs, ws, ceiling, kv, cfgs)


@dataclass(frozen=True)
class Probe:
    """A running row: where its users send, and how its vLLM counters are read."""

    target: Target
    read: Reader
    quiet_s: float  # how long the counters must stay still to count as settled
    source: str  # where the counters come from, in words
    status_url: str | None = None  # Ballast's /v1/status, sampled for its level
    admin: dict[str, str] = field(default_factory=dict)
    routes: Reader | None = None  # Ballast's route decisions by reason, from Ray's metrics export


def _wait_ready(url: str, headers: dict[str, str], max_s: float = READY_MAX_S) -> None:
    """Until ``url`` answers 200, at most ``max_s``."""
    import httpx

    stop = time.monotonic() + max_s
    while time.monotonic() < stop:
        try:
            if httpx.get(url, headers=headers, timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not answer 200 within {max_s:g} s")


def _start_ballast(name: str, plan: Plan) -> Probe:
    from ballast.ops.app import start
    from loadtest.bench_overload import BASE, PORT

    cfg = plan.ballast_cfgs[name]
    start(cfg, "127.0.0.1", PORT)
    path = cfg.route_prefix.rstrip("/")
    _wait_ready(f"{BASE}{path}/healthz/ready", {})
    admin = {"Authorization": f"Bearer {cfg.auth.demo_admin_token}"}
    deployment = cfg.deployment_name(cfg.models[0].name)
    keys = tuple(tenant_key(t) for t in range(plan.spec.tenants))
    model = cfg.models[0].name
    return Probe(
        Target("127.0.0.1", PORT, f"{path}/v1/chat/completions", plan.model_name, keys),
        http_reader(f"{BASE}{path}/admin/replicas", admin, lambda d: ballast_counters(d, deployment), True),
        BALLAST_QUIET_S,
        "GET /admin/replicas",
        status_url=f"{BASE}{path}/v1/status",
        admin=admin,
        routes=http_reader(METRICS_URL, {}, lambda text: route_counts(text, model), False),
    )


def _start_serve_llm(plan: Plan) -> Probe:
    from ray import serve

    from loadtest.bench_overload import BASE, PORT

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(serve_llm_app(plan.model_name, plan.model_dir, plan.engine_kwargs), name="llm", route_prefix="/")
    _wait_ready(f"{BASE}/v1/models", {})
    return Probe(
        Target("127.0.0.1", PORT, "/v1/chat/completions", plan.model_name),
        http_reader(METRICS_URL, {}, prometheus_counters, False),
        METRICS_QUIET_S,
        f"Ray's metrics export ({METRICS_URL})",
    )


def _row_env(name: str, plan: Plan) -> None:
    """Ballast's rows: its configured ingress (ballast.router.ingress); ray.serve.llm: Serve's
    proxy and defaults, with Ray's workers at the normal CPU priority as in Ballast's rows."""
    from ballast.router.ingress import FAST_PATH_ENV, WORKER_NICENESS_ENV, ingress_env

    if name in PREFIX_AFFINITY:
        os.environ.update(ingress_env(plan.ballast_cfgs[name]))
        return
    for key in (*FAST_PATH_ENV, *ingress_env(next(iter(plan.ballast_cfgs.values())))):
        os.environ.pop(key, None)
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    os.environ.update(WORKER_NICENESS_ENV)


@contextmanager
def row_session(name: str, plan: Plan) -> Iterator[Probe]:
    """A Ray of the row's own with its stack started and answering; everything torn down after
    (the stack, Ray, the environment as it was)."""
    import ray

    saved = dict(os.environ)
    llm = name not in PREFIX_AFFINITY
    # Every row's Ray the same, with Ray's defaults: its metrics exported on METRICS_PORT (vLLM's
    # counters for ray.serve.llm, the route decisions for Ballast), pushed there every 10 s (a
    # shorter interval costs every process CPU on this host); ray.serve.llm's placement groups
    # need logical CPUs.
    extra: dict[str, Any] = {"_metrics_export_port": METRICS_PORT}
    if llm:
        extra["num_cpus"] = LLM_NUM_CPUS
    try:
        _row_env(name, plan)
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False, **extra)
        try:
            yield _start_serve_llm(plan) if llm else _start_ballast(name, plan)
        finally:
            try:
                _stop(name, plan)
            finally:
                ray.shutdown()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _stop(name: str, plan: Plan) -> None:
    from ray import serve

    from ballast.ops.app import shutdown

    if name in PREFIX_AFFINITY:
        shutdown(plan.ballast_cfgs[name])
    else:
        serve.shutdown()


# -- one row ---------------------------------------------------------------------------------------
async def measure(name: str, probe: Probe, plan: Plan) -> RowResult:
    """Warm up, settle and read the counters, run the span, settle and read them again."""
    from loadtest.bench_overload import one_model, sample_status

    args, convs = plan.args, conversations(plan.spec)
    think_s = args.think_ms / 1000.0
    stagger_s = args.warmup_s / 2 / len(convs)
    warm = await drive(probe.target, convs, args.warmup_s, args.max_tokens, stagger_s, think_s)
    print(f"  {name}: warm-up {sum(o.ok for o in warm)} answers, {_codes(warm)}", flush=True)
    print(f"  {name}: tenant 0's first turn: {await sample_turn(probe.target, plan)}", flush=True)
    if probe.status_url is not None:
        print(f"  {name}: {await settle_level(probe.status_url, probe.admin)}", flush=True)
    before = await read_settled(probe.read, probe.quiet_s)
    routes_before = await read_settled(probe.routes, METRICS_QUIET_S) if probe.routes else None
    trace: list[dict[str, Any]] = []
    sampled = sample_status(probe.status_url, probe.admin, trace, one_model) if probe.status_url else None
    sampler = asyncio.create_task(sampled) if sampled is not None else None
    try:
        # The users come back as from a pause each: spread over one think time, not all at once.
        outcomes = await drive(probe.target, convs, args.duration_s, args.max_tokens, think_s / len(convs), think_s)
    finally:
        if sampler is not None:
            sampler.cancel()
    after = await read_settled(probe.read, probe.quiet_s)
    routes_after = await read_settled(probe.routes, METRICS_QUIET_S) if probe.routes else None
    print(f"  {name}: in Ray's metrics export: {await _series(METRICS_URL) or 'none of ours'}", flush=True)
    result = RowResult(name, args.duration_s, outcomes)
    if before is None or not after:
        result.note = f"vLLM's prefix-cache counters not found in {probe.source}: hit and max_over_mean not measured"
    else:
        result.deltas = counter_deltas(before, after)
    result.levels, result.reasons = level_summary(trace)
    if routes_before is not None and routes_after:
        result.routes = {k: v - routes_before.get(k, 0) for k, v in routes_after.items()}
    return result


async def settle_level(url: str, admin: dict[str, str], max_s: float = LEVEL_SETTLE_MAX_S) -> str:
    """Wait, with no traffic, until Ballast's ``/v1/status`` says level 0 (it steps down one level a
    stable window), at most ``max_s``: the span starts from a stack at rest, as the overload
    benchmark's phases do, its caches as the warm-up left them. Says how it went."""
    import httpx

    from loadtest.bench_overload import one_model

    t0 = time.monotonic()
    level: Any = None
    async with httpx.AsyncClient(timeout=5.0) as c:
        while time.monotonic() - t0 < max_s:
            try:
                level = one_model((await c.get(url, headers=admin)).json()).get("level")
            except (httpx.HTTPError, ValueError, AttributeError):
                level = None
            if level == 0:
                return f"level 0 after {time.monotonic() - t0:.0f} s at rest"
            await asyncio.sleep(1.0)
    return f"still level {level} after {max_s:g} s at rest: the span starts there"


def level_summary(trace: list[dict[str, Any]]) -> tuple[dict[int, int], dict[str, tuple[int, str]]]:
    """Ballast's ``/v1/status`` samples (its one model's view, ``bench_overload.one_model``): how
    many at each level, and per kind of the controller's reason (its words without the numbers,
    ``reason_kind``) how many and the last in full."""
    from loadtest.bench_overload import reason_kind

    levels: dict[int, int] = {}
    reasons: dict[str, tuple[int, str]] = {}
    for t in trace:
        if isinstance(t.get("level"), int):
            levels[t["level"]] = levels.get(t["level"], 0) + 1
        reason = (t.get("controller") or {}).get("reason")
        if isinstance(reason, str):
            kind = reason_kind(reason) or reason
            reasons[kind] = (reasons.get(kind, (0, ""))[0] + 1, reason)
    return levels, reasons


async def sample_turn(target: Target, plan: Plan) -> str:
    """The first turn of tenant 0's first conversation, sent once more: the prompt tokens the stack
    reports and the answer's start, for the rows' renderings and answers to be compared."""
    async with LeanClient(target.host, target.port, max_connections=1, timeout_s=CLIENT_TIMEOUT_S) as c:
        out, text = await one_turn(c, target, Conversation(plan.spec, 0, 0), plan.args.max_tokens, time.perf_counter)
    return f"prompt_tokens={out.prompt_tokens}, answer {text[:40]!r}... ({out.code})"


async def _series(url: str) -> str:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5.0) as c:
            return ", ".join(counter_series((await c.get(url)).text, (VLLM_QUERIES, VLLM_HITS, ROUTE_DECISIONS)))
    except (httpx.HTTPError, ValueError) as e:
        return f"(not read: {e})"


def run_row(name: str, plan: Plan) -> RowResult:
    """The row in a Ray of its own; a stack that does not start or fails is a row saying so."""
    stage = "did not start"
    try:
        with row_session(name, plan) as probe:
            stage = "failed"
            print(f"  {name}: answering; counters from {probe.source}", flush=True)
            install_uvloop()
            try:
                return asyncio.run(measure(name, probe, plan))
            finally:
                asyncio.set_event_loop_policy(None)
    except Exception as e:  # noqa: BLE001 - one row's failure is reported, and the other rows still run
        return RowResult(name, error=f"{stage}: {type(e).__name__}: {e}"[:400])


# -- the report ------------------------------------------------------------------------------------
def _codes(outcomes: list[Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            counts[f"{o.status}:{o.code}"] = counts.get(f"{o.status}:{o.code}", 0) + 1
    return "errors " + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) if counts else "none")


def print_plan(plan: Plan) -> None:
    spec, ws = plan.spec, plan.working_set_blocks
    print(f"engine (every row, per replica): {plan.engine_kwargs}", flush=True)
    print(
        f"workload: {spec.tenants} tenants x {spec.users_per_tenant} users, {spec.turns} turns a conversation, "
        f"max_tokens {plan.args.max_tokens}, seed {spec.seed}; working set {ws:.0f} blocks of {BLOCK_SIZE} tokens; "
        f"KV cache {plan.kv_blocks} blocks per replica x {MODEL_REPLICAS} replicas "
        f"(working set / one replica's cache = {ws / plan.kv_blocks:.2f}); users pause {plan.args.think_ms:g} ms "
        f"after an answer; hit ceiling {plan.hit_ceiling_ratio:.3f} (a cache that never evicts, each turn on the "
        "replica of the turn before; answers not counted)",
        flush=True,
    )


def print_table(results: dict[str, RowResult], ttft_slo_ms: float) -> None:
    print(
        f"\n{'row':<17} {'answers':>7} {'ans/s':>6} {'hit':>6} {'p50 ms':>7} {'p99 ms':>7} {'slo_rps':>7} "
        f"{'max/mean':>8} {'prompt tok':>10} {'level':>5}  queries by replica; errors"
    )
    for name, r in results.items():
        if r.error is not None:
            print(f"{name:<17} {r.error}")
            continue
        f = r.figures(ttft_slo_ms)
        ok = [o for o in r.outcomes if o.ok]
        prompts = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
        per_replica = "/".join(str(q) for q, _ in sorted((r.deltas or {}).values(), reverse=True)) or "-"
        print(
            f"{name:<17} {len(ok):>7} {len(ok) / r.duration_s:>6.2f} {f.hit_ratio:>6.3f} {f.ttft_p50_ms:>7.0f} "
            f"{f.ttft_p99_ms:>7.0f} {f.slo_rps:>7.2f} {f.max_over_mean:>8.3f} "
            f"{(sum(prompts) / len(prompts) if prompts else float('nan')):>10.0f} "
            f"{'-' if r.max_level is None else r.max_level:>5}  {per_replica}; {_codes(r.outcomes)}"
        )
        if r.levels:
            n = sum(r.levels.values())
            shares = ", ".join(f"{lv}: {k / n:.0%}" for lv, k in sorted(r.levels.items()))
            print(f"{'':<17} Ballast's level over the span (its /v1/status every 0.5 s): {shares}")
        if r.routes:
            n = sum(r.routes.values())
            shares = ", ".join(f"{k} {v / n:.0%}" for k, v in sorted(r.routes.items(), key=lambda kv: -kv[1]) if v)
            print(f"{'':<17} routed in the span ({n}, ballast_route_decisions_total by reason): {shares}")
        total = sum(c for c, _ in r.reasons.values())
        for _, (k, last) in sorted(r.reasons.items(), key=lambda kv: -kv[1][0])[:3]:
            print(f"{'':<17} reason in {k / total:.0%} of the samples, the last: {last}")
        if r.note:
            print(f"{'':<17} {r.note}")
    print(
        f"answers: complete 200s in the span; hit: vLLM's prefix-cache hits / queries (prompt tokens) over the "
        f"span; p50/p99: TTFT, client side, to the first chunk with content; slo_rps: answers with TTFT <= "
        f"{ttft_slo_ms:g} ms per second; max/mean: the replica given the most prompt tokens over the mean; "
        f"prompt tok: per answer, as the stack reported it; level: Ballast's highest degradation level in the span"
    )


def print_targets(results: dict[str, RowResult], ttft_slo_ms: float) -> None:
    figs = {name: r.figures(ttft_slo_ms) for name, r in results.items() if r.error is None}
    print("\nballast-affinity: targets (informational)")
    for what, met, detail in target_checks(figs):
        print(f"  [{'-' if met is None else 'ok' if met else 'MISSED'}] {what}: {detail}")


def print_summary(results: dict[str, RowResult], ttft_slo_ms: float) -> None:
    """Last: one line per row, in ``ROWS`` order."""
    print()
    for name in ROWS:
        if name in results:
            print(summary_line(name, results[name].figures(ttft_slo_ms)), flush=True)


# -- the command line ------------------------------------------------------------------------------
def _rows(raw: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in ROWS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a comma-separated subset of {', '.join(ROWS)}, got {raw!r}")
    return tuple(n for n in ROWS if n in names)


def _bounded(kind: Callable[[str], Any], low: float, high: float) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{low:g} to {high:g}, got {raw!r}")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="cluster/local.yaml")
    p.add_argument("--vllm-model", default="models/demo", help="the Hugging Face directory (make demo-model)")
    p.add_argument("--rows", type=_rows, default=ROWS, help="comma-separated, of " + ", ".join(ROWS))
    p.add_argument("--duration-s", type=_bounded(float, 5, 1200), default=90.0, help="the measured span")
    p.add_argument("--warmup-s", type=_bounded(float, 0, 600), default=20.0)
    p.add_argument("--ttft-slo-ms", type=_bounded(float, 1, 60000), default=1000.0)
    p.add_argument("--kv-blocks", type=_bounded(int, 8, 1 << 20), default=None, help="per replica")
    p.add_argument("--users-per-tenant", type=_bounded(int, 1, 64), default=2)
    p.add_argument("--turns", type=_bounded(int, 1, 16), default=WorkloadSpec.turns, help="per conversation")
    p.add_argument("--max-tokens", type=_bounded(int, 1, 256), default=24)
    p.add_argument(
        "--think-ms",
        type=_bounded(float, 0, 60000),
        default=THINK_MS,
        help="a user's pause after an answer (0: back to back, every row saturated)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--common-words",
        type=_bounded(int, 0, 4096),
        default=0,
        help="a preamble every tenant's system prompt starts with (what isolation keeps apart)",
    )
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.vllm_model, "config.json")):
        p.error(f"--vllm-model: no config.json in {args.vllm_model!r} (make demo-model writes models/demo)")
    return args


def main(argv: list[str] | None = None) -> int:
    """The plan, each row in turn, then the table, the targets and the summary lines; 1 where a
    row did not run."""
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per counter read in Ray's log format
    plan = make_plan(args)
    print_plan(plan)
    results: dict[str, RowResult] = {}
    for name in args.rows:
        print(f"\n{name}: starting", flush=True)
        t0 = time.monotonic()
        results[name] = run_row(name, plan)
        print(f"  {name}: {results[name].error or 'done'} ({time.monotonic() - t0:.0f} s)", flush=True)
    print_table(results, args.ttft_slo_ms)
    print_targets(results, args.ttft_slo_ms)
    print_summary(results, args.ttft_slo_ms)
    return 1 if any(r.error is not None for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
