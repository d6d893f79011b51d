"""A pytest plugin for grading (loaded by kvmini.course.running, not by the test suite): the tests
of one exercise share a time limit, and every test's outcome is written down as it finishes.

KVMINI_EXERCISE_LIMIT seconds per exercise (its tests' time adds up; past it, the test running is
stopped and the exercise's other tests do not run); KVMINI_OUTCOMES: a file that gets one JSON line
when a test starts and one per outcome, so that when a submission crashes the process (a segfault,
os._exit) or hangs where no signal reaches it, the grader knows which test it was and what finished.
Standalone on purpose (no kvmini import): the grader loads it from its own repository.
"""
import json
import os
import signal
import time

import pytest

LIMIT = float(os.environ.get("KVMINI_EXERCISE_LIMIT", "0"))
OUTCOMES = os.environ.get("KVMINI_OUTCOMES", "")
spent: dict[str, float] = {}  # exercise -> seconds its tests took so far


class OverTime(BaseException):
    """Not an Exception: a solution's `except Exception` cannot swallow it."""


def write(**record) -> None:
    if OUTCOMES:
        with open(OUTCOMES, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def exercise_of(item) -> str:
    mark = item.get_closest_marker("exercise")
    return str(mark.args[0]) if mark and mark.args else ""


def over_time(signum, frame):
    signal.setitimer(signal.ITIMER_REAL, 1.0)  # again every second, until the test gives up
    raise OverTime(f"not finished within its exercise's time limit of {LIMIT:g} s")


def pytest_runtest_logstart(nodeid, location):
    write(started=nodeid)


def pytest_runtest_setup(item):
    if LIMIT and spent.get(exercise_of(item), 0.0) >= LIMIT:
        pytest.fail(f"did not run: its exercise's time limit of {LIMIT:g} s was used up by its other tests")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    name, start = exercise_of(item), time.perf_counter()
    if LIMIT:
        signal.signal(signal.SIGALRM, over_time)
        signal.setitimer(signal.ITIMER_REAL, max(LIMIT - spent.get(name, 0.0), 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        skip = report.longrepr if report.skipped and isinstance(report.longrepr, tuple) else None
        write(test=report.nodeid, when=report.when, outcome=report.outcome, seconds=report.duration,
              xfail=getattr(report, "wasxfail", None),
              skip=list(skip) if skip else None,  # (path, line, "Skipped: reason"): where the skip was raised
              message="" if report.passed or skip else report.longreprtext[-3000:])


def pytest_collectreport(report):
    if report.failed:
        write(broken=report.nodeid, message=report.longreprtext[-3000:])
