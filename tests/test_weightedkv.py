"""WeightedKV's convex value merging: the paper's Fig. 3 toy run by hand, and Alg. 1 written literally."""
import pytest
import torch
import torch.nn.functional as F

from kvmini.cache import LayerCache
from kvmini.generate import prefill
from kvmini.methods.convex_value_merge import convex_value_merge
from kvmini.methods.registry import make_policy
from cases import stored
from checks import assert_equal
from reference import group_mean, in_position_order, random_model

E = torch.eye(8)  # v_t = e_t, so a merged value shows its mixing weights directly


def append_token(lc: LayerCache, t: int) -> None:
    """Token t (1-based) with key 10 * e_t and value e_t."""
    lc.append(10 * E[t - 1].view(1, 1, 1, 8), E[t - 1].view(1, 1, 1, 8), torch.tensor([[t]]))


def set_average_attention(lc: LayerCache, abar: list[float]) -> None:
    lc.declare("a", "n")
    lc.aux("a")[:] = torch.tensor(abar).view(1, 1, -1)
    lc.aux("n")[:] = 1.0


def toy_layer(a: list[float], n: list[float]) -> LayerCache:
    """One head holding positions 0..S-1, key 10 e_t and value e_t (its mixing weights show), and Alg. 1's a and n."""
    lc = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=8)
    for t in range(len(a)):
        lc.append(10 * E[t].view(1, 1, 1, 8), E[t].view(1, 1, 1, 8), torch.tensor([[t]]))
    lc.declare("a", "n")
    lc.aux("a")[:] = torch.tensor(a).view(1, 1, -1)
    lc.aux("n")[:] = torch.tensor(n).view(1, 1, -1)
    return lc


ONE_MERGE = [  # (what it tells apart, a, n, sinks, j deleted, the weights of v_{j+1} after the merge)
    # line 7: abar = a / n with n > 1: [.9, .2, .3, .25, .9], so j = 1 (a alone would pick 2) into 2: .4 v_1 + .6 v_2
    ("line 7, abar = a / n", [0.9, 0.6, 0.3, 0.5, 0.9], [1, 3, 1, 2, 1], 0, 1, {1: 0.4, 2: 0.6}),
    # line 8: a tie of abar at positions 1 and 2 goes to the earliest, 1, merged into 2 half and half
    ("line 8, a tie to the earliest", [0.5, 0.2, 0.2, 0.6, 0.9], [1] * 5, 0, 1, {1: 0.5, 2: 0.5}),
    # line 9: abar_j = abar_{j+1} = 0 is 0/0 read literally: kvmini gives each half (and no NaN)
    ("line 9, two zero averages", [0.5, 0.0, 0.0, 0.6, 0.9], [1] * 5, 0, 1, {1: 0.5, 2: 0.5}),
    # line 8's range: with 1 sink, position 1 is the first j may be, here the lowest: .1 / .6 v_1 + .5 / .6 v_2
    ("line 8, the first position after the sinks", [0.9, 0.1, 0.5, 0.6, 0.9], [1] * 5, 1, 1, {1: 1 / 6, 2: 5 / 6}),
]


@pytest.mark.exercise("convex_value_merge")
def test_alg1_one_merge_by_hand():
    """One merge of `convex_value_merge` (five entries to a capacity of 4, recent window 1) on inputs that tell
    the readings of Alg. 1 lines 7-9 apart: n > 1, a tie, two zero averages, the lowest just after the sinks."""
    for case, a, n, sinks, j, weights in ONE_MERGE:
        lc = toy_layer(a, n)
        convex_value_merge(lc, capacity=4, sinks=sinks, recent=1)
        kept = lc.positions.flatten().tolist()
        want = [p for p in range(5) if p != j]
        assert kept == want, f"Alg. 1 {case} (`convex_value_merge`): j = {j} is deleted, want {want} kept, got {kept}"
        got = lc.values[0, 0, kept.index(j + 1)]
        want_v = sum(w * E[p] for p, w in weights.items())
        assert torch.allclose(got, want_v, atol=1e-6), (f"Alg. 1 {case} (`convex_value_merge`): v_{j + 1} becomes "
                                                         f"{want_v[:5].tolist()}, got {got[:5].tolist()}")


@pytest.mark.exercise("convex_value_merge")
def test_fig3_toy_run_with_cache_size_4():
    """Fig. 3 / Sec. III-B: at step 5 v2 (abar 0.1) merges into v3 (0.5) as v2/6 + 5 v3/6; after step 8
    the cache holds v3, v6, v7, v8, with v3 and v6 each carrying three values. The scores of steps
    6-8 are our own (the figure's are not in the text), chosen to give that end state."""
    lc = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=8)
    for t in range(1, 5):
        append_token(lc, t)
    steps = {5: [0.3, 0.1, 0.5, 0.4, 0.6], 6: [0.2, 0.5, 0.45, 0.6, 0.7], 7: [0.5, 0.2, 0.3, 0.6, 0.9],
             8: [0.5, 0.1, 0.4, 0.8, 0.9]}
    for t, abar in steps.items():
        append_token(lc, t)
        set_average_attention(lc, abar)
        convex_value_merge(lc, capacity=4, sinks=0, recent=1)  # Alg. 1: j < m, the newest never merges
        if t == 5:
            assert lc.positions.flatten().tolist() == [1, 3, 4, 5], \
                f"Alg. 1 (`convex_value_merge`): the positions kept after step 5, got {lc.positions.flatten().tolist()}"
            torch.testing.assert_close(lc.values[0, 0, 1], E[1] / 6 + 5 * E[2] / 6, msg=lambda m: (
                f"Alg. 1 line 9 (`convex_value_merge`): v3's value after v2 merges into it, v2/6 + 5 v3/6. {m}"))
    v = lc.values[0, 0]
    assert lc.positions.flatten().tolist() == [3, 6, 7, 8], \
        f"Alg. 1 (`convex_value_merge`): the positions kept after step 8, got {lc.positions.flatten().tolist()}"
    v3 = 2 / 7 * E[0] + 5 / 7 * (E[1] / 6 + 5 * E[2] / 6)  # step 6: v1 (0.2) into v3' (0.5)
    v5 = 0.4 * E[3] + 0.6 * E[4]  # step 7: v4 (0.2) into v5 (0.3)
    v6 = 0.2 * v5 + 0.8 * E[5]  # step 8: v5' (0.1) into v6 (0.4)
    for pos, got, want in zip((3, 6, 7, 8), v, [v3, v6, E[6], E[7]]):
        torch.testing.assert_close(got, want, msg=lambda m, pos=pos: f"Alg. 1 line 9 (`convex_value_merge`): v{pos}'s value. {m}")
        assert abs(got.sum().item() - 1) < 1e-6, f"Alg. 1 line 9 (`convex_value_merge`): v{pos}'s weights sum to {got.sum().item()}, not 1"
    torch.testing.assert_close(lc.keys[0, 0], 10 * E[[2, 5, 6, 7]], msg=lambda m: (  # keys are never merged, only dropped
        f"Alg. 1 (`convex_value_merge`): the kept keys, which are only dropped, never merged. {m}"))


@pytest.mark.exercise("convex_value_merge")
def test_sinks_and_recent_window_are_never_merged_away():
    """Seven tokens into a capacity of 5 with 2 sinks and 2 recent (the weakest ones): only tokens 3-5
    may merge; 5 merges into 6, then 4 into 6, each value a convex combination (worked below)."""
    lc = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=8)
    for t in range(1, 8):
        append_token(lc, t)
    lc.positions.sub_(1)  # positions 0-6, as in a cache: the sinks are the positions below `sinks`
    set_average_attention(lc, [0.01, 0.02, 0.9, 0.8, 0.7, 0.03, 0.04])  # sinks and recent are the weakest
    convex_value_merge(lc, capacity=5, sinks=2, recent=2)
    # mergeable: tokens 3, 4, 5. First 5 (0.7) merges into 6; then 4 (0.8) merges into 6.
    got = (lc.positions + 1).flatten().tolist()
    assert got == [1, 2, 3, 6, 7], f"Alg. 1 line 8 (`convex_value_merge`): the tokens kept, want [1, 2, 3, 6, 7], got {got}"
    v6 = (0.7 * E[4] + 0.03 * E[5]) / 0.73
    torch.testing.assert_close(lc.values[0, 0, 3], (0.8 * E[3] + 0.03 * v6) / 0.83, msg=lambda m: (
        f"Alg. 1 line 9 (`convex_value_merge`): token 6's value after 5, then 4, merge into it. {m}"))
    torch.testing.assert_close(lc.values[0, 0, [0, 1, 2, 4]], E[[0, 1, 2, 6]], msg=lambda m: (
        f"Alg. 1 line 8 (`convex_value_merge`): the values of the sinks and of the recent token 7, untouched. {m}"))


@stored
@torch.no_grad()
def literal_alg1(model, ids: torch.Tensor, m: int, sinks: int, recent: int):
    """Alg. 1 token by token with Python lists per (layer, batch, KV head): keys, values, positions, a, n."""
    # BEGIN REFERENCE
    from kvmini.model import apply_rope

    cfg = model.config
    B, N = ids.shape
    g, D = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    new = lambda: [[[] for _ in range(cfg.num_kv_heads)] for _ in range(B)]  # noqa: E731
    K, V, P, A, C = ([new() for _ in range(cfg.num_layers)] for _ in range(5))
    logits = []
    for t in range(N):
        angles = torch.tensor([[float(t)]]) * model.inv_freq
        angles = torch.cat((angles, angles), -1)
        x = model.model.embed_tokens(ids[:, t : t + 1])  # (B, 1, C)
        for l, block in enumerate(model.model.layers):
            attn = block.self_attn
            h = block.input_layernorm(x)
            q = apply_rope(attn.q_proj(h).view(B, 1, -1, D).transpose(1, 2), angles.cos(), angles.sin())
            k = apply_rope(attn.k_proj(h).view(B, 1, -1, D).transpose(1, 2), angles.cos(), angles.sin())
            v = attn.v_proj(h).view(B, 1, -1, D).transpose(1, 2)
            out = torch.zeros(B, cfg.num_heads, 1, D)
            probs = torch.zeros(B, cfg.num_heads, 1, len(K[l][0][0]) + 1)
            for b in range(B):
                for hk in range(cfg.num_kv_heads):
                    K[l][b][hk].append(k[b, hk, 0]); V[l][b][hk].append(v[b, hk, 0]); P[l][b][hk].append(t)
                    A[l][b][hk].append(0.0); C[l][b][hk].append(0.0)  # Alg. 1 lines 4-5: [a, 0], [n, 0]
                for hq in range(cfg.num_heads):
                    hk = hq // g
                    p = (torch.stack(K[l][b][hk]) @ q[b, hq, 0] / D**0.5).softmax(-1)
                    probs[b, hq, 0] = p
                    out[b, hq, 0] = p @ torch.stack(V[l][b][hk])
            mean = group_mean(probs, g)[:, :, 0]  # (B, H_kv, S)
            for b in range(B):
                for hk in range(cfg.num_kv_heads):
                    a, n, vals = A[l][b][hk], C[l][b][hk], V[l][b][hk]
                    for j in range(len(a)):
                        a[j] += mean[b, hk, j].item()  # line 4
                        n[j] += 1  # line 5
                    if len(vals) > m:  # line 6
                        abar = [a[j] / n[j] for j in range(len(a))]  # line 7
                        j = min(range(sinks, len(a) - max(recent, 1)), key=lambda i: abar[i])  # line 8
                        vals[j + 1] = (abar[j] * vals[j] + abar[j + 1] * vals[j + 1]) / (abar[j] + abar[j + 1])  # 9
                        for lst in (K[l][b][hk], vals, P[l][b][hk], a, n):  # line 10
                            del lst[j]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, 1, -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        logits.append(model.lm_head(model.model.norm(x))[:, -1])
    return logits, P, V
    # END REFERENCE


@pytest.mark.exercise("convex_value_merge")
def test_chunk_size_1_is_algorithm_1_literally():
    model = random_model(L=2, H=4, H_kv=2, seed=11)
    ids = torch.randint(0, 61, (2, 26), generator=torch.Generator().manual_seed(3))
    m, n_prompt = 12, 14
    policy = make_policy("weightedkv", m, sinks=2, recent=3)
    cache = model.new_cache(2, 4)
    policy.start(n_prompt, 26)
    with torch.no_grad():
        got = [model(ids[:, t : t + 1], cache, policy)[:, -1] for t in range(26)]
    want, positions, values = literal_alg1(model, ids, m, sinks=2, recent=3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for l, lc in enumerate(cache.layers):
        held, _, held_values = in_position_order(lc)
        assert held.tolist() == positions[l]
        torch.testing.assert_close(held_values, torch.stack([torch.stack([torch.stack(h) for h in row])
                                                           for row in values[l]]), atol=1e-5, rtol=0)
    assert sum(policy.evicted) == 2 * (26 - m)


def test_chunked_prompt_keeps_capacity_and_default_windows():
    model = random_model(seed=2)
    policy = make_policy("weightedkv", 40)
    recent, sinks = policy.recent, policy.sinks
    assert recent(1024) == 508 and recent(256) == 124 and sinks == 4
    ids = torch.randint(0, 61, (1, 150), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1)
    prefill(model, ids, cache, policy)  # 150 tokens in chunks of 64: merged down after each chunk
    assert cache.lengths() == [40, 40, 40]
    assert policy.chunk_for(150, 150) == 64 and policy.chunk_for(30, 39) is None  # a no-op budget: one call
    for lc in cache.layers:
        pos = lc.positions[0, 0].tolist()
        assert pos[:4] == [0, 1, 2, 3] and pos[-16:] == list(range(134, 150))  # sinks, (40 - 8) // 2 recent


@pytest.mark.exercise("convex_value_merge")
def test_the_newest_token_is_never_merged_even_without_a_recent_window():
    """Alg. 1 line 8 merges j into j + 1 for j < m: the newest token, here the weakest, is never merged away."""
    lc = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=8)
    for t in range(1, 4):
        append_token(lc, t)
    set_average_attention(lc, [0.5, 0.4, 0.1])  # the newest token is the weakest
    convex_value_merge(lc, capacity=2, sinks=0, recent=0)  # Alg. 1 line 8: j in 0..m-1
    got = lc.positions.flatten().tolist()
    assert got == [1, 3], f"Alg. 1 line 8 (`convex_value_merge`): the tokens kept (the newest stays), want [1, 3], got {got}"
    torch.testing.assert_close(lc.values[0, 0, 1], (0.4 * E[1] + 0.1 * E[2]) / 0.5, msg=lambda m: (
        f"Alg. 1 line 9 (`convex_value_merge`): the newest token's value after token 2 merges into it. {m}"))


def test_counts_of_a_chunk_follow_the_causal_mask():
    """A chunk of 3 queries at positions 5, 6, 7: older keys are seen 3 times, new keys 3, 2 and 1 times."""
    from kvmini.methods.weightedkv import attended

    lc = LayerCache(1, 1, 8, torch.float32, "cpu")
    for t in [1, 3, 5, 6, 7]:
        append_token(lc, t)
    lc.declare("a", "n")
    attended(lc, torch.tensor([[[0.5, 1.0, 1.5, 0.4, 0.1]]]), start=5, T=3)
    assert lc.aux("n").tolist() == [[[3, 3, 3, 2, 1]]]
    torch.testing.assert_close(lc.aux("a"), torch.tensor([[[0.5, 1.0, 1.5, 0.4, 0.1]]]))


def scrambled_copy(lc: LayerCache, perm: list) -> LayerCache:
    """The same entries (and a, n) in another buffer order."""
    out = LayerCache(1, 1, lc.values.shape[-1], torch.float32, "cpu")
    out.append(lc.keys[:, :, perm], lc.values[:, :, perm], lc.positions[:, 0, perm])
    out.declare(*lc.aux_names())
    for name in lc.aux_names():
        out.aux(name)[:] = lc.aux(name)[:, :, perm]
    return out


@pytest.mark.exercise("convex_value_merge")
@pytest.mark.parametrize("seed", range(4))
def test_a_decode_steps_merge_is_the_same_in_any_buffer_order(seed):
    """A decode step's merge (`keep_order=False`: j deleted in O(D), the last entry moved into its slot)
    on a buffer whose order is mixed (but for the sink, which eviction never moves from the first slot)
    equals the merge on the position-ordered buffer, step after step: entries are found by position.
    (Against Alg. 1 written out: test_chunk_size_1_is_algorithm_1_literally, whose steps are these.)"""
    gen = torch.Generator().manual_seed(seed)
    ordered = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=16)
    for t in range(5):  # positions from 0: the sink is position 0 (a cache always starts there)
        append_token(ordered, t)
    mixed = scrambled_copy(ordered, [0] + (torch.randperm(4, generator=gen) + 1).tolist())  # the sink stays first
    for t in range(4, 8):
        for lc in (ordered, mixed):
            if t > 4:
                append_token(lc, t)
        abar = torch.rand(ordered.length, generator=gen).tolist()
        set_average_attention(ordered, abar)
        by_pos = dict(zip(ordered.positions.flatten().tolist(), abar))
        mixed.declare("a", "n")
        mixed.aux("a")[:] = torch.tensor([by_pos[p] for p in mixed.positions.flatten().tolist()]).view(1, 1, -1)
        mixed.aux("n")[:] = 1.0
        convex_value_merge(ordered, ordered.length - 1, sinks=1, recent=2)
        convex_value_merge(mixed, mixed.length - 1, sinks=1, recent=2, newest=t, keep_order=False)
        got = ordered.positions.flatten().tolist()
        assert got == sorted(got), f"Alg. 1 (`convex_value_merge`): the buffer in position order after step {t}, got {got}"
        p, _, v = in_position_order(mixed)
        assert_equal(p.tolist(), ordered.positions.tolist(),
                     f"Alg. 1 (`convex_value_merge`, keep_order=False): the positions kept after step {t} in a scrambled buffer")
        torch.testing.assert_close(v, ordered.values, msg=lambda m, t=t: (
            f"Alg. 1 line 9 (`convex_value_merge`, keep_order=False): the values after step {t} in a scrambled buffer. {m}"))


def test_merge_runs_by_hand():
    """One chunk, capacity 4 of 7: sinks 1, recent 1. abar = [.9, .1, .2, .8, .05, .7, .6] at positions 1..7:
    delete the 3 lowest mergeable (.05, .1, .2 -> positions 5, 2, 3). The run 2, 3 merges into 4 at once,
    position 5 alone into 6 (line 9 exactly)."""
    from kvmini.methods.convex_value_merge import merge_runs

    lc = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=8)
    for t in range(1, 8):
        append_token(lc, t)
    abar = [0.9, 0.1, 0.2, 0.8, 0.05, 0.7, 0.6]
    set_average_attention(lc, abar)
    merge_runs(lc, capacity=4, sinks=1, recent=1)
    assert lc.positions.flatten().tolist() == [1, 4, 6, 7]
    torch.testing.assert_close(lc.values[0, 0, 1], (0.1 * E[1] + 0.2 * E[2] + 0.8 * E[3]) / 1.1)
    torch.testing.assert_close(lc.values[0, 0, 2], (0.05 * E[4] + 0.7 * E[5]) / 0.75)
    torch.testing.assert_close(lc.values[0, 0, [0, 3]], E[[0, 6]])
    torch.testing.assert_close(lc.keys[0, 0], 10 * E[[0, 3, 5, 6]])  # keys are only dropped


@pytest.mark.exercise("convex_value_merge")
def test_merge_runs_equals_algorithm_1_when_no_two_deleted_entries_touch():
    """`merge_runs` (all merges of a call at once) equals `convex_value_merge` (Alg. 1, one at a time) when
    the deleted entries are apart."""
    from kvmini.methods.convex_value_merge import merge_runs

    caches = []
    for _ in range(2):
        lc = LayerCache(1, 1, 8, torch.float32, "cpu", capacity=8)
        for t in range(1, 9):
            append_token(lc, t)
        set_average_attention(lc, [0.9, 0.1, 0.8, 0.2, 0.7, 0.15, 0.6, 0.5])  # lowest three: 2, 4, 6 (apart)
        caches.append(lc)
    convex_value_merge(caches[0], capacity=5, sinks=1, recent=1)
    merge_runs(caches[1], capacity=5, sinks=1, recent=1)
    got = [c.positions.flatten().tolist() for c in caches]
    assert got == [[1, 3, 5, 7, 8]] * 2, f"Alg. 1 (`convex_value_merge`, then `merge_runs`): the tokens kept, got {got}"
    torch.testing.assert_close(caches[1].values, caches[0].values, msg=lambda m: (
        f"Alg. 1 line 9: `merge_runs`' values against `convex_value_merge`'s, one merge at a time. {m}"))


@pytest.mark.exercise("convex_value_merge")
@torch.no_grad()
def test_how_far_chunked_run_merging_moves_from_algorithm_1():
    """The deviations measured: the next-token distributions of 8 teacher-forced decode steps after a
    64-token prompt at capacity 16 (the steps read the merged values; the prompt's own last logits do
    not), Alg. 1 token by token (`--chunk-size 1`) against one 64-token chunk, merged in runs (the
    default) or one by one (chunk_merge=sequential). Measured: KL 0.0059 (runs) and 0.0058 (sequential).
    A wrong run merge breaks the bounds: equal weights instead of abar, or no merge at all, give
    0.0075; the run's weights without the surviving entry's own, 0.011."""
    model = random_model(seed=7)
    ids = torch.randint(0, 61, (1, 72), generator=torch.Generator().manual_seed(8))

    @torch.inference_mode()
    def next_tokens(chunk, **options):
        policy = make_policy("weightedkv", 16, **options)
        cache = model.new_cache(1, 4)
        prefill(model, ids[:, :64], cache, policy, chunk_size=chunk, total_len=72)
        return torch.cat([model(ids[:, t : t + 1], cache, policy)[:, -1] for t in range(64, 72)]).log_softmax(-1)

    literal = next_tokens(1)  # (8, V)
    kl = {name: F.kl_div(next_tokens(None, chunk_merge=name), literal, log_target=True, reduction="sum").item() / 8
          for name in ("runs", "sequential")}
    print("KL(Alg. 1 token by token || one chunk), mean over 8 steps:", {k: round(v, 4) for k, v in kl.items()})
    assert 0 < kl["sequential"] < 0.0065 and 0 < kl["runs"] < min(0.0065, 1.1 * kl["sequential"]), (
        f"Alg. 1 (`convex_value_merge` token by token) against one chunk: KL {kl} outside (0, 0.0065), "
        "the runs' within 1.1x of the sequential merge's")


def test_merge_off_drops_the_same_tokens_and_merges_no_value():
    """value_merge=off: the tokens WeightedKV deletes (lowest a/n, sinks and window kept) are dropped, key and
    value: after one prefill chunk the same positions are held, every value as the full cache's."""
    model = random_model(L=2)
    ids = torch.randint(0, 61, (1, 48), generator=torch.Generator().manual_seed(2))
    caches = {}
    for merge in ("convex", "off", None):
        caches[merge] = model.new_cache(1)
        policy = None if merge is None else make_policy("weightedkv", 24, value_merge=merge)
        prefill(model, ids, caches[merge], policy)  # one chunk (of 64): one ranking, no merge feeds back
    for lc_w, lc_off, lc_full in zip(*(caches[m].layers for m in ("convex", "off", None))):
        assert lc_off.length == 24
        assert torch.equal(lc_w.positions.sort(-1).values, lc_off.positions.sort(-1).values)
        as_full = lambda lc: lc_full.values.gather(2, lc.positions[..., None].expand_as(lc.values))  # noqa: E731
        torch.testing.assert_close(lc_off.values, as_full(lc_off))
        assert not torch.allclose(lc_w.values, as_full(lc_w))  # WeightedKV merged values into their neighbours
