"""The GPU paths for real: the model on CUDA, NVML, and the VRAM watchdog.

Three sections, printed from one run. Each needs a CUDA device
(``torch.cuda.is_available()``); without one each says "skipped: no CUDA" and the run
exits 0 having measured nothing.

1. **Decode cost by batch rows, CPU and CUDA side by side.** The default model
   (``cluster/local.yaml``) built twice from the same seed; for each row count,
   the median time of a 4-step chunk, tokens per second, and the chunk in which a
   wider row (a noisy tenant's longer prompt) joins two short ones. On the 2-core CPU
   machines a third row costs the others ~17 % per step (#3's fairness tail); this
   says what it costs on a GPU.
2. **NVML**, as the replica (``make_gpu_probe``) and its watchdog
   (``make_process_gpu_probe``, this process's memory by PID) read it, beside
   torch's own count of what it reserved.
3. **The VRAM watchdog on real memory.** ``WatchdogCore`` with the default settings
   (warm-up off) samples this process through real NVML and psutil while the
   process really allocates CUDA memory between samples (``Leak``). Time is simulated
   (each sample is ``--sample-s`` later on an injected clock) so that an hour-long leak
   window passes in seconds; the memory is not. Three cases: steady (decode work,
   no leak), a slow leak and a fast one; for each, the slope the watchdog measured
   against the rate asked for and the rate torch's caching allocator reserved (a
   block of 10 MiB or more gets a segment of its own rounded up to 2 MiB, so a 25 MiB
   block takes 26), its time-to-limit against the truth at the reserved rate, and the
   rungs of the action ladder it took. The leaked memory is freed after each case.
   The leaks are bounded before they start: both together within half the device's
   free memory.

The watchdog section is ``watchdog_case`` and ``case_lines``, which take the probe, the
memory and the decode work as arguments: the unit suite runs them on CPU tensors with a
fake NVML (tests/unit/test_bench_gpu.py), so a change to the watchdog's interface breaks
the suite, not the next GPU run. Nothing here imports Ray or vLLM (a lent GPU machine has
neither: ``loadtest.gpu_check``).

Run: ``make bench-gpu`` (about a minute on an H200).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ballast.model.protocol import Join

MB = 1024 * 1024
SECTIONS = ("1. decode by batch rows, CPU and CUDA", "2. NVML", "3. VRAM watchdog on real allocations")
LEAK_SHARE_OF_FREE = 0.5  # both leaks together at most this share of the device's free memory


def decode_costs(backend: Any, rows_list: list[int], reps: int, sync: Callable[[], Any]) -> dict[int, float]:
    """Median seconds of a 4-step chunk with ``rows`` short rows generating."""
    import torch

    out: dict[int, float] = {}
    with torch.inference_mode():
        for rows in rows_list:
            lb = backend.open_batch()
            lb.run_chunk([Join(i, backend.text.encode("quiet tenant", 16), 400) for i in range(rows)], 1)
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                lb.run_chunk([], 4)
                sync()
                times.append(time.perf_counter() - t0)
            out[rows] = statistics.median(times)
    return out


def join_cost(backend: Any, reps: int, sync: Callable[[], Any]) -> dict[str, float]:
    """A 4-step chunk of two short rows: alone, with a wide row in the batch, and as the wide row joins."""
    import torch

    q = lambda k: Join(k, backend.text.encode("quiet tenant", 16), 16)  # noqa: E731
    n = lambda k: Join(k, backend.text.encode("n" * 28, 32), 32)  # noqa: E731
    cases = {
        "2 short rows": ([q(1), q(2)], []),
        "2 short + 1 wide row": ([q(1), q(2), n(3)], []),
        "2 short, wide row joins": ([q(1), q(2)], [n(3)]),
    }
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, (init, join) in cases.items():
            times = []
            for _ in range(reps):
                lb = backend.open_batch()
                lb.run_chunk(init, 1)
                sync()
                t0 = time.perf_counter()
                lb.run_chunk(join, 4)
                sync()
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times)
    return out


class Leak:
    """Memory a watchdog case holds on ``device``, grown block by block and freed at once.

    Each block is written (``fill_``) so that its pages are in use, not only reserved.
    ``reserved_bytes`` is what the device's allocator holds for this process (torch's
    count on CUDA), or None where it keeps no such count (CPU): then what was asked for
    is the truth.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self._blocks: list[Any] = []

    @property
    def held_bytes(self) -> int:
        """Bytes asked for by the blocks held now."""
        return sum(int(b.numel()) for b in self._blocks)

    def reserved_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.memory_reserved(self.device)) if self.device.startswith("cuda") else None

    def grow(self, mb: float) -> None:
        import torch

        block = torch.empty(int(mb * MB), dtype=torch.uint8, device=self.device)
        block.fill_(1)
        self._blocks.append(block)

    def free(self) -> None:
        """Drop every block and give the device's cached memory back."""
        import torch

        self._blocks.clear()
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def decode_work(backend: Any) -> Callable[[int], None]:
    """One sample's steady work: a 4-step chunk of 8 rows on ``backend``, the rows opened
    again whenever they have all finished (churning the device's caching allocator)."""
    import torch

    lb = backend.open_batch()

    def step(i: int) -> None:
        with torch.inference_mode():
            if lb.size == 0:
                lb.run_chunk([Join(j, backend.text.encode(f"steady {i}", 16), 64) for j in range(8)], 1)
            lb.run_chunk([], 4)

    return step


@dataclass(frozen=True)
class CaseResult:
    """One watchdog case: what was allocated, what the watchdog measured and did."""

    name: str
    samples: int
    sample_s: float
    asked_mb_per_h: float  # the rate the case allocated at
    reserved_mb_per_h: float | None  # the rate the allocator reserved at; None where it keeps no count
    slope_mb_per_h: float | None  # the watchdog's VRAM trend; None: no trend (no VRAM series)
    r2: float | None
    leaking: bool
    first_leak_at_s: float | None  # simulated seconds to the first leak verdict
    tto_s: float | None  # the watchdog's time to the limit at the end
    true_tto_s: float | None  # the truth: the room left at the end over the reserved (else asked) rate
    rungs: tuple[tuple[float, str], ...]  # (simulated s, action) in the order taken
    ready: bool
    recycle: bool
    reason: str | None
    vram_end_mb: float  # the process's VRAM at the last sample, as the probe read it
    vram_after_free_mb: float | None  # the same once the leak was freed
    leaked_mb: float
    wall_s: float

    @property
    def sim_s(self) -> float:
        return self.samples * self.sample_s


def watchdog_case(
    name: str,
    settings: Any,
    probe: Any,
    leak: Leak,
    mb_per_sample: float,
    samples: int,
    sample_s: float,
    work: Callable[[int], None],
    sync: Callable[[], Any] = lambda: None,
) -> CaseResult:
    """Sample this process ``samples`` times through ``WatchdogCore`` (``settings``, the
    VRAM from ``probe``), growing ``leak`` by ``mb_per_sample`` between samples, or, at 0,
    doing one step of ``work``; each sample ``sample_s`` later on the core's clock. The
    leak is freed before this returns, and the probe read once more."""
    from ballast.control.watchdog import PsutilSampler, WatchdogCore
    from ballast.policies.reports import WatchedReplica

    if samples < 2 or sample_s <= 0 or mb_per_sample < 0:
        raise ValueError(f"{name}: want samples >= 2, sample_s > 0, mb_per_sample >= 0")
    clock = [0.0]
    replica = WatchedReplica(replica_id="bench-" + re.sub(r"[^a-z0-9]+", "-", name.lower()), deployment="bench-gpu")
    core = WatchdogCore(settings, replica, PsutilSampler(os.getpid()), gpu=probe, clock=lambda: clock[0])
    first_leak_at: float | None = None
    rungs: list[tuple[float, str]] = []
    seen: dict[str, int] = {}
    leak.free()  # the device's cache of earlier work given back: the leak's blocks are new memory
    reserved0 = leak.reserved_bytes()
    t0 = time.perf_counter()
    report = None
    for i in range(samples):
        if mb_per_sample > 0:
            leak.grow(mb_per_sample)
        else:
            work(i)
        sync()
        clock[0] += sample_s
        report = core.sample()
        trend = report.trends.get("vram_bytes")
        if trend is not None and trend.leaking and first_leak_at is None:
            first_leak_at = clock[0]
        for action, count in report.actions_total.items():
            if count > seen.get(action, 0):
                rungs.append((clock[0], action))
        seen = dict(report.actions_total)
    wall_s = time.perf_counter() - t0
    assert report is not None
    reserved1 = leak.reserved_bytes()
    leaked = leak.held_bytes
    leak.free()
    after = probe.sample()
    trend = report.trends.get("vram_bytes")
    asked_per_h = mb_per_sample * MB * 3600.0 / sample_s
    span_h = samples * sample_s / 3600.0
    reserved_per_h = None if reserved0 is None or reserved1 is None else (reserved1 - reserved0) / span_h
    rate_per_h = reserved_per_h if reserved_per_h is not None else asked_per_h
    vram, total = report.vram_bytes, report.vram_total_bytes
    leaked_at_all = asked_per_h > 0 and rate_per_h > 0 and vram is not None and total is not None
    true_tto = (total - vram) * 3600.0 / rate_per_h if leaked_at_all else None  # steady: no truth to meet
    return CaseResult(
        name=name,
        samples=samples,
        sample_s=sample_s,
        asked_mb_per_h=asked_per_h / MB,
        reserved_mb_per_h=None if reserved_per_h is None else reserved_per_h / MB,
        slope_mb_per_h=None if trend is None else trend.slope_per_h / MB,
        r2=None if trend is None else trend.r2,
        leaking=bool(trend is not None and trend.leaking),
        first_leak_at_s=first_leak_at,
        tto_s=None if trend is None else trend.time_to_limit_s,
        true_tto_s=true_tto,
        rungs=tuple(rungs),
        ready=report.ready,
        recycle=report.recycle_requested,
        reason=report.action_reason,
        vram_end_mb=(vram or 0.0) / MB,
        vram_after_free_mb=(after.process_vram_bytes or 0) / MB if after is not None else None,
        leaked_mb=leaked / MB,
        wall_s=wall_s,
    )


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 3600:.2f} h" if v >= 3600 else f"{v:.0f} s"


def _fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def case_lines(r: CaseResult) -> list[str]:
    """The three printed lines of one case."""
    r2 = "-" if r.r2 is None else f"{r.r2:.3f}"
    rungs = ", ".join(f"{a} at {_fmt_s(t)}" for t, a in r.rungs) or "none"
    after = "-" if r.vram_after_free_mb is None else f"{r.vram_after_free_mb:,.0f}"
    return [
        f"   {r.name:<10} asked {r.asked_mb_per_h:>9,.0f} MB/h, reserved {_fmt_rate(r.reserved_mb_per_h):>9} MB/h "
        f"| measured {_fmt_rate(r.slope_mb_per_h):>9} MB/h (r2 {r2}) "
        f"| leaking {r.leaking} (first at {_fmt_s(r.first_leak_at_s)}) | time-to-limit {_fmt_s(r.tto_s)} "
        f"(truth {_fmt_s(r.true_tto_s)})",
        f"   {'':<10} rungs: {rungs}; ready {r.ready}, recycle {r.recycle}; reason {r.reason!r}",
        f"   {'':<10} process VRAM {r.vram_end_mb:,.0f} MiB at the end, {after} MiB after freeing "
        f"{r.leaked_mb:,.0f} MiB; {r.sim_s / 3600:.2f} simulated h in {r.wall_s:.1f} s",
    ]


def watchdog_header(settings: Any, samples: int, sample_s: float) -> str:
    return (
        f"\n{SECTIONS[2]}: real NVML and real allocations; {samples} samples, {sample_s:g} simulated s apart "
        f"(long window {settings.leak_window_s:g} s, "
        f"verdict after {settings.leak_window_s * settings.leak_min_span_ratio:g} s; "
        f"short window {settings.leak_short_window_s:g} s, verdict after {settings.leak_short_min_span_s:g} s within "
        f"{_fmt_s(settings.leak_short_horizon_s)} of the limit; "
        f"leak at >= {settings.vram_leak_mb_per_h:g} MB/h; ladder when time-to-limit < {_fmt_s(settings.warn_tto_s)})"
    )


def leak_room_problem(free_bytes: int, mb_per_sample: Sequence[float], samples: int) -> str | None:
    """Why the leaks asked for do not fit the device (None: they do): every leak case's
    memory together at most ``LEAK_SHARE_OF_FREE`` of what is free before the first."""
    want = sum(mb_per_sample) * samples * MB
    room = free_bytes * LEAK_SHARE_OF_FREE
    if want <= room:
        return None
    return (
        f"the leaks would take {want / MB:,.0f} MiB, more than {LEAK_SHARE_OF_FREE:.0%} of the "
        f"{free_bytes / MB:,.0f} MiB free: lower --slow-mb, --fast-mb or --samples"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--config", default="cluster/local.yaml")
    parser.add_argument("--rows", default="1,2,3,4,8,16,32")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sample-s", type=float, default=30.0, help="simulated seconds between watchdog samples")
    parser.add_argument("--samples", type=int, default=80, help="watchdog samples per case")
    parser.add_argument("--slow-mb", type=float, default=25.0, help="MB allocated per sample, slow leak")
    parser.add_argument("--fast-mb", type=float, default=500.0, help="MB allocated per sample, fast leak")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        for title in SECTIONS:
            print(f"{title}: skipped: no CUDA (torch.cuda.is_available() is False)")
        return 0
    from ballast.config import load_config

    cfg = load_config(args.config)
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); CPU threads {torch.get_num_threads()}"
    )
    gpu = _decode_section(cfg, args)
    probe = _nvml_section(gpu)
    if probe is None:
        return 1
    try:
        _watchdog_section(cfg, args, probe, gpu)
    finally:
        probe.close()
    return 0


def _decode_section(cfg: Any, args: argparse.Namespace) -> Any:
    """Section 1; returns the model on CUDA, which the others use."""
    import torch

    from ballast.model.engine import build_engine

    cpu = build_engine(cfg.model.model_copy(update={"device": "cpu"}))
    gpu = build_engine(cfg.model.model_copy(update={"device": "cuda"}))
    for b in (cpu, gpu):
        b.warmup()
    rows_list = [int(r) for r in args.rows.split(",")]
    no_sync = lambda: None  # noqa: E731
    costs = {
        "cpu": decode_costs(cpu, rows_list, args.reps, no_sync),
        "cuda": decode_costs(gpu, rows_list, args.reps, torch.cuda.synchronize),
    }
    a = cfg.model.architecture
    print(
        f"\n{SECTIONS[0]}: 4-step chunk, model d_model={a.d_model} n_layers={a.n_layers} "
        f"({cpu.parameter_count:,} params)"
    )
    print(f"{'rows':>5} | {'cpu ms':>8} {'cpu tok/s':>10} | {'cuda ms':>8} {'cuda tok/s':>10} | cpu/cuda")
    for rows in rows_list:
        c, g = costs["cpu"][rows], costs["cuda"][rows]
        print(f"{rows:>5} | {c * 1e3:8.2f} {rows * 4 / c:10.0f} | {g * 1e3:8.2f} {rows * 4 / g:10.0f} | {c / g:7.1f}x")
    joins = {"cpu": join_cost(cpu, args.reps, no_sync), "cuda": join_cost(gpu, args.reps, torch.cuda.synchronize)}
    print("\n   a wide row beside two short ones (4-step chunk, ms; x = / '2 short rows')")
    for name in joins["cpu"]:
        c, g = joins["cpu"][name], joins["cuda"][name]
        base_c, base_g = joins["cpu"]["2 short rows"], joins["cuda"]["2 short rows"]
        print(f"   {name:<26} cpu {c * 1e3:6.2f} ({c / base_c:4.2f}x)   cuda {g * 1e3:6.2f} ({g / base_g:4.2f}x)")
    return gpu


def _nvml_section(gpu: Any) -> Any:
    """Section 2; returns the watchdog's probe of this process, or None (and says why)."""
    import torch

    from ballast.control.gpu import make_gpu_probe, make_process_gpu_probe, visible_gpu_uuid

    print(f"\n{SECTIONS[1]}")
    dev_probe = make_gpu_probe(gpu.device)
    s = dev_probe.sample() if dev_probe else None
    if dev_probe:
        dev_probe.close()
    uuid = visible_gpu_uuid()
    proc_probe = make_process_gpu_probe(uuid, os.getpid())
    p = proc_probe.sample() if proc_probe else None
    print(f"   replica probe: {s}")
    print(f"   GPU uuid: {uuid}")
    print(f"   watchdog probe (pid {os.getpid()}): {p}")
    print(
        f"   torch: allocated {torch.cuda.memory_allocated() / MB:.0f} MiB, "
        f"reserved {torch.cuda.memory_reserved() / MB:.0f} MiB"
        f" (NVML's per-process figure adds the CUDA context)"
    )
    if proc_probe is None or p is None or p.process_vram_bytes is None:
        print(f"{SECTIONS[2]}: not run: no per-process VRAM from NVML (the watchdog's VRAM series would be absent)")
        if proc_probe is not None:
            proc_probe.close()
        return None
    return proc_probe


def _watchdog_section(cfg: Any, args: argparse.Namespace, probe: Any, gpu: Any) -> None:
    import torch

    settings = cfg.watchdog.model_copy(update={"warmup_s": 0.0})
    print(watchdog_header(settings, args.samples, args.sample_s))
    free, _ = torch.cuda.mem_get_info()
    problem = leak_room_problem(free, (args.slow_mb, args.fast_mb), args.samples)
    if problem is not None:
        print(f"   not run: {problem}")
        return
    sync = torch.cuda.synchronize
    for name, mb in (("steady", 0.0), ("slow leak", args.slow_mb), ("fast leak", args.fast_mb)):
        work = decode_work(gpu) if mb == 0 else (lambda i: None)  # the steady batch gone before a leak
        r = watchdog_case(name, settings, probe, Leak(str(gpu.device)), mb, args.samples, args.sample_s, work, sync)
        del work
        print("\n".join(case_lines(r)))


if __name__ == "__main__":
    raise SystemExit(main())
