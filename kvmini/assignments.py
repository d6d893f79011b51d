"""Course-assignment mode: write a student copy of the repository with the mechanisms removed.

Solution regions in kvmini/ are marked by two comment lines:

    # BEGIN EXERCISE <name>: <where to read about it>
    ...the solution...
    # END EXERCISE

In the copy, each region keeps its markers and its body becomes
`raise NotImplementedError("exercise <name>: see <where>")`, so the mechanism's tests fail until
a student writes it. Everything else (tests, tutorials, the engine) is copied unchanged.

    python -m kvmini.assignments ../student-kvmini        # writes the copy, lists the exercises
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvmini import cli
from kvmini.errors import KvminiError

BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+): (.+)$")
END = re.compile(r"^\s*# END EXERCISE$")
ROOT = Path(__file__).resolve().parent.parent
SKIP = {".git", "weights", "results", "__pycache__", ".hypothesis", ".pytest_cache"}


def strip(text: str) -> tuple[str, list[str]]:
    """Replace every exercise body in `text`; returns the new text and the exercise names."""
    out, names, inside = [], [], False
    for line in text.splitlines(keepends=True):
        begin = BEGIN.match(line)
        if begin:
            if inside:
                raise ValueError(f"nested exercise at: {line.strip()}")
            indent, name, where = begin.groups()
            message = f"exercise {name}: see {where}"
            out += [line, f"{indent}raise NotImplementedError({message!r})\n"]
            names.append(name)
            inside = True
        elif END.match(line):
            if not inside:
                raise ValueError("END EXERCISE without BEGIN")
            out.append(line)
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN EXERCISE without END")
    return "".join(out), names


def repository_files(root: Path) -> list[Path]:
    """Tracked files when `root` is a git checkout, else every file outside SKIP."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
        return [root / p for p in listed.splitlines() if (root / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in root.rglob("*") if p.is_file() and not SKIP & set(p.relative_to(root).parts)]


def check_destination(dest: Path, root: Path = ROOT) -> None:
    """Refuse, before anything is copied, a destination the copy cannot go to or must not overwrite."""
    where = dest.resolve()
    if where == root or root in where.parents:
        raise KvminiError(f"{dest} is in the repository {root}; the copy must go to a folder outside it")
    if dest.exists() and not dest.is_dir():
        raise KvminiError(f"{dest} is a file, not a folder")
    if dest.exists() and any(dest.iterdir()):
        raise KvminiError(f"{dest} exists and is not empty; give a new or empty folder")
    existing = next(p for p in [where, *where.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvminiError(f"cannot write {dest}: {existing} is not a folder this user may write to")
    dest.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=dest).close()  # what os.access cannot tell (a read-only file system)


def write_student_copy(dest: Path, root: Path = ROOT) -> list[str]:
    """Copy the repository to `dest` with every exercise stripped; returns the exercise names."""
    check_destination(dest, root)
    names = []
    for src in repository_files(root):
        rel = src.relative_to(root)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.parts[0] == "kvmini" and src.suffix == ".py" and src.name != "assignments.py":  # not these docs
            text, found = strip(src.read_text(encoding="utf-8"))
            target.write_text(text, encoding="utf-8")
            names += found
        else:
            shutil.copy2(src, target)
    return list(dict.fromkeys(names))  # an exercise may span several regions (e.g. three functions)


def main(argv=None) -> int:
    p = cli.OneLineParser(description="Write a student copy of kvmini with the mechanisms left as exercises.")
    p.add_argument("dest", help="folder for the copy (new or empty, outside the repository)")

    def work():
        args = p.parse_args(argv)
        names = write_student_copy(Path(args.dest))
        print(f"wrote {args.dest} with {len(names)} exercises: {', '.join(names)}")
        return 0

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
