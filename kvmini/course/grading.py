"""Checking an exercise in a copy (`check`) and grading a class (`grade`).

`check` runs the copy's own tests in the copy. `grade` takes what was handed out from the repository
it runs from, never from the copy (whose manifest a student could rewrite): each exercise's tests run
with the copy's kvmini but the repository's tests/ and pytest.ini (`graded_tree`: a test the copy
loosened or deleted grades as handed out), and the fingerprint of every file the grade depends on is
compared (a test, pytest's configuration or a module changed outside the exercise regions is reported
beside the student's row, never hidden). Copies are graded `jobs` at a time; in each, one test process
runs every attempted exercise, each exercise's tests under one time limit (running.py).

A cell: `pass n/n`, `fail k/n` (k of its n test cases pass), `not attempted 0/n` (every region still
raises the stub's NotImplementedError; its tests are not run), `-` (not handed out in this copy: its
regions hold the repository's solution and the manifest does not list it). A test case passes when it
passes, or when a test file skips it (no CUDA GPU); a skip the code under test raises, or an expected
failure, does not count, and a line under the table says why.
"""
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from kvmini import cli
from kvmini.course.copies import MANIFEST, fingerprint, fingerprints, graded
from kvmini.course.exercises import ROOT, Exercise, exercises, unparsable_tests
from kvmini.course.running import Result, run_tests
from kvmini.errors import KvminiError

NOT_ATTEMPTED = "not attempted"


def of(ex: Exercise, results: list[Result]) -> list[Result]:
    return [r for r in results if r.test.split("[")[0] in ex.tests]


def status(ex: Exercise, results: list[Result], cases: int | None = None) -> str:
    """The cell: pass n/n, fail k/n, not attempted 0/n (n: `cases` when known, else the results')."""
    mine = of(ex, results)
    n = len(mine) if cases is None or mine else cases
    if ex.open:
        return f"{NOT_ATTEMPTED} 0/{n}"
    passed = sum(r.ok for r in mine)
    return f"pass {passed}/{n}" if mine and passed == len(mine) else f"fail {passed}/{n}"


def not_run(results: list[Result]) -> list[str]:
    """Why tests did not run (a module that does not import, a time-out, a crash) or did not count (a
    skip raised by the code under test), each reason once with its count."""
    why = [r.message for r in results if r.message.startswith(("did not run: ", "did not finish: ", "did not count: "))]
    return [f"{why.count(w)} test{'s' * (why.count(w) > 1)} {w}" for w in dict.fromkeys(why)]


def known(folder: Path) -> dict[str, Exercise]:
    if not folder.is_dir():
        raise KvminiError(f"{folder} is not a folder")
    if not (folder / "kvmini" / "course" / "exercises.py").is_file():
        raise KvminiError(f"{folder} is not a kvmini copy (no kvmini/course/exercises.py in it)")
    return exercises(folder)


def check(folder: Path, name: str, limit: float) -> int:
    """One exercise: every test, its time, and on failure its docstring and error. "all": a table of the
    exercises handed out, whose tests run for those attempted (a region written), as a grade runs them."""
    found = known(folder)
    if name != "all" and name not in found:
        raise KvminiError(f"no exercise {name!r}; the exercises are {', '.join(found)}")
    listed = handed_out_in(folder, found)  # "all": the exercises handed out in this copy (`new --only`) ...
    chosen = [ex for ex in found.values() if ex.name in listed] if name == "all" else [found[name]]
    skipped = [ex.name for ex in chosen if ex.open] if name == "all" else []  # ... and attempted (as grade runs them)
    chosen = [ex for ex in chosen if ex.name not in skipped]
    unparsable = unparsable_tests(folder)
    for line in unparsable:  # its declarations cannot be read: its exercises' tests cannot be found
        print(f"{line}: the exercises whose tests it holds cannot be checked until it does")
    untested = [ex.name for ex in chosen if not ex.tests]
    if untested and not unparsable:  # a test file, or its markers, deleted: nothing would run, and nothing would fail
        print(f"no tests are declared for {', '.join(untested)} in this copy (a test file or its "
              "@pytest.mark.exercise markers were removed?); a grade runs the tests as handed out")
    start = time.perf_counter()
    results = run_tests(folder, {ex.name: list(ex.tests) for ex in chosen}, limit)
    seconds = time.perf_counter() - start
    if name == "all":
        print(f"{'exercise':<24}{'tests':>6}{'passed':>8}  {'status':<20}{'time':>8}")
        for ex in found.values():
            if ex.name not in listed:
                print(f"{ex.name:<24}{'':>6}{'':>8}  {'-':<20}{'':>8}  (not handed out in this copy)")
                continue
            if ex.name in skipped:
                print(f"{ex.name:<24}{'':>6}{'':>8}  {NOT_ATTEMPTED:<20}{'':>8}  (not run)")
                continue
            mine = of(ex, results)
            print(f"{ex.name:<24}{len(mine):>6}{sum(r.ok for r in mine):>8}  {status(ex, results):<20}"
                  f"{sum(r.seconds for r in mine):>6.1f} s")
        print("".join(f"{why}\n" for why in not_run(results)), end="")
        if skipped:
            print(f"not run, not attempted (every region still the stub): {', '.join(skipped)}; "
                  "check NAME runs one exercise's tests all the same")
        print(f"({seconds:.1f} s in all; one exercise's tests in detail: python -m kvmini.course check NAME)")
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
    return 0 if all(r.ok for r in results) and not (untested or unparsable or skipped) else 1


def problems(folder: Path, handed_out: dict[str, str] | None = None) -> list[str]:
    """How the copy differs from what was handed out, in what the grade depends on. What was handed
    out is `handed_out` (default: this repository's `fingerprints`, as its manifest says it was made),
    not the copy's manifest: a manifest that disagrees with it is one more difference."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        withheld = manifest.get("withheld") is True
    except (OSError, ValueError, AttributeError):
        manifest, withheld = None, False
    handed_out = fingerprints(withheld=withheld) if handed_out is None else handed_out
    found = []
    try:
        if manifest["files"] != handed_out:
            found.append(f"{MANIFEST} differs from this repository: the copy was handed out from another version "
                         "(grade from the one you handed out) or the manifest was edited")
    except (KeyError, TypeError):
        found.append(f"{MANIFEST} is missing or unreadable: not a copy made by `new`, or edited")
    for rel, digest in handed_out.items():
        path = folder / rel
        try:
            same = fingerprint(rel, path.read_text(encoding="utf-8", errors="surrogateescape"), withheld) == digest
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
        raise KvminiError(f"{folder} is not a student copy (no {MANIFEST}; copies are made with `new`)")
    return found


def handed_out_here(root: Path = ROOT) -> tuple[dict[str, Exercise], dict[bool, dict[str, str]]]:
    """What a copy of the repository `root` was handed out with: its exercises (their tests, their
    solutions) and the fingerprints of the files the grade depends on (by whether the copy's references
    were withheld). `root` must hold every solution."""
    reference = exercises(root)
    if any(ex.unfinished for ex in reference.values()):
        raise KvminiError(f"grade from the repository the copies were made from: {root} is itself a student copy "
                          "(its exercises are open)")
    return reference, {w: fingerprints(root, w) for w in (False, True)}


def graded_tree(folder: Path, into: Path, root: Path = ROOT) -> Path:
    """The copy as `grade` runs it: a folder `into`/graded whose entries link to the copy's, for the
    names the repository has at its top level (kvmini/, tutorials/ ...; weights/ too), except tests/
    and pytest.ini, which are the repository's own: the grade uses the tests that were handed out."""
    tree = into / "graded"
    tree.mkdir()
    for name in sorted({p.name for p in root.iterdir()} - {"tests", "pytest.ini", ".git"} | {"weights"}):
        if (folder / name).exists():
            (tree / name).symlink_to((folder / name).resolve())
    shutil.copytree(root / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__", "withheld_cases.pt"))
    shutil.copy(root / "pytest.ini", tree / "pytest.ini")
    return tree


def manifest_of(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest if isinstance(manifest, dict) else {}
    except (OSError, ValueError):
        return {}


def handed_out_in(folder: Path, exercises: dict) -> set[str]:
    """The exercises the copy's manifest lists; every one when it has none (reported by `problems`:
    such a copy is graded all the same)."""
    listed = manifest_of(folder).get("exercises")
    return set(listed) if isinstance(listed, list) else set(exercises)


def case_counts(root: Path, reference: dict[str, Exercise]) -> dict[str, int]:
    """Each exercise's number of test cases (a parametrized test counts once per case), as collected in `root`."""
    tests = [t for ex in reference.values() for t in ex.tests]
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *tests],
                            cwd=root, capture_output=True, text=True).stdout.splitlines()
    ids = [line.split("[")[0] for line in listed if "::" in line]
    return {name: sum(i in ex.tests for i in ids) for name, ex in reference.items()}


def grade_one(folder: Path, limit: float, reference: dict[str, Exercise], files: dict[bool, dict[str, str]],
              cases: dict[str, int] | None = None, threads: int = 0) -> dict:
    """One copy: each exercise handed out in it, by the repository's own tests (`reference`, `files`: handed_out_here)."""
    mine = student_copy(folder)
    manifest = manifest_of(folder)
    listed = handed_out_in(folder, reference)
    cases = cases or {}
    cells, run = {}, {}
    for name, ex in reference.items():
        theirs = mine.get(name)  # None: its markers were removed (then its tests run all the same)
        if name not in listed and theirs is not None and theirs.bodies == ex.bodies:
            continue  # not handed out: the copy holds the repository's solution
        if theirs is not None and theirs.open:
            cells[name] = {"status": f"{NOT_ATTEMPTED} 0/{cases.get(name, '?')}", "passed": 0,
                           "tests": cases.get(name), "failures": {}}
        else:
            run[name] = ex
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = graded_tree(folder, Path(tmp))
        results = run_tests(tree, {name: list(ex.tests) for name, ex in run.items()}, limit, threads)
        for name, ex in run.items():
            mine_ = of(ex, results)
            cells[name] = {"status": status(ex, mine_, cases.get(name)), "passed": sum(r.ok for r in mine_),
                           "tests": len(mine_), "failures": {r.test: r.message.splitlines()[0] if r.message else "failed"
                                                             for r in mine_ if not r.ok}}
            notes += [f"{name}: {why.replace(str(tree), str(folder))}" for why in not_run(mine_)]  # the copy's paths
    withheld = manifest.get("withheld") is True
    name = manifest.get("student") if isinstance(manifest.get("student"), str) and manifest.get("student") else folder.resolve().name
    return {"student": name, "path": str(folder), "exercises": {n: cells[n] for n in reference if n in cells},
            "problems": problems(folder, files[withheld]), "notes": notes}


def repository_commit(root: Path = ROOT) -> str:
    """The commit graded from, with '+changes' when the checkout differs from it ('unknown' outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
        return commit + (" +changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def refuse_bad_input(folders: list[Path], out: Path) -> None:
    for i, folder in enumerate(folders):  # bad input is refused before any test runs
        student_copy(folder)
        if any(folder.resolve() == other.resolve() for other in folders[:i]):
            raise KvminiError(f"{folder} is given twice; grade each copy once")
    inside = next((f for f in folders if f.resolve() == out.resolve() or f.resolve() in out.resolve().parents), None)
    if inside is not None:
        raise KvminiError(f"--out {out} is inside the copy {inside} being graded; write it elsewhere")


def grade(folders: list[Path], out: Path, limit: float, jobs: int) -> int:
    """Every copy's cell per exercise, `jobs` copies at a time, as a table with a total per student and a
    summary row (and JSON / CSV in `out`); under it, each copy's differences from what was handed out and
    why tests did not run. 0 whenever the class was graded, whatever the grades."""
    refuse_bad_input(folders, out)
    out = cli.writable_folder(out, "--out")
    reference, files = handed_out_here()
    cases = case_counts(ROOT, reference)
    started, commit, load = datetime.now(timezone.utc), repository_commit(), round(os.getloadavg()[0], 2)
    print(f"grading {len(folders)} copies at commit {commit}, {jobs} at a time, each exercise's tests "
          f"limited to {limit:g} s", file=sys.stderr, flush=True)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    clock = time.perf_counter()

    def one(folder):
        row = grade_one(folder, limit, reference, files, cases, threads)
        print(f"graded {folder} ({time.perf_counter() - clock:.0f} s)", file=sys.stderr, flush=True)
        return row

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(one, folders))
    names = [n for n in reference if any(n in row["exercises"] for row in rows)]  # in the order a student meets them
    labels = [row["student"] for row in rows]
    for row in rows:  # two copies of one name (alice/kvmini, bob/kvmini): their paths
        if labels.count(row["student"]) > 1:
            row["student"] = row["path"]
    for row in rows:
        cells = [row["exercises"][n] for n in names if n in row["exercises"]]
        row["total"] = f"{sum(c['passed'] for c in cells)}/{sum(c['tests'] or 0 for c in cells)}"
        row["copy"] = "changed" if row["problems"] else "as handed out"
    summary = {n: f"{sum(row['exercises'].get(n, {}).get('status', '').startswith('pass') for row in rows)}"
                  f"/{sum(n in row['exercises'] for row in rows)} pass" for n in names}
    table = [["student", *names, "total", "copy"]] + [
        [row["student"], *(row["exercises"].get(n, {}).get("status", "-") for n in names), row["total"], row["copy"]]
        for row in rows] + [["(students passing)", *summary.values(), "", ""]]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    seconds = time.perf_counter() - clock
    print(f"graded {started:%Y-%m-%d %H:%M} UTC at commit {commit}; each exercise's tests limited to {limit:g} s")
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for row in rows:
        for line in row["problems"] + row["notes"]:
            print(f"{row['student']}: {line}")
    stem = out / f"grades-{started:%Y%m%d-%H%M%S}"
    about = {"graded_at": started.isoformat(timespec="seconds"), "commit": commit, "time_limit_per_exercise_s": limit,
             "jobs": jobs, "cores": os.cpu_count(), "load_at_start": load, "seconds": round(seconds, 1)}
    Path(f"{stem}.json").write_text(json.dumps({**about, "exercises": names, "summary": summary, "students": rows},
                                               indent=1) + "\n")
    with open(f"{stem}.csv", "w", newline="") as f:
        csv.writer(f).writerows([table[0] + ["problems", "notes", "commit", "graded at"]] + [
            r + ["; ".join(row["problems"]), "; ".join(row["notes"]), commit, about["graded_at"]]
            for r, row in zip(table[1:], rows)] + [table[-1] + ["", "", commit, about["graded_at"]]])
    print(f"wrote {stem}.json and {stem}.csv ({seconds:.0f} s)")
    return 0
