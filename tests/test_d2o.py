"""D2O: variance-softmax allocation (Eq. 4-5) and EMA-threshold merging (Eq. 9-12), by hand and against
literal loops; the whole method on a random model; and variance-softmax composed with SnapKV scoring."""
import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmini.cache import LayerCache
from kvmini.errors import KvminiError
from kvmini.methods.ema_merging import EMAMerge, convex_merge, ema_threshold, nearest, scatter_mean_merge
from kvmini.methods.registry import make_policy
from kvmini.generate import prefill
from kvmini.methods.allocators import proportional
from kvmini.methods.variance_softmax import attention_variance, layer_weights, split
from cases import stored
from checks import assert_equal
from reference import group_mean, random_model, simulate


# --- allocation --------------------------------------------------------------------------------

def test_zscore_weights_by_hand():
    """kvmini's reading of Eq. 5 (`allocation=zscore`): softmax(-z(F_v)), and no NaN when the variances are equal."""
    z = [(f - 2) / math.sqrt(2 / 3) for f in (1, 2, 3)]  # standardized variances
    softmax = [math.exp(-x) / sum(math.exp(-y) for y in z) for x in z]
    assert layer_weights([1, 2, 3], "zscore") == pytest.approx(softmax)
    assert layer_weights([1, 2, 3], "zscore") == pytest.approx([0.7245, 0.2129, 0.0626], abs=1e-4)
    assert layer_weights([5, 5, 5], "zscore") == pytest.approx([1 / 3] * 3)  # no spread (sigma = 0): uniform


@pytest.mark.exercise("variance_softmax")
def test_eq4_attention_variance_by_hand():
    """Eq. 4 (`attention_variance`): per head, the variance of the column sums over the key positions
    (divided by n; by n - correction when asked), then the mean over the heads and the batch."""
    def literal(rows, correction=0):  # rows: each head's column sums
        out = []
        for row in rows:
            mean = sum(row) / len(row)
            out.append(sum((x - mean) ** 2 for x in row) / (len(row) - correction))
        return sum(out) / len(out)

    peaked = [[5.0, 0.2, 0.2, 0.2, 0.2, 0.2], [3.0, 1.0, 0.5, 0.5, 0.5, 0.5]]  # two heads, six keys
    got = attention_variance(torch.tensor([peaked]))
    assert got == pytest.approx(literal(peaked)), \
        f"Eq. 4 (`attention_variance`): F_v of two heads' column sums, want {literal(peaked):.4f}, got {got:.4f}"
    got = attention_variance(torch.tensor([peaked]), correction=1)
    assert got == pytest.approx(literal(peaked, 1)), \
        f"Eq. 4 (`attention_variance`) with correction=1: want {literal(peaked, 1):.4f}, got {got:.4f}"
    apart = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # heads with different means: each has variance 2/3
    got = attention_variance(torch.tensor([apart]))
    assert got == pytest.approx(2 / 3), (f"Eq. 4 (`attention_variance`): heads whose column sums have different "
                                         f"means, each head's variance (2/3) then their mean: want 0.6667, got {got:.4f}")
    assert attention_variance(torch.full((1, 2, 6), 1.0)) == 0, "Eq. 4 (`attention_variance`): even attention has variance 0"
    batch = [[[1.0, 2.0, 3.0]], [[0.0, 0.0, 3.0]]]  # two sequences of one head: the mean of their variances
    got = attention_variance(torch.tensor(batch))
    assert got == pytest.approx(literal([batch[0][0], batch[1][0]])), f"Eq. 4 (`attention_variance`) over a batch: got {got:.4f}"


@pytest.mark.exercise("reciprocal_allocation")
def test_reciprocal_allocation_by_hand():
    """Exercise `reciprocal_allocation` (tutorial 3, Table 4): w_l = (1/F_l) / sum_k 1/F_k. [1, 2, 3] is its own
    rank vector with minimum 1, so [0.5, 2, 8] (not ranks, minimum 0.5) also tells 1/F from 1/rank and from
    1/(F - min + 1): 1/F = [2, 0.5, 0.125], their sum 2.625 -> [16/21, 4/21, 1/21]."""
    for F_v, want in (([1, 2, 3], [6 / 11, 3 / 11, 2 / 11]), ([0.5, 2.0, 8.0], [16 / 21, 4 / 21, 1 / 21]),
                      ([8.0, 0.5, 2.0], [1 / 21, 16 / 21, 4 / 21])):
        got = layer_weights(F_v, "reciprocal")
        assert got == pytest.approx(want, rel=1e-12), \
            f"Table 4's reciprocal allocation (`layer_weights`, how='reciprocal') of F_v = {F_v}: want {want}, got {got}"


@pytest.mark.exercise("reciprocal_allocation")
def test_reciprocal_allocation_of_a_zero_variance():
    """A layer whose attention is perfectly even has F_v = 0 (Eq. 4): 1/F_v is infinite, so that layer's share
    is the whole (the limit of F -> 0), the others' 0, and no share is NaN (1/0 / sum(1/F) literally is inf/inf)."""
    got = layer_weights([0.0, 2.0, 4.0], "reciprocal")
    assert all(math.isfinite(x) for x in got), f"Table 4's reciprocal allocation (`layer_weights`) of F_v = [0, 2, 4]: " \
        f"want finite shares [1, 0, 0], got {got} (1/0 taken literally?)"
    assert got == pytest.approx([1.0, 0.0, 0.0], abs=1e-12), \
        f"Table 4's reciprocal allocation (`layer_weights`) of F_v = [0, 2, 4]: want [1, 0, 0], got {got}"


@pytest.mark.exercise("variance_softmax")
def test_paper_and_uniform_weights_by_hand():
    """Exercise `variance_softmax` (tutorial 3): Eq. 5 as printed on raw variances [1, 2, 3] (`paper`):
    softmax(-F_v), no standardizing, no temperature; uniform: 1/3 each; a low temperature
    sharpens towards the lowest variance; standardized weights do not depend on the variances' scale."""
    e = [math.exp(-f) for f in (1, 2, 3)]
    got = layer_weights([1, 2, 3], "paper")
    assert got == pytest.approx([x / sum(e) for x in e]), f"Eq. 5 as printed (`layer_weights`, how='paper'): got {got}"
    got = layer_weights([1, 2, 3], "uniform")
    assert got == pytest.approx([1 / 3] * 3), f"the uniform allocation (`layer_weights`, how='uniform'): got {got}"
    hot = layer_weights([1, 2, 3], temperature=0.1)
    assert hot[0] > 0.99, f"Eq. 5 with temperature 0.1 (`layer_weights`): the lowest-variance layer's weight, got {hot[0]}"
    # standardizing makes the weights independent of the variances' scale (they grow with n)
    got, want = layer_weights([1e6, 2e6, 3e6]), layer_weights([1, 2, 3])
    assert got == pytest.approx(want), f"Eq. 5 on z-scored variances (`layer_weights`): [1e6, 2e6, 3e6] gives {got}, [1, 2, 3] {want}"


def test_allocation_clamps_and_redistributes_by_hand():
    w = [0.7245, 0.2129, 0.0626]
    # 217 > 150 is capped; the other 150 tokens split 0.2129 : 0.0626 -> 115.9, 34.1
    assert proportional(w, 300, low=20, high=[150] * 3) == [150, 116, 34]
    # the floors take 120, so the first layer gets 180, not its cap of 200
    assert proportional([0.9, 0.05, 0.05], 300, low=60, high=[200] * 3) == [180, 60, 60]
    assert proportional([0.5, 0.5], 10, low=8, high=[100] * 2) == [8, 8]  # infeasible total: every layer at its floor


@pytest.mark.exercise("variance_softmax")
def test_unclamped_allocation_is_eq5_as_written():
    """clamp_budgets=false: S_l = softmax(-F_v)_l * L * b, rounded to the total, no bounds.
    F_v = [0, 1, 2], b = 10, L = 3: 30 * [1, e^-1, e^-2] / 1.5032 = [19.96, 7.34, 2.70] -> [20, 7, 3];
    clamped to [8, 12] the first layer stops at 12, the third at 8, the second takes the rest."""
    for clamp, want in [(False, [20, 7, 3]), (True, [12, 10, 8])]:
        got = split([0.0, 1.0, 2.0], "paper", 10, 12, low=8, clamp=clamp)
        assert got == want, f"Eq. 5 as written (`split`, clamp={clamp}): want {want}, got {got}"


def test_unclamped_eq5_that_starves_a_layer_is_a_clear_error():
    """On a prompt whose raw variances differ, Eq. 5 (z-scored) leaves a layer fewer tokens than its 4 sinks."""
    model = random_model(L=4)
    policy = make_policy("d2o", 16, variant="paper", allocation="zscore", clamp_budgets=False)
    with pytest.raises(KvminiError, match=r"d2o: a budget of \d+ tokens \(layer \d\) is too small for 4 sinks"):
        with torch.no_grad():
            prefill(model, torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(0)), model.new_cache(), policy)


def exact_clamped_split(weights, total, low, high):
    """The real-valued answer, found without bisection: sum_l clamp(lam * w_l, low, high) is piecewise
    linear in lam with breakpoints low / w_l and high / w_l; find the segment holding `total`, solve it."""
    f = lambda lam: sum(min(max(lam * w, low), high) for w in weights)  # noqa: E731
    points = sorted({0.0} | {low / w for w in weights} | {high / w for w in weights})
    for a, b in zip(points, points[1:]):
        if f(a) <= total <= f(b):
            lam = a if f(b) == f(a) else a + (total - f(a)) * (b - a) / (f(b) - f(a))  # linear on [a, b]
            return [min(max(lam * w, low), high) for w in weights]
    return [high] * len(weights) if total >= f(points[-1]) else [low] * len(weights)


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.floats(0.001, 1), min_size=1, max_size=12), b=st.integers(1, 300),
       low=st.integers(1, 40), n=st.integers(1, 500))
def test_allocation_is_the_clamped_proportional_split(weights, b, low, n):
    """The total is kept, bounds hold, and every layer is within one token of the exact clamped
    proportional split (computed above by a different method)."""
    L, low = len(weights), min(low, n)
    S = proportional(weights, b * L, low, [n] * L)
    total = max(min(b * L, n * L), low * L)
    assert sum(S) == total and all(low <= s <= n for s in S)
    for got, exact in zip(S, exact_clamped_split(weights, total, low, n)):
        assert abs(got - exact) < 1 + 1e-6


def test_exact_ties_go_to_the_earliest_layer_whatever_the_weights_scale():
    """`round_to_total`'s tie rule: remainders equal in exact arithmetic give their tokens to the earliest layers,
    by hand, and the same split for weights rescaled by any factor (float error differs, the rule does not)."""
    assert proportional([1, 1, 1], 10, 0, [100] * 3) == [4, 3, 3]  # 3.33 each: the first takes the extra token
    assert proportional([2, 1, 1], 10, 0, [100] * 3) == [5, 3, 2]  # 5, 2.5, 2.5: layer 1 before layer 2
    assert proportional([1, 3, 1, 3], 12, 0, [100] * 4) == [2, 5, 1, 4]  # 1.5, 4.5, 1.5, 4.5: layers 0 and 1
    rng = random.Random(0)
    changed = []
    for case in range(3000):
        L = rng.randint(2, 12)
        weights = [rng.randint(1, 5) for _ in range(L)]  # small integers: many exact ties
        total, low = rng.randint(L, 40 * L), rng.randint(0, 3)
        high = [rng.choice([10**6, rng.randint(low + 1, 60)]) for _ in range(L)]
        want = proportional(weights, total, low, high)
        for c in (3.0, 0.1, 1e-3, 7.7, 1 / 3):
            if proportional([w * c for w in weights], total, low, high) != want:
                changed.append((weights, total, low, high, c))
    assert not changed, f"`proportional` split {len(changed)} rescaled cases otherwise, e.g. {changed[:2]}"


def test_allocation_regression_rounding_near_the_cap():
    """Found by Hypothesis: the big layers want 348.7 of a 349 cap; rounding must not look like a clamp."""
    S = proportional([0.1328125, 0.1328125, 0.001, 0.001, 0.001, 0.001], 708, 1, [349] * 6)
    assert sum(S) == 708 and S[:2] in ([349, 348], [348, 349], [349, 349]) and all(2 <= s <= 3 for s in S[2:])


# --- EMA-threshold merging -------------------------------------------------------------------

# What a failure of the checks below names: the threshold is Eq. 10's, the keys and values Eq. 9's choice and
# Eq. 11-12's merge (each function's own check, `test_eq*_alone`, says which of them is wrong)
TAU = "Eq. 10 (`ema_threshold`, fed by Eq. 9's similarities): the threshold after this step"
KEYS = lambda m: f"Eq. 9 and 11-12 (`nearest` chooses, `convex_merge` writes): the kept keys. {m}"  # noqa: E731
VALUES = lambda m: f"Eq. 11-12 (`convex_merge`, on Eq. 9's choices): the kept values. {m}"  # noqa: E731

def toy_cache(keys, values):
    lc = LayerCache(1, 1, 2, torch.float32, "cpu", capacity=8)
    for t, (k, v) in enumerate(zip(keys, values)):
        lc.append(torch.tensor(k).view(1, 1, 1, 2), torch.tensor(v).view(1, 1, 1, 2), torch.tensor([[t]]))
    return lc


@pytest.mark.exercise("ema_merging")
def test_eq9_nearest_alone():
    """Eq. 9 (`nearest`) by itself: evicted k3 = (1, 0.5) and k4 = (-1, 0) against kept k0 = (1, 0), k1 = (0, 3).
    k3's cosines are 1/sqrt(1.25) = 2/sqrt(5) to k0 and 1.5/(3 sqrt(1.25)) = 1/sqrt(5) to k1: its nearest is k0
    (k1's norm 3 divided out: without it, k1 would win at 3/sqrt(5)); k4's are -1 and 0: k1 at 0."""
    kept = torch.tensor([[1.0, 0.0], [0.0, 3.0]]).view(1, 1, 2, 2)
    best, j = nearest(torch.tensor([[1.0, 0.5], [-1.0, 0.0]]).view(1, 1, 2, 2), kept)
    assert_equal(j[0, 0].tolist(), [0, 1], "Eq. 9 (`nearest`): the nearest kept key of each evicted key, "
                 "by cosine (each kept key's norm divided out)")
    torch.testing.assert_close(best[0, 0], torch.tensor([2 / math.sqrt(5), 0.0]),
                               msg=lambda m: f"Eq. 9 (`nearest`): the cosine of each evicted key to its nearest. {m}")


@pytest.mark.exercise("ema_merging")
def test_eq9_nearest_takes_the_earlier_key_on_a_tie():
    """Eq. 9's argmax on a tie (tutorial 4: the earlier key): kept k0 = (0, 1), k1 = (1, 0), k2 = (0, 1).
    Evicted (1, 1) is at 1/sqrt(2) from all three, (0, 2) at 1 from k0 and k2: both choose k0."""
    kept = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]).view(1, 1, 3, 2)
    best, j = nearest(torch.tensor([[1.0, 1.0], [0.0, 2.0]]).view(1, 1, 2, 2), kept)
    assert_equal(j[0, 0].tolist(), [0, 0], "Eq. 9 (`nearest`): on a tie, the earlier kept key")
    torch.testing.assert_close(best[0, 0], torch.tensor([1 / math.sqrt(2), 1.0]),
                               msg=lambda m: f"Eq. 9 (`nearest`): the cosine of each evicted key to its nearest. {m}")


@pytest.mark.exercise("ema_merging")
def test_eq9_nearest_never_chooses_an_excluded_key():
    """Eq. 9 with `exclude` (a decode step: the victim may not choose itself): evicted (1, 0.1) against
    k0 = (1, 0), k1 = (0, 1), k0 excluded: its nearest is k1 at 0.1/sqrt(1.01), not k0 at 1/sqrt(1.01)."""
    kept = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    best, j = nearest(torch.tensor([[1.0, 0.1]]).view(1, 1, 1, 2), kept, exclude=torch.tensor([[[[True, False]]]]))
    assert_equal(j[0, 0].tolist(), [1], "Eq. 9 (`nearest`, k0 excluded): the nearest key allowed")
    torch.testing.assert_close(best[0, 0], torch.tensor([0.1 / math.sqrt(1.01)]), msg=lambda m: (
        f"Eq. 9 (`nearest`, k0 excluded): the cosine to the nearest key allowed. {m}"))


@pytest.mark.exercise("ema_merging")
@pytest.mark.parametrize("beta", [0.0, 0.7, 1.0])
def test_eq10_ema_threshold_alone(beta):
    """Eq. 10 (`ema_threshold`) by itself: tau_0 is the given mean (no earlier threshold), then
    tau_t = beta * new + (1 - beta) * tau_{t-1}."""
    new, old = torch.tensor([[0.9]]), torch.tensor([[0.5]])
    assert_equal(ema_threshold(None, new, beta), new, "Eq. 10 (`ema_threshold`): tau_0, `new` itself")
    want = beta * 0.9 + (1 - beta) * 0.5
    assert ema_threshold(old, new, beta).item() == pytest.approx(want), \
        f"Eq. 10 (`ema_threshold`): tau_t for beta {beta}, want {want:.3f}, got {ema_threshold(old, new, beta).item():.3f}"


@pytest.mark.exercise("ema_merging")
def test_eq11_12_convex_merge_alone():
    """Eq. 11-12 (`convex_merge`) by itself: kept x0 = (1, 0), x1 = (0, 1); evicted x2 = (1, 0.1) and x3 = (1, -0.1)
    both chose x0 with u = 0.9 and merge; x4 = (5, 5) chose x1 with u = 0.2 but is not marked (below tau), so x1
    stays. x0 <- (e x0 + e^0.9 (x2 + x3)) / (e + 2 e^0.9) = (1, 0): weights that sum to 1."""
    keep = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    evict = torch.tensor([[1.0, 0.1], [1.0, -0.1], [5.0, 5.0]]).view(1, 1, 3, 2)
    j_star, best = torch.tensor([[[0, 0, 1]]]), torch.tensor([[[0.9, 0.9, 0.2]]])
    got = convex_merge(keep, evict, j_star, best, torch.tensor([[[True, True, False]]]))
    torch.testing.assert_close(got[0, 0, 0], torch.tensor([1.0, 0.0]), msg=lambda m: (
        "Eq. 11-12 (`convex_merge`): kept token 0, into which two evicted tokens merge (softmax weights over "
        f"itself, e^1, and each one's own e^u, summing to 1). {m}"))
    torch.testing.assert_close(got[0, 0, 1], torch.tensor([0.0, 1.0]), msg=lambda m: (
        f"Eq. 11-12 (`convex_merge`): kept token 1, chosen only by a token not marked to merge, must stay. {m}"))


@pytest.mark.exercise("ema_merging")
def test_eq11_12_convex_merge_at_a_low_similarity():
    """Eq. 11-12 (`convex_merge`) at a similarity far from 1: kept x0 = (1, 0); evicted x1 = (0, 1) chose it with
    u = 0.5 and merges. Softmax weights over {x0 (similarity 1), x1}: w_c = e / (e + e^0.5) = 0.62246,
    w_1 = e^0.5 / (e + e^0.5) = 0.37754, so x0 <- (0.62246, 0.37754). Linear weights u / (u + 1) would give
    (0.667, 0.333); a merge that drops the kept token (the mean of the merged ones) (0, 1)."""
    w_c, w_1 = math.e / (math.e + math.exp(0.5)), math.exp(0.5) / (math.e + math.exp(0.5))
    assert (w_c, w_1) == pytest.approx((0.62246, 0.37754), abs=1e-5)  # the hand computation itself
    got = convex_merge(torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[[0.0, 1.0]]]]), torch.tensor([[[0]]]),
                       torch.tensor([[[0.5]]]), torch.tensor([[[True]]]))
    torch.testing.assert_close(got[0, 0, 0], torch.tensor([w_c, w_1]), msg=lambda m: (
        "Eq. 11-12 (`convex_merge`): kept token 0 after one token merges into it at u = 0.5: want "
        f"(e, e^0.5) / (e + e^0.5) = ({w_c:.5f}, {w_1:.5f}), got {got[0, 0, 0].tolist()}. {m}"))


@pytest.mark.exercise("ema_merging")
def test_d2o_merge_by_hand():
    """Keep k0 = (1, 0) and k1 = (0, 1); evict k2 = (1, 0.1) and k3 = (-1, 0).
    cos(k2, k0) = 1/sqrt(1.01) = 0.995 (its nearest), cos(k3, .) = -1, 0 (nearest k1, similarity 0).
    tau_0 = (0.995 + 0) / 2: k2 merges into k0, k3 is dropped.
    Weights (Eq. 12): w_c = e / (e + e^0.995), w_2 = e^0.995 / (e + e^0.995)."""
    lc = toy_cache([(1, 0), (0, 1), (1, 0.1), (-1, 0)], [(1, 2), (5, 6), (3, 4), (7, 8)])
    merge = EMAMerge(beta=0.7)
    merged = merge(0, lc, torch.tensor([[[0, 1]]]))
    u = 1 / math.sqrt(1.01)
    assert merge.tau[0].item() == pytest.approx(u / 2), TAU
    w_c, w_2 = math.e / (math.e + math.exp(u)), math.exp(u) / (math.e + math.exp(u))
    assert (w_c, w_2) == pytest.approx((0.50124, 0.49876), abs=1e-5)  # the hand computation itself
    torch.testing.assert_close(lc.keys[0, 0, 0], torch.tensor([w_c + w_2, 0.1 * w_2]), msg=KEYS)
    torch.testing.assert_close(lc.values[0, 0, 0], torch.tensor([w_c * 1 + w_2 * 3, w_c * 2 + w_2 * 4]), msg=VALUES)
    torch.testing.assert_close(lc.keys[0, 0, 1], torch.tensor([0.0, 1.0]), msg=KEYS)  # k3 was not similar enough
    torch.testing.assert_close(lc.values[0, 0, 1], torch.tensor([5.0, 6.0]), msg=VALUES)
    assert merged.item() == 1.0, f"Eq. 10 (`ema_threshold`): tokens merged (k2 only), got {merged.item()}"


@pytest.mark.exercise("ema_merging")
def test_two_evicted_tokens_merge_into_one_kept_token_convexly():
    """Eq. 11-12 when two tokens merge into the same kept one: keep k0 = (1, 0) and k1 = (0, 1); evict
    k2 = (1, 0.1) and k3 = (1, -0.1), both nearest k0 with u = 1/sqrt(1.01), so tau_0 = u and both merge.
    Softmax weights over {k0 (similarity 1), k2, k3}: w_c = e / (e + 2 e^u), w_2 = w_3 = e^u / (e + 2 e^u),
    summing to 1, so the merged key is (1, 0). Eq. 12 read with the sum over E_j in the numerator
    (each w_i = sum e^u / ...) would give (e + 4 e^u) / (e + 2 e^u) = 1.50 as the key's first coordinate."""
    lc = toy_cache([(1, 0), (0, 1), (1, 0.1), (1, -0.1)], [(1, 2), (5, 6), (3, 4), (5, 8)])
    merged = EMAMerge(beta=0.7)(0, lc, torch.tensor([[[0, 1]]]))
    u = 1 / math.sqrt(1.01)
    den = math.e + 2 * math.exp(u)
    w_c, w_i = math.e / den, math.exp(u) / den
    assert w_c + 2 * w_i == pytest.approx(1.0)  # the hand computation itself
    assert merged.item() == 2.0, f"Eq. 10 (`ema_threshold`): tokens merged (k2 and k3), got {merged.item()}"
    torch.testing.assert_close(lc.keys[0, 0, 0], torch.tensor([1.0, 0.0]), msg=lambda m: (  # 0.1 w_2 - 0.1 w_3 = 0
        f"Eq. 11-12 (`convex_merge`): kept token 0's key after two tokens merge into it (convex: (1, 0)). {m}"))
    torch.testing.assert_close(lc.values[0, 0, 0], torch.tensor([w_c * 1 + w_i * (3 + 5), w_c * 2 + w_i * (4 + 8)]), msg=VALUES)


@stored
def literal_merge(keys, values, keep, tau):
    """Eq. 9-12 with loops: nearest kept key by cosine, merge iff similarity >= tau, softmax weights with j's own e^1."""
    # BEGIN REFERENCE
    unit = lambda x: x / x.norm()  # noqa: E731
    evict = [i for i in range(len(keys)) if i not in keep]
    best = {i: max((float(unit(keys[i]) @ unit(keys[j])), -keep.index(j), j) for j in keep) for i in evict}
    new_k, new_v = {}, {}
    for j in keep:
        chose = [i for i in evict if best[i][2] == j and best[i][0] >= tau]
        den = math.e + sum(math.exp(best[i][0]) for i in chose)
        new_k[j] = (math.e * keys[j] + sum(math.exp(best[i][0]) * keys[i] for i in chose)) / den
        new_v[j] = (math.e * values[j] + sum(math.exp(best[i][0]) * values[i] for i in chose)) / den
    return new_k, new_v, [best[i][0] for i in evict]
    # END REFERENCE


@pytest.mark.exercise("ema_merging")
@pytest.mark.parametrize("seed", range(5))
def test_merge_equals_literal_loops_over_several_steps(seed):
    """A prefill cut then 4 decode steps (one eviction each): nearest neighbours, merges and
    tau_t = beta * max_sim_t + (1 - beta) * tau_{t-1}, all by loops."""
    gen = torch.Generator().manual_seed(seed)
    D, beta = 4, 0.7
    keys = [torch.randn(D, generator=gen) for _ in range(10)]
    values = [torch.randn(D, generator=gen) for _ in range(10)]
    lc = LayerCache(1, 1, D, torch.float32, "cpu")
    for t in range(10):
        lc.append(keys[t].view(1, 1, 1, D), values[t].view(1, 1, 1, D), torch.tensor([[t]]))
    merge, tau = EMAMerge(beta), None
    for step in range(5):
        S = lc.length
        keep = sorted(torch.randperm(S, generator=gen)[: 6 if step == 0 else S - 1].tolist())
        cur_k, cur_v = list(lc.keys[0, 0]), list(lc.values[0, 0])
        sims = literal_merge(cur_k, cur_v, keep, float("inf"))[2]  # max similarities of the evicted
        threshold = sum(sims) / len(sims) if tau is None else tau  # tau_0, else compare with tau_{t-1}
        new_k, new_v, _ = literal_merge(cur_k, cur_v, keep, threshold)
        merge(0, lc, torch.tensor([[keep]]))
        lc.keep(torch.tensor([[keep]]))
        tau = threshold if tau is None else beta * sims[0] + (1 - beta) * tau
        assert merge.tau[0].item() == pytest.approx(tau, abs=1e-6), TAU
        torch.testing.assert_close(lc.keys[0, 0], torch.stack([new_k[j] for j in keep]), atol=1e-5, rtol=0, msg=KEYS)
        torch.testing.assert_close(lc.values[0, 0], torch.stack([new_v[j] for j in keep]), atol=1e-5, rtol=0, msg=VALUES)
        if step < 4:
            t = 10 + step
            k, v = torch.randn(D, generator=gen), torch.randn(D, generator=gen)
            lc.append(k.view(1, 1, 1, D), v.view(1, 1, 1, D), torch.tensor([[t]]))


@pytest.mark.exercise("ema_merging")
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_beta_extremes(beta):
    """beta 0: tau never moves from tau_0; beta 1: tau is the latest maximum similarity."""
    lc = toy_cache([(1, 0), (0, 1), (1, 0.1), (-1, 0), (1, 1)], [(0, 0)] * 5)
    merge = EMAMerge(beta)
    merge(0, lc, torch.tensor([[[0, 1, 4]]]))  # prefill: evict k2, k3
    tau_0 = merge.tau[0].item()
    torch.testing.assert_close(lc.keys[0, 0, 1], torch.tensor([0.0, 1.0]), msg=lambda m: (
        "Eq. 11-12 (`convex_merge`): kept k1, chosen only by k3 (similarity 0, below tau_0), must stay as it was; "
        f"the threshold judgment is the merge's `merge` mask. {m}"))
    lc.keep(torch.tensor([[[0, 1, 4]]]))
    merge(0, lc, torch.tensor([[[0, 2]]]))  # a decode step evicts k1 = (0, 1): nearest (1, 1), cos 0.707
    assert merge.tau[0].item() == pytest.approx(tau_0 if beta == 0 else 1 / math.sqrt(2)), \
        f"Eq. 10 (`ema_threshold`): tau after a decode step with beta {beta}"


# --- the whole method, and a new composition ----------------------------------------------------

KVMINI = {"variant": "paper", "allocation": "zscore"}  # kvmini's own reading of Eq. 5 (z-scored variances)


@stored
def literal_budgets(F_v, b, n, low, how="zscore"):
    """Eq. 5 by hand, on z-scored variances (`zscore`) or raw ones (`paper`): softmax(-z) or softmax(-F_v),
    the clamped proportional split of L * b (exact_clamped_split), integers by largest remainder."""
    # BEGIN REFERENCE
    mean = sum(F_v) / len(F_v)
    std = math.sqrt(sum((f - mean) ** 2 for f in F_v) / len(F_v))
    e = [math.exp(-(f - mean) / std) if how == "zscore" else math.exp(-f) for f in F_v]
    weights = [x / sum(e) for x in e]
    exact = exact_clamped_split(weights, b * len(F_v), min(low, b), max(n, b))
    floors = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[: b * len(F_v) - sum(floors)]:
        floors[i] += 1
    return floors
    # END REFERENCE

@stored
def literal_variances(model, ids):
    """F_v per layer from the prompt's full attention (tests/reference.py), by Eq. 4 written out."""
    # BEGIN REFERENCE
    variances = []

    def record(layer, c, probs, kept, new):
        g = model.config.num_heads // model.config.num_kv_heads  # query heads per KV head
        col = group_mean(probs, g)[0].sum(1)  # (H_kv, n): column sums per KV head
        per_head = [sum((x - sum(row) / len(row)) ** 2 for x in row) / len(row) for row in col.tolist()]
        variances.append(sum(per_head) / len(per_head))
        return [[sorted(s + new) for s in kept[0]]]

    simulate(model, [ids], record)
    return variances
    # END REFERENCE


def test_d2o_budgets_follow_eq5_and_hold_during_decode():
    model = random_model(L=4, H=4, H_kv=2, seed=3, sharp=2.0)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(2))
    policy = make_policy("d2o", 0.5, **KVMINI)
    cache = model.new_cache(1, 4)
    policy.start(40, 46)
    with torch.no_grad():
        model(ids, cache, policy)
        want = literal_budgets(literal_variances(model, ids), 20, 40, 8)
        assert policy.budgets == want and sum(want) == 80 and len(set(want)) > 1
        assert cache.lengths() == want
        for t in range(6):
            model(torch.tensor([[t + 1]]), cache, policy)
            assert cache.lengths() == want  # one eviction (or merge) per decode step
    assert sum(policy.merged) > 0
    for lc, S_l in zip(cache.layers, want):
        pos = sorted(lc.positions[0, 0].tolist())
        M = (S_l - 4) // 4  # N:M = 3:1 of the non-sink budget
        assert pos[:4] == [0, 1, 2, 3] and pos[len(pos) - M :] == list(range(46 - M, 46))


@pytest.mark.exercise("variance_softmax")
def test_paper_variant_budgets_follow_eq5_as_printed():
    """The paper variant on a random model: each layer's budget is Eq. 5 as printed on that layer's F_v
    (Eq. 4 written out), split and clamped by hand (`literal_budgets(..., how="paper")`)."""
    model = random_model(L=4, H=4, H_kv=2, seed=3, sharp=2.0)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(2))
    policy = make_policy("d2o", 0.5, variant="paper", merge="off")  # (merging is exercise ema_merging)
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        prefill(model, ids, cache, policy)
    want = literal_budgets(literal_variances(model, ids), 20, 40, 8, "paper")
    assert policy.budgets == want, f"Eq. 4-5 as printed (`attention_variance`, `layer_weights`): want {want}, got {policy.budgets}"


def test_d2o_allocation_alternatives_and_short_prompts():
    model = random_model(L=4, seed=3)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for allocation in ("uniform", "reciprocal"):
            policy = make_policy("d2o", 0.5, **{**KVMINI, "allocation": allocation})
            prefill(model, ids, model.new_cache(1), policy)
            assert sum(policy.budgets) == 80
        uniform = make_policy("d2o", 0.5, **{**KVMINI, "allocation": "uniform"})
        prefill(model, ids, model.new_cache(1), uniform)
        assert uniform.budgets == [20] * 4
        short = make_policy("d2o", 128, **KVMINI)  # a 6-token prompt, shorter than sinks + windows: nothing to do
        short.start(6, 6)
        logits = model(ids[:, :6], model.new_cache(1), short)
        assert torch.equal(logits, model(ids[:, :6]))
        with pytest.raises(KvminiError, match="too small for 4 sinks"):  # 3 tokens cannot hold 4 sinks
            prefill(model, ids[:, :6], model.new_cache(1), make_policy("d2o", 3, **KVMINI))
        half = make_policy("d2o", 0.5, **KVMINI)  # a share of a short prompt is raised to what works instead
        prefill(model, ids[:, :6], model.new_cache(1), half)
        assert half.run.note == "budget raised from 3 to 5 tokens per layer, the least d2o can keep"


def test_deferred_allocation_completes_with_protected_layers():
    """Layers 0 and L-1 never compressed: the other layers are measured, budgeted (Eq. 5 over them,
    L-2 layers sharing (L-2) * b) and compressed after the last measured layer."""
    model = random_model(L=4, H=4, H_kv=2, seed=3, sharp=2.0)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(2))
    policy = make_policy("d2o", 0.5, variant="paper", allocation="zscore", merge="off", protected_layers="0,3")
    cache = model.new_cache(1)
    prefill(model, ids, cache, policy)
    lengths = cache.lengths()
    assert lengths[0] == lengths[3] == 40 and policy.budgets[0] == policy.budgets[3] == 40
    assert lengths[1] + lengths[2] == 2 * 20 and lengths[1:3] == policy.budgets[1:3]


def test_variance_softmax_composes_with_snapkv_scoring():
    """A combination no paper ran: D2O's layer allocation with SnapKV's pooled window scores."""
    model = random_model(L=4, H=4, H_kv=2, seed=5, sharp=2.0)
    ids = torch.randint(0, 61, (1, 48), generator=torch.Generator().manual_seed(4))
    policy = make_policy("snapkv_d2o", 16, window=4, kernel=3)  # its merges change no budget nor kept position
    cache = model.new_cache(1)
    prefill(model, ids, cache, policy)
    want = literal_budgets(literal_variances(model, ids), 16, 48, 8)
    assert policy.budgets == want and cache.lengths() == want and sum(want) == 64 and len(set(want)) > 1
    for lc in cache.layers:  # SnapKV keeps its observation window
        assert lc.positions[0, 0, -4:].tolist() == [44, 45, 46, 47]


# --- the authors' code (AIoT-MLSys-Lab/D2O), written out ----------------------------------------

def literal_official_budgets(v, b, n, L, parts, low):
    """softmax(-v) L rho, clamped to [0.01, 1], times n + 1 (the first decode step's length); the
    heavy and recent parts floored separately; kvmini's floor of `low` tokens."""
    N, M = parts
    e = [math.exp(-x) for x in v]
    shares = [min(max(x / sum(e) * L * b / n, 0.01), 1.0) * (n + 1) for x in e]
    return [max(int(x * N / (N + M)) + int(x * M / (N + M)), low) for x in shares]


def d2o_official_literal(g, L, b, n, sinks, parts, protected, low):
    """The official schedule with loops, merging off: nothing is compressed in the prompt; F_v per
    query head (unbiased variance of the column sums, min-max across the layer's heads, mean); at
    the first decode step every unprotected layer keeps its 4 sinks (inside the N heavy), its top
    scores and its M recent tokens, scores = attention summed over every query so far."""
    v, acc, budgets = {}, {}, {}

    def choose(layer, c, probs, kept, new):
        P = group_mean(probs, g)[0]  # (H_kv, T, N): per KV head, for the scores
        for h in range(P.shape[0]):
            for p in sorted(kept[0][h] + new):
                acc[layer, h, p] = acc.get((layer, h, p), 0.0) + P[h, :, p].sum().item()
        if c == 0:
            col = probs[0].sum(1)  # (H, n): column sums of every query head
            var = [sum((x - sum(row) / len(row)) ** 2 for x in row) / (len(row) - 1) for row in col.tolist()]
            v[layer] = sum((x - min(var)) / (max(var) - min(var) + 1e-6) for x in var) / len(var)
            return [[sorted(s + new) for s in kept[0]]]
        if not budgets:
            budgets.update(enumerate(literal_official_budgets([v[l] for l in range(L)], b, n, L, parts, low)))
        rows = []
        for h, s in enumerate(kept[0]):
            cand = sorted(s + new)
            S = budgets[layer]
            if layer in protected or len(cand) <= S:
                rows.append(cand)
                continue
            recent = S * parts[1] // sum(parts)
            middle = cand[sinks : len(cand) - recent]
            heavy = sorted(middle, key=lambda p: (-acc[layer, h, p], p))[: S - sinks - recent]
            rows.append(cand[:sinks] + sorted(heavy) + cand[len(cand) - recent :])
        return [rows]
    return choose, budgets


@pytest.mark.parametrize("L,protected,clamp", [(4, "0,1,-1", True), (3, "", True), (3, "", False)])
def test_official_schedule_allocation_and_split_equal_a_literal_run(L, protected, clamp):
    """clamp=False: the authors' budgets with only their own int() floors and 1% floor (no sinks + 4)."""
    model = random_model(L=L, H=4, H_kv=2, seed=3, sharp=2.0)
    gen = torch.Generator().manual_seed(2)
    n = 40
    calls = [torch.randint(0, 61, (1, n), generator=gen)] + [torch.randint(0, 61, (1, 1), generator=gen)
                                                            for _ in range(4)]
    policy = make_policy("d2o", 16, variant="official", merge="off", protected_layers=protected, clamp_budgets=clamp)
    cache = model.new_cache(1, 4)
    policy.start(n, n + 4)
    got, after = [], []
    with torch.no_grad():
        for ids in calls:
            got.append(model(ids, cache, policy)[:, -1])
            after.append([lc.positions.sort(dim=-1).values.tolist() for lc in cache.layers])
    prot = tuple(int(x) % L for x in protected.split(",") if x)
    choose, budgets = d2o_official_literal(2, L, 16, n, 4, (1, 1), prot, 8 if clamp else 0)
    want, entering = simulate(model, calls + calls[-1:], choose)  # one more call: what the last one kept
    for a, w in zip(got, want):  # evict == mask, the prompt uncompressed, then every step
        torch.testing.assert_close(a, w, atol=1e-5, rtol=0)
    assert entering[1] == [[[list(range(n))] * 2] for _ in range(L)]  # nothing compressed in the prompt
    for c in range(len(calls)):
        assert after[c] == entering[c + 1], f"call {c}"
    for l, lc in enumerate(cache.layers):
        assert lc.length == (n + 4 if l in prot else budgets[l])
    if not prot:
        assert len(set(budgets.values())) > 1  # the layers really differ


@stored
def literal_official_merge(keys, values, keep, tau_prev, beta):
    """The authors' merge with loops, several KV heads: per head the nearest kept key by cosine;
    one threshold per layer (EMA of the mean best similarity over heads and evicted tokens); an
    evicted slot merges when its similarity averaged over the heads reaches it; then
    x_j <- (x_j + sum_i u_ij x_i) / (1 + |E_j|)."""
    # BEGIN REFERENCE
    H = len(keys)
    unit = lambda x: x / x.norm()  # noqa: E731
    evict = [[i for i in range(len(keys[h])) if i not in keep[h]] for h in range(H)]
    best = [[max((float(unit(keys[h][i]) @ unit(keys[h][j])), -keep[h].index(j), j) for j in keep[h])
             for i in evict[h]] for h in range(H)]
    mean_best = sum(u for h in range(H) for u, _, _ in best[h]) / sum(len(e) for e in evict)
    tau = mean_best if tau_prev is None else beta * mean_best + (1 - beta) * tau_prev
    E = len(evict[0])
    chosen = [sum(best[h][e][0] for h in range(H)) / H >= tau for e in range(E)]
    new_k, new_v = [], []
    for h in range(H):
        k_h, v_h = {}, {}
        for j in keep[h]:
            into = [e for e in range(E) if chosen[e] and best[h][e][2] == j]
            k_h[j] = (keys[h][j] + sum(best[h][e][0] * keys[h][evict[h][e]] for e in into)) / (1 + len(into))
            v_h[j] = (values[h][j] + sum(best[h][e][0] * values[h][evict[h][e]] for e in into)) / (1 + len(into))
        new_k.append(torch.stack([k_h[j] for j in keep[h]]))
        new_v.append(torch.stack([v_h[j] for j in keep[h]]))
    return torch.stack(new_k), torch.stack(new_v), tau
    # END REFERENCE


def random_cache(heads: int, D: int, n: int, gen: torch.Generator) -> LayerCache:
    """n entries at positions 0..n-1 with random keys and values."""
    lc = LayerCache(1, heads, D, torch.float32, "cpu")
    for t in range(n):
        lc.append(torch.randn(1, heads, 1, D, generator=gen), torch.randn(1, heads, 1, D, generator=gen),
                  torch.tensor([[t]]))
    return lc


@pytest.mark.exercise("ema_merging")
@pytest.mark.parametrize("seed", range(4))
def test_official_merge_equals_literal_loops_over_several_heads_and_steps(seed):
    """The official weights and per-layer threshold (Eq. 9-12 as the authors' code does them) over four
    compressions of three heads equal a literal loop over every evicted token: threshold, keys, values."""
    gen = torch.Generator().manual_seed(seed)
    H, D, beta = 3, 4, 0.5
    lc = random_cache(H, D, 10, gen)
    merge, tau = EMAMerge(beta, weights="official", tau="per_layer"), None
    for step in range(4):
        S = lc.length
        keep = [sorted(torch.randperm(S, generator=gen)[: 6 if step == 0 else S - 1].tolist()) for _ in range(H)]
        keys = [list(lc.keys[0, h]) for h in range(H)]
        values = [list(lc.values[0, h]) for h in range(H)]
        want_k, want_v, tau = literal_official_merge(keys, values, keep, tau, beta)
        merge(0, lc, torch.tensor([keep]))
        lc.keep(torch.tensor([keep]))
        assert merge.tau[0].item() == pytest.approx(tau, abs=1e-6), TAU
        torch.testing.assert_close(lc.keys[0], want_k, atol=1e-5, rtol=0, msg=KEYS)
        torch.testing.assert_close(lc.values[0], want_v, atol=1e-5, rtol=0, msg=VALUES)
        lc.append(torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen),
                  torch.tensor([[10 + step]]))


@pytest.mark.exercise("ema_merging")
def test_paper_merge_over_several_kv_heads_equals_loops_per_head():
    """The paper's merge is per KV head: each head alone equals the one-head loop (literal_merge)."""
    gen = torch.Generator().manual_seed(5)
    H, D = 3, 4
    lc = LayerCache(1, H, D, torch.float32, "cpu")
    for t in range(9):
        lc.append(torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen), torch.tensor([[t]]))
    keep = [sorted(torch.randperm(9, generator=gen)[:5].tolist()) for _ in range(H)]
    keys = [list(lc.keys[0, h].clone()) for h in range(H)]  # copies: the merge writes the cache in place
    values = [list(lc.values[0, h].clone()) for h in range(H)]
    merge = EMAMerge(0.7)
    merge(0, lc, torch.tensor([keep]))
    for h in range(H):
        sims = literal_merge(keys[h], values[h], keep[h], float("inf"))[2]
        new_k, new_v, _ = literal_merge(keys[h], values[h], keep[h], sum(sims) / len(sims))
        assert merge.tau[0][0, h].item() == pytest.approx(sum(sims) / len(sims), abs=1e-6), TAU
        torch.testing.assert_close(lc.keys[0, h, keep[h]], torch.stack([new_k[j] for j in keep[h]]), atol=1e-5, rtol=0, msg=KEYS)
        torch.testing.assert_close(lc.values[0, h, keep[h]], torch.stack([new_v[j] for j in keep[h]]), atol=1e-5,
                                   rtol=0, msg=VALUES)


def after_evict_one(items: list, victim: int) -> list:
    """A buffer after `LayerCache.evict_one(victim)`, by hand: the last entry takes the victim's slot."""
    out = list(items)
    out[victim] = out[-1]
    return out[:-1]


@pytest.mark.exercise("ema_merging")
@pytest.mark.parametrize("seed", range(4))
def test_one_eviction_merge_equals_literal_loops_paper(seed):
    """A decode step (`EMAMerge.one`: the victim evicted, only its nearest entry written) equals the
    loops of Eq. 9-12 with every other entry kept, over several steps in a mixed buffer order."""
    gen = torch.Generator().manual_seed(seed)
    D, beta = 4, 0.7
    lc = random_cache(1, D, 8, gen)
    merge, tau = EMAMerge(beta), None
    for step in range(5):
        S = lc.length
        victim = int(torch.randint(0, S, (1,), generator=gen))
        cur_k, cur_v = list(lc.keys[0, 0].clone()), list(lc.values[0, 0].clone())
        keep = [j for j in range(S) if j != victim]
        sim = literal_merge(cur_k, cur_v, keep, float("inf"))[2][0]
        tau = sim if tau is None else beta * sim + (1 - beta) * tau  # tau_t, compared with this step's
        new_k, new_v, _ = literal_merge(cur_k, cur_v, keep, tau)
        merge.one(0, lc, torch.tensor([[victim]]), 7 + step)
        assert merge.tau[0].item() == pytest.approx(tau, abs=1e-6), TAU
        want_k = after_evict_one([new_k.get(j, cur_k[j]) for j in range(S)], victim)
        want_v = after_evict_one([new_v.get(j, cur_v[j]) for j in range(S)], victim)
        torch.testing.assert_close(lc.keys[0, 0], torch.stack(want_k), atol=1e-5, rtol=0, msg=KEYS)
        torch.testing.assert_close(lc.values[0, 0], torch.stack(want_v), atol=1e-5, rtol=0, msg=VALUES)
        lc.append(torch.randn(1, 1, 1, D, generator=gen), torch.randn(1, 1, 1, D, generator=gen),
                  torch.tensor([[8 + step]]))


@pytest.mark.exercise("ema_merging")
@pytest.mark.parametrize("seed", range(4))
def test_one_eviction_merge_equals_literal_loops_official(seed):
    """The authors' per-layer threshold and scatter-mean, one eviction per head per step, several heads."""
    gen = torch.Generator().manual_seed(seed)
    H, D, beta = 3, 4, 0.5
    lc = random_cache(H, D, 8, gen)
    merge, tau = EMAMerge(beta, weights="official", tau="per_layer"), None
    for step in range(4):
        S = lc.length
        victims = torch.randint(0, S, (H,), generator=gen).tolist()
        keys = [list(lc.keys[0, h].clone()) for h in range(H)]
        values = [list(lc.values[0, h].clone()) for h in range(H)]
        keep = [[j for j in range(S) if j != victims[h]] for h in range(H)]
        want_k, want_v, tau = literal_official_merge(keys, values, keep, tau, beta)  # (H, S-1, D) in keep order
        merge.one(0, lc, torch.tensor([victims]), 7 + step)
        assert merge.tau[0].item() == pytest.approx(tau, abs=1e-6), TAU
        for h in range(H):
            by_index = dict(zip(keep[h], range(S - 1)))  # buffer index -> row of want
            order = after_evict_one(list(range(S)), victims[h])
            torch.testing.assert_close(lc.keys[0, h], want_k[h, [by_index[j] for j in order]], atol=1e-5, rtol=0, msg=KEYS)
            torch.testing.assert_close(lc.values[0, h], want_v[h, [by_index[j] for j in order]], atol=1e-5, rtol=0, msg=VALUES)
        lc.append(torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen),
                  torch.tensor([[8 + step]]))


@pytest.mark.exercise("ema_merging")
def test_nearest_reads_given_norms_and_never_chooses_an_excluded_pair():
    """Eq. 9 against torch's own cosine: `nearest` finds each evicted key's most similar key, the same with
    the keys' norms given; with each one's nearest excluded, it finds the second most similar."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        k_evict = torch.randn(2, 3, 7, 8, generator=gen, dtype=dtype)  # (B, H_kv, E, D)
        keys = torch.randn(2, 3, 11, 8, generator=gen, dtype=dtype)  # (B, H_kv, S, D)
        u = F.cosine_similarity(k_evict[:, :, :, None], keys[:, :, None], dim=-1)  # (B, H_kv, E, S)
        order = u.sort(-1, descending=True)
        tol = dict(rtol=0, atol=8 * torch.finfo(dtype).eps)
        for norms in (None, keys.norm(dim=-1)):
            best, j = nearest(k_evict, keys, norms)
            given = "given" if norms is not None else "computed"
            assert_equal(j, order.indices[..., 0], f"Eq. 9 (`nearest`, norms {given}, {dtype}): the nearest kept key j*")
            torch.testing.assert_close(best, order.values[..., 0], **tol, msg=lambda m, g=given, d=dtype: (
                f"Eq. 9 (`nearest`, norms {g}, {d}): the similarity u to j*. {m}"))
        first = torch.zeros_like(u, dtype=torch.bool).scatter_(3, order.indices[..., :1], True)
        best, j = nearest(k_evict, keys, exclude=first)
        assert_equal(j, order.indices[..., 1], f"Eq. 9 (`nearest`, each nearest excluded, {dtype}): j*")
        torch.testing.assert_close(best, order.values[..., 1], **tol, msg=lambda m, d=dtype: (
            f"Eq. 9 (`nearest`, each nearest excluded, {d}): the similarity u to j*. {m}"))


@pytest.mark.parametrize("writes", ["keys", "values"])
def test_a_merge_that_writes_one_side_leaves_the_other(writes):
    """writes="keys" (or "values"): the by-hand merge above on that side, the other side as it was:
    the bulk merge and a decode step's single merge alike."""
    keys, values = [(1, 0), (0, 1), (1, 0.1), (-1, 0)], [(1, 2), (5, 6), (3, 4), (7, 8)]
    both, one = toy_cache(keys, values), toy_cache(keys, values)
    EMAMerge(beta=0.7)(0, both, torch.tensor([[[0, 1]]]))
    EMAMerge(beta=0.7, writes=writes)(0, one, torch.tensor([[[0, 1]]]))
    as_before = toy_cache(keys, values)
    written, kept = (one.keys, one.values) if writes == "keys" else (one.values, one.keys)
    torch.testing.assert_close(written[0, 0, :2], (both.keys if writes == "keys" else both.values)[0, 0, :2])
    torch.testing.assert_close(kept[0, 0, :2], (as_before.values if writes == "keys" else as_before.keys)[0, 0, :2])
    for lc, w in ((toy_cache(keys, values), "both"), (toy_cache(keys, values), writes)):  # one step: evict k2
        EMAMerge(beta=0.7, writes=w).one(0, lc, torch.tensor([[2]]), newest=3)
        if w == "both":
            k_both, v_both = lc.keys.clone(), lc.values.clone()
    as_before.evict_one(2)  # the step evicts k2: k3 takes its slot
    torch.testing.assert_close(lc.keys, k_both if writes == "keys" else as_before.keys)
    torch.testing.assert_close(lc.values, v_both if writes == "values" else as_before.values)
    assert not torch.equal(k_both, as_before.keys) and not torch.equal(v_both, as_before.values)  # k2 merged into k0


@pytest.mark.parametrize("weights", ["paper", "official"])
def test_a_decode_step_merges_its_one_token_by_hand(weights):
    """A decode step's Eq. 11-12 is the prompt's merge with E = 1 (one evicted token i, its nearest entry j); by
    hand at u = 0.5: paper w_i = e^0.5 / (e^0.5 + e) = 0.37754, w_j = 0.62246; official 0.25 and 0.5; a token
    that does not merge leaves j as it was."""
    combine = convex_merge if weights == "paper" else scatter_mean_merge
    one, zero = (torch.full((1, 2, 1, 1), v, dtype=torch.float64) for v in (1.0, 0.0))  # (B, H_kv, 1, 1)
    half, merges, j = torch.full((1, 2, 1), 0.5, dtype=torch.float64), torch.tensor([[[True], [False]]]), torch.zeros(1, 2, 1, dtype=torch.long)
    w_j, w_i = combine(one, zero, j, half, merges), combine(zero, one, j, half, merges)  # x_j's weight, x_i's
    hand = (0.37754, 0.62246) if weights == "paper" else (0.25, 0.5)
    assert w_i.flatten().tolist() == pytest.approx([hand[0], 0.0], abs=1e-5)
    assert w_j.flatten().tolist() == pytest.approx([hand[1], 1.0], abs=1e-5)
