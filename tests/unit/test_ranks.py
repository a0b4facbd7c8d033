"""What a replica of a model of several ranks sets before its engine starts (its ranks'
cores on CPU, their GPU share), vLLM's executor, the engine's processes by name (psutil
faked: the fakes are named as fakes), and a dead engine holding its rows (vLLM faked)."""

from __future__ import annotations

from typing import Any

import pytest

from ballast.model.ranks import engine_processes, rank_environment, split_cores, with_executor
from ballast.policies.placement import Placement

CPU_TP2 = Placement("m", 2, 1, (("CPU", 1.0),))
GPU_TP4 = Placement("m", 4, 1, (("GPU", 1.0),), executor="ray")
HALF_GPU_TP2 = Placement("m", 2, 1, (("GPU", 0.5),), executor="ray")


def test_cores_are_split_into_a_contiguous_run_per_rank() -> None:
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([3, 2, 1, 0], 2) == [[0, 1], [2, 3]]
    assert split_cores(range(5), 2) == [[0, 1, 2], [3, 4]]  # the larger run first
    assert split_cores([4, 5, 6], 3) == [[4], [5], [6]]
    assert split_cores([7], 2) == [[7], [7]]  # fewer cores than ranks: they share
    with pytest.raises(ValueError):
        split_cores([], 2)


def test_on_cpu_each_ranks_openmp_threads_get_cores_of_their_own() -> None:
    assert rank_environment(CPU_TP2, [0, 1], {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert rank_environment(CPU_TP2, [0, 1, 2, 3], {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    pp = Placement("m", 2, 2, (("CPU", 1.0),))  # four ranks in all
    assert rank_environment(pp, range(8), {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3|4,5|6,7"}


def test_the_operators_own_binding_is_kept_and_one_rank_sets_nothing() -> None:
    assert rank_environment(CPU_TP2, [0, 1], {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == {}
    assert rank_environment(None, [0, 1], {}) == {}


def test_gpu_ranks_bind_no_cores_and_a_share_of_a_gpu_is_told_to_vllm() -> None:
    assert rank_environment(GPU_TP4, [0, 1], {}) == {}
    assert rank_environment(HALF_GPU_TP2, [0, 1], {}) == {"VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    assert rank_environment(HALF_GPU_TP2, [0, 1], {"VLLM_RAY_PER_WORKER_GPUS": "0.4"}) == {}


def test_vllm_is_told_its_executor_unless_the_config_names_one() -> None:
    assert with_executor({"dtype": "bfloat16"}, CPU_TP2) == {"dtype": "bfloat16", "distributed_executor_backend": "mp"}
    assert with_executor({}, GPU_TP4) == {"distributed_executor_backend": "ray"}
    assert with_executor({"distributed_executor_backend": "mp"}, GPU_TP4)["distributed_executor_backend"] == "mp"
    assert with_executor({"dtype": "float32"}, None) == {"dtype": "float32"}


class FakePsutil:
    """Stands in for the psutil module: processes by pid, each with a name and a command line."""

    class Error(Exception):
        pass

    def __init__(self, procs: dict[int, tuple[str, list[str]]]) -> None:
        self.procs = procs

    def Process(self, pid: int) -> Any:  # noqa: N802 - psutil's name
        if pid not in self.procs:
            raise self.Error(pid)
        name, cmdline = self.procs[pid]
        fake = type("FakeProcess", (), {"name": lambda _: name, "cmdline": lambda _: cmdline})
        return fake()


def test_the_engines_processes_by_the_names_vllm_gives_them() -> None:
    fake = FakePsutil(
        {
            10: ("VLLM::EngineCore", ["VLLM::EngineCore"]),
            11: ("VLLM::Worker_TP0", ["VLLM::Worker_TP0"]),
            12: ("python", ["ray::RayWorkerWrapper.execute_method", "x"]),
        }
    )
    assert engine_processes([10, 11, 12, 13], psutil_module=fake) == (
        (10, "VLLM::EngineCore"),
        (11, "VLLM::Worker_TP0"),
        (12, "ray::RayWorkerWrapper.execute_method"),  # 13 is gone: not listed
    )


class TestADeadEngineFailsNoRow:
    """vLLM's engine dead (a rank or its core gone): the rows wait for the replica to go as a
    whole (their requests are then sent elsewhere), where a row's own fault fails that row."""

    class FakeLLM:
        """Stands in for vLLM's AsyncLLM: every generate fails with ``error``."""

        def __init__(self, error: BaseException) -> None:
            self.error = error

        async def generate(self, *args, **kwargs):
            raise self.error
            yield  # an async generator, as AsyncLLM.generate is

    def pump(self, error: BaseException):
        import asyncio
        from types import SimpleNamespace

        from ballast.model.protocol import GREEDY
        from ballast.model.vllm_batch import Row, VLLMBatch

        died: list[str] = []  # what the batch told its engine
        engine = SimpleNamespace(llm=self.FakeLLM(error), name="tiny-tp", engine_died=died.append)
        batch = VLLMBatch(engine, "b1")
        row = Row(0, "b1-0", GREEDY)
        asyncio.run(batch._pump(row, None, None, None, 0))
        return died, row

    def test_engine_dead_holds_the_row_and_says_why(self) -> None:
        pytest.importorskip("vllm")
        from vllm.v1.engine.exceptions import EngineDeadError

        died, row = self.pump(EngineDeadError())
        assert (row.finished, row.error) == (False, None)
        assert len(died) == 1 and died[0].startswith("EngineDeadError: EngineCore encountered an issue")

    def test_a_rows_own_failure_still_fails_that_row(self) -> None:
        pytest.importorskip("vllm")
        died, row = self.pump(ValueError("bad logits"))
        assert row.finished and isinstance(row.error, ValueError) and died == []
