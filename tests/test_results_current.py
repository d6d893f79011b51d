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
    monkeypatch.setattr(provenance, "REDESIGN", None)  # the rule itself (a redesign's deferral: tested below)
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
    assert line.endswith("measure alone: python -m kvmini.eval.suite --only fidelity --methods h2o")


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}"
    path.write_text(text.replace(old, new, 1))


def speed_results(tmp_path, methods) -> tuple[Path, dict]:
    (tmp_path / "speed").mkdir()
    return made_now(tmp_path / "speed", "speed", methods, {}), {"speed": {"methods": methods, "sizes": {}}}


def test_docstrings_and_comments_stale_nothing(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    speed, today = speed_results(tmp_path, ["full", "h2o", "d2o"])
    fidelity = made_now(tmp_path, "fidelity", ["full", "h2o"], {})
    for path in (root / "kvmini" / "cache.py", root / "kvmini" / "methods" / "h2o.py",
                 root / "kvmini" / "eval" / "fidelity.py", root / "kvmini" / "methods" / "registry.py"):
        text = path.read_text()
        assert text.startswith('"""') or text.startswith('r"""'), path
        path.write_text(text.replace('"""', '"""A docstring fix. ', 1) + "\n# a comment\n")
    assert provenance.stale(speed, today) == []
    assert provenance.stale(fidelity, {"fidelity": {"methods": ["full", "h2o"], "sizes": {}}}) == []


def test_a_refactor_leaves_accuracy_current_and_makes_speed_stale(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    (tmp_path / "a").mkdir(), (tmp_path / "c").mkdir()
    fidelity = made_now(tmp_path / "a", "fidelity", ["full", "h2o"], {})
    speed, today = speed_results(tmp_path, ["full", "h2o"])
    parts = made_now(tmp_path / "c", "parts_speed", ["full", "snapkv"], {})  # timed, as speed is
    with open(root / "kvmini" / "cache.py", "a") as f:
        f.write("\nA_REFACTOR = 'same behaviour, other code'\n")
    assert provenance.stale(fidelity, {"fidelity": {"methods": ["full", "h2o"], "sizes": {}}}) == []
    [line] = provenance.stale(speed, today)
    assert "speed is stale (kvmini/cache.py changed)" in line and line.endswith("re-run: python -m kvmini.eval.suite "
                                                                                "--only speed")
    [line] = provenance.stale(parts, {"parts_speed": {"methods": ["full", "snapkv"], "sizes": {}}})
    assert "parts_speed is stale (kvmini/cache.py changed)" in line


def test_during_a_redesign_code_stales_no_speed_row_but_a_method_not_measured_is_named(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    monkeypatch.setattr(provenance, "REDESIGN", "a redesign in steps")
    speed, today = speed_results(tmp_path, ["full", "h2o"])
    for name in ("cache.py", "methods/h2o.py"):
        with open(root / "kvmini" / name, "a") as f:
            f.write("\nA_REFACTOR = 1\n")
    assert provenance.stale(speed, today) == []
    today["speed"]["methods"].append("tova")
    [line] = provenance.stale(speed, today)
    assert "speed is stale (tova is not measured)" in line


def test_the_command_line_option_reading_and_report_stale_no_speed(tmp_path, monkeypatch):
    """They run outside any clock (provenance.UNTIMED); the registry's make_policy does not."""
    root = copy_of_the_code(tmp_path, monkeypatch)
    speed, today = speed_results(tmp_path, ["full", "h2o"])
    for name in ("cli.py", "methods/options.py", "report.py"):
        with open(root / "kvmini" / name, "a") as f:
            f.write("\nA_CHANGE = 1\n")
    assert provenance.stale(speed, today) == []
    with open(root / "kvmini" / "methods" / "registry.py", "a") as f:
        f.write("\nA_CHANGE = 1\n")
    assert "speed is stale (kvmini/methods/registry.py changed)" in provenance.stale(speed, today)[0]


def test_a_method_s_code_stales_its_own_speed_rows_only(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    speed, today = speed_results(tmp_path, ["full", "h2o", "snapkv", "d2o", "d2o[variant=paper]"])
    with open(root / "kvmini" / "methods" / "d2o.py", "a") as f:
        f.write("\nA_CHANGE = 1\n")
    [line] = provenance.stale(speed, today)
    assert "speed is stale (d2o's code changed)" in line
    assert line.endswith("measure alone: python -m kvmini.eval.suite --only speed --methods d2o")
    with open(root / "kvmini" / "methods" / "ema_merging.py", "a") as f:  # a part D2O uses, H2O does not
        f.write("\nA_CHANGE = 1\n")
    assert "speed is stale (d2o's code changed)" in provenance.stale(speed, today)[0]


def test_a_new_method_is_not_measured_and_stales_nothing_else(tmp_path, monkeypatch):
    root = copy_of_the_code(tmp_path, monkeypatch)
    speed, today = speed_results(tmp_path, ["full", "h2o", "snapkv"])
    fidelity = made_now(tmp_path, "fidelity", ["full", "h2o", "snapkv"], {"methods": ["h2o", "snapkv"]})
    new = "zz_made_up"  # a name no real method takes: "cake" was one a contributor added for real
    (root / "kvmini" / "methods" / f"{new}.py").write_text((root / "kvmini" / "methods" / "snapkv.py").read_text())
    edit(root / "kvmini" / "methods" / "registry.py", "    \"snapkv\": snapkv,\n", "    \"snapkv\": snapkv,\n"
         f"    \"{new}\": {new},\n")
    edit(root / "kvmini" / "methods" / "registry.py", "from kvmini.methods import (", f"from kvmini.methods import ({new}, ")
    assert provenance.stale(speed, today) == []  # the registry's table of methods stales nothing
    today["speed"]["methods"].append(new)
    [line] = provenance.stale(speed, today)
    assert f"speed is stale ({new} is not measured)" in line
    assert line.endswith(f"measure alone: python -m kvmini.eval.suite --only speed --methods {new}")
    [line] = provenance.stale(fidelity, {"fidelity": {"methods": ["full", "h2o", "snapkv", new],
                                                      "sizes": {"methods": ["h2o", "snapkv", new]}}})
    assert (f"fidelity is stale ({new} has no entry in the behaviour recording (record it: PYTHONPATH=. python "
            f"tests/test_engine_regression.py --record {new}); {new} is not measured); measure alone: ") in line


def test_the_measure_alone_command_keeps_the_folder_and_profile():
    made = "python -m kvmini.eval.suite --profile full --only speed parts_speed --out results/full-speed"
    assert provenance.measure_alone(made, "speed", {"h2o", "cam"}) == (
        "python -m kvmini.eval.suite --profile full --out results/full-speed --only speed --methods cam h2o")


def test_a_result_without_a_fingerprint_or_of_other_sizes_or_methods_is_stale(tmp_path):
    path = made_now(tmp_path, "layers", ["full", "d2o", "vatp"], {"n": 8})
    assert provenance.stale(path, {"layers": {"methods": ["full", "d2o"], "sizes": {"n": 16}}}) == [
        f"{path}: layers is stale (the suite no longer measures vatp; the profile's sizes changed); "
        "re-run: python -m kvmini.eval.suite --only layers"]
    results = json.loads(path.read_text())
    del results["provenance"]["layers"]["fingerprint"]
    path.write_text(json.dumps(results))
    assert "made before results recorded a fingerprint by method" in provenance.stale(
        path, {"layers": {"methods": [], "sizes": {"n": 8}}})[0]


def test_the_documents_name_a_method_not_measured_with_the_command_that_measures_it():
    from kvmini.eval import docs

    path = ROOT / "results" / "quick" / "results.json"
    results = json.loads(path.read_text())
    assert docs.not_measured(("results/quick/results.json", results)).startswith("Every method")
    results["provenance"]["speed"]["methods"].remove("cam[variant=paper]")  # as if the variant were new
    table = docs.not_measured(("results/quick/results.json", results))
    assert ("| `results/quick/results.json` | speed | cam[variant=paper] | `python -m kvmini.eval.suite --out "
            "results/quick --only speed --methods cam` |") in table


def test_a_result_names_the_machine_it_measured_on():
    """Speed compares only on one machine: two hosts of one name may differ in vector units."""
    info = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nmodel\t\t: 207\nflags\t\t: fpu avx2 avx512f "
            "amx_tile\n\nprocessor\t: 1\nmodel name\t: Other\n")
    assert provenance.machine(info).startswith("Intel(R) Xeon(R) Processor (model 207), AVX-512, AMX, ")
    assert provenance.machine("model name : Old\nflags : fpu avx2\n").startswith("Old, ")
    assert "machine" in provenance.stamp("fidelity", ["full"], ["--only", "fidelity"])
