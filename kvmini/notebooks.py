"""Tutorials as executed notebooks, and the one helper their figures use.

    python -m kvmini.notebooks            # every tutorial -> notebooks/NN_name.ipynb, executed
    python -m kvmini.notebooks 03 06      # only these (3 and 03 name the same tutorial)

Needs jupytext, nbclient and ipykernel (requirements-dev.txt); the notebooks are written to
notebooks/ (git-ignored). In a notebook, `show(fig, name)` displays a figure inline; run as a
script, it saves it to results/figures/<name>.png instead (git-ignored: a reader's run leaves the
checkout clean). The committed figures the README shows, results/tutorials/, are drawn again by naming
that folder: `KVMINI_FIGURES=results/tutorials python tutorials/03_d2o_layer_level.py`.
`show_page(path)` shows a kvmini.view page inline (in an iframe); as a script it prints where the page is.
"""
import os
import sys
from pathlib import Path

from kvmini import cli
from kvmini.errors import KvminiError

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "results" / "tutorials"  # the committed figures (the README's)


def in_notebook() -> bool:
    return "ipykernel" in sys.modules


def figures() -> Path:
    """Where a script's figures go: $KVMINI_FIGURES if set, else results/figures (git-ignored)."""
    return Path(os.environ.get("KVMINI_FIGURES") or ROOT / "results" / "figures")


def show(fig, name: str) -> None:
    """Inline in a notebook; saved as <figures()>/<name>.png when run as a script."""
    import matplotlib.pyplot as plt

    if in_notebook():
        plt.show()
        return
    out = figures() / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"(figure saved to {out})")


def show_page(path: Path, height: int = 560) -> None:
    """A kvmini.view page inline in a notebook (the whole file in an iframe's srcdoc: no server needed)."""
    if not in_notebook():
        print(f"(page written to {path}; open it in a browser)")
        return
    import html

    from IPython.display import HTML, display

    page = html.escape(Path(path).read_text(encoding="utf-8"), quote=True)
    frame = f'<iframe srcdoc="{page}" style="width: 100%; height: {height}px; border: 1px solid #ddd"></iframe>'
    display(HTML(f"<div>{frame}</div>"))  # (a bare iframe makes IPython warn)


def build(tutorial: Path, out_dir: Path, timeout: int = 1200, root: Path = ROOT):
    """tutorials/NN_name.py -> out_dir/NN_name.ipynb, executed in `root` (this repository, or a
    student copy: the tutorial then imports the copy's kvmini)."""
    import jupytext
    from nbclient import NotebookClient

    notebook = jupytext.read(tutorial)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(root)}},
                   extra_arguments=["--IPKernelApp.log_level=ERROR"]).execute()  # (not its warning, once per
    # notebook, that a kernel on this machine's loopback talks unencrypted TCP; a cell's error still fails here)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (tutorial.stem + ".ipynb")
    jupytext.write(notebook, path)
    return notebook, path


def images(notebook) -> int:
    """How many PNG figures the executed notebook shows."""
    return sum("image/png" in out.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []))


def select(tutorials: list[Path], numbers: list[str]) -> list[Path]:
    """The tutorials named by number ("3" or "03" is 03_...py); all of them when none is named."""
    by_number = {int(t.name.split("_")[0]): t for t in tutorials}
    chosen = []
    for text in numbers:
        number = int(text) if text.strip().isdigit() and text.isascii() else None
        if number not in by_number:
            raise KvminiError(f"no tutorial {text!r}; the tutorials are numbered "
                              f"{', '.join(f'{n:02d}' for n in sorted(by_number))}")
        chosen.append(by_number[number])
    return list(dict.fromkeys(chosen)) or tutorials


def main(argv=None) -> int:
    p = cli.OneLineParser(prog="python -m kvmini.notebooks",
                          description="Build executed notebooks of the tutorials (into notebooks/).")
    p.add_argument("only", nargs="*", help="tutorial numbers, e.g. 03 6 (3 and 03 are the same; default: all)")
    p.add_argument("--out", type=cli.path, default=str(ROOT / "notebooks"), help="output folder (default: notebooks/)")

    def work():
        args = p.parse_args(argv)
        tutorials = select(sorted((ROOT / "tutorials").glob("[0-9]*.py")), args.only)
        try:
            import jupytext  # noqa: F401  (checked before the first tutorial runs)
            import nbclient  # noqa: F401
        except ImportError as e:
            raise KvminiError(f"{e.name} is not installed (pip install -r requirements-dev.txt)") from None
        out = cli.writable_folder(args.out, "--out")
        for t in tutorials:
            print(f"executing {t.name} ...", file=sys.stderr, flush=True)
            notebook, path = build(t, out)
            print(f"{path}: {images(notebook)} figure(s)")
        return 0

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
