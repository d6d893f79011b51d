"""Student copies: the repository with the exercises' solutions stripped, a manifest of what the
grade depends on, and (on request) the tests' literal references withheld.

A literal reference a test compares against (tests/test_dbudgetkv.py's `sequential_prune` ...) is
marked in its test file by `# BEGIN REFERENCE` / `# END REFERENCE` lines and its function decorated
with `@stored` (tests/cases.py). `new --withhold-references` runs the exercises' tests here, in the
instructor's repository, recording each reference's outputs (tests/data/withheld_cases.pt in the
copy), and hands out the test files with those regions' bodies removed: the tests then read the
stored outputs, and the copy holds no reference for a student to call.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvmini.course.exercises import ROOT, exercises, holds_regions, strip
from kvmini.errors import KvminiError

SKIP = {".git", "weights", "results", "__pycache__", ".hypothesis", ".pytest_cache"}
MANIFEST = ".kvmini-copy.json"  # written into every copy: what it held when it was handed out
GRADED = ("kvmini", "tests", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini")  # (and top-level scripts):
#   what the grade depends on; a change there is reported
CASES = "tests/data/withheld_cases.pt"  # a withheld copy's stored outputs (the grade never reads them)
REFERENCE_BEGIN = re.compile(r"^(\s*)# BEGIN REFERENCE$")
REFERENCE_END = re.compile(r"^\s*# END REFERENCE$")
WITHHELD = "...  # withheld: its outputs are stored in tests/data/withheld_cases.pt (see tests/cases.py)"


def withhold(text: str) -> str:
    """`text` with the body of every REFERENCE region replaced by a stub line (markers kept)."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        begin = REFERENCE_BEGIN.match(line)
        if begin:
            if inside:
                raise ValueError(f"nested reference at: {line.strip()}")
            out += [line, f"{begin[1]}{WITHHELD}\n"]
            inside = True
        elif REFERENCE_END.match(line):
            if not inside:
                raise ValueError("END REFERENCE without BEGIN")
            out.append(line)
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN REFERENCE without END")
    return "".join(out)


def references(root: Path = ROOT) -> dict[str, list[str]]:
    """Test file -> the body of each REFERENCE region in it (what a withheld copy must not hold)."""
    found = {}
    for path in sorted((root / "tests").glob("*.py")):
        lines, body, inside = path.read_text(encoding="utf-8").splitlines(), [], False
        for line in lines:
            if REFERENCE_BEGIN.match(line):
                inside, body = True, []
            elif REFERENCE_END.match(line):
                inside = False
                found.setdefault(f"tests/{path.name}", []).append("\n".join(body))
            elif inside:
                body.append(line)
    return found


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
    libraries' own conftest.py files), nor a withheld copy's stored cases (the grade runs the references)."""
    parts = rel.split("/")
    if "__pycache__" in parts or "site-packages" in parts or any(p.startswith(".") for p in parts[:-1]) or rel == CASES:
        return False
    return parts[0] in GRADED or parts[0].endswith(".py") or rel.endswith("/conftest.py")


def fingerprints(root: Path = ROOT, withheld: bool = False) -> dict[str, str]:
    """What a copy of `root` holds as handed out: the fingerprint of every file the grade depends on
    (a copy's are the same: its regions are not part of a fingerprint); `withheld`: of a copy made
    with the references withheld."""
    files = {p.relative_to(root).as_posix(): p for p in repository_files(root)}
    return {rel: fingerprint(rel, path.read_text(encoding="utf-8", errors="surrogateescape"), withheld)
            for rel, path in files.items() if graded(rel)}


def fingerprint(rel: str, text: str, withheld: bool = False) -> str:
    """sha256 of a file as the grade sees it: a module with exercise regions without their bodies; a test
    file of a withheld copy as it was handed out (its references' bodies withheld)."""
    if holds_regions(rel):
        text = strip(text)[0]
    elif withheld and rel.startswith("tests/") and rel.endswith(".py"):
        text = withhold(text)
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


def record_cases(into: Path, root: Path = ROOT) -> None:
    """Run every test of the files that hold references, in `root` (which holds the references and the
    solutions), storing each @stored reference's outputs in `into`; they must all pass. Recorded once
    per version of what the grade depends on (a cache in ~/.cache/kvmini), then copied."""
    digest = hashlib.sha256(json.dumps(fingerprints(root), sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvmini" / f"withheld-{digest}.pt"
    if not cache.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.part")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *references(root)],
                              cwd=root, capture_output=True, text=True, env={**os.environ, "KVMINI_RECORD_CASES": str(partial)})
        if proc.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            raise KvminiError(f"recording the references' outputs failed (their tests must pass in {root}): {last[0]}")
        partial.replace(cache)
    into.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(cache, into)


def write_student_copy(dest: Path, root: Path = ROOT, names=None, withheld: bool = False, student: str = "") -> list[str]:
    """Copy the repository to `dest` with the exercises stripped (only `names`, when given) and a
    manifest of what the grade depends on; `withheld`: the tests' references replaced by stored
    outputs. Returns the names of the exercises stripped."""
    known = exercises(root)
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise KvminiError(f"no exercise {', '.join(unknown)}; the exercises are {', '.join(known)}")
    check_destination(dest, root)
    if withheld:
        record_cases(dest / CASES, root)
    stripped = []
    for src in repository_files(root):
        rel = src.relative_to(root).as_posix()
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if holds_regions(rel):
            text, found = strip(src.read_text(encoding="utf-8"), names)
            target.write_text(text, encoding="utf-8")
            stripped += found
        elif withheld and rel.startswith("tests/") and rel.endswith(".py"):
            target.write_text(withhold(src.read_text(encoding="utf-8")), encoding="utf-8")
        else:
            shutil.copy2(src, target)
    stripped = list(dict.fromkeys(stripped))  # an exercise may span several regions
    manifest = {"exercises": stripped, "withheld": withheld, "files": fingerprints(root, withheld)}
    if student:
        manifest["student"] = student
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return stripped


def describe(dest: Path, names: list[str]) -> str:
    """What `new` prints: each exercise, where its holes are, where to read, how to check it."""
    lines = [f"wrote {dest} with {len(names)} exercises (each region raises NotImplementedError until written):"]
    for ex in (e for n, e in exercises(dest).items() if n in names):
        lines += [f"  {ex.name}", f"    holes: {ex.where()}", f"    read:  {ex.tutorial}, \"{ex.section}\"",
                  f"    check: {ex.check}"]
    lines.append(f"all at once: cd {dest} && python -m kvmini.course check")
    return "\n".join(lines)
