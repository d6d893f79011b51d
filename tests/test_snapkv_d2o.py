"""snapkv_d2o (SnapKV's scores + D2O's variance-softmax budgets and EMA merging) against literal
references: the budgets from Eq. 4-5 written out, the kept positions from SnapKV's rule written
out, and "evict == mask" for the composition without its merge."""
import pytest
import torch

from kvmini.methods.registry import make_policy
from reference import random_model, simulate
from test_d2o import literal_budgets, literal_variances
from test_methods_reference import snapkv as literal_snapkv

WINDOW, KERNEL, N, BUDGET, L = 4, 3, 48, 16, 4


@pytest.fixture(scope="module")
def setting():
    model = random_model(L=L, H=4, H_kv=2, seed=5, sharp=2.0)
    gen = torch.Generator().manual_seed(4)
    calls = [torch.randint(0, 61, (1, N), generator=gen)] + [torch.randint(0, 61, (1, 1), generator=gen)
                                                               for _ in range(3)]
    budgets = literal_budgets(literal_variances(model, calls[0]), BUDGET, N, WINDOW + 4)
    return model, calls, budgets


def run(model, calls, policy):
    cache, logits, kept = model.new_cache(1, 4), [], []
    policy.start(N, N + len(calls) - 1)
    with torch.no_grad():
        for ids in calls:
            kept.append([[[cache[l].positions[0, h].tolist() for h in range(2)]] for l in range(L)])
            logits.append(model(ids, cache, policy)[:, -1])
    return logits, kept, cache


def test_budgets_follow_eq5(setting):
    model, calls, want = setting
    policy = make_policy("snapkv_d2o", BUDGET, window=WINDOW, kernel=KERNEL)
    _, _, cache = run(model, calls[:1], policy)
    assert sum(want) == BUDGET * L and len(set(want)) > 1  # the layers really differ
    assert policy.budgets == want and cache.lengths() == want


def test_without_its_merge_eviction_equals_masking(setting, monkeypatch):
    """The composition's selection alone (its merge replaced by `rows.shrink_rows`): logits and kept
    positions equal SnapKV's literal rule applied with the literal budgets, at every call."""
    from kvmini.methods import snapkv_d2o
    from kvmini.methods.rows import shrink_rows

    monkeypatch.setattr(snapkv_d2o, "shrink_merging", lambda merge, layer, lc, *rest: shrink_rows(lc, *rest) or torch.zeros(()))
    model, calls, budgets = setting
    policy = make_policy("snapkv_d2o", BUDGET, window=WINDOW, kernel=KERNEL)
    got_logits, got_kept, _ = run(model, calls, policy)
    choose = literal_snapkv(BUDGET, g=2, prefill_calls=1, window=WINDOW, kernel=KERNEL, budgets=budgets)
    want_logits, want_kept = simulate(model, calls, choose)
    assert got_kept == want_kept
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_with_its_merge_the_same_tokens_stay_and_decoding_sees_merged_values(setting):
    """Merging changes no selection (the prompt is compressed after its last layer attended), only
    the kept keys and values, which the decode steps then read."""
    model, calls, budgets = setting
    got_logits, got_kept, _ = run(model, calls, make_policy("snapkv_d2o", BUDGET, window=WINDOW, kernel=KERNEL))
    choose = literal_snapkv(BUDGET, g=2, prefill_calls=1, window=WINDOW, kernel=KERNEL, budgets=budgets)
    want_logits, want_kept = simulate(model, calls, choose)
    assert got_kept == want_kept
    torch.testing.assert_close(got_logits[0], want_logits[0], atol=1e-5, rtol=0)  # the prompt: before any merge
    assert not torch.allclose(got_logits[1], want_logits[1], atol=1e-4)  # decoding reads merged K/V
