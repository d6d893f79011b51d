"""The reading path of a method: the kvmini files a reader opens to follow `run.py --method NAME` from the
prompt to a kept token, in the order they are met, with their non-blank lines (README's reading-order table).

The path starts at kvmini/generate.py, model.py, the method's module and the module of every
kvmini object `make_policy(NAME, 0.2)` returns (what actually runs); it follows top-level kvmini imports
depth first, in the order a file writes them, and never the registry (it imports every method).
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ("kvmini/generate.py", "kvmini/model.py")
SKIP = {"kvmini/methods/registry.py"}


def _file(module: str, root: Path) -> str | None:
    for rel in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
        if module.startswith("kvmini") and (root / rel).is_file():
            return rel
    return None


def imports(rel: str, root: Path = ROOT) -> list[str]:
    """The kvmini files `rel` imports at its top level, in the order it writes them."""
    found = []
    for node in ast.parse((root / rel).read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [f for n in names if (f := _file(n, root)) and f not in found]
    return found


def running(method: str, root: Path = ROOT) -> list[str]:
    """The files of the kvmini classes in what make_policy(method, 0.2) returns, three levels down."""
    from kvmini.methods.registry import make_policy  # imports torch: only when a table is written

    found, seen = [], set()

    def visit(obj, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        found.extend(f for c in type(obj).__mro__ if (f := _file(c.__module__, root)) and f not in found)
        values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
        values += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
        for v in values:
            for item in v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) else [v]:
                if type(item).__module__.startswith("kvmini"):
                    visit(item, depth + 1)

    visit(make_policy(method, 0.2), 0)
    return found


def path(method: str, root: Path = ROOT) -> list[str]:
    """The reading path of `method`, depth first from its entries."""
    order: list[str] = []

    def walk(rel: str) -> None:
        if rel in order or rel in SKIP:
            return
        order.append(rel)
        for f in imports(rel, root):
            walk(f)

    for start in (*ENTRY, f"kvmini/methods/{method}.py", *running(method, root)):
        walk(start)
    return order


def lines(rel: str, root: Path = ROOT) -> int:
    """Non-blank lines (code, docstrings and comments alike)."""
    return sum(1 for line in (root / rel).read_text().splitlines() if line.strip())


def summary(rel: str, root: Path = ROOT) -> str:
    """The first sentence of a module's docstring."""
    doc = (ast.get_docstring(ast.parse((root / rel).read_text())) or "").split("\n\n")[0].replace("\n", " ")
    return re.split(r"(?<!\bApp\.)(?<!\bEq\.)(?<!\bal\.)(?<=[.?]) (?=[A-Z(])", doc)[0].replace("|", "\\|")


def table(methods=("h2o", "d2o"), root: Path = ROOT) -> str:
    paths = {m: path(m, root) for m in methods}
    files = list(dict.fromkeys(f for m in methods for f in paths[m]))
    rows = [f"| {i} | `{f}` | {lines(f, root)} | " + " | ".join("✓" if f in paths[m] else "" for m in methods)
            + f" | {summary(f, root)} |" for i, f in enumerate(files, 1)]
    totals = " | ".join(f"{len(paths[m])} files, {sum(lines(f, root) for f in paths[m]):,} lines" for m in methods)
    return "\n".join([f"| # | file | lines | {' | '.join(methods)} | what it holds |",
                      "|---|---|---|" + "---|" * len(methods) + "---|", *rows, f"| | **total** | | {totals} | |"])
