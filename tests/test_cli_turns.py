"""run.py's runs of several prompts over one cache: --chat (turns on stdin) and --context with --question
(kvmini.conversation), on the tiny byte-level chat model of test_hostile_inputs; bad input is one line."""
import io
import json
import re
import subprocess
import sys

import pytest
import torch

from kvmini.chat import load_chat_format
from kvmini.conversation import Session, split_at_context
from kvmini.generate import Sampling, generate
from kvmini.loading import load_model
from kvmini.methods.registry import make_policy
from kvmini.tokenizer import load_tokenizer
from test_hostile_inputs import ROOT, assert_one_line, chat_model_template, cli, model, prompt  # noqa: F401 (fixtures)


def chat_run(capsys, monkeypatch, stdin: str, *argv):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return cli(capsys, "--chat", *argv)


def test_a_chat_continues_one_cache_turn_by_turn(capsys, monkeypatch, model):
    code, out, err = chat_run(capsys, monkeypatch, "Hello there\n\nHow are you?\n", "--model", model, "--method",
                              "snapkv", "--budget", 40, "--window", 4, "--max-new-tokens", 5)
    assert code == 0, err
    assert out.count("turn 1      ") == 2 and out.count("turn 2      ") == 2  # after the answer, and in the report
    assert "turn 3" not in out  # the blank line is no turn


def test_the_turns_fed_are_the_conversation_the_template_renders(chat_model_template):
    """Every token the cache saw, in order, is the rendering of the whole conversation (each answer as the
    model gave it) — including an answer's last token, which --max-new-tokens cut before it was fed."""
    folder = chat_model_template
    m, tok, chat = load_model(folder, "cpu", "float32"), load_tokenizer(folder), load_chat_format(folder)
    policy = make_policy("full", None)
    ascii_only = Sampling(vocab=128)  # the answers' bytes decode to text that encodes back to them
    answer = lambda ids, cache, p: generate(m, torch.tensor([ids]), 4, ascii_only, policy=p, cache=cache,  # noqa: E731
                                            more_prompts=True)
    turns = Session(m, tok, chat, policy, answer, 4, keep_snapshots=False).chat_turns(["Hi", "More?", "Bye"])
    fed = []
    for t in turns:
        fed += t.ids + t.result.tokens[0][: t.result.decode_steps]
    said = [{"role": "user", "content": s} for s in ("Hi", "More?", "Bye")]
    answers = [{"role": "assistant", "content": tok.decode(t.result.tokens[0])} for t in turns]
    whole = chat.render([said[0], answers[0], said[1], answers[1], said[2]])
    assert fed == tok.encode(whole) + turns[-1].result.tokens[0][: turns[-1].result.decode_steps]
    assert turns[-1].result.cache.seen_tokens == len(fed)


def test_questions_about_one_context_are_answered_from_copies(capsys, model, tmp_path):
    """The second question's answer does not depend on the first: it equals a run that asks it alone."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour lamps were lit one by one while the baker set out the bread.")
    args = ("--model", model, "--method", "h2o", "--budget", 0.5, "--max-new-tokens", 6, "--context", doc)
    code, both, err = cli(capsys, *args, "--question", "Who lit the lamps?", "--question", "What did the baker do?")
    assert code == 0, err
    code, alone, err = cli(capsys, *args, "--question", "What did the baker do?")
    assert code == 0, err
    answer = lambda out, i: out.split(f"question {i}: ")[1].split("\n")[1]  # noqa: E731  the line after the question
    assert answer(both, 2) == answer(alone, 1)
    assert "compressed to" in both and "before any question" in both


def test_the_context_part_and_the_question_part_are_one_rendering():
    class Chat:
        def render(self, messages):
            return "<u>" + messages[0]["content"] + "</u><a>"

    assert split_at_context(Chat(), "ctx", "q?") == ("<u>ctx", "\n\nq?</u><a>")
    assert split_at_context(None, "ctx", "q?") == ("ctx", "\n\nq?\n")


def test_the_page_shows_each_turn(capsys, monkeypatch, model, tmp_path):
    page = tmp_path / "turns.html"
    code, out, err = chat_run(capsys, monkeypatch, "Hi\nAgain\n", "--model", model, "--method", "h2o", "--budget", 20,
                              "--max-new-tokens", 3, "--html", page)
    assert code == 0, err
    data = json.loads(page.read_text().split('id="data">')[1].split("</script>")[0])
    assert [p["name"] for p in data["panels"]] == ["after turn 1", "after turn 2"]
    assert data["panels"][0]["seen"] < data["panels"][1]["seen"]


@pytest.mark.parametrize("mode", ["chat", "context"])
def test_the_page_of_the_full_cache_over_several_prompts(capsys, monkeypatch, model, prompt, tmp_path, mode):
    """The default method (the full cache: no policy, nothing merged) writes its page too."""
    page = tmp_path / "full.html"
    argv = ("--model", model, "--max-new-tokens", 2, "--html", page)
    if mode == "chat":
        code, out, err = chat_run(capsys, monkeypatch, "Hi\nAgain\n", *argv)
    else:
        code, out, err = cli(capsys, *argv, "--context", prompt, "--question", "Why?")
    assert code == 0, err
    data = json.loads(page.read_text().split('id="data">')[1].split("</script>")[0])
    assert len(data["panels"]) == 2 and f"page      {page}" in out


@pytest.mark.parametrize("argv,stdin,fragment", [
    (["--chat"], "", "--chat read no turn"),
    (["--chat"], "\n  \n", "--chat read no turn"),
    (["--chat", "--prompt", "PROMPT"], "hi\n", "--chat reads its turns from stdin; it takes no --prompt or --context"),
    (["--context", "PROMPT"], "", "--context needs at least one --question TEXT"),
    (["--question", "why?"], "", "--question asks about a --context FILE; give one"),
    (["--prompt", "PROMPT", "--context", "PROMPT", "--question", "q"], "", "--prompt and --context are two ways"),
    (["--context", "PROMPT", "--question", " "], "", "--question must not be empty"),
    (["--prompt", ""], "", "argument --prompt: must not be empty (a path)"),
    (["--context", "", "--question", "q"], "", "argument --context: must not be empty (a path)"),
    (["--prompt", "PROMPT", "--html", " "], "", "argument --html: must not be empty (a path)"),
    (["--prompt", "PROMPT", "--model", ""], "", "argument --model: must not be empty (a path)"),
    (["--context", "PROMPT", "--question", "caf\udce9?"], "", "--question is not UTF-8 text"),  # argv b"caf\xe9?"
    (["--context", "MISSING", "--question", "q"], "", "prompt file not found"),
    ([], "", "give the prompt: --prompt FILE, --chat (turns on stdin) or --context FILE --question TEXT"),
])
def test_bad_input_is_one_line(capsys, monkeypatch, model, prompt, tmp_path, argv, stdin, fragment):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    argv = [str(prompt) if a == "PROMPT" else str(tmp_path / "missing.txt") if a == "MISSING" else a for a in argv]
    code, _, err = cli(capsys, *([] if "--model" in argv else ["--model", model]), *argv)  # an option given once
    assert_one_line(code, err, fragment)


def test_stdin_that_is_not_utf8_is_one_line(model):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--chat", "--model", str(model), "--max-new-tokens", "2"],
                          input=b"hi \xff\xfe\n", capture_output=True, timeout=300, cwd=ROOT)
    assert_one_line(proc.returncode, proc.stderr.decode(), "--chat: line 1 of stdin is not UTF-8 text (byte 3)")


def test_a_question_too_long_for_the_context_is_refused_before_the_context_is_read(capsys, monkeypatch, model, tmp_path):
    """Every question is measured against the model's context before the context's prefill starts (a long
    context would otherwise be compressed first, then refused at the question)."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour lamps were lit one by one.")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]

    def no_prefill(*args, **kwargs):
        raise AssertionError("the context was prefilled before the question was refused")
    monkeypatch.setattr("kvmini.conversation.prefill", no_prefill)
    code, _, err = cli(capsys, "--model", model, "--max-new-tokens", 2, "--context", doc,
                       "--question", "Who lit them?", "--question", "why " * context)
    assert_one_line(code, err, "question 2: ")
    assert f"exceeds the model's context of {context} tokens" in err


def test_each_turns_line_says_when_its_budget_was_raised(capsys, monkeypatch, model):
    """A short turn at a ratio budget is raised to the least SnapKV keeps (its window): the turn's own line
    says so, not only the report's note (which describes the last turn)."""
    code, out, err = chat_run(capsys, monkeypatch, "Hi\nAnd then?\n", "--model", model, "--method", "snapkv",
                              "--budget", 0.2, "--window", 8, "--max-new-tokens", 2)
    assert code == 0, err
    turn_lines = [line for line in out.splitlines() if line.startswith("turn ")]
    assert len(turn_lines) == 2, out
    assert re.search(r"; budget raised from \d+ to 8 tokens per layer, the least snapkv can keep$", turn_lines[0]), out
    assert "budget raised" not in turn_lines[1]  # 0.2 of every token seen by then (54) is 10: it fits
