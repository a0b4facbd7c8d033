"""The GPU paths for real: the model on CUDA, NVML, and the VRAM watchdog.

Needs a CUDA device (``torch.cuda.is_available()``); without one it says so and exits 1.
Three parts, printed from one run:

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
   process really allocates CUDA memory between samples. Time is simulated (each
   sample is ``--sample-s`` later on an injected clock) so that an hour-long leak
   window passes in seconds; the memory is not. Three cases: steady (decode work,
   no leak), a slow leak and a fast one; for each, the slope the watchdog measured
   against the rate allocated, its time-to-limit against the truth, and the rungs of
   the action ladder it took. The leaked memory is freed after each case.

Run: ``make bench-gpu`` (about a minute on an H200).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Optional

MB = 1024 * 1024


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


def decode_costs(backend: Any, rows_list: list[int], reps: int, sync: Any) -> dict[int, float]:
    """Median seconds of a 4-step chunk with ``rows`` short rows generating."""
    import torch

    out: dict[int, float] = {}
    with torch.inference_mode():
        for rows in rows_list:
            lb = backend.open_batch()
            lb.run_chunk([(i, backend.encode("quiet tenant", 16), 400) for i in range(rows)], 1)
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                lb.run_chunk([], 4)
                sync()
                times.append(time.perf_counter() - t0)
            out[rows] = statistics.median(times)
    return out


def join_cost(backend: Any, reps: int, sync: Any) -> dict[str, float]:
    """A 4-step chunk of two short rows: alone, with a wide row in the batch, and as the wide row joins."""
    import torch

    q = lambda k: (k, backend.encode("quiet tenant", 16), 16)  # noqa: E731
    n = lambda k: (k, backend.encode("n" * 28, 32), 32)  # noqa: E731
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


def watchdog_case(
    name: str, settings: Any, probe: Any, backend: Any, mb_per_sample: float, samples: int, sample_s: float
) -> dict[str, Any]:
    """Sample this process ``samples`` times, allocating ``mb_per_sample`` of CUDA memory between samples."""
    import torch

    from ballast.control.watchdog import PsutilSampler, WatchdogCore

    clock = [0.0]
    core = WatchdogCore(
        settings, {"replica_id": f"bench-{name}"}, PsutilSampler(os.getpid()), gpu=probe, clock=lambda: clock[0]
    )
    leak: list[Any] = []
    first_leak_at: Optional[float] = None
    rungs: list[tuple[float, str]] = []
    seen_actions: dict[str, int] = {}
    report: dict[str, Any] = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        lb = backend.open_batch()
        for i in range(samples):
            if mb_per_sample > 0:
                t = torch.empty(int(mb_per_sample * MB), dtype=torch.uint8, device=backend.device)
                t.fill_(1)  # touched: the allocator's pages are in use, not just reserved
                leak.append(t)
            else:  # steady: real decode work churning the caching allocator
                if lb.size == 0:
                    lb.run_chunk([(j, backend.encode(f"steady {i}", 16), 64) for j in range(8)], 1)
                lb.run_chunk([], 4)
            torch.cuda.synchronize()
            clock[0] += sample_s
            report = core.sample()
            trend = report["trends"].get("vram_bytes", {})
            if trend.get("leaking") and first_leak_at is None:
                first_leak_at = clock[0]
            for action, count in report["actions_total"].items():
                if count > seen_actions.get(action, 0):
                    rungs.append((clock[0], action))
            seen_actions = dict(report["actions_total"])
    wall_s = time.perf_counter() - t0
    leaked = sum(t.numel() for t in leak)
    del leak
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    after = probe.sample()
    trend = report["trends"].get("vram_bytes", {})
    rate_per_h = mb_per_sample * MB * 3600.0 / sample_s
    vram = report["vram_bytes"]
    total = report["vram_total_bytes"]
    true_tto = (total - vram) / (rate_per_h / 3600.0) if rate_per_h > 0 and vram is not None else None
    return {
        "name": name,
        "rate_mb_per_h": rate_per_h / MB,
        "slope_mb_per_h": (trend.get("slope_per_h") or 0.0) / MB if trend else None,
        "r2": trend.get("r2") if trend else None,
        "leaking": bool(trend.get("leaking")) if trend else False,
        "first_leak_at_s": first_leak_at,
        "tto_s": trend.get("time_to_limit_s") if trend else None,
        "true_tto_s": true_tto,
        "rungs": rungs,
        "ready": report["ready"],
        "recycle": report["recycle_requested"],
        "reason": report["action_reason"],
        "vram_end_mb": (vram or 0) / MB,
        "vram_after_free_mb": (after.process_vram_bytes or 0) / MB if after is not None else None,
        "leaked_mb": leaked / MB,
        "sim_s": samples * sample_s,
        "wall_s": wall_s,
    }


def _fmt_s(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v / 3600:.2f} h" if v >= 3600 else f"{v:.0f} s"


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="cluster/local.yaml")
    parser.add_argument("--rows", default="1,2,3,4,8,16,32")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sample-s", type=float, default=30.0, help="simulated seconds between watchdog samples")
    parser.add_argument("--samples", type=int, default=80, help="watchdog samples per case")
    parser.add_argument("--slow-mb", type=float, default=25.0, help="MB allocated per sample, slow leak")
    parser.add_argument("--fast-mb", type=float, default=500.0, help="MB allocated per sample, fast leak")
    args = parser.parse_args(argv)

    import torch

    from ballast.config import load_config
    from ballast.control.gpu import make_gpu_probe, make_process_gpu_probe, visible_gpu_uuid
    from ballast.model.engine import build_engine

    if not torch.cuda.is_available():
        print("bench-gpu needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 1
    cfg = load_config(args.config)
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); CPU threads {torch.get_num_threads()}"
    )

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
        f"\n1. decode, 4-step chunk, model d_model={a.d_model} n_layers={a.n_layers} ({cpu.parameter_count:,} params)"
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
    del cpu

    print("\n2. NVML")
    dev_probe = make_gpu_probe(gpu.device)
    s = dev_probe.sample() if dev_probe else None
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
        print("   no per-process VRAM from NVML: the watchdog's VRAM series would be absent here")
        return 1

    settings = cfg.watchdog.model_copy(update={"warmup_s": 0.0})
    print(
        f"\n3. VRAM watchdog, real NVML and real allocations; {args.samples} samples, "
        f"{args.sample_s:g} simulated s apart "
        f"(long window {settings.leak_window_s:g} s, "
        f"verdict after {settings.leak_window_s * settings.leak_min_span_ratio:g} s; "
        f"short window {settings.leak_short_window_s:g} s, verdict after {settings.leak_short_min_span_s:g} s within "
        f"{_fmt_s(settings.leak_short_horizon_s)} of the limit; "
        f"leak at >= {settings.vram_leak_mb_per_h:g} MB/h; ladder when time-to-limit < {_fmt_s(settings.warn_tto_s)})"
    )
    cases = [("steady", 0.0), ("slow leak", args.slow_mb), ("fast leak", args.fast_mb)]
    for name, mb in cases:
        r = watchdog_case(name, settings, proc_probe, gpu, mb, args.samples, args.sample_s)
        slope = "-" if r["slope_mb_per_h"] is None else f"{r['slope_mb_per_h']:,.0f}"
        print(
            f"   {name:<10} allocated {r['rate_mb_per_h']:>9,.0f} MB/h | measured {slope:>9} MB/h "
            f"(r2 {r['r2'] if r['r2'] is None else round(r['r2'], 3)}) "
            f"| leaking {r['leaking']} (first at {_fmt_s(r['first_leak_at_s'])}) | time-to-limit {_fmt_s(r['tto_s'])} "
            f"(truth {_fmt_s(r['true_tto_s'])})"
        )
        rungs = ", ".join(f"{a} at {_fmt_s(t)}" for t, a in r["rungs"]) or "none"
        print(f"   {'':<10} rungs: {rungs}; ready {r['ready']}, recycle {r['recycle']}; reason {r['reason']!r}")
        print(
            f"   {'':<10} process VRAM {r['vram_end_mb']:,.0f} MiB at the end, "
            f"{r['vram_after_free_mb']:,.0f} MiB after freeing "
            f"{r['leaked_mb']:,.0f} MiB; {r['sim_s'] / 3600:.2f} simulated h in {r['wall_s']:.1f} s"
        )
    proc_probe.close()
    if dev_probe:
        dev_probe.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
