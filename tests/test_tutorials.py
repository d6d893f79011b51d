"""Every tutorial runs top to bottom as a notebook (its own asserts are the checks) and shows its
figures inline; one also runs as a plain script, which saves its figure to a file instead. Every
tutorial also runs to the end in a fresh student copy, where every exercise is still open."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmini.course.copies import write_student_copy
from kvmini.course.exercises import exercises
from kvmini.notebooks import FIGURES, build, images

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9]*.py"))


def test_there_are_tutorials():
    assert len(TUTORIALS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_as_a_notebook_and_shows_its_figures(path, default_model_dir, tmp_path):
    notebook, written = build(path, tmp_path)
    assert written.exists()
    figure_cells = [c for c in notebook.cells if c.cell_type == "code" and "show(fig" in c.source]
    assert figure_cells, "every tutorial has at least one figure"
    for cell in figure_cells:
        assert any("image/png" in out.get("data", {}) for out in cell.outputs), cell.source[:80]
    assert images(notebook) >= len(figure_cells)
    for cell in (c for c in notebook.cells if c.cell_type == "code" and "show_page(" in c.source):  # kvmini.view
        assert any("<iframe srcdoc=" in out.get("data", {}).get("text/html", "") for out in cell.outputs), cell.source[:80]


@pytest.mark.slow
def test_a_tutorial_runs_as_a_script_and_saves_its_figure_outside_the_committed_ones(default_model_dir, tmp_path):
    """A script run writes its figure where KVMINI_FIGURES says (by default results/figures, git-ignored),
    never over the committed figures the README shows (results/tutorials)."""
    committed = FIGURES / "01_cache_memory.png"
    before = committed.read_bytes()
    proc = subprocess.run([sys.executable, str(ROOT / "tutorials" / "01_transformer_and_kv_cache.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, KVMINI_FIGURES=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "01_cache_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert committed.read_bytes() == before


def test_script_figures_default_to_a_git_ignored_folder(monkeypatch):
    from kvmini.notebooks import ROOT as root, figures

    monkeypatch.delenv("KVMINI_FIGURES", raising=False)
    assert figures() == root / "results" / "figures"
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/figures/x.png"], cwd=root)
    assert ignored.returncode == 0 or not (root / ".git").exists()


@pytest.fixture(scope="module")
def student_copy(default_model_dir, tmp_path_factory):
    copy = tmp_path_factory.mktemp("student") / "kvmini"
    write_student_copy(copy)
    (copy / "weights" / default_model_dir.name).symlink_to(default_model_dir)  # what a student downloads
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_in_a_student_copy(path, student_copy, tmp_path):
    """With every hole open, each cell that needs an exercise skips what needs it and says so."""
    notebook, _ = build(student_copy / "tutorials" / path.name, tmp_path, root=student_copy)
    said = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)
    for ex in exercises(student_copy).values():
        if ex.tutorial == f"tutorials/{path.name}":
            assert f"(this cell skips what needs exercise {ex.name}: it is not done yet" in said, ex.name
    assert "No artists with labels" not in said  # a figure whose lines were all skipped is not drawn empty
