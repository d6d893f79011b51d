"""DynamicKV's progressive layer budgets against a literal Alg. 1 run on a masked simulation."""
import pytest
import torch

from kvmini.errors import KvminiError
from kvmini.methods.registry import make_policy
from reference import group_mean, random_model, simulate


def water_fill(counts, total, caps):
    """Z_i proportional to counts (Eq. 7-8) summing to `total`, none above its cap: fix the capped, repeat."""
    fixed = {}
    while True:
        free = [i for i in range(len(counts)) if i not in fixed]
        left = total - sum(fixed.values())
        weight = sum(counts[i] for i in free)
        Z = {i: left * counts[i] / weight if weight else 0.0 for i in free}
        over = {i: caps[i] for i in free if Z[i] > caps[i]}
        if not over:
            return [fixed.get(i, Z.get(i)) for i in range(len(counts))]
        fixed.update(over)


def largest_remainder(exact, total):
    floors = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    return floors


def literal_dynamickv(n, w_t, ws, kernel, r_max, m, L, g, tail=True):
    """Alg. 1 with loops. Returns the choose / after_layer pair for `simulate` and the Z history.
    tail=False is the authors' code (DreamMr/DynamicKV): no re-allocation after the last layer
    unless L is a multiple of m."""
    bs = min(int(r_max * (w_t - ws)), n - ws)
    scores = {}  # layer -> [head][position] pooled window attention over the prefix
    history = []

    def choose(layer, c, probs, kept, new):
        if c > 0:  # prefill only; decode appends
            return [[sorted(s + new) for s in row] for row in kept]
        P = group_mean(probs, g)[0]  # (H_kv, n, n)
        rows = []
        scores[layer] = []
        for h in range(P.shape[0]):
            C = [P[h, n - ws :, j].sum().item() for j in range(n - ws)]  # Eq. 1 (a sum ranks like the mean)
            pooled = [sum(C[i] for i in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= i < n - ws) / kernel
                      for j in range(n - ws)]
            scores[layer].append(pooled)
            top = sorted(sorted(range(n - ws), key=lambda j: (-pooled[j], j))[:bs])  # Eq. 3-4
            rows.append(top + list(range(n - ws, n)))
        return [rows]

    def after_layer(layer, c, kept):
        l = layer + 1
        if c > 0 or (l % m and (l != L or not tail)):
            return
        flat = [(scores[i][h][j], i) for i in range(l) for h in range(len(scores[i])) for j in range(n - ws)]
        k = (w_t - ws) * len(scores[0]) * l
        C = [0] * l
        for _, i in sorted(flat, key=lambda t: -t[0])[:k]:  # Eq. 5-6
            C[i] += 1
        held = [len(kept[i][0][0]) - ws for i in range(l)]
        Z = largest_remainder(water_fill(C, (w_t - ws) * L, held), min((w_t - ws) * L, sum(held)))  # Eq. 7-8
        history.append(Z)
        for i in range(l):
            for h, row in enumerate(kept[i][0]):
                prefix = row[: len(row) - ws]
                best = sorted(sorted(prefix, key=lambda p: (-scores[i][h][p], p))[: Z[i]])
                kept[i][0][h] = best + row[len(row) - ws :]

    return choose, after_layer, history


@pytest.mark.parametrize("L,m,w_t,r_max,tail", [(4, 2, 12, 10, True), (5, 2, 12, 10, True), (5, 3, 10, 2, True),
                                                (3, 4, 9, 3, True), (5, 2, 12, 10, False), (5, 3, 10, 2, False)])
def test_engine_equals_literal_algorithm_1(L, m, w_t, r_max, tail):
    n, ws, kernel = 48, 4, 3
    model = random_model(L=L, H=4, H_kv=2, seed=L + m, sharp=2.0)
    gen = torch.Generator().manual_seed(m)
    calls = [torch.randint(0, 61, (1, n), generator=gen)] + [torch.randint(0, 61, (1, 1), generator=gen)
                                                            for _ in range(3)]
    policy = make_policy("dynamickv", w_t, window=ws, kernel=kernel, r_max=r_max, interval=m, tail_reallocation=tail)
    cache = model.new_cache(1, 4)
    policy.start(n, n + 3)
    with torch.no_grad():
        got = [model(ids, cache, policy)[:, -1] for ids in calls]
    choose, after_layer, history = literal_dynamickv(n, w_t, ws, kernel, r_max, m, L, 2, tail)
    want, entering = simulate(model, calls, choose, after_layer)
    updates = [l for l in range(1, L + 1) if l % m == 0 or (l == L and tail)]
    assert len(history) == len(updates)  # every m layers, and the tail (L % m != 0 included) unless official
    if tail:
        assert sum(history[-1]) == (w_t - ws) * L  # totals: (w_t - w_s) L + w_s L in all
        assert policy.budgets == [z + ws for z in history[-1]]
        assert sum(policy.budgets) == w_t * L
    else:  # the last L % m layers keep b_s + w_s, the finished ones their share of the whole total
        bs = min(int(r_max * (w_t - ws)), n - ws)
        assert policy.budgets[len(history[-1]):] == [bs + ws] * (L - len(history[-1]))
        assert policy.budgets[: len(history[-1])] == [z + ws for z in history[-1]]
    for a, b in zip(got, want):  # evict == mask, through prefill and 3 decode steps
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for l, lc in enumerate(cache.layers):
        assert lc.positions.sort(dim=-1).values[:, :, :-1].tolist() == entering[-1][l]


def test_budget_must_exceed_the_window():
    model = random_model()
    with pytest.raises(KvminiError, match="must exceed the window of 8"):
        with torch.no_grad():
            model(torch.zeros(1, 40, dtype=torch.long), model.new_cache(1), make_policy("dynamickv", 8))
