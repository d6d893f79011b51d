"""Every way in keeps run.py's promise: the evaluation tools (fidelity, suite, bench_hf), the course
tools (course, notebooks), the weights tool and the Python API answer a user's mistake or the
operating system's refusal with one line on stderr and exit code 2 (the API: a KvminiError naming
the argument), never a traceback, never a silent no-op; Ctrl-C is one line and 130.

Each tool's `main(argv)` holds its error boundary, so most cases run in this process; only Ctrl-C
during the imports and file permissions need a child process.
"""
import json
import math
import re
import signal
import subprocess
import sys

import pytest
import torch

from kvmini.errors import KvminiError
from test_hostile_inputs import ROOT, assert_one_line, chat_model_template, cli, model, prompt, unprivileged  # noqa: F401


def tool(capsys, main, *argv):
    """A tool's main(argv) in this process -> (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except KeyboardInterrupt:  # would stop the whole test session
        pytest.fail("Ctrl-C escaped the tool's main")
    out, err = capsys.readouterr()
    return code, out, err


# --- evaluation tools ------------------------------------------------------------------------------

def test_fidelity_json_into_a_missing_folder_is_refused_before_the_work(capsys, model, tmp_path):
    from kvmini.eval import fidelity

    code, out, err = tool(capsys, fidelity.main, "--model", model, "--n", 16, "--k", 4, "--methods", "h2o",
                          "--budgets", 8, "--json", tmp_path / "missing" / "x.json")
    assert_one_line(code, err, f"the folder {tmp_path / 'missing'} does not exist")
    assert out == ""  # no table: nothing ran


def test_fidelity_bad_budget_is_refused_before_the_full_cache_runs(capsys, model):
    from kvmini.eval import fidelity

    code, out, err = tool(capsys, fidelity.main, "--model", model, "--n", 16, "--k", 4, "--methods", "h2o",
                          "--budgets", 0)
    assert_one_line(code, err, "--budget must be a finite number > 0")


@pytest.mark.parametrize("argv,fragment", [
    (["--n", "0"], "argument --n: must be >= 1, got 0 (see --help)"),
    (["--offset", "-1"], "argument --offset: must be >= 0"),
    (["--nosuch"], "unrecognized arguments: --nosuch (see --help)"),
])
def test_fidelity_usage_errors_are_one_line(capsys, argv, fragment):
    from kvmini.eval import fidelity

    assert_one_line(*tool(capsys, fidelity.main, *argv)[::2], fragment)


@pytest.mark.parametrize("tool_name", ["suite", "fidelity"])
def test_ctrl_c_and_the_unexpected_during_a_tools_work(capsys, monkeypatch, model, tmp_path, tool_name):
    from kvmini.eval import fidelity, suite

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    module, work, argv = {
        "suite": (suite, "run_suite", ["--profile", "smoke", "--only", "layers", "--out", tmp_path]),
        "fidelity": (fidelity, "run", ["--n", 16, "--k", 4, "--methods", "h2o", "--budgets", 8]),
    }[tool_name]
    monkeypatch.setattr(module, work, interrupted)
    assert_one_line(*tool(capsys, module.main, "--model", model, *argv)[::2], "interrupted (Ctrl-C)", expect_code=130)
    monkeypatch.setattr(module, work, lambda *a, **k: 1 / 0)
    assert_one_line(*tool(capsys, module.main, "--model", model, *argv)[::2], "unexpected ZeroDivisionError")


def test_suite_out_an_existing_file_is_refused_before_the_work(capsys, model, tmp_path):
    from kvmini.eval import suite

    existing = tmp_path / "results"
    existing.write_text("mine")
    code, out, err = tool(capsys, suite.main, "--model", model, "--profile", "smoke", "--only", "layers",
                          "--out", existing)
    assert_one_line(code, err, f"--out {existing} is a file, not a folder")
    assert existing.read_text() == "mine"


def test_suite_out_empty_is_refused_not_read_as_the_current_folder(capsys, model):
    from kvmini.eval import suite

    code, out, err = tool(capsys, suite.main, "--model", model, "--profile", "smoke", "--only", "layers", "--out", "")
    assert_one_line(code, err, "argument --out: must not be empty")


def test_suite_unknown_profile_is_one_line(capsys):
    from kvmini.eval import suite

    assert_one_line(*tool(capsys, suite.main, "--profile", "nosuch")[::2], "invalid choice: 'nosuch'")


def test_suite_refuses_an_experiment_longer_than_the_context(capsys, model, tmp_path):
    from kvmini.eval import suite

    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    n = suite.PROFILES["smoke"]["layers"]["n"]  # 128 tokens
    code, out, err = tool(capsys, suite.main, "--model", model, "--profile", "smoke", "--only", "layers",
                          "--out", tmp_path / "out")
    assert_one_line(code, err, f"experiment layers needs {n} tokens, more than the model's context of 64")
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("argv,fragment", [
    (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["--prompt-tokens", "0"], "argument --prompt-tokens: must be >= 1, got 0"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
])
def test_bench_hf_bad_numbers_and_dtype(capsys, argv, fragment):
    from kvmini.eval import bench_hf

    args = {"--prompt-tokens": "8", "--new-tokens": "2", "--repeats": "1", **dict(zip(argv[::2], argv[1::2]))}
    assert_one_line(*tool(capsys, bench_hf.main, *[x for kv in args.items() for x in kv])[::2], fragment)


# --- course tools ----------------------------------------------------------------------------------

def test_course_new_into_bad_destinations(capsys, tmp_path):
    from kvmini.course.__main__ import main

    file = tmp_path / "a_file"
    file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "thesis.tex").write_text("mine")
    for dest, fragment in [(file, "is a file, not a folder"), (file / "sub", "is not a folder this user may write"),
                           (full, "exists and is not empty"), (ROOT, "is in the repository"),
                           (ROOT / "student", "is in the repository")]:
        assert_one_line(*tool(capsys, main, "new", dest)[::2], fragment)
    assert (full / "thesis.tex").read_text() == "mine" and not (ROOT / "student").exists()


def test_course_new_into_a_folder_it_may_not_write(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    proc = subprocess.run([*unprivileged(), sys.executable, "-m", "kvmini.course", "new", str(locked / "copy")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert_one_line(proc.returncode, proc.stderr, "is not a folder this user may write to")


def test_check_and_grade_refuse_what_is_not_a_student_copy(capsys, tmp_path):
    from kvmini.course.__main__ import main

    (tmp_path / "empty").mkdir()
    for argv, fragment in [(["grade", tmp_path / "missing"], "missing is not a folder"),
                           (["grade", tmp_path / "empty"], "is not a kvmini copy (no kvmini/course/exercises.py in it)"),
                           (["grade", ROOT], "is not a student copy (no .kvmini-copy.json"),
                           (["grade"], "the following arguments are required: DIR"),
                           (["check", "nosuch", ROOT], "no exercise 'nosuch'; the exercises are variance_softmax, "),
                           (["check", "ema_merging", tmp_path / "missing"], "missing is not a folder"),
                           (["new", tmp_path / "copy", "--only", "nosuch"], "no exercise nosuch; the exercises are")]:
        assert_one_line(*tool(capsys, main, *argv)[::2], fragment)
    assert not (tmp_path / "copy").exists()


def test_notebooks_refuse_an_unknown_tutorial(capsys, tmp_path):
    from kvmini import notebooks

    assert_one_line(*tool(capsys, notebooks.main, "99", "--out", tmp_path)[::2],
                    "no tutorial '99'; the tutorials are numbered 01, 02")
    assert not any(tmp_path.iterdir())


def test_notebooks_refuse_an_output_folder_that_is_a_file(capsys, tmp_path):
    from kvmini import notebooks

    (tmp_path / "nb").write_text("mine")
    assert_one_line(*tool(capsys, notebooks.main, "3", "--out", tmp_path / "nb")[::2], "is a file, not a folder")


def test_notebooks_read_3_as_03():
    from kvmini.notebooks import ROOT as NB_ROOT, select

    tutorials = sorted((NB_ROOT / "tutorials").glob("[0-9]*.py"))
    third = [t for t in tutorials if t.name.startswith("03_")]
    assert select(tutorials, ["3"]) == select(tutorials, ["03"]) == select(tutorials, ["3", "03"]) == third
    assert select(tutorials, []) == tutorials


# --- weights tool ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,fragment", [
    (["--hub", ""], "--hub must name a repository"),
    (["--hub", " "], "--hub must name a repository"),
    (["--hub", "/"], "--hub must name a repository"),
    (["--dest", "somewhere"], "--dest is the folder for --hub"),
    (["--nosuch"], "unrecognized arguments"),
])
def test_weights_bad_arguments(capsys, argv, fragment):
    from kvmini import weights

    code, out, err = tool(capsys, weights.main, *argv)
    assert_one_line(code, err, fragment)
    assert out == ""  # the default model was not prepared in their place


# --- the page of what each method keeps -----------------------------------------------------------

@pytest.mark.parametrize("argv,fragment", [
    (["--methods", "h2o", "nosuch"], "unknown method 'nosuch'"),
    (["--methods", "h2o", "--budget", "abc"], "argument --budget: must be a finite number, got 'abc' (see --help)"),
    (["--methods", "h2o", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0 (see --help)"),
])
def test_view_bad_arguments_are_one_line(capsys, tmp_path, prompt, argv, fragment):
    from kvmini import view

    code, out, err = tool(capsys, view.main, *argv, "--prompt", prompt, "--out", tmp_path / "kept.html",
                          "--model", tmp_path / "no-model")
    assert_one_line(code, err, fragment)
    assert out == "" and not (tmp_path / "kept.html").exists()



def test_view_says_when_a_budget_was_raised_to_fit(capsys, tmp_path, model, prompt):
    """A ratio of a short prompt below what SnapKV always keeps (its window) is raised, and the tool says so
    on the method's stderr line, as run.py's report does (docs/design.md, "Budgets")."""
    from kvmini import view

    code, out, err = tool(capsys, view.main, "--methods", "snapkv", "h2o", "--prompt", prompt, "--out",
                          tmp_path / "kept.html", "--model", model, "--budget", 0.1, "--max-new-tokens", 1, "--raw")
    assert code == 0, err
    snapkv = next(line for line in err.splitlines() if line.startswith("snapkv: "))
    assert "; budget raised from " in snapkv and "the least snapkv can keep" in snapkv
    assert "budget raised" not in next(line for line in err.splitlines() if line.startswith("h2o: "))

# --- run.py ----------------------------------------------------------------------------------------

def test_budget_with_a_plus_sign_is_read_as_without(capsys, model, prompt):
    reports = []
    for text in ["1", "+1", " 1 "]:
        code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "h2o", "--budget", text,
                             "--recent", 0, "--max-new-tokens", 1)
        assert code == 0, err
        reports.append(next(line for line in out.splitlines() if line.startswith("method")))
    assert reports[0] == reports[1] == reports[2] and "budget 1 = 1 token per layer" in reports[0]
    assert "(█ = 1 token; the full cache holds" in out  # the bars' scale: one token, not '1 tokens'


def test_a_large_token_budget_is_printed_as_digits(capsys, model, prompt):
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "h2o", "--budget", "1e6",
                         "--max-new-tokens", 1)
    assert code == 0, err
    assert "budget 1000000 = " in next(line for line in out.splitlines() if line.startswith("method"))


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "dynamickv"])
def test_window_zero_is_refused_by_the_option_check(capsys, model, prompt, method):
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model, "--method", method, "--window", 0)[::2],
                    "--window must be >= 1")


def test_report_says_why_protected_layers_hold_more_than_the_budget(capsys, model, prompt):
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "d2o", "--budget", 8,
                         "--protected-layers", "0", "--max-new-tokens", 2)
    assert code == 0, err
    mean_held = float(out.split("KV cache  2 layers, ")[1].split("/")[1])  # min/mean/max entries
    method = next(line for line in out.splitlines() if line.startswith("method"))
    assert mean_held > 8  # layer 0 holds the whole prompt
    budgets = re.search(r"= 8-(\d+) \(mean ([\d.]+)\) tokens per layer; a mean above 8 because layers 0 are protected "
                        r"\(never compressed\)", method)
    assert budgets and float(budgets[2]) == (8 + int(budgets[1])) / 2 <= mean_held, method  # the budgets, set before the
    # last decode step; the KV cache line is the cache after it (a protected layer keeps every token decoded)


def test_report_says_why_dynamickvs_last_layers_hold_more_than_the_budget(capsys, model, prompt):
    """2 layers, re-allocation every 4 (Alg. 1 line 24): no layer is ever re-budgeted, each keeps
    b_s + w_s = r_max (b - w_s) + w_s = 2 (10 - 2) + 2 = 18 entries of the prompt."""
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "dynamickv", "--budget", 10,
                         "--window", 2, "--r-max", 2, "--max-new-tokens", 1)
    assert code == 0, err
    method = next(line for line in out.splitlines() if line.startswith("method"))
    assert "budget 10 = 18 tokens per layer; a mean above 10 because the last 2 " \
           "layers come after the last re-allocation (every 4 layers, Alg. 1 line 24)" in method


# --- Ctrl-C while the imports run (a child that says when it is importing, then waits) --------------

IMPORTING = """
import runpy, sys, time

class Pause:  # the first import of numpy (torch imports it) tells the parent, then waits for Ctrl-C
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            print("importing", flush=True)
            time.sleep(300)

sys.meta_path.insert(0, Pause())
entry, sys.argv = sys.argv[1], sys.argv[1:]
if entry.endswith(".py"):
    runpy.run_path(entry, run_name="__main__")
else:
    runpy.run_module(entry, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("entry", ["run.py", "kvmini.eval.fidelity", "kvmini.eval.suite", "kvmini.eval.bench_hf",
                                   "kvmini.weights", "kvmini.view", "kvmini.eval.docs"])
def test_ctrl_c_while_importing(entry):
    proc = subprocess.Popen([sys.executable, "-c", IMPORTING, entry, "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, text=True)
    assert proc.stdout.readline() == "importing\n"  # the child is inside an import now, and waits there
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert_one_line(proc.returncode, err, "interrupted (Ctrl-C)", expect_code=130)
    assert out == ""



EARLY = """
import os, runpy, signal, sys

class CtrlC:  # a real SIGINT at the moment module `at` is imported, before run.py's own handler is in place
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)  # delivered now: the default handler raises KeyboardInterrupt here

at, sys.argv = sys.argv[1], sys.argv[2:]
signal.signal(signal.SIGINT, signal.default_int_handler)  # as on a terminal, also when launched with `&` (ignored)
sys.meta_path.insert(0, CtrlC())
runpy.run_path("run.py", run_name="__main__")
"""


@pytest.mark.parametrize("module", ["argparse", "kvmini.cli", "kvmini.errors"])
def test_ctrl_c_in_run_pys_first_imports(module):
    """Ctrl-C before kvmini.cli's handler is installed (in run.py's first imports) is one line and 130 too."""
    proc = subprocess.run([sys.executable, "-c", EARLY, module, "run.py", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert_one_line(proc.returncode, proc.stderr, "interrupted (Ctrl-C)", expect_code=130)
    assert proc.stdout == ""


def test_every_python_file_compiles_without_a_warning():
    """`python -W error -c "import kvmini.methods.registry"` failed on an invalid escape ('\\s' in a
    docstring). Compiled from source (a cached .pyc would hide the warning), no file warns."""
    import warnings

    for path in [ROOT / "run.py", *(p for folder in ("kvmini", "tests", "tutorials") for p in (ROOT / folder).rglob("*.py"))]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(encoding="utf-8"), str(path), "exec")  # a SyntaxError names the file and line

# --- the Python API --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(chat_model_template):  # noqa: F811
    from kvmini.loading import load_model

    return load_model(chat_model_template, "cpu", "float32")


@pytest.mark.parametrize("case,fragment", [
    (dict(ids=torch.zeros(1, 0, dtype=torch.long)), "ids must be a (B, T) tensor with B, T >= 1"),
    (dict(ids=torch.zeros(1, 2, 3, dtype=torch.long)), "ids must be a (B, T) tensor with B, T >= 1"),
    (dict(ids=torch.tensor([[5, 259]])), "ids must be token ids in [0, 258]"),
    (dict(ids=torch.tensor([[5, -1]])), "ids must be token ids in [0, 258]"),
    (dict(ids=torch.tensor([[0.5, 1.0]])), "ids must hold integer token ids"),
    (dict(ids=[[1, 2], [3]]), "ids must be a (B, T) tensor of token ids or a list of equal-length lists"),
    (dict(chunk_size=-1), "chunk_size must be None or a whole number >= 1, got -1"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a whole number >= 0, got -3"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a whole number >= 0"),
])
def test_generate_names_the_bad_argument(tiny, case, fragment):
    from kvmini.generate import generate

    args = {"ids": torch.tensor([[1, 2, 3]]), "max_new_tokens": 2, **case}
    with pytest.raises(KvminiError) as e:
        generate(tiny, args.pop("ids"), args.pop("max_new_tokens"), **args)
    assert fragment in str(e.value)


def test_generate_takes_lists_of_equal_rows(tiny):
    from kvmini.generate import generate

    assert generate(tiny, [[1, 2, 3]], 2).tokens == generate(tiny, torch.tensor([[1, 2, 3]]), 2).tokens


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(top_k=-1), "top_k must be a whole number >= 0"),
    (dict(top_p=0.0), "top_p must be a number in (0, 1]"),
    (dict(top_p=math.inf), "top_p must be a number in (0, 1]"),
    (dict(seed=-1), "seed must be None or a whole number in [0, 2**64 - 1]"),
    (dict(seed=1.5), "seed must be None or a whole number"),
    (dict(vocab=0), "vocab must be None or a whole number >= 1"),
])
def test_sampling_names_the_bad_argument(kwargs, fragment):
    from kvmini.generate import Sampling

    with pytest.raises(KvminiError) as e:
        Sampling(**kwargs)
    assert fragment in str(e.value)


def layer_of_five(batch=1):
    from kvmini.cache import LayerCache

    lc = LayerCache(batch, 2, 4, torch.float32, "cpu")
    lc.append(torch.randn(batch, 2, 5, 4), torch.randn(batch, 2, 5, 4), torch.arange(5).expand(batch, 5))
    return lc


@pytest.mark.parametrize("slot,fragment", [
    (10, "slot must be in [0, 4]"),
    (-1, "slot must be in [0, 4]"),
    (torch.tensor([[10, 0]]), "slot must be in [0, 4]"),
    (torch.tensor([[1, 2, 3]]), "slot must be a whole number or a long tensor (1, 2)"),
    (torch.tensor([[1.0, 2.0]]), "slot must be a whole number or a long tensor (1, 2)"),
])
def test_evict_one_refuses_a_slot_not_held(slot, fragment):
    lc = layer_of_five()
    before = lc.keys.clone()
    with pytest.raises(KvminiError) as e:
        lc.evict_one(slot)
    assert fragment in str(e.value)
    assert lc.length == 5 and torch.equal(lc.keys, before)


def test_evict_one_of_a_whole_number_evicts_that_slot_in_every_head():
    lc = layer_of_five()
    lc.evict_one(1)  # the last entry (position 4) moves into slot 1
    assert lc.positions[0].tolist() == [[0, 4, 2, 3], [0, 4, 2, 3]]


def test_make_policy_and_fidelity_run_name_the_bad_argument(tiny):
    from kvmini.eval import fidelity
    from kvmini.methods.registry import make_policy

    with pytest.raises(KvminiError, match="unknown method"):
        make_policy(["h2o"])
    ids = torch.randint(0, 256, (1, 12))
    for kwargs, fragment in [(dict(n=0), "n (the prompt's tokens) must be a whole number in [1, 11]"),
                             (dict(n=12), "n (the prompt's tokens) must be a whole number in [1, 11]"),
                             (dict(methods="h2o"), "methods must be a list of method specs"),
                             (dict(budgets=0.2), "budgets must be a list of budgets"),
                             (dict(ids=ids[0]), "ids must be a tensor (1, N + K)")]:
        args = {"ids": ids, "n": 8, "methods": ["h2o"], "budgets": [4], **kwargs}
        with pytest.raises(KvminiError) as e:
            fidelity.run(tiny, args["ids"], args["n"], args["methods"], args["budgets"], log=lambda m: None)
        assert fragment in str(e.value)


def test_streaming_run_names_the_bad_argument(tiny):
    from kvmini.eval import streaming

    ids = torch.randint(0, 256, (1, 20))
    for kwargs, fragment in [(dict(capacities=[10]), "capacities must be whole numbers >= 1"),  # 2 * 10 >= 19
                             (dict(capacities=[0]), "capacities must be whole numbers >= 1"),
                             (dict(capacities=4), "capacities must be a list of whole numbers"),
                             (dict(chunk=0), "chunk must be a whole number >= 1")]:
        args = {"capacities": [4], "chunk": 4, **kwargs}
        with pytest.raises(KvminiError) as e:
            streaming.run(tiny, ids, args["capacities"], ["h2o"], chunk=args["chunk"], log=lambda m: None)
        assert fragment in str(e.value)
