"""kvmini.threads: idle cores counted by hand from two made-up readings of /proc/stat, and the choice
never above torch's default nor below one thread."""
import kvmini.threads
from kvmini.threads import fit_threads, idle_cores

# user nice system idle iowait irq softirq steal (clock ticks since boot)
BEFORE = """cpu  300 0 100 1000 0 0 0 0 0 0
cpu0 100 0 50 500 0 0 0 0 0 0
cpu1 200 0 50 500 0 0 0 0 0 0
intr 12345
"""
AFTER = """cpu  320 0 100 1010 0 0 0 0 0 0
cpu0 100 0 50 508 2 0 0 0 0 0
cpu1 220 0 50 500 0 0 0 0 0 0
intr 12399
"""


def test_idle_cores_by_hand():
    # cpu0: 10 ticks, all idle (8 idle + 2 iowait) -> 1.0; cpu1: 20 ticks of user -> 0.0
    assert idle_cores(BEFORE, AFTER, {0, 1}) == 1.0
    assert idle_cores(BEFORE, AFTER, {1}) == 0.0  # only the cores the process may use count
    assert idle_cores(BEFORE, BEFORE, {0, 1}) == 2.0  # no tick passed: idle


def test_threads_follow_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(kvmini.threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    readings = iter([BEFORE, AFTER])
    monkeypatch.setattr(kvmini.threads.Path, "read_text", lambda self: next(readings))
    assert fit_threads(2, sample_s=0) == (1, "1 of its 2 usable cores busy at the start")
    readings = iter([BEFORE, BEFORE])
    assert fit_threads(2, sample_s=0) == (2, "torch's default")
    readings = iter([BEFORE, BEFORE])
    assert fit_threads(1, sample_s=0) == (1, "torch's default")  # never more than torch's own count


def test_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert fit_threads(3, sample_s=0) == (3, "OMP_NUM_THREADS")
