"""Every committed results file describes today's code (the rule: docs/evaluation.md, "When a result is
stale"; kvmini/eval/provenance.py). Reads files only: no git, no model, a second or two."""
import json
import shutil
from pathlib import Path

import pytest

from kvmini.eval import provenance, suite

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted(ROOT.glob("results/*/results.json"))


@pytest.mark.parametrize("path", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_results_file_is_not_older_than_the_code_it_describes(path):
    profile = json.loads(path.read_text())["profile"]
    stale = provenance.stale(path, suite.today(profile))
    assert not stale, "\n".join(stale)


def made_now(tmp_path, experiment, methods, sizes) -> Path:
    """A results file of one experiment, stamped as the suite stamps it."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"profile": "quick", "sizes": {experiment: sizes}, experiment: [],
                                "provenance": {experiment: provenance.stamp(experiment, methods, ["--only", experiment])}}))
    return path


def copy_of_the_code(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "kvmini", root / "kvmini", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests" / "data", root / "tests" / "data")
    monkeypatch.setattr(provenance, "ROOT", root)
    monkeypatch.setattr(provenance, "RECORDING", root / "tests" / "data" / "engine_regression")
    return root


def test_a_changed_behaviour_recording_makes_the_accuracy_results_of_that_method_stale(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    sizes = {"n": 8}
    path = made_now(tmp_path, "fidelity", ["full", "h2o", "snapkv"], sizes)
    today = {"fidelity": {"methods": ["full", "h2o", "snapkv"], "sizes": sizes}}
    assert provenance.stale(path, today) == []
    recording = root / "tests" / "data" / "engine_regression.json"
    facts = json.loads(recording.read_text())
    facts["tiny"]["b1/h2o@12"]["evicted"][0] += 1  # as if H2O now evicted one token more
    recording.write_text(json.dumps(facts))
    [line] = provenance.stale(path, today)
    assert "fidelity is stale (h2o's recorded behaviour changed)" in line
    assert line.endswith("re-run: python -m kvmini.eval.suite --only fidelity")


def test_a_refactor_leaves_accuracy_current_and_makes_speed_stale(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    fidelity = made_now(tmp_path / "a", "fidelity", ["full", "h2o"], {})
    speed = made_now(tmp_path / "b", "speed", ["full"], {})
    (tmp_path / "c").mkdir()
    parts = made_now(tmp_path / "c", "parts_speed", ["full", "snapkv"], {})  # timed, as speed is
    with open(root / "kvmini" / "cache.py", "a") as f:
        f.write("\n# a refactor: same behaviour, other code\n")
    assert provenance.stale(fidelity, {"fidelity": {"methods": ["full", "h2o"], "sizes": {}}}) == []
    [line] = provenance.stale(speed, {"speed": {"methods": ["full"], "sizes": {}}})
    assert "speed is stale (kvmini/cache.py changed)" in line
    [line] = provenance.stale(parts, {"parts_speed": {"methods": ["full", "snapkv"], "sizes": {}}})
    assert "parts_speed is stale (kvmini/cache.py changed)" in line


def test_a_result_without_a_fingerprint_or_of_other_sizes_or_methods_is_stale(tmp_path):
    path = made_now(tmp_path, "layers", ["full", "d2o"], {"n": 8})
    assert provenance.stale(path, {"layers": {"methods": ["full", "d2o", "vatp"], "sizes": {"n": 16}}}) == [
        f"{path}: layers is stale (the suite now measures full, d2o, vatp; the profile's sizes changed); "
        "re-run: python -m kvmini.eval.suite --only layers"]
    results = json.loads(path.read_text())
    del results["provenance"]["layers"]["fingerprint"]
    path.write_text(json.dumps(results))
    assert "made before results recorded a fingerprint" in provenance.stale(path, {"layers": {"methods": [],
                                                                                              "sizes": {"n": 8}}})[0]
