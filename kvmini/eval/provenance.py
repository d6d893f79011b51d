"""Where a result came from, and whether the code it describes has changed since (docs/evaluation.md,
"When a result is stale").

Each experiment in a results.json carries `provenance`: the command, the date and the git commit that
made it (the commit is for people; the check below never reads git), the method specs it measured,
and a fingerprint of what it depends on:

    accuracy (streaming, passkey, fidelity, layers, ablations, queryaware)
        per method measured, and `full` (the model itself), a digest of that method's entries in the
        engine's behaviour recording (tests/data/engine_regression.*); plus a digest of the
        experiment's own module. tests/test_engine_regression.py proves the code still behaves as
        recorded, so a refactor that changes no behaviour leaves these results current.
    speed, parts_speed
        a digest of every source file on the timed path: kvmini/eval/speed.py, every method module,
        and every kvmini module they import. Any edit there may change a time.

    stale(path) -> one line per experiment whose fingerprint differs from the code's today.
"""
import ast
import datetime
import hashlib
import json
import shlex
import struct
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDING = ROOT / "tests" / "data" / "engine_regression"
EXPERIMENT_MODULE = {"streaming": "kvmini/eval/streaming.py", "passkey": "kvmini/eval/passkey.py",
                     "fidelity": "kvmini/eval/fidelity.py", "layers": "kvmini/eval/layers.py",
                     "ablations": "kvmini/eval/fidelity.py", "queryaware": "kvmini/eval/query_aware.py"}

TIMED = ("speed", "parts_speed")  # experiments that measure time: fingerprinted by the code on the timed path


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def file_digest(relative: str) -> str:
    """A source file's digest, line endings normalised (a Windows checkout gives the same)."""
    return digest((ROOT / relative).read_bytes().replace(b"\r\n", b"\n"))


def method_of(spec: str) -> str:
    """'d2o[variant=paper]' -> 'd2o'."""
    return spec.split("[")[0]


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


def imports_of(relative: str) -> set[str]:
    """The kvmini source files a module imports at its top level (imports inside a function load the
    model or the text for a measurement, outside the timed code)."""
    found = set()
    for node in ast.parse((ROOT / relative).read_text()).body:
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a name may be a module
        for m in modules:
            for candidate in (m.replace(".", "/") + ".py", m.replace(".", "/") + "/__init__.py"):
                if m.startswith("kvmini") and (ROOT / candidate).is_file():
                    found.add(candidate)
    return found


def speed_path() -> list[str]:
    """Every source file the speed experiment runs: speed.py, the methods, and what they import."""
    todo = {"kvmini/eval/speed.py"} | {f"kvmini/methods/{p.name}" for p in (ROOT / "kvmini" / "methods").glob("*.py")}
    seen = set()
    while todo:
        path = todo.pop()
        seen.add(path)
        todo |= imports_of(path) - seen
    return sorted(seen)


def fingerprint(experiment: str, specs: list[str]) -> dict:
    if experiment in TIMED:
        return {"code": {path: file_digest(path) for path in speed_path()}}
    names = sorted({"full", *map(method_of, specs)})
    module = EXPERIMENT_MODULE[experiment]
    return {"behaviour": recorded_behaviour(names), "code": {module: file_digest(module)}}


def stamp(experiment: str, specs: list[str], argv: list[str]) -> dict:
    """The provenance of an experiment run now by `python -m kvmini.eval.suite argv`."""
    return {"command": shlex.join(["python", "-m", "kvmini.eval.suite", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(), "methods": list(specs), "fingerprint": fingerprint(experiment, specs)}


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


def stale(path: Path, today: dict[str, dict]) -> list[str]:
    """One line per experiment of results file `path` that the code no longer gives, naming why and the
    command that re-makes it: its fingerprint differs from today's or is missing, or the suite now runs
    it otherwise (`today`: experiment -> {"methods": specs, "sizes": ...} of the file's profile)."""
    results = json.loads(Path(path).read_text())
    shown = Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path
    lines = []
    for experiment in (e for e in today if e in results):
        made = results.get("provenance", {}).get(experiment, {})
        if "fingerprint" not in made:
            why = ["made before results recorded a fingerprint"]
        else:
            then, now = made["fingerprint"], fingerprint(experiment, made["methods"])
            why = [f"{m}'s recorded behaviour changed" for m in then.get("behaviour", {})
                   if then["behaviour"][m] != now["behaviour"][m]]
            why += [f"{m} has no entry in the behaviour recording"
                    for m, d in now.get("behaviour", {}).items() if not d]
            why += [f"{f} changed" if f in now["code"] else f"{f} is no longer on its path"
                    for f in then["code"] if then["code"][f] != now["code"].get(f)]
            why += [f"{f} is new on its path" for f in now["code"] if f not in then["code"]]
            if made["methods"] != today[experiment]["methods"]:
                why.append(f"the suite now measures {', '.join(today[experiment]['methods'])}")
        if results.get("sizes", {}).get(experiment) != today[experiment]["sizes"]:
            why.append("the profile's sizes changed")
        if why:
            command = made.get("command", "(unknown: see the file's git log)")
            lines.append(f"{shown}: {experiment} is stale ({'; '.join(why)}); re-run: {command}")
    return lines
