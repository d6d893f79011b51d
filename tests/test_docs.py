"""The measured numbers of README.md and docs/ are what `python -m kvmini.eval.docs` writes from the
committed results files (kvmini/eval/docs.py)."""
import json
import re
import shutil
from pathlib import Path

import pytest

from kvmini.errors import KvminiError
from kvmini.eval import docs, plots

ROOT = Path(__file__).resolve().parents[1]


def test_the_documents_are_what_the_generator_writes(capsys):
    assert docs.main(["--check"]) == 0, capsys.readouterr().err


def copy_of_the_documents(tmp_path) -> Path:
    shutil.copy(ROOT / "README.md", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "tutorials").mkdir()
    shutil.copy(ROOT / "tutorials" / "README.md", tmp_path / "tutorials")
    for record in (r for r in docs.RECORD if (ROOT / r).exists()):  # the test run's, bench_hf's
        (tmp_path / record).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / record, tmp_path / record)
    for results in ROOT.glob("results/*/results.json"):
        (tmp_path / results.parent.relative_to(ROOT)).mkdir(parents=True)
        for name in ("results.json", "summary.md"):
            shutil.copy(results.with_name(name), tmp_path / results.parent.relative_to(ROOT))
    for figure in plots.FIGURES:
        shutil.copy(ROOT / figure, tmp_path / figure)
    return tmp_path


def test_a_number_changed_by_hand_in_a_generated_region_fails_the_check(tmp_path, monkeypatch, capsys):
    root = copy_of_the_documents(tmp_path)
    speed = root / "docs" / "speed.md"
    text = speed.read_text()
    start = text.index("<!-- generated: speed-8k")
    digit = re.compile(r"\d").search(text, text.index("| H2O |", start))  # the first number of H2O's row
    speed.write_text(text[: digit.start()] + str((int(digit.group()) + 1) % 10) + text[digit.end():])
    monkeypatch.setattr(docs, "ROOT", root)
    assert docs.main(["--check"]) == 1
    assert capsys.readouterr().err == "docs/speed.md: region speed-8k differs from what `python -m kvmini.eval.docs` writes\n"
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0  # writing restores it
    assert speed.read_text() == text


def test_an_edited_summary_fails_the_check(tmp_path, monkeypatch, capsys):
    root = copy_of_the_documents(tmp_path)
    summary = root / "results" / "quick" / "summary.md"
    summary.write_text(summary.read_text().replace("| 256 | h2o |", "| 256 | H2O |"))
    monkeypatch.setattr(docs, "ROOT", root)
    assert docs.main(["--check"]) == 1
    assert "results/quick/summary.md differs" in capsys.readouterr().err


def test_a_figure_that_no_longer_shows_the_committed_results_fails_the_check(tmp_path, monkeypatch, capsys):
    """The README's figures record a digest of the results they draw: results measured again (here one
    KL changed) name the figure, without drawing it, until the generator draws it again."""
    root = copy_of_the_documents(tmp_path)
    path = root / "results" / "quick" / "results.json"
    results = json.loads(path.read_text())
    row = next(r for r in results["fidelity"] if r["method"] == "h2o")
    row["kl"] *= 2
    path.write_text(json.dumps(results, indent=1))
    monkeypatch.setattr(docs, "ROOT", root)
    assert docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "results/quick/frontier_kl.png does not show the committed results" in err
    assert "results/full-speed/speed_vs_kl.png does not show the committed results" in err  # KL at 20% too
    assert "frontier_passkey.png" not in err  # its data did not change
    pytest.importorskip("matplotlib", reason="matplotlib (requirements-dev.txt) draws the figures")
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0


def test_no_cell_of_the_claims_table_exceeds_60_words():
    """docs/evaluation.md's claims table: a verdict and the few numbers it rests on per cell; every
    number in the detail tables below it."""
    text = (ROOT / "docs" / "evaluation.md").read_text()
    table = text[text.index("<!-- generated: claims "):text.index("<!-- end generated -->", text.index("<!-- generated: claims "))]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")][1:]
    assert len(rows) >= 12
    for row in rows:
        for cell in row.strip("| ").split(" | "):
            assert len(cell.split()) <= 60, cell


def test_an_unknown_region_is_an_error():
    with pytest.raises(KvminiError, match="unknown generated region 'nonesuch'"):
        docs.rewritten("<!-- generated: nonesuch -->\n<!-- end generated -->\n")


def test_every_generated_table_has_its_results():
    """A table whose experiment no committed file holds says so in the document; that is not done."""
    missing = [f"{path.relative_to(ROOT)}: {line}" for path in docs.documents()
               for line in path.read_text().splitlines() if line.startswith("*Not measured yet:")]
    assert not missing, "\n".join(missing)


def test_the_profiles_table_names_every_size_of_every_experiment():
    """A size added to a profile must appear in docs/evaluation.md's table: each is a field of its cell."""
    from string import Formatter

    from kvmini.eval import suite, tables

    assert list(tables.PROFILE_CELLS) == suite.EXPERIMENTS
    for profile in ("quick", "full"):
        for experiment, sizes in suite.PROFILES[profile].items():
            fields = {f for _, f, _, _ in Formatter().parse(tables.PROFILE_CELLS[experiment]) if f}
            assert fields == set(sizes), (profile, experiment)


def test_profile_cells_by_hand():
    from kvmini.eval import suite, tables

    assert tables.profile_cell("streaming", dict(n=4096, capacities=[256, 1024], chunk=4)) == (
        "4,096 tokens, capacities 256, 1,024, chunks of 4")
    assert tables.profile_cell("passkey", dict(lengths=[1024], depths=[0.1, 0.5], budgets=[128, 0.2])) == (
        "1,024 tokens × depths 0.1, 0.5; budgets 128 tokens, 20%")
    assert tables.profile_cell("fidelity", dict(n=64, k=8, prompts=2, budgets=[0.2], methods=["h2o", "tova"])) == (
        "N=64, K=8, 2 prompts, budgets 20%; 2 method specs")
    table = tables.profiles_table(suite.PROFILES).splitlines()
    assert table[:2] == ["| experiment | quick profile | full profile |", "|---|---|---|"]
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| {e}" for e in suite.EXPERIMENTS]


def test_not_run_names_the_experiments_no_file_holds():
    from kvmini.eval import tables

    assert tables.not_run({"streaming": {}, "fidelity": {}}, {"speed": {}, "parts_speed": {}, "layers": {}}) == (
        "Not measured in the full profile (no results file holds them): passkey, ablations, queryaware, why.")


def test_what_the_tutorials_say_of_the_committed_ablations():
    """Tutorials 3, 4 and 5 describe the committed ablations in words, not numbers; these are those
    words, checked against results/quick/results.json (a re-measure that changes them fails here)."""
    rows = {r["method"]: r for r in json.loads((ROOT / "results/quick/results.json").read_text())["ablations"]}
    kl = {spec: r["kl"] for spec, r in rows.items()}
    # tutorial 3: Eq. 5's allocation and the zscore reading far behind the official allocation and
    # uniform budgets (paper merge), and the whole official variant ahead of them all
    behind = min(kl["d2o[variant=paper]"], kl["d2o[variant=paper,allocation=zscore]"])
    ahead = max(kl["d2o[variant=paper,allocation=official]"], kl["d2o[variant=paper,allocation=uniform]"])
    assert behind > 2 * ahead and kl["d2o"] < min(kl[s] for s in rows if s.startswith("d2o[variant=paper"))
    # tutorial 4: from the official variant, the paper's merge and a per-head threshold each lower the
    # KL a little, no merging lowers it most, a 3:1 split costs more than any of them
    assert kl["d2o[merge=off]"] < min(kl["d2o[merge=paper]"], kl["d2o[tau=per_head]"])
    assert max(kl["d2o[merge=paper]"], kl["d2o[tau=per_head]"]) < kl["d2o"] < kl["d2o[nm=3:1]"]
    # tutorial 5: the official variant prunes to a few percent and loses more than the paper variant;
    # the paper variant with norm_excludes_kept keeps more than either and loses least
    share = {spec: r["kept_share"] for spec, r in rows.items()}
    official, paper, excluded = "dbudgetkv[variant=official]", "dbudgetkv", "dbudgetkv[norm_excludes_kept=true]"
    assert share[official] < 0.1 and share[official] < share[paper] < share[excluded]
    assert kl[excluded] < kl[paper] < kl[official]
