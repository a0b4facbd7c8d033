"""model.cpus: the config's checks, and ``pin_to_cores`` setting every thread's affinity.

The pinning runs in a child process, never in pytest's own: the child starts a second
thread first, pins to core 0 (every machine has it), and prints the affinity of each of
its threads and of one started after the pin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from ballast.config import load_config
from ballast.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LINUX = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )


class TestConfig:
    def test_cores_are_taken_for_the_model_and_each_served_model(self) -> None:
        cfg = load_config({"model": {"cpus": [1]}})
        assert cfg.model.cpus == [1]
        assert cfg.models[0].cpus == [1]

    def test_no_cores_by_default(self) -> None:
        cfg = load_config({})
        assert cfg.model.cpus is None
        assert cfg.models[0].cpus is None

    @pytest.mark.parametrize(
        ("cpus", "says"),
        [([], "at least one core"), ([0, -1], "[-1]"), ([2, 0, 2], "[2] listed more than once")],
    )
    def test_bad_core_lists_are_refused_naming_cpus(self, cpus: list[int], says: str) -> None:
        with pytest.raises(ConfigError) as info:
            load_config({"model": {"cpus": cpus}})
        assert "model.cpus" in info.value.reason
        assert says in info.value.reason

    def test_a_core_beyond_this_machine_is_left_to_the_replica(self) -> None:
        # Configs are loaded on other machines than the one that serves them.
        assert load_config({"model": {"cpus": [4096]}}).model.cpus == [4096]


PIN_AND_REPORT = """
    import json, os, threading
    from ballast.model.niceness import pin_to_cores

    stop = threading.Event()
    before = threading.Thread(target=stop.wait)
    before.start()
    pinned = pin_to_cores([0])
    seen, looked = {}, threading.Event()

    def later():
        seen["after"] = sorted(os.sched_getaffinity(0))
        looked.set()
        stop.wait()

    after = threading.Thread(target=later)
    after.start()
    looked.wait()
    tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    stop.set()
    before.join(); after.join()
    print(json.dumps({"pinned": pinned, "tasks": tasks, "after": seen["after"]}))
"""


@LINUX
class TestPinToCores:
    def test_every_thread_and_a_later_one_on_the_cores_given(self) -> None:
        done = run_child(PIN_AND_REPORT)
        assert done.returncode == 0, done.stderr
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["pinned"] >= 2  # the main thread and the one started before
        assert len(out["tasks"]) >= 3  # with the one started after
        assert all(cores == [0] for cores in out["tasks"].values()), out["tasks"]
        assert out["after"] == [0]

    def test_a_core_this_machine_lacks_is_refused_and_nothing_moves(self) -> None:
        done = run_child(
            """
            import os
            from ballast.model.niceness import pin_to_cores

            mask = os.sched_getaffinity(0)
            try:
                pin_to_cores([0, os.cpu_count()])
            except ValueError as e:
                print("refused:", e)
            assert os.sched_getaffinity(0) == mask
            """
        )
        assert done.returncode == 0, done.stderr
        assert f"refused: cpus: cores [0, {os.cpu_count()}]" in done.stdout


class TestBenchModelsLayout:
    """loadtest.bench_models: B's replica on the last core, everything else on the rest."""

    def test_b_gets_the_last_core(self) -> None:
        from loadtest.bench_models import core_layout

        assert core_layout(True, 2) == ([1], "b on core 1; everything else on cores 0")
        assert core_layout(True, 4) == ([3], "b on core 3; everything else on cores 0,1,2")

    def test_nothing_pinned_when_turned_off_or_on_one_core(self) -> None:
        from loadtest.bench_models import core_layout

        assert core_layout(False, 4)[0] is None and "--no-own-core-b" in core_layout(False, 4)[1]
        assert core_layout(True, 1)[0] is None

    def test_only_b_lists_cores_in_the_config(self) -> None:
        from loadtest.bench_models import A, B, models_data

        path = str(ROOT / "cluster/local.yaml")
        cfg = load_config(models_data(path, [1]))
        assert cfg.served_model(B).cpus == [1] and cfg.served_model(A).cpus is None
        unpinned = load_config(models_data(path))
        assert unpinned.served_model(A).cpus is None and unpinned.served_model(B).cpus is None

    def test_on_by_default_and_can_be_turned_off(self) -> None:
        from loadtest.bench_models import _parser

        assert _parser().parse_args([]).own_core_b is True
        assert _parser().parse_args(["--no-own-core-b"]).own_core_b is False

    def test_the_configs_own_cores_are_dropped(self, tmp_path: Path) -> None:
        from loadtest.bench_models import A, B, models_data

        data = yaml.safe_load((ROOT / "cluster/local.yaml").read_text())
        data["model"]["cpus"] = [0]
        path = tmp_path / "pinned.yaml"
        path.write_text(yaml.safe_dump(data))
        cfg = load_config(models_data(str(path), [1]))
        assert cfg.served_model(A).cpus is None and cfg.served_model(B).cpus == [1]
