"""Every exercise's checks can fail: each plausible wrong answer of tests/wrong_answers.py, put in place
of the reference solution, fails at least one of that exercise's checks (and the reference passes them:
the exercise's own tests, run in the suite). A wrong answer that passed would be a misreading the course
cannot see; this test names it."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wrong_answers import BY_NAME, WRONG, Wrong, put_in_place
from kvmini.course.exercises import exercises

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BY_NAME))
def test_a_wrong_answer_fails_a_check_of_its_exercise(name):
    w = BY_NAME[name]
    if exercises(ROOT)[w.exercise].unfinished:
        pytest.skip(f"{w.exercise} is not written here (a student copy): there is no reference line to change")
    run = subprocess.run([sys.executable, "tests/wrong_answers.py", name], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert f"in place: {name}" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    failed = list(dict.fromkeys(re.findall(r"^FAILED (tests/\S+?\.py::\w+)", run.stdout, re.M)))  # in the order run
    assert run.returncode == 1 and failed, f"{name} ({w.misreading}) passes every check of {w.exercise}"
    assert set(failed) <= set(exercises(ROOT)[w.exercise].tests)  # the exercise's own checks, nothing else
    if w.caught_by:  # the check of the one function it gets wrong fails first, naming its equation
        assert failed[0].endswith(f"::{w.caught_by}"), f"{name}: the first check to fail is not {w.caught_by}; failed: {failed}"


def test_every_exercise_has_wrong_answers_each_named_once():
    assert {w.exercise for w in WRONG} == set(exercises(ROOT))
    assert len(BY_NAME) == len(WRONG)


def test_a_wrong_answer_not_in_its_region_is_refused():
    with pytest.raises(ValueError, match="not one"):
        put_in_place(Wrong("x", "ema_merging", "", "kvmini.methods.ema_merging", "no such line", ""))
