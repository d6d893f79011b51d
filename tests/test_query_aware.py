"""The query-aware experiment (kvmini/eval/query_aware.py): both conditions feed the same ids, the
"after" condition compresses the context before the question exists, and the metrics by hand."""
import pytest
import torch

from kvmini.eval import query_aware
from kvmini.eval.passkey import QUESTION
from kvmini.methods.registry import make_policy
from reference import random_model


class CharTokenizer:
    """One id per character (vocabulary 61: ids collide, lengths and cuts do not)."""

    def encode(self, text, bos=None):
        return [ord(c) % 61 for c in text]

    def decode(self, ids):
        return "".join(chr(48 + i % 10) for i in ids)


class Chat:
    def render(self, messages):
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_the_prompt_is_cut_at_the_end_of_the_context():
    tok = CharTokenizer()
    ctx, q = query_aware.split_prompt(tok, Chat(), 700, 0.5, 12345)
    rest = "\n\n" + QUESTION + "</user><assistant>The passkey is"
    assert q == tok.encode(rest)  # the question part is exactly the rest of the rendered text
    assert ctx[:6] == tok.encode("<user>") and 650 <= len(ctx) + len(q) <= 750


def test_both_conditions_feed_the_same_ids(monkeypatch):
    fed = []
    real = query_aware.answer_and_logits

    def spy(model, prompts, policy, reference, stop_ids):
        fed.append((policy is None, [p.clone() for p in prompts]))
        return real(model, prompts, policy, reference, stop_ids)

    monkeypatch.setattr(query_aware, "answer_and_logits", spy)
    rows = query_aware.run(random_model(), CharTokenizer(), Chat(), [("h2o", 0.3)], 400, [0.5], 3, set(),
                           log=lambda m: None)
    (full, [one]), (_, [in_prompt]), (_, [ctx, q]) = fed
    assert full and torch.equal(one, in_prompt) and torch.equal(torch.cat([ctx, q], 1), in_prompt)
    assert q.shape[1] == len("\n\n" + QUESTION + "</user><assistant>The passkey is")
    assert [(r["method"], r["condition"]) for r in rows] == [("full", "in prompt"), ("h2o", "in prompt"), ("h2o", "after")]
    assert rows[0]["kl"] == 0 and rows[0]["top1"] == 1 and rows[2]["kl"] > 0


def kept(cache):
    return [[set(cache[l].positions[0, h].tolist()) for h in range(cache[l].positions.shape[1])]
            for l in range(len(cache))]


def test_after_the_context_snapkv_has_compressed_it_before_any_question():
    model = random_model(seed=3)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 61, (1, 40), generator=gen)
    q1, q2 = (torch.randint(0, 61, (1, 8), generator=gen) for _ in range(2))
    snapkv = lambda: make_policy("snapkv", 0.25, window=3, kernel=3)  # noqa: E731
    _, context_only = query_aware.feed(model, [ctx], snapkv())
    assert context_only.lengths() == [10] * 3  # 25% of the 40 context tokens, before a question exists
    before = kept(context_only)
    in_prompt, after = [], []
    for q in (q1, q2):
        in_prompt.append(kept(query_aware.feed(model, [torch.cat([ctx, q], 1)], snapkv())[1]))
        cache = query_aware.feed(model, [ctx, q], snapkv())[1]
        assert cache.lengths() == [12] * 3  # the budget of every token seen: 25% of 48
        after.append([[{p for p in h if p < 40} for h in layer] for layer in kept(cache)])
        assert all(a <= b for la, lb in zip(after[-1], before) for a, b in zip(la, lb))  # nothing evicted comes back
    context_in_prompt = [[[{p for p in h if p < 40} for h in layer] for layer in run] for run in in_prompt]
    assert context_in_prompt[0] != context_in_prompt[1]  # with the question in the prompt, the question chooses


def rows(method, condition, correct, kls):
    return [{"method": method, "budget": 0.1, "condition": condition, "correct": c, "kl": k, "top1": 0.5}
            for c, k in zip(correct, kls)]


def test_accuracy_kl_and_the_dependence_rule_by_hand():
    data = (rows("a", "in prompt", [1, 1, 0], [0.1, 0.2, 0.3]) + rows("a", "after", [0, 1, 0], [0.1, 0.2, 0.3])
            + rows("b", "in prompt", [1, 1, 1], [0.1, 0.1, 0.1]) + rows("b", "after", [1, 1, 1], [0.2, 0.3, 0.25])
            + rows("c", "in prompt", [1, 0, 0], [0.01, 0.01, 0.01]) + rows("c", "after", [1, 0, 0], [0.03, 0.03, 0.03]))
    m = query_aware.by_condition(data)
    assert m[("a", 0.1)]["in prompt"]["accuracy"] == pytest.approx(2 / 3)
    assert m[("a", 0.1)]["after"]["accuracy"] == pytest.approx(1 / 3)  # a drop of 1/3 >= 0.25
    assert m[("b", 0.1)]["after"]["kl"] == pytest.approx(0.25)  # 2.5 x 0.1, and 0.15 nats more
    assert m[("c", 0.1)]["after"]["kl"] == pytest.approx(0.03)  # 3 x, but only 0.02 nats more
    assert query_aware.question_dependent(data) == ["a", "b"]


def test_the_summary_table_and_figure_name_the_dependent_methods(tmp_path):
    from kvmini.eval import plots, tables
    from kvmini.eval.summary import summary

    data = [{"method": "full", "budget": None, "condition": "in prompt", "correct": c, "kl": 0.0, "top1": 1.0}
            for c in (1, 1, 0)] + rows("a", "in prompt", [1, 1, 0], [0.1, 0.2, 0.3]) + rows("a", "after", [0, 1, 0], [0.1, 0.2, 0.3])
    data += rows("c", "in prompt", [1, 0, 0], [0.01] * 3) + rows("c", "after", [1, 0, 0], [0.03] * 3)
    for r in data:
        r.update(context_tokens=500, question_tokens=20)
    results = {"profile": "quick", "device": "cpu", "queryaware": data,
               "sizes": {"queryaware": {"length": 512, "depths": [0.1, 0.5, 0.9], "budgets": [0.1], "k": 4}}}
    assert "| a | 0.1 | 0.67 | 0.33 | 0.200 | 0.200 | 0.50 | 0.50 | yes |" in summary(results)
    table = tables.queryaware_table(results)
    assert "| `c` | 10% | 33% → 33% | 0.010 → 0.030 | 0.50 → 0.50 | no |" in table
    assert "**depending on the question**: `a`; **not**: `c`." in table and "(the full cache: 67%)" in table
    pytest.importorskip("matplotlib", reason="matplotlib (requirements-dev.txt) is not installed")
    [png] = plots.write_plots({"queryaware": data}, tmp_path)
    assert png.endswith("queryaware.png") and (tmp_path / "queryaware.png").stat().st_size > 1000
