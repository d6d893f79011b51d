"""DynamicKV's progressive layer budgets against a literal Alg. 1 run on a masked simulation."""
import pytest
import torch

from kvmini.errors import KvminiError
from kvmini.generate import prefill
from kvmini.methods.registry import make_policy
from cases import stored
from checks import assert_equal
from reference import group_mean, random_model, simulate

# BEGIN REFERENCE
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
# END REFERENCE


@stored
def dynamickv_reference(model, calls, *literal):
    """What Alg. 1 written out keeps and computes over `calls`, and its Z history (`literal_dynamickv(*literal)`)."""
    # BEGIN REFERENCE
    choose, after_layer, history = literal_dynamickv(*literal)
    return (*simulate(model, calls, choose, after_layer), history)
    # END REFERENCE


@pytest.mark.exercise("progressive_budgets")
def test_eq5_6_reallocate_counts_by_hand():
    """`reallocate`'s Eq. 5-6 alone: 2 finished layers, 2 KV heads, window w = 1, mean budget w_t = 3, so the top
    k = (w_t - w) * H_kv * l = 8 keys over every head of both layers (layer 0 holds one key fewer: -inf).
    Sorted: .9 .8 .7 .6 .5 in layer 0, .4 .35 .3 in layer 1 -> C = [5, 3]."""
    from kvmini.methods.progressive_budgets import reallocate

    inf = float("inf")
    A0 = torch.tensor([[[0.9, 0.8, 0.7, -inf], [0.6, 0.5, 0.0, -inf]]])  # (1, H_kv, n - w): layer 0, 3 keys held
    A1 = torch.tensor([[[0.4, 0.3, 0.0, 0.0], [0.35, 0.2, 0.1, 0.05]]])  # layer 1, 4 keys held
    C, _ = reallocate([A0, A1], [4, 5], n=5, w=1, w_t=3, L=3)
    assert C == [5, 3], f"Eq. 5-6 (`reallocate`): C, each finished layer's count among the top (w_t - w) * H_kv * l = 8 " \
        f"scores over every head of every finished layer: want [5, 3], got {C}"


@pytest.mark.exercise("progressive_budgets")
def test_eq7_8_reallocate_budgets_by_hand():
    """`reallocate`'s Eq. 7-8 alone, on the counts C = [5, 3] above: the finished layers share (w_t - w) * L = 6
    tokens beyond the window, 5 : 3 = 3.75 : 2.25, each capped at what it holds beyond the window (held - w =
    3 and 4): layer 0 stops at 3 and hands its excess on, so Z = [3, 3]."""
    from kvmini.methods.progressive_budgets import reallocate

    inf = float("inf")
    A0 = torch.tensor([[[0.9, 0.8, 0.7, -inf], [0.6, 0.5, 0.0, -inf]]])
    A1 = torch.tensor([[[0.4, 0.3, 0.0, 0.0], [0.35, 0.2, 0.1, 0.05]]])
    C, Z = reallocate([A0, A1], [4, 5], n=5, w=1, w_t=3, L=3)
    if C == [5, 3]:  # else Eq. 5-6's own check says what is wrong
        assert Z == [3, 3], f"Eq. 7-8 (`reallocate`): Z, (w_t - w) * L = 6 tokens split 5 : 3 over the finished layers, " \
            f"each capped at held - w = [3, 4] and the excess handed on: want [3, 3], got {Z}"


@pytest.mark.parametrize("L,m,w_t,r_max,tail", [(4, 2, 12, 10, True), (5, 2, 12, 10, True), (5, 3, 10, 2, True),
                                                (3, 4, 9, 3, True), (5, 2, 12, 10, False), (5, 3, 10, 2, False)])
@pytest.mark.exercise("progressive_budgets")
def test_engine_equals_literal_algorithm_1(L, m, w_t, r_max, tail):
    """The whole method on a random model of L layers, re-allocating every m (Eq. 5-8), keeps the tokens,
    and gives the logits, of Alg. 1 written out as a loop (`literal_dynamickv`), L mod m != 0 included."""
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
    want, entering, history = dynamickv_reference(model, calls, n, w_t, ws, kernel, r_max, m, L, 2, tail)
    updates = [l for l in range(1, L + 1) if l % m == 0 or (l == L and tail)]
    assert_equal(len(history), len(updates), "Eq. 5-8 (`reallocate`): re-allocations, one every m layers (and the tail)")
    if tail:
        assert sum(history[-1]) == (w_t - ws) * L, \
            f"Eq. 5-8 (`reallocate`): the last re-allocation hands out (w_t - w_s) L = {(w_t - ws) * L}, got {sum(history[-1])}"
        assert policy.budgets == [z + ws for z in history[-1]], \
            f"Eq. 5-8 (`reallocate`): the last re-allocation's budgets, want {[z + ws for z in history[-1]]}, got {policy.budgets}"
        assert sum(policy.budgets) == w_t * L, f"Eq. 5-8 (`reallocate`): the budgets sum to {sum(policy.budgets)}, not w_t L"
    else:  # the last L % m layers keep b_s + w_s, the finished ones their share of the whole total
        bs, done = min(int(r_max * (w_t - ws)), n - ws), len(history[-1])
        assert policy.budgets[done:] == [bs + ws] * (L - done), \
            f"Eq. 5-8 (`reallocate`): the {L - done} unfinished layers keep b_s + w_s = {bs + ws}, got {policy.budgets[done:]}"
        assert policy.budgets[:done] == [z + ws for z in history[-1]], \
            f"Eq. 5-8 (`reallocate`): the finished layers' budgets, want {[z + ws for z in history[-1]]}, got {policy.budgets[:done]}"
    for l, lc in enumerate(cache.layers):
        assert_equal(lc.positions.sort(dim=-1).values[:, :, :-1].tolist(), entering[-1][l],
                     f"Eq. 5-8 (`reallocate`, then the cut to each layer's budget): the tokens layer {l} keeps")
    for c, (a, b) in enumerate(zip(got, want)):  # evict == mask, through prefill and 3 decode steps
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m, c=c: f"the logits of call {c} over the kept cache. {m}")


def test_budget_must_exceed_the_window():
    model = random_model()
    with pytest.raises(KvminiError, match="must exceed the window of 8"):
        with torch.no_grad():
            prefill(model, torch.zeros(1, 40, dtype=torch.long), model.new_cache(1), make_policy("dynamickv", 8))


@stored
def authors_dynamickv(probs: list[torch.Tensor], ws: int, kernel: int, r_max: float, base: int, m: int):
    """DreamMr/DynamicKV (dynamic_v11.py) in the shape of its code, per query head, on the prompt's
    attention probs[l] (1, H, n, n) of each layer: budget_compute_per_layer keeps the attn_cache topk
    (descending) + the window; update_and_reset_budget every m layers floors with int(), tops up the
    last count after the last layer, gives the remainder to the last layer, caps at n - ws and slices
    each buffer's first fix_length entries (into the window, duplicating it, if fix_length is larger).
    Returns per layer and head the set of kept positions."""
    # BEGIN REFERENCE
    L, (_, H, n, _) = len(probs), probs[0].shape
    budget_size = min(int(r_max * base), n - ws)
    attn, buffers = [], []  # per layer: attn_cache (1, H, n - ws); per head the buffer's positions in order
    for l in range(1, L + 1):
        attn_sum = probs[l - 1][:, :, -ws:, :-ws].sum(dim=-2)
        attn_cache = torch.nn.functional.avg_pool1d(attn_sum, kernel_size=kernel, padding=kernel // 2, stride=1)
        indices = attn_cache.topk(budget_size, dim=-1).indices  # (1, H, budget_size), best first
        attn.append(attn_cache)
        buffers.append([indices[0, h].tolist() + list(range(n - ws, n)) for h in range(H)])
        if l % m:
            continue
        gather_attn = torch.cat([t.unsqueeze(0) for t in attn], dim=0)  # (l, 1, H, n - ws)
        tk = base * H * gather_attn.shape[0]
        _, topk_indices = torch.topk(gather_attn.view(-1), k=min(tk, gather_attn.numel()))
        dim1 = gather_attn.shape[1] * gather_attn.shape[2] * gather_attn.shape[3]
        counts = torch.zeros(gather_attn.shape[0], dtype=torch.long).scatter_add_(
            0, topk_indices // dim1, torch.ones_like(topk_indices)) // gather_attn.shape[0]
        if torch.sum(counts).item() != dim1 and l == L:
            counts[-1] += tk // L - torch.sum(counts)
        norm = [t / torch.sum(counts).item() for t in counts]
        fix = [int((budget_size * t).item()) for t in norm]
        ss_radio = sum(fix) / (base * L)
        fix = [int(k // ss_radio) for k in fix]
        fix[-1] += base * L - sum(fix)
        for i, fix_length in enumerate(fix):
            fix_length = min(fix_length, gather_attn.shape[3])
            buffers[i] = [row[:fix_length] + row[-ws:] for row in buffers[i]]
    return [[sorted(set(row)) for row in layer] for layer in buffers]
    # END REFERENCE


@pytest.mark.exercise("progressive_budgets")
@pytest.mark.parametrize("L,m,w_t,r_max", [(4, 2, 10, 3), (6, 2, 12, 2), (4, 4, 10, 3), (6, 4, 9, 10)])
def test_rounding_floor_keeps_what_the_authors_code_keeps(L, m, w_t, r_max):
    """One KV head per query head (g = 1), so the authors' per-query-head cache is kvmini's per-KV-head one."""
    n, ws, kernel = 40, 4, 3
    model = random_model(L=L, H=2, H_kv=2, seed=L * m, sharp=2.0)
    ids = torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(m))
    probs = {}

    def record(layer, c, p, kept, new):
        probs[layer] = p
        return [[sorted(s + new) for s in row] for row in kept]

    simulate(model, [ids], record)
    want = authors_dynamickv([probs[l] for l in range(L)], ws, kernel, r_max, w_t - ws, m)
    policy = make_policy("dynamickv", w_t, variant="official", window=ws, kernel=kernel, r_max=r_max, interval=m)
    cache = model.new_cache(1, n)
    prefill(model, ids, cache, policy)
    for l, lc in enumerate(cache.layers):
        got = lc.positions[0].sort(-1).values.tolist()
        assert got == want[l], (f"Eq. 5-8, the authors' rounding (`reallocate`, variant official): the tokens layer {l} keeps, "
                                f"want {want[l]}, got {got}")


def test_algorithm_1_rounding_by_hand():
    """Alg. 1 lines 6-10 on C = [30, 10], b_s = 40, (w_t - w_s) L = 8 * 4: normalised by the largest count,
    BL = [int(40 * 30/30), int(40 * 10/30)] = [40, 13], r = 53 / 32, Z = [int(40 / r), int(13 / r)] = [24, 7];
    the authors' code normalises by the sum and hands the remainder to the last layer: [24, 8]."""
    from kvmini.methods.progressive_budgets import alg1_budgets, floor_budgets

    assert alg1_budgets([30, 10], 40, 8, 4) == [24, 7]
    assert floor_budgets([30, 10], 40, 8, 4, cap=100, heads=1) == [24, 8]
    assert alg1_budgets([0, 0], 40, 8, 4) == [0, 0]


def test_rounding_alg1_is_the_one_the_engine_runs(monkeypatch):
    from kvmini.methods import dynamickv

    calls = []
    original = dynamickv.alg1_budgets
    monkeypatch.setattr(dynamickv, "alg1_budgets", lambda *a: calls.append(a) or original(*a))
    model = random_model(L=4, H=2, H_kv=2, seed=3)
    cache = model.new_cache(1, 40)
    with torch.no_grad():
        prefill(model, torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(0)), cache,
                make_policy("dynamickv", 10, rounding="alg1", window=4, kernel=3, r_max=3, interval=2))
    assert [len(a[0]) for a in calls] == [2, 4]  # re-allocations after layers 1 and 3 (0-based), over 2 and 4 layers
    kept = [lc.length for lc in cache.layers]
    Z = original(*calls[-1])
    assert kept == [min(z + 4, 3 * 6 + 4) for z in Z]  # each layer: its Z + the window, never more than b_s + w_s


def test_eq7_8_split_of_tutorial_7_by_hand():
    """Tutorial 7's worked numbers: C = [30, 10, 5, 5] shares 32 tokens as 32 C / 50 = [19.2, 6.4, 3.2, 3.2]
    -> [19, 7, 3, 3] (the last token to the largest remainder); layer 0 capped at 15 leaves 17 split
    10 : 5 : 5 = [8.5, 4.25, 4.25] -> [9, 4, 4]."""
    from kvmini.methods.allocators import proportional

    assert proportional([30, 10, 5, 5], 32, 0, [100] * 4) == [19, 7, 3, 3]
    assert proportional([30, 10, 5, 5], 32, 0, [15, 100, 100, 100]) == [15, 9, 4, 4]


def test_uniform_allocation_is_snapkv_with_dynamickv_window():
    """layer_budgets=uniform switches the progressive re-allocation off: every layer keeps the mean budget,
    chosen by the same window scores, which is SnapKV with DynamicKV's window (8) and kernel (7)."""
    model = random_model(L=4)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(3))
    kept = {}
    for spec, opts in (("dynamickv", {"layer_budgets": "uniform"}), ("snapkv", {"window": 8})):
        cache = model.new_cache(1)
        prefill(model, ids, cache, make_policy(spec, 16, **opts))
        kept[spec] = [lc.positions.sort(-1).values for lc in cache.layers]
    assert [len(p[0, 0]) for p in kept["dynamickv"]] == [16] * 4
    for a, b in zip(kept["dynamickv"], kept["snapkv"]):
        assert torch.equal(a, b)
    cache = model.new_cache(1)
    prefill(model, ids, cache, make_policy("dynamickv", 16))
    assert len({lc.length for lc in cache.layers}) > 1  # progressive: the layers differ (what the option switches off)
