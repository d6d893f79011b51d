"""Run the test suite and record what it took: results/tests/run.json, the source of the test-run
numbers in docs/design.md ("Running them") and tutorials/README.md (kvmini.eval.docs writes them).

    python -m kvmini.eval.test_run                       # the whole suite, as the README's test command
    python -m kvmini.eval.test_run --out /tmp/run.json -- tests/test_sampling.py   # pytest's own arguments

The suite runs in a child process (`python -m pytest -q -n auto`, its output shown as it comes) with a JUnit
report, read back here into counts, skip reasons and per-file and per-test seconds. A run in which a
test fails writes nothing and exits 1: the numbers describe a suite that passes.
"""
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from kvmini import cli
from kvmini.errors import KvminiError
from kvmini.eval.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
OUT = "results/tests/run.json"


def outcome(case: ET.Element) -> tuple[str, str]:
    """A JUnit testcase -> (passed | failed | skipped | xfailed, the skip's reason)."""
    for child in case:
        if child.tag in ("failure", "error"):
            return "failed", ""
        if child.tag == "skipped":
            if child.get("type") == "pytest.xfail":
                return "xfailed", ""
            return "skipped", (child.get("message") or "").removeprefix("Skipped: ")
    return "passed", ""


def is_record(path: Path) -> bool:
    try:
        return isinstance(data := json.loads(path.read_text()), dict) and "tests" in data and "command" in data
    except (ValueError, UnicodeDecodeError):
        return False


def read_report(xml: Path) -> dict:
    """Counts, skip reasons and seconds per test file and per test of a JUnit report."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    reasons, files, tests, xfailed = {}, {}, {}, []
    for case in ET.parse(xml).getroot().iter("testcase"):
        result, reason = outcome(case)
        counts[result] += 1
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
        file = case.get("classname", "").replace(".", "/") + ".py"  # tests.test_cli -> tests/test_cli.py
        seconds, test = float(case.get("time") or 0), f"{file}::{case.get('name')}"
        files[file] = round(files.get(file, 0) + seconds, 2)
        tests[test] = round(seconds, 2)
        if result == "xfailed":
            xfailed.append(test)
    return {"tests": sum(counts.values()), **counts, "skip_reasons": reasons, "xfailed_tests": xfailed,
            "file_seconds": files, "test_seconds": tests}


def minutes(seconds: float) -> str:
    """95.4 -> '1m35s'; 42.0 -> '42 s'."""
    whole = round(seconds)
    return f"{whole // 60}m{whole % 60:02d}s" if whole >= 60 else f"{whole} s"


def provenance(run: dict) -> str:
    m = run["machine"]
    return (f"`{run['command']}` at commit {run['commit']}, {run['date']}, {m['cpus']} cores, load average "
            f"{m['load_at_start']} at its start")


def summary(run: dict) -> str:
    """docs/design.md's paragraph on the last recorded run."""
    skips = "; ".join(f"{n}: {why}" for why, n in sorted(run["skip_reasons"].items(), key=lambda x: -x[1]))
    slowest = sorted(run["file_seconds"].items(), key=lambda x: -x[1])[:3]
    return (f"The last recorded run of the suite took **{minutes(run['seconds'])}** for {run['tests']:,} tests: "
            f"{run['passed']:,} pass, {run['skipped']} skip ({skips}), {run['xfailed']} xfail"
            + "".join(f" ({t.removeprefix('tests/')})" for t in run["xfailed_tests"]) + ". The slowest files: "
            + ", ".join(f"{f.removeprefix('tests/')} {minutes(t)}" for f, t in slowest)
            + f". Recorded by {provenance(run)} (results/tests/run.json).")


def tutorials(run: dict) -> str:
    """tutorials/README.md's sentence on how long the tutorials take as tests."""
    parts = []
    for test, how in (("test_tutorial_runs_as_a_notebook_and_shows_its_figures", "as notebooks"),
                      ("test_tutorial_runs_in_a_student_copy", "in a fresh student copy with every exercise open")):
        times = {k.split("[")[1].rstrip("]"): t for k, t in run["test_seconds"].items()
                 if k.startswith(f"tests/test_tutorials.py::{test}[")}
        if times:
            slow = max(times, key=times.get)
            parts.append(f"{how}, the {len(times)} tutorials took {min(times.values()):.0f}–{times[slow]:.0f} s each "
                         f"({slow} the slowest), {minutes(sum(times.values()))} in all")
    if not parts:
        return "*The last recorded test run did not run the tutorials: `python -m kvmini.eval.test_run` records them.*"
    return ("In the last recorded test run, " + "; ".join(parts) + " (a test's seconds include its fixtures' "
            f"setup: the first one prepares the model or the copy). Recorded by {provenance(run)} "
            "(results/tests/run.json).")


def record(pytest_args: list[str], out: Path) -> int:
    path = ROOT / OUT if str(out) == OUT else out.resolve()  # the default in this repository; others from here
    if str(out) == OUT:
        path.parent.mkdir(parents=True, exist_ok=True)
    path = cli.writable_file(path, "--out")  # before the run, so that no run is lost to it
    if path.exists() and path.stat().st_size and not is_record(path):
        raise KvminiError(f"--out {out} is not a record of this tool's (a JSON file it wrote); write it elsewhere")
    pytest_args = [str(Path(a).resolve()) if not a.startswith("-") and Path(a.split("::")[0]).exists() and "::" not in a
                   else a for a in pytest_args]  # paths given from here; pytest runs in the repository
    command = shlex.join(["python", "-m", "kvmini.eval.test_run", *(["--out", str(out)] if str(out) != OUT else []),
                          *(["--", *pytest_args] if pytest_args else [])])
    started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        t0 = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "auto", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", *pytest_args], cwd=ROOT).returncode
        seconds = time.perf_counter() - t0
        if not xml.exists():
            raise KvminiError(f"pytest wrote no report (exit code {code}): nothing recorded")
        report = read_report(xml)
    if code in (4, 5) or not report["tests"]:  # pytest's usage error, or no test collected
        raise KvminiError(f"no test ran (pytest exit code {code}): check the arguments after --; nothing recorded")
    if code != 0 or report["failed"] or report["passed"] == 0:
        print(f"error: the run did not pass (pytest exit code {code}, {report['failed']} failed, {report['passed']} "
              f"passed); {out} is not written", file=sys.stderr)
        return 1
    import torch

    result = {"command": command, "date": started.strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
              "seconds": round(seconds, 1), "machine": {"cpus": os.cpu_count(), "load_at_start": round(load, 1),
                                                        "load_at_end": round(os.getloadavg()[0], 1),
                                                        "python": platform.python_version(), "torch": torch.__version__},
              **report}
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}: {report['tests']:,} test{'' if report['tests'] == 1 else 's'} in {seconds / 60:.1f} minutes")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = cli.OneLineParser(description="Run the test suite and record its counts and seconds (results/tests/run.json).")
    p.add_argument("--out", type=cli.path, default=OUT, help=f"the JSON file to write (default: {OUT}); pytest's arguments follow --")
    return cli.run(lambda: record(pytest_args, Path(p.parse_args(ours).out)))


if __name__ == "__main__":
    sys.exit(main())
