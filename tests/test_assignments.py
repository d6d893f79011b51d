"""Course-assignment mode: the student copy loses exactly the marked solutions, and their tests fail there."""
import subprocess
import sys
from pathlib import Path

import pytest

from kvmini.assignments import strip, write_student_copy

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = ["reciprocal_allocation", "variance_softmax", "ema_merging", "frobenius_stop", "convex_value_merge",
             "progressive_budgets", "value_norm"]


def test_strip_keeps_markers_and_raises():
    text = "def f(x):\n    y = 1\n    # BEGIN EXERCISE f: tutorial 9, \"F\"\n    return x + y\n    # END EXERCISE\n"
    stripped, names = strip(text)
    assert names == ["f"]
    assert stripped == ("def f(x):\n    y = 1\n    # BEGIN EXERCISE f: tutorial 9, \"F\"\n"
                        "    raise NotImplementedError('exercise f: see tutorial 9, \"F\"')\n    # END EXERCISE\n")
    with pytest.raises(ValueError, match="without END"):
        strip("# BEGIN EXERCISE g: here\nx = 1\n")


def test_every_exercise_points_to_an_existing_tutorial():
    for path in (ROOT / "kvmini").rglob("*.py"):
        if path.name == "assignments.py":  # its docstring describes the markers
            continue
        for line in path.read_text().splitlines():
            if "# BEGIN EXERCISE" in line:
                tutorial = line.split(": ", 1)[1].split(",")[0]
                assert (ROOT / tutorial).is_file(), f"{path.name}: {tutorial} does not exist"


@pytest.mark.slow
def test_student_copy_fails_the_mechanism_tests(tmp_path):
    dest = tmp_path / "student"
    names = write_student_copy(dest)
    assert sorted(names) == sorted(EXERCISES)
    assert (dest / "tests" / "test_weightedkv.py").is_file() and not (dest / "weights" / "SmolLM2-135M-Instruct").exists()
    tests = ["tests/test_weightedkv.py", "tests/test_dbudgetkv.py", "tests/test_d2o.py", "tests/test_dynamickv.py",
             "tests/test_vatp.py"]
    student = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                             cwd=dest, capture_output=True, text=True, timeout=600)
    assert student.returncode != 0
    for name in EXERCISES:
        assert f"exercise {name}: see" in student.stdout, name
    original = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert original.returncode == 0, original.stdout[-2000:]
