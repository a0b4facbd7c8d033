"""lm-evaluation-harness as a client: the same tasks through Ballast on vLLM and against
``vllm serve`` on the same model directory (``make eval-openai``).

``python -m loadtest.eval_openai [--model-dir models/demo] [--lm-eval .venv-lmeval/bin/lm_eval]``

lm-eval runs in an environment of its own (``.venv-lmeval``, ``requirements/lmeval.txt``),
as a subprocess, with its OpenAI-API models and the local tasks in ``tests/data/lmeval``
(``--include_path``; the data files are JSONL in the tree, nothing is downloaded):

- ``ballast_facts_mc``: 20 multiple-choice facts, four choices each, scored by
  log-likelihood with ``--model local-completions``: one ``/v1/completions`` request per
  choice with ``echo: true, logprobs: 1, max_tokens: 1``, the continuation's prompt
  log-probabilities summed (acc, acc_norm). Twice: the prompt sent as token ids
  (``tokenized_requests=True``, the context and continuation tokenized by lm-eval with
  the directory's tokenizer) and as text (``tokenized_requests=False``, tokenized by
  the server);
- ``ballast_facts_gen``: 5 questions answered greedily (``until`` a newline, 16 tokens at
  most) with ``--model local-chat-completions --apply_chat_template``: one
  ``/v1/chat/completions`` request each (exact_match).

The servers, one after the other (never both: the host's cores and memory are shared):

1. Ballast: the config's app (``cluster/local.yaml`` by default, with the overload bench's
   changes: ``bench_overload.bench_data``, one model replica, port 8124, the ``bench``
   tenant, whose key has no token quota, so that the run measures answers, not a quota),
   its primary model the directory on vLLM (``model.backend: vllm``), no fallback, on an
   embedded Ray;
2. vLLM's own OpenAI server (``vllm serve``'s, started as its module: ``vllm_serve_argv``)
   on the same directory, the same model name, engine settings (``ENGINE_KWARGS``) and
   port ``--vllm-port``, a subprocess in a session of its own, stopped (its process group)
   after.

``--hang-heartbeats N`` sets Ballast's ``watchdog.hang_missed_heartbeats`` (the config's
by default): on a CPU engine the first request asking for prompt log-probabilities can
take seconds without a token, which the default judges a hung replica.

The engine's settings are the same on both sides: float32, eager, a 512-token context.
Requests one at a time (``num_concurrent=1``), each tried once more at most
(``max_retries=1``); the key in ``OPENAI_API_KEY``, which lm-eval's local models send as
a bearer token (``vllm serve`` takes any). Each lm-eval run writes its results and its
samples (``--log_samples``) under ``--out`` (``.run/eval-openai/<time>/<server>/<run>``).

Compared, per run: each metric (equal as lm-eval prints them), each sample's
log-likelihoods (the largest absolute difference over every choice of every question:
random weights give near-chance scores, so the scores' equality alone would say little;
equal log-likelihoods to ~1e-3 give the same argmax) and each generated answer (the same
text). Prints a table of the metrics side by side, then one line a script reads (one
line, folded here)::

    lmeval: ballast_acc=<x> vllm_acc=<x> ballast_acc_norm=<x> vllm_acc_norm=<x>
      ballast_exact=<x> vllm_exact=<x> max_ll_abs_diff=<x> same_generations=<k>/<n> equal=<true|false>

``acc`` and ``acc_norm`` are the token-id run's; ``equal`` is true when every metric of
every run is the same on both servers and every generated answer too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = "tests/data/lmeval"  # relative to ROOT: the tasks' data_files are too
MC_TASK = "ballast_facts_mc"
GEN_TASK = "ballast_facts_gen"
SERVERS = ("ballast", "vllm")
# The engine's settings on both sides (Ballast's engine_kwargs; `vllm serve`'s flags).
ENGINE_KWARGS: Mapping[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512}
VLLM_KV_CACHE_GIB = "1"  # `vllm serve`'s CPU KV cache (VLLM_CPU_KVCACHE_SPACE); Ballast sizes its own
STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL after this


@dataclass(frozen=True)
class Run:
    """One lm-eval invocation: its lm-eval model, its task, how the prompt travels."""

    name: str
    model: str  # lm-eval's model type
    task: str
    tokenized: bool = False  # local-completions: the prompt as token ids (tokenized by lm-eval)

    @property
    def chat(self) -> bool:
        return self.model == "local-chat-completions"

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


RUNS = (
    Run("mc-ids", "local-completions", MC_TASK, tokenized=True),
    Run("mc-text", "local-completions", MC_TASK, tokenized=False),
    Run("gen-chat", "local-chat-completions", GEN_TASK),
)


@dataclass(frozen=True)
class Scores:
    """What one lm-eval run gave: its metrics (``acc``, ``acc_norm``, ``exact_match``; the
    filter's suffix and the standard errors left out), per question the log-likelihood of
    each choice (multiple choice) or the generated answer (generation), by ``doc_id``."""

    metrics: Mapping[str, float]
    loglikelihoods: Mapping[int, tuple[float, ...]]
    generations: Mapping[int, str]


@dataclass(frozen=True)
class Comparison:
    """Both servers' scores for every run, set side by side."""

    ballast: Mapping[str, Scores]
    vllm: Mapping[str, Scores]

    def metrics_equal(self) -> bool:
        return all(self.ballast[r].metrics == self.vllm[r].metrics for r in self.ballast)

    def max_ll_abs_diff(self) -> float:
        """The largest |difference| of one choice's log-likelihood over every run; inf when a
        question or choice is in one server's samples and not the other's."""
        worst = 0.0
        for run, mine in self.ballast.items():
            theirs = self.vllm[run].loglikelihoods
            if mine.loglikelihoods.keys() != theirs.keys():
                return float("inf")
            for doc, lls in mine.loglikelihoods.items():
                if len(lls) != len(theirs[doc]):
                    return float("inf")
                worst = max([worst, *(abs(a - b) for a, b in zip(lls, theirs[doc], strict=True))])
        return worst

    def same_generations(self) -> tuple[int, int]:
        """(answers the same on both servers, answers) over every run; a question one server
        answered and the other did not counts as not the same."""
        same = total = 0
        for run, mine in self.ballast.items():
            theirs = self.vllm[run].generations
            for doc in mine.generations.keys() | theirs.keys():
                total += 1
                same += doc in mine.generations and doc in theirs and mine.generations[doc] == theirs[doc]
        return same, total

    def equal(self) -> bool:
        same, total = self.same_generations()
        return self.ballast.keys() == self.vllm.keys() and self.metrics_equal() and same == total


def lm_eval_argv(lm_eval: str, run: Run, model_name: str, base_url: str, model_dir: str, out_dir: str) -> list[str]:
    """The lm-eval command line for ``run`` against the server at ``base_url`` (no path)."""
    args = [f"model={model_name}", f"base_url={base_url.rstrip('/')}{run.endpoint}"]
    if not run.chat:  # the directory's tokenizer counts the context's tokens (and sends them)
        args += [f"tokenizer={model_dir}", "tokenizer_backend=huggingface", f"tokenized_requests={run.tokenized}"]
    args += ["num_concurrent=1", "max_retries=1"]
    argv = [lm_eval, "--model", run.model, "--model_args", ",".join(args), "--tasks", run.task]
    argv += ["--include_path", TASKS_DIR, "--output_path", out_dir, "--log_samples"]
    return [*argv, "--apply_chat_template"] if run.chat else argv


def read_scores(out_dir: Path, task: str) -> Scores:
    """``task``'s scores from an lm-eval run's ``--output_path``: the last results file
    written under it and the samples file beside it."""
    results = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        raise FileNotFoundError(f"no lm-eval results under {out_dir}")
    found = json.loads(results[-1].read_text(encoding="utf-8"))["results"][task]
    metrics = {
        k.split(",")[0]: float(v)
        for k, v in found.items()
        if "," in k and "_stderr" not in k and isinstance(v, (int, float))
    }
    samples = sorted(results[-1].parent.glob(f"samples_{task}_*.jsonl"))
    if not samples:
        raise FileNotFoundError(f"no lm-eval samples of {task} beside {results[-1]}")
    lls: dict[int, tuple[float, ...]] = {}
    gens: dict[int, str] = {}
    for line in samples[-1].read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        sample = json.loads(line)
        doc, resps = int(sample["doc_id"]), sample["filtered_resps"]
        if resps and isinstance(resps[0], list):  # loglikelihood: [[ll, is_greedy], ...] per choice
            lls[doc] = tuple(float(r[0]) for r in resps)
        else:  # generate_until: [text]
            gens[doc] = str(resps[0]) if resps else ""
    return Scores(metrics, lls, gens)


def table(comparison: Comparison) -> list[str]:
    """The metrics of every run side by side, one row each."""
    rows = [f"{'run':<10} {'metric':<12} {'ballast':>9} {'vllm':>9}"]
    for run, mine in comparison.ballast.items():
        theirs = comparison.vllm[run].metrics
        for metric in sorted(mine.metrics.keys() | theirs.keys()):
            b, v = mine.metrics.get(metric, float("nan")), theirs.get(metric, float("nan"))
            rows.append(f"{run:<10} {metric:<12} {b:>9.4f} {v:>9.4f}")
    return rows


def final_line(comparison: Comparison) -> str:
    """The one line a script reads (the module docstring names its fields)."""

    def metric(side: Mapping[str, Scores], run: str, name: str) -> str:
        value = side[run].metrics.get(name) if run in side else None
        return "nan" if value is None else f"{value:.4f}"

    b, v = comparison.ballast, comparison.vllm
    same, total = comparison.same_generations()
    return (
        f"lmeval: ballast_acc={metric(b, 'mc-ids', 'acc')} vllm_acc={metric(v, 'mc-ids', 'acc')} "
        f"ballast_acc_norm={metric(b, 'mc-ids', 'acc_norm')} vllm_acc_norm={metric(v, 'mc-ids', 'acc_norm')} "
        f"ballast_exact={metric(b, 'gen-chat', 'exact_match')} vllm_exact={metric(v, 'gen-chat', 'exact_match')} "
        f"max_ll_abs_diff={comparison.max_ll_abs_diff():.2e} same_generations={same}/{total} "
        f"equal={str(comparison.equal()).lower()}"
    )


def vllm_serve_argv(python: str, model_dir: str, model_name: str, port: int) -> list[str]:
    """vLLM's OpenAI server (what ``vllm serve`` runs) on ``model_dir`` with ``ENGINE_KWARGS``
    as its flags, on loopback. Started as ``python -m vllm.entrypoints.openai.api_server``:
    the ``vllm`` command of the CPU build (package ``vllm-cpu``) fails before it parses its
    arguments, reading the version of a package named ``vllm``, which is not installed."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    argv += ["--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port)]
    for key, value in ENGINE_KWARGS.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


# --- the servers and lm-eval (not in the unit suite: they need Ray, vLLM and lm-eval) ---


def wait_ready(url: str, timeout_s: float, alive: Any = None) -> None:
    """Poll ``url`` until it answers 200, for at most ``timeout_s``; ``alive()`` False (the
    server's process ended) stops the wait at once."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"the server ended before {url} answered")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


@contextmanager
def ballast_server(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """Ballast on vLLM on an embedded Ray: yields (base URL, model name, API key)."""
    import ray

    from ballast.config import load_config, with_model_dir
    from ballast.ops.app import shutdown, start
    from loadtest.bench_overload import BASE, BENCH_KEY, PORT, VLLM_RSS_LIMIT_MB, bench_data

    data = with_model_dir(bench_data(args.config, 1), args.model_dir, "vllm")
    data["fallback"] = None
    data["model"]["engine_kwargs"] = dict(ENGINE_KWARGS)
    data.setdefault("watchdog", {})["rss_limit_mb"] = VLLM_RSS_LIMIT_MB
    if args.hang_heartbeats is not None:
        data["watchdog"]["hang_missed_heartbeats"] = args.hang_heartbeats
    cfg = load_config(data)
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        start(cfg, "127.0.0.1", PORT)
        base = BASE + cfg.route_prefix.rstrip("/")
        wait_ready(f"{base}/healthz/ready", args.start_timeout_s)
        yield base, cfg.model.name, BENCH_KEY
    finally:
        try:
            shutdown(cfg)
        finally:
            ray.shutdown()


@contextmanager
def vllm_server(args: argparse.Namespace, model_name: str, log: Path) -> Iterator[str]:
    """``vllm serve`` as a subprocess in a session of its own: yields its base URL."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB}
    argv = vllm_serve_argv(sys.executable, str(args.model_dir), model_name, args.vllm_port)
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{args.vllm_port}"
            wait_ready(f"{base}/health", args.start_timeout_s, alive=lambda: proc.poll() is None)
            yield base
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's own group (it was started in a session of its own), SIGKILL
    after ``STOP_GRACE_S``."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_lm_eval(args: argparse.Namespace, run: Run, base: str, model_name: str, key: str, out: Path) -> Scores:
    """One lm-eval run, bounded by ``--run-timeout-s``; its output goes to ``out/lm-eval.log``."""
    out.mkdir(parents=True, exist_ok=True)
    argv = lm_eval_argv(args.lm_eval, run, model_name, base, str(args.model_dir), str(out))
    env = {
        **os.environ,
        "OPENAI_API_KEY": key,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    log = out / "lm-eval.log"
    with log.open("wb") as sink:
        code = subprocess.run(
            argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=args.run_timeout_s
        )
    if code.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"lm-eval {run.name} failed (exit {code.returncode}): {' '.join(argv)}\n{tail}")
    return read_scores(out, run.task)


def evaluate(
    args: argparse.Namespace, server: str, base: str, model_name: str, key: str, out: Path
) -> dict[str, Scores]:
    scores: dict[str, Scores] = {}
    for run in RUNS:
        t0 = time.monotonic()
        scores[run.name] = run_lm_eval(args, run, base, model_name, key, out / server / run.name)
        shown = " ".join(f"{k}={v:.4f}" for k, v in sorted(scores[run.name].metrics.items()))
        print(f"{server:<8} {run.name:<9} {shown}  ({time.monotonic() - t0:.0f} s)", flush=True)
    return scores


def ensure_model(model_dir: Path) -> None:
    """The demo Llama (``ballast.model.demo``) in ``model_dir`` unless a model is there."""
    if not (model_dir / "config.json").exists():
        from ballast.model.demo import main as make_demo

        make_demo([str(model_dir)])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cluster/local.yaml")
    p.add_argument("--model-dir", type=Path, default=Path("models/demo"))
    p.add_argument("--lm-eval", default=".venv-lmeval/bin/lm_eval")
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--out", type=Path, default=None, help="default: .run/eval-openai/<time>")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=900.0)
    p.add_argument(
        "--hang-heartbeats",
        type=int,
        default=None,
        help="watchdog.hang_missed_heartbeats for Ballast's replica (default: the config's)",
    )
    args = p.parse_args(argv)
    if not 1024 <= args.vllm_port <= 65535 or args.vllm_port in (8000, 8123, 8124):
        p.error("--vllm-port 1024-65535, not 8000/8123/8124 (the stacks' ports)")
    if not Path(args.lm_eval).exists():
        p.error(f"{args.lm_eval} not found: `make eval-openai` builds .venv-lmeval")
    args.model_dir = args.model_dir.resolve()
    out = (args.out or ROOT / ".run" / "eval-openai" / time.strftime("%Y%m%dT%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model_dir)
    t0 = time.monotonic()
    with ballast_server(args) as (base, model_name, key):
        ballast = evaluate(args, "ballast", base, model_name, key, out)
    t1 = time.monotonic()
    with vllm_server(args, model_name, out / "vllm-serve.log") as base:
        vllm = evaluate(args, "vllm", base, model_name, "unused-by-vllm", out)
    t2 = time.monotonic()
    comparison = Comparison(ballast, vllm)
    for row in table(comparison):
        print(row)
    print(f"ballast {t1 - t0:.0f} s, vllm serve {t2 - t1:.0f} s (start, three lm-eval runs, stop); files in {out}")
    print(final_line(comparison), flush=True)


if __name__ == "__main__":
    main()
