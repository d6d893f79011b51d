"""Running exercises' tests in a copy (kvmini.assignments check) and grading a class (grade).

The tests run in a child process, `python -m pytest`, and report through pytest's JUnit XML: `check`
runs them in the copy itself (its own kvmini, its own tests). `grade` takes what was handed out from
the repository it runs from, never from the copy (whose manifest a student could rewrite): each
exercise's tests run with the copy's kvmini but the repository's tests/ and pytest.ini (`graded_tree`:
a test the copy loosened or deleted grades as handed out), and the fingerprint of every file the
grade depends on is compared (a test, pytest's configuration or a module changed outside the
exercise regions is reported beside the student's row, never hidden). Each exercise's tests run in their own child
process and time limit, so one that hangs or breaks fails alone, with the reason beside the row.

Status of an exercise: `pass` (every test passes), `fail k/n` (k of its n test cases pass),
`not attempted` (every region still raises the stub's NotImplementedError), `-` (not handed out in
this copy: its regions hold the repository's solution and the manifest does not list it). A test
case passes when it passes, or when a test file skips it (no CUDA GPU); a skip the code under test
raises, or an expected failure, does not count (`not_a_pass`), and the line under the table says why.
"""
import csv
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from kvmini import cli
from kvmini.assignments import MANIFEST, ROOT, Exercise, exercises, fingerprint, fingerprints, graded
from kvmini.errors import KvminiError

NOT_ATTEMPTED = "not attempted"
MESSAGE_LINES = 8  # of a failure's message, shown by `check` (torch's "not close" gives its numbers below line 1)


@dataclass
class Result:
    test: str  # tests/test_x.py::test_y[param]
    ok: bool
    seconds: float
    message: str = ""  # the failure's first lines


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
            why = ((proc.stdout + proc.stderr).strip().splitlines() or ["pytest wrote no report"])[-1]
        except subprocess.TimeoutExpired:
            why = f"not finished after {timeout} s"
        results, broken = parse(report, folder / "tests") if report.exists() else ([], {})
    ran = {r.test.split("[")[0] for r in results}
    return results + [Result(t, False, 0.0, f"did not run: {broken.get(t.split('::')[0], why)}")
                      for t in tests if t not in ran]


def parse(report: Path, tests: Path) -> tuple[list[Result], dict[str, str]]:
    """JUnit XML -> Results, and why each test module that did not import failed (its last error
    line, where it was raised). A test skipped by a test file in `tests` (a marker, or the test itself:
    no CUDA GPU) counts as passed: it is not the student's to fix; a skip raised anywhere else (the
    code under test) or an expected failure (no exercise's test is one) is a failure that says so."""
    results, broken = [], {}
    for case in ET.parse(report).iter("testcase"):
        failed = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
        text = "" if failed is None else (failed.get("message") or "").strip()
        if failed is None and (skipped := case.find("skipped")) is not None:
            text = not_a_pass(skipped, tests)
            failed = skipped if text else None
        module = case.get("classname", "")
        if not module:  # a collection error: the module did not import
            errors = [line[1:].strip() for line in (failed.text or "").splitlines() if line.startswith("E ")]
            where = next((e for e in errors if e.startswith("File ")), "")
            broken[case.get("name", "").replace(".", "/") + ".py"] = " ".join(
                ["the test module does not import:", *errors[-1:], f"({where})" if where else ""]).strip()
            continue
        results.append(Result(f"{module.replace('.', '/')}.py::{case.get('name')}", failed is None,
                              float(case.get("time", 0)), "\n".join(line[:300] for line in text.splitlines()[:MESSAGE_LINES])))
    return results, broken


def not_a_pass(skipped: ET.Element, tests: Path) -> str:
    """Why a skipped test case is not a pass ('' when it is one). JUnit writes a skip as
    'path:line: reason', where the skip was raised; an xfail without a place."""
    reason = skipped.get("message") or ""
    if skipped.get("type") == "pytest.xfail":
        return f"did not count: expected to fail (xfail: {reason}), which no exercise's test is"
    where = re.match(r"(.*?):(\d+): ", skipped.text or "")
    path = tests / where[1] if where else None  # (tests / an absolute path: that path)
    if path is not None and tests.resolve() in path.resolve().parents:
        return ""
    folder = tests.parent  # where the tests ran: the place is shown inside it (kvmini/methods/vatp.py)
    place = "an unknown place" if path is None else f"{shown(path, folder)}:{where[2]}"
    return f"did not count: skipped by {place}: {reason} (only a test may skip itself)"


def shown(path: Path, folder: Path) -> str:
    """`path` relative to `folder` where it is inside it, else as it is."""
    return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)


def of(ex: Exercise, results: list[Result]) -> list[Result]:
    return [r for r in results if r.test.split("[")[0] in ex.tests]


def status(ex: Exercise, results: list[Result]) -> str:
    if ex.open:
        return NOT_ATTEMPTED
    mine = of(ex, results)
    passed = sum(r.ok for r in mine)
    return "pass" if mine and passed == len(mine) else f"fail {passed}/{len(mine)}"


def not_run(results: list[Result]) -> list[str]:
    """Why tests did not run (a module that does not import, a time-out) or did not count (a skip raised by
    the code under test), each reason once with its count."""
    why = [r.message for r in results if r.message.startswith(("did not run: ", "did not count: "))]
    return [f"{why.count(w)} test{'s' * (why.count(w) > 1)} {w}" for w in dict.fromkeys(why)]


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
    listed = handed_out_in(folder, found)  # "all": the exercises handed out in this copy (`new --only`)
    chosen = [ex for ex in found.values() if ex.name in listed] if name == "all" else [found[name]]
    untested = [ex.name for ex in chosen if not ex.tests]
    if untested:  # a test file, or its markers, deleted: nothing would run, and nothing would fail
        print(f"no tests are declared for {', '.join(untested)} in this copy (a test file or its "
              "@pytest.mark.exercise markers were removed?); a grade runs the tests as handed out")
    start = time.perf_counter()
    results = run_tests(folder, [t for ex in chosen for t in ex.tests], timeout)
    seconds = time.perf_counter() - start
    if name == "all":
        print(f"{'exercise':<24}{'tests':>6}{'passed':>8}  {'status':<15}{'time':>8}")
        for ex in found.values():
            if ex.name not in listed:
                print(f"{ex.name:<24}{'':>6}{'':>8}  {'-':<15}{'':>8}  (not handed out in this copy)")
                continue
            mine = of(ex, results)
            print(f"{ex.name:<24}{len(mine):>6}{sum(r.ok for r in mine):>8}  {status(ex, results):<15}"
                  f"{sum(r.seconds for r in mine):>6.1f} s")
        print("".join(f"{why}\n" for why in not_run(results)), end="")
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
                print("".join(f"        {line}\n" for line in [*doc.splitlines(), *r.message.splitlines()] if line), end="")
        print(f"{ex.name}: {sum(r.ok for r in results)} of {len(results)} tests pass ({seconds:.1f} s)")
    return 0 if all(r.ok for r in results) and not untested else 1


def problems(folder: Path, handed_out: dict[str, str] | None = None) -> list[str]:
    """How the copy differs from what was handed out, in what the grade depends on. What was handed
    out is `handed_out` (default: this repository's `fingerprints`), not the copy's manifest: a
    manifest that disagrees with it is one more difference."""
    handed_out = fingerprints() if handed_out is None else handed_out
    found = []
    try:
        if json.loads((folder / MANIFEST).read_text())["files"] != handed_out:
            found.append(f"{MANIFEST} differs from this repository: the copy was handed out from another version "
                         "(grade from the one you handed out) or the manifest was edited")
    except (OSError, ValueError, KeyError, TypeError):
        found.append(f"{MANIFEST} is missing or unreadable: not a copy made by `assignments new`, or edited")
    for rel, digest in handed_out.items():
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
        if rel not in handed_out and graded(rel) and path.is_file():
            found.append(f"{rel} is new")
    return found


def student_copy(folder: Path) -> dict[str, Exercise]:
    """The exercises of a student copy; the repository itself (no manifest, no open hole) is refused."""
    found = known(folder)
    if not (folder / MANIFEST).is_file() and not any(ex.open for ex in found.values()):
        raise KvminiError(f"{folder} is not a student copy (no {MANIFEST}; copies are made with `assignments new`)")
    return found


def handed_out_here(root: Path = ROOT) -> tuple[dict[str, Exercise], dict[str, str]]:
    """What a copy of the repository `root` was handed out with: its exercises (their tests, their
    solutions) and the fingerprints of the files the grade depends on. `root` must hold every solution."""
    reference = exercises(root)
    if any(ex.unfinished for ex in reference.values()):
        raise KvminiError(f"grade from the repository the copies were made from: {root} is itself a student copy "
                          "(its exercises are open)")
    return reference, fingerprints(root)


def graded_tree(folder: Path, into: Path, root: Path = ROOT) -> Path:
    """The copy as `grade` runs it: a folder `into`/graded whose entries link to the copy's, for the
    names the repository has at its top level (kvmini/, tutorials/ ...; weights/ too), except tests/
    and pytest.ini, which are the repository's own: the grade uses the tests that were handed out."""
    tree = into / "graded"
    tree.mkdir()
    for name in sorted({p.name for p in root.iterdir()} - {"tests", "pytest.ini", ".git"} | {"weights"}):
        if (folder / name).exists():
            (tree / name).symlink_to((folder / name).resolve())
    shutil.copytree(root / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pytest.ini", tree / "pytest.ini")
    return tree


def handed_out_in(folder: Path, exercises: dict) -> set[str]:
    """The exercises the copy's manifest lists; every one when it has none (reported by `problems`:
    such a copy is graded all the same)."""
    try:
        return set(json.loads((folder / MANIFEST).read_text())["exercises"])
    except (OSError, ValueError, KeyError, TypeError):
        return set(exercises)


def grade_one(folder: Path, timeout: int, reference: dict[str, Exercise], files: dict[str, str]) -> dict:
    """One copy: each exercise handed out in it, by the repository's own tests (`reference`, `files`: handed_out_here)."""
    mine = student_copy(folder)
    listed = handed_out_in(folder, reference)
    statuses, notes = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        tree = graded_tree(folder, Path(tmp))
        for name, ex in reference.items():
            theirs = mine.get(name)  # None: its markers were removed (then its tests run all the same)
            if name not in listed and theirs is not None and theirs.bodies == ex.bodies:
                continue  # not handed out: the copy holds the repository's solution
            if theirs is not None and theirs.open:
                statuses[name] = NOT_ATTEMPTED
                continue
            results = run_tests(tree, list(ex.tests), timeout)
            statuses[name] = status(ex, results)
            notes += [f"{name}: {why.replace(str(tree), str(folder))}" for why in not_run(results)]  # the copy's paths
    return {"student": str(folder), "exercises": statuses, "problems": problems(folder, files), "notes": notes}


def grade(folders: list[Path], json_path, csv_path, timeout: int) -> int:
    """Every copy's status per exercise, as a table (and JSON / CSV); under it, each copy's differences
    from what was handed out and why tests did not run."""
    reference, files = handed_out_here()
    for i, folder in enumerate(folders):  # bad input is refused before any test runs
        student_copy(folder)
        if any(folder.resolve() == other.resolve() for other in folders[:i]):
            raise KvminiError(f"{folder} is given twice; grade each copy once")
    wanted = [(Path(p), flag) for p, flag in ((json_path, "--json"), (csv_path, "--csv")) if p]
    if len({p.resolve() for p, _ in wanted}) < len(wanted):
        raise KvminiError("--json and --csv name the same file; give each its own")
    for p, flag in wanted:
        inside = next((f for f in folders if f.resolve() in p.resolve().parents), None)
        if inside is not None:
            raise KvminiError(f"{flag} {p} is inside the copy {inside} being graded; write it elsewhere")
    outputs = [cli.writable_file(p, flag) for p, flag in wanted]
    rows = []
    for folder in folders:
        print(f"grading {folder} ...", file=sys.stderr, flush=True)
        rows.append(grade_one(folder, timeout, reference, files))
    names = [n for n in reference if any(n in row["exercises"] for row in rows)]  # in the order a student meets them
    table = [["student", *names, "copy"]] + [
        [row["student"], *(row["exercises"].get(n, "-") for n in names), "changed" if row["problems"] else "as handed out"]
        for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for row in rows:
        for line in row["problems"] + row["notes"]:
            print(f"{row['student']}: {line}")
    if json_path:
        outputs.pop(0).write_text(json.dumps({"exercises": names, "students": rows}, indent=1) + "\n")
    if csv_path:
        with open(outputs.pop(0), "w", newline="") as f:
            csv.writer(f).writerows([table[0] + ["problems", "notes"]] + [
                r + ["; ".join(row["problems"]), "; ".join(row["notes"])] for r, row in zip(table[1:], rows)])
    return 0
