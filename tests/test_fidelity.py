"""The fidelity tool's metric math, teacher forcing and command line (on tiny random models)."""
import math
import subprocess
import sys

import pytest
import torch

from kvmini.errors import KvminiError
from kvmini.eval.fidelity import compare, continuation_logits, parse_spec, run, table
from kvmini.methods.registry import METHODS, make_policy
from reference import random_model


def test_metrics_worked_by_hand():
    full = torch.tensor([[0.0, 0.0], [0.0, 5.0]])  # p = (1/2, 1/2), then a confident second token
    method = torch.tensor([[math.log(3), 0.0], [0.0, 5.0]])  # q = (3/4, 1/4), then identical
    m = compare(method, full, torch.tensor([0, 1]))
    kl_first = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # = 0.5 ln(4/3)
    assert abs(m["kl"] - kl_first / 2) < 1e-6
    nll = (-math.log(0.75) - math.log(math.exp(5) / (1 + math.exp(5)))) / 2
    assert abs(m["ppl"] - math.exp(nll)) < 1e-5
    assert m["top1"] == 1.0  # argmax of (1/2, 1/2) is the first token, as for (3/4, 1/4)
    assert compare(full, full, torch.tensor([1, 1]))["kl"] == 0.0


def test_teacher_forcing_equals_one_full_forward():
    model = random_model(seed=2)
    ids = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(0))
    logits, kept = continuation_logits(model, ids, 20)
    with torch.no_grad():
        ref = model(ids, all_logits=True)[0, 19:29]  # outputs at positions n-1 .. N+K-2
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert kept == [20, 20, 20]
    stepped, _ = continuation_logits(model, ids, 20, make_policy("h2o", 1000))  # decode-time path, never full
    torch.testing.assert_close(stepped, ref, atol=1e-5, rtol=0)


def test_rows_and_table():
    model = random_model(seed=4)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(1))
    rows = run(model, ids, 32, ["streaming_llm[sinks=2]", "tova"], [0.25, 12], log=lambda m: None)
    assert [(r["method"], r["budget"]) for r in rows] == [("full", None), ("streaming_llm[sinks=2]", 0.25),
                                                          ("streaming_llm[sinks=2]", 12), ("tova", 0.25), ("tova", 12)]
    assert rows[0]["kl"] == 0 and rows[0]["top1"] == 1
    assert rows[1]["kept"] == 8 and rows[3]["kept_share"] == 0.25 and rows[4]["kept"] == 12
    assert all(r["kl"] > 0 for r in rows[1:])
    assert table(rows, 32, 8).count("\n| ") == 6  # header + 5 rows


def test_method_specs():
    assert parse_spec("d2o[allocation=uniform,nm=1:1,beta=0.5]") == (
        "d2o", {"allocation": "uniform", "nm": (1, 1), "beta": 0.5})
    assert parse_spec("h2o") == ("h2o", {})
    # a list: a comma not followed by name= continues it; semicolons separate its items too
    assert parse_spec("d2o[protected_layers=0,1,merge=off]") == ("d2o", {"protected_layers": (0, 1), "merge": "off"})
    assert parse_spec("d2o[merge=off,protected_layers=0;-1]") == ("d2o", {"merge": "off", "protected_layers": (0, -1)})
    assert parse_spec("d2o[protected_layers=]") == ("d2o", {"protected_layers": ()})
    assert parse_spec("dbudgetkv[norm_excludes_kept=yes]") == ("dbudgetkv", {"norm_excludes_kept": True})
    for bad, msg in [("h3o", "unknown method 'h3o'"), ("d2o[beta]", "bad option"), ("d2o[beta=x]", "bad value"),
                     ("d2o[beta=1.5]", "--beta must be in"), ("d2o[protected_layers=0,x]", "bad value '0,x'"),
                     ("h2o[kernel=3]", "bad option 'kernel=3'"), ("d2o[merge=off", "bad spec"),
                     ("d2o[merge=off]x", "bad spec"), ("d2o[[merge=off]]", "bad spec"),
                     ("d2o[beta=0.3,beta=0.4]", "beta is given twice"),
                     ("d2o[merge=off,beta=0.2]", "--beta does nothing with --merge off")]:
        with pytest.raises(KvminiError, match=msg):
            parse_spec(bad)


def test_command_line_error_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "kvmini.eval.fidelity", "--methods", "h2o", "nope"],
                          capture_output=True, text=True, timeout=120)
    names = ", ".join(m for m in METHODS if m != "full")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: unknown method 'nope'; choose from {names}"


@pytest.mark.slow
def test_fidelity_tool_on_the_default_model(default_model_dir):
    proc = subprocess.run([sys.executable, "-m", "kvmini.eval.fidelity", "--n", "300", "--k", "16",
                           "--methods", "snapkv", "tova", "--budgets", "64"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "Fidelity on pydoc text: prompt N=300, teacher-forced continuation K=16"
    full, snapkv, tova = (line.split(" | ") for line in lines[-3:])
    assert full[5] == "0.0000" and full[6] == "1.000 |"
    assert snapkv[:3] == ["| snapkv", "64", "64.0"] and float(snapkv[5]) > 0
    assert "[3/3] tova budget 64" in proc.stderr  # progress on stderr


@pytest.mark.parametrize("argv,line", [
    (["--methods", "h2o", "snapkv", "h2o"],
     "error: the methods name one method twice (h2o, h2o); give each method spec once (each is one row)"),
    (["--methods", "d2o[nm=1:1]", "d2o[nm=1:1]"], "error: the methods name one method twice (d2o[nm=1:1], d2o[nm=1:1])"),
    (["--methods", "adakv", "snapkv", "adakv[alpha=0.2]"],  # by value: 0.2 is adakv's default alpha
     "error: the methods name one method twice (adakv, adakv[alpha=0.2])"),
    (["--methods", "h2o[recent=2]", "h2o[recent=+2]"], "error: the methods name one method twice"),
    (["--budgets", "0.2", "64", "0.20"], "error: the budgets name one budget twice (0.2 64 0.2); give each once"),
    (["--n", "100", "--budgets", "0.2", "128"], "error: budget 128 is more tokens than the 100-token prompt, which it "
                                                "would keep whole; give a budget of at most 100 tokens or a ratio in (0, 1]"),
    (["--json", ""], "error: argument --json: must not be empty (a path)"),
    (["--model", ""], "error: argument --model: must not be empty (a path)"),
])
def test_lists_and_paths_that_cannot_make_a_table_are_one_line(capsys, argv, line):
    """Refused before the model loads (no model folder is needed to see it): a method or budget named
    twice (computed twice, two rows alike), a token budget over the prompt (a kept share above 100%)."""
    from kvmini.eval.fidelity import main

    code = main(argv + (["--model", "/nonexistent"] if "--model" not in argv else []))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(line), err
