"""Pure parts of ballast.model.server (the replica itself runs in the integration suite)."""

import pytest

from ballast.policies.window import CountWindow
from ballast.model.server import WAIT_WINDOW_S, WINDOW, recent_percentile


def stamped(samples: list[tuple[float, float]]) -> CountWindow[float]:
    """A replica's wait window holding (stamp, value) samples, oldest first."""
    window: CountWindow[float] = CountWindow(WINDOW)
    for at_s, value in samples:
        window.add(value, at_s)
    return window


def test_queue_wait_p95_forgets_waits_older_than_the_window():
    # A burst of 5 s waits, then nothing admitted (level 4 sheds all): the burst must age
    # out, or the replica keeps reporting it and holds the level up by itself.
    waits = stamped([(float(t), 5000.0) for t in range(20)])
    assert recent_percentile(waits, 20.0, WAIT_WINDOW_S, 0.95) == 5000.0
    assert recent_percentile(waits, 20.0 + WAIT_WINDOW_S + 0.5, WAIT_WINDOW_S, 0.95) is None
    assert len(waits) == 0  # dropped, not just skipped


def test_queue_wait_p95_of_recent_samples():
    waits = stamped([(100.0 + i * 0.01, float(i)) for i in range(100)])
    assert recent_percentile(waits, 101.0, WAIT_WINDOW_S, 0.95) == 95.0
    assert recent_percentile(stamped([]), 0.0, WAIT_WINDOW_S, 0.95) is None


def test_a_cpu_replica_takes_its_configured_torch_threads():
    import torch

    from ballast.config import ModelConfig
    from ballast.model.engine import build_engine

    before = torch.get_num_threads()
    small = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 64}
    try:
        torch.set_num_threads(2)
        build_engine(ModelConfig(device="cpu", architecture=small, cpu_threads=1))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        build_engine(ModelConfig(device="cpu", architecture=small, cpu_threads=None))  # None: torch's own choice
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# -- the replica carries out its scheduler's decision (ballast/policies/scheduler.py) ----------------


class _Decoder:
    def feed(self, ids, final=False):
        return ""


def _bare_replica(kv_budget_tokens: int, batch_limit: int):
    """A ModelServer with only what ``_step`` and ``_timed_out`` read (no Ray, no model)."""
    from ballast.policies.scheduler import SchedulerConfig
    from ballast.model.server import ModelServer

    s = ModelServer.__new__(ModelServer)
    s._sched = SchedulerConfig(kv_budget_tokens=kv_budget_tokens, context_tokens=64)
    s._waiting, s._active, s._evict = {}, {}, []
    s._queued = s._running = s._kv_reserved = 0
    s._batch_limit = batch_limit
    s._waits_ms = CountWindow(WINDOW)
    s._progress_at_s = 0.0
    return s


def _enqueue(s, key: int, prompt: int, max_tokens: int, at_s: float, deadline_s: float):
    from ballast.model.server import _Item

    it = _Item(list(range(prompt)), max_tokens, enqueued_at_s=at_s, deadline_s=deadline_s, decoder=_Decoder(), key=key)
    s._waiting[key] = it
    s._queued += 1
    return it


def test_the_replica_moves_rows_and_reserves_kv_as_its_scheduler_decides():
    from ballast.model.server import _DEADLINE_MARK

    s = _bare_replica(kv_budget_tokens=100, batch_limit=2)
    first = _enqueue(s, 1, 10, 30, at_s=0.0, deadline_s=10.0)
    late = _enqueue(s, 2, 10, 30, at_s=0.5, deadline_s=1.0)
    third = _enqueue(s, 3, 20, 40, at_s=1.0, deadline_s=10.0)
    s._evict = [7]  # a row a stop string ended: the batch drops it with the others

    leaving, joins = s._step(2.0)
    assert leaving == [7]
    assert [j[0] for j in joins] == [1, 3] and joins[0] == (1, first.ids, 30, None)
    assert late.out.get_nowait() == _DEADLINE_MARK and not late.started  # dropped, no prefill
    assert (s._queued, s._running, s._kv_reserved) == (0, 2, 100) and sorted(s._active) == [1, 3]
    assert third.started and third.queue_wait_ms == 1000.0 and list(s._waits_ms) == [2000.0, 1000.0]

    first.cancelled = True  # its caller left: it leaves at the next boundary, answered with nothing
    fourth = _enqueue(s, 4, 10, 30, at_s=3.0, deadline_s=10.0)
    leaving, joins = s._step(4.0)
    assert leaving == [1] and [j[0] for j in joins] == [4]
    assert first.out.empty()
    assert (s._queued, s._running, s._kv_reserved) == (0, 2, 100) and fourth.started

    leaving, joins = s._step(11.0)  # both deadlines passed while running
    assert sorted(leaving) == [3, 4] and joins == []
    assert third.out.get_nowait() == _DEADLINE_MARK and fourth.out.get_nowait() == _DEADLINE_MARK
    assert (s._running, s._kv_reserved, s._active) == (0, 0, {})


def test_a_timed_out_request_is_a_stall_only_when_no_step_came_for_stall_s():
    from ballast.policies.scheduler import STALL_S
    from ballast.errors import DeadlineExceeded
    from ballast.model.server import ModelStalled

    s = _bare_replica(kv_budget_tokens=100, batch_limit=1)
    it = _enqueue(s, 1, 10, 30, at_s=100.0, deadline_s=105.0)
    s._progress_at_s = 104.5
    assert isinstance(s._timed_out(it, 5.0, 105.0), DeadlineExceeded)
    s._progress_at_s = 105.0 - STALL_S - 0.5
    err = s._timed_out(it, 5.0, 105.0)
    assert isinstance(err, ModelStalled) and "no decode step for 1.5s" in str(err)


class _FakeBatch:
    """``LiveBatch``'s face: each row emits one token a step until it has its max_tokens."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # key -> tokens still to emit
        self.removed: list[int] = []

    def keys(self) -> list[int]:
        return list(self.rows)

    def remove(self, keys) -> None:
        self.removed += [k for k in keys if self.rows.pop(k, None) is not None]

    def take_failed(self) -> dict:
        return {}

    def run_chunk(self, joins, steps: int) -> dict[int, list[int]]:
        self.rows.update((key, n) for key, _ids, n, *_ in joins)
        out = {}
        for key, left in list(self.rows.items()):
            out[key] = [5] * min(steps, left)
            self.rows[key] = left - len(out[key])
            if self.rows[key] == 0:
                del self.rows[key]
        return out


def _looping_replica():
    """A bare replica with what its engine loop reads, over ``_FakeBatch``."""
    import asyncio
    from types import SimpleNamespace

    s = _bare_replica(kv_budget_tokens=1_000_000, batch_limit=4)

    async def no_stall() -> None:
        return None

    s._model_cfg = SimpleNamespace(stream_chunk_tokens=2, batch_wait_timeout_s=0)
    s._chaos = SimpleNamespace(stall_point=no_stall)
    s._backend = SimpleNamespace(eos_ids=set())
    s._m_batch = SimpleNamespace(observe=lambda n: None)
    s._m_tokens = SimpleNamespace(inc=lambda n: None)
    s._batch = _FakeBatch()
    s._wake = asyncio.Event()
    s._progress = s._batches = 0
    s._batch_sizes = CountWindow(WINDOW)
    return s


async def _until(predicate, what: str) -> None:
    import asyncio

    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_row_that_leaves_an_otherwise_empty_batch_is_dropped_before_the_next_chunk():
    import asyncio

    s = _looping_replica()
    alone = _enqueue(s, 1, 4, 100_000, at_s=0.0, deadline_s=1e12)
    engine = asyncio.get_running_loop().create_task(s._engine())
    try:
        s._wake.set()
        await alone.out.get()  # it decodes
        alone.cancelled = True  # its caller left, and nothing else is waiting or running
        s._wake.set()
        await _until(lambda: not s._active and not s._wake.is_set(), "the loop went idle")
        nxt = _enqueue(s, 2, 4, 3, at_s=0.0, deadline_s=1e12)
        s._wake.set()
        chunks = [await nxt.out.get() for _ in range(3)]
        assert chunks[-1] is None and chunks[-2]["finish_reason"] == "length"
        assert 1 in s._batch.removed and 1 not in s._batch.rows  # not decoded beside row 2
        assert list(s._batch_sizes)[-2:] == [1, 1]
    finally:
        engine.cancel()


async def test_a_row_the_batch_fails_alone_fails_its_request_only_and_the_others_finish_whole():
    # The real built-in engine's batch: four rows join one chunk, one of them with a prompt id
    # outside the vocabulary (a batch-level poison the replica's own checks would refuse
    # first). That request gets a 400 ENGINE_REFUSED; the other three get every token,
    # the same tokens as each alone.
    import asyncio

    from ballast.errors import EngineRefused
    from ballast.model.builtin_checkpoint import BackendSpec, load_backend
    from ballast.model.builtin_decoder import TinyDecoderConfig

    backend = load_backend(
        BackendSpec(
            config=TinyDecoderConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64),
            device="cpu",
            compile="eager",
        )
    )
    s = _looping_replica()
    s._backend, s._batch = backend, backend.open_batch()
    s._run_chunk = lambda leaving, joins, steps: (s._batch.remove(leaving), s._batch.run_chunk(joins, steps))[1]
    prompts = {1: [72, 105], 2: [65, 66, 67], 3: [999, 1], 4: [120]}
    rows = {k: _enqueue(s, k, 0, 6, at_s=0.0, deadline_s=1e12) for k in prompts}
    for k, it in rows.items():
        it.ids = prompts[k]
    engine = asyncio.get_running_loop().create_task(s._engine())
    try:
        s._wake.set()
        got = {}
        for k, it in rows.items():
            chunks = []
            while (c := await asyncio.wait_for(it.out.get(), 30)) is not None and not isinstance(c, BaseException):
                chunks.append(c)
            got[k] = c if isinstance(c, BaseException) else [i for ch in chunks for i in ch["ids"]]
        assert isinstance(got[3], EngineRefused) and got[3].field == "prompt" and got[3].status == 400
        for k in (1, 2, 4):
            alone = backend.open_batch()
            assert got[k] == alone.run_chunk([(k, prompts[k], 6)], 6)[k], k
        assert not s._active and s._running == 0
    finally:
        engine.cancel()


def test_a_requests_own_values_are_refused_at_submit_naming_the_field():
    from ballast.errors import EngineRefused
    from ballast.model.server import _sampling, continue_ids

    assert continue_ids([0, 5, 255], 256) == [0, 5, 255]
    for bad in ([0, 256], [-1], [True], ["7"], "12"):
        with pytest.raises(EngineRefused) as e:
            continue_ids(bad, 256)
        assert e.value.field == "continue_ids" and e.value.status == 400
    for req, field in (
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"top_p": 1.5}, "top_p"),
    ):
        with pytest.raises(EngineRefused) as e:
            _sampling(req)
        assert e.value.field == field
    assert _sampling({"temperature": 1e-40}).temperature == 0.0 and _sampling({}) is None
