"""Course mode (kvmini.course): a student copy loses exactly the marked solutions; each exercise's check
runs its own tests (failing while its holes are open, passing once they are written, whatever the
other exercises' state); grade reports a class; every exercise is declared in full."""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from course_class import solve
from kvmini.course.cells import solved
from kvmini.course.copies import MANIFEST, write_student_copy
from kvmini.course.exercises import exercises, strip
from kvmini.course.grading import NOT_ATTEMPTED, graded_tree, problems
from kvmini.errors import KvminiError

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = {  # written out by hand: what the markers in kvmini/methods must add up to
    "variance_softmax": {"kvmini/methods/variance_softmax.py": ["attention_variance", "layer_weights"]},
    "reciprocal_allocation": {"kvmini/methods/variance_softmax.py": ["layer_weights"]},
    "ema_merging": {"kvmini/methods/ema_merging.py": ["nearest", "ema_threshold", "convex_merge"]},
    "frobenius_stop": {"kvmini/methods/frobenius_stop.py": ["frobenius_stop"]},
    "convex_value_merge": {"kvmini/methods/convex_value_merge.py": ["convex_value_merge"]},
    "progressive_budgets": {"kvmini/methods/progressive_budgets.py": ["reallocate"]},
    "value_norm": {"kvmini/methods/vatp.py": ["VATP.norm"]},
}


def course(cwd, *argv):
    return subprocess.run([sys.executable, "-m", "kvmini.course", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def test_strip_keeps_markers_and_raises():
    text = 'def f(x):\n    y = 1\n    # BEGIN EXERCISE f: tutorials/t.py, "F"\n    return x + y\n    # END EXERCISE\n'
    stripped, names = strip(text)
    assert names == ["f"]
    assert stripped == ('def f(x):\n    y = 1\n    # BEGIN EXERCISE f: tutorials/t.py, "F"\n    raise NotImplementedError('
                        '"exercise f: see tutorials/t.py, \'F\'; check it with python -m kvmini.course check f")\n'
                        "    # END EXERCISE\n")
    assert strip(text, names=set()) == (text, [])  # only the exercises named
    with pytest.raises(ValueError, match="without END"):
        strip('# BEGIN EXERCISE g: tutorials/t.py, "G"\nx = 1\n')


def test_every_exercise_is_declared_in_full():
    """Each exercise has its holes, its tests (and nothing else marks a test), and a tutorial section
    whose exercise names the functions and the check command."""
    found = exercises(ROOT)
    assert {name: ex.holes for name, ex in found.items()} == EXERCISES
    marked = set(re.findall(r'@pytest\.mark\.exercise\("(\w+)"\)', "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))))
    assert marked == set(found)
    for ex in found.values():
        assert ex.tests and not ex.open, ex.name
        tutorial = (ROOT / ex.tutorial).read_text()
        assert f"# ## {ex.section}\n" in tutorial, (ex.name, ex.section)
        exercise_section = tutorial.split("# ## Exercises")[1]
        assert f"`{ex.check}`" in " ".join(exercise_section.split()), ex.name  # (a line break may split it)
        for functions in ex.holes.values():
            for function in functions:
                assert f"`{function}`" in exercise_section, (ex.name, function)


def test_solved_in_the_repository_and_a_misspelt_name(capsys):
    assert solved(*EXERCISES) and capsys.readouterr().out == ""  # every solution is here: no cell skips
    with pytest.raises(KvminiError, match="no exercise ema_merge; the exercises are variance_softmax"):
        solved("ema_merge")


def test_a_changed_test_or_module_is_reported(tmp_path):
    copy = tmp_path / "copy"
    write_student_copy(copy)
    assert problems(copy) == []
    solve(copy, "frobenius_stop")  # inside the regions: the student's work
    assert problems(copy) == []
    test = copy / "tests" / "test_d2o.py"
    test.write_text(test.read_text().replace("assert ", "assert True or ", 1))
    module = copy / "kvmini" / "methods" / "ema_merging.py"
    module.write_text(module.read_text().replace("WEIGHTS = (", "WEIGHTS = ('x', "))
    (copy / "tests" / "helper.py").write_text("")
    (copy / "tests" / "test_vatp.py").unlink()
    assert sorted(problems(copy)) == ["kvmini/methods/ema_merging.py changed outside the exercise regions",
                                      "tests/helper.py is new", "tests/test_d2o.py changed",
                                      "tests/test_vatp.py is missing"]
    (copy / MANIFEST).unlink()
    assert "is missing or unreadable" in problems(copy)[0]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """A class: one student did nothing, one did everything, and one per exercise did only that one."""
    base = tmp_path_factory.mktemp("class")
    for student in ("untouched", "all", *EXERCISES):
        write_student_copy(base / student)
    for name in EXERCISES:
        solve(base / name, name)
        solve(base / "all", name)
    return base


@pytest.mark.slow
def test_a_copy_lists_its_holes_and_checks(tmp_path):
    proc = course(ROOT, "new", tmp_path / "copy")
    assert proc.returncode == 0, proc.stderr
    assert "ema_merging\n    holes: kvmini/methods/ema_merging.py: nearest, ema_threshold, convex_merge\n" in proc.stdout
    for name in EXERCISES:
        assert f"    check: python -m kvmini.course check {name}\n" in proc.stdout
    assert {n for n, ex in exercises(tmp_path / "copy").items() if ex.open} == set(EXERCISES)
    assert not (tmp_path / "copy" / "weights" / "SmolLM2-135M-Instruct").exists()


@pytest.mark.slow
def test_check_one_exercise_fails_open_and_passes_written(copies):
    """Only ema_merging's tests run: with its three holes open each fails on its own stub, never on
    another exercise's (all six others are open too); written, all of them pass."""
    open_ = course(copies / "untouched", "check", "ema_merging")
    assert open_.returncode == 1, open_.stderr
    failed = re.findall(r"^  FAIL  (\S+)", open_.stdout, re.M)
    assert failed and "  PASS  " not in open_.stdout
    assert set(re.findall(r"exercise (\w+): see", open_.stdout)) == {"ema_merging"}
    assert f"ema_merging: 0 of {len(failed)} tests pass" in open_.stdout
    done = course(copies / "ema_merging", "check", "ema_merging")
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.findall(r"^  PASS  (\S+)", done.stdout, re.M) == failed
    assert f"ema_merging: {len(failed)} of {len(failed)} tests pass" in done.stdout
    other = course(ROOT, "check", "value_norm", copies / "ema_merging")  # the copy named
    assert other.returncode == 1 and "value_norm: 0 of" in other.stdout


def written(path: Path) -> dict:
    """The one grades-<time>.json that grade wrote into `path`."""
    found = list(path.glob("grades-*.json"))
    assert len(found) == 1 and found[0].with_suffix(".csv").is_file(), found
    return json.loads(found[0].read_text())


@pytest.mark.slow
def test_grade_a_class(copies, tmp_path):
    """Each exercise passes with only itself written (its tests never need another one), and the
    table says so, two copies at a time: untouched, one per exercise, all; k/n in every cell, a total
    per student, a summary row per exercise, the commit and the time graded, exit code 0."""
    students = [copies / s for s in ("untouched", *EXERCISES, "all")]
    proc = course(ROOT, "grade", *students, "--out", tmp_path, "-j", 2)
    assert proc.returncode == 0, proc.stderr
    data = written(tmp_path)
    assert data["exercises"] == list(EXERCISES)  # in the order a student meets them
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert data["commit"].split()[0] == head and data["time_limit_per_exercise_s"] == 60 and data["jobs"] == 2
    assert data["graded_at"][:4].isdigit() and data["graded_at"].endswith("+00:00")
    n = {name: cell["tests"] for name, cell in data["students"][-1]["exercises"].items()}  # all: every test ran
    assert all(n.values()) and n["ema_merging"] > len(exercises(ROOT)["ema_merging"].tests)  # parametrized: cases
    solved_by = {"untouched": set(), "all": set(EXERCISES), **{name: {name} for name in EXERCISES}}
    for row in data["students"]:
        want = solved_by[row["student"]]  # the copy's folder name
        assert {name: cell["status"] for name, cell in row["exercises"].items()} == {
            name: f"pass {n[name]}/{n[name]}" if name in want else f"{NOT_ATTEMPTED} 0/{n[name]}" for name in EXERCISES}, row
        assert row["total"] == f"{sum(n[name] for name in want)}/{sum(n.values())}" and row["problems"] == []
        assert all(cell["failures"] == {} for cell in row["exercises"].values())
    assert data["summary"] == dict.fromkeys(EXERCISES, f"2/{len(students)} pass")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"graded {data['graded_at'][:10]} ") and data["commit"] in lines[0] and "60 s" in lines[0]
    assert re.split(r"\s{2,}", lines[1]) == ["student", *EXERCISES, "total", "copy"]
    assert re.split(r"\s{2,}", lines[2]) == ["untouched", *[f"{NOT_ATTEMPTED} 0/{n[e]}" for e in EXERCISES],
                                              f"0/{sum(n.values())}", "as handed out"]
    assert re.split(r"\s{2,}", lines[len(students) + 2]) == ["(students passing)", *[f"2/{len(students)} pass"] * 7]
    csv_rows = next(tmp_path.glob("grades-*.csv")).read_text().splitlines()
    assert csv_rows[0] == ",".join(["student", *EXERCISES, "total", "copy", "problems", "notes", "commit", "graded at"])
    assert len(csv_rows) == 1 + len(students) + 1  # and the summary row


@pytest.mark.slow
def test_check_every_exercise_at_once(copies):
    proc = course(copies / "ema_merging", "check")
    assert proc.returncode == 1  # not every exercise passes: the open ones are not attempted
    assert re.search(r"^ema_merging\s+(\d+)\s+\1\s+pass\s", proc.stdout, re.M), proc.stdout
    for name in EXERCISES.keys() - {"ema_merging"}:  # still stubs: not run, as a grade does not run them
        assert re.search(rf"^{name}\s+{NOT_ATTEMPTED}\s+\(not run\)$", proc.stdout, re.M), name
    skipped = ", ".join(name for name in EXERCISES if name != "ema_merging")
    assert f"not run, not attempted (every region still the stub): {skipped};" in proc.stdout


@pytest.mark.slow
def test_a_module_that_does_not_parse_fails_its_tests_with_the_reason(tmp_path):
    copy = tmp_path / "copy"
    write_student_copy(copy)
    vatp = copy / "kvmini" / "methods" / "vatp.py"
    vatp.write_text(vatp.read_text().replace('        raise NotImplementedError("exercise value_norm',
                                             '        return received +\n        raise NotImplementedError("x'))
    proc = course(copy, "check", "value_norm")
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"^value_norm: kvmini/methods/vatp.py: line \d+$", proc.stdout, re.M)  # no parse: its line
    assert "did not run: the test module does not import: SyntaxError" in proc.stdout
    assert "value_norm: 0 of 4 tests pass" in proc.stdout
    proc = course(copy, "check")  # the table says why too: every method module is imported by the registry
    assert re.search(r"^\d+ tests did not run: the test module does not import: SyntaxError", proc.stdout, re.M), proc.stdout
    from kvmini.course.grading import grade_one, handed_out_here

    note = grade_one(copy, 300, *handed_out_here())["notes"][0]  # where, in the copy (not the grade's own tree)
    assert note.startswith("value_norm: ") and f'File "{copy}/kvmini/methods/vatp.py", line' in note, note


@pytest.mark.slow
def test_check_in_a_copy_of_some_exercises_shows_the_others_as_not_handed_out(tmp_path):
    copy = tmp_path / "copy"
    write_student_copy(copy, names=["frobenius_stop"])
    proc = course(copy, "check")
    assert proc.returncode == 1 and re.search(rf"^frobenius_stop\s+{NOT_ATTEMPTED}\s+\(not run\)$", proc.stdout, re.M)
    assert "not run, not attempted (every region still the stub): frobenius_stop;" in proc.stdout
    for name in EXERCISES.keys() - {"frobenius_stop"}:
        assert re.search(rf"^{name}\s+-\s+\(not handed out in this copy\)$", proc.stdout, re.M), name


def test_what_was_handed_out_comes_from_the_repository_not_the_copy(tmp_path):
    """A student who loosens a test and rewrites the manifest to match is still reported: grade compares
    the copy with the repository's own files, and the rewritten manifest is one more difference."""
    from kvmini.course.copies import fingerprint

    copy = tmp_path / "copy"
    write_student_copy(copy)
    test = copy / "tests" / "test_dbudgetkv.py"
    test.write_text(test.read_text().replace("assert ", "assert True or ", 1))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"]["tests/test_dbudgetkv.py"] = fingerprint("tests/test_dbudgetkv.py", test.read_text())
    (copy / MANIFEST).write_text(json.dumps(manifest))
    found = problems(copy)
    assert "tests/test_dbudgetkv.py changed" in found
    assert any(line.startswith(f"{MANIFEST} differs from this repository") for line in found)
    with tempfile.TemporaryDirectory() as tmp:  # and the grade runs the repository's tests, not the loosened one
        tree = graded_tree(copy, Path(tmp))
        assert (tree / "tests" / "test_dbudgetkv.py").read_text() == (ROOT / "tests" / "test_dbudgetkv.py").read_text()
        assert (tree / "kvmini").resolve() == (copy / "kvmini").resolve()  # with the copy's kvmini


def test_a_virtual_environment_in_the_copy_is_not_a_change():
    from kvmini.course.copies import graded

    assert graded("tests/conftest.py") and graded("tools/conftest.py") and graded("kvmini/cache.py") and graded("run.py")
    for rel in (".venv/lib/python3.11/site-packages/numpy/conftest.py", "venv/lib/python3.11/site-packages/x/conftest.py",
                ".tox/py311/conftest.py", "kvmini/__pycache__/cache.cpython-311.pyc"):
        assert not graded(rel), rel


def test_a_partly_written_exercise_is_unfinished(tmp_path):
    """ema_merging has three regions: with one written it is no longer open (its tests run when graded)
    but still unfinished (a tutorial cell that needs it skips)."""
    copy = tmp_path / "copy"
    write_student_copy(copy)
    module = copy / "kvmini" / "methods" / "ema_merging.py"
    text = module.read_text()
    first = text.index("raise NotImplementedError(\"exercise ema_merging")
    module.write_text(text[:first] + "u = F.normalize(k_evict, dim=-1) @ F.normalize(k_keep, dim=-1).transpose(-1, -2)\n"
                      "    return u.max(-1)" + text[text.index("\n", first):])
    ex = exercises(copy)["ema_merging"]
    assert not ex.open and ex.unfinished
    assert exercises(copy)["frobenius_stop"].open and exercises(copy)["frobenius_stop"].unfinished  # untouched


def test_an_exercise_not_handed_out_is_not_graded_and_one_that_was_cannot_be_hidden(tmp_path):
    """A copy of one exercise (--only): the others hold the solution and are not in its row. Taking
    the exercise out of the manifest does not hide it: its regions are not the solution."""
    from kvmini.course.grading import grade_one, handed_out_here

    copy = tmp_path / "copy"
    write_student_copy(copy, names=["frobenius_stop"])
    reference, files = handed_out_here()
    assert list(grade_one(copy, 60, reference, files)["exercises"]) == ["frobenius_stop"]
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "exercises": []}))
    cells = grade_one(copy, 60, reference, files)["exercises"]
    assert list(cells) == ["frobenius_stop"] and cells["frobenius_stop"]["status"].startswith(NOT_ATTEMPTED)


def test_check_says_when_an_exercise_has_no_tests_left(tmp_path, capsys):
    from kvmini.course.grading import check

    copy = tmp_path / "copy"
    write_student_copy(copy)
    solve(copy, "value_norm")
    (copy / "tests" / "test_vatp.py").unlink()
    assert check(copy, "value_norm", 60) == 1
    assert "no tests are declared for value_norm in this copy" in capsys.readouterr().out


@pytest.mark.slow
def test_a_hung_or_crashing_submission_is_reported_and_skipped(tmp_path):
    """One student: frobenius_stop written, value_norm's region loops forever, progressive_budgets' region
    kills the test process, convex_value_merge's tests deleted with a wrong solution. value_norm fails on
    its time limit, progressive_budgets on the crash (both said under the table), the other exercises'
    tests still run: frobenius_stop passes, convex_value_merge fails the repository's tests, which run
    whatever the copy did to its own; each failing test's first line is in the JSON."""
    copy = tmp_path / "copy"
    write_student_copy(copy)
    solve(copy, "frobenius_stop")
    for rel, name, body in [("vatp.py", "value_norm", "        while True:\n            pass\n"),
                            ("progressive_budgets.py", "progressive_budgets", "    import os; os._exit(3)\n"),
                            ("convex_value_merge.py", "convex_value_merge", "    return\n")]:
        module = copy / "kvmini" / "methods" / rel
        text = module.read_text()
        at = text.index(f'raise NotImplementedError("exercise {name}')
        module.write_text(text[:at] + body.lstrip() + text[at - (len(body) - len(body.lstrip())):])
    (copy / "tests" / "test_weightedkv.py").unlink()
    proc = course(ROOT, "grade", copy, "--timeout", 20, "--out", tmp_path / "grades")
    assert proc.returncode == 0, proc.stderr
    row = written(tmp_path / "grades")["students"][0]
    cells = {name: cell["status"] for name, cell in row["exercises"].items()}
    assert cells["frobenius_stop"].startswith("pass ") and cells["ema_merging"].startswith(NOT_ATTEMPTED)
    assert cells["value_norm"].startswith("fail 0/") and cells["progressive_budgets"].startswith("fail 0/")
    assert cells["convex_value_merge"].startswith("fail ")
    assert any(n.startswith("value_norm: 1 test did not finish: not finished within its exercise's time limit of 20 s")
               for n in row["notes"]), row["notes"]
    assert any(n.startswith("value_norm: ") and "did not run: its exercise's time limit of 20 s was used up" in n
               for n in row["notes"]), row["notes"]  # its other tests
    assert any(n.startswith("progressive_budgets: ") and "exit code 3" in n and "(while running it)" in n
               for n in row["notes"]), row["notes"]
    assert not any(n.startswith("convex_value_merge: ") for n in row["notes"])  # its tests ran: the repository's
    failures = row["exercises"]["convex_value_merge"]["failures"]
    assert failures and all(test.startswith("tests/test_weightedkv.py::") and line for test, line in failures.items())
    assert "tests/test_weightedkv.py is missing" in row["problems"]
    assert f"copy: value_norm: " in proc.stdout  # the reasons are printed under the table too


def test_grading_from_a_student_copy_is_refused(tmp_path):
    """What was handed out is read from the repository that grades: a copy, its exercises open, cannot be it."""
    from kvmini.course.grading import handed_out_here

    copy = tmp_path / "copy"
    write_student_copy(copy)
    with pytest.raises(KvminiError, match="grade from the repository the copies were made from: .* is itself a student copy"):
        handed_out_here(copy)
    reference, files = handed_out_here()
    assert list(reference) == list(EXERCISES) and "tests/test_d2o.py" in files[False] and "tests/test_d2o.py" in files[True]


def test_grade_output_inside_a_copy_is_refused(tmp_path):
    from kvmini.course.grading import grade

    copy = tmp_path / "copy"
    write_student_copy(copy)
    with pytest.raises(KvminiError, match=f"--out {copy / 'tests'} is inside the copy {copy}"):
        grade([copy], copy / "tests", 60, 1)
    assert not list((copy / "tests").glob("grades-*"))


def test_grade_writes_outside_the_repository_by_default():
    from kvmini.course.__main__ import parser

    out = Path(parser().parse_args(["grade", "x"]).out).resolve()
    assert out == ROOT.parent / "kvmini-grades" and ROOT not in out.parents


def test_only_a_test_may_skip_itself(tmp_path):
    """A skip raised in a test file (a CUDA marker) passes; one raised by the code under test, or an
    expected failure, does not count, and says where (hand-written records, as limits.py writes them)."""
    from kvmini.course.grading import not_run
    from kvmini.course.running import outcomes

    (tmp_path / "tests").mkdir()
    records = [
        {"test": "tests/test_vatp.py::test_marker", "when": "setup", "outcome": "skipped", "seconds": 0, "xfail": None,
         "skip": [str(tmp_path / "tests" / "conftest.py"), 52, "Skipped: no CUDA GPU on this machine"], "message": ""},
        {"test": "tests/test_vatp.py::test_relative", "when": "call", "outcome": "skipped", "seconds": 0, "xfail": None,
         "skip": ["tests/test_vatp.py", 9, "Skipped: own"], "message": ""},
        {"test": "tests/test_vatp.py::test_from_code", "when": "call", "outcome": "skipped", "seconds": 0, "xfail": None,
         "skip": [str(tmp_path / "kvmini" / "methods" / "vatp.py"), 44, "Skipped: needs a GPU"], "message": ""},
        {"test": "tests/test_vatp.py::test_xfail", "when": "call", "outcome": "skipped", "seconds": 0, "xfail": "later",
         "skip": None, "message": ""},
        {"test": "tests/test_vatp.py::test_passes", "when": "call", "outcome": "passed", "seconds": 0, "xfail": None,
         "skip": None, "message": ""}]
    results = outcomes(records, tmp_path)
    assert [(r.test.split("::")[1], r.ok) for r in results] == [
        ("test_marker", True), ("test_relative", True), ("test_from_code", False), ("test_xfail", False), ("test_passes", True)]
    assert not_run(results) == [
        "1 test did not count: skipped by kvmini/methods/vatp.py:44: needs a GPU (only a test may skip itself)",
        "1 test did not count: expected to fail (xfail: later), which no exercise's test is"]


@pytest.mark.slow
def test_a_skip_in_the_solution_is_not_a_pass_and_a_copy_without_its_manifest_is_graded(tmp_path):
    """A region that skips its tests grades as failed, with the reason under the table; a copy whose
    manifest is gone is graded all the same: its solved exercise passes (not '-', not handed out)."""
    from kvmini.course.grading import grade_one, handed_out_here

    reference, files = handed_out_here()
    skipping, unlisted = tmp_path / "skipping", tmp_path / "unlisted"
    write_student_copy(skipping, names=["value_norm"])
    vatp = skipping / "kvmini" / "methods" / "vatp.py"
    vatp.write_text(vatp.read_text().replace('        raise NotImplementedError("exercise value_norm',
                                             '        import pytest; pytest.skip("needs a CUDA GPU")\n'
                                             '        raise NotImplementedError("x'))
    row = grade_one(skipping, 300, reference, files)
    assert list(row["exercises"]) == ["value_norm"] and row["exercises"]["value_norm"]["status"].startswith("fail 0/")
    assert any(n.startswith("value_norm: ") and "did not count: skipped by kvmini/methods/vatp.py:" in n
               and n.endswith("needs a CUDA GPU (only a test may skip itself)") for n in row["notes"]), row["notes"]
    write_student_copy(unlisted)
    solve(unlisted, "value_norm")  # with the repository's own solution
    (unlisted / MANIFEST).unlink()
    row = grade_one(unlisted, 300, reference, files)
    assert {name: cell["status"].rsplit(" ", 1)[0] for name, cell in row["exercises"].items()} == {
        name: "pass" if name == "value_norm" else NOT_ATTEMPTED for name in reference}
    assert "is missing or unreadable" in row["problems"][0]


def test_a_misspelt_command_is_not_a_new_copy():
    """There is no short form `kvmini.course DIR`: a misspelt command, or a folder named like one, is refused."""
    for argv in (["chek"], ["some/folder/chek"]):
        proc = course(ROOT, *argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"invalid choice: '{argv[0]}' (choose from 'new', 'check', 'grade')" in proc.stderr, proc.stderr
    assert not (ROOT / "chek").exists() and not (ROOT / "some").exists()


@pytest.mark.slow
def test_a_copy_with_the_references_withheld_holds_none_and_a_solution_passes_check(tmp_path):
    """`new --withhold-references`: no line of any reference's body is anywhere in the copy (a grep
    for every line that appears only inside those bodies, and for one line of each by hand); with
    the exercises open `check` fails, with them written it passes on the stored cases, the copy is
    as handed out, and a test that uses a withheld reference outside the exercises passes too."""
    from kvmini.course.copies import CASES, references, withhold

    bodies = references(ROOT)  # every test file that carries references (test_references_are_found_in_any_test_file)
    elsewhere = {line.strip() for p in ROOT.rglob("*.py") if ".git" not in p.parts
                 for line in withhold(p.read_text(encoding="utf-8", errors="replace")).splitlines()}
    only_there = {line.strip() for found in bodies.values() for body in found for line in body.splitlines()} - elsewhere
    only_there = {line for line in only_there if len(line) > 12}
    by_hand = ["while pruned < S - 1:",  # sequential_prune
               "vals[j + 1] = (abar[j] * vals[j] + abar[j + 1] * vals[j + 1]) / (abar[j] + abar[j + 1])  # 9",
               "Z = largest_remainder(water_fill(C, (w_t - ws) * L, held), min((w_t - ws) * L, sum(held)))  # Eq. 7-8",
               "norm = {q: sum(abs(x) ** p for x in values[b, h, q].tolist()) ** (1 / p) for q in middle}",
               "chose = [i for i in evict if best[i][2] == j and best[i][0] >= tau]",
               "e = [math.exp(-(f - mean) / std) if how == \"zscore\" else math.exp(-f) for f in F_v]"]
    assert set(by_hand) <= only_there and len(only_there) > 60
    copy = tmp_path / "copy"
    proc = course(ROOT, "new", copy, "--withhold-references")
    assert proc.returncode == 0, proc.stderr
    held = {line.strip() for p in copy.rglob("*") if p.is_file() and p.suffix != ".pt"
            for line in p.read_text(encoding="utf-8", errors="replace").splitlines()}
    assert not only_there & held, sorted(only_there & held)[:5]
    assert (copy / CASES).is_file() and problems(copy) == []
    assert course(copy, "check", "frobenius_stop").returncode == 1  # open: its tests fail
    for name in EXERCISES:
        solve(copy, name)
    proc = course(copy, "check")
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in EXERCISES:
        assert re.search(rf"^{name}\s+(\d+)\s+\1\s+pass\s", proc.stdout, re.M), proc.stdout
    other = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_weightedkv.py::test_chunk_size_1_is_algorithm_1_literally"],
                           cwd=copy, capture_output=True, text=True, timeout=600)
    assert other.returncode == 0, other.stdout[-2000:]
    assert problems(copy) == []  # the student's work is inside the regions


def test_references_are_found_in_any_test_file(tmp_path):
    """A test file may carry `# BEGIN REFERENCE` markers of its own (a new method's test, copied from
    test_vatp's) with no list to edit: the files found are those whose functions are `@stored`, here and
    in a folder holding only a new one."""
    from kvmini.course.copies import references

    stored_in = {f"tests/{p.name}" for p in (ROOT / "tests").glob("*.py") if "\n@stored\n" in p.read_text()}
    assert set(references(ROOT)) == stored_in and "tests/test_vatp.py" in stored_in
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_new.py").write_text(
        "@stored\ndef literal(x):\n    # BEGIN REFERENCE\n    return 2 * x\n    # END REFERENCE\n")
    assert references(tmp_path) == {"tests/test_new.py": ["    return 2 * x"]}


DOC = (ROOT / "docs" / "course.md").read_text()


def test_the_guide_lists_the_exercises_as_declared():
    """docs/course.md's table: each exercise, its module and functions, its tutorial and section."""
    rows = re.findall(r"^\| `(\w+)` \| `([\w/.]+)`: ([^|(]+?)(?: \(.*?\))? \| (\d\d), \"(.+)\" \|$", DOC, re.M)
    found = exercises(ROOT)
    assert [r[0] for r in rows] == list(found)
    for name, module, functions, number, section in rows:
        ex = found[name]
        assert ex.holes == {module: [f.strip(" `") for f in functions.split(",")]}, name
        assert ex.tutorial.startswith(f"tutorials/{number}_") and ex.section == section, name


def test_every_command_of_the_guide_is_accepted():
    """Each `python -m kvmini.course ...` line of docs/course.md and the README parses as written (its
    arguments and options exist); the defaults the guide states are the parser's."""
    import shlex

    from kvmini.course.__main__ import parser

    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"(?:^|&& )python -m kvmini\.course (.+?)(?:\s+#.*)?$", DOC + "\n" + readme, re.M)
    assert len(commands) >= 10
    for line in commands:
        parser().parse_args([a for a in shlex.split(line.replace("../class/*", "../class/a ../class/b"))])
    grade = parser().parse_args(["grade", "x"])
    assert grade.jobs == os.cpu_count() and grade.timeout == 60 and "--timeout`, 60 s" in DOC
    assert "`-j` at a time (default: the machine's cores)" in DOC


def test_the_guides_weights_link_works_from_the_repository(tmp_path):
    """The guide's `ln -s` line, run as written in a repository beside a copy that `new` wrote (which holds
    the tracked weights/README.md, so a link to the whole weights/ folder would land in weights/weights):
    the copy then finds the default model where kvmini looks for it (an absolute link)."""
    from kvmini.weights import DEFAULT_MODEL_DIR

    line = next(l for l in DOC.splitlines() if l.startswith("ln -s "))
    command = line.split("#")[0].strip()
    repo, copy = tmp_path / "repo", tmp_path / "kvmini-student"
    (repo / "weights" / DEFAULT_MODEL_DIR.name).mkdir(parents=True)
    (repo / "weights" / DEFAULT_MODEL_DIR.name / "config.json").write_text("{}")
    write_student_copy(copy, ROOT)
    assert (copy / "weights" / "README.md").is_file()  # the copy's own weights/ folder
    subprocess.run(["bash", "-c", command], cwd=repo, check=True)
    found = copy / DEFAULT_MODEL_DIR.relative_to(ROOT)
    assert (found / "config.json").read_text() == "{}"
    assert Path(os.readlink(found)).is_absolute()


@pytest.mark.parametrize("prepared", [False, True])
def test_new_says_in_one_line_when_the_model_to_link_is_not_prepared(tmp_path, monkeypatch, capsys, prepared):
    """In a fresh clone the guide's `ln -s` line, run next, would make a dangling link and nothing said so
    until a test failed: `new` says it, one line on stderr, and only then (the copy is written either way)."""
    import kvmini.weights
    from kvmini.course.__main__ import main

    model = tmp_path / "weights" / "SmolLM2-135M-Instruct"
    if prepared:
        model.mkdir(parents=True)
        (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(kvmini.weights, "DEFAULT_MODEL_DIR", model)
    assert main(["new", str(tmp_path / "copy"), "--only", "value_norm"]) == 0
    err = capsys.readouterr().err
    assert (err == "") if prepared else (err.count("\n") == 1 and err.startswith(f"note: {model} is not prepared yet,"))
    assert (tmp_path / "copy" / "kvmini" / "methods" / "vatp.py").is_file()


def test_a_test_file_that_does_not_parse_is_named_by_check(tmp_path, capsys):
    """Not 'no tests are declared' and '0 of 0 tests pass': the file and its error, and exit code 1."""
    from kvmini.course.grading import check

    copy = tmp_path / "copy"
    write_student_copy(copy, names=["frobenius_stop"])
    test = copy / "tests" / "test_dbudgetkv.py"
    lines = test.read_text().splitlines()
    lines[19] = "def ("
    test.write_text("\n".join(lines) + "\n")
    assert check(copy, "frobenius_stop", 60) == 1
    out = capsys.readouterr().out
    assert ("tests/test_dbudgetkv.py does not parse: invalid syntax (line 20): the exercises whose tests it holds "
            "cannot be checked until it does") in out
    assert "no tests are declared" not in out


def test_a_students_name_from_the_manifest(tmp_path):
    """`new --student NAME` names the row; without it the row is the copy's folder name."""
    from kvmini.course.grading import grade_one, handed_out_here

    named, plain = tmp_path / "x" / "kvmini", tmp_path / "bob"
    assert course(ROOT, "new", named, "--student", "Alice Martin").returncode == 0
    write_student_copy(plain)
    reference, files = handed_out_here()
    assert grade_one(named, 60, reference, files)["student"] == "Alice Martin"
    assert grade_one(plain, 60, reference, files)["student"] == "bob"


def test_the_guides_class_timing_is_the_committed_grade():
    """docs/course.md's timing of thirty copies is the committed grade's own record (results/course/):
    30 students, 10 of each kind graded as made, 2 at a time on 2 cores, its minutes, load and commit."""
    found = sorted((ROOT / "results" / "course").glob("grades-*.json"))
    assert len(found) == 1 and found[0].with_suffix(".csv").is_file()
    data = json.loads(found[0].read_text())
    kinds = {}
    for row in data["students"]:
        kinds.setdefault(row["student"].split("-")[0], []).append(row["total"])
    total = sum(cell["tests"] for cell in data["students"][0]["exercises"].values())
    assert {kind: len(rows) for kind, rows in kinds.items()} == {"untouched": 10, "half": 10, "solved": 10}
    assert set(kinds["untouched"]) == {f"0/{total}"} and set(kinds["solved"]) == {f"{total}/{total}"}
    assert all(row["problems"] == [] and row["notes"] == [] for row in data["students"])
    assert data["jobs"] == data["cores"] == 2 and data["seconds"] < 15 * 60
    assert f"in {data['seconds'] / 60:.1f} minutes on this project's 2-core machine" in " ".join(DOC.split())
    assert f"load average {data['load_at_start']} at its start; commit {data['commit'][:7]}" in " ".join(DOC.split())


@pytest.mark.slow
def test_the_guides_setup_pasted_in_order_gives_a_copy_that_checks_an_exercise(tmp_path, default_model_dir):
    """docs/course.md as a newcomer runs it: in a repository holding the default model, the first `new` line
    and the `ln -s` line of "Hand out", then "Work on one exercise"'s `cd` and `check ema_merging`, pasted
    into one shell in that order. The copy finds the model through the link (no download) and the check
    runs the exercise's tests, which fail on its open holes."""
    hand_out = DOC.split("## Hand out", 1)[1].split("```bash", 1)[1].split("```", 1)[0].splitlines()
    work = DOC.split("## Work on one exercise", 1)[1].split("```bash", 1)[1].split("```", 1)[0].splitlines()
    lines = [next(l for l in hand_out if l.startswith("python -m kvmini.course new ../kvmini-student ")),
             next(l for l in hand_out if l.startswith("ln -s ")),
             next(l for l in work if l.startswith("cd ")),
             next(l for l in work if l.startswith("python -m kvmini.course check ema_merging"))]
    commands = [line.split("#")[0].strip() for line in lines]
    repo = tmp_path / "repo"  # this repository's tracked files, as a git checkout of its own
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    (repo / "weights" / default_model_dir.name).symlink_to(default_model_dir)  # the repository has the model
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               HF_HUB_OFFLINE="1")
    run = subprocess.run(["bash", "-c", "\n".join(commands)], cwd=repo, capture_output=True, text=True, env=env,
                         timeout=900)
    copy = tmp_path / "kvmini-student"
    assert (copy / "weights" / default_model_dir.name / "config.json").is_file(), run.stdout + run.stderr
    assert re.search(r"^ema_merging: 0 of \d+ tests pass", run.stdout, re.M), run.stdout[-3000:] + run.stderr[-3000:]
    assert "NotImplementedError: exercise ema_merging" in run.stdout and "download" not in run.stdout + run.stderr
