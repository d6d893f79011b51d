"""A prompt is a prompt, however it arrives: a prefill in chunks keeps what one call keeps.

Every method that compresses once the prompt is complete (SnapKV, PyramidKV, DynamicKV, DBudgetKV,
snapkv_d2o, KNorm, D2O's two variants: every registered method but those compressing after every call),
in each of its variants and with each option value that makes it read other attention statistics
(tests/tiny.py, `statistic_cases`), must keep, after a chunked prefill and a few decode steps,
the same positions in every layer and KV head as after a one-shot prefill, with the same budgets,
and keys and values equal within float tolerance. The one-shot run is the expectation: it is
itself proved against literal references (test_methods_reference, test_d2o, test_dbudgetkv, ...).
Chunk sizes go below and above every observation window, down to one token, and past the prompt.
The methods that compress after every call by design (H2O, TOVA, StreamingLLM, WeightedKV) are
checked for what a chunk size may change: StreamingLLM's positions do not depend on it.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmini.generate import generate, prefill
from kvmini.methods.registry import METHODS, compress_every_call, make_policy
from reference import random_model
from tiny import WINDOW, budget_for, statistic_cases

N, STEPS, B = 45, 3, 2  # prompt tokens, decode steps after it, sequences
L = 5  # layers
PROMPT_TIME = [m for m in METHODS if METHODS[m] is not None and m not in compress_every_call()]
CASES = [(name, budget_for(name, 16, L, N), options) for name, options in statistic_cases(PROMPT_TIME)]
CHUNKS = sorted({1, 3, 7, WINDOW - 1, WINDOW + 5, N + 10})  # below and above the observation window (tests/tiny.py)


def model_and_prompt(seed: int = 0):
    model = random_model(L=L, H=4, H_kv=2, seed=seed)
    ids = torch.randint(0, 61, (B, N + STEPS), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids


@torch.inference_mode()
def run(model, ids, name, budget, options, sizes):
    """Prefill ids[:, :N] in calls of the given sizes, decode the next STEPS tokens (teacher-forced).
    Returns (per layer: (positions, keys, values) in position order, budgets, last logits)."""
    policy = make_policy(name, budget, **options)
    cache = model.new_cache(B, N + STEPS)
    policy.start(N, N + STEPS, model)
    start = 0
    for size in sizes:
        model(ids[:, start : start + size], cache, policy)
        start += size
    assert start == N
    for t in range(N, N + STEPS):
        logits = model(ids[:, t : t + 1], cache, policy)
    layers = []
    for lc in cache:
        order = lc.positions.argsort(-1)  # (B, H_kv, S)
        layers.append((lc.positions.gather(2, order), lc.keys.gather(2, order[..., None].expand_as(lc.keys)),
                       lc.values.gather(2, order[..., None].expand_as(lc.values))))
    return layers, policy.budgets, logits


def assert_same_run(got, want):
    (got_layers, got_budgets, got_logits), (want_layers, want_budgets, want_logits) = got, want
    assert got_budgets == want_budgets
    for (pos, k, v), (pos_w, k_w, v_w) in zip(got_layers, want_layers):
        assert pos.tolist() == pos_w.tolist()  # the same positions in every layer, sequence and KV head
        torch.testing.assert_close(k, k_w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def chunks_of(size: int) -> list[int]:
    return [min(size, N - s) for s in range(0, N, size)]


@pytest.mark.parametrize("name,budget,options", CASES, ids=[f"{n}{o}" for n, _, o in CASES])
def test_chunked_prefill_keeps_the_one_shot_sets(name, budget, options):
    model, ids = model_and_prompt()
    want = run(model, ids, name, budget, options, [N])
    assert min(want[1]) < N, "the one-shot run compressed nothing"
    for size in CHUNKS:
        assert_same_run(run(model, ids, name, budget, options, chunks_of(size)), want)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.sets(st.integers(1, N - 1), max_size=6))
def test_any_split_of_the_prompt_keeps_the_one_shot_sets(case, cuts):
    """Calls of unequal sizes, cut anywhere (inside, at or across the observation window)."""
    name, budget, options = case
    model, ids = model_and_prompt()
    bounds = [0, *sorted(cuts), N]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert_same_run(run(model, ids, name, budget, options, sizes), run(model, ids, name, budget, options, [N]))


def test_streaming_llm_keeps_the_same_positions_in_any_chunks():
    """Compressing after every chunk (by design) changes what later chunks attend to, not what
    StreamingLLM keeps: the sinks and the latest tokens."""
    model, ids = model_and_prompt()
    want = run(model, ids, "streaming_llm", 12, {}, [N])
    for size in (1, 7, 20):
        got = run(model, ids, "streaming_llm", 12, {}, chunks_of(size))
        assert [p.tolist() for p, _, _ in got[0]] == [p.tolist() for p, _, _ in want[0]]


@pytest.mark.parametrize("name,options", [("h2o", {}), ("tova", {}), ("streaming_llm", {}), ("knorm", {}),
                                          ("snapkv", dict(window=4)), ("weightedkv", {})])
def test_a_prefill_only_call_leaves_the_promised_cache(name, options):
    """generate(max_new_tokens=0) with a budget of T - 1: the prompt is compressed to T - 1 entries."""
    model, ids = model_and_prompt()
    T = 20
    got = generate(model, ids[:, :T], 0, policy=make_policy(name, T - 1, **options))
    assert got.cache.lengths() == [T - 1] * 5


@pytest.mark.slow
def test_chunked_prefill_keeps_the_one_shot_sets_on_the_default_model(default_model, default_tokenizer, real_text):
    """The issue's case: a 150-token prompt in chunks of 64 (the last chunk holds 22 queries, fewer than
    SnapKV's window of 32), and D2O's default (official) variant, whose F_v spans the whole prompt."""
    ids = torch.tensor([default_tokenizer.encode(real_text)[:150]])
    for name, budget in (("snapkv", 48), ("d2o", 48)):
        want, got = (prefill_and_positions(default_model, ids, name, budget, c) for c in (None, 64))
        assert got == want, name


@torch.inference_mode()
def prefill_and_positions(model, ids, name, budget, chunk):
    policy = make_policy(name, budget)
    cache = model.new_cache(1, ids.shape[1] + 1)
    prefill(model, ids, cache, policy, chunk_size=chunk, total_len=ids.shape[1] + 1)
    model(ids[:, -1:], cache, policy)  # D2O's official variant compresses at the first decode step
    return policy.budgets, [lc.positions.sort(-1).values.tolist() for lc in cache]
