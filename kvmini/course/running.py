"""Running exercises' tests in a child `python -m pytest` and reading what they did.

One child runs the tests of every exercise asked for (one interpreter start, not one per exercise),
with the `limits` plugin: each exercise's tests share a time limit, and every outcome is written down
as it happens. When the child dies (a crash) or hangs past the limits of all its exercises, the test
it was running is reported, its exercise's remaining tests are skipped, and the other exercises' tests
not yet run go to a new child.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MESSAGE_LINES = 8  # of a failure's message, shown by `check` (torch's "not close" gives its numbers below line 1)
STARTUP = 120  # seconds a child may take beyond its exercises' limits (the interpreter, torch, collection)


@dataclass
class Result:
    test: str  # tests/test_x.py::test_y[param]
    ok: bool
    seconds: float
    message: str = ""  # the failure's first lines


def run_tests(folder: Path, tests: dict[str, list[str]], limit: float, threads: int = 0) -> list[Result]:
    """Run each exercise's `tests` (exercise -> ids without parameters) in `folder` with its own kvmini,
    under `limit` seconds per exercise; one Result per test case. A test that did not run (its module
    does not import, a time-out, a crash) is a failure saying why."""
    results, left = [], {name: list(ids) for name, ids in tests.items() if ids}
    while left:
        records, why = run_child(folder, [t for ids in left.values() for t in ids], limit * len(left) + STARTUP,
                                 limit, threads)
        done = outcomes(records, folder)
        results += done
        finished = {r.test.split("[")[0] for r in done}
        broken = {r["broken"]: r["message"] for r in records if "broken" in r}
        started = [r["started"] for r in records if "started" in r]
        stuck = started[-1] if why and started and started[-1] not in {r.test for r in done} else None
        if stuck is not None:
            results.append(Result(stuck, False, 0.0, f"did not run: {why} (while running it)"))
        again = {}
        for name, ids in left.items():
            missing = [t for t in ids if t not in finished and (stuck is None or t != stuck.split("[")[0])]
            if stuck is not None and stuck.split("[")[0] not in ids:
                again[name] = missing  # the child stopped before reaching them: a new one runs them
            else:
                after = f"{stuck} stopped the test process first" if stuck is not None else why
                results += [Result(t, False, 0.0, f"did not run: {broken_reason(t, broken) or after or 'no outcome'}")
                            for t in missing]
        left = {name: ids for name, ids in again.items() if ids}
    return results


def broken_reason(test: str, broken: dict[str, str]) -> str:
    """Why a test's module did not import, from pytest's collection error (its last error line, and where)."""
    message = broken.get(test.split("::")[0], "")
    if not message:
        return ""
    errors = [line[1:].strip() for line in message.splitlines() if line.startswith("E ")] or message.splitlines()[-1:]
    where = next((e for e in errors if e.startswith("File ")), "")
    return " ".join(["the test module does not import:", *errors[-1:], f"({where})" if where else ""]).strip()


def run_child(folder: Path, tests: list[str], timeout: float, limit: float, threads: int) -> tuple[list[dict], str]:
    """One `python -m pytest` over `tests` in `folder`; its records (see limits.py) and, when it did not
    end by itself, why ('' when it did)."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(Path(__file__).with_name("limits.py"), Path(tmp) / "kvmini_course_limits.py")
        record = Path(tmp) / "outcomes.jsonl"
        env = {**os.environ, "KVMINI_EXERCISE_LIMIT": str(limit), "KVMINI_OUTCOMES": str(record),
               "PYTHONPATH": os.pathsep.join([tmp, *filter(None, [os.environ.get("PYTHONPATH")])])}
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvmini_course_limits",
                   "--continue-on-collection-errors", *tests]
        try:
            proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout, env=env)
            why = "" if proc.returncode in (0, 1) else f"the test process ended with exit code {proc.returncode}" + (
                " (a crash)" if proc.returncode < 0 else ": " + ((proc.stdout + proc.stderr).strip().splitlines() or ["?"])[-1])
        except subprocess.TimeoutExpired:
            why = f"the test process did not finish after {timeout:g} s (a hang no time limit could stop)"
        lines = record.read_text(encoding="utf-8").splitlines() if record.exists() else []
    return [json.loads(line) for line in lines if line.strip()], why


def outcomes(records: list[dict], folder: Path) -> list[Result]:
    """One Result per test case from the plugin's records. A test skipped by a test file (a marker, or the
    test itself: no CUDA GPU) counts as passed: it is not the student's to fix; a skip raised anywhere
    else (the code under test) or an expected failure (no exercise's test is one) is a failure saying so."""
    by_test: dict[str, Result] = {}
    for r in (r for r in records if "test" in r):
        message = "" if r["outcome"] == "passed" else first_lines(r["message"])
        if "OverTime: " in message:  # stopped by limits.py
            message = "did not finish: " + message.split("OverTime: ")[1].splitlines()[0]
        message = message.removeprefix("Failed: ")  # limits.py's "did not run: ..." (pytest.fail)
        if r["outcome"] == "skipped":
            message = not_a_pass(r, folder)
        ok = not message
        old = by_test.get(r["test"])
        if old is None:
            by_test[r["test"]] = Result(r["test"], ok, r["seconds"], message)
        else:
            old.ok, old.seconds, old.message = old.ok and ok, old.seconds + r["seconds"], old.message or message
    return list(by_test.values())


def first_lines(text: str) -> str:
    """A failure's message: its `E ` lines (pytest's error) when it has any, else its last lines."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = errors or text.strip().splitlines()[-MESSAGE_LINES:]
    return "\n".join(line[:300] for line in lines[:MESSAGE_LINES]) or "failed"


def not_a_pass(record: dict, folder: Path) -> str:
    """Why a skipped test case is not a pass ('' when it is one)."""
    if record.get("xfail") is not None:
        return f"did not count: expected to fail (xfail: {record['xfail']}), which no exercise's test is"
    path, line, reason = record.get("skip") or (None, 0, "")
    reason = re.sub(r"^Skipped: ", "", reason)
    where = None if path is None else Path(os.path.normpath(folder.absolute() / path))
    if where is not None and (folder / "tests").resolve() in where.resolve().parents:
        return ""
    place = "an unknown place" if where is None else f"{shown(where, folder.absolute())}:{line}"
    return f"did not count: skipped by {place}: {reason} (only a test may skip itself)"


def shown(path: Path, folder: Path) -> str:
    """`path` relative to `folder` where it is inside it, else as it is."""
    return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
