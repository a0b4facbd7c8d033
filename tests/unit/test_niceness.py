"""ballast/model/niceness.py: a model replica yields the CPU, on every thread it has.

Run in a child process: niceness cannot be lowered again without privilege, and the
test process must keep its own."""

import subprocess
import sys

import pytest

from ballast.config import load_config

CHILD = """
import os, threading
from ballast.model.niceness import niceness, yield_cpu_to
def threads():  # a thread that has just ended may still be listed, and vanish while read
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            out.append(niceness(int(tid)))
        except ProcessLookupError:
            pass
    return sorted(out)
started, stop = threading.Event(), threading.Event()
def run():
    started.set(); stop.wait()
t = threading.Thread(target=run, daemon=True); t.start(); started.wait()   # a thread already running
try:
    before = threads()
    moved = yield_cpu_to({target})
    again = yield_cpu_to({target})  # nothing left to move
    after = threads()
    later = []
    t2 = threading.Thread(target=lambda: later.append(niceness()), daemon=True); t2.start(); t2.join()  # started after
    print(before, moved, again, after, later)
finally:
    stop.set()
"""


def child(target: int) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(target=target)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_every_thread_yields_and_threads_started_later_inherit_it():
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 11:
        pytest.skip(f"this process already runs at niceness {base}")
    assert child(12) == f"[{base}, {base}] 2 0 [12, 12] [12]"


def test_it_never_lowers_a_niceness_and_checks_its_range():
    from ballast.model.niceness import yield_cpu_to

    assert child(0).split()[2:4] == ["0", "0"]  # already at or above 0: nothing moved
    with pytest.raises(ValueError, match="0..19"):
        yield_cpu_to(20)


def test_model_replicas_default_to_the_normal_priority():
    cfg = load_config({})
    assert cfg.model.niceness == 0
    assert load_config({"model": {"niceness": 15}}).model.niceness == 15
    with pytest.raises(ValueError):
        load_config({"model": {"niceness": -1}})


def test_only_the_compute_thread_yields():
    """``model.compute_niceness``: the one thread the engine's chunks run on moves itself;
    the thread that made it and its other threads keep theirs. (In this process: the
    thread moved is the pool's own, and it ends with the pool.)"""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ballast.model.niceness import niceness, yield_this_thread_to

    here = niceness(threading.get_native_id())
    with ThreadPoolExecutor(1, initializer=yield_this_thread_to, initargs=(max(here, 7),)) as compute:
        first = compute.submit(lambda: (threading.get_native_id(), niceness(threading.get_native_id()))).result()
        again = compute.submit(lambda: yield_this_thread_to(max(here, 7))).result()
    assert first[1] == max(here, 7) and again is False  # already there: nothing moved
    assert first[0] != threading.get_native_id() and niceness(threading.get_native_id()) == here
    with pytest.raises(ValueError, match="compute_niceness"):
        yield_this_thread_to(20)


def test_compute_niceness_may_not_be_below_the_replicas():
    assert load_config({"model": {"niceness": 5, "compute_niceness": 10}}).model.compute_niceness == 10
    assert load_config({}).model.compute_niceness is None
    with pytest.raises(Exception, match="compute_niceness 3 is below niceness 5"):
        load_config({"model": {"niceness": 5, "compute_niceness": 3}})
