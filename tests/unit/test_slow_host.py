"""loadtest.slow_host: busy processes pinned one to a core while a benchmark runs, gone after."""

from __future__ import annotations

import os

import psutil
import pytest

from loadtest.slow_host import cores_for, slowed


def test_each_burner_is_pinned_to_its_own_core_and_gone_after_the_block():
    with slowed(1) as procs:
        (p,) = procs
        assert p.is_alive()
        pinned = psutil.Process(p.pid)  # on its core before the block runs
        assert pinned.cpu_affinity() == [cores_for(1)[0]]
        assert pinned.nice() == psutil.Process().nice()  # normal priority: it competes
    assert not p.is_alive()
    with slowed(0) as none:
        assert none == []


def test_a_burner_stops_by_itself_at_its_longest_life():
    with slowed(1, max_s=0.0) as procs:
        procs[0].join(30)  # its first look at the clock ends it
        assert procs[0].exitcode == 0


def test_more_busy_cores_than_the_host_has_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="busy cores on this host"):
        cores_for(len(os.sched_getaffinity(0)) + 1)
    with pytest.raises(ValueError):
        cores_for(0)
