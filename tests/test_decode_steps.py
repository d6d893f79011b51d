"""Decode steps: what evict_every holds and evicts, `lowest` and the merge's nearest entry on rows of
their own, D2O's thresholds and its first compression taken in chunks, and run.py's refusal of the
removed --layer-by-layer. `run` and `same` (one run's caches, logits, budgets and traces; two runs
equal) serve the other test files too. Float64 models, so that no near tie can flip between runs.
"""
import pytest
import torch

from kvmini.cache import PAD, LayerCache
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.registry import make_policy
from kvmini.methods.selectors import lowest
from kvmini.view import record_merges
from reference import random_model

TOL = dict(rtol=1e-12, atol=1e-12)
def run(model, name, budget, options, batch: int = 1, steps: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    calls = [torch.randint(0, 61, (batch, 40), generator=gen)]
    calls += [torch.randint(0, 61, (batch, 1), generator=gen) for _ in range(steps)]
    policy = make_policy(name, budget, **options)
    trace = record_merges(policy)
    policy.start(40, 40 + steps)
    cache = model.new_cache(batch, 4)
    logits = []
    with torch.no_grad():
        for ids in calls:
            logits.append(model(ids, cache, policy)[:, -1])
    return cache, policy, logits, trace


def same(a, b) -> None:
    cache_a, policy_a, logits_a, trace_a = a
    cache_b, policy_b, logits_b, trace_b = b
    for la, lb in zip(logits_a, logits_b):
        torch.testing.assert_close(la, lb, **TOL)
    for lc_a, lc_b in zip(cache_a.layers, cache_b.layers):
        assert lc_a.length == lc_b.length
        assert torch.equal(lc_a.positions, lc_b.positions)  # the same entries in the same slots
        torch.testing.assert_close(lc_a.keys, lc_b.keys, **TOL)
        torch.testing.assert_close(lc_a.values, lc_b.values, **TOL)
        assert lc_a.aux_names() == lc_b.aux_names()
        for name in lc_a.aux_names():
            torch.testing.assert_close(lc_a.aux(name), lc_b.aux(name), **TOL)
    assert policy_a.budgets == policy_b.budgets and policy_a.evicted == policy_b.evicted
    assert policy_a.merged == pytest.approx(policy_b.merged, abs=1e-9)
    assert (trace_a is None) == (trace_b is None)
    for ra, rb in zip(trace_a or [], trace_b or []):
        assert ra.layer == rb.layer and torch.equal(ra.evicted, rb.evicted) and torch.equal(ra.into, rb.into)
        torch.testing.assert_close(ra.weight, rb.weight, **TOL)
    assert len(trace_a or []) == len(trace_b or [])


@pytest.fixture(scope="module")
def model():
    return random_model(L=4).to(torch.float64)


def test_lowest_skips_pads_and_takes_a_window_per_row():
    # two rows (layers) of 5 places; row 1 holds 4 entries after a pad
    score = torch.tensor([[[5.0, 1.0, 9.0, 3.0, 0.0]], [[-1.0, 4.0, 2.0, 8.0, 6.0]]])
    positions = torch.tensor([[[0, 1, 2, 3, 4]], [[PAD, 0, 1, 2, 3]]])
    recent = torch.tensor([3, 1])[:, None, None]  # row 0 protects positions 2-4, row 1 position 4 (none held)
    # row 0: free position 1 (score 1); row 1: positions 1, 2, 3 free, the lowest is 1 (score 2), the pad never
    assert lowest(score, positions, 1, recent, newest=4).tolist() == [[1], [2]]
    assert lowest(score, positions, 1, 0, newest=4).tolist() == [[4], [2]]


def test_a_pad_is_never_the_nearest_entry():
    """A pad's key is zero, so its cosine (0) would beat real keys that all point away from the victim."""
    lc = LayerCache(2, 1, 2, torch.float64, "cpu")
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [-1.0, -0.5], [-1.0, 0.1]])  # zero, a victim, two keys pointing away
    lc.append(keys.expand(2, 1, 4, 2), keys.expand(2, 1, 4, 2), torch.arange(4).expand(2, 4))
    lc.keys[0, 0, :4] = lc.values[0, 0, :4] = keys.roll(-1, 0)  # row 0 holds 3 entries (positions 1-3), then a pad
    lc._pos[0, 0, :4] = torch.tensor([1, 2, 3, PAD])
    lc.counts = torch.tensor([[3], [4]])  # row 1 holds 4 (its zero key is real)
    merge = EMAMerge(beta=0.5, weights="official", tau="per_head")
    merge.trace = []  # a first threshold is the step's own similarity: every evicted token merges
    merge.one(0, lc, torch.tensor([[0], [1]]), 3)  # each row's victim: the key [1, 0]
    assert merge.trace[0].into.flatten().tolist() == [2, 0]  # cosines -0.89 and 0 (not the pad's 0)


def test_evict_every_n_holds_up_to_budget_plus_n_minus_one_and_evicts_n_at_once(model):
    policy = make_policy("h2o", 12, evict_every=4)
    policy.start(40, 52)
    cache = model.new_cache(1, 4)
    gen = torch.Generator().manual_seed(1)
    held = []
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 40), generator=gen), cache, policy)
        held.append(cache.lengths()[0])
        for _ in range(12):
            model(torch.randint(0, 61, (1, 1), generator=gen), cache, policy)
            held.append(cache.lengths()[0])
    assert held == [12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12]  # the prompt to 12; then every 4th step
    assert policy.evicted == [28 + 12] * 4


def test_evict_every_n_evicts_what_keep_top_of_the_scores_keeps(model):
    """Every N-th step, each layer keeps the budget's best of the budget + N entries it holds by H2O's
    scores: computed here from the scores before the step plus that step's attention row, taken from a
    copy of the cache run without compression, and `keep_top` (tested by hand in test_policy.py)."""
    import copy

    from kvmini.eval.layers import ColumnSums
    from kvmini.methods.selectors import keep_top

    policy = make_policy("h2o", 12, evict_every=3, recent=2)
    policy.start(40, 46)
    cache = model.new_cache(1, 4)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 40), generator=gen), cache, policy)
        for _ in range(2):
            model(torch.randint(0, 61, (1, 1), generator=gen), cache, policy)
        assert cache.lengths() == [14] * 4  # budget + N - 1
        step, copied, row = torch.randint(0, 61, (1, 1), generator=gen), copy.deepcopy(cache), ColumnSums()
        model(step, copied, row)  # the third step's attention rows, nothing evicted
        model(step, cache, policy)
    for lc, full, sums in zip(cache.layers, copied.layers, row.sums):
        score = full.aux("attention_sum") + sums  # (1, H_kv, 15): the scores the eviction sees
        order = full.positions.argsort(-1)
        keep = keep_top(score.gather(2, order), 12, 0, 2)  # (1, H_kv, 12) in position order
        want = full.positions.gather(2, order).gather(2, keep)
        assert torch.equal(lc.positions.sort(-1).values, want)


@pytest.mark.parametrize("options", [{}, {"variant": "paper"}, {"protected_layers": ""}], ids=str)
def test_d2o_first_compression_by_chunks_equals_one_call(model, options, monkeypatch):
    """D2O's first compression (the whole prompt's evicted keys against the kept ones, Eq. 9) takes its
    similarities a chunk of evicted keys at a time when they are many (`EMAMerge.at_once`): forced to
    one evicted key per chunk here, every run (kept entries, keys, values, merges, thresholds, traces,
    logits) equals the one-call specification."""
    from kvmini.methods import ema_merging
    whole = run(model, "d2o", 12, options)
    monkeypatch.setattr(ema_merging.EMAMerge, "at_once", 1)  # a row per chunk
    chunked = run(model, "d2o", 12, options)
    same(chunked, whole)
    assert sum(whole[1].merged) > 0  # the merges happened


def test_run_py_refuses_the_removed_layer_by_layer_in_one_line(capsys):
    import run

    assert run.main(["--method", "h2o", "--prompt", "docs/lighthouse.txt", "--layer-by-layer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layer-by-layer is gone" in err[0] and "The method form" in err[0]
