"""kvmini.eval.test_run: a JUnit report read into counts and seconds, and the sentences written from them."""
import json
import subprocess
import sys

from kvmini.eval import test_run

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.test_a" name="test_two" time="2.25"/>
<testcase classname="tests.test_b" name="test_gpu" time="0.01"><skipped type="pytest.skip" message="no CUDA GPU on this machine">x</skipped></testcase>
<testcase classname="tests.test_b" name="test_gpu2" time="0.01"><skipped type="pytest.skip" message="no CUDA GPU on this machine">x</skipped></testcase>
<testcase classname="tests.test_b" name="test_known" time="4.0"><skipped type="pytest.xfail" message="the authors' code">x</skipped></testcase>
</testsuite></testsuites>"""


def test_a_report_by_hand(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    r = test_run.read_report(xml)
    assert (r["tests"], r["passed"], r["failed"], r["skipped"], r["xfailed"]) == (5, 2, 0, 2, 1)
    assert r["skip_reasons"] == {"no CUDA GPU on this machine": 2}
    assert r["xfailed_tests"] == ["tests/test_b.py::test_known"]
    assert r["file_seconds"] == {"tests/test_a.py": 3.75, "tests/test_b.py": 4.02}  # 1.5 + 2.25; 0.01 + 0.01 + 4
    assert r["test_seconds"]["tests/test_a.py::test_two"] == 2.25


def test_minutes():
    assert [test_run.minutes(s) for s in (42.0, 59.6, 95.4, 3599.6, 906)] == ["42 s", "1m00s", "1m35s", "60m00s",
                                                                               "15m06s"]


def run_of(tests: dict[str, float]) -> dict:
    return {"command": "python -m kvmini.eval.test_run", "commit": "abc", "date": "2026-11-25 21:00 UTC",
            "seconds": 906.0, "machine": {"cpus": 2, "load_at_start": 0.5, "load_at_end": 1.0},
            "tests": 3, "passed": 2, "failed": 0, "skipped": 1, "xfailed": 0, "xfailed_tests": [],
            "skip_reasons": {"no CUDA GPU on this machine": 1}, "file_seconds": {"tests/test_tutorials.py": 60.0},
            "test_seconds": tests}


def test_the_sentences_by_hand():
    notebook = "tests/test_tutorials.py::test_tutorial_runs_as_a_notebook_and_shows_its_figures"
    copy = "tests/test_tutorials.py::test_tutorial_runs_in_a_student_copy"
    run = run_of({f"{notebook}[01_a]": 10.0, f"{notebook}[02_b]": 50.0, f"{copy}[01_a]": 70.2, f"{copy}[02_b]": 5.0})
    assert test_run.summary(run).startswith("The last recorded run of the suite took **15m06s** for 3 tests: 2 pass, "
                                            "1 skip (1: no CUDA GPU on this machine), 0 xfail. The slowest files: "
                                            "test_tutorials.py 1m00s. Recorded by `python -m kvmini.eval.test_run` "
                                            "at commit abc")
    text = test_run.tutorials(run)
    assert "as notebooks, the 2 tutorials took 10–50 s each (02_b the slowest), 1m00s in all" in text
    assert "every exercise open, the 2 tutorials took 5–70 s each (01_a the slowest), 1m15s in all" in text
    assert "did not run the tutorials" in test_run.tutorials(run_of({}))


def test_a_run_that_fails_writes_nothing_and_one_that_passes_is_recorded(tmp_path):
    (tmp_path / "test_pass.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_fail.py").write_text("def test_no():\n    assert 1 == 2\n")
    out = tmp_path / "run.json"
    run = lambda *tests: subprocess.run([sys.executable, "-m", "kvmini.eval.test_run", "--out", str(out), "--",  # noqa: E731
                                         *map(str, tests)], cwd=test_run.ROOT, capture_output=True, text=True,
                                        timeout=300)
    failed = run(tmp_path / "test_pass.py", tmp_path / "test_fail.py")
    assert failed.returncode == 1 and "did not pass" in failed.stderr and not out.exists()
    passed = run(tmp_path / "test_pass.py")
    assert passed.returncode == 0, passed.stderr
    recorded = json.loads(out.read_text())
    assert (recorded["tests"], recorded["passed"], recorded["failed"]) == (1, 1, 0)
    assert recorded["command"].endswith(f"-- {tmp_path / 'test_pass.py'}")
