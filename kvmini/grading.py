"""Running exercises' tests in a copy (kvmini.assignments check) and grading a class (grade).

The tests run in a child process, `python -m pytest` in the copy itself (its own kvmini, its own
tests), and report through pytest's JUnit XML. Before grading, a copy is compared with the manifest
written when it was handed out (kvmini.assignments.MANIFEST): a test, pytest's configuration or a
module changed outside the exercise regions is reported beside the student's row, never hidden.

Status of an exercise: `pass` (every test passes), `fail k/n` (k of its n tests pass), `not
attempted` (every region still raises the stub's NotImplementedError), `-` (not in this copy).
"""
import csv
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from kvmini import cli
from kvmini.assignments import MANIFEST, Exercise, exercises, fingerprint, graded
from kvmini.errors import KvminiError

NOT_ATTEMPTED = "not attempted"


@dataclass
class Result:
    test: str  # tests/test_x.py::test_y[param]
    ok: bool
    seconds: float
    message: str = ""  # the first line of the failure


def run_tests(folder: Path, tests: list[str], timeout: int) -> list[Result]:
    """Run `tests` (ids without parameters) in `folder` with its own kvmini; one Result per test
    case. A test that did not run (its module does not import, a time-out) is a failure saying why."""
    if not tests:
        return []  # (pytest without test ids would run the whole suite)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                   f"--junitxml={report}", *tests]
        try:
            proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout)
            why = (proc.stdout.strip().splitlines() or ["pytest wrote no report"])[-1]
        except subprocess.TimeoutExpired:
            why = f"not finished after {timeout} s"
        results, broken = parse(report) if report.exists() else ([], {})
    ran = {r.test.split("[")[0] for r in results}
    return results + [Result(t, False, 0.0, f"did not run: {broken.get(t.split('::')[0], why)}")
                      for t in tests if t not in ran]


def parse(report: Path) -> tuple[list[Result], dict[str, str]]:
    """JUnit XML -> Results, and why each test module that did not import failed (its last error
    line, where it was raised). A skipped test counts as passed: it is not the student's to fix."""
    results, broken = [], {}
    for case in ET.parse(report).iter("testcase"):
        failed = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
        text = "" if failed is None else (failed.get("message") or "").strip()
        module = case.get("classname", "")
        if not module:  # a collection error: the module did not import
            errors = [line[1:].strip() for line in (failed.text or "").splitlines() if line.startswith("E ")]
            where = next((e for e in errors if e.startswith("File ")), "")
            broken[case.get("name", "").replace(".", "/") + ".py"] = " ".join(
                ["the test module does not import:", *errors[-1:], f"({where})" if where else ""]).strip()
            continue
        results.append(Result(f"{module.replace('.', '/')}.py::{case.get('name')}", failed is None,
                              float(case.get("time", 0)), (text.splitlines() or [""])[0][:300]))
    return results, broken


def of(ex: Exercise, results: list[Result]) -> list[Result]:
    return [r for r in results if r.test.split("[")[0] in ex.tests]


def status(ex: Exercise, results: list[Result]) -> str:
    if ex.open:
        return NOT_ATTEMPTED
    mine = of(ex, results)
    passed = sum(r.ok for r in mine)
    return "pass" if mine and passed == len(mine) else f"fail {passed}/{len(mine)}"


def known(folder: Path) -> dict[str, Exercise]:
    if not folder.is_dir():
        raise KvminiError(f"{folder} is not a folder")
    if not (folder / "kvmini" / "assignments.py").is_file():
        raise KvminiError(f"{folder} is not a kvmini copy (no kvmini/assignments.py in it)")
    return exercises(folder)


def check(folder: Path, name: str, timeout: int) -> int:
    """One exercise: every test, its time, and on failure its docstring and error. "all": a table."""
    found = known(folder)
    if name != "all" and name not in found:
        raise KvminiError(f"no exercise {name!r}; the exercises are {', '.join(found)}")
    chosen = list(found.values()) if name == "all" else [found[name]]
    start = time.perf_counter()
    results = run_tests(folder, [t for ex in chosen for t in ex.tests], timeout)
    seconds = time.perf_counter() - start
    if name == "all":
        print(f"{'exercise':<24}{'tests':>6}{'passed':>8}  {'status':<15}{'time':>8}")
        for ex in chosen:
            mine = of(ex, results)
            print(f"{ex.name:<24}{len(mine):>6}{sum(r.ok for r in mine):>8}  {status(ex, results):<15}"
                  f"{sum(r.seconds for r in mine):>6.1f} s")
        print(f"({seconds:.1f} s in all; one exercise's tests in detail: python -m kvmini.assignments check NAME)")
    else:
        ex = chosen[0]
        print(f"{ex.name}: {ex.where()}")
        told = set()  # a test's docstring and error once, not once per parameter
        for r in results:
            print(f"  {'PASS' if r.ok else 'FAIL'}  {r.test}  ({r.seconds:.2f} s)")
            if not r.ok and (r.test.split("[")[0], r.message) not in told:
                told.add((r.test.split("[")[0], r.message))
                doc = ex.tests.get(r.test.split("[")[0], "")
                print("".join(f"        {line}\n" for line in [*doc.splitlines(), r.message] if line), end="")
        print(f"{ex.name}: {sum(r.ok for r in results)} of {len(results)} tests pass ({seconds:.1f} s)")
    return 0 if all(r.ok for r in results) else 1


def problems(folder: Path) -> list[str]:
    """How the copy differs from what was handed out, in what the grade depends on."""
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{MANIFEST} is missing or unreadable: not a copy made by `assignments new`, or edited"]
    found = []
    for rel, digest in recorded.items():
        path = folder / rel
        try:
            same = fingerprint(rel, path.read_text(encoding="utf-8", errors="surrogateescape")) == digest
        except OSError:
            found.append(f"{rel} is missing")
            continue
        except ValueError:  # unbalanced exercise markers
            same = False
        if not same:
            found.append(f"{rel} changed" + (" outside the exercise regions" if rel.startswith("kvmini/") else ""))
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel not in recorded and graded(rel) and path.is_file():
            found.append(f"{rel} is new")
    return found


def student_copy(folder: Path) -> dict[str, Exercise]:
    """The exercises of a student copy; the repository itself (no manifest, no open hole) is refused."""
    found = known(folder)
    if not (folder / MANIFEST).is_file() and not any(ex.open for ex in found.values()):
        raise KvminiError(f"{folder} is not a student copy (no {MANIFEST}; copies are made with `assignments new`)")
    return found


def grade_one(folder: Path, timeout: int) -> dict:
    found = student_copy(folder)
    try:
        handed_out = list(json.loads((folder / MANIFEST).read_text())["exercises"])
    except (OSError, ValueError, KeyError, TypeError):
        handed_out = list(found)  # (reported by `problems`)
    chosen = [ex for name, ex in found.items() if name in handed_out]
    results = run_tests(folder, [t for ex in chosen if not ex.open for t in ex.tests], timeout)
    return {"student": str(folder), "problems": problems(folder),
            "exercises": {ex.name: status(ex, results) for ex in chosen}}


def grade(folders: list[Path], json_path, csv_path, timeout: int) -> int:
    """Every copy's status per exercise, as a table (and JSON / CSV); problems listed under it."""
    for folder in folders:  # bad input is refused before any test runs
        student_copy(folder)
    outputs = [cli.writable_file(p, flag) for p, flag in ((json_path, "--json"), (csv_path, "--csv")) if p]
    rows = []
    for folder in folders:
        print(f"grading {folder} ...", file=sys.stderr, flush=True)
        rows.append(grade_one(folder, timeout))
    names = list(dict.fromkeys(n for row in rows for n in row["exercises"]))
    table = [["student", *names, "copy"]] + [
        [row["student"], *(row["exercises"].get(n, "-") for n in names), "changed" if row["problems"] else "as handed out"]
        for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for row in rows:
        for problem in row["problems"]:
            print(f"{row['student']}: {problem}")
    if json_path:
        outputs.pop(0).write_text(json.dumps({"exercises": names, "students": rows}, indent=1) + "\n")
    if csv_path:
        with open(outputs.pop(0), "w", newline="") as f:
            csv.writer(f).writerows([table[0] + ["problems"]] + [r + ["; ".join(row["problems"])]
                                                                  for r, row in zip(table[1:], rows)])
    return 0
