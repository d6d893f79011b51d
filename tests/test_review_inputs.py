"""Bad input found by a sweep of every entry point (2026-11-25), one line and exit code 2 each: an
output that would overwrite an input, an option given twice or abbreviated, an empty path, options
the other settings ignore, numbers beyond what torch can size, a dangling output link, duplicates,
and malformed results files."""
import json
import os
import subprocess
import sys

import pytest

from test_entry_points import tool
from test_hostile_inputs import ROOT, assert_one_line, chat_model_template, cli, model, prompt  # noqa: F401


@pytest.mark.parametrize("extra,fragment", [
    (["--method", "h2o", "--method", "snapkv"], "--method is given twice; give it once"),
    (["--budget", "4", "--budget", "0.5", "--method", "h2o"], "--budget is given twice"),
    (["--meth", "h2o"], "unrecognized arguments: --meth h2o"),  # no abbreviations: --meth is not --method
    (["--budget", "1_0", "--method", "h2o"], "argument --budget: must be a finite number, got '1_0'"),
    (["--method", "snapkv", "--kernel", "99999999999"], "must be a whole number of at most 2,147,483,647 in size"),
    (["--method", "cam", "--merge-mask", "always", "--merge-seed", "5"], "--merge-seed does nothing with --merge-mask always"),
    (["--method", "d2o", "--protected-layers", "1,1"], "must name each layer once"),
    (["--method", "d2o", "--protected-layers", "0,,1"], "must be layer numbers separated by commas"),
])
def test_run_py_options(capsys, model, prompt, extra, fragment):
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model, *extra)[::2], fragment)


def test_an_html_page_never_overwrites_what_the_run_reads(capsys, model, prompt):
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model, "--html", prompt)[::2],
                    f"--html {prompt} would overwrite {prompt}, which this run reads")
    inside = model / "config.json"
    before = inside.read_bytes()
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model, "--html", inside)[::2],
                    f"would overwrite a file in {model}")
    assert inside.read_bytes() == before


def test_an_output_that_links_to_nothing_is_refused_and_kept(capsys, model, prompt, tmp_path):
    link = tmp_path / "page.html"
    link.symlink_to(tmp_path / "nowhere")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model, "--html", link)[::2],
                    "is a link to a missing file")
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_kvmini_debug_0_is_off(model, prompt):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--prompt", "missing.txt"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env=dict(os.environ, KVMINI_DEBUG="0"))
    assert_one_line(proc.returncode, proc.stderr, "prompt file not found: missing.txt")


@pytest.mark.parametrize("argv,fragment", [
    (["--methods", "h2o[recent=2]", "h2o[recent=+2]"], "--methods names one method twice (h2o[recent=2], h2o[recent=+2])"),
    (["--methods", "adakv", "adakv[alpha=0.2]"], "--methods names one method twice (adakv, adakv[alpha=0.2])"),  # a default
    (["--methods", "d2o", "d2o[variant=official]"], "--methods names one method twice (d2o, d2o[variant=official])"),
    (["--methods", "h2o", "h2o[evict_every=1]"], "--methods names one method twice (h2o, h2o[evict_every=1])"),
    (["--methods", "full", "--budget", "0.5"], "--budget does not apply to method full"),
    (["--methods", "dbudgetkv", "--budget", "0.5"], "--budget does not apply to method dbudgetkv"),
    (["--methods", "h2o", "--methods", "snapkv"], "--methods is given twice"),
])
def test_view_refuses_before_the_model_loads(capsys, tmp_path, prompt, argv, fragment):
    from kvmini import view

    assert_one_line(*tool(capsys, view.main, *argv, "--prompt", prompt, "--out", tmp_path / "p.html")[::2], fragment)


def test_view_never_overwrites_its_prompt(capsys, prompt):
    from kvmini import view

    before = prompt.read_text()
    assert_one_line(*tool(capsys, view.main, "--methods", "h2o", "--prompt", prompt, "--out", prompt)[::2],
                    "which this run reads")
    assert prompt.read_text() == before


@pytest.mark.parametrize("make_argv,fragment", [
    (lambda d: ["new", ""], "argument dest: must not be empty (a path)"),
    (lambda d: ["check", "x", ""], "argument dir: must not be empty (a path)"),
    (lambda d: ["grade", ""], "argument DIR: must not be empty (a path)"),
    (lambda d: ["grade", d, "--out", ""], "argument --out: must not be empty (a path)"),
    (lambda d: ["grade", d, "-j", "0"], "argument -j/--jobs: must be in [1, 256]"),
    (lambda d: ["check", "x", d, "--timeout", "99999999999999999999"], "argument --timeout: must be in [1, 604800]"),
    (lambda d: ["grade", d, d], "is given twice; grade each copy once"),
])
def test_course_refuses(capsys, tmp_path, make_argv, fragment):
    from kvmini.course.__main__ import main
    from kvmini.course.copies import write_student_copy

    copy = tmp_path / "copy"
    write_student_copy(copy, names=["value_norm"])
    assert_one_line(*tool(capsys, main, *make_argv(copy))[::2], fragment)


def test_other_tools_refuse_empty_paths_and_duplicates(capsys, tmp_path):
    from kvmini import notebooks
    from kvmini.eval import suite

    assert_one_line(*tool(capsys, notebooks.main, "1", "--out", "")[::2], "argument --out: must not be empty (a path)")
    out = tmp_path / "new"
    assert_one_line(*tool(capsys, suite.main, "--only", "speed", "speed", "--out", out)[::2],
                    "--only names speed twice")
    assert_one_line(*tool(capsys, suite.main, "--device", "", "--out", out)[::2], "unsupported device ''")
    assert not out.exists()  # refused before the folder is made


def test_test_run_refuses_what_would_record_nothing_or_overwrite_a_file(capsys, tmp_path):
    from kvmini.eval import test_run

    test = tmp_path / "test_one.py"
    test.write_text("def test_ok():\n    assert True\n")
    assert_one_line(*tool(capsys, test_run.main, "--out", test, "--", test)[::2], "is not a record of this tool's")
    assert test.read_text().startswith("def test_ok")
    out = tmp_path / "run.json"
    for argv in (["--collect-only", test], [test, "-k", "nomatch"], [tmp_path / "missing.py"]):
        assert_one_line(*tool(capsys, test_run.main, "--out", out, "--", *argv)[::2], "no test ran")
    assert not out.exists()


@pytest.mark.parametrize("content,fragment", [
    ("not json", "cannot be read"), ("[1]", "is not a results file (a JSON object)"),
    ("{}", "lacks what its summary needs"),
])
def test_docs_name_a_broken_results_file(capsys, tmp_path, monkeypatch, content, fragment):
    from kvmini.eval import docs
    from test_docs import copy_of_the_documents

    root = copy_of_the_documents(tmp_path)
    (root / "results" / "quick" / "results.json").write_text(content)
    monkeypatch.setattr(docs, "ROOT", root)
    assert_one_line(*tool(capsys, docs.main, "--check")[::2], fragment)


def test_chat_drops_a_byte_order_mark_as_prompt_files_do(monkeypatch):
    import io

    import run

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeffHi\n\ufeffthere\n".encode())))
    assert list(run.stdin_lines()) == ["Hi\n", "\ufeffthere\n"]  # only the stream's first bytes are a BOM


@pytest.mark.parametrize("argv,fragment", [
    (["--n", "abc", "--peak", "h2o"], "argument --n: must be a whole number, got 'abc'"),
    (["--n", "0", "--step", "h2o"], "argument --n: must be >= 1, got 0"),
    (["--n", "64", "--step", "h2o", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--n", "64"], "one of the arguments --peak --first-step --step --ops is required"),
    (["--n", "64", "--peak", "h2o", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "one of the arguments --peak --first-step --step --ops is required"),
    (["--peak", "h2o"], "the following arguments are required: --n"),
    (["--ops", "h2o", "nosuch"], "--ops: unknown method 'nosuch'"),
])
def test_the_speed_tool_refuses_its_usage_errors_in_one_line(capsys, argv, fragment):
    """`python -m kvmini.eval.speed` with a bad command line: one line, exit 2, before any work (issue 71)."""
    from kvmini.eval import speed

    with pytest.raises(SystemExit) as e:
        speed.main(argv)
    assert_one_line(e.value.code, capsys.readouterr().err, fragment)
