"""Course mode: a student copy of the repository with the mechanisms removed, a check per exercise
and a grade table for a class (kvmini.grading runs the tests).

An exercise is declared once. Its solution is marked in kvmini/ by two comment lines (an exercise
may span several functions; one function may hold regions of two exercises):

    # BEGIN EXERCISE <name>: <tutorial>, "<section of the tutorial>"
    ...the solution...
    # END EXERCISE

and its tests carry `@pytest.mark.exercise("<name>")`. Everything else is found from these: the
holes (file:function), the tutorial section, the check command. In the copy, each region keeps its
markers and its body becomes `raise NotImplementedError("exercise <name>: see ...")`.

    python -m kvmini.assignments new ../student    # writes the copy, lists each hole and its check
    python -m kvmini.assignments check ema_merging # in a copy: that exercise's tests, pass/fail each
    python -m kvmini.assignments check             # every exercise, one line each
    python -m kvmini.assignments grade alice/ bob/ --csv grades.csv   # student x exercise

`python -m kvmini.assignments DIR` (without `new`) also writes a copy. In a copy the tutorials
still run to the end: `solved(name)` and `usable(method)` tell a cell to skip what needs an exercise
not done yet, and say so. docs/course.md is the instructors' guide.
"""
import ast
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvmini import cli
from kvmini.errors import KvminiError

BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+): (\S+), \"(.+)\"$")
END = re.compile(r"^\s*# END EXERCISE$")
ROOT = Path(__file__).resolve().parent.parent
SKIP = {".git", "weights", "results", "__pycache__", ".hypothesis", ".pytest_cache"}
MANIFEST = ".kvmini-copy.json"  # written into every copy: what it held when it was handed out
GRADED = ("kvmini", "tests", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini")  # (and top-level scripts):
#   what the grade depends on; a change there is reported
COMMANDS = ("new", "check", "grade")


@dataclass
class Exercise:
    name: str
    tutorial: str  # tutorials/NN_name.py
    section: str  # the heading in the tutorial
    holes: dict[str, list[str]] = field(default_factory=dict)  # file -> [function, ...]
    tests: dict[str, str] = field(default_factory=dict)  # "tests/test_x.py::test_y" -> its docstring
    bodies: list[str] = field(default_factory=list)  # each region's body, in the order of the sources
    open: bool = True  # every region still the stub (a student copy that nobody touched)
    unfinished: bool = False  # some region still the stub

    @property
    def check(self) -> str:
        return f"python -m kvmini.assignments check {self.name}"

    def where(self) -> str:
        return "; ".join(f"{path}: {', '.join(functions)}" for path, functions in self.holes.items())


def stub(name: str, tutorial: str, section: str) -> str:
    return f"exercise {name}: see {tutorial}, {section!r}; check it with python -m kvmini.assignments check {name}"


def strip(text: str, names=None) -> tuple[str, list[str]]:
    """Replace the body of every exercise region in `text` (only those of `names`, when given);
    returns the new text and the names of the regions replaced."""
    out, found, inside = [], [], None
    for line in text.splitlines(keepends=True):
        begin = BEGIN.match(line)
        if begin:
            if inside is not None:
                raise ValueError(f"nested exercise at: {line.strip()}")
            indent, name, tutorial, section = begin.groups()
            inside = names is None or name in names
            out.append(line)
            if inside:
                out.append(f"{indent}raise NotImplementedError({stub(name, tutorial, section)!r})\n")
                found.append(name)
        elif END.match(line):
            if inside is None:
                raise ValueError("END EXERCISE without BEGIN")
            out.append(line)
            inside = None
        elif not inside:
            out.append(line)
    if inside is not None:
        raise ValueError("BEGIN EXERCISE without END")
    return "".join(out), found


def sources(root: Path) -> list[Path]:
    """The modules that may hold exercise regions (this one only describes them)."""
    return sorted(p for p in (root / "kvmini").rglob("*.py") if p.name != "assignments.py" and "__pycache__" not in p.parts)


def function_at(tree: ast.Module | None, line: int) -> str:
    """The qualified name of the innermost function holding `line` ("Class.method"); a module that
    does not parse (a student's syntax error) gives the line."""
    if tree is None:
        return f"line {line}"
    name, body = [], tree.body
    while True:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.lineno <= line <= n.end_lineno), None)
        if node is None:
            return ".".join(name) or "<module>"
        name.append(node.name)
        body = node.body


def parsed(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def declared_tests(root: Path):
    """(exercise name, test id, docstring) for every test marked @pytest.mark.exercise("name")."""
    for path in sorted((root / "tests").glob("test_*.py")):
        tree = parsed(path.read_text(encoding="utf-8"))  # a test file that does not parse declares nothing
        for node in tree.body if tree else []:
            for mark in getattr(node, "decorator_list", []):
                if (isinstance(mark, ast.Call) and ast.unparse(mark.func) == "pytest.mark.exercise"
                        and mark.args and isinstance(mark.args[0], ast.Constant)):
                    yield mark.args[0].value, f"tests/{path.name}::{node.name}", ast.get_docstring(node) or ""


def exercises(root: Path = ROOT) -> dict[str, Exercise]:
    """Every exercise declared in the repository (or copy) at `root`, in the order of the sources."""
    found: dict[str, Exercise] = {}
    for path in sources(root):
        text = path.read_text(encoding="utf-8")
        if "# BEGIN EXERCISE" not in text:
            continue
        tree, lines = parsed(text), text.splitlines()
        for i, line in enumerate(lines):
            begin = BEGIN.match(line)
            if not begin:
                continue
            _, name, tutorial, section = begin.groups()
            ex = found.setdefault(name, Exercise(name, tutorial, section))
            ex.holes.setdefault(path.relative_to(root).as_posix(), []).append(function_at(tree, i + 1))
            end = next((j for j in range(i, len(lines)) if END.match(lines[j])), len(lines))
            body = [b.strip() for b in lines[i + 1: end]]
            stubbed = body == [f"raise NotImplementedError({stub(name, tutorial, section)!r})"]
            ex.bodies.append("\n".join(body))
            ex.open &= stubbed
            ex.unfinished |= stubbed
    for name, test, doc in declared_tests(root):
        if name in found:
            found[name].tests[test] = doc
    return dict(sorted(found.items(), key=lambda item: reading_order(root, item[1])))


def reading_order(root: Path, ex: Exercise) -> tuple[str, int]:
    """(tutorial, where its section starts): the order in which a student meets the exercises."""
    path = root / ex.tutorial
    return ex.tutorial, path.read_text(encoding="utf-8").find(ex.section) if path.is_file() else -1


def skipping(ex: Exercise) -> None:
    print(f"(this cell skips what needs exercise {ex.name}: it is not done yet in this copy; "
          f"its holes: {ex.where()}; check it with {ex.check})")


def solved(*names: str) -> bool:
    """For a tutorial cell: True when these exercises are written in this copy (always in the
    repository itself); otherwise says which are open (a region of theirs still the stub) and where,
    and returns False: the cell skips."""
    found = exercises()
    unknown = [name for name in names if name not in found]
    if unknown:
        raise KvminiError(f"no exercise {', '.join(unknown)}; the exercises are {', '.join(found)}")
    missing = [found[name] for name in names if found[name].unfinished]
    for ex in missing:
        skipping(ex)
    return not missing


def usable(name: str, **options) -> bool:
    """For a tutorial cell: whether method `name` with `options` runs in this copy, tried on a tiny
    random model (a prompt and three decode steps); if an open exercise stops it, says which, and
    returns False."""
    import torch

    from kvmini.config import ModelConfig
    from kvmini.methods.registry import chooses_budget, make_policy
    from kvmini.model import Transformer

    # 8 layers and 48 tokens: more than any method protects or waits for (DynamicKV re-allocates every 4)
    model = Transformer(ModelConfig("llama", 50, 32, 64, 8, 4, 2, 8, rope_theta=1000.0)).eval()
    policy, cache = make_policy(name, None if chooses_budget(name) else 0.5, **options), model.new_cache()
    policy.start(48, 51)
    try:
        with torch.no_grad():
            for chunk in (torch.arange(48)[None] % 50, *torch.arange(3)[:, None, None]):
                model(chunk, cache, policy)
    except NotImplementedError as e:
        ex = exercises().get(str(e).removeprefix("exercise ").split(":")[0])
        if ex is None:
            raise
        skipping(ex)
        return False
    return True


def repository_files(root: Path) -> list[Path]:
    """Tracked files when `root` is a git checkout, else every file outside SKIP."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
        return [root / p for p in listed.splitlines() if (root / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in root.rglob("*") if p.is_file() and not SKIP & set(p.relative_to(root).parts)]


def graded(rel: str) -> bool:
    """Whether the grade may depend on this file (a path relative to the copy): a change is reported.
    Not caches, nor what lies in a hidden folder or an installed package (a .venv in the copy holds
    libraries' own conftest.py files)."""
    parts = rel.split("/")
    if "__pycache__" in parts or "site-packages" in parts or any(p.startswith(".") for p in parts[:-1]):
        return False
    return parts[0] in GRADED or parts[0].endswith(".py") or rel.endswith("/conftest.py")


def fingerprints(root: Path = ROOT) -> dict[str, str]:
    """What a copy of `root` holds as handed out: the fingerprint of every file the grade depends on
    (a copy's are the same: its regions are not part of a fingerprint)."""
    files = {p.relative_to(root).as_posix(): p for p in repository_files(root)}
    return {rel: fingerprint(rel, path.read_text(encoding="utf-8", errors="surrogateescape"))
            for rel, path in files.items() if graded(rel)}


def fingerprint(rel: str, text: str) -> str:
    """sha256 of a file as the grade sees it: a module with exercise regions without their bodies."""
    if rel.startswith("kvmini/") and rel.endswith(".py") and not rel.endswith("/assignments.py"):
        text = strip(text)[0]
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


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


def write_student_copy(dest: Path, root: Path = ROOT, names=None) -> list[str]:
    """Copy the repository to `dest` with the exercises stripped (only `names`, when given) and a
    manifest of what the grade depends on; returns the names of the exercises stripped."""
    known = exercises(root)
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise KvminiError(f"no exercise {', '.join(unknown)}; the exercises are {', '.join(known)}")
    check_destination(dest, root)
    stripped = []
    for src in repository_files(root):
        rel = src.relative_to(root).as_posix()
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("kvmini/") and src.suffix == ".py" and src.name != "assignments.py":
            text, found = strip(src.read_text(encoding="utf-8"), names)
            target.write_text(text, encoding="utf-8")
            stripped += found
        else:
            shutil.copy2(src, target)
    stripped = list(dict.fromkeys(stripped))  # an exercise may span several regions
    manifest = {"exercises": stripped, "files": fingerprints(root)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return stripped


def describe(dest: Path, names: list[str]) -> str:
    """What `new` prints: each exercise, where its holes are, where to read, how to check it."""
    lines = [f"wrote {dest} with {len(names)} exercises (each region raises NotImplementedError until written):"]
    for ex in (e for n, e in exercises(dest).items() if n in names):
        lines += [f"  {ex.name}", f"    holes: {ex.where()}", f"    read:  {ex.tutorial}, \"{ex.section}\"",
                  f"    check: {ex.check}"]
    lines.append(f"all at once: cd {dest} && python -m kvmini.assignments check")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    older = bool(argv) and argv[0] not in COMMANDS and not argv[0].startswith("-")
    if older:
        argv.insert(0, "new")  # the older form: python -m kvmini.assignments DIR
    p = cli.OneLineParser(prog="python -m kvmini.assignments",
                          description="Course mode: hand out a student copy of kvmini, check an exercise, grade a class.")
    commands = p.add_subparsers(dest="command", required=True, parser_class=cli.OneLineParser)
    new = commands.add_parser("new", help="write a student copy with the mechanisms left as exercises")
    new.add_argument("dest", type=cli.path, help="folder for the copy (new or empty, outside the repository)")
    new.add_argument("--only", nargs="+", metavar="NAME", help="strip only these exercises (default: all)")
    check = commands.add_parser("check", help="run one exercise's tests (or every exercise's) in a copy")
    check.add_argument("name", nargs="?", default="all", help="the exercise (default: all of them, one line each)")
    check.add_argument("dir", type=cli.path, nargs="?", default=".", help="the copy (default: the current folder)")
    grade = commands.add_parser("grade", help="a table student x exercise over student copies")
    grade.add_argument("dirs", type=cli.path, nargs="+", metavar="DIR", help="student copies (made with `new`)")
    grade.add_argument("--json", type=cli.path, metavar="FILE", help="also write the table as JSON")
    grade.add_argument("--csv", type=cli.path, metavar="FILE", help="also write the table as CSV")
    check.add_argument("--timeout", type=cli.seconds, default=900, help="seconds for the tests (default 900)")
    grade.add_argument("--timeout", type=cli.seconds, default=900,
                       help="seconds for one exercise's tests in one copy (default 900)")

    def work():
        args = p.parse_args(argv)
        near = difflib.get_close_matches(argv[1], COMMANDS, n=1, cutoff=0.7) if older else []
        if near and not Path(argv[1]).exists():  # a misspelt command would quietly become a new copy
            raise KvminiError(f"{argv[1]!r} is not a command ({', '.join(COMMANDS)}): did you mean {near[0]}? "
                              f"(a copy in a folder of that name: python -m kvmini.assignments new {argv[1]})")
        if args.command == "new":
            names = write_student_copy(Path(args.dest), names=args.only)
            print(describe(Path(args.dest), names))
            return 0
        from kvmini import grading

        if args.command == "check":
            return grading.check(Path(args.dir), args.name, args.timeout)
        return grading.grade([Path(d) for d in args.dirs], args.json, args.csv, args.timeout)

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
