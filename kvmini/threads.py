"""How many threads run.py gives torch: its default, or fewer when other work keeps some of the cores busy.

With a core busy, torch's threads wait at every operation for the one that shares that core, and a
small model's decode step, many short operations, slows down several times (the commit that added this
module gives the measurement). So the command line counts the cores this process may use that are idle
now (Linux's /proc/stat, over a tenth of a second) and runs at most that many threads. An
OMP_NUM_THREADS the user set wins; elsewhere torch's default stays.
"""
import os
import time
from pathlib import Path


def core_ticks(text: str) -> dict[int, tuple[int, int]]:
    """Core -> (idle ticks, all ticks) of one reading of /proc/stat. A core's line is `cpuN user nice system
    idle iowait irq softirq steal ...` in clock ticks since boot; idle time is idle + iowait."""
    out = {}
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit():
            t = [int(x) for x in fields[:8]]
            out[int(name[3:])] = (t[3] + t[4], sum(t))
    return out


def idle_cores(before: str, after: str, allowed: set[int]) -> float:
    """The idle share of each allowed core between two readings of /proc/stat, summed (2.0: two idle cores).
    A core with no ticks between the readings counts as idle."""
    a, b = core_ticks(before), core_ticks(after)
    share = 0.0
    for core in allowed & a.keys() & b.keys():
        idle, total = b[core][0] - a[core][0], b[core][1] - a[core][1]
        share += idle / total if total > 0 else 1.0
    return share


def fit_threads(default: int, sample_s: float = 0.1) -> tuple[int, str]:
    """-> (threads to use, the reason in a few words), never more than `default` (torch's own count).
    An OMP_NUM_THREADS that OpenMP ignores (not a whole number >= 1) is said so, and the cores are counted."""
    omp = os.environ.get("OMP_NUM_THREADS")
    outer = (omp or "").split(",")[0].strip()  # OpenMP's nested form "4,2": 4 at the outer level
    if outer.isdigit() and int(outer) >= 1:
        return default, "OMP_NUM_THREADS"
    ignored = f"; OMP_NUM_THREADS={omp!r} is not a whole number >= 1, which OpenMP ignores" if omp else ""
    try:
        allowed = os.sched_getaffinity(0)
        stat = Path("/proc/stat")
        before = stat.read_text()
        time.sleep(sample_s)
        after = stat.read_text()
    except (OSError, AttributeError):  # not Linux: torch's default
        return default, "torch's default" + ignored
    if not allowed <= core_ticks(before).keys():  # a container whose /proc/stat numbers other cores than this process's
        return default, "torch's default (/proc/stat does not list the cores this process may use)" + ignored
    free = round(idle_cores(before, after, allowed))
    if free >= default:
        return default, "torch's default" + ignored
    n = max(1, free)
    return n, f"{len(allowed) - free} of its {len(allowed)} usable cores busy at the start" + ignored
