"""Write every measured number of README.md, docs/ and tutorials/README.md from the committed results files.

    python -m kvmini.eval.docs           # rewrite the generated regions and results/*/summary.md
    python -m kvmini.eval.docs --check   # exit 1, naming the document and region, where they differ

A generated region of a markdown file reads

    <!-- generated: NAME (from results/quick/results.json) -->
    ... TABLES[NAME] of those files (kvmini.eval.tables, kvmini.eval.claims) ...
    <!-- end generated -->

(two regions are made from the code instead: "profiles", the sizes of kvmini.eval.suite.PROFILES, and
"reading-order", the files a reader opens to follow a method, kvmini.eval.reading)

and whatever is typed between the two lines is replaced (so a number edited by hand fails --check).
Each results folder's summary.md is kvmini.eval.summary.summary of its results.json, rewritten alike,
and each README figure (kvmini.eval.plots.FIGURES) is drawn again when the digest it records differs
from that of the results it shows (--check compares the digests only: it draws nothing).
"""
import json
import re
import sys
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
from kvmini.errors import KvminiError  # noqa: E402
from kvmini.eval import claims, tables  # noqa: E402
from kvmini.eval import authors, bench_hf, paired, test_run  # noqa: E402
from kvmini.eval.tables import FULL, FULL_SPEED, QUICK  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REGION = re.compile(r"<!-- generated: (\S+)[^\n]*-->\n(.*?)<!-- end generated -->", re.DOTALL)

TESTS = test_run.OUT  # the last recorded run of the test suite
HF = "results/hf/bench.json"  # kvmini against HF transformers (kvmini.eval.bench_hf --out)
OPS = "results/ops/decode_ops.json"  # ops per decode step (kvmini.eval.speed --ops --out), as kvmini.eval.ops.OPS
AUTHORS = {stem: f"results/authors/{stem}.json" for stem in authors.RESULTS}  # python -m kvmini.eval.authors METHOD
PROFILES_SOURCE = "kvmini/eval/suite.py"  # not a results file: the profiles' sizes, read from the module
AUTHORS_SOURCE = "kvmini/eval/authors.py"  # not a results file: the authors' code that cannot run, and why
READING_SOURCE = "kvmini/"  # not a results file: the reading path's files and lines, read from the code
# name -> (the results files it reads, the function of their contents)
TABLES = {
    "profiles": ((PROFILES_SOURCE,), lambda _: profiles()),
    "reading-order": ((READING_SOURCE,), lambda _: reading()),
    "authors-cannot-run": ((AUTHORS_SOURCE,), lambda _: authors.cannot_run()),
    "not-run-full": ((FULL, FULL_SPEED), tables.not_run),
    "claims": ((QUICK, FULL, FULL_SPEED), claims.claims),
    "not-measured": ((QUICK, FULL, FULL_SPEED), lambda q, f, s: not_measured((QUICK, q), (FULL, f), (FULL_SPEED, s))),
    "claims-detail": ((QUICK, FULL, FULL_SPEED), claims.details),
    "claims-readme": ((QUICK, FULL, FULL_SPEED), claims.readme),
    "provenance": ((QUICK, FULL, FULL_SPEED),
                   lambda q, f, s: tables.provenance_table((QUICK, q), (FULL, f), (FULL_SPEED, s))),
    "d2o-ablations": ((QUICK,), lambda q: tables.ablations(q, "d2o")),
    "dbudgetkv-ablations": ((QUICK,), lambda q: tables.ablations(q, "dbudgetkv")),
    "dynamickv-ablations": ((QUICK,), lambda q: tables.ablations(q, "dynamickv")),
    "evict-every": ((QUICK,), lambda q: tables.ablations(q, "evict_every")),
    "speed-8k": ((FULL_SPEED,), tables.speed_table),
    "together-8k": ((FULL_SPEED,), tables.together_table),
    "speed-2k": ((QUICK,), tables.speed_table),
    "together-2k": ((QUICK,), tables.together_table),
    "parts-8k": ((FULL_SPEED,), tables.parts_table),
    "parts-2k": ((QUICK,), tables.parts_table),
    "queryaware": ((QUICK,), tables.queryaware_table),
    "why": ((QUICK,), lambda q: paired.table(tables.need(q, "why"), tables.name)),
    "queryaware-verdict": ((QUICK,), tables.queryaware_verdict),
    "test-run": ((TESTS,), test_run.summary),
    "hf": ((HF,), bench_hf.table),
    "decode-ops": ((OPS,), lambda res: ops_markdown(res)),
    "tutorial-times": ((TESTS,), test_run.tutorials),
    **{f"authors-{m}": ((path,), authors.table) for m, path in AUTHORS.items()},
}
# the command that measures an experiment into each file, for a table that finds it missing
MEASURE = {QUICK: "python -m kvmini.eval.suite --only {experiment} --out results/quick",
           FULL: "python -m kvmini.eval.suite --profile full --only {experiment} --out results/full",
           FULL_SPEED: "python -m kvmini.eval.suite --profile full --only {experiment} --out results/full-speed"}

# the command that records each file read by a region but not made by the suite
RECORD = {**{path: authors.command(stem) for stem, path in AUTHORS.items()},
          TESTS: "python -m kvmini.eval.test_run",
          HF: "python -m kvmini.eval.bench_hf --out results/hf/bench.json`, then with `--dtype bfloat16",
          OPS: "python -m kvmini.eval.speed --ops --out results/ops/decode_ops.json"}


def ops_markdown(res: dict) -> str:
    from kvmini.eval.ops import ops_markdown as table  # imports torch: only when this region is written

    return table(res)


def profiles() -> str:
    from kvmini.eval.suite import PROFILES  # imports the experiments (and torch): only when this region is written

    return tables.profiles_table(PROFILES)


def reading() -> str:
    from kvmini.eval.reading import table  # imports torch (what make_policy returns): only when this region is written

    return table()


def not_measured(*files: tuple[str, dict]) -> str:
    """The methods the suite runs that a results file lacks (a method just added), with the command that
    measures each alone into it (kvmini.eval.provenance.measure_alone)."""
    from kvmini.eval import provenance, suite  # imports torch: only when this region is written

    rows = []
    for path, res in ((p, r) for p, r in files if r.get("profile") in suite.PROFILES):
        for experiment, want in suite.today(res["profile"]).items():
            made = res.get("provenance", {}).get(experiment)
            missing = [s for s in want["methods"] if made and s not in made["methods"]]
            if missing:
                names = {provenance.method_of(s) for s in missing}
                rows.append(f"| `{path}` | {experiment} | {', '.join(missing)} | "
                            f"`{provenance.measure_alone(made['command'], experiment, names)}` |")
    if not rows:
        return "Every method and variant the suite runs is measured in every results file."
    return "\n".join(["Not measured yet:", "", "| results file | experiment | not measured | measure it alone |",
                      "|---|---|---|---|", *rows])


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "tutorials" / "README.md"]


def region(name: str, root: Path = ROOT) -> str:
    """The whole region NAME as the generator writes it."""
    if name not in TABLES:
        raise KvminiError(f"unknown generated region {name!r}; known: {', '.join(TABLES)}")
    sources, make = TABLES[name]
    if absent := [s for s in sources if s in RECORD and not (root / s).exists()]:
        body = f"*Not measured yet: `{RECORD[absent[0]]}` writes {absent[0]}.*"
        return f"<!-- generated: {name} (from {', '.join(sources)}) -->\n{body}\n<!-- end generated -->"
    loaded = [None if s in (PROFILES_SOURCE, READING_SOURCE, AUTHORS_SOURCE) else read(root, s) for s in sources]
    try:
        body = make(*loaded)
    except tables.Missing as e:
        lacking = next(s for s, res in zip(sources, loaded) if str(e) not in res)
        body = f"*Not measured yet: `{MEASURE[lacking].format(experiment=e)}` writes it.*"
    except SHAPE_ERRORS as e:
        raise KvminiError(f"region {name}: {', '.join(sources)} lack what it needs ({type(e).__name__}: {e}); "
                          "measure them again") from None
    return f"<!-- generated: {name} (from {', '.join(sources)}) -->\n{body}\n<!-- end generated -->"


SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError)  # a results file of another shape


def read(root: Path, source: str) -> dict:
    """A results file, or a KvminiError naming it (and the command that makes it, where one does)."""
    make = RECORD.get(source) or MEASURE.get(source, "").format(experiment="...")
    try:
        data = json.loads((root / source).read_text())
    except (OSError, ValueError) as e:
        raise KvminiError(f"{source} cannot be read ({cli.one_line(e)}): `{make}` makes it") from None
    if not isinstance(data, dict):
        raise KvminiError(f"{source} is not a results file (a JSON object): `{make}` makes it")
    return data


def rewritten(text: str, root: Path = ROOT) -> str:
    return REGION.sub(lambda m: region(m.group(1), root), text)


def outputs(root: Path = ROOT) -> dict[Path, tuple[str, str]]:
    """file -> (its text now, the text the generator writes)."""
    from kvmini.eval.summary import summary

    out = {}
    for path in documents(root):
        now = path.read_text()
        out[path] = (now, rewritten(now, root))
    for results in sorted(root.glob("results/*/results.json")):
        md = results.with_name("summary.md")
        try:
            written = summary(read(root, results.relative_to(root).as_posix()))
        except SHAPE_ERRORS as e:
            raise KvminiError(f"{results.relative_to(root)} lacks what its summary needs ({type(e).__name__}: {e}); "
                              "measure it again") from None
        out[md] = (md.read_text() if md.exists() else "", written)
    return out


def stale_figures(root: Path = ROOT) -> list[str]:
    """The README figures whose recorded digest is not that of the committed results they show."""
    from kvmini.eval import plots

    return [file for file, (sources, _) in plots.FIGURES.items()
            if plots.recorded_digest(root / file) != plots.figure_digest(file, *(read(root, s) for s, _ in sources))]


def draw_figures(root: Path = ROOT) -> list[str]:
    """Draw the stale README figures again (kvmini.eval.plots); the files drawn."""
    from kvmini.eval import plots

    stale = stale_figures(root)
    for file in stale:
        plots.draw_figure(file, root / file, *(read(root, s) for s, _ in plots.FIGURES[file][0]))
    return stale


def differences(root: Path = ROOT) -> list[str]:
    """One line per generated part that differs from what the generator writes."""
    found = [f"{file} does not show the committed results (its data digest differs): `python -m kvmini.eval.docs` "
             "draws it" for file in stale_figures(root)]
    for path, (now, written) in outputs(root).items():
        if now == written:
            continue
        shown = path.relative_to(root)
        names = [m.group(1) for m in REGION.finditer(now) if m.group(0) != region(m.group(1), root)]
        found += [f"{shown}: region {n} differs from what `python -m kvmini.eval.docs` writes" for n in names] or [
            f"{shown} differs from what `python -m kvmini.eval.docs` writes"]
    return found


def main(argv=None) -> int:
    p = cli.OneLineParser(prog="python -m kvmini.eval.docs",
                          description="Write the measured numbers of README.md and docs/ from results/.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated part differs")
    return cli.run(lambda: generate(p.parse_args(argv)), imports=("kvmini.eval.suite",))


def generate(args) -> int:
    if args.check:
        found = differences(ROOT)
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    for path, (now, written) in outputs(ROOT).items():
        if now != written:
            path.write_text(written)
            print(f"wrote {path.relative_to(ROOT)}")
    for file in draw_figures(ROOT):
        print(f"drew {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
