"""Ballast's batching against transformers' ``generate`` on the same model and prompts.

``make bench-model``. One process, one model, one list of
requests, four ways of serving it, at each concurrency C (default 1, 8, 32):

- **ballast**: :class:`ballast.model.hf_engine.HFBatch` driven as the replica's
  engine (``server._engine``) drives it: chunk after chunk of ``--chunk-tokens``
  steps; a request waiting joins at the next chunk boundary (up to C rows) and
  leaves when it has its tokens. C closed-loop clients: each sends its next
  request when its previous one finishes. Text decoding is left out (it runs on
  the replica's event loop, beside the batch, and ``generate`` has none either).
- **generate**: transformers' own ``model.generate`` with a static batch: C
  requests at a time, left-padded with an attention mask, greedy,
  ``max_new_tokens`` the longest in the batch; every request is done when its
  batch is (the closed loop's C clients all finish together and send again
  together). tokens/s counts only each request's own asked-for tokens.
- **transformers-cb**: transformers' continuous batching
  (``init_continuous_batching``: its own scheduler thread over a paged cache),
  C closed-loop clients through ``add_request`` / ``get_result``. When it does
  not run here the table says why in one line and the other two stacks go on.
- **vllm**: vLLM's engine (:class:`ballast.model.vllm_engine.VLLMBackend`, its
  ``AsyncLLM``) on the same directory, driven chunk by chunk as the replica drives
  it, with the same closed-loop clients (``--no-vllm`` leaves it out; when it cannot
  start, one line says why). vLLM schedules its rows itself: paged KV cache, prefix
  caching (on, Ballast's default: the workload's prompts repeat), its own CPU threads.

The requests are seeded: half short (8 tokens), half long (``--max-tokens`` / 2
up to ``--max-tokens``), prompts drawn from the demo corpus; the same sequence for
every stack. No EOS: every request runs to its max_tokens in every stack (the
backend's ``eos_ids`` is emptied, ``generate`` gets ``min_new_tokens``, the
continuous batcher ``eos_token_id=-1``, vLLM ``ignore_eos``), so all stacks produce as many tokens.

**Latency** is from a request's submission to its last token. A ballast client
whose request ends in a chunk submits its next one at the end of that chunk, and
it joins the next chunk at once: in the closed loop no request waits for a chunk.

**The short request beside long ones.** A short request's p99 alone against its
p99 while the other C-1 rows of the batch (C the largest concurrency) are long
requests, themselves a closed loop. For ballast, the short request arrives at a
seeded random moment inside a running chunk (it is submitted at
``start + u * (end - start)`` of that chunk, measured), so the wait for the chunk
boundary is counted, as on the replica. For generate it is submitted with a
static batch of C-1 long ones (the best case: no wait for a batch already
running). For transformers-cb it is added while C-1 long requests are running.

Written by hand: the point is to drive the project's own batch loop step by step
with closed-loop clients on an injected clock, which no load tool does
(Locust and friends drive HTTP, not a ``run_chunk`` call).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ballast.model.protocol import Join, RowSampling

Clock = Callable[[], float]

SHORT_TOKENS = 8
THROUGHPUT_TARGET_RATIO = 0.9  # ballast tok/s >= 0.9 x generate's at the largest concurrency
SHORT_P99_TARGET_RATIO = 1.2  # short request's p99 beside long ones <= 1.2 x alone

# Prompts of a few lengths (6 to 40 tokens with the demo tokenizer); any tokenizer encodes them.
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A replica serves requests; the router sends each one to the least loaded replica.",
    "Tokens per second, time to first token, and the p99 latency of short requests.",
    "The KV cache grows by one token per step for every row in the running batch.",
    "Hello! How are you today?",
    "What is the capital of France?",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog, twice, and the router "
    "sends each request to the least loaded replica.",
)


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.prompt or self.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and max_tokens >= 1, got {self!r}")


def workload(
    n: int, max_tokens: int, seed: int, *, short_tokens: int = SHORT_TOKENS, short_ratio: float = 0.5
) -> list[Request]:
    """``n`` seeded requests: ``short_ratio`` of them short, the rest long (max_tokens / 2 .. max_tokens)."""
    if n < 1 or max_tokens < short_tokens:
        raise ValueError(f"need n >= 1 and max_tokens >= {short_tokens}, got n={n}, max_tokens={max_tokens}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = (
            short_tokens if rng.random() < short_ratio else rng.randint(max(short_tokens, max_tokens // 2), max_tokens)
        )
        out.append(Request(rng.choice(PROMPTS), tokens))
    return out


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, as bench_router's tables."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class StackRun:
    """One stack at one concurrency: per-request latencies, tokens generated, wall time."""

    stack: str
    concurrency: int
    latencies_s: list[float] = field(default_factory=list)
    tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def p50_ms(self) -> float:
        return pct(self.latencies_s, 0.50) * 1000.0

    @property
    def p99_ms(self) -> float:
        return pct(self.latencies_s, 0.99) * 1000.0


@dataclass
class ShortBeside:
    """A short request's latencies alone and beside C-1 long ones."""

    stack: str
    beside: int  # long rows beside it
    alone_s: list[float] = field(default_factory=list)
    beside_s: list[float] = field(default_factory=list)  # from its arrival
    from_join_s: list[float] = field(default_factory=list)  # ballast: from the chunk boundary it joined at
    step_s: dict[int, float] = field(default_factory=dict)  # ballast: one decode step's time at 1 and C rows

    @property
    def ratio(self) -> float:
        return pct(self.beside_s, 0.99) / pct(self.alone_s, 0.99)


# ------------------------------------------------------------------------ ballast


def run_ballast(
    backend: Any,
    requests: Sequence[Request],
    concurrency: int,
    chunk_tokens: int,
    clock: Clock = time.perf_counter,
    stack: str = "ballast",
    sampling: Any = None,
) -> StackRun:
    """C closed-loop clients over one engine batch, chunk by chunk, as the replica's
    engine loop runs it: an HFBatch (``ballast``), or a VLLMBatch (``vllm``: vLLM
    schedules its own rows; the replica's loop only hands them over and collects).

    The batch's ``run_chunk`` ends with one device-to-host copy (or vLLM's own
    outputs), so the clock read after it sees the work done on CUDA too.
    """
    import torch

    run = StackRun(stack, concurrency)
    batch = backend.open_batch()
    todo = deque(range(len(requests)))
    waiting: deque[int] = deque()
    submitted: dict[int, float] = {}
    got: dict[int, int] = {}
    start = clock()
    for _ in range(min(concurrency, len(todo))):
        key = todo.popleft()
        waiting.append(key)
        submitted[key] = start
    with torch.inference_mode():
        while waiting or batch.keys():
            joins = []
            while waiting and len(batch.keys()) + len(joins) < concurrency:
                key = waiting.popleft()
                req = requests[key]
                joins.append(Join(key, backend.text.encode(req.prompt, req.max_tokens), req.max_tokens, sampling))
                got[key] = 0
            out = batch.run_chunk(joins, chunk_tokens)
            now = clock()
            for key, ids in out.items():
                got[key] += len(ids)
                run.tokens += len(ids)
                if got[key] >= requests[key].max_tokens:
                    run.latencies_s.append(now - submitted.pop(key))
                    if todo:  # this client's next request, joining at the next boundary
                        nxt = todo.popleft()
                        waiting.append(nxt)
                        submitted[nxt] = now
    run.elapsed_s = clock() - start
    return run


def short_beside_long_ballast(
    backend: Any,
    beside: int,
    long_tokens: Sequence[int],
    prompt: str,
    trials: int,
    chunk_tokens: int,
    seed: int,
    clock: Clock = time.perf_counter,
    stack: str = "ballast",
    sampling: Any = None,
) -> ShortBeside:
    """A short request alone, then beside ``beside`` long rows kept running (a closed loop of their own).

    Beside them, each trial's short request arrives at a seeded random point of a
    running chunk and joins at the next boundary, so its wait for the boundary counts.
    """
    import torch

    rng = random.Random(seed)
    res = ShortBeside(stack, beside)
    short_ids = backend.text.encode(prompt, SHORT_TOKENS)
    with torch.inference_mode():
        for i in range(trials):  # alone: an idle batch takes it at once
            batch = backend.open_batch()
            t0 = clock()
            batch.run_chunk([Join(("s", i), short_ids, SHORT_TOKENS, sampling)], chunk_tokens)
            while batch.keys():
                batch.run_chunk([], chunk_tokens)
            res.alone_s.append(clock() - t0)

        batch = backend.open_batch()
        next_long = 0

        def refill() -> list[Join]:
            nonlocal next_long
            joins = []
            live = sum(1 for k in batch.keys() if k[0] == "l")
            for _ in range(beside - live):
                n = long_tokens[next_long % len(long_tokens)]
                joins.append(Join(("l", next_long), backend.text.encode(prompt, n), n, sampling))
                next_long += 1
            return joins

        # Fill, then let the long rows drift apart before the first trial.
        for _ in range(3):
            batch.run_chunk(refill(), chunk_tokens)
        for i in range(trials):
            for _ in range(rng.randint(0, 2)):
                batch.run_chunk(refill(), chunk_tokens)
            t0 = clock()
            batch.run_chunk(refill(), chunk_tokens)
            t1 = clock()
            submitted = t0 + rng.random() * (t1 - t0)  # arrived during that chunk
            key = ("s", i)
            joins = refill() + [Join(key, short_ids, SHORT_TOKENS, sampling)]
            got = 0
            while True:
                out = batch.run_chunk(joins, chunk_tokens)
                got += len(out.get(key, []))
                if got >= SHORT_TOKENS:
                    done = clock()
                    res.beside_s.append(done - submitted)
                    res.from_join_s.append(done - t1)
                    break
                joins = refill()
        batch.remove(batch.keys())  # the long rows left (vLLM would go on running them)
    return res


def decode_step_s(backend: Any, rows: int, prompt: str, steps: int, clock: Clock = time.perf_counter) -> float:
    """One decode step's mean time with ``rows`` rows in the batch (after their prefill).

    Every row of the batch steps together, so the ratio of this at C rows to 1 row
    is the floor of the short request's ratio on this device, whatever the scheduler.
    """
    import torch

    ids = backend.text.encode(prompt, steps + 1)
    batch = backend.open_batch()
    with torch.inference_mode():
        batch.run_chunk([Join(i, ids, steps + 1) for i in range(rows)], 1)
        t0 = clock()
        batch.run_chunk([], steps)
        return (clock() - t0) / steps


# ----------------------------------------------------------------------- generate


def _generate(model: Any, tokenizer: Any, prompts: list[str], n: int, device: str) -> int:
    """One static batch through ``model.generate``; the new tokens per row."""
    import torch

    from ballast.model.hf_checkpoint import attention_kernels

    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt").to(device)
    with torch.inference_mode(), attention_kernels(device):  # the kernels ballast's batch uses
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=n,
            min_new_tokens=n,  # no early EOS: every row runs to n, as ballast's rows run to theirs
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    out[0, -1].item()  # waits for the device, so the clock read after it sees the work
    return int(out.shape[1] - enc["input_ids"].shape[1])


def run_generate(
    model: Any,
    tokenizer: Any,
    device: str,
    requests: Sequence[Request],
    concurrency: int,
    clock: Clock = time.perf_counter,
) -> StackRun:
    """C requests at a time as a static batch; each request's latency is its batch's."""
    run = StackRun("generate", concurrency)
    start = clock()
    for lo in range(0, len(requests), concurrency):
        group = requests[lo : lo + concurrency]
        t0 = clock()
        new = _generate(model, tokenizer, [r.prompt for r in group], max(r.max_tokens for r in group), device)
        t1 = clock()
        run.tokens += sum(min(r.max_tokens, new) for r in group)  # only what each request asked for
        run.latencies_s += [t1 - t0] * len(group)
    run.elapsed_s = clock() - start
    return run


def short_beside_long_generate(
    model: Any,
    tokenizer: Any,
    device: str,
    beside: int,
    long_tokens: Sequence[int],
    prompt: str,
    trials: int,
    clock: Clock = time.perf_counter,
) -> ShortBeside:
    """The short request alone, then in a static batch with ``beside`` long ones (submitted with it)."""
    res = ShortBeside("generate", beside)
    for _ in range(trials):
        t0 = clock()
        _generate(model, tokenizer, [prompt], SHORT_TOKENS, device)
        res.alone_s.append(clock() - t0)
    for i in range(trials):
        n = max(long_tokens[(i * beside + j) % len(long_tokens)] for j in range(beside))
        t0 = clock()
        _generate(model, tokenizer, [prompt] * (beside + 1), n, device)
        res.beside_s.append(clock() - t0)
    return res


# ----------------------------------------------------------------- transformers-cb


class _CB:
    """transformers' continuous batching manager, started for one run and stopped after it.

    ``stop`` puts back the attention implementation the manager switched from, so
    the other stacks run the model as loaded.
    """

    def __init__(self, model: Any, tokenizer: Any, concurrency: int, max_prompt: int, max_tokens: int, n: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        gen = GenerationConfig(
            do_sample=False, max_new_tokens=max_tokens, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id
        )
        # Sized for this workload: left to itself on CPU it takes a share of host memory
        # (hundreds of MB for the demo model), seconds to allocate at every start.
        page = 256
        blocks = 2 * concurrency * -(-(max_prompt + max_tokens) // page)
        cfg = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=blocks,
            max_requests_per_batch=concurrency,
            allow_block_sharing=False,  # no prefix cache: the other stacks prefill every prompt in full
            auto_switch_to_flash=False,
        )
        hints = WorkloadHints(max_prompt_length=max_prompt, max_generated_length=max_tokens, num_requests=n)
        self.manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cfg, workload_hints=hints
        )
        self.manager.warmup()
        self.manager.start()
        # The first request after start pays for the batch processor's set-up; not measured.
        self.add("warmup", tokenizer.encode(PROMPTS[0]), 4)
        self.next_finished()

    def add(self, rid: str, ids: list[int], n: int) -> None:
        if self.manager.add_request(ids, request_id=rid, max_new_tokens=n, eos_token_id=-1) is None:
            raise RuntimeError(f"the continuous batching manager dropped request {rid}")  # noqa: TRY003

    def next_finished(self) -> Any:
        """The next finished request's output; raises if the manager's thread died or failed it."""
        while True:
            res = self.manager.get_result(timeout=60)
            if res is None:
                if not self.manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped")
                continue
            if res.error is not None:
                raise RuntimeError(f"request {res.request_id} failed: {res.error}")
            if res.is_finished():
                return res

    def close(self, hard: bool = False) -> None:
        """Stop the thread (``hard``: without finishing the requests still running) and release the manager."""
        self.manager.stop(block=True, timeout=60, hard_stop=hard)
        self.manager.destroy()


def run_transformers_cb(
    model: Any,
    tokenizer: Any,
    requests: Sequence[Request],
    concurrency: int,
    clock: Clock = time.perf_counter,
) -> StackRun:
    """C closed-loop clients through transformers' continuous batching manager."""
    run = StackRun("transformers-cb", concurrency)
    ids = [tokenizer.encode(r.prompt) for r in requests]
    cb = _CB(model, tokenizer, concurrency, max(map(len, ids)), max(r.max_tokens for r in requests), len(requests))
    try:
        todo = deque(range(len(requests)))
        submitted: dict[str, tuple[int, float]] = {}

        def send() -> None:
            k = todo.popleft()
            submitted[str(k)] = (k, clock())
            cb.add(str(k), ids[k], requests[k].max_tokens)

        start = clock()
        for _ in range(min(concurrency, len(todo))):
            send()
        while submitted:
            res = cb.next_finished()
            now = clock()
            k, t0 = submitted.pop(res.request_id)
            run.latencies_s.append(now - t0)
            run.tokens += min(len(res.generated_tokens), requests[k].max_tokens)
            if todo:
                send()
        run.elapsed_s = clock() - start
    finally:
        cb.close()
    return run


def short_beside_long_cb(
    model: Any,
    tokenizer: Any,
    beside: int,
    long_tokens: Sequence[int],
    prompt: str,
    trials: int,
    seed: int,
    clock: Clock = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> ShortBeside:
    """The short request alone, then added while ``beside`` long requests run (each replaced when done)."""
    rng = random.Random(seed)
    res = ShortBeside("transformers-cb", beside)
    ids = tokenizer.encode(prompt)
    cb = _CB(model, tokenizer, beside + 1, len(ids), max(long_tokens), beside + trials)
    try:
        for i in range(trials):
            t0 = clock()
            cb.add(f"a{i}", ids, SHORT_TOKENS)
            cb.next_finished()
            res.alone_s.append(clock() - t0)
        for j in range(beside):
            cb.add(f"l{j}", ids, long_tokens[j % len(long_tokens)])
        next_long = beside
        for i in range(trials):
            sleep(rng.random() * 0.05)  # land somewhere in the running steps
            t0 = clock()
            cb.add(f"s{i}", ids, SHORT_TOKENS)
            while True:
                out = cb.next_finished()
                if out.request_id == f"s{i}":
                    res.beside_s.append(clock() - t0)
                    break
                cb.add(f"l{next_long}", ids, long_tokens[next_long % len(long_tokens)])  # keep the batch full
                next_long += 1
    finally:
        cb.close(hard=True)  # the long rows still running are not waited for
    return res


# ----------------------------------------------------------------------- the run


@dataclass
class Report:
    header: list[str]
    runs: list[StackRun]
    shorts: list[ShortBeside]
    notes: list[str]


def _model_lines(backend: Any, loaded: Any, device: str) -> list[str]:
    import torch
    import transformers

    c = loaded.model.config
    geometry = (
        f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} heads "
        f"({getattr(c, 'num_key_value_heads', c.num_attention_heads)} kv), vocab {c.vocab_size}, "
        f"context {backend.max_seq_len}"
    )
    return [
        f"model: {backend.source} ({loaded.info.architecture}, {backend.parameter_count:,} params; {geometry}; "
        f"{str(loaded.dtype).replace('torch.', '')}, attention {c._attn_implementation})",
        f"device: {device}; torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f} at start "
        f"({os.cpu_count()} CPUs: other work on them skews the times)",
    ]


def run_all(
    path: Path,
    device: str,
    concurrency: Sequence[int],
    n_requests: int,
    max_tokens: int,
    chunk_tokens: int,
    seed: int,
    short_trials: int,
    with_cb: bool = True,
    with_vllm: bool = False,
    clock: Clock = time.perf_counter,
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """Every stack at every concurrency, then the short-beside-long figures, on one loaded model.

    ``with_vllm``: vLLM's engine (``VLLMBackend``) on the same directory beside the
    others, started once; when it cannot start here the table says why in one line."""
    from ballast.model.hf_checkpoint import load_checkpoint
    from ballast.model.hf_engine import HFBackend

    loaded = load_checkpoint(path, device)
    backend = HFBackend(loaded, name="bench")
    backend.eos_ids = frozenset()  # every row runs to its max_tokens, as generate's do with min_new_tokens
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token_id is None:  # generate's left padding needs one; the backend pads with the same
        tokenizer.pad_token_id = backend._pad_id
    requests = workload(n_requests, max_tokens, seed)
    lengths = sorted({len(backend.text.encode(p, 0)) for p in PROMPTS})
    short = sum(1 for r in requests if r.max_tokens == SHORT_TOKENS)
    header = _model_lines(backend, loaded, loaded.device) + [
        f"workload: {n_requests} requests per row (seed {seed}): {short} short ({SHORT_TOKENS} tokens), "
        f"{n_requests - short} long ({max(SHORT_TOKENS, max_tokens // 2)}..{max_tokens}); prompts {lengths[0]}.."
        f"{lengths[-1]} tokens; {sum(r.max_tokens for r in requests):,} tokens per row; no EOS; greedy; "
        f"ballast chunks of {chunk_tokens} steps",
    ]
    notes: list[str] = []
    report = _run_stacks(
        backend,
        loaded,
        requests,
        header,
        notes,
        concurrency,
        max_tokens,
        chunk_tokens,
        seed,
        short_trials,
        with_cb,
        clock,
        log,
    )
    # vLLM after the others, alone: its CPU worker polls for work (about a fifth of a
    # core while idle, measured here), which would slow the stacks beside it.
    vllm = _start_vllm(path, loaded, max(concurrency), notes, log) if with_vllm else None
    if vllm is not None:
        try:
            header.append(_vllm_line(vllm))
            _run_vllm(report, vllm, requests, concurrency, max_tokens, chunk_tokens, seed, short_trials, clock, log)
        finally:
            vllm.shutdown()
    return report


def _run_vllm(
    report: Report,
    vllm: Any,
    requests: list[Request],
    concurrency: Sequence[int],
    max_tokens: int,
    chunk_tokens: int,
    seed: int,
    short_trials: int,
    clock: Clock,
    log: Callable[[str], None],
) -> None:
    """vLLM's rows at every concurrency and its short-beside-long figures, into ``report``
    (each row after the other stacks' rows at its concurrency)."""

    to_the_end = RowSampling(ignore_eos=True)  # its rows run to max_tokens, as the others' do
    vllm.warmup(sorted(set(concurrency)))
    for c in concurrency:
        log(f"concurrency {c}: vllm")
        run = run_ballast(vllm, requests, c, chunk_tokens, clock, stack="vllm", sampling=to_the_end)
        last = max(i for i, r in enumerate(report.runs) if r.concurrency == c)
        report.runs.insert(last + 1, run)
    beside = max(concurrency) - 1
    if beside >= 1:
        longs = [r.max_tokens for r in requests if r.max_tokens != SHORT_TOKENS] or [max_tokens]
        log("short beside long: vllm")
        report.shorts.append(
            short_beside_long_ballast(
                vllm,
                beside,
                longs,
                PROMPTS[4],
                short_trials,
                chunk_tokens,
                seed,
                clock,
                stack="vllm",
                sampling=to_the_end,
            )
        )


def _start_vllm(path: Path, loaded: Any, rows: int, notes: list[str], log: Callable[[str], None]) -> Any:
    """vLLM's engine on ``path`` with the transformers model's dtype, or None (the reason in ``notes``)."""
    log("starting vLLM")
    try:
        from ballast.model.vllm_engine import VLLMBackend, default_engine_kwargs

        kwargs = {"dtype": str(loaded.dtype).replace("torch.", "")}
        return VLLMBackend(str(path), name="bench-vllm", engine_kwargs=default_engine_kwargs(str(path), kwargs, rows))
    except Exception as exc:  # noqa: BLE001 - any failure is reported, and the others go on
        notes.append(f"vllm did not run: {type(exc).__name__}: {str(exc)[:300]}")
        return None


def _vllm_line(vllm: Any) -> str:
    import vllm as vllm_pkg

    cfg = vllm._llm.vllm_config
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    where = (
        f"CPU, OpenMP threads bound {bind!r} (vLLM's default keeps a core for its front)"
        if vllm.device == "cpu"
        else vllm.device
    )
    return (
        f"vllm: {vllm_pkg.__version__} on {where}; max_num_seqs {cfg.scheduler_config.max_num_seqs}, "
        f"prefix caching {cfg.cache_config.enable_prefix_caching}; started in {vllm.start_s:.0f} s; "
        f"driven as the replica drives it (chunks of the same steps); run after the others, alone"
    )


def _run_stacks(
    backend: Any,
    loaded: Any,
    requests: list[Request],
    header: list[str],
    notes: list[str],
    concurrency: Sequence[int],
    max_tokens: int,
    chunk_tokens: int,
    seed: int,
    short_trials: int,
    with_cb: bool,
    clock: Clock,
    log: Callable[[str], None],
) -> Report:
    model, tokenizer = loaded.model, loaded.tokenizer

    # Warm-up: allocator and kernels at each batch size, for both stacks.
    backend.warmup(sorted(set(concurrency)))
    for c in sorted(set(concurrency)):
        _generate(model, tokenizer, [PROMPTS[0]] * c, 4, loaded.device)

    runs: list[StackRun] = []
    cb_ok = with_cb
    for c in concurrency:
        log(f"concurrency {c}: ballast")
        runs.append(run_ballast(backend, requests, c, chunk_tokens, clock))
        log(f"concurrency {c}: generate")
        runs.append(run_generate(model, tokenizer, loaded.device, requests, c, clock))
        if cb_ok:
            log(f"concurrency {c}: transformers-cb")
            try:
                runs.append(run_transformers_cb(model, tokenizer, requests, c, clock))
            except Exception as exc:  # noqa: BLE001 - any failure is reported, and the others go on
                notes.append(f"transformers-cb did not run: {type(exc).__name__}: {exc}")
                cb_ok = False

    beside = max(concurrency) - 1
    longs = [r.max_tokens for r in requests if r.max_tokens != SHORT_TOKENS] or [max_tokens]
    prompt = PROMPTS[4]
    shorts = []
    if beside >= 1:
        log("short beside long: ballast")
        shorts.append(
            short_beside_long_ballast(backend, beside, longs, prompt, short_trials, chunk_tokens, seed, clock)
        )
        shorts[-1].step_s = {n: decode_step_s(backend, n, prompt, 32, clock) for n in (1, beside + 1)}
        log("short beside long: generate")
        shorts.append(
            short_beside_long_generate(
                model, tokenizer, loaded.device, beside, longs, prompt, max(1, short_trials // 3), clock
            )
        )
        if cb_ok:
            log("short beside long: transformers-cb")
            try:
                shorts.append(short_beside_long_cb(model, tokenizer, beside, longs, prompt, short_trials, seed, clock))
            except Exception as exc:  # noqa: BLE001
                notes.append(f"transformers-cb short-beside-long did not run: {type(exc).__name__}: {exc}")
    return Report(header, runs, shorts, notes)


def render(report: Report) -> list[str]:
    lines = list(report.header)
    lines.append("")
    lines.append(
        f"{'conc':>5} | {'stack':<16} | {'tokens':>7} {'tok/s':>8} | {'p50 ms':>8} {'p99 ms':>8} | vs generate"
    )
    by = {(r.concurrency, r.stack): r for r in report.runs}
    for r in report.runs:
        gen = by.get((r.concurrency, "generate"))
        vs = f"{r.tokens_per_s / gen.tokens_per_s:5.2f}x" if gen and r.stack != "generate" else ""
        lines.append(
            f"{r.concurrency:>5} | {r.stack:<16} | {r.tokens:>7} {r.tokens_per_s:>8.0f} | "
            f"{r.p50_ms:>8.1f} {r.p99_ms:>8.1f} | {vs}"
        )
    top = max((r.concurrency for r in report.runs), default=0)
    b, g = by.get((top, "ballast")), by.get((top, "generate"))
    if b and g:
        ratio = b.tokens_per_s / g.tokens_per_s
        mark = "ok" if ratio >= THROUGHPUT_TARGET_RATIO else "MISSED"
        lines.append(f"target: ballast tok/s >= {THROUGHPUT_TARGET_RATIO}x generate's at {top}: {ratio:.2f}x {mark}")
    if report.shorts:
        s0 = report.shorts[0]
        lines.append("")
        lines.append(f"short request ({SHORT_TOKENS} tokens) alone vs beside {s0.beside} long ones, p99 of each:")
        for s in report.shorts:
            target = ""
            if s.stack == "ballast":
                target = (
                    f"  target <= {SHORT_P99_TARGET_RATIO}x: {'ok' if s.ratio <= SHORT_P99_TARGET_RATIO else 'MISSED'}"
                )
            lines.append(
                f"  {s.stack:<16} alone {pct(s.alone_s, 0.99) * 1e3:7.1f} ms (n={len(s.alone_s)}), beside "
                f"{pct(s.beside_s, 0.99) * 1e3:7.1f} ms (n={len(s.beside_s)}): {s.ratio:5.2f}x{target}"
            )
            if s.step_s:
                (one, a), (many, b) = sorted(s.step_s.items())
                lines.append(
                    f"  {'':<16} one decode step: {a * 1e3:.1f} ms at {one} row, {b * 1e3:.1f} ms at {many} rows "
                    f"({b / a:.2f}x: every row steps together, so no scheduler goes below this on this device)"
                )
            if s.from_join_s:
                join = pct(s.from_join_s, 0.99)
                lines.append(
                    f"  {'':<16} of which from the chunk boundary it joined at: {join * 1e3:.1f} ms "
                    f"({join / pct(s.alone_s, 0.99):.2f}x alone; the rest is the wait for that boundary)"
                )
    lines += report.notes
    return lines


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"want a comma-separated list of ints >= 1, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="a checkpoint directory (default: build the demo model)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=96, help="requests per row")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="the longest request's tokens (long: half to all of it)"
    )
    parser.add_argument("--chunk-tokens", type=int, default=4, help="ballast's steps per chunk (stream_chunk_tokens)")
    parser.add_argument("--short-trials", type=int, default=30, help="short requests alone and beside long ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--no-cb", action="store_true", help="leave transformers' continuous batching out")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's engine out")
    args = parser.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False", file=sys.stderr)
        return 1

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        path = args.model
        if path is None:
            from ballast.model.demo import DEMO_GEOMETRY, make_llama

            path = make_llama(Path(tmp) / "demo", **DEMO_GEOMETRY)
        report = run_all(
            path,
            device,
            args.concurrency,
            args.requests,
            args.max_tokens,
            args.chunk_tokens,
            args.seed,
            args.short_trials,
            with_cb=not args.no_cb,
            with_vllm=not args.no_vllm,
            log=lambda s: print(f"... {s}", file=sys.stderr, flush=True),
        )
    print("\n".join(render(report)))
    print(f"(run took {time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.2f} at the end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
