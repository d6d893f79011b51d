"""Exercises: declared once, by comment regions in kvmini/ and markers on their tests.

An exercise's solution is marked in kvmini/ by two comment lines (an exercise may span several
functions; one function may hold regions of two exercises):

    # BEGIN EXERCISE <name>: <tutorial>, "<section of the tutorial>"
    ...the solution...
    # END EXERCISE

and its tests carry `@pytest.mark.exercise("<name>")`. Everything else is found from these: the
holes (file:function), the tutorial section, the check command. In a student copy, each region keeps
its markers and its body becomes `raise NotImplementedError("exercise <name>: see ...")`.
"""
import ast
import re
from dataclasses import dataclass, field
from pathlib import Path


BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+): (\S+), \"(.+)\"$")
END = re.compile(r"^\s*# END EXERCISE$")
ROOT = Path(__file__).resolve().parent.parent.parent
COMMAND = "python -m kvmini.course"


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
        return f"{COMMAND} check {self.name}"

    def where(self) -> str:
        return "; ".join(f"{path}: {', '.join(functions)}" for path, functions in self.holes.items())


def stub(name: str, tutorial: str, section: str) -> str:
    return f"exercise {name}: see {tutorial}, {section!r}; check it with {COMMAND} check {name}"


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
    """The modules that may hold exercise regions (not the course's own, which only describe them)."""
    return sorted(p for p in (root / "kvmini").rglob("*.py") if holds_regions(p.relative_to(root).as_posix()))


def holds_regions(rel: str) -> bool:
    """Whether the file at `rel` (relative to the repository) may hold exercise regions."""
    return (rel.startswith("kvmini/") and rel.endswith(".py") and not rel.startswith("kvmini/course/")
            and "__pycache__" not in rel)


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


def unparsable_tests(root: Path) -> list[str]:
    """Test files that do not parse, each with its error: the exercises' tests they declare cannot be found."""
    found = []
    for path in sorted((root / "tests").glob("test_*.py")):
        try:
            ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError as e:
            found.append(f"tests/{path.name} does not parse: {e.msg} (line {e.lineno})")
    return found


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
