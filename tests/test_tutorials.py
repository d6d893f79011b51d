"""Every tutorial runs top to bottom as a notebook (its own asserts are the checks) and shows its
figures inline; one also runs as a plain script, which saves its figure to a file instead. Every
tutorial also runs to the end in a fresh student copy, where every exercise is still open."""
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
def test_a_tutorial_runs_as_a_script_and_saves_its_figure(default_model_dir):
    target = FIGURES / "01_cache_memory.png"
    committed = target.read_bytes() if target.exists() else None  # the README shows the committed ones
    target.unlink(missing_ok=True)
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tutorials" / "01_transformer_and_kv_cache.py")], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert target.exists() and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        if committed is not None:
            target.write_bytes(committed)


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
