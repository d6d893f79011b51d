"""The compression engine's contracts: budgets, no-op equivalence, invariants, batching, no state leaks."""
import inspect
import itertools
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvmini.budget import resolve_budget
from kvmini.cache import PAD, LayerCache
from kvmini.errors import KvminiError
from kvmini.generate import generate
from kvmini.methods.allocators import round_to_total
from kvmini.methods.pyramidkv import pyramid
from kvmini.methods.registry import METHODS, chooses_budget, make_policy, method_options
from kvmini.methods.selectors import keep_top, shrink
from kvmini.report import full_nbytes
from reference import in_position_order, random_model
from tiny import budget_for, budget_of, fitted, least_budget

COMPRESSING = [m for m in METHODS if m != "full" and not chooses_budget(m)]


def held_positions(lc, b: int = 0) -> list[list[int]]:
    """The positions each KV head of sequence b of a layer holds, ascending, pads excluded."""
    return [sorted(p for p in h if p != PAD) for h in lc.positions[b].tolist()]


def own_counts(policy) -> bool:
    """Do the heads of a layer keep their own counts under this method (its compressor says so)?"""
    return policy.own_counts


def run_calls(model, calls, policy, prompt_len):
    """Feed calls (ids (B, T) each) through the model; last-position logits per call and the cache."""
    B = calls[0].shape[0]
    cache = model.new_cache(B, 4)
    if policy is not None:
        policy.start(prompt_len, prompt_len + len(calls) - 1, model)
    with torch.no_grad():
        logits = [model(ids, cache, policy)[:, -1] for ids in calls]
    return logits, cache


def make_calls(B, n, steps, seed=0, vocab=61):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (B, n), generator=gen)] + [torch.randint(0, vocab, (B, 1), generator=gen)
                                                               for _ in range(steps)]


# --- budgets -----------------------------------------------------------------------------------

def test_budget_convention():
    assert resolve_budget(0.25, 400) == 100  # ratio of the prompt
    assert resolve_budget(1.0, 37) == 37
    assert resolve_budget(128, 37) == 128  # tokens per layer, whatever the prompt
    assert resolve_budget(0.001, 10) == 1  # never zero
    assert resolve_budget(1, 37) == 1  # an int is a token count, even 1 (1.0 is the whole prompt)
    assert resolve_budget(3.0, 37) == 3
    for bad, msg in [(0, "> 0"), (-3, "> 0"), (float("nan"), "> 0"), (float("inf"), "finite"), (True, "> 0"),
                     ("5", "> 0"), (12.5, "whole number")]:
        with pytest.raises(KvminiError, match=msg):
            resolve_budget(bad, 100)


def test_keep_top_worked_example():
    score = torch.tensor([5.0, 1, 9, 3, 7, 2]).view(1, 1, 6)
    assert keep_top(score, 4, sinks=1, recent=1).tolist() == [[[0, 2, 4, 5]]]
    assert keep_top(score, 3, sinks=0, recent=0).tolist() == [[[0, 2, 4]]]
    tied = torch.tensor([1.0, 1, 1, 1]).view(1, 1, 4)
    assert keep_top(tied, 2, sinks=0, recent=0).tolist() == [[[0, 1]]]  # ties go to the earlier entry


def test_round_to_total_and_pyramid_by_hand():
    assert round_to_total([1.5, 1.5, 1.0], 4) == [2, 1, 1]
    assert pyramid(40, 4, window=8, beta=4) == [64, 48, 32, 16]  # k_min 8, k_max 56, see the docstring


@given(b=st.integers(5, 3000), L=st.integers(1, 40), w=st.integers(0, 4), beta=st.floats(1, 50))
def test_pyramid_budgets_sum_to_the_uniform_total(b, L, w, beta):
    budgets = pyramid(b, L, window=w, beta=beta)
    assert sum(budgets) == b * L
    assert budgets == sorted(budgets, reverse=True)
    extra = b - w
    for l, got in enumerate(budgets):  # within one token of the linear formula
        k_min = extra / beta
        exact = w + (2 * extra - k_min) - (2 * extra - 2 * k_min) * l / max(L - 1, 1) if L > 1 else b
        assert abs(got - exact) < 1


def test_what_generic_tests_derive_from_a_method_by_hand():
    """tests/tiny.py: SnapKV always keeps its window (32 tokens, 3 as fitted to the tiny prompts), PyramidKV's
    pyramid over a mean of 32 has nothing beyond its 32-token window to spread, StreamingLLM needs its 4 sinks
    and one recent token, DBudgetKV chooses its budgets; H2O's recent window is a rule of the budget, not cut."""
    assert fitted("snapkv") == {"window": 3} and fitted("h2o") == {} and fitted("scissorhands") == {"recent": 3}
    assert least_budget("snapkv", {}, 30, 51) == 32 and least_budget("snapkv", {"window": 3}, 3, 40) == 3
    assert least_budget("pyramidkv", {}, 30, 51) == 32
    assert least_budget("streaming_llm", {}, 3, 40) == 5 and budget_for("streaming_llm", 3) == 5
    assert least_budget("dbudgetkv", {}, 3, 40) is None and budget_for("dbudgetkv", 8) is None


# --- a budget nobody reaches is exactly `full` ------------------------------------------------

@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_at_least_the_sequence_is_exactly_full(name):
    model = random_model()
    n, steps = 12, 6
    calls = make_calls(2, n, steps)
    want, full_cache = run_calls(model, calls, None, n)
    budgets = [n + steps] + ([1.0] if name in ("snapkv", "pyramidkv") else [])
    for budget in budgets:
        got, cache = run_calls(model, calls, make_policy(name, budget, **fitted(name)), n)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        for layer, ref in zip(cache.layers, full_cache.layers):
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)


@pytest.mark.parametrize("name", COMPRESSING)
def test_generate_with_huge_budget_gives_full_tokens(name):
    model = random_model(seed=3)
    ids = torch.randint(0, 61, (1, 15), generator=torch.Generator().manual_seed(1))
    full = generate(model, ids, 10).tokens
    assert generate(model, ids, 10, policy=make_policy(name, 10_000, **fitted(name))).tokens == full


# --- invariants, over random shapes, lengths, budgets and batch sizes -------------------------

@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])  # every registered method, on every run
@settings(max_examples=6, deadline=None)
@given(
    kv_heads=st.integers(1, 3), group=st.integers(1, 3), B=st.integers(1, 2), n=st.integers(1, 40),
    steps=st.integers(0, 6), budget=st.integers(5, 30), chunk=st.integers(1, 40), seed=st.integers(0, 10**6),
)
def test_invariants(name, kv_heads, group, B, n, steps, budget, chunk, seed):
    model = random_model(L=2, H=kv_heads * group, H_kv=kv_heads, seed=seed % 100)
    options = fitted(name)
    policy = base = make_policy(name, None if chooses_budget(name) else budget, **options)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (B, n + steps), generator=gen)
    cache = model.new_cache(B, 4)
    policy.start(n, n + steps, model)
    calls = [ids[:, s : min(s + chunk, n)] for s in range(0, n, chunk)] + [ids[:, t : t + 1] for t in range(n, n + steps)]
    with torch.no_grad():
        for c, ids_c in enumerate(calls):
            try:
                logits = model(ids_c, cache, policy)
            except KvminiError as e:  # a budget below what the method always keeps is refused at the first call
                assume(c > 0 or "too small" not in str(e))  # (test_budgets_that_cannot_work_are_rejected)
                raise
            assert torch.isfinite(logits).all()
            seen = cache.seen_tokens
            for b, l in itertools.product(range(B), range(len(cache))):
                heads = held_positions(cache[l], b)  # each KV head's positions, pads excluded
                assert all(p < q for h in heads for p, q in zip(h, h[1:])), "positions unique"
                assert all(p < seen for h in heads for p in h)
                counts = [len(h) for h in heads]
                held = Fraction(sum(counts), len(counts))  # per KV head, on average (exact)
                assert own_counts(base) or len(set(counts)) == 1, "a layer's heads hold the same count"
                b_l = budget_of(base, l, b) if base.run.compresses else seen  # inactive: budget >= the sequence
                if own_counts(base) and l in base.kept:  # each head's budget, as the method gave it
                    gave = base.kept[l][b].tolist()
                    assert sum(gave) / len(gave) <= b_l + 0.5, "never above budget (each head's count rounded)"
                    assert seen < n or counts == [g + seen - n for g in gave], "each head holds what it was given"
                    b_l = Fraction(sum(gave), len(gave))
                if l in base.run.protected:  # never compressed
                    assert held == seen
                    continue
                if base.schedule == "decode":  # D2O's official variant: from the first decode step on
                    assert held == (seen if seen <= n else min(seen, b_l)), "never above budget"
                elif base.schedule == "every_call" or (base.schedule == "after_prompt" and seen >= n):
                    slack = base.evict_every - 1 if seen > n else 0  # held beyond the budget between evictions
                    assert min(seen, b_l) <= held <= min(seen, b_l + slack), "never above budget"
                elif base.schedule == "after_prompt":
                    assert held == seen
                elif seen <= n:  # prefill-only methods compress when the prompt is complete, then append
                    assert held == (min(n, b_l) if seen == n else seen)
                else:
                    assert held == min(n, b_l if base.run.compresses else n) + seen - n
                sinks = base.sinks if seen > 0 else 0
                recent = min(base.recent(b_l), seen)
                want = set(range(min(sinks, seen))) | set(range(seen - recent, seen))
                if base.schedule == "every_call" or (seen == n and base.schedule != "decode") or (
                        base.schedule in ("after_prompt", "decode") and seen > n):
                    for h in heads:
                        assert want <= set(h), "sinks and recent window kept"


# --- batching and state ------------------------------------------------------------------------

PER_SEQUENCE = {  # settings where the two sequences keep different counts in some layer
    "d2o": dict(seed=1, budget=12, options={"variant": "paper", "allocation": "zscore"}),
    "d2o[official]": dict(seed=1, budget=12, options={"protected_layers": ()}),  # at the first decode step, one at a time
    "snapkv_d2o": dict(seed=1, budget=12, options={"window": 3, "kernel": 3}),
    "dynamickv": dict(seed=5, budget=8, options={"window": 2, "kernel": 3, "interval": 1}),
    "dbudgetkv": dict(seed=5, budget=None)}


@pytest.mark.parametrize("name", COMPRESSING + ["dbudgetkv", "d2o[official]"])
def test_batch_of_two_equals_two_single_runs(name):
    """Each sequence of a batch keeps what it keeps alone: its kept positions, keys, values and logits (where its
    budgets follow its own statistics, the batch's rows hold different counts, and one policy runs them all)."""
    setting = PER_SEQUENCE.get(name) or dict(seed=5, budget=budget_for(name, 8, n=24))
    name = name.split("[")[0]
    model = random_model(seed=setting["seed"])
    n, steps = 24, 5
    calls = make_calls(2, n, steps, seed=2)
    options = setting.get("options", fitted(name))
    both, cache2 = run_calls(model, calls, make_policy(name, setting["budget"], **options), n)
    if name in PER_SEQUENCE:  # the rows really differ, so the batch cache holds pads
        assert any(lc.padded for lc in cache2.layers)
    for b in range(2):
        alone, cache1 = run_calls(model, [c[b : b + 1] for c in calls], make_policy(name, setting["budget"], **options), n)
        for x, y in zip(both, alone):
            torch.testing.assert_close(x[b : b + 1], y, atol=1e-5, rtol=0)
        for l2, l1 in zip(cache2.layers, cache1.layers):
            (p2, k2, v2), (p1, k1, v1) = in_position_order(l2, b), in_position_order(l1)
            assert torch.equal(p2, p1)
            torch.testing.assert_close(k2, k1, atol=1e-5, rtol=0)
            torch.testing.assert_close(v2, v1, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", COMPRESSING + ["dbudgetkv", "d2o[official]"])
def test_a_batch_row_keeps_what_it_keeps_alone_after_a_next_prompt(name):
    """Three different prompts in one batch, decoded, then continued with a next prompt of its own each, and
    decoded again: every row keeps what it keeps alone, also where the first prompt left the rows holding
    different counts (the next prompt is one fact of the run for every row)."""
    setting = PER_SEQUENCE.get(name) or dict(seed=5, budget=budget_for(name, 8, n=24))
    name = name.split("[")[0]
    options, first, second = setting.get("options", fitted(name)), make_calls(3, 24, 3, seed=2), make_calls(3, 9, 3, seed=3)
    seeds = (setting["seed"], 1, 7) if name in PER_SEQUENCE else (setting["seed"],)  # rows of counts of their own:
    for seed in seeds:  # DBudgetKV's and DynamicKV's rows parted on some seeds (before issue 83)
        one_seed(name, setting["budget"], options, random_model(seed=seed), first, second)


def one_seed(name, budget, options, model, first, second):
    def run(rows):
        policy, cache = make_policy(name, budget, **options), model.new_cache(len(rows), 4)
        logits = []
        with torch.no_grad():
            for prompt_len, calls in ((24, first), (9, second)):
                policy.start(prompt_len, model=model) if cache.seen_tokens == 0 else policy.next_prompt(prompt_len)
                logits += [model(ids[rows], cache, policy)[:, -1] for ids in calls]
        return logits, cache

    both, cache3 = run([0, 1, 2])
    for b in range(3):
        alone, cache1 = run([b])
        for x, y in zip(both, alone):
            torch.testing.assert_close(x[b : b + 1], y, atol=1e-5, rtol=0)
        for l3, l1 in zip(cache3.layers, cache1.layers):
            (p3, k3, v3), (p1, k1, v1) = in_position_order(l3, b), in_position_order(l1)
            assert torch.equal(p3, p1), (name, b)
            torch.testing.assert_close(k3, k1, atol=1e-5, rtol=0)
            torch.testing.assert_close(v3, v1, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", COMPRESSING)
def test_back_to_back_prompts_equal_fresh_runs(name):
    model = random_model(seed=6)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 61, (1, 20), generator=gen), torch.randint(0, 61, (1, 14), generator=gen)
    budget = budget_for(name, 9, n=14)  # both prompts compressed
    shared = make_policy(name, budget, **fitted(name))
    first, second = generate(model, a, 8, policy=shared), generate(model, b, 8, policy=shared)
    fresh_a = generate(model, a, 8, policy=make_policy(name, budget, **fitted(name)))
    fresh_b = generate(model, b, 8, policy=make_policy(name, budget, **fitted(name)))
    assert first.tokens == fresh_a.tokens and second.tokens == fresh_b.tokens
    assert second.cache.lengths() == fresh_b.cache.lengths()
    for x, y in zip(second.cache.layers, fresh_b.cache.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.positions, y.positions)
        assert x.aux_names() == y.aux_names()
        for aux in x.aux_names():
            assert torch.equal(x.aux(aux), y.aux(aux))


def test_a_call_the_policy_would_have_to_guess_about_is_refused():
    """Without start() the policy would have to guess where the prompt ends; a second cache is another run."""
    model = random_model()
    policy = make_policy("streaming_llm", 0.5, sinks=2)
    with torch.no_grad(), pytest.raises(KvminiError, match=r"call policy.start\(prompt_len\) before the first call"):
        model(torch.zeros(1, 20, dtype=torch.long), model.new_cache(), policy)
    policy.start(20)
    with torch.no_grad():
        model(torch.zeros(1, 20, dtype=torch.long), model.new_cache(), policy)
        assert policy.budgets == [10, 10, 10]
        with pytest.raises(KvminiError, match="this cache holds 0 tokens, but this run of the policy has fed 20"):
            model(torch.zeros(1, 8, dtype=torch.long), model.new_cache(), policy)


# --- bytes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,budget", [("streaming_llm", 7), ("h2o", 0.5), ("pyramidkv", 12)])
def test_cache_bytes_follow_the_formula(name, budget, dtype):
    model = random_model(L=4).to(dtype)
    B, n, steps = 2, 30, 3
    _, cache = run_calls(model, make_calls(B, n, steps), make_policy(name, budget, **fitted(name)), n)
    H_kv, D = model.config.num_kv_heads, model.config.head_dim
    if name == "pyramidkv":  # prefill-only: the pyramid's budgets (sum 4 * 12), then every step appends
        kept = [b + steps for b in pyramid(12, 4, window=fitted(name)["window"], beta=20)]
    else:
        kept = [7 if name == "streaming_llm" else 15] * 4
    elem = 2 if dtype == torch.bfloat16 else 4
    assert cache.lengths() == kept
    assert cache.nbytes() == 2 * sum(kept) * H_kv * D * elem * B
    assert full_nbytes(cache) == 2 * 4 * (n + steps) * H_kv * D * elem * B


# --- the registry ------------------------------------------------------------------------------

def test_registry_errors_are_clear():
    with pytest.raises(KvminiError, match="unknown method 'h3o'"):
        make_policy("h3o", 0.2)
    with pytest.raises(KvminiError, match="--kernel does not apply to method h2o"):
        make_policy("h2o", 0.2, kernel=3)
    with pytest.raises(KvminiError, match="--kernel must be odd"):
        make_policy("snapkv", 0.2, kernel=4)
    with pytest.raises(KvminiError, match="--budget does not apply to method full"):
        make_policy("full", 0.5)
    assert make_policy("full") is None
    assert method_options("snapkv") == {"window": 32, "kernel": 7, "pooling": "avg", "reduce": "mean"}
    from kvmini.methods.registry import resolved_options  # what run.py's report shows

    assert resolved_options("d2o", {"variant": "paper"})["nm"] == (3, 1)
    assert resolved_options("d2o", {"nm": (2, 1)})["nm"] == (2, 1) and resolved_options("d2o", {})["merge"] == "official"
    assert resolved_options("dynamickv", {"variant": "official"})["rounding"] == "floor"
    assert resolved_options("dynamickv", {})["tail_reallocation"] is False  # Alg. 1 line 24: every m layers only


@pytest.mark.parametrize("name,options,budget", [("streaming_llm", {}, 4), ("snapkv", {}, 20), ("h2o", {"recent": 9}, 8)])
def test_budgets_that_cannot_work_are_rejected(name, options, budget):
    model = random_model()
    with pytest.raises(KvminiError, match="too small"):
        run_calls(model, make_calls(1, 40, 0), make_policy(name, budget, **options), 40)


def test_self_budgeted_method_back_to_back_and_threshold_zero():
    model = random_model(L=4, seed=6)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 61, (1, 30), generator=gen), torch.randint(0, 61, (1, 22), generator=gen)
    shared = make_policy("dbudgetkv", threshold=0.1, protected_layers="0")
    first, second = generate(model, a, 6, policy=shared), generate(model, b, 6, policy=shared)
    fresh = generate(model, b, 6, policy=make_policy("dbudgetkv", threshold=0.1, protected_layers="0"))
    assert second.tokens == fresh.tokens and second.cache.lengths() == fresh.cache.lengths()
    assert min(first.cache.lengths()) < 30 + 5
    nothing = generate(model, a, 6, policy=make_policy("dbudgetkv", threshold=0.0, protected_layers=""))
    assert nothing.cache.lengths() == [35] * 4 and nothing.tokens == generate(model, a, 6).tokens


@settings(max_examples=60, deadline=None)
@given(S=st.integers(3, 30), sinks=st.integers(0, 4), recent=st.integers(0, 6), seed=st.integers(0, 10**6))
def test_lowest_drops_what_keep_top_drops_in_any_buffer_order(S, sinks, recent, seed):
    """The per-step victim (`lowest`, no sort, buffer in any order) is the one entry keep_top leaves out."""
    from kvmini.methods.selectors import keep_top, lowest

    if sinks + recent >= S:
        return
    gen = torch.Generator().manual_seed(seed)
    # a held set as eviction leaves it: the first `sinks` positions, the `recent` latest, gaps between
    middle = sorted((torch.randperm(3 * S, generator=gen)[: S - sinks - recent] + sinks).tolist())
    top = max(middle + [sinks - 1]) + 1
    positions = torch.tensor(list(range(sinks)) + middle + list(range(top, top + recent)))  # (S,) ascending
    score = torch.randint(0, 4, (S,), generator=gen).float()  # few values: many ties
    kept = keep_top(score.view(1, 1, S), S - 1, sinks, recent)[0, 0].tolist()
    dropped = positions[sorted(set(range(S)) - set(kept))].item()
    perm = torch.cat([torch.arange(sinks), torch.randperm(S - sinks, generator=gen) + sinks])  # sinks first
    victim = lowest(score[perm].view(1, 1, S), positions[perm].view(1, 1, S), sinks, recent, int(positions.max()))
    assert positions[perm][victim].item() == dropped


@settings(max_examples=60, deadline=None)
@given(S=st.integers(3, 30), sinks=st.integers(0, 4), recent=st.integers(0, 6), m=st.integers(2, 8),
       seed=st.integers(0, 10**6))
def test_shrink_dropping_m_at_once_keeps_what_keep_top_keeps_in_any_buffer_order(S, sinks, recent, m, seed):
    """evict_every's batches (e.g. h2o[evict_every=8]): `shrink` keeps, per head, the entries keep_top
    keeps on the position-ordered scores with many ties, keys with them, whatever the buffer's order."""
    if sinks + recent + m > S:
        return
    gen = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(3 * S, generator=gen)[:S].sort().values for _ in range(2)])  # (2, S)
    score = torch.randint(0, 4, (2, S), generator=gen).double()  # few values: many ties
    want = positions.gather(1, keep_top(score.view(1, 2, S), S - m, sinks, recent)[0])  # (2, S - m) ascending
    perm = torch.stack([torch.randperm(S, generator=gen) for _ in range(2)])  # each head's buffer in its own order
    lc = LayerCache(1, 2, 1, torch.float64, "cpu")
    lc.append(torch.zeros(1, 2, S, 1), torch.zeros(1, 2, S, 1), torch.zeros(1, S, dtype=torch.long))
    lc.positions[0] = positions.gather(1, perm)
    lc.keys[0, :, :, 0] = positions.gather(1, perm).double()  # each key names its position
    shrink(lc, score.gather(1, perm).view(1, 2, S), S - m, sinks, recent, int(positions.max()))
    assert lc.positions[0].sort(-1).values.tolist() == want.tolist()
    assert torch.equal(lc.keys[0, :, :, 0], lc.positions[0].double())


def test_shrink_dropping_two_worked_example():
    """score [5, 1, 9, 1, 7, 2] at positions 0..5: with 1 sink and a window of 1, dropping two drops the
    tied 1s; a window of 3 keeps 3, 4, 5 and the best of 0, 1, 2."""
    score = torch.tensor([[[5.0, 1, 9, 1, 7, 2]]])
    for sinks, recent, kept in [(1, 1, [0, 2, 4, 5]), (0, 3, [2, 3, 4, 5])]:
        lc = LayerCache(1, 1, 1, torch.float32, "cpu")
        lc.append(torch.zeros(1, 1, 6, 1), torch.zeros(1, 1, 6, 1), torch.arange(6)[None])
        shrink(lc, score, 4, sinks, recent, 5)
        assert lc.positions.tolist() == [[kept]]


def test_every_mechanism_refuses_a_mode_it_does_not_know():
    from kvmini.methods.ema_merging import EMAMerge
    from kvmini.methods.variance_softmax import layer_weights

    for make in (lambda: EMAMerge(weights="papr"), lambda: EMAMerge(tau="per_token"),
                 lambda: layer_weights([1.0, 2.0], "softmax")):
        with pytest.raises(KvminiError, match="must be one of"):
            make()


@pytest.mark.parametrize("name", COMPRESSING)
def test_a_budgeter_plan_is_pure(name):
    """The engine asks a budgeter's plan (to find the least budget a short prompt can take) without
    starting it: the same arguments give the same budgets, and nothing of the budgeter changes."""
    policy = make_policy(name, 0.5, **fitted(name))
    budgeter = policy  # a method plans itself
    before = dict(vars(budgeter))
    first = budgeter.plan(12, 4, 40)
    assert budgeter.plan(12, 4, 40) == first and len(first) == 4
    assert vars(budgeter).keys() == before.keys() and all(vars(budgeter)[k] is v for k, v in before.items())


def in_order(text: str, fragments: list[str]) -> bool:
    at = 0
    for fragment in fragments:
        at = text.find(fragment, at)
        if at < 0:
            return False
    return True


FORWARD = [  # (docs/design.md's forward call, the model's code): the same calls, in one order
    ("step = begin(method, cache, T)", "step = begin(method, cache, T)"),
    ("wants = method.before(cache, step)", "wants = method.before(cache, step)"),
    ("cache[l].append(k, v, positions)", "cache.append(k, v, pos)"),
    ("attend(q, cache[l], wants)", "attend(q, K, V,"),
    ("o_proj -> MLP", "self.mlp("),
    ("method.after_attention(l, cache, stats, step)", "method.after_attention(i, cache, stats, step)"),
    ("method.after_layers(cache, step)", "method.after_layers(cache, step)"),
]


def test_the_model_calls_the_policy_in_design_md_s_order():
    """docs/design.md's forward call is the order model.py runs: `before` first, the append before
    attention, the MLP before after_attention (read in the order the code runs: forward, into the block, back)."""
    from kvmini.model import Attention, Block, Transformer

    design = (Path(__file__).resolve().parent.parent / "docs/design.md").read_text()
    block = design.split("model.forward(ids (B, T), cache, method)")[1].split("```")[0]
    forward = inspect.getsource(Transformer.forward)
    at = forward.index("block(x,")
    code = forward[:at] + inspect.getsource(Attention.forward) + inspect.getsource(Block.forward) + forward[at:]
    assert in_order(block, [d for d, _ in FORWARD]) and in_order(code, [c for _, c in FORWARD])
    assert not in_order(code, [c for _, c in FORWARD][::-1])


def test_every_method_and_variant_names_one_of_the_four_schedules():
    """`schedule` is a plain name (kvmini.methods.method.Method): a misspelt one would be read by the report,
    the kept-token page and the budget's no-op rule as a method that never compresses at the prompt."""
    from kvmini.methods.registry import policy_for, specs

    names = {spec: policy_for(spec, 0.2).schedule for spec in specs()}
    assert set(names.values()) == {"prefill", "after_prompt", "every_call", "decode"}, names
    assert names["h2o"] == "every_call" and names["snapkv"] == "prefill"
    assert {names["d2o"], names["d2o[variant=paper]"]} == {"decode", "after_prompt"}


def test_the_declared_schedule_is_the_one_a_default_policy_runs():
    """The registry reads a method's schedule off its class, building nothing (start-up builds one method):
    it must be what a policy built with the defaults runs, so that the budget rules and the tools agree."""
    from kvmini.methods.registry import policy_for, schedule

    for name, module in METHODS.items():
        if module is not None:
            assert schedule(name) == policy_for(name, 0.2).schedule, name


def test_run_py_builds_only_the_method_asked_for_before_the_first_forward_pass(monkeypatch):
    """Reading the command line (every method's flags, --help's list and schedules) and making the policy
    build exactly one method: a debugger that starts at main steps through one constructor."""
    import run
    from kvmini.methods.method import Method
    from kvmini.methods.registry import make_policy

    built, init = [], Method.__init__
    monkeypatch.setattr(Method, "__init__", lambda self, *a, **k: built.append(type(self).__name__) or init(self, *a, **k))
    args = run.parse_args(["--method", "d2o", "--prompt", str(Path(__file__).resolve().parent.parent / "docs/lighthouse.txt")])
    make_policy(args.method, args.budget, **args.options)
    assert built == ["D2O"]


def test_a_method_finds_the_model_of_its_run_and_a_fork_shares_it():
    """prefill hands the model to `start` (a method may read its weights: tutorial 9, part 4); it is held
    weakly, so `fork` copies the method's state but not the model."""
    from kvmini.generate import fork, prefill

    model, policy = random_model(L=2), make_policy("h2o", 0.5)
    assert policy.model is None
    cache = model.new_cache(1)
    prefill(model, torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(0)), cache, policy)
    assert policy.model is model
    _, copied = fork(cache, policy)
    assert copied.model is model and copied is not policy
    policy.start(5)
    assert policy.model is None  # a new run started without a model has none
