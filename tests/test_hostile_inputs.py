"""run.py against a hostile user: every bad input is one line on stderr and exit code 2 (Ctrl-C: 130),
never a traceback and never a silently wrong answer; the legitimate edge cases give a correct,
truthfully reported result.

Most cases call run.py's real entry point `run.main(argv)` in this process (fast); the cases that
need the operating system (unreadable files, closed or full output, signals, the terminal's
encoding) start `python run.py` as a child process. The model is a tiny random Llama with a
byte-level tokenizer written here (256 byte tokens + 3 ChatML specials), so nothing is downloaded.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run
from hf_tiny import make_tiny
from kvmini.tokenizer import bytes_to_unicode

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # ids 256, 257, 258
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def chat_model_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_model")
    make_tiny("llama", folder, vocab_size=259)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(bos_token_id=258, eos_token_id=257)
    (folder / "config.json").write_text(json.dumps(cfg))
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    added = [{"id": 256 + i, "content": s, "special": True} for i, s in enumerate(SPECIALS)]
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": added,
                 "pre_tokenizer": {"type": "ByteLevel", "use_regex": True}, "normalizer": None}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return folder


@pytest.fixture
def model(chat_model_template, tmp_path):
    """A fresh copy per test, free to be broken."""
    return Path(shutil.copytree(chat_model_template, tmp_path / "model"))


@pytest.fixture
def prompt(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("The quick brown fox jumps over the lazy dog.")
    return p


def cli(capsys, *argv):
    """run.main in this process -> (exit code, stdout, stderr)."""
    code = run.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def child(*argv, env=None, **kwargs):
    """python run.py in a child process -> (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=dict(os.environ, **(env or {})), **kwargs)
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line(code, err, fragment, expect_code=2):
    lines = err.strip().splitlines()
    assert code == expect_code, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert fragment in lines[0], lines[0]


def edit_json(path: Path, change):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


# --- numbers and devices ------------------------------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["--method", "h2o", "--budget", "inf"], "must be a finite number"),
    (["--method", "h2o", "--budget", "1e400"], "must be a finite number"),
    (["--method", "h2o", "--budget", "nan"], "must be a finite number"),
    (["--method", "dynamickv", "--r-max", "inf"], "must be a finite number"),
    (["--temperature", "nan"], "must be a finite number"),
    (["--top-p", "١.٥"], "must be a finite number"),
    (["--seed", "1" + "0" * 30], "must be in [0, 18446744073709551615]"),
    (["--seed", "-1"], "must be in [0, "),
    (["--max-new-tokens", "٣"], "must be a whole number"),
    (["--max-new-tokens", "1e3"], "must be a whole number"),
    (["--top-k", "²"], "must be a whole number"),
    (["--method", "d2o", "--nm", "²:1"], "must look like N:M"),
    (["--method", "dbudgetkv", "--protected-layers", "¹"], "must be layer numbers"),
    (["--method", "snapkv", "--window", "³"], "must be a whole number"),
    (["--device", "meta"], "unsupported device 'meta'"),
    (["--device", "mps"], "unsupported device 'mps'"),
    (["--device", "xpu"], "unsupported device 'xpu'"),
    (["--device", "cuda:x"], "unsupported device 'cuda:x'"),
])
def test_numbers_and_devices(capsys, model, prompt, args, fragment):
    code, _, err = cli(capsys, "--prompt", prompt, "--model", model, *args)
    assert_one_line(code, err, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_absent_gpu_by_index(capsys, model, prompt):
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model, "--device", "cuda:1")[::2], "no CUDA GPU")


# --- files that parse but have the wrong shape ------------------------------------------------------

def replace_with_dir(path: Path):
    path.unlink()
    path.mkdir()


CONFIG_CASES = {
    "list": (lambda d: [d], "must hold a JSON object, not a list"),
    "string hidden_size": (lambda d: {**d, "hidden_size": "48"}, 'hidden_size must be a positive integer, got "48"'),
    "zero heads": (lambda d: {**d, "num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    "null max_position": (lambda d: {**d, "max_position_embeddings": None}, "max_position_embeddings must not be null"),
    "rope_scaling string": (lambda d: {**d, "rope_scaling": "linear"}, 'rope_scaling must be an object (or null), got "linear"'),
    "bool vocab": (lambda d: {**d, "vocab_size": True}, "vocab_size must be a positive integer, got true"),
    "float layers": (lambda d: {**d, "num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer, got 2.0"),
    "more layers than the weights": (lambda d: {**d, "num_hidden_layers": 10**7},  # refused before the model is built
                                     "config.json has num_hidden_layers 10000000 but the weights in"),
    "inf eps": (lambda d: {**d, "rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
    "eos a string": (lambda d: {**d, "eos_token_id": "</s>"}, "eos_token_id must be token ids"),
    "no heads": (lambda d: {k: v for k, v in d.items() if k != "num_attention_heads"},
                 "lacks the field 'num_attention_heads'"),
    "hidden not divisible": (lambda d: {**d, "hidden_size": 50, "head_dim": None}, "hidden_size=50 is not a multiple"),
    "model_type a list": (lambda d: {**d, "model_type": ["llama"]}, "unsupported architecture: model_type=['llama']"),
    "layer_types too short": (lambda d: {**d, "model_type": "mistral", "sliding_window": 4, "layer_types": ["full"]},
                              "layer_types must list one attention type per layer (2)"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_json_of_the_wrong_shape(capsys, model, prompt, case):
    change, fragment = CONFIG_CASES[case]
    edit_json(model / "config.json", change)
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], fragment)


def test_config_json_that_is_a_directory(capsys, model, prompt):
    replace_with_dir(model / "config.json")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], "config.json is not a file")


TOKENIZER_CASES = {
    "a list": (lambda d: [d], "needs an object \"model\" with an object \"vocab\""),
    "no vocab": (lambda d: {**d, "model": {"type": "BPE", "merges": []}}, "with an object \"vocab\""),
    "char outside the byte alphabet": (lambda d: {**d, "model": {**d["model"], "vocab": {**d["model"]["vocab"], "中": 300}}},
                                       "'中' (id 300) is not written in the byte-level alphabet"),
    "added token without content": (lambda d: {**d, "added_tokens": [{"id": 256}]},
                                    "every added_tokens entry needs a non-empty string content and an id"),
    "added token with empty content": (lambda d: {**d, "added_tokens": [{"id": 256, "content": ""}]},
                                       "every added_tokens entry needs a non-empty string content and an id"),
    "added token id past 32 bits": (lambda d: {**d, "added_tokens": [{"id": 10**12, "content": "<x>"}]},
                                    "every added_tokens entry needs a non-empty string content and an id"),
    "empty split pattern": (lambda d: {**d, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": ""}}, {"type": "ByteLevel", "use_regex": False}]}},
                            "the pre_tokenizer's Split pattern must be a non-empty regex"),
    "split pattern with empty pieces": (lambda d: {**d, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "a*"}}, {"type": "ByteLevel", "use_regex": False}]}},
                                        "matches an empty piece"),
    "split pattern that drops text": (lambda d: {**d, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?<=a+)b"}}, {"type": "ByteLevel", "use_regex": False}]}},
                                      "leaves some characters out of every piece"),
    "string id": (lambda d: {**d, "model": {**d["model"], "vocab": {**d["model"]["vocab"], "Ā": "0"}}},
                  "vocab must map each token to its own id"),
    "pre_tokenizer a list": (lambda d: {**d, "pre_tokenizer": ["ByteLevel"]}, "unexpected structure"),
    "normalizer a string": (lambda d: {**d, "normalizer": "NFC"}, "unexpected structure"),
    "merges of numbers": (lambda d: {**d, "model": {**d["model"], "merges": [1, 2]}}, "merges must be"),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_tokenizer_json_of_the_wrong_shape(capsys, model, prompt, case):
    change, fragment = TOKENIZER_CASES[case]
    edit_json(model / "tokenizer.json", change)
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], fragment)


@pytest.mark.parametrize("content,fragment", [
    (b"garbage" * 20, "cannot read sentencepiece model"),
    (b"QUJD notanumber\n", "cannot read sentencepiece model"),  # not tiktoken's shape: read as sentencepiece
    (b"QUJD 0\n!!!! 1\n", "broken tiktoken file"),
])
def test_malformed_tokenizer_model(capsys, model, prompt, content, fragment):
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.model").write_bytes(content)
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], fragment)


@pytest.mark.parametrize("name,content,fragment", [
    ("tokenizer_config.json", b"{not json", "broken tokenizer_config.json"),
    ("tokenizer_config.json", b"[1, 2]", "it must hold a JSON object"),
    ("tokenizer_config.json", b'{"chat_template": 7}', "chat_template must be a string or a list"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "tool_use", "template": "x"}]}', "none named 'default'"),
    ("chat_template.jinja", b"<|im_start|>\xff\xfe", "chat_template.jinja is not UTF-8 text"),
])
def test_broken_settings_files(capsys, model, prompt, name, content, fragment):
    (model / name).write_bytes(content)
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], fragment)


def test_weights_that_link_to_nothing_and_a_model_that_is_a_file(capsys, model, prompt):
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(model / "gone.safetensors")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], "model.safetensors is a link to nothing")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", prompt)[::2], "is a file, not a checkpoint folder")


def test_weights_file_that_is_a_directory(capsys, model, prompt):
    replace_with_dir(model / "model.safetensors")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], "model.safetensors is not a file")


def test_broken_shard_index(capsys, model, prompt):
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], "broken shard index")


def test_integer_weights_are_refused(capsys, model, prompt):
    from safetensors.torch import load_file, save_file

    state = load_file(model / "model.safetensors")
    state["model.norm.weight"] = torch.ones(48, dtype=torch.int64)
    save_file(state, model / "model.safetensors")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2],
                    "tensor 'model.norm.weight' in model.safetensors has dtype int64")


def test_nan_logits_are_detected(capsys, model, prompt):
    from safetensors.torch import load_file, save_file

    state = load_file(model / "model.safetensors")
    state["model.norm.weight"] = torch.full((48,), float("nan"))
    save_file(state, model / "model.safetensors")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2],
                    "non-finite logits (NaN or inf) at the prompt")


def test_prompt_of_zero_tokens(capsys, model, tmp_path):
    edit_json(model / "tokenizer.json", lambda d: {**d, "model": {**d["model"], "vocab": {
        c: i for c, i in d["model"]["vocab"].items() if i < 128}}})  # ASCII bytes only
    p = tmp_path / "accents.txt"
    p.write_text("éèê")
    assert_one_line(*cli(capsys, "--prompt", p, "--model", model, "--raw")[::2], "encodes to zero tokens")


def test_prompt_that_is_a_directory(capsys, model, tmp_path):
    assert_one_line(*cli(capsys, "--prompt", tmp_path, "--model", model)[::2], "is a directory")


@pytest.mark.parametrize("where,fragment", [("missing/kept.html", "does not exist"), (".", "is a folder, not a file"),
                                            ("locked/kept.html", "cannot be written")])
def test_html_page_that_cannot_be_written(capsys, prompt, tmp_path, where, fragment):
    """Refused before any work: the model folder given does not even exist, and the error is about --html."""
    if where.startswith("locked"):
        if os.geteuid() == 0:
            pytest.skip("root may write into a read-only folder")
        (tmp_path / "locked").mkdir(mode=0o500)
    code, _, err = cli(capsys, "--prompt", prompt, "--model", tmp_path / "no-model", "--html", tmp_path / where)
    assert_one_line(code, err, fragment)
    assert not (tmp_path / "missing").exists()


def test_html_page_is_written(capsys, model, prompt, tmp_path):
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "h2o", "--budget", 16,
                         "--max-new-tokens", 3, "--html", tmp_path / "kept.html")
    assert code == 0, err
    assert f"page      {tmp_path / 'kept.html'}" in out
    assert 'id="data">{"tokens"' in (tmp_path / "kept.html").read_text()


def test_comparison_page_of_several_methods(capsys, model, prompt, tmp_path):
    from kvmini import view

    out = tmp_path / "compare.html"
    code = view.main(["--methods", "h2o", "d2o[variant=paper]", "--prompt", str(prompt), "--out", str(out),
                      "--model", str(model), "--budget", "16", "--max-new-tokens", "3"])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text().split('id="data">')[1].split("</script>")[0])
    assert [p["name"] for p in data["panels"]] == ["h2o", "d2o[variant=paper]"] and data["panels"][1]["merged"]


@pytest.mark.parametrize("args,fragment", [(["--methods", "h2o", "nope"], "unknown method 'nope'"),
                                           (["--methods", "h2o", "--out", "missing/x.html"], "does not exist"),
                                           (["--methods", "h2o", "--out", ""], "argument --out: must not be empty"),
                                           (["--methods", "h2o", "--model", ""], "argument --model: must not be empty"),
                                           (["--methods", "h2o", "snapkv", "h2o"], "--methods names one method twice (h2o, h2o)")])
def test_comparison_page_refuses_bad_input_before_any_work(capsys, prompt, tmp_path, args, fragment):
    from kvmini import view

    base = {"--prompt": str(prompt), "--model": str(tmp_path / "no-model"), "--out": str(tmp_path / "x.html")}
    argv = [x for flag, value in base.items() if flag not in args for x in (flag, value)] + args  # each flag once
    argv = [str(tmp_path / a) if a.startswith("missing/") else a for a in argv]
    code = view.main(argv)
    assert_one_line(code, capsys.readouterr().err, fragment)


# --- nothing silently wrong ------------------------------------------------------------------------

@pytest.mark.parametrize("method", [("snapkv",), ("pyramidkv",), ("d2o", "--variant", "paper")])  # official: all protected
def test_a_budget_too_small_names_the_least_that_works(capsys, model, prompt, method):
    code, _, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", *method, "--budget", "3")
    assert_one_line(code, err, "the least budget that works on this ")
    least = int(re.search(r"is (\d+) tokens per layer$", err.strip()).group(1))
    if method[0] == "snapkv":
        assert least == 32  # no sinks, a 32-token window: the window alone
    if method[0] == "d2o":
        assert least == 5  # Eq. 8 with 4 sinks and N:M = 3:1: more than the sinks, and (5 - 4) // 4 = 0 recent
    if method[0] == "pyramidkv":
        assert "(layer 0, from a mean budget of 3 tokens)" in err  # its schedule gives layer 0 less than the mean
    fails, _, _ = cli(capsys, "--prompt", prompt, "--model", model, "--method", *method, "--budget", str(least - 1),
                      "--max-new-tokens", "2")
    works, _, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", *method, "--budget", str(least),
                        "--max-new-tokens", "2")
    assert (fails, works) == (2, 0), err


def test_protected_layer_that_does_not_exist(capsys, model, prompt):
    code, _, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "dbudgetkv", "--protected-layers", "0,5")
    assert_one_line(code, err, "protected layers [0, 5] do not all exist; this model has layers 0 to 1")


def test_chat_template_list_uses_the_default_one(capsys, model, prompt):
    templates = [{"name": "tool_use", "template": "[INST]"}, {"name": "default", "template": CHATML}]
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--max-new-tokens", 2)
    assert code == 0, err
    assert "tokens (ChatML format)" in out


def test_tokenizer_smaller_than_the_model_is_reported(capsys, model, prompt):
    edit_json(model / "tokenizer.json", lambda d: {**d, "added_tokens": d["added_tokens"][:2]})  # no id 258
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--max-new-tokens", 3)
    assert code == 0, err
    assert "the model has 259 output ids, the tokenizer 258: the 1 ids without text are never sampled" in out


def test_ids_past_the_tokenizer_are_never_sampled():
    from kvmini.generate import Sampling, sample

    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0]])  # id 3 would win, but the tokenizer has ids 0-2 only
    assert sample(logits, Sampling(vocab=3), None).tolist() == [1]
    probs_of_3 = [sample(logits, Sampling(temperature=1.0, vocab=3), torch.Generator().manual_seed(s)).item()
                  for s in range(50)]
    assert 3 not in probs_of_3


def test_tokenizer_larger_than_the_model_is_refused(capsys, model, prompt):
    edit_json(model / "config.json", lambda d: {**d, "vocab_size": 200})
    from safetensors.torch import load_file, save_file

    state = load_file(model / "model.safetensors")
    state = {k: (v[:200] if k in ("model.embed_tokens.weight", "lm_head.weight") else v) for k, v in state.items()}
    save_file(state, model / "model.safetensors")
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], "do not match")


def test_d2o_budgets_stay_feasible_at_a_tiny_temperature(chat_model_template):
    """A softmax that underflows to a one-hot asked one layer for more than the prompt; now the split
    respects every layer's cap, and the reported budgets are exactly what the cache holds."""
    from kvmini.generate import prefill
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy

    m = load_model(chat_model_template, "cpu", "float32")
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    policy = make_policy("d2o", 0.9, variant="paper", allocation="zscore", softmax_temperature=1e-6)  # 54 per layer
    cache = m.new_cache(1)
    prefill(m, ids, cache, policy)
    assert max(policy.budgets) <= 60 and sum(policy.budgets) == 108
    assert cache.lengths() == policy.budgets


def test_proportional_split_with_weights_that_underflowed():
    from kvmini.methods.allocators import proportional

    # layer 0 would take everything but is capped at 60; layers 1 and 2 (weight 0) share the other
    # 90 equally: 60 + 45 + 45 = 150, all within [10, 60]
    assert proportional([1.0, 0.0, 0.0], 150, 10, [60, 60, 60]) == [60, 45, 45]


def test_h2o_budget_one_below_a_two_token_prompt_keeps_one_token(chat_model_template):
    from kvmini.generate import generate
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy

    m = load_model(chat_model_template, "cpu", "float32")
    ids = torch.tensor([[5, 6]])
    T = ids.shape[1]
    result = generate(m, ids, 4, policy=make_policy("h2o", T - 1))
    assert result.cache.lengths() == [1, 1]


@pytest.mark.parametrize("threshold", ["0.5", "0.99"])
def test_dbudgetkv_sinks_longer_than_the_prompt_keep_everything(capsys, model, prompt, threshold):
    code, out, err = cli(capsys, "--prompt", prompt, "--model", model, "--method", "dbudgetkv", "--sinks", 1000,
                         "--protected-layers", "", "--threshold", threshold, "--max-new-tokens", 1)
    assert code == 0, err
    prompt_tokens = int(out.split("prompt    ")[1].split()[0])
    assert f"self-chosen budget {prompt_tokens} tokens per layer = 100.0% of the prompt" in out


def test_dbudgetkv_never_prunes_a_sink(chat_model_template):
    from kvmini.generate import prefill
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy

    m = load_model(chat_model_template, "cpu", "float32")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = m.new_cache(1)
    prefill(m, ids, cache, make_policy("dbudgetkv", None, threshold=0.999, sinks=12, protected_layers=""))
    for layer in cache.layers:
        assert layer.length >= 12
        assert layer.positions[0, 0, :12].tolist() == list(range(12))


def test_an_unexpected_error_is_still_one_line(capsys, model, prompt, monkeypatch):
    import kvmini.generate

    monkeypatch.setattr(kvmini.generate, "generate", lambda *a, **k: 1 / 0)
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2],
                    "unexpected ZeroDivisionError: division by zero")



@pytest.mark.parametrize("error,fragment", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 2304000000207360 bytes. Error code 12 (Cannot allocate memory)"),
     "out of memory: a tensor of 2,145,767.2 GiB"),  # 2,304,000,000,207,360 / 2**30, by hand
    (MemoryError(), "out of memory (a shorter prompt"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"), "out of memory (a shorter prompt"),
])
def test_an_allocation_that_fails_says_out_of_memory(capsys, model, prompt, monkeypatch, error, fragment):
    import kvmini.generate

    def fail(*args, **kwargs):  # what scissorhands --history 10**11 met: a ring buffer of 24,587 GiB
        raise error
    monkeypatch.setattr(kvmini.generate, "generate", fail)
    assert_one_line(*cli(capsys, "--prompt", prompt, "--model", model)[::2], fragment)


# --- the operating system ------------------------------------------------------------------------

def unprivileged():
    """A prefix that runs a command without the right to read or write other users' files:
    root ignores file permissions, so for root the capabilities that allow it are dropped."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file permissions cannot be tested")
    return [setpriv, "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("target", ["prompt", "config.json", "tokenizer.json", "model.safetensors"])
def test_unreadable_files(model, prompt, target):
    path = prompt if target == "prompt" else model / target
    path.chmod(0)
    proc = subprocess.run([*unprivileged(), sys.executable, str(ROOT / "run.py"), "--prompt", str(prompt),
                           "--model", str(model)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert_one_line(proc.returncode, proc.stderr, f"Permission denied: {path}")


def test_read_only_weights_folder_on_first_use(tmp_path, prompt):
    weights = tmp_path / "weights"
    weights.mkdir()
    weights.chmod(0o555)
    code = ("import sys, pathlib, kvmini.weights as w, run; "
            f"w.DEFAULT_MODEL_DIR = pathlib.Path({str(weights)!r}) / 'SmolLM2-135M-Instruct'; "
            f"sys.exit(run.main(['--prompt', {str(prompt)!r}]))")
    proc = subprocess.run([*unprivileged(), sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert_one_line(proc.returncode, proc.stderr, f"cannot write the default model to {weights}: Permission denied")


def test_full_disk(model, prompt):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--prompt", str(prompt), "--model", str(model),
                               "--max-new-tokens", "2"], stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              timeout=300)
    assert_one_line(proc.returncode, proc.stderr, "cannot write the output: No space left on device")


def test_broken_pipe(model, prompt):
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "--prompt", str(prompt), "--model", str(model),
                             "--max-new-tokens", "40"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # like `| head -c 0`: closed long before the first token (importing torch takes a second)
    err = proc.stderr.read().decode()
    assert_one_line(proc.wait(timeout=300), err, "cannot write the output: Broken pipe")


def test_stdout_closed(model, prompt):
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" run.py --prompt "{prompt}" --model "{model}" >&-'],
                          stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert_one_line(proc.returncode, proc.stderr, "standard output is closed")


def test_chat_with_stdin_closed(model):
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" run.py --chat --model "{model}" <&-'],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert_one_line(proc.returncode, proc.stderr, "--chat reads its turns from stdin, which is closed")


@pytest.mark.parametrize("content,fragment", [
    (b"", "is empty"), (b"  \n\t", "is empty"), (b"caf\xe9", "is not UTF-8 text (byte 3)"),
])
def test_the_comparison_page_reads_the_prompt_as_run_py_does(capsys, model, tmp_path, content, fragment):
    from kvmini import view

    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    code = view.main(["--methods", "h2o", "--prompt", str(bad), "--out", str(tmp_path / "k.html"), "--model", str(model)])
    assert_one_line(code, capsys.readouterr().err, fragment)


def test_a_byte_order_mark_is_not_part_of_the_prompt(tmp_path):
    from kvmini.cli import read_prompt

    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbfHello")
    assert read_prompt(str(p)) == "Hello"


def test_a_rust_panic_is_one_line(capsys):
    """pyo3 turns a Rust library's panic into PanicException, a BaseException: the boundary catches it too."""
    from kvmini import cli as boundary

    class PanicException(BaseException):
        pass

    def work():
        raise PanicException("range end index 2 out of range for slice of length 0")

    assert boundary.run(work) == 2
    assert capsys.readouterr().err == ("error: unexpected PanicException: range end index 2 out of range for slice of "
                                       "length 0 (a case kvmini does not check yet; KVMINI_DEBUG=1 shows where)\n")


def test_ascii_terminal_gets_ascii_bars(model, prompt):
    code, out, err = child("--prompt", prompt, "--model", model, "--method", "h2o", "--budget", 8,
                           "--max-new-tokens", 3, env={"PYTHONIOENCODING": "ascii"})
    assert code == 0 and err == "", err
    assert "(# = 8 tokens;" in out


def test_debug_variable_shows_the_traceback(model, prompt):
    (model / "config.json").write_text("[]")
    code, _, err = child("--prompt", prompt, "--model", model, env={"KVMINI_DEBUG": "1"})
    assert code == 1 and "Traceback" in err and "KvminiError" in err


FIFO_CASES = [  # (where the FIFO goes, the arguments; MODEL / PROMPT / FIFO are filled in)
    ("prompt", ["run.py", "--model", "MODEL", "--prompt", "FIFO"]),
    ("prompt", ["run.py", "--model", "MODEL", "--context", "FIFO", "--question", "why?"]),
    ("output", ["run.py", "--model", "MODEL", "--prompt", "PROMPT", "--html", "FIFO"]),
    ("tokenizer.json", ["run.py", "--model", "MODEL", "--prompt", "PROMPT"]),
    ("tokenizer_config.json", ["run.py", "--model", "MODEL", "--prompt", "PROMPT"]),
    ("chat_template.jinja", ["run.py", "--model", "MODEL", "--prompt", "PROMPT"]),
    ("prompt", ["-m", "kvmini.view", "--model", "MODEL", "--methods", "h2o", "--prompt", "FIFO", "--out", "OUT"]),
    ("output", ["-m", "kvmini.view", "--model", "MODEL", "--methods", "h2o", "--prompt", "PROMPT", "--out", "FIFO"]),
    ("output", ["-m", "kvmini.eval.fidelity", "--model", "MODEL", "--n", 8, "--k", 2, "--methods", "h2o",
                "--budgets", 4, "--json", "FIFO"]),
]


@pytest.mark.parametrize("where,argv", FIFO_CASES)
def test_a_fifo_is_refused_not_waited_on(model, prompt, tmp_path, where, argv):
    """Opening a FIFO nobody writes to (or reads from) waits forever: a prompt, a model file or an output
    that is one is refused at once, in a child process (a hang fails on the time limit, not the session)."""
    fifo = model / where if where not in ("prompt", "output") else tmp_path / f"{where}.fifo"
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    fill = {"MODEL": model, "PROMPT": prompt, "FIFO": fifo, "OUT": tmp_path / "out.html"}
    proc = subprocess.run([sys.executable, *(str(fill.get(a, a)) for a in argv)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert_one_line(proc.returncode, proc.stderr, "is not a regular file")
