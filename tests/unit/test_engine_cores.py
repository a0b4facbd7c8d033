"""loadtest.engine_cores: the engine's own core, this process and its children off it."""

from __future__ import annotations

import os

import pytest

from loadtest.engine_cores import OMP_BIND, engine_core, engine_cpu


def test_the_engine_gets_the_last_core_and_the_rest_keep_the_others():
    assert engine_core([0, 1]) == (1, {0})
    assert engine_core({5, 2, 9, 3}) == (9, {2, 3, 5})
    assert engine_core([4]) is None  # one core: nothing to keep apart
    assert engine_core([]) is None


def test_shared_placement_changes_neither_the_mask_nor_the_environment(monkeypatch):
    monkeypatch.delenv(OMP_BIND, raising=False)
    before = os.sched_getaffinity(0)
    with engine_cpu("shared") as placement:
        assert os.sched_getaffinity(0) == before and OMP_BIND not in os.environ
    assert "shared" in placement.words and placement.core is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to keep one apart")
def test_own_placement_binds_the_worker_apart_and_restores_both(monkeypatch):
    monkeypatch.delenv(OMP_BIND, raising=False)
    before = os.sched_getaffinity(0)
    core, rest = engine_core(before) or (None, set())
    with engine_cpu("own") as placement:
        assert os.environ[OMP_BIND] == str(core)
        assert os.sched_getaffinity(0) == rest and core not in os.sched_getaffinity(0)
        assert f"core {core} alone" in placement.words and placement.core == core
    assert os.sched_getaffinity(0) == before and OMP_BIND not in os.environ


def test_a_bind_the_operator_set_is_kept(monkeypatch):
    monkeypatch.setenv(OMP_BIND, "0")
    before = os.sched_getaffinity(0)
    with engine_cpu("own") as placement:
        assert os.sched_getaffinity(0) == before and os.environ[OMP_BIND] == "0"
    assert "as set" in placement.words


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="engine cpu"):
        with engine_cpu("half"):
            pass
