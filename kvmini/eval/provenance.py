"""Where a result came from, and whether the code it measured has changed since (docs/evaluation.md,
"When a result is stale").

Each experiment in a results.json carries `provenance`: the command, date, git commit and CPU that made
it (for people: the check below reads no git), the method specs it measured, the `merged` runs that
measured single methods into it (`python -m kvmini.eval.suite --methods NAME`), and a fingerprint:

    code     what every row shares. Accuracy (streaming, passkey, fidelity, layers, ablations,
             queryaware, why): the experiment's module. Speed (speed, parts_speed): the timed path every
             method shares: kvmini/eval/speed.py and the kvmini modules it imports, the model and the
             engine among them, and the registry without its table of methods (not the command line,
             the option reading or the report, which run outside the clock: UNTIMED).
    methods  per method name. Accuracy: a digest of the method's entries in the engine's behaviour
             recording (tests/data/engine_regression.*; `full` is the model itself), so a refactor
             that changes no behaviour stales nothing. Speed: a digest of the code only that method
             runs (its module and the method-only modules it imports).

Code is digested by meaning: its syntax tree without docstrings or comments, so a docstring fix stales
nothing. A changed method stales its own rows, a method the suite now runs but has not measured is named
as not measured, and the command in the line measures that method alone.

    stale(path, today) -> one line per experiment that no longer describes today's code.
"""
import ast
import datetime
import hashlib
import json
import os
import platform
import shlex
import struct
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDING = ROOT / "tests" / "data" / "engine_regression"
EXPERIMENT_MODULE = {"streaming": "kvmini/eval/streaming.py", "passkey": "kvmini/eval/passkey.py",
                     "fidelity": "kvmini/eval/fidelity.py", "layers": "kvmini/eval/layers.py",
                     "ablations": "kvmini/eval/fidelity.py", "queryaware": "kvmini/eval/query_aware.py",
                     "why": "kvmini/eval/why.py"}
TIMED = ("speed", "parts_speed")  # experiments that measure time: fingerprinted by the code on the timed path
REGISTRY = "kvmini/methods/registry.py"
# A redesign that moves the engine in steps changes the timed path at every step, and measuring every speed
# row again takes longer than a session on a slow machine. While one is named here, a code change stales no
# timed row: the rows are measured once, when it completes, each step being measured side by side with the
# commit before it instead, and every document that shows them says so (docs/evaluation.md, "When a result
# is stale"). A method not measured, or changed sizes, stale a timed result as always.
REDESIGN = "issue 83 moves the engine in steps (a run is the engine's; D2O's steps; one attention path)"
RECORD = "PYTHONPATH=. python tests/test_engine_regression.py --record"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def method_of(spec: str) -> str:
    """'d2o[variant=paper]' -> 'd2o'."""
    return spec.split("[")[0]


def meaning(relative: str) -> str:
    """A source file's digest by meaning: its syntax tree without docstrings (comments are not in it).
    The registry is read without its table of methods, so a line that adds a method stales nothing."""
    tree = ast.parse((ROOT / relative).read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    if relative == REGISTRY:
        tree.body = [n for n in tree.body if not _is_method_table(n)]
    return digest(ast.dump(tree).encode())


def _is_method_table(node) -> bool:
    """The registry's `METHODS = {...}` and its import of the method modules."""
    return (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["METHODS"]) or \
        (isinstance(node, ast.ImportFrom) and node.module == "kvmini.methods")


def method_modules() -> dict[str, str]:
    """Method name -> its module file, read from the registry's METHODS table (no import, no torch)."""
    for node in ast.parse((ROOT / REGISTRY).read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["METHODS"]:
            return {k.value: f"kvmini/methods/{v.id}.py" for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(v, ast.Name)}
    raise ValueError(f"{REGISTRY} has no METHODS table")


def imports_of(relative: str) -> set[str]:
    """The kvmini source files a module imports at its top level (imports inside a function load the
    model or the text for a measurement, outside the timed code)."""
    found = set()
    for node in ast.parse((ROOT / relative).read_text()).body:
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and not \
                (relative == REGISTRY and _is_method_table(node)):
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a name may be a module
        for m in modules:
            for candidate in (m.replace(".", "/") + ".py", m.replace(".", "/") + "/__init__.py"):
                if m.startswith("kvmini") and (ROOT / candidate).is_file():
                    found.add(candidate)
    return found


def closure(starts: set[str], leave_out: set[str] = frozenset()) -> set[str]:
    """`starts` and every kvmini file they import, transitively, except `leave_out`."""
    todo, seen = set(starts), set()
    while todo:
        path = todo.pop()
        seen.add(path)
        todo |= imports_of(path) - seen - leave_out
    return seen


UNTIMED = {"kvmini/cli.py", "kvmini/methods/options.py", "kvmini/report.py"}  # command line, options, report: off any clock


def shared_timed_path() -> set[str]:
    """What every method's timed run executes: speed.py and its imports, the registry's table, the command
    line, the reading and checking of options and the report left out."""
    return closure({"kvmini/eval/speed.py"}, UNTIMED)


def method_code(name: str, shared: set[str]) -> str:
    """A digest of the code only method `name` runs on the timed path ('' for the full cache)."""
    module = method_modules().get(name)
    own = sorted(closure({module}, shared) - shared) if module else []
    return digest(" ".join(f"{f}:{meaning(f)}" for f in own).encode())


def recorded_behaviour(names) -> dict[str, str]:
    """Method name -> digest of its entries in the recording (tensors and facts); '' if it has none."""
    raw = RECORDING.with_suffix(".safetensors").read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]  # safetensors: header length, JSON header, then the data
    header, data = json.loads(raw[8 : 8 + size]), raw[8 + size :]
    facts = json.loads(RECORDING.with_suffix(".json").read_text())
    found = {name: hashlib.sha256() for name in names}
    for key in sorted(k for k in header if k != "__metadata__"):  # 'b1/d2o@12[variant=paper]/keys.0'
        name = method_of(key.split("/")[1].split("@")[0])
        if name in found:
            t = header[key]
            begin, end = t["data_offsets"]
            found[name].update(f"{key} {t['dtype']} {t['shape']}".encode() + data[begin:end])
    for scenario in sorted(facts):
        for label in sorted(facts[scenario]):  # 'b1/d2o@12' (tiny) or 'd2o@64' (default model)
            name = label.split("/")[-1].split("@")[0]
            if name in found:
                found[name].update(f"{scenario} {label} {json.dumps(facts[scenario][label], sort_keys=True)}".encode())
    return {name: h.hexdigest()[:16] if h.digest() != hashlib.sha256().digest() else "" for name, h in found.items()}


def fingerprint(experiment: str, specs: list[str]) -> dict:
    names = sorted({"full", *map(method_of, specs)})
    if experiment in TIMED:
        shared = shared_timed_path()
        return {"code": {f: meaning(f) for f in sorted(shared)}, "methods": {m: method_code(m, shared) for m in names}}
    module = EXPERIMENT_MODULE[experiment]
    return {"code": {module: meaning(module)}, "methods": recorded_behaviour(names)}


def stamp(experiment: str, specs: list[str], argv: list[str]) -> dict:
    """The provenance of an experiment run now by `python -m kvmini.eval.suite argv`."""
    return {"command": command(argv), "date": now(), "commit": commit(), "machine": machine(), "methods": list(specs),
            "fingerprint": fingerprint(experiment, specs)}


def machine(cpuinfo: str | None = None) -> str:
    """The CPU a run measured on, e.g. 'Intel(R) Xeon(R) Processor (model 207), AVX-512, AMX, 2 cores': times
    from two runs compare only on one machine (two hosts of one name may differ in model and vector units)."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    units = [name for flag, name in (("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags]
    model = f" (model {fields['model']})" if "model" in fields else ""
    return ", ".join([fields.get("model name", platform.processor() or platform.machine()) + model, *units,
                      f"{os.cpu_count()} cores"])


def merge_stamp(made: dict, experiment: str, specs: list[str], today_specs: list[str], argv: list[str]) -> dict:
    """`made` (an experiment's provenance) after the specs of `specs`' methods were measured alone into it."""
    names = {method_of(s) for s in specs}
    now_print = fingerprint(experiment, specs)
    methods = [s for s in today_specs if s in made["methods"] or method_of(s) in names]
    return {**made, "methods": methods,
            "fingerprint": {"code": made["fingerprint"]["code"],
                            "methods": {**made["fingerprint"]["methods"],
                                        **{m: d for m, d in now_print["methods"].items() if m in names}}},
            "merged": made.get("merged", []) + [{"methods": [s for s in specs if s != "full"], "command": command(argv),
                                                 "date": now(), "commit": commit(), "machine": machine()}]}


def command(argv) -> str:
    return shlex.join(["python", "-m", "kvmini.eval.suite", *argv])


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def commit() -> str | None:
    """HEAD, with '+ uncommitted changes' when the code or the recording differ from it (results being
    written do not count); None outside a git clone."""
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True,  # noqa: E731
                                        check=True, timeout=30).stdout.strip()
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "kvmini", "tests/data")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" + uncommitted changes" if dirty else "")


def measure_alone(made_command: str, experiment: str, names) -> str:
    """The command that measures methods `names` alone into the results file `made_command` wrote."""
    words, keep = shlex.split(made_command), []
    for flag in (f for f in ("--profile", "--out", "--model", "--device") if f in words):
        keep += words[words.index(flag): words.index(flag) + 2]
    return command([*keep, "--only", experiment, "--methods", *sorted(names)])


def without_methods(sizes):
    """An experiment's sizes without its list of methods (compared method by method above)."""
    return {k: v for k, v in sizes.items() if k != "methods"} if isinstance(sizes, dict) else sizes


def stale(path: Path, today: dict[str, dict]) -> list[str]:
    """One line per experiment of results file `path` that the code no longer gives, naming why and the
    command that re-makes it: the whole experiment when its shared code, its sizes or its format changed;
    the methods alone whose code or recorded behaviour changed, or that the suite runs and it lacks
    (`today`: experiment -> {"methods": specs, "sizes": ...} of the file's profile)."""
    results = json.loads(Path(path).read_text())
    shown = Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path
    lines = []
    for experiment in (e for e in today if e in results):
        made = results.get("provenance", {}).get(experiment, {})
        whole, alone, why = [], set(), []
        if "methods" not in made.get("fingerprint", {}):
            whole.append("made before results recorded a fingerprint by method")
        else:
            missing = [s for s in today[experiment]["methods"] if s not in made["methods"]]
            then, now_print = made["fingerprint"], fingerprint(experiment, made["methods"] + missing)
            whole += [f"{f} changed" if f in now_print["code"] else f"{f} is no longer on its path"
                      for f in then["code"] if then["code"][f] != now_print["code"].get(f)]
            whole += [f"{f} is new on its path" for f in now_print["code"] if f not in then["code"]]
            if experiment in TIMED and REDESIGN:  # code changes are measured when the redesign completes
                whole, then = [], now_print
            changed = [m for m in then["methods"] if then["methods"][m] != now_print["methods"].get(m)]
            whole += ["the model's recorded behaviour changed"] if "full" in changed else []  # speed: never
            for m in (m for m in changed if m != "full"):
                why.append(f"{m}'s {'code' if experiment in TIMED else 'recorded behaviour'} changed")
                alone.add(m)
            unrecorded = sorted(m for m, d in now_print["methods"].items() if not d and experiment not in TIMED)
            why += [f"{m} has no entry in the behaviour recording (record it: {RECORD} {m})" for m in unrecorded]
            alone |= set(unrecorded)
            why += [f"{s} is not measured" for s in missing]
            alone |= {method_of(s) for s in missing}
            gone = [s for s in made["methods"] if s not in today[experiment]["methods"]]
            whole += [f"the suite no longer measures {', '.join(gone)}"] if gone else []
        if without_methods(results.get("sizes", {}).get(experiment)) != without_methods(today[experiment]["sizes"]):
            whole.append("the profile's sizes changed")
        made_by = made.get("command", "(unknown: see the file's git log)")
        if whole:
            lines.append(f"{shown}: {experiment} is stale ({'; '.join(whole + why)}); re-run: {made_by}")
        elif why:
            lines.append(f"{shown}: {experiment} is stale ({'; '.join(why)}); measure alone: "
                         f"{measure_alone(made_by, experiment, alone)}")
    return lines
