"""How fast this machine runs the benchmark's own model right now, in rows per second.

On the shared 2-core host the same model in the same process answers 52 to 66 rows
a second from one minute to the next with nothing else running (16 staggered rows,
4-token chunks; measured 2026-11-25). A benchmark that measures C first and its
phases minutes later reads that drift as the stack's doing. ``rows_per_second``
runs a fixed piece of the replica's own work (its ``LiveBatch``: rows joining and
leaving between chunks, as under load) in the calling process, on one torch
thread like the replica, so a phase's speed over C's speed says how much of a
goodput / C ratio is the machine. It takes about two seconds; run it
while the stack is idle. ``SpeedProbeProcess`` runs it in a process of its own: run in
the load generator's process it left the generator sending up to ~100 ms late (p99)
in the phase after it.
"""

from __future__ import annotations

import time
from typing import Any

from ballast.model.protocol import Join

ROWS = 16  # rows in the batch, about what the gate lets through at C on this host
CHUNK_TOKENS = 4
NEW_TOKENS = 32
PROMPT = "The quick brown fox jumps over the lazy dog"


class SpeedProbeProcess:
    """A :class:`SpeedProbe` in a process of its own (spawned once), so that timing the
    machine leaves the calling process as it was: no torch threads, no GIL held, no
    garbage its collector would sweep mid-phase. ``rows_per_second`` blocks; call it
    from a thread (``asyncio.to_thread``) in an event loop."""

    def __init__(self, architecture: dict[str, Any], seed: int = 0) -> None:
        import concurrent.futures
        import multiprocessing

        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_probe,
            initargs=(architecture, seed),
        )

    def rows_per_second(self) -> float:
        return self._pool.submit(_probe_rows_per_second).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_PROBE: SpeedProbe | None = None  # the probe process's own


def _start_probe(architecture: dict[str, Any], seed: int) -> None:
    global _PROBE
    _PROBE = SpeedProbe(architecture, seed)


def _probe_rows_per_second() -> float:
    assert _PROBE is not None
    return _PROBE.rows_per_second()


class SpeedProbe:
    """The model built once; ``rows_per_second`` measures the machine now."""

    def __init__(self, architecture: dict[str, Any], seed: int = 0) -> None:
        import torch

        from ballast.model.builtin_decoder import TinyDecoderConfig, build_tiny_decoder
        from ballast.model.builtin_engine import TorchDecoderBackend

        self._torch = torch
        cfg = TinyDecoderConfig(**architecture)
        self._backend = TorchDecoderBackend(build_tiny_decoder(cfg, seed), name="speed", device="cpu", source="speed")
        self._ids = self._backend.text.encode(PROMPT, NEW_TOKENS)
        self.rows_per_second(rows_done=ROWS)  # warm-up

    def rows_per_second(self, rows_done: int = 6 * ROWS) -> float:
        """Rows finished per second over ``rows_done`` rows, the batch kept at ``ROWS``
        with its rows staggered (each chunk, some leave and as many join)."""
        torch = self._torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the replica runs (model.cpu_threads)
        try:
            batch = self._backend.open_batch()
            # Staggered from the start: row j asks for 1 + 32 j / 16 tokens, so rows
            # finish in different chunks and each replacement keeps the stagger.
            joins = [Join(j, self._ids, 1 + (NEW_TOKENS * j) // ROWS) for j in range(ROWS)]
            key, done, started = ROWS, 0, None
            while done < ROWS + rows_done:
                with torch.inference_mode():
                    out = batch.run_chunk(joins, CHUNK_TOKENS)
                alive = set(batch.keys())
                joins = []
                for k in out:
                    if k in alive:
                        continue
                    done += 1
                    if done == ROWS:  # the first batch's rows are out: steady from here
                        started = time.perf_counter()
                    key += 1
                    joins.append(Join(key, self._ids, NEW_TOKENS))
            assert started is not None
            return rows_done / (time.perf_counter() - started)
        finally:
            torch.set_num_threads(threads)
