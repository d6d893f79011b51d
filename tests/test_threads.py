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


def machine(monkeypatch, cores: set, *readings: str) -> None:
    """A process that may use `cores`, reading /proc/stat as `readings`, one after the other."""
    monkeypatch.setattr(kvmini.threads.os, "sched_getaffinity", lambda pid: cores, raising=False)
    texts = iter(readings)
    monkeypatch.setattr(kvmini.threads.Path, "read_text", lambda self: next(texts))


def test_threads_follow_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine(monkeypatch, {0, 1}, BEFORE, AFTER, BEFORE, BEFORE, BEFORE, BEFORE)
    assert fit_threads(2, sample_s=0) == (1, "1 of its 2 usable cores busy at the start")
    assert fit_threads(2, sample_s=0) == (2, "torch's default")
    assert fit_threads(1, sample_s=0) == (1, "torch's default")  # never more than torch's own count


def test_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert fit_threads(3, sample_s=0) == (3, "OMP_NUM_THREADS")


def test_an_omp_num_threads_openmp_ignores_is_said_and_the_cores_are_counted(monkeypatch):
    for value in ("abc", "0", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        machine(monkeypatch, {0, 1}, BEFORE, AFTER)
        assert fit_threads(2, sample_s=0) == (1, "1 of its 2 usable cores busy at the start; "
                                              f"OMP_NUM_THREADS={value!r} is not a whole number >= 1, which OpenMP ignores")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nested form: 4 at the outer level
    assert fit_threads(2, sample_s=0) == (2, "OMP_NUM_THREADS")


def test_cores_that_proc_stat_does_not_list_are_not_counted_as_busy(monkeypatch):
    """A container whose /proc/stat numbers cpu0, cpu1 while the process may use cores 4 and 5."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine(monkeypatch, {4, 5}, BEFORE, AFTER)
    assert fit_threads(2, sample_s=0) == (2, "torch's default (/proc/stat does not list the cores this process may use)")
