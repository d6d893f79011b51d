"""run.py --compare (kvmini.compare): where two answers part, by hand; the printed KL and top-1 equal the
fidelity tool's on the same prompt and continuation; a budget that keeps everything changes nothing; the
page marks where the answers part; every refusal is one line."""
import json
import re

import pytest
import torch

from kvmini.chat import load_chat_format, stop_token_ids
from kvmini.compare import parts_at
from kvmini.eval.fidelity import run as fidelity_run
from kvmini.generate import generate
from kvmini.view import write_comparison
from test_cli import assert_one_line_error, run
from test_view import Words, dom, needs_browser, panels, runs  # noqa: F401 (runs: the fixture)


@pytest.mark.parametrize("full, method, expected", [
    ([5, 6, 7], [5, 6, 9], 2),  # the third token differs
    ([5, 6, 7], [8, 6, 7], 0),  # the first
    ([5, 6], [5, 6, 7], 2),  # the full cache's answer ended first
    ([5, 6, 7], [5], 1),  # the method's did
    ([], [4], 0),
    ([5, 6], [5, 6], None),  # the same answer
    ([], [], None),
])
def test_where_two_answers_part(full, method, expected):
    assert parts_at(full, method) == expected


def block(out: str) -> dict:
    """The numbers of a printed comparison block."""
    m = re.search(r"answers agree for (\d+) of (\d+) tokens · KL ([\d.]+) nats/token · top-1 (\d+)%", out)
    kept = re.search(r"kept ([\d.]+)% of K/V bytes", out)
    assert m and kept, out
    return {"agree": int(m[1]), "of": int(m[2]), "kl": float(m[3]), "top1": int(m[4]) / 100,
            "kept": float(kept[1]) / 100}


@pytest.mark.slow
def test_the_comparison_is_the_fidelity_tools_on_the_full_answer(default_model_dir, default_model, default_tokenizer,
                                                                  tmp_path):
    text = "The lighthouse was built of grey granite in 1871 by Thomas Avery. " * 6 + "\nWho built the lighthouse?"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    code, out, err = run("--prompt", prompt, "--method", "h2o", "--budget", 0.3, "--max-new-tokens", 16, "--compare",
                         "--quiet")
    assert code == 0, err
    shown = block(out)
    chat = load_chat_format(default_model_dir)  # the same prompt and the full cache's answer, made here
    ids = default_tokenizer.encode(chat.render([{"role": "user", "content": text}]))
    stop = stop_token_ids(default_model.config.eos_token_ids, default_tokenizer, chat)
    full = generate(default_model, torch.tensor([ids]), 16, stop_ids=stop).tokens[0]
    rows = fidelity_run(default_model, torch.tensor([ids + full]), len(ids), ["h2o"], [0.3], log=lambda m: None)
    assert shown["of"] == len(full)
    assert shown["kl"] == pytest.approx(rows[1]["kl"], abs=1e-3)  # printed to 3 decimals
    assert shown["top1"] == pytest.approx(rows[1]["top1"], abs=0.006)  # printed in whole percent
    assert f"--- the full cache, on the same prompt ---\n{default_tokenizer.decode(full)}" in out
    assert 0.2 < shown["kept"] < 0.5


@pytest.mark.slow
def test_a_budget_that_keeps_everything_changes_nothing_per_question(default_model_dir, tmp_path):
    context = tmp_path / "doc.txt"
    context.write_text("The lighthouse was built of grey granite in 1871 by Thomas Avery.")
    code, out, err = run("--context", context, "--question", "Who built it?", "--question", "When?", "--method", "h2o",
                         "--budget", 1000, "--max-new-tokens", 8, "--compare", "--quiet")
    assert code == 0, err
    assert out.count("nowhere: the answers are the same") == 2, out
    for shown in map(block, out.split("--- question ")[1:]):  # the two comparisons, after the answers
        assert shown["kl"] == 0 and shown["top1"] == 1 and shown["kept"] == 1 and shown["agree"] == shown["of"]


@pytest.mark.slow
def test_the_page_shows_both_answers_and_where_they_part(default_model_dir, tmp_path):
    prompt, page = tmp_path / "prompt.txt", tmp_path / "kept.html"
    prompt.write_text("Name three colours of the rainbow, then three animals.")
    code, out, err = run("--prompt", prompt, "--method", "streaming_llm", "--budget", 6, "--max-new-tokens", 12,
                         "--compare", "--html", page, "--quiet")
    assert code == 0, err
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page.read_text(), re.S)[1])
    full, method = data["panels"]
    assert (full["name"], method["name"]) == ("full", "streaming_llm")
    agree = block(out)["agree"]
    parted = agree if agree < block(out)["of"] else None
    assert full["parts"] == method["parts"] == parted
    if parted is not None:
        assert full["generated"][:parted] == method["generated"][:parted]
        if parted < min(len(full["generated"]), len(method["generated"])):  # (the page shows what the caches saw)
            assert full["generated"][parted] != method["generated"][parted]


@pytest.mark.parametrize("args, fragment", [
    (["--chat"], "--compare takes --prompt or --context/--question"),
    (["--prompt", "p.txt", "--method", "full"], "give a --method other than full"),
    (["--prompt", "p.txt", "--method", "h2o", "--temperature", "0.7"], "needs --seed N"),
])
def test_compare_refusals_are_one_line(args, fragment):
    code, _, err = run(*args, "--compare")
    assert_one_line_error(code, err, fragment)


@needs_browser
def test_the_parted_tokens_are_marked_in_a_browser(runs, tmp_path):
    """Tokens from where the answers part carry the `part` mark, in each panel that has a part point, and no
    other token does (three runs of test_view's tiny page: parts at generated token 2, none, 0)."""
    prompt, out, _ = runs
    page = write_comparison(tmp_path / "kept.html", list(out.values()), Words(), prompt, parts=[2, None, 0])
    shown = panels(dom(page, ""))
    for (name, run_), at in zip(out.items(), [2, None, 0]):
        classes = shown[name][0]
        marked = [p for p, c in enumerate(classes) if " part" in c]
        assert marked == ([] if at is None else list(range(len(prompt) + at, run_[0].seen_tokens)))
