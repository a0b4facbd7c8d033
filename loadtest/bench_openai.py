"""The Responses API against chat, and embeddings against vLLM offline (``make bench-openai``).

Two sections, each in a Ray of its own, one after the other (``--sections``):

``ttft``: one Ballast stack, its primary model the ``--vllm-model`` directory on vLLM (one
replica, no fallback, the response cache off), the same prompt (``PROMPT``, one user message)
sent as a streamed chat completion and as a streamed Responses request (``store: false``:
chat keeps nothing either), greedy, the same token limit. TTFT, client side, from the send to
the first chat chunk whose delta has content, or to the first ``response.output_text.delta``
event; every stream is read to its end and checked (chat: ``[DONE]``, no error chunk;
Responses: ``response.created`` first, ``response.completed`` last, no ``response.failed``
or ``error``). The two kinds alternate on each client (``plan``), so that the machine's drift
hits both alike; at each ``--concurrency`` ``--requests`` of each kind, bounded by
``--max-phase-s``, after ``--warmup`` of each kind not counted. The prompt is the same every
time: vLLM's prefix cache holds it after the first, so TTFT is the path's and one decode
step's, where a difference between the two fronts shows most.

``embed``: one Ballast stack, its primary model the same directory as ``kind: embed`` on
vLLM's pooling runner (one replica, no fallback); ``--embed-requests`` requests of
``--inputs-per-request`` texts each (``embed_inputs``: ``--words`` words, about 32 tokens of
the demo tokenizer; distinct), ``--embed-concurrency`` in flight, ``encoding_format`` base64
(the openai client's default); inputs per second over the span from the first send to the
last answer, after one warm-up request. Then, once the stack is down (not both at once on a
small host), vLLM offline in a subprocess: ``vllm.LLM(model=dir, runner="pooling",
convert="embed", dtype float32, enforce_eager)`` with the replica's ``max_model_len``,
KV cache size (``vllm_args.default_engine_kwargs``) and ``max_num_seqs`` the rows the replica
holds (its own vLLM steps half: ``vllm_args.step_rows``), ``LLM.embed`` on
the same texts in one call (its documented best), after a warm-up call; inputs per second.
The vectors are compared input by input: cosine, and its minimum over the inputs; the tokens
each side counted are printed beside them, and the CPU seconds each side's processes took in
its span by role (``loadtest.stack_cpu``), with the seconds the engine waited for a core.

Where the engine computes (``--engine-cpu``): ``own`` (the default, on a host of two cores or
more) gives vLLM's worker the last core of this process's affinity on both sides
(``VLLM_CPU_OMP_THREADS_BIND``) and keeps everything else off it (this process, and so Ray and
every process either side starts, on the other cores), as a GPU host gives the engine a
device of its own: the figure is then the path's cost, not the host's. ``shared`` leaves the
placement to the kernel: on two cores the worker then shares its core with the router, the
replica, Serve's proxy and Ray's daemons (all of them Ballast's side only), and the ratio
reads how much of the engine's core they take.

Prints each section's table, then one line a script reads (``final_line``; ``nan`` for a
section not run)::

    openai: responses_ttft_p50_ratio=<x> responses_ttft_p99_ratio=<x> embed_throughput_ratio=<x> embed_min_cosine=<x>

The TTFT ratios are Responses over chat at the first ``--concurrency`` (target <= 1.1); the
throughput ratio is Ballast's over vLLM offline (target >= 0.9). A request Ballast refuses,
answers wrongly or fails ends the run with what was seen (``BenchFault``). Loopback only.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loadtest.engine_cores import ENGINE_CPU, engine_cpu

SECTIONS = ("ttft", "embed")
KINDS = ("chat", "responses")
PROMPT = "In two short sentences, say what a lighthouse keeper does on a stormy night."
WORDS = (
    "river stone cloud lamp garden signal copper window harbor meadow pencil thunder "
    "orchard lantern valley mirror engine canvas forest compass ribbon glacier violin saddle"
).split()
CLIENT_TIMEOUT_S = 60.0  # the longest one request is waited for: a run ends by itself
READY_TIMEOUT_S = 300.0  # a stack that is not ready by then fails the run
OFFLINE_TIMEOUT_S = 900.0  # vLLM offline: its start, the warm-up and the timed call
MAX_FAULT_BYTES = 300  # of an answer's body quoted in a fault
# The embeddings model's engine settings on both sides (as the other vLLM benches': float32,
# eager, a 512-token context); the rest is Ballast's (``vllm_args.default_engine_kwargs``).
EMBED_ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512}


class BenchFault(RuntimeError):
    """Ballast answered something the bench cannot count (a refusal, a wrong shape, a
    failed stream): what was sent and what came back."""

    def __init__(self, what: str, seen: str) -> None:
        super().__init__(what, seen)
        self.what, self.seen = what, seen

    def __str__(self) -> str:
        return f"{self.what}: {self.seen}"


# --- pure parts -----------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks
    (numpy's default, ``statistics.quantiles``' "inclusive"); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(num: float, den: float) -> float:
    """``num / den``; nan where either is nan or ``den`` is not positive."""
    if math.isnan(num) or math.isnan(den) or den <= 0:
        return math.nan
    return num / den


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its ``event:`` name (empty where none was sent) and its
    ``data:`` lines joined by newlines."""

    event: str
    data: str


def sse_events(lines: Iterable[str]) -> Iterator[SseEvent]:
    """The events of a server-sent stream read line by line (without line ends): fields
    until a blank line; comments (``:``) and other fields are skipped; an event cut off
    at the end of the stream still counts."""
    name, data = "", []
    for line in lines:
        if not line:
            if data:
                yield SseEvent(name, "\n".join(data))
            name, data = "", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield SseEvent(name, "\n".join(data))


def _json(ev: SseEvent, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(ev.data)
    except ValueError:
        raise BenchFault(what, f"an event that is not JSON: {ev.data[:MAX_FAULT_BYTES]!r}") from None
    if not isinstance(obj, dict):
        raise BenchFault(what, f"an event that is not an object: {ev.data[:MAX_FAULT_BYTES]!r}")
    return obj


class ChatStream:
    """Reads a streamed chat completion event by event: ``token`` is whether an event is
    the first-token kind (a delta with content); ``end`` checks the whole stream."""

    def __init__(self) -> None:
        self.done = False

    def token(self, ev: SseEvent) -> bool:
        if ev.data == "[DONE]":
            self.done = True
            return False
        obj = _json(ev, "chat")
        if "error" in obj:
            raise BenchFault("chat", f"an error in the stream: {ev.data[:MAX_FAULT_BYTES]}")
        choices = obj.get("choices") or [{}]
        return bool((choices[0].get("delta") or {}).get("content"))

    def end(self) -> None:
        if not self.done:
            raise BenchFault("chat", "the stream ended without [DONE]")


class ResponsesStream:
    """Reads a streamed Responses answer event by event: ``token`` is whether an event is
    the first-token kind (a ``response.output_text.delta`` with text); ``end`` checks the
    whole stream: ``response.created`` first; last ``response.completed``, or
    ``response.incomplete`` for ``max_output_tokens`` (a limit reached, as chat's
    ``length``); nothing failed; each event's name its object's ``type``."""

    def __init__(self) -> None:
        self.types: list[str] = []

    def token(self, ev: SseEvent) -> bool:
        obj = _json(ev, "responses")
        kind = str(obj.get("type", ""))
        if ev.event and ev.event != kind:
            raise BenchFault("responses", f"event {ev.event!r} carries an object of type {kind!r}")
        if kind in ("response.failed", "error") or (kind == "response.incomplete" and _why_incomplete(obj) != LIMIT):
            raise BenchFault("responses", f"{kind}: {ev.data[:MAX_FAULT_BYTES]}")
        if len(self.types) < MAX_EVENTS_KEPT:  # bounded: the order checks need the ends only
            self.types.append(kind)
        else:
            self.types[-1] = kind
        return kind == "response.output_text.delta" and bool(obj.get("delta"))

    def end(self) -> None:
        if not self.types or self.types[0] != "response.created":
            raise BenchFault("responses", f"the first event is {self.types[:1]}, not response.created")
        if self.types[-1] not in ("response.completed", "response.incomplete"):
            raise BenchFault("responses", f"the last event is {self.types[-1]!r}, not response.completed")


LIMIT = "max_output_tokens"  # the one reason a response may end incomplete here
MAX_EVENTS_KEPT = 4096


def _why_incomplete(obj: dict[str, Any]) -> str | None:
    details = (obj.get("response") or {}).get("incomplete_details") or {}
    return details.get("reason") if isinstance(details, dict) else None


def first_token_ms(
    lines: Iterable[str], stream: ChatStream | ResponsesStream, start_s: float, clock: Callable[[], float]
) -> float:
    """Milliseconds from ``start_s`` to the first event ``stream`` takes for a token, by
    ``clock``; the stream is read to its end and checked (``stream.end``)."""
    first: float | None = None
    for ev in sse_events(lines):
        if stream.token(ev) and first is None:
            first = (clock() - start_s) * 1000
    stream.end()
    if first is None:
        raise BenchFault(KINDS[isinstance(stream, ResponsesStream)], "no text in the answer")
    return first


def chat_body(model: str, max_tokens: int) -> dict[str, Any]:
    """``PROMPT`` as a streamed chat completion."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def responses_body(model: str, max_tokens: int) -> dict[str, Any]:
    """``PROMPT`` as a streamed Responses request: the chat body it becomes is
    ``chat_body``'s (a string input is one user message)."""
    return {
        "model": model,
        "input": PROMPT,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "store": False,
    }


def plan(requests: int, concurrency: int) -> list[list[str]]:
    """Each client's requests in order: the two kinds alternating, client ``w`` starting
    with ``KINDS[w % 2]``, so that at any moment about as many of each are in flight; each
    kind ``ceil(requests / concurrency) * concurrency`` times in all (at least ``requests``)."""
    per_client = 2 * math.ceil(requests / concurrency)
    return [[KINDS[(w + i) % 2] for i in range(per_client)] for w in range(concurrency)]


def cpu_line(span: dict[str, float]) -> str:
    """CPU seconds by role in a span (``stack_cpu.delta``), the roles that took any, and the
    engine's wait for a core."""
    from loadtest.stack_cpu import ROLES, wait_key

    used = ", ".join(f"{r} {span[r]:.2f}" for r in ROLES if span.get(r, 0.0) >= 0.01)
    return f"cpu s {used or '-'}; engine waited {span.get(wait_key('engine'), 0.0):.2f} s for a core"


def embed_inputs(count: int, words: int) -> list[str]:
    """``count`` distinct texts of the same shape: a numbered note of ``words`` words."""
    n = len(WORDS)
    return [f"note {i}: " + " ".join(WORDS[(i * 7 + j * 5 + i // n) % n] for j in range(words)) for i in range(count)]


def decode_embedding(item: Any, dims: int | None = None) -> list[float]:
    """One ``data[]`` item's vector: base64 of little-endian float32, or a list of numbers."""
    import numpy as np

    raw = item.get("embedding") if isinstance(item, dict) else None
    if isinstance(raw, str):
        vec = np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist()
    elif isinstance(raw, list):
        vec = [float(x) for x in raw]
    else:
        raise BenchFault("embeddings", f"an item without a vector: {str(item)[:MAX_FAULT_BYTES]}")
    if dims is not None and len(vec) != dims:
        raise BenchFault("embeddings", f"a vector of {len(vec)} numbers, the others have {dims}")
    return vec


def cosines(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> list[float]:
    """The cosine of each ``a[i]`` with ``b[i]`` (0 where either vector is zero)."""
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"{len(a)} vectors against {len(b)}")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"vectors of shape {x.shape} against {y.shape}")
    norms = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    dots = np.einsum("ij,ij->i", x, y)
    return [float(d / n) if n > 0 else 0.0 for d, n in zip(dots, norms, strict=True)]


@dataclass(frozen=True)
class Figures:
    """What the final line says; nan for a section not run."""

    p50_ratio: float = math.nan
    p99_ratio: float = math.nan
    throughput_ratio: float = math.nan
    min_cosine: float = math.nan


def final_line(f: Figures) -> str:
    """The one line a script reads."""
    return (
        f"openai: responses_ttft_p50_ratio={f.p50_ratio:.3f} responses_ttft_p99_ratio={f.p99_ratio:.3f} "
        f"embed_throughput_ratio={f.throughput_ratio:.3f} embed_min_cosine={f.min_cosine:.6f}"
    )


def ttft_table(times: dict[int, dict[str, list[float]]]) -> tuple[list[str], tuple[float, float]]:
    """The TTFT section's lines (per concurrency and kind: n, p50, p99; the ratios), and the
    first concurrency's p50 and p99 ratios (Responses over chat)."""
    lines = [f"{'conc':>4}  {'kind':<9} {'n':>4} {'p50 ms':>8} {'p99 ms':>8}"]
    first: tuple[float, float] | None = None
    for conc, by_kind in times.items():
        for kind in KINDS:
            t = by_kind[kind]
            lines.append(f"{conc:>4}  {kind:<9} {len(t):>4} {pct(t, 50):>8.1f} {pct(t, 99):>8.1f}")
        r50 = ratio(pct(by_kind["responses"], 50), pct(by_kind["chat"], 50))
        r99 = ratio(pct(by_kind["responses"], 99), pct(by_kind["chat"], 99))
        lines.append(f"{conc:>4}  responses/chat  p50 {r50:.3f}  p99 {r99:.3f}")
        first = first or (r50, r99)
    return lines, first or (math.nan, math.nan)


# --- the run --------------------------------------------------------------------------------


@dataclass
class EmbedRun:
    """One side's embeddings: the vectors by input, the tokens it counted, the span."""

    vectors: list[list[float]]
    tokens: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def inputs_per_s(self) -> float:
        return len(self.vectors) / self.elapsed_s if self.elapsed_s > 0 else math.nan


def _stack(data: dict[str, Any]) -> Any:
    """Start the config ``data`` in a Ray of its own and wait until it is ready; the
    config is returned (``_down`` ends it)."""
    import httpx
    import ray

    from ballast.config import load_config
    from ballast.ops.app import start
    from loadtest.bench_overload import BASE, PORT

    cfg = load_config(data)
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        start(cfg, "127.0.0.1", PORT)
        url = f"{BASE}{cfg.route_prefix.rstrip('/')}/healthz/ready"
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get(url).status_code == 200:
                        return cfg
                except httpx.HTTPError:
                    pass
                time.sleep(1)
        raise BenchFault("start", f"not ready after {READY_TIMEOUT_S:.0f} s")
    except BaseException:
        _down(cfg)
        raise


def _down(cfg: Any) -> None:
    import ray

    from ballast.ops.app import shutdown

    try:
        shutdown(cfg)
    finally:
        ray.shutdown()


def _base_data(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's mapping as the other vLLM benches set it: the bench tenant and
    port, the model directory on vLLM, one replica, no fallback, no response cache."""
    from ballast.config import with_model_dir
    from loadtest.bench_overload import VLLM_RSS_LIMIT_MB, bench_data

    data = with_model_dir(bench_data(args.config, 1), args.vllm_model, "vllm")
    data["fallback"] = None
    data.setdefault("resilience", {}).setdefault("cache", {})["enabled"] = False
    data.setdefault("watchdog", {})["rss_limit_mb"] = VLLM_RSS_LIMIT_MB
    return data


def _ttft_one(client: Any, urls: dict[str, str], bodies: dict[str, dict[str, Any]], key: str, kind: str) -> float:
    """One request of ``kind``: its TTFT in ms, its stream read to the end and checked."""
    stream: ChatStream | ResponsesStream = ChatStream() if kind == "chat" else ResponsesStream()
    start = time.perf_counter()
    with client.stream("POST", urls[kind], json=bodies[kind], headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise BenchFault(kind, f"{r.status_code} {r.read()[:MAX_FAULT_BYTES]!r}")
        seen = Seen(r.iter_lines())
        try:
            return first_token_ms(seen, stream, start, time.perf_counter)
        except BenchFault as fault:  # what came, to tell a wrong stream from a cut or empty one
            what = f"{r.headers.get('content-type')!r}, {seen.count} lines, the first {seen.first!r}"
            raise BenchFault(fault.what, f"{fault.seen} ({what})") from None


class Seen:
    """Lines as they are read, counted, with the first ``MAX_FAULT_BYTES`` of them kept."""

    def __init__(self, lines: Iterable[str]) -> None:
        self._lines = lines
        self.count = 0
        self.first = ""

    def __iter__(self) -> Iterator[str]:
        for line in self._lines:
            self.count += 1
            if len(self.first) < MAX_FAULT_BYTES:
                self.first = (self.first + line + "\n")[:MAX_FAULT_BYTES]
            yield line


def _ttft_phase(send: Callable[[str], float], clients: list[list[str]], max_phase_s: float) -> dict[str, list[float]]:
    """One concurrency: a thread per client sending its kinds in order (``send``), none
    started after ``max_phase_s``; TTFT in ms by kind."""
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    lock = threading.Lock()  # guards times: the clients append from their threads
    stop_at = time.monotonic() + max_phase_s

    def client_loop(kinds: list[str]) -> None:
        for kind in kinds:
            if time.monotonic() >= stop_at:
                return
            ms = send(kind)
            with lock:
                times[kind].append(ms)

    with ThreadPoolExecutor(len(clients)) as pool:
        for f in [pool.submit(client_loop, kinds) for kinds in clients]:
            f.result()
    return times


def run_ttft(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    """The ``ttft`` section: TTFT in ms by concurrency and kind."""
    import httpx

    from ballast.config import load_config
    from loadtest.bench_overload import BASE, BENCH_KEY, vllm_engine_kwargs

    data = _base_data(args)
    m = load_config(data).model
    data["model"]["engine_kwargs"] = vllm_engine_kwargs(str(m.path), m.max_batch_size)
    cfg = _stack(data)
    try:
        prefix = f"{BASE}{cfg.route_prefix.rstrip('/')}"
        urls = {"chat": f"{prefix}/v1/chat/completions", "responses": f"{prefix}/v1/responses"}
        bodies = {
            "chat": chat_body(cfg.model.name, args.max_tokens),
            "responses": responses_body(cfg.model.name, args.max_tokens),
        }
        out: dict[int, dict[str, list[float]]] = {}
        with httpx.Client(timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=64)) as client:
            for i in range(args.warmup):
                for kind in KINDS[i % 2 :] + KINDS[: i % 2]:
                    _ttft_one(client, urls, bodies, BENCH_KEY, kind)
            for conc in args.concurrency:
                send = functools.partial(_ttft_one, client, urls, bodies, BENCH_KEY)
                times = _ttft_phase(send, plan(args.requests, conc), args.max_phase_s)
                out[conc] = times
                print(f"concurrency {conc}: {len(times['chat'])} chat, {len(times['responses'])} responses", flush=True)
        return out
    finally:
        _down(cfg)


def run_embed_ballast(args: argparse.Namespace, texts: list[str]) -> tuple[EmbedRun, dict[str, Any]]:
    """The ``embed`` section's Ballast side; also the engine settings for the offline side
    (its replica's, with every row it holds in a step)."""
    import httpx

    from ballast.config import load_config
    from ballast.model.vllm_args import DEFAULT_ENGINE_KWARGS, default_engine_kwargs, pooling_engine_kwargs
    from loadtest.bench_overload import BASE, BENCH_KEY
    from loadtest.stack_cpu import StackCpu, delta

    data = _base_data(args)
    data["model"]["kind"] = "embed"
    data["model"]["engine_kwargs"] = dict(EMBED_ENGINE_KWARGS)
    data["model"]["embed"] = {"max_inputs": max(args.inputs_per_request, 1)}
    m = load_config(data).model
    # What the replica runs with (``engine.build_engine``): the offline side takes its sizes.
    pooled = pooling_engine_kwargs(EMBED_ENGINE_KWARGS, m.embed.pooling, m.embed.normalize, m.embed.dimensions)
    engine = {**DEFAULT_ENGINE_KWARGS, **default_engine_kwargs(str(m.path), pooled, m.max_batch_size)}
    # The offline side steps every row the replica holds (the replica's vLLM steps half of
    # them, the other half queued: ``vllm_args.step_rows``); at this size the step's rows do
    # not change vLLM's throughput on a CPU, so this is the stricter reference, not a slower one.
    offline = {**engine, "max_num_seqs": m.max_batch_size}
    cfg = _stack(data)
    try:
        url = f"{BASE}{cfg.route_prefix.rstrip('/')}/v1/embeddings"
        status_url = f"{BASE}{cfg.route_prefix.rstrip('/')}/v1/status"
        per = args.inputs_per_request
        chunks = [texts[i : i + per] for i in range(0, len(texts), per)]
        vectors: list[list[float] | None] = [None] * len(texts)
        tokens = [0]
        lock = threading.Lock()

        def send(client: httpx.Client, j: int) -> None:
            body = {"model": cfg.model.name, "input": chunks[j], "encoding_format": "base64"}
            r = client.post(url, json=body, headers={"Authorization": f"Bearer {BENCH_KEY}"})
            if r.status_code != 200:
                seen = f"{r.status_code} {r.content[:MAX_FAULT_BYTES]!r}; the model then: {_level(client, status_url)}"
                raise BenchFault("embeddings", seen)
            obj = r.json()
            items = sorted(obj.get("data") or [], key=lambda d: d.get("index", -1))
            if [d.get("index") for d in items] != list(range(len(chunks[j]))):
                raise BenchFault(
                    "embeddings", f"indices {[d.get('index') for d in items][:8]}... for {len(chunks[j])} inputs"
                )
            with lock:
                for d in items:
                    vectors[j * per + d["index"]] = decode_embedding(d)
                tokens[0] += int((obj.get("usage") or {}).get("prompt_tokens", 0))

        with httpx.Client(timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=64)) as client:
            send(client, 0)  # warm-up: its vectors are the first chunk's, sent again below
            tokens[0] = 0
            cpu = StackCpu()
            before = cpu.read()
            start = time.perf_counter()
            with ThreadPoolExecutor(args.embed_concurrency) as pool:
                for f in [pool.submit(send, client, j) for j in range(len(chunks))]:
                    f.result()
            elapsed = time.perf_counter() - start
            span = delta(cpu.read(), before)
        done = [v for v in vectors if v is not None]
        if len(done) != len(texts):
            raise BenchFault("embeddings", f"{len(texts) - len(done)} inputs without a vector")
        return EmbedRun(done, tokens[0], elapsed, [cpu_line(span), f"engine {engine}"]), offline
    finally:
        _down(cfg)


def _level(client: Any, status_url: str) -> str:
    """The one model's level, and the controller's reason and inputs, from ``/v1/status``."""
    from ballast.ops.status_text import model_view, sole_model

    try:  # the admin token cluster/local.yaml names (an operator's route)
        r = client.get(status_url, headers={"Authorization": "Bearer dev-admin-token"})
        doc = r.json()
    except Exception as e:  # noqa: BLE001 - a diagnosis only: the fault is reported either way
        return f"/v1/status unread ({e!r})"
    name = sole_model(doc) if isinstance(doc, dict) else None
    if r.status_code != 200 or name is None:  # not the document looked for: say what came
        return f"/v1/status {r.status_code} {r.content[:MAX_FAULT_BYTES]!r}"
    view = model_view(doc, name)
    state = view.get("controller") or {}
    return json.dumps({"level": view.get("level"), "reason": state.get("reason"), "inputs": state.get("inputs")})


def run_embed_offline(model_dir: str, engine: dict[str, Any], texts: list[str], warmup: int) -> EmbedRun:
    """The ``embed`` section's vLLM side, in a subprocess of its own (``--offline-embed``)."""
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        job = os.path.join(tmp, "job.json")
        out = os.path.join(tmp, "out.json")
        keep = ("max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "dtype", "enforce_eager")
        with open(job, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "model": model_dir,
                    "engine": {k: engine[k] for k in keep if k in engine},
                    "texts": texts,
                    "warmup": warmup,
                },
                f,
            )
        cmd = [sys.executable, "-m", "loadtest.bench_openai", "--offline-embed", job, out]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        subprocess.run(cmd, check=True, timeout=OFFLINE_TIMEOUT_S, env=env)
        with open(out, encoding="utf-8") as f:
            res = json.load(f)
    return EmbedRun(res["vectors"], res["tokens"], res["elapsed_s"], [res["cpu"], f"engine {res['engine']}"])


def offline_embed_main(job_path: str, out_path: str) -> None:
    """The subprocess: vLLM's ``LLM.embed`` on the job's texts, timed after a warm-up."""
    from vllm import LLM

    from loadtest.stack_cpu import StackCpu, delta

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    engine = {**job["engine"], "runner": "pooling", "convert": "embed"}
    llm = LLM(model=job["model"], **engine)
    texts = job["texts"]
    llm.embed(texts[: job["warmup"]], use_tqdm=False)
    cpu = StackCpu()
    before = cpu.read()
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    res = {
        "vectors": [[float(x) for x in o.outputs.embedding] for o in outs],
        "tokens": sum(len(o.prompt_token_ids) for o in outs),
        "elapsed_s": elapsed,
        "engine": engine,
        "cpu": cpu_line(delta(cpu.read(), before)),
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(res, f)


def run_embed(args: argparse.Namespace) -> tuple[float, float]:
    """The ``embed`` section: prints both sides; the throughput ratio and the min cosine."""
    texts = embed_inputs(args.embed_requests * args.inputs_per_request, args.words)
    with engine_cpu(args.engine_cpu) as where:
        placement = where.words
        ballast, engine = run_embed_ballast(args, texts)
        offline = run_embed_offline(str(args.vllm_model), engine, texts, args.inputs_per_request)
    cos = cosines(ballast.vectors, offline.vectors)
    r = ratio(ballast.inputs_per_s, offline.inputs_per_s)
    print(
        f"embeddings: {len(texts)} inputs, {args.embed_requests} requests of {args.inputs_per_request}, "
        f"{args.embed_concurrency} in flight; {placement}",
        flush=True,
    )
    for name, side in (("ballast", ballast), ("vllm-offline", offline)):
        print(
            f"  {name:<13} {side.inputs_per_s:8.1f} inputs/s  {side.elapsed_s:7.2f} s  "
            f"{side.tokens} tokens ({side.tokens / len(texts):.1f} per input)",
            flush=True,
        )
    print(f"  ballast/offline {r:.3f}  cosine min {min(cos):.6f} mean {statistics.fmean(cos):.6f}", flush=True)
    print(f"  ballast {'; '.join(ballast.notes)}", flush=True)
    print(f"  offline {'; '.join(offline.notes)}", flush=True)
    return r, min(cos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cluster/local.yaml")
    p.add_argument("--vllm-model", default="models/demo")
    p.add_argument("--sections", default=",".join(SECTIONS), help="ttft, embed, or both (comma-separated)")
    p.add_argument("--requests", type=int, default=100, help="of each kind, at each concurrency")
    p.add_argument("--concurrency", default="1,4", help="clients in flight, comma-separated")
    p.add_argument("--warmup", type=int, default=4, help="of each kind, not counted")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-phase-s", type=float, default=180.0)
    p.add_argument("--embed-requests", type=int, default=32)
    p.add_argument("--inputs-per-request", type=int, default=64)
    # Two: the next request's rows wait while one runs, so the engine is never without work,
    # and the line stays one request long (four requests of 64 rows ahead of a replica of 32
    # are a second's wait, which the level reads as overload at its 1,000 ms threshold).
    p.add_argument("--embed-concurrency", type=int, default=2)
    p.add_argument("--engine-cpu", choices=ENGINE_CPU, default="own", help="vLLM's worker on a core of its own, or not")
    p.add_argument("--words", type=int, default=5, help="words per embeddings input (5: ~32 demo tokens)")
    p.add_argument("--offline-embed", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.offline_embed:
        offline_embed_main(*args.offline_embed)
        return
    try:
        sections = [s for s in args.sections.split(",") if s]
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        p.error("--concurrency: integers, comma-separated")
    if not sections or any(s not in SECTIONS for s in sections):
        p.error(f"--sections: of {SECTIONS}")
    if not args.concurrency or any(not 1 <= c <= 32 for c in args.concurrency):
        p.error("--concurrency: 1-32 each")
    bounds = (
        (1 <= args.requests <= 2000, "--requests 1-2000"),
        (0 <= args.warmup <= 100, "--warmup 0-100"),
        (1 <= args.max_tokens <= 256, "--max-tokens 1-256"),
        (1 <= args.max_phase_s <= 1800, "--max-phase-s 1-1800"),
        (1 <= args.embed_requests <= 256, "--embed-requests 1-256"),
        (1 <= args.inputs_per_request <= 2048, "--inputs-per-request 1-2048"),
        (1 <= args.embed_concurrency <= 32, "--embed-concurrency 1-32"),
        (1 <= args.words <= 200, "--words 1-200"),
    )
    for ok, what in bounds:
        if not ok:
            p.error(what)
    started = time.monotonic()
    figures = Figures()
    if "ttft" in sections:
        lines, (r50, r99) = ttft_table(run_ttft(args))
        print("\n".join(lines), flush=True)
        figures = Figures(r50, r99)
    if "embed" in sections:
        tr, cmin = run_embed(args)
        figures = Figures(figures.p50_ratio, figures.p99_ratio, tr, cmin)
    print(f"bench-openai: {time.monotonic() - started:.0f} s", flush=True)
    print(final_line(figures), flush=True)


if __name__ == "__main__":
    main()
