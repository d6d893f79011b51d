"""KNorm (Devoto et al. 2024) against a literal masked simulation: keep the lowest key norms."""
import pytest
import torch

from kvmini.methods.registry import make_policy
from reference import random_model, simulate, top_positions


def literal_knorm(budget, prefill_calls):
    """In the call that completes the prompt, each (sequence, KV head) keeps the `budget` positions
    whose keys have the smallest L2 norm; decode steps append."""
    def choose(layer, c, probs, kept, new, keys):
        out = []
        for b, row in enumerate(kept):
            out.append([])
            for h, s in enumerate(row):
                cand = sorted(s + new)
                if c == prefill_calls - 1 and len(cand) > budget:
                    norm = {p: -float(keys[b, h, p].norm()) for p in cand}  # higher = smaller norm
                    cand = top_positions(cand, norm, budget)
                out[-1].append(cand)
        return out
    return choose


@pytest.mark.parametrize("chunks,budget", [([17], 6), ([9, 8], 0.5)])
def test_knorm_equals_literal_masked_simulation(chunks, budget):
    model = random_model(L=3, H=4, H_kv=2, seed=4)
    gen = torch.Generator().manual_seed(3)
    B, steps, n = 2, 4, sum(chunks)
    calls = [torch.randint(0, 61, (B, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (B, 1), generator=gen) for _ in range(steps)]
    policy = make_policy("knorm", budget)
    policy.start(n, n + steps)
    cache, got_logits, got_kept = model.new_cache(B, 4), [], []
    with torch.no_grad():
        for ids in calls:
            got_kept.append([[[cache[l].positions[b, h].tolist() for h in range(2)] for b in range(B)]
                             for l in range(3)])
            got_logits.append(model(ids, cache, policy)[:, -1])
    b_tokens = budget if isinstance(budget, int) else round(budget * n)
    want_logits, want_kept = simulate(model, calls, literal_knorm(b_tokens, len(chunks)), with_keys=True)
    assert got_kept == want_kept
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.lengths() == [b_tokens + steps] * 3


def test_knorm_asks_attention_for_nothing():
    policy = make_policy("knorm", 4)
    policy.start(10, 10)
    model = random_model(L=2)
    cache = model.new_cache(1)
    assert policy.before(cache, policy.run.step(policy, cache, 10)) is None  # the fast SDPA path


def test_knorm_keeps_the_smallest_keys_by_hand():
    from kvmini.cache import LayerCache

    lc = LayerCache(1, 1, 2, torch.float32, "cpu")
    keys = torch.tensor([[3.0, 4.0], [0.6, 0.8], [1.0, 0.0], [0.0, 2.0]])  # norms 5, 1, 1, 2
    lc.append(keys.view(1, 1, 4, 2), keys.view(1, 1, 4, 2), torch.arange(4)[None])
    cache = type("OneLayer", (list,), {"seen_tokens": 0})([lc])  # what KNorm's hooks read of a KVCache
    policy = make_policy("knorm", 2)
    policy.start(4)
    step = policy.run.step(policy, cache, 4)
    policy.before(cache, step)
    policy.after_attention(0, cache, {}, step)
    assert lc.positions.tolist() == [[[1, 2]]]  # the two keys of norm 1 (the tie goes to the earlier)
