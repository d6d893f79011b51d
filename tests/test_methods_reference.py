"""Every baseline against a literal re-simulation written from its paper (tests/reference.py).

The engine evicts physically; the simulation keeps everything and masks with -inf. Equal
logits prove "evict == mask"; equal kept positions at every call prove the scorer, the
selector and the schedule. Each `choose` below is the method in plain Python loops.
"""
from collections import defaultdict

import pytest
import torch

from kvmini.methods.registry import make_policy
from reference import engine_run, group_mean, random_model, simulate, top_positions


def per_head(kept, new, rule):
    """Apply rule(b, h, candidates) to every (batch, KV head) kept set."""
    return [[rule(b, h, sorted(s + new)) for h, s in enumerate(row)] for b, row in enumerate(kept)]


def streaming_llm(budget, sinks=4, **_):
    def choose(layer, c, probs, kept, new):
        return per_head(kept, new, lambda b, h, cand: cand if len(cand) <= budget
                        else cand[:sinks] + cand[len(cand) - (budget - sinks):])
    return choose


def h2o(budget, g, recent=None, **_):
    recent = budget // 2 if recent is None else recent
    acc = defaultdict(float)  # (layer, b, h, position) -> attention received so far

    def choose(layer, c, probs, kept, new):
        received = group_mean(probs, g).sum(2)  # (B, H_kv, N): column sums of this call

        def rule(b, h, cand):
            for p in cand:
                acc[layer, b, h, p] += received[b, h, p].item()
            if len(cand) <= budget:
                return cand
            old, last = cand[: len(cand) - recent], cand[len(cand) - recent :]
            return top_positions(old, {p: acc[layer, b, h, p] for p in old}, budget - recent) + last
        return per_head(kept, new, rule)
    return choose


def tova(budget, g, **_):
    def choose(layer, c, probs, kept, new):
        row = group_mean(probs, g)[:, :, -1]  # (B, H_kv, N): the latest query's attention
        return per_head(kept, new, lambda b, h, cand: cand if len(cand) <= budget
                        else top_positions(cand, {p: row[b, h, p].item() for p in cand}, budget))
    return choose


def snapkv(budget, g, prefill_calls, window=32, kernel=7, pooling="avg", budgets=None, **_):
    def choose(layer, c, probs, kept, new):
        b_l = budgets[layer] if budgets else budget
        C = group_mean(probs, g)[:, :, -window:].sum(2)  # (B, H_kv, N): attention of the observation window

        def rule(b, h, cand):
            if c != prefill_calls - 1 or len(cand) <= b_l:
                return cand
            prefix, obs = cand[:-window], cand[-window:]
            pooled = {}
            for j, p in enumerate(prefix):  # pooling along keys, zero / -inf padding outside the prefix
                near = [C[b, h, prefix[i]].item() for i in range(j - kernel // 2, j + kernel // 2 + 1)
                        if 0 <= i < len(prefix)]
                pooled[p] = sum(near) / kernel if pooling == "avg" else max(near)
            return top_positions(prefix, pooled, b_l - window) + obs
        return per_head(kept, new, rule)
    return choose


CASES = [  # method, options, budget, literal rule, prompt chunks
    ("streaming_llm", {}, 9, streaming_llm, [17]),
    ("streaming_llm", {"sinks": 2}, 6, streaming_llm, [5, 7]),
    ("h2o", {}, 8, h2o, [17]),
    ("h2o", {"recent": 3}, 7, h2o, [6, 11]),
    ("h2o", {"reduce": "mean"}, 0.5, h2o, [16]),
    ("tova", {}, 8, tova, [17]),
    ("tova", {}, 6, tova, [4, 4, 9]),
    ("snapkv", {"window": 4, "kernel": 3}, 9, snapkv, [20]),
    ("snapkv", {"window": 3, "kernel": 5, "pooling": "max"}, 8, snapkv, [12, 8]),
    ("pyramidkv", {"window": 3, "kernel": 3, "pyramid_beta": 4}, 8, snapkv, [20]),
]


@pytest.mark.parametrize("name,options,budget,rule,chunks", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_engine_equals_literal_masked_simulation(name, options, budget, rule, chunks):
    model = random_model(L=3, H=4, H_kv=2, seed=len(chunks))
    gen = torch.Generator().manual_seed(7)
    B, steps, n = 2, 5, sum(chunks)
    calls = [torch.randint(0, 61, (B, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (B, 1), generator=gen) for _ in range(steps)]

    policy = make_policy(name, budget, **options)
    got_logits, got_kept = engine_run(model, calls, policy, n)

    b_tokens = budget if budget > 1 else round(budget * n)
    choose = rule(b_tokens, g=2, prefill_calls=len(chunks), budgets=policy.budgets if name == "pyramidkv" else None,
                  **options)
    want_logits, want_kept = simulate(model, calls, choose)
    assert got_kept == want_kept
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert any(len(s) < n for layer in got_kept[-1] for row in layer for s in row), "nothing was evicted"
