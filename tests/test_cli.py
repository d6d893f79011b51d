"""run.py: the happy path, and one-line errors with exit code 2. Most run through the real entry point in a
child process; the refusals of options, many and alike, call `run.main(argv)` in this process (the same
error boundary, `kvmini.cli.run`)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmini.budget import resolve_budget
from kvmini.methods.registry import DEFAULT_BUDGET, METHODS, schedule
from tiny import least_budget

ROOT = Path(__file__).resolve().parent.parent


def run(*args, timeout=300):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(code, err, fragment):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert fragment in lines[0], lines[0]


@pytest.fixture
def prompt(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("What is the capital of France?")
    return p


@pytest.mark.slow
def test_generates_and_reports(default_model_dir, prompt):
    code, out, err = run("--prompt", prompt, "--max-new-tokens", 12)
    assert code == 0, err
    assert "Paris" in out
    for field in ("model", "prefill", "tokens/s", "decode", "KV cache"):
        assert field in out


def test_help_shows_examples_methods_and_their_options():
    code, out, _ = run("--help")
    assert code == 0 and "examples:" in out and "--method" in out
    for name in ("full", "streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "weightedkv", "dbudgetkv", "d2o",
                 "dynamickv"):
        assert f"\n  {name} " in out
    assert "--window [32], --kernel [7], --pooling [avg], --reduce [mean], --pyramid-beta [20]" in out


@pytest.mark.slow
def test_compressed_run_reports_what_was_kept(default_model_dir, tmp_path, real_text):
    doc = tmp_path / "doc.txt"
    doc.write_text(real_text[:2000] + "\nSummarize the text above.")
    code, out, err = run("--prompt", doc, "--method", "pyramidkv", "--budget", "64", "--max-new-tokens", 5)
    assert code == 0, err
    report = out.split("--- kvmini report ---")[1]
    assert "pyramidkv, budget 64 = " in report and "window 32, kernel 7" in report
    assert report.count("kept      layers ") == 3  # 30 layers, 10 bars per line
    for field in ("MiB kept vs", "ratio 0.", "evicted   "):
        assert field in report
    sample = (ROOT / "docs" / "usage.md").read_text().split("--- kvmini report ---\n")[1].split("```")[0]
    labels = lambda text: [line[:10].strip() for line in text.strip().splitlines()]  # noqa: E731
    assert labels(report) == labels(sample)  # docs/usage.md's sample has the report's lines, in order


@pytest.mark.slow
def test_the_report_sample_of_usage_md_is_what_run_py_prints(default_model_dir, tmp_path, real_text):
    """docs/usage.md's sample, line by line, times aside: pyramidkv's budgets and every count and size
    of the report follow from the prompt's length alone, so any raw prompt of that length gives them."""
    from kvmini.tokenizer import load_tokenizer

    sample = (ROOT / "docs" / "usage.md").read_text().split("--- kvmini report ---\n")[1].split("```")[0]
    n = int(re.search(r"^prompt +(\d+) tokens", sample, re.M).group(1))
    method = re.search(r"^method +(\w+), budget (\d+) ", sample, re.M)
    new = int(re.search(r"^decode +(\d+) new tokens", sample, re.M).group(1))
    tok = load_tokenizer(default_model_dir)
    text = tok.decode(tok.encode(real_text)[:n])
    while len(tok.encode(text)) > n:  # decoding and encoding again can join two tokens or split one
        text = text[:-1]
    assert len(tok.encode(text)) == n
    (tmp_path / "p.txt").write_text(text)
    code, out, err = run("--prompt", tmp_path / "p.txt", "--raw", "--method", method.group(1), "--budget",
                         method.group(2), "--max-new-tokens", new)
    assert code == 0, err
    timeless = lambda text: [line[:10] if line.startswith("prefill") else line.split(",")[0]  # noqa: E731
                             if line.startswith("decode") else line for line in text.strip().splitlines()]
    assert timeless(out.split("--- kvmini report ---\n")[1]) == timeless(sample)


@pytest.mark.slow
def test_budget_too_small_for_the_window(default_model_dir, prompt):
    assert_one_line_error(*run("--prompt", prompt, "--method", "snapkv", "--budget", "16")[::2],
                          "too small for 0 sinks and a window of 32 tokens")


@pytest.mark.parametrize("setup,fragment", [
    (lambda p: p.unlink(), "prompt file not found"),
    (lambda p: p.write_text("  \n"), "is empty"),
    (lambda p: p.write_bytes(b"caf\xe9 latin-1"), "not UTF-8"),
])
def test_bad_prompt_files(prompt, setup, fragment):
    setup(prompt)
    assert_one_line_error(*run("--prompt", prompt)[::2], fragment)


@pytest.mark.slow
def test_prompt_longer_than_context(default_model_dir, tmp_path, real_text):
    long = tmp_path / "long.txt"
    long.write_text(real_text[:200_000])
    assert_one_line_error(*run("--prompt", long)[::2], "exceeds the model's context of 8192")


@pytest.mark.parametrize("args,fragment", [
    (["--method", "nope"], "invalid choice: 'nope'"),
    (["--max-new-tokens", "0"], "must be >= 1"),
    (["--max-new-tokens", "many"], "must be a whole number, got 'many'"),
    (["--temperature", "-1"], "must be >= 0"),
    (["--top-p", "1.5"], "must be in (0, 1]"),
    (["--top-k", "-3"], "must be >= 0"),
    (["--dtype", "float8"], "unknown dtype"),
    (["--budget", "x"], "must be a finite number, got 'x'"),
    (["--budget", "0.5"], "--budget does not apply to method full"),
    (["--method", "tova", "--budget", "0"], "--budget must be a finite number > 0"),
    (["--method", "tova", "--budget", "12.5"], "must be a whole number"),
    (["--method", "h2o", "--kernel", "3"], "--kernel does not apply to method h2o"),
    (["--method", "snapkv", "--kernel", "4"], "--kernel must be odd"),
    (["--method", "h2o", "--reduce", "median"], "argument --reduce: must be mean, max or sum"),
    (["--method", "streaming_llm", "--sinks", "-1"], "--sinks must be >= 0, got -1"),
    (["--method", "dbudgetkv", "--budget", "0.3"], "--budget does not apply to method dbudgetkv"),
    (["--method", "dbudgetkv", "--protected-layers", "0,x"], "argument --protected-layers: must be layer numbers separated by commas"),
    (["--method", "d2o", "--nm", "3-1"], "argument --nm: must look like N:M"),
    (["--method", "d2o", "--allocation", "random"], "argument --allocation: must be official, paper, zscore, reciprocal or uniform"),
    (["--method", "d2o", "--beta", "1.5"], "--beta must be in [0, 1]"),
    (["--top-k", "5"], "--top-k sets sampling, and --temperature 0 (the default) decodes greedily"),
    (["--seed", "3", "--temperature", "0"], "--seed sets sampling"),
    (["--method", "d2o", "--merge", "off", "--beta", "0.3"], "--beta does nothing with --merge off"),
    (["--method", "d2o", "--softmax-temperature", "2"], "does nothing with --allocation official"),
    (["--method", "d2o", "--nm", "0:1"], "no budget can work with these options"),
])
def test_bad_options(prompt, tiny_llama, args, fragment, capsys):
    import run

    code = run.main([str(a) for a in ("--prompt", prompt, "--model", tiny_llama, *args)])
    assert_one_line_error(code, capsys.readouterr().err, fragment)


def test_unsupported_architecture(prompt, tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tiny_llama / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama)[::2], "unsupported architecture")


def test_broken_weights(prompt, tiny_llama):
    (tiny_llama / "model.safetensors").write_bytes(b"\x00" * 100)
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama)[::2], "cannot read")


def test_weights_with_a_wrong_shape(prompt, tiny_llama):
    from safetensors.torch import load_file, save_file

    state = load_file(tiny_llama / "model.safetensors")
    state["model.norm.weight"] = torch.ones(5)
    save_file(state, tiny_llama / "model.safetensors")
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama)[::2], "shape mismatch for 'model.norm.weight'")


def test_missing_tensor_and_missing_folder(prompt, tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(tiny_llama / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tiny_llama / "model.safetensors")
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama)[::2], "missing tensor 'model.layers.1.mlp.up_proj.weight'")
    assert_one_line_error(*run("--prompt", prompt, "--model", tmp_path / "nowhere")[::2], "model folder not found")


def test_pickle_only_checkpoint_is_refused(prompt, tiny_llama):
    (tiny_llama / "model.safetensors").rename(tiny_llama / "pytorch_model.bin")
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama)[::2], "safetensors only")


def test_missing_tokenizer(prompt, tiny_llama):
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama)[::2], "no tokenizer.json or tokenizer.model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present, so it cannot be missing")
def test_cuda_requested_without_gpu(prompt, tiny_llama):
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama, "--device", "cuda")[::2], "no CUDA GPU")


def test_tokenizer_that_does_not_match_the_model(prompt, tiny_llama, default_model_dir):
    shutil.copy(default_model_dir / "tokenizer.json", tiny_llama)  # 49152 ids for a 97-entry embedding
    assert_one_line_error(*run("--prompt", prompt, "--model", tiny_llama, "--raw")[::2], "do not match")


def test_hub_download_failure_is_one_line(tmp_path):
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "kvmini.weights", "--hub", "nobody/nothing", "--dest", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "could not download nobody/nothing")


SHORT_QUESTION = "In two sentences, explain why the sky looks blue during the day but red and orange at sunset."


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))  # every registered method, one added later included
def test_a_short_question_works_with_every_method_default(default_model_dir, tmp_path, capsys, method):
    """51 tokens with the chat template; 20% of that is less than what some methods always keep (SnapKV's
    32-token window), so a ratio budget is raised to the least the method's parts can keep (tests/tiny.py,
    `least_budget`), and the report says so."""
    import run

    p = tmp_path / "question.txt"
    p.write_text(SHORT_QUESTION)
    code = run.main(["--prompt", str(p), "--method", method, "--max-new-tokens", "4", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    n, L = int(re.search(r"prompt\s+(\d+) tokens", out)[1]), int(re.search(r"KV cache\s+(\d+) layers", out)[1])
    b, least = resolve_budget(DEFAULT_BUDGET, n), least_budget(method, {}, L, n) if METHODS[method] else None
    if least is not None and b < least <= n:
        assert f"note      budget raised from {b} to {least} tokens per layer, the least {method} can keep" in out
        if schedule(method) == "prefill":
            assert "appended  each layer's last 3 entries were appended while decoding" in out


def test_a_prompt_shorter_than_the_window_is_not_compressed(tiny_llama):
    from kvmini.generate import generate
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy

    model = load_model(tiny_llama, "cpu", "float32")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    policy = make_policy("snapkv", 0.2)  # a 32-token window for a 5-token prompt
    result = generate(model, ids, 3, policy=policy)
    assert policy.run.note == "not compressed: the 5-token prompt is no longer than what snapkv always keeps"
    assert result.tokens == generate(model, ids, 3).tokens and result.cache.lengths() == [7, 7]
    with pytest.raises(Exception, match="too small for 0 sinks and a window of 32"):  # a token count stays exact
        generate(model, torch.arange(40)[None] % 90, 3, policy=make_policy("snapkv", 16))
