"""One command for a lent GPU machine: ``python3 -m loadtest.gpu_check`` (``make gpu-check``).

For a machine with CUDA, torch, transformers, tokenizers, safetensors and NVML
(nvidia-ml-py), no network, no Ray, no vLLM and no pydantic, which receives this working
tree and nothing else. From the tree's root, in this order, each section in a process of
its own with a time bound, all of them within one budget (``--budget-s``, 8 minutes):

1. **wheels**: the packages Ballast's config needs that such a machine lacks (pydantic and
   what it imports, ``WHEELS``), installed from ``.whl/`` into a directory of their own
   that goes first on every later section's path (``pip install --no-index --no-deps
   --target``); skipped where they import already. ``--fetch-wheels``, on a machine with
   a package index, downloads them there for CPython 3.12 on manylinux x86_64, at the
   versions constraints.txt pins.
2. **environment**: the interpreter, torch and its device, each package and module the
   sections import (Ray and vLLM said to be absent, not needed), then a CPU smoke of the
   parts that run without a GPU: the config, one watchdog sample, a decode timing of the
   built-in model and bench-model's stacks on the tiny Llama. It says whether CUDA is there.
3. **bench-gpu**: ``loadtest.bench_gpu`` (decode by rows on CPU and CUDA, NVML, the VRAM
   watchdog on real allocations).
4. **bench-model, demo**: ``loadtest.bench_model --device cuda --no-vllm`` on the demo
   Llama (``ballast.model.demo``), with a lighter workload than its default
   (``BENCH_MODEL_ARGS``) so that both models fit the budget.
5. **0.7 B Llama**: a Llama of ``LLAMA_07B``'s geometry (0.72 B parameters) built from
   a ``LlamaConfig`` with random weights on the GPU in bfloat16, with the demo's
   tokenizer, and written to a temporary directory (removed at the end).
6. **bench-model, 0.7 B**: the same benchmark on it, at 8 and 32 clients.

A section that needs CUDA says "skipped: no CUDA" without it; one that runs past its
bound (or past what is left of the budget) is stopped, its process group killed, and
marked "timed out", its output so far kept. Every section's output, status and seconds
go to one figures file (``$OUT/gpu-check.md`` when ``OUT`` is set, else
``.run/gpu-check/figures.md``; ``--out`` to choose), whose last line, printed too, sums
the run up::

    gpu-check: 6 ok, 0 skipped, 0 failed, 0 timed out in 371 s (budget 480 s); figures in /out/gpu-check.md

The exit status is 0 when no section failed or timed out. ``--dry-run`` prints the plan
(each section's command and bound) and runs nothing. docs/benchmarks.md ("GPU check")
says what to carry to the machine and how to run it.

Written by hand: a runner of a few bounded subprocesses, so that one section's hang or
crash costs its bound and not the run; a task runner (make, nox) would need an install.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480.0
OUTPUT_TAIL_BYTES = 64 * 1024  # what the figures file keeps of one section's output (its end)
KILL_GRACE_S = 5.0  # between SIGTERM and SIGKILL for a section past its bound

# What Ballast's config imports that a lent machine lacks (pydantic, and what pydantic
# imports; typing_extensions too, as torch's may be older than pydantic needs), pinned by
# constraints.txt. Pure Python but pydantic_core, built for CPython 3.12 on manylinux.
WHEELS = ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions")
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# The ~0.7 B Llama: TinyLlama's widths (hidden 2048, MLP 5632, 16 heads of 128, 4 KV heads)
# at 13 layers, a 32,000-entry vocabulary (the demo tokenizer uses its first few hundred).
LLAMA_07B: dict[str, int] = dict(
    hidden=2048, intermediate=5632, layers=13, heads=16, kv_heads=4, vocab=32000, context=2048
)
# bench-model's workload here: half its default requests and about half its short trials
# (as its 0.76 B run on an H100 had), and for the 0.7 B model no single-client row (87
# tok/s there: about 30 s a stack, half the section's bound, and one row shows no
# batching), so that both fit the budget.
BENCH_MODEL_ARGS = ("--device", "cuda", "--no-vllm", "--requests", "48", "--short-trials", "16")
LLAMA_CONCURRENCY = ("--concurrency", "8,32")

CUDA_LINE = "cuda available: "  # the environment section's line that says whether CUDA is there
PROBE_MODULES = (
    "numpy",
    "psutil",
    "yaml",
    "pynvml",
    "safetensors",
    "tokenizers",
    "transformers",
    "pydantic",
    "ballast.config",
    "ballast.control.gpu",
    "ballast.control.watchdog",
    "ballast.model.engine",
    "ballast.model.hf_checkpoint",
    "ballast.model.hf_engine",
    "ballast.model.demo",
    "loadtest.bench_gpu",
    "loadtest.bench_model",
)
NOT_NEEDED = ("ray", "vllm")  # said when present; nothing here imports them


@dataclass(frozen=True)
class Section:
    """One step of the check: a command run from the tree's root, within ``bound_s``."""

    name: str
    argv: tuple[str, ...]
    bound_s: float
    needs_cuda: bool = False
    after: str | None = None  # a section that must have passed first
    skip_reason: str | None = None  # known before the run: said instead of running

    def __post_init__(self) -> None:
        if not self.name or not self.argv or not self.bound_s > 0:
            raise ValueError(f"a section needs a name, a command and a positive bound: {self!r}")


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # "ok", "failed (exit N)", "timed out after N s", "skipped: ..."
    seconds: float
    output: str
    command: str = ""

    @property
    def kind(self) -> str:
        """ok, skipped, failed or timed out: what the summary counts."""
        for kind in ("ok", "skipped", "timed out"):
            if self.status.startswith(kind):
                return kind
        return "failed"


def missing_packages() -> list[str]:
    """The packages of ``WHEELS`` that this interpreter cannot import."""
    import importlib.util

    return [name for name in WHEELS if importlib.util.find_spec(name.replace("-", "_")) is None]


def plan(python: str, wheels_dir: Path, site_dir: Path, llama_dir: Path, missing: Sequence[str]) -> list[Section]:
    """The sections in order, each with its bound (they add up to ``BUDGET_S``); the
    wheels are installed only where some of them are ``missing``."""
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    if not missing:
        wheels_skipped: str | None = "pydantic and what it imports are importable here"
    elif not wheels:
        wheels_skipped = f"no wheels in {wheels_dir}; {', '.join(missing)} will be missing"
    else:
        wheels_skipped = None
    pip = (python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir")
    me = (python, "-m", "loadtest.gpu_check")
    bench_model = (python, "-m", "loadtest.bench_model", *BENCH_MODEL_ARGS)
    return [
        Section(
            "wheels",
            (*pip, "--upgrade", "--target", str(site_dir), *(str(w) for w in wheels)),
            20,
            skip_reason=wheels_skipped,
        ),
        Section("environment", (*me, "--probe"), 40),
        Section("bench-gpu", (python, "-m", "loadtest.bench_gpu", "--config", "cluster/local.yaml"), 100, True),
        Section("bench-model, demo Llama", bench_model, 100, True),
        Section("0.7 B Llama, built", (*me, "--build-llama", str(llama_dir)), 40, True),
        Section(
            "bench-model, 0.7 B Llama",
            (*bench_model, *LLAMA_CONCURRENCY, "--model", str(llama_dir)),
            180,
            True,
            "0.7 B Llama, built",
        ),
    ]


def section_env(base: Mapping[str, str], site_dir: Path) -> dict[str, str]:
    """The sections' environment: the wheels' directory (the first section fills it) and
    the tree's root first on the path, output unbuffered (a section stopped at its bound
    keeps what it printed), and Hugging Face's libraries offline (no network: fail at once)."""
    env = dict(base)
    paths = [str(site_dir), str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _tail(path: Path, limit: int = OUTPUT_TAIL_BYTES) -> str:
    size = path.stat().st_size
    with path.open("rb") as f:
        if size > limit:
            f.seek(size - limit)
        text = f.read().decode("utf-8", errors="replace")
    return f"[the first {size - limit:,} bytes left out]\n{text}" if size > limit else text


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the section's process group, SIGKILL after ``KILL_GRACE_S``."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_section(
    section: Section, env: Mapping[str, str], bound_s: float, clock: Callable[[], float] = time.monotonic
) -> Outcome:
    """Run one section from the tree's root for at most ``bound_s``; its output (stdout
    and stderr together, the last ``OUTPUT_TAIL_BYTES``) and how it ended."""
    command = " ".join(section.argv)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        log = Path(tmp) / "output"
        t0 = clock()
        with log.open("wb") as sink:
            try:
                proc = subprocess.Popen(
                    section.argv, cwd=ROOT, env=dict(env), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                return Outcome(section.name, f"failed (cannot start: {e})", 0.0, "", command)
            try:
                code = proc.wait(timeout=bound_s)
                status = "ok" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                _stop(proc)
                status = f"timed out after {bound_s:.0f} s"
        return Outcome(section.name, status, clock() - t0, _tail(log), command)


def run_all(
    sections: Sequence[Section],
    env: Mapping[str, str],
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
    say: Callable[[str], None] = print,
) -> list[Outcome]:
    """Every section in order within ``budget_s`` in all: each bounded by its own bound
    and by what is left; one that needs CUDA is skipped unless the environment section
    said CUDA is there, one that comes ``after`` another unless that one passed."""
    deadline = clock() + budget_s
    done: dict[str, Outcome] = {}
    cuda = False
    for s in sections:
        left = deadline - clock()
        reason = _skip_reason(s, done, cuda, left)
        if reason is not None:
            outcome = Outcome(s.name, f"skipped: {reason}", 0.0, "", " ".join(s.argv))
        else:
            outcome = run_section(s, env, min(s.bound_s, left), clock)
        if s.name == "environment":
            cuda = f"{CUDA_LINE}True" in outcome.output  # said first: a module missing later fails its section
        done[s.name] = outcome
        say(f"[gpu-check] {s.name}: {outcome.status} ({outcome.seconds:.0f} s)")
    return list(done.values())


def _skip_reason(s: Section, done: Mapping[str, Outcome], cuda: bool, left_s: float) -> str | None:
    if s.skip_reason is not None:
        return s.skip_reason
    if s.needs_cuda and not cuda:
        return "no CUDA"
    if s.after is not None and (s.after not in done or done[s.after].kind != "ok"):
        return f"needs '{s.after}', which did not pass"
    if left_s < 1.0:
        return "no time left in the budget"
    return None


def summary(outcomes: Sequence[Outcome], elapsed_s: float, budget_s: float, figures: Path) -> str:
    counts = {k: sum(1 for o in outcomes if o.kind == k) for k in ("ok", "skipped", "failed", "timed out")}
    return (
        f"gpu-check: {counts['ok']} ok, {counts['skipped']} skipped, {counts['failed']} failed, "
        f"{counts['timed out']} timed out in {elapsed_s:.0f} s (budget {budget_s:.0f} s); figures in {figures}"
    )


def render(outcomes: Sequence[Outcome], header: Sequence[str], last_line: str) -> str:
    """The figures file: a header, each section's status, command and output, the summary."""
    lines = ["# gpu-check", "", *header, ""]
    for i, o in enumerate(outcomes, start=1):
        lines += [f"## {i}. {o.name}: {o.status} ({o.seconds:.0f} s)", ""]
        if o.command:
            lines += [f"`{o.command}`", ""]
        if o.output.strip():
            lines += ["```", o.output.rstrip("\n"), "```", ""]
    lines.append(last_line)
    return "\n".join(lines) + "\n"


def figures_path(out: str | None, environ: Mapping[str, str]) -> Path:
    if out:
        return Path(out)
    if environ.get("OUT"):
        return Path(environ["OUT"]) / "gpu-check.md"
    return ROOT / ".run" / "gpu-check" / "figures.md"


# ------------------------------------------------------------------- wheels, here


def pins(constraints: Path, names: Sequence[str]) -> list[str]:
    """``name==version`` for each of ``names`` as ``constraints`` pins it (names compared
    as PyPI normalizes them); ValueError naming any that is not pinned there."""

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    found: dict[str, str] = {}
    for line in constraints.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if m:
            found[norm(m.group(1))] = f"{m.group(1)}=={m.group(2)}"
    missing = [n for n in names if norm(n) not in found]
    if missing:
        raise ValueError(f"{constraints}: no pin for {', '.join(missing)}")
    return [found[norm(n)] for n in names]


def fetch_command(python: str, dest: Path, requirements: Sequence[str], python_version: str) -> list[str]:
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    return [
        python,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        *requirements,
    ]


def fetch_wheels(dest: Path, python_version: str) -> int:
    """Download ``WHEELS`` into ``dest`` (its old wheels removed first: one version of
    each, for one Python), as constraints.txt pins them."""
    requirements = pins(ROOT / "constraints.txt", WHEELS)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    code = subprocess.call(fetch_command(sys.executable, dest, requirements, python_version))
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print("\n".join(f"  {w.name}" for w in wheels))
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {dest} (for CPython {python_version})")
    return code


# --------------------------------------------------------- the sections' own commands


def probe() -> int:
    """The environment section: versions, the device, every module the sections import,
    then a CPU smoke of what runs without a GPU. Exit 1 if any of it fails."""
    import importlib
    import importlib.util
    import platform

    print(f"python {platform.python_version()} ({sys.executable}); {platform.platform()}; {os.cpu_count()} CPUs")
    try:
        import torch
    except ImportError as e:
        print(f"{CUDA_LINE}False (torch: {e})")
        return 1
    cuda = torch.cuda.is_available()
    print(f"{CUDA_LINE}{cuda}")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.get_num_threads()} threads")
    if cuda:
        p = torch.cuda.get_device_properties(0)
        print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
    failed = 0
    for name in PROBE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - each missing piece is said, and the others go on
            print(f"  {name}: MISSING ({type(e).__name__}: {e})")
            failed += 1
            continue
        version = getattr(module, "__version__", None)
        print(f"  {name}{f' {version}' if version else ''} ({Path(getattr(module, '__file__', None) or '?').parent})")
    for name in NOT_NEEDED:
        present = importlib.util.find_spec(name) is not None
        print(f"  {name}: {'present' if present else 'absent'} (not needed)")
    if failed:
        print(f"{failed} module(s) missing: the sections that import them will fail")
        return 1
    return _smoke()


def _smoke() -> int:
    """The parts that run on CPU, each timed: what a section would otherwise find broken."""
    from ballast.config import load_config
    from ballast.control.watchdog import PsutilSampler, WatchdogCore
    from ballast.model.demo import make_tiny_llama
    from ballast.model.engine import build_engine
    from ballast.policies.reports import WatchedReplica
    from loadtest import bench_gpu, bench_model

    def config() -> str:
        return f"{load_config('cluster/local.yaml').model.name!r} loaded"

    def watchdog() -> str:
        w = load_config("cluster/local.yaml").watchdog
        r = WatchdogCore(w, WatchedReplica("gpu-check", "gpu-check"), PsutilSampler(os.getpid())).sample()
        return f"rss {(r.rss_bytes or 0) / 2**20:.0f} MiB, {r.threads:.0f} threads"

    def decode() -> str:
        m = load_config("cluster/local.yaml").model
        costs = bench_gpu.decode_costs(build_engine(m.model_copy(update={"device": "cpu"})), [2], 1, lambda: None)
        return f"a 4-step chunk of 2 rows in {costs[2] * 1e3:.1f} ms"

    def stacks() -> str:
        with tempfile.TemporaryDirectory() as tmp:
            path = make_tiny_llama(Path(tmp) / "tiny")
            report = bench_model.run_all(path, "cpu", [1], 2, 8, 4, 0, 1, with_cb=False)
        return f"{len(report.runs)} rows ({', '.join(sorted({r.stack for r in report.runs}))})"

    print("CPU smoke:")
    failed = 0
    for name, step in (
        ("config", config),
        ("watchdog sample", watchdog),
        ("decode", decode),
        ("bench-model stacks", stacks),
    ):
        t0 = time.perf_counter()
        try:
            said = step()
        except Exception as e:  # noqa: BLE001 - each failure is said, and the others go on
            said, failed = f"FAILED: {type(e).__name__}: {e}", failed + 1
        print(f"  {name}: {said} ({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


def llama_config(tokenizer: Any, geometry: Mapping[str, int]) -> Any:
    """A ``LlamaConfig`` of ``geometry`` (``LLAMA_07B``'s keys) around ``tokenizer``'s special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=max(geometry["vocab"], len(tokenizer)),
        hidden_size=geometry["hidden"],
        intermediate_size=geometry["intermediate"],
        num_hidden_layers=geometry["layers"],
        num_attention_heads=geometry["heads"],
        num_key_value_heads=geometry["kv_heads"],
        max_position_embeddings=geometry["context"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_llama(
    dir: Path, geometry: Mapping[str, int] = LLAMA_07B, device: str = "cuda", dtype: str = "bfloat16"
) -> tuple[int, float, float]:
    """Write a Llama of ``geometry`` with random weights (seeded; Llama's own init), built
    on ``device`` in ``dtype``, with the demo's tokenizer, into ``dir``: (parameters,
    seconds to build, seconds to write)."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from ballast.model.demo import SEED, train_tokenizer

    tokenizer = train_tokenizer(context=geometry["context"])
    config = llama_config(tokenizer, geometry)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, dtype)).eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built_s = time.perf_counter() - t0
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    t0 = time.perf_counter()
    dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir)
    tokenizer.save_pretrained(dir)
    return sum(p.numel() for p in model.parameters()), built_s, time.perf_counter() - t0


def _build_llama_main(dir: Path) -> int:
    params, built_s, written_s = build_llama(dir)
    size = sum(f.stat().st_size for f in dir.iterdir() if f.is_file())
    g = LLAMA_07B
    print(
        f"a random Llama of {params / 1e9:.2f} B parameters (hidden {g['hidden']}, MLP {g['intermediate']}, "
        f"{g['layers']} layers, {g['heads']} heads, {g['kv_heads']} KV heads, vocabulary {g['vocab']:,}, "
        f"context {g['context']}): built on cuda in bfloat16 in {built_s:.1f} s, "
        f"written ({size / 2**30:.2f} GiB) in {written_s:.1f} s"
    )
    return 0


# ------------------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", help="the figures file (default: $OUT/gpu-check.md, else .run/gpu-check/figures.md)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's bound, seconds")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="where the wheels are (or go: --fetch-wheels)")
    p.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "ballast-gpu-check-site")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    p.add_argument("--fetch-wheels", action="store_true", help="download the wheels into --wheels, and stop")
    p.add_argument("--python-version", default="3.12", help="the wheels' Python (--fetch-wheels)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the environment section
    p.add_argument("--build-llama", type=Path, help=argparse.SUPPRESS)  # the 0.7 B section
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.probe:
        return probe()
    if args.build_llama is not None:
        return _build_llama_main(args.build_llama)
    if args.fetch_wheels:
        return fetch_wheels(args.wheels, args.python_version)
    if not 60 <= args.budget_s <= 3600:
        _parser().error("--budget-s: between 60 and 3600")
    figures = figures_path(args.out, os.environ)
    with tempfile.TemporaryDirectory(prefix="gpu-check-llama-") as tmp:
        sections = plan(sys.executable, args.wheels, args.site, Path(tmp) / "llama-0.7b", missing_packages())
        if args.dry_run:
            for i, s in enumerate(sections, start=1):
                cuda = ", needs CUDA" if s.needs_cuda else ""
                skip = f" [skipped: {s.skip_reason}]" if s.skip_reason else ""
                print(f"{i}. {s.name} (within {s.bound_s:.0f} s{cuda}){skip}: {' '.join(s.argv)}")
            print(f"budget {args.budget_s:.0f} s; figures to {figures}")
            return 0
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        t0 = time.monotonic()
        outcomes = run_all(sections, section_env(os.environ, args.site), args.budget_s)
        elapsed = time.monotonic() - t0
    last = summary(outcomes, elapsed, args.budget_s, figures)
    header = [f"started {started} on {os.uname().nodename}; budget {args.budget_s:.0f} s; tree {ROOT}"]
    figures.parent.mkdir(parents=True, exist_ok=True)
    figures.write_text(render(outcomes, header, last))
    print(last)
    return 0 if all(o.kind in ("ok", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
