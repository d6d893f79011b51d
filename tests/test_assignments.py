"""Course mode: a student copy loses exactly the marked solutions; each exercise's check runs its own
tests (failing while its holes are open, passing once they are written, whatever the other
exercises' state); grade reports a class; every exercise is declared in full."""
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvmini.assignments import MANIFEST, exercises, solved, strip, write_student_copy
from kvmini.errors import KvminiError
from kvmini.grading import NOT_ATTEMPTED, graded_tree, problems

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = {  # written out by hand: what the markers in kvmini/methods must add up to
    "variance_softmax": {"kvmini/methods/variance_softmax.py": ["layer_weights"]},
    "reciprocal_allocation": {"kvmini/methods/variance_softmax.py": ["layer_weights"]},
    "ema_merging": {"kvmini/methods/ema_merging.py": ["nearest", "ema_threshold", "convex_merge"]},
    "frobenius_stop": {"kvmini/methods/frobenius_stop.py": ["frobenius_stop"]},
    "convex_value_merge": {"kvmini/methods/convex_value_merge.py": ["convex_value_merge"]},
    "progressive_budgets": {"kvmini/methods/progressive_budgets.py": ["ProgressiveBudgets.decide"]},
    "value_norm": {"kvmini/methods/vatp.py": ["ValueWeightedAttention.norm"]},
}


def assignments(cwd, *argv):
    return subprocess.run([sys.executable, "-m", "kvmini.assignments", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def solve(copy: Path, name: str) -> None:
    """What a student does: every region of `name` in the copy gets a working body (the original's)."""
    for rel in exercises(ROOT)[name].holes:
        still_open = {n for n, ex in exercises(copy).items() if ex.open and rel in ex.holes} - {name}
        (copy / rel).write_text(strip((ROOT / rel).read_text(), still_open)[0])


def test_strip_keeps_markers_and_raises():
    text = 'def f(x):\n    y = 1\n    # BEGIN EXERCISE f: tutorials/t.py, "F"\n    return x + y\n    # END EXERCISE\n'
    stripped, names = strip(text)
    assert names == ["f"]
    assert stripped == ('def f(x):\n    y = 1\n    # BEGIN EXERCISE f: tutorials/t.py, "F"\n    raise NotImplementedError('
                        '"exercise f: see tutorials/t.py, \'F\'; check it with python -m kvmini.assignments check f")\n'
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
    proc = assignments(ROOT, "new", tmp_path / "copy")
    assert proc.returncode == 0, proc.stderr
    assert "ema_merging\n    holes: kvmini/methods/ema_merging.py: nearest, ema_threshold, convex_merge\n" in proc.stdout
    for name in EXERCISES:
        assert f"    check: python -m kvmini.assignments check {name}\n" in proc.stdout
    assert {n for n, ex in exercises(tmp_path / "copy").items() if ex.open} == set(EXERCISES)
    assert not (tmp_path / "copy" / "weights" / "SmolLM2-135M-Instruct").exists()
    assert assignments(ROOT, tmp_path / "old-form").returncode == 0  # python -m kvmini.assignments DIR


@pytest.mark.slow
def test_check_one_exercise_fails_open_and_passes_written(copies):
    """Only ema_merging's tests run: with its three holes open each fails on its own stub, never on
    another exercise's (all six others are open too); written, all of them pass."""
    open_ = assignments(copies / "untouched", "check", "ema_merging")
    assert open_.returncode == 1, open_.stderr
    failed = re.findall(r"^  FAIL  (\S+)", open_.stdout, re.M)
    assert failed and "  PASS  " not in open_.stdout
    assert set(re.findall(r"exercise (\w+): see", open_.stdout)) == {"ema_merging"}
    assert f"ema_merging: 0 of {len(failed)} tests pass" in open_.stdout
    done = assignments(copies / "ema_merging", "check", "ema_merging")
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.findall(r"^  PASS  (\S+)", done.stdout, re.M) == failed
    assert f"ema_merging: {len(failed)} of {len(failed)} tests pass" in done.stdout
    other = assignments(ROOT, "check", "value_norm", copies / "ema_merging")  # the copy named
    assert other.returncode == 1 and "value_norm: 0 of" in other.stdout


@pytest.mark.slow
def test_grade_a_class(copies, tmp_path):
    """Each exercise passes with only itself written (its tests never need another one), and the
    table says so: untouched, one per exercise, all."""
    students = [copies / s for s in ("untouched", *EXERCISES, "all")]
    proc = assignments(ROOT, "grade", *students, "--json", tmp_path / "g.json", "--csv", tmp_path / "g.csv")
    assert proc.returncode == 0, proc.stderr
    expected = {"untouched": {}, "all": dict.fromkeys(EXERCISES, "pass"), **{n: {n: "pass"} for n in EXERCISES}}
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["exercises"] == list(EXERCISES)  # in the order a student meets them
    for row in data["students"]:
        want = expected[Path(row["student"]).name]
        assert row["exercises"] == {name: want.get(name, NOT_ATTEMPTED) for name in EXERCISES}, row
        assert row["problems"] == []
    lines = proc.stdout.splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["student", *EXERCISES, "copy"]
    assert re.split(r"\s{2,}", lines[1]) == [str(students[0]), *[NOT_ATTEMPTED] * 7, "as handed out"]
    assert re.split(r"\s{2,}", lines[3]) == [str(students[2]), NOT_ATTEMPTED, "pass", *[NOT_ATTEMPTED] * 5, "as handed out"]
    assert re.split(r"\s{2,}", lines[-1]) == [str(students[-1]), *["pass"] * 7, "as handed out"]
    csv_rows = (tmp_path / "g.csv").read_text().splitlines()
    assert csv_rows[0] == ",".join(["student", *EXERCISES, "copy", "problems", "notes"]) and len(csv_rows) == 1 + len(students)


@pytest.mark.slow
def test_check_every_exercise_at_once(copies):
    proc = assignments(copies / "ema_merging", "check")
    assert proc.returncode == 1  # the open exercises' tests fail
    assert re.search(r"^ema_merging\s+(\d+)\s+\1\s+pass\s", proc.stdout, re.M), proc.stdout
    for name in EXERCISES.keys() - {"ema_merging"}:
        assert re.search(rf"^{name}\s+(\d+)\s+0\s+{NOT_ATTEMPTED}\s", proc.stdout, re.M), name


@pytest.mark.slow
def test_a_module_that_does_not_parse_fails_its_tests_with_the_reason(tmp_path):
    copy = tmp_path / "copy"
    write_student_copy(copy)
    vatp = copy / "kvmini" / "methods" / "vatp.py"
    vatp.write_text(vatp.read_text().replace('        raise NotImplementedError("exercise value_norm',
                                             '        return received +\n        raise NotImplementedError("x'))
    proc = assignments(copy, "check", "value_norm")
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"^value_norm: kvmini/methods/vatp.py: line \d+$", proc.stdout, re.M)  # no parse: its line
    assert "did not run: the test module does not import: SyntaxError" in proc.stdout
    assert "value_norm: 0 of 3 tests pass" in proc.stdout
    proc = assignments(copy, "check")  # the table says why too: every method module is imported by the registry
    assert re.search(r"^\d+ tests did not run: the test module does not import: SyntaxError", proc.stdout, re.M), proc.stdout
    from kvmini.grading import grade_one, handed_out_here

    note = grade_one(copy, 300, *handed_out_here())["notes"][0]  # where, in the copy (not the grade's own tree)
    assert note.startswith("value_norm: ") and f'File "{copy}/kvmini/methods/vatp.py", line' in note, note


@pytest.mark.slow
def test_check_in_a_copy_of_some_exercises_shows_the_others_as_not_handed_out(tmp_path):
    copy = tmp_path / "copy"
    write_student_copy(copy, names=["frobenius_stop"])
    proc = assignments(copy, "check")
    assert re.search(rf"^frobenius_stop\s+(\d+)\s+0\s+{NOT_ATTEMPTED}\s", proc.stdout, re.M), proc.stdout
    for name in EXERCISES.keys() - {"frobenius_stop"}:
        assert re.search(rf"^{name}\s+-\s+\(not handed out in this copy\)$", proc.stdout, re.M), name


def test_what_was_handed_out_comes_from_the_repository_not_the_copy(tmp_path):
    """A student who loosens a test and rewrites the manifest to match is still reported: grade compares
    the copy with the repository's own files, and the rewritten manifest is one more difference."""
    from kvmini.assignments import fingerprint

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
    from kvmini.assignments import graded

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
    from kvmini.grading import grade_one, handed_out_here

    copy = tmp_path / "copy"
    write_student_copy(copy, names=["frobenius_stop"])
    reference, files = handed_out_here()
    assert grade_one(copy, 60, reference, files)["exercises"] == {"frobenius_stop": NOT_ATTEMPTED}
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "exercises": []}))
    assert grade_one(copy, 60, reference, files)["exercises"] == {"frobenius_stop": NOT_ATTEMPTED}


def test_check_says_when_an_exercise_has_no_tests_left(tmp_path, capsys):
    from kvmini.grading import check

    copy = tmp_path / "copy"
    write_student_copy(copy)
    solve(copy, "value_norm")
    (copy / "tests" / "test_vatp.py").unlink()
    assert check(copy, "value_norm", 60) == 1
    assert "no tests are declared for value_norm in this copy" in capsys.readouterr().out


@pytest.mark.slow
def test_grading_runs_the_repositorys_tests_each_exercise_apart(tmp_path):
    """One student: frobenius_stop written, value_norm's region loops forever, convex_value_merge's tests
    deleted with a wrong solution. Each exercise runs alone: frobenius_stop passes, value_norm fails
    on its time limit (the reason under the table), convex_value_merge fails the repository's tests,
    which run whatever the copy did to its own."""
    copy = tmp_path / "copy"
    write_student_copy(copy)
    solve(copy, "frobenius_stop")
    vatp = copy / "kvmini" / "methods" / "vatp.py"
    vatp.write_text(vatp.read_text().replace('        raise NotImplementedError("exercise value_norm',
                                             '        while True:\n            pass\n        raise NotImplementedError("x'))
    merge = copy / "kvmini" / "methods" / "convex_value_merge.py"
    merge.write_text(merge.read_text().replace('    raise NotImplementedError("exercise convex_value_merge', '    return\n'
                                               '    raise NotImplementedError("x'))
    (copy / "tests" / "test_weightedkv.py").unlink()
    proc = assignments(ROOT, "grade", copy, "--timeout", 30, "--json", tmp_path / "g.json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "g.json").read_text())["students"][0]
    assert row["exercises"]["frobenius_stop"] == "pass"
    assert row["exercises"]["value_norm"].startswith("fail 0/")
    assert row["exercises"]["convex_value_merge"].startswith("fail ")
    assert row["exercises"]["ema_merging"] == NOT_ATTEMPTED
    assert any(n.startswith("value_norm: ") and "did not run: not finished after 30 s" in n for n in row["notes"])
    assert not any(n.startswith("convex_value_merge: ") for n in row["notes"])  # its tests ran: the repository's
    assert "tests/test_weightedkv.py is missing" in row["problems"]
    assert f"{copy}: value_norm: " in proc.stdout  # the reasons are printed under the table too


def test_grading_from_a_student_copy_is_refused(tmp_path):
    """What was handed out is read from the repository that grades: a copy, its exercises open, cannot be it."""
    from kvmini.grading import handed_out_here

    copy = tmp_path / "copy"
    write_student_copy(copy)
    with pytest.raises(KvminiError, match="grade from the repository the copies were made from: .* is itself a student copy"):
        handed_out_here(copy)
    reference, files = handed_out_here()
    assert list(reference) == list(EXERCISES) and "tests/test_d2o.py" in files


def test_grade_outputs_that_would_overwrite_each_other_or_a_copy_are_refused(tmp_path, capsys):
    from kvmini.grading import grade

    copy = tmp_path / "copy"
    write_student_copy(copy)
    same = tmp_path / "grades.txt"
    with pytest.raises(KvminiError, match="--json and --csv name the same file"):
        grade([copy], same, same, 60)
    with pytest.raises(KvminiError, match=f"--json {copy / 'tests' / 'test_vatp.py'} is inside the copy {copy}"):
        grade([copy], copy / "tests" / "test_vatp.py", None, 60)
    assert (copy / "tests" / "test_vatp.py").read_text() == (ROOT / "tests" / "test_vatp.py").read_text()


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.test_vatp" name="test_marker"><skipped type="pytest.skip" message="no CUDA GPU on this machine">{tests}/conftest.py:52: no CUDA GPU on this machine</skipped></testcase>
<testcase classname="tests.test_vatp" name="test_relative"><skipped type="pytest.skip" message="own">tests/test_vatp.py:9: own</skipped></testcase>
<testcase classname="tests.test_vatp" name="test_from_code"><skipped type="pytest.skip" message="needs a GPU">{root}/kvmini/methods/vatp.py:44: needs a GPU</skipped></testcase>
<testcase classname="tests.test_vatp" name="test_xfail"><skipped type="pytest.xfail" message="later" /></testcase>
<testcase classname="tests.test_vatp" name="test_passes" />
</testsuite></testsuites>"""


def test_only_a_test_may_skip_itself(tmp_path):
    """A skip raised in a test file (a CUDA marker) passes; one raised by the code under test, or an
    expected failure, does not count, and says where (hand-written JUnit, as pytest writes it)."""
    from kvmini.grading import not_run, parse

    (tmp_path / "tests").mkdir()
    report = tmp_path / "report.xml"
    report.write_text(JUNIT.format(tests=tmp_path / "tests", root=tmp_path))
    results, broken = parse(report, tmp_path / "tests")
    assert broken == {} and [(r.test.split("::")[1], r.ok) for r in results] == [
        ("test_marker", True), ("test_relative", True), ("test_from_code", False), ("test_xfail", False), ("test_passes", True)]
    assert not_run(results) == [
        "1 test did not count: skipped by kvmini/methods/vatp.py:44: needs a GPU (only a test may skip itself)",
        "1 test did not count: expected to fail (xfail: later), which no exercise's test is"]


@pytest.mark.slow
def test_a_skip_in_the_solution_is_not_a_pass_and_a_copy_without_its_manifest_is_graded(tmp_path):
    """A region that skips its tests grades as failed, with the reason under the table; a copy whose
    manifest is gone is graded all the same: its solved exercise passes (not '-', not handed out)."""
    from kvmini.grading import grade_one, handed_out_here

    reference, files = handed_out_here()
    skipping, unlisted = tmp_path / "skipping", tmp_path / "unlisted"
    write_student_copy(skipping, names=["value_norm"])
    vatp = skipping / "kvmini" / "methods" / "vatp.py"
    vatp.write_text(vatp.read_text().replace('        raise NotImplementedError("exercise value_norm',
                                             '        import pytest; pytest.skip("needs a CUDA GPU")\n'
                                             '        raise NotImplementedError("x'))
    row = grade_one(skipping, 300, reference, files)
    assert row["exercises"] == {"value_norm": "fail 0/" + row["exercises"]["value_norm"].split("/")[1]}
    assert any(n.startswith("value_norm: ") and "did not count: skipped by kvmini/methods/vatp.py:" in n
               and n.endswith("needs a CUDA GPU (only a test may skip itself)") for n in row["notes"]), row["notes"]
    write_student_copy(unlisted)
    solve(unlisted, "value_norm")  # with the repository's own solution
    (unlisted / MANIFEST).unlink()
    row = grade_one(unlisted, 300, reference, files)
    assert row["exercises"] == {name: "pass" if name == "value_norm" else NOT_ATTEMPTED for name in reference}
    assert "is missing or unreadable" in row["problems"][0]


def test_a_misspelt_command_is_not_a_new_copy():
    proc = assignments(ROOT, "chek")  # (the older form `assignments DIR` would write a copy named chek)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'chek' is not a command (new, check, grade): did you mean check?" in proc.stderr
    assert not (ROOT / "chek").exists()
