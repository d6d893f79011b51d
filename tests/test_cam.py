"""CaM's cache merging (kvmini.methods.cache_merging): the hand-worked toy, Eq. 14 + Algorithm 1 written
literally (the paper's shape) and the authors' perplexity code mirrored line by line (their shape), each
against the compressor; invariants of the method run on a model."""
import math

import pytest
import torch

from kvmini.cache import LayerCache
from kvmini.methods.cache_merging import CacheMerge
from kvmini.methods.registry import make_policy
from reference import random_model
from test_decode_steps import run, same

DT = torch.float64


# --- the paper's shape: one head, Python lists, one eviction at a time (from /work/notes/ref_cam.py) -----------

class Head:
    """One head's cache in position order: pos[i], V[i] (Dv,), acc[i] (the attention it received so far)."""

    def __init__(self, pos, V, acc):
        self.pos, self.V, self.acc = list(pos), [v.clone() for v in V], list(acc)


def literal_probability(score_i, score_targets):
    """Eq. 14: clamp(Abar_i / avg(Abar_targets), 0, 1), and the ratio; 0/0 -> 0, x/0 -> 1 (kv_cache_cam.py:34-35)."""
    den = sum(score_targets) / len(score_targets)
    ratio = (math.nan if score_i == 0 else math.inf) if den == 0 else score_i / den
    return (0.0 if math.isnan(ratio) else min(max(ratio, 0.0), 1.0)), ratio


def literal_mask(p, ratio, mask, u):
    return {"bernoulli": float(u < p), "expectation": p, "threshold": float(ratio > 1), "always": 1.0}[mask]


def literal_compress(c: Head, budget, sinks, m, divide, mask, draws=None, log=None):
    """Algorithm 1 until the head holds `budget`: evict the oldest non-sink i, merge v_i into the m entries
    after it with weight M / (m or the count), delete it. draws[e]: the uniform of the e-th eviction."""
    e = 0
    while len(c.pos) > budget:
        i = sinks
        targets = list(range(i + 1, min(i + 1 + m, len(c.pos))))
        p, ratio = literal_probability(c.acc[i], [c.acc[t] for t in targets])
        M = literal_mask(p, ratio, mask, None if draws is None else draws[e])
        w = M / (m if divide == "fixed" else len(targets))
        for t in targets:
            c.V[t] = c.V[t] + w * c.V[i]
        if log is not None:
            log.append((c.pos[i], c.pos[targets[0]] if w > 0 else -1, w))
        del c.pos[i], c.V[i], c.acc[i]
        e += 1


# --- the authors' shape: generate_task/streaming_llm/kv_cache_cam.py, StartRecentKVCache_cam + slicev ----------

def official_generation_literal(q, k, v, start_size, recent_size, merge_num, sampler):
    """One head, bsz 1, one token per forward (eval_long_ppl.py:82-97); q, k given already rotated (the
    code's pos-shift RoPE is not modelled). Returns the kept positions, values (S, Dv) and accum_attn (S,)."""
    cache_size = start_size + recent_size
    N, D = q.shape
    K, V = torch.zeros(1, 1, 0, D, dtype=DT), torch.zeros(1, 1, 0, v.shape[1], dtype=DT)
    pos, accum_attn = [], None
    for t in range(N):
        K = torch.cat([K, k[t].view(1, 1, 1, D)], dim=2)
        V = torch.cat([V, v[t].view(1, 1, 1, -1)], dim=2)
        pos.append(t)
        attn_weights = torch.softmax((q[t].view(1, 1, 1, D) @ K.transpose(2, 3)) / math.sqrt(D), -1)
        seq_len = K.size(2)
        x = V
        start = seq_len - recent_size
        if accum_attn is None:  # :20-25
            accum_attn = attn_weights
        else:
            tmp = attn_weights[..., :accum_attn.shape[-1]] + accum_attn
            accum_attn = torch.cat([tmp, attn_weights[..., accum_attn.shape[-1]:]], dim=-1)
        if seq_len <= cache_size:  # :86-88
            continue
        merge_prob = accum_attn[..., start - 1] / torch.mean(accum_attn[..., start:start + merge_num], dim=-1)  # :33
        if torch.isnan(merge_prob).any():
            merge_prob[torch.isnan(merge_prob)] = 0
        merge_mask = sampler(merge_prob.clamp(min=0, max=1))  # :36
        to_merge = x[:, :, start - 1, ...] * merge_mask / merge_num  # :37
        x[:, :, start:start + merge_num, ...] += to_merge.unsqueeze(2)  # :38
        accum_attn = torch.cat([accum_attn[..., :start - 1], accum_attn[..., start:]], dim=-1)  # :40
        K = torch.cat([K[:, :, 0:start_size], K[:, :, seq_len - recent_size:seq_len]], dim=2)  # :95-110
        V = torch.cat([x[:, :, 0:start_size], x[:, :, start:seq_len]], dim=2)
        pos = pos[:start_size] + pos[start:]
    return pos, V[0, 0], accum_attn[0, 0, 0]


# --- helpers -----------------------------------------------------------------------------------------------

def layer(positions, values, acc) -> LayerCache:
    """A one-head layer cache holding `values` (S, Dv) at `positions` with accumulated attention `acc`."""
    values = torch.as_tensor(values, dtype=DT)
    lc = LayerCache(1, 1, values.shape[1], DT, "cpu")
    lc.append(torch.zeros(1, 1, len(positions), values.shape[1], dtype=DT), values[None, None],
              torch.tensor([positions]))
    lc.declare("attention_sum")
    lc.aux("attention_sum")[:] = torch.as_tensor(acc, dtype=DT)
    return lc


def by_position(lc: LayerCache, h: int = 0):
    order = lc.positions[0, h].argsort()
    return lc.positions[0, h][order].tolist(), lc.values[0, h][order], lc.aux("attention_sum")[0, h][order]


def compressor(**kw) -> CacheMerge:
    cm = CacheMerge(**kw)
    cm.start(1)
    cm.trace = []
    return cm


def toy():
    """cam.md's toy: 6 prompt tokens, causal attention rows q0..q5 summed over the queries."""
    A = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0.9, 0.1, 0, 0, 0, 0], [0.5, 0.1, 0.4, 0, 0, 0],
                      [0.4, 0.1, 0.2, 0.3, 0, 0], [0.4, 0.0, 0.2, 0.2, 0.2, 0], [0.5, 0.0, 0.1, 0.1, 0.1, 0.2]], dtype=DT)
    V = [[1, 0], [2, 4], [0, 2], [4, 0], [2, 2], [6, 4]]
    return layer(list(range(6)), V, A.sum(0))  # Abar = [3.7, 0.3, 0.9, 0.6, 0.3, 0.2]


def decode_step(cm, lc, t, value, row, b=4):
    """Token t with `value` attends with `row` over the held entries and itself (buffer order), then compress."""
    lc.append(torch.zeros(1, 1, 1, 2, dtype=DT), torch.tensor(value, dtype=DT).view(1, 1, 1, 2), torch.tensor([[t]]))
    lc.aux("attention_sum").add_(torch.tensor(row, dtype=DT))
    return cm(0, lc, lc.aux("attention_sum"), b)


# --- the toy, numbers by hand (cam.md section 6) --------------------------------------------------------------

def test_toy_paper_variant_by_hand():
    """sinks 1, budget 4, m 2, v_i / (targets), M = p. Evict 1: p = 0.3 / ((0.9 + 0.6) / 2) = 0.4, v2, v3 +=
    0.4 (2, 4) / 2 = (0.4, 0.8). Evict 2, now (0.4, 2.8): p = clamp(0.9 / 0.45) = 1, v3, v4 += (0.2, 1.4)."""
    lc, cm = toy(), compressor(sinks=1, m=2, divide="count", mask="expectation")
    merged = cm(0, lc, lc.aux("attention_sum"), 4)
    pos, V, acc = by_position(lc)
    assert pos == [0, 3, 4, 5]
    torch.testing.assert_close(V, torch.tensor([[1, 0], [4.6, 2.2], [2.2, 3.4], [6, 4]], dtype=DT))
    torch.testing.assert_close(acc, torch.tensor([3.7, 0.6, 0.3, 0.2], dtype=DT))  # a merge leaves Abar alone
    (record,) = cm.trace
    assert record.evicted.tolist() == [[[1, 2]]] and record.into.tolist() == [[[2, 3]]]  # the first targets
    torch.testing.assert_close(record.weight, torch.tensor([[[0.2, 0.5]]], dtype=DT))  # M / 2
    # decode: token 6 = (0, 6) attends [0, 0, 0.6, 0.4, 0] over 0, 3, 4, 5, 6: Abar = [3.7, 0.6, 0.9, 0.6, 0];
    # evict 3: p = 0.6 / 0.75 = 0.8, v4, v5 += 0.8 (4.6, 2.2) / 2 = (1.84, 0.88)
    merged += decode_step(cm, lc, 6, [0, 6], [0.0, 0.0, 0.6, 0.4, 0.0])
    pos, V, acc = by_position(lc)
    assert pos == [0, 4, 5, 6]
    torch.testing.assert_close(V, torch.tensor([[1, 0], [4.04, 4.28], [7.84, 4.88], [0, 6]], dtype=DT))
    torch.testing.assert_close(acc, torch.tensor([3.7, 0.9, 0.6, 0.0], dtype=DT))
    assert merged == pytest.approx(0.4 + 1 + 0.8)


def test_toy_official_variant_by_hand():
    """m 16, always / 16. Evict 1 into 2..5 (4 targets): p = 0.3 / 0.5 = 0.6, share 0.6 (2, 4) / 16 = (0.075,
    0.15). Evict 2 = (0.075, 2.15) into 3..5: p = clamp(0.9 / (1.1 / 3)) = 1, share (0.0046875, 0.134375).
    Decode: evict 3 = (4.0796875, 0.284375) into 4, 5, 6: p = clamp(0.6 / 0.5) = 1, share / 16; the new token
    receives it too."""
    lc, cm = toy(), compressor(sinks=1, m=16, divide="fixed", mask="expectation")
    cm(0, lc, lc.aux("attention_sum"), 4)
    v3 = [4 + 0.075 + 0.0046875, 0.15 + 0.134375]
    torch.testing.assert_close(by_position(lc)[1], torch.tensor(
        [[1, 0], v3, [2.0796875, 2.284375], [6.0796875, 4.284375]], dtype=DT))
    decode_step(cm, lc, 6, [0, 6], [0.0, 0.0, 0.6, 0.4, 0.0])
    pos, V, _ = by_position(lc)
    share = torch.tensor(v3, dtype=DT) / 16  # (0.25498046875, 0.0177734375)
    assert pos == [0, 4, 5, 6]
    torch.testing.assert_close(V, torch.tensor([[1, 0], [2.0796875, 2.284375], [6.0796875, 4.284375], [0, 6]],
                                               dtype=DT) + torch.cat([torch.zeros(1, 2, dtype=DT), share.expand(3, 2)]))


def test_toy_threshold_always_and_bernoulli_by_hand():
    lc, cm = toy(), compressor(sinks=1, m=2, divide="count", mask="threshold")  # ratios 0.4 (no), 2 (yes)
    cm(0, lc, lc.aux("attention_sum"), 4)
    torch.testing.assert_close(by_position(lc)[1], torch.tensor([[1, 0], [4, 1], [2, 3], [6, 4]], dtype=DT))
    assert cm.trace[0].into.tolist() == [[[-1, 3]]]  # evicted 1 was dropped, not merged
    lc, cm = toy(), compressor(sinks=1, m=2, divide="count", mask="always")  # the "w.o. Merge Mask" ablation
    cm(0, lc, lc.aux("attention_sum"), 4)  # v2 = (0, 2) + (1, 2) = (1, 4); v3 = (5, 2) + (0.5, 2)
    torch.testing.assert_close(by_position(lc)[1], torch.tensor([[1, 0], [5.5, 4], [2.5, 4], [6, 4]], dtype=DT))
    # Bernoulli: eviction 1 (p = 0.4) merges iff the layer's first uniform is below 0.4; eviction 2 (p = 1) always
    u = torch.rand((1, 1, 2), generator=torch.Generator().manual_seed(0), dtype=DT)  # seed 0, layer 0
    lc, cm = toy(), compressor(sinks=1, m=2, divide="count", mask="bernoulli", seed=0)
    cm(0, lc, lc.aux("attention_sum"), 4)
    want = [[1, 0], [5.5, 4], [2.5, 4], [6, 4]] if u[0, 0, 0] < 0.4 else [[1, 0], [4, 1], [2, 3], [6, 4]]
    torch.testing.assert_close(by_position(lc)[1], torch.tensor(want, dtype=DT))


# --- the compressor against the literal references ----------------------------------------------------------

CASES = [dict(m=16, divide="fixed", mask="expectation"), dict(m=16, divide="count", mask="expectation"),
         dict(m=3, divide="fixed", mask="bernoulli"), dict(m=3, divide="count", mask="bernoulli"),
         dict(m=4, divide="count", mask="threshold"), dict(m=2, divide="fixed", mask="always")]


@pytest.mark.parametrize("kw", CASES, ids=str)
def test_compressor_equals_algorithm_1_after_a_prompt_and_decode_steps(kw):
    """Synthetic caches, 2 heads, sinks 2, budget 9: a 20-entry prompt (11 evictions, the cascade), then 6
    decode steps (one eviction each, buffer out of position order), each head against `literal_compress`
    with the same uniforms (drawn per layer as the module documents: (1, H_kv, E) per compression)."""
    gen = torch.Generator().manual_seed(3)
    H, S, b, sinks = 2, 20, 9, 2
    V = torch.randn(H, S, 3, generator=gen, dtype=DT)
    acc = torch.rand(H, S, generator=gen, dtype=DT) * torch.linspace(3, 0.2, S, dtype=DT)  # older: more attention
    lc = LayerCache(1, H, 3, DT, "cpu")
    lc.append(torch.zeros(1, H, S, 3, dtype=DT), V[None], torch.arange(S)[None])
    lc.declare("attention_sum")
    lc.aux("attention_sum")[:] = acc
    cm = compressor(sinks=sinks, **kw)
    draws = torch.Generator().manual_seed(0)  # seed 0, layer 0: the compressor's generator
    heads = [Head(range(S), V[h], acc[h].tolist()) for h in range(H)]
    calls = [(None, None)] + [(torch.randn(H, 1, 3, generator=gen, dtype=DT), torch.rand(H, S, generator=gen, dtype=DT))
                              for _ in range(6)]
    for step, (v_new, row) in enumerate(calls):
        if v_new is not None:
            t = S + step - 1
            lc.append(torch.zeros(1, H, 1, 3, dtype=DT), v_new[None], torch.tensor([[t]]))
            for h, c in enumerate(heads):  # the row over the held entries, in position order
                order = lc.positions[0, h].argsort()
                w = row[h, : b + 1]
                lc.aux("attention_sum")[0, h, order] += w
                c.pos.append(t), c.V.append(v_new[h, 0]), c.acc.append(0.0)
                c.acc = [a + float(x) for a, x in zip(c.acc, w)]
        E = lc.length - b
        u = torch.rand((1, H, E), generator=draws, dtype=DT)
        cm(0, lc, lc.aux("attention_sum"), b)
        for h, c in enumerate(heads):
            literal_compress(c, b, sinks, kw["m"], kw["divide"], kw["mask"], draws=u[0, h].tolist())
            pos, values, a = by_position(lc, h)
            assert pos == c.pos
            torch.testing.assert_close(values, torch.stack(c.V), rtol=0, atol=1e-12)
            torch.testing.assert_close(a, torch.tensor(c.acc, dtype=DT), rtol=0, atol=1e-12)


@pytest.mark.parametrize("sinks, recent, m", [(1, 5, 16), (2, 20, 4), (4, 12, 16)])
@pytest.mark.parametrize("mask", ["expectation", "bernoulli"])
def test_token_by_token_equals_the_authors_kv_cache_cam(sinks, recent, m, mask):
    """The authors' perplexity path (chunk size 1, `official`): a one-head cache fed one token per call, each
    call's attention row added to Abar, then the compressor; against the line-by-line mirror with the same
    uniforms (expectation: M = p). Sharp queries so that some p < 1 (the gate is exercised)."""
    torch.manual_seed(1)
    N, D = 40, 8
    q, k, v = 3 * torch.randn(N, D, dtype=DT), torch.randn(N, D, dtype=DT), torch.randn(N, D, dtype=DT)
    draws = torch.Generator().manual_seed(0)
    sampler = (lambda p: p) if mask == "expectation" else \
        (lambda p: (torch.rand((1, 1, 1), generator=draws, dtype=DT)[0, 0] < p).to(DT))
    want_pos, want_V, want_acc = official_generation_literal(q, k, v, sinks, recent, m, sampler)
    cm, b, ps = compressor(sinks=sinks, m=m, divide="fixed", mask=mask), sinks + recent, []
    lc = LayerCache(1, 1, D, DT, "cpu")
    lc.declare("attention_sum")
    for t in range(N):
        lc.append(k[t].view(1, 1, 1, D), v[t].view(1, 1, 1, D), torch.tensor([[t]]))
        lc.aux("attention_sum").add_(torch.softmax(lc.keys[0, 0] @ q[t] / math.sqrt(D), -1))
        if lc.length > b:
            cm(0, lc, lc.aux("attention_sum"), b)
            ps.append(cm.trace[-1].weight.item() * m)
    pos, V, acc = by_position(lc)
    assert pos == want_pos
    torch.testing.assert_close(V, want_V, rtol=0, atol=1e-12)
    torch.testing.assert_close(acc, want_acc, rtol=0, atol=1e-12)
    if mask == "expectation":
        assert any(0 < p < 1 for p in ps)


def test_merging_with_every_target_conserves_the_sum_of_values():
    """divide=count, mask=always: v_i / (count) to each of its count targets, so the held values sum to what
    all values summed before (fixed: a value near the end loses the share of targets that do not exist)."""
    gen = torch.Generator().manual_seed(5)
    V, acc = torch.randn(30, 4, generator=gen, dtype=DT), torch.rand(30, generator=gen, dtype=DT)
    for divide, conserved in (("count", True), ("fixed", False)):
        lc, cm = layer(list(range(30)), V, acc), compressor(sinks=4, m=16, divide=divide, mask="always")
        cm(0, lc, lc.aux("attention_sum"), 12)
        assert torch.allclose(lc.values.sum((0, 1, 2)), V.sum(0), atol=1e-12) == conserved


# --- the method on a model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return random_model(L=4).to(torch.float64)


def test_budget_sinks_and_recent_are_held_at_every_step_and_the_global_rng_is_untouched(model):
    policy = make_policy("cam", 12)
    policy.start(40, 48)
    cache, gen = model.new_cache(1, 4), torch.Generator().manual_seed(0)
    state = torch.get_rng_state()
    with torch.no_grad():
        for t, ids in enumerate([torch.randint(0, 61, (1, 40), generator=gen)] +
                                [torch.randint(0, 61, (1, 1), generator=gen) for _ in range(8)]):
            model(ids, cache, policy)
            for lc in cache.layers:  # 4 sinks and the newest 8 (after call t, the newest is 39 + t)
                assert lc.length == 12
                assert lc.positions.sort(-1).values.tolist() == [[list(range(4)) + list(range(32 + t, 40 + t))] * 2]
                assert torch.isfinite(lc.values).all()
    assert torch.equal(torch.get_rng_state(), state)
    assert policy.evicted == [28 + 8] * 4 and all(0 < m <= 36 for m in policy.merged)


def test_two_runs_equal_and_the_seed_matters(model):
    first, again = run(model, "cam", 12, {}), run(model, "cam", 12, {})
    same(first, again)
    other = run(model, "cam", 12, {"merge_seed": 1})
    assert any(not torch.equal(a.values, b.values) for a, b in zip(first[0].layers, other[0].layers))


def test_the_trace_records_each_eviction_once_with_its_first_target(model):
    _, policy, _, trace = run(model, "cam", 12, {"merge_mask": "expectation"})
    by_layer = {}
    for r in trace:
        by_layer.setdefault(r.layer, []).append(r)
    for layer, records in by_layer.items():
        evicted = torch.cat([r.evicted for r in records], -1)  # (1, H_kv, 36)
        assert evicted.shape[-1] == 36 and all(len(set(h)) == 36 for h in evicted[0].tolist())
        into = torch.cat([r.into for r in records], -1)
        assert ((into == -1) | (into > evicted)).all()
        weight = torch.cat([r.weight for r in records], -1)
        assert ((weight >= 0) & (weight <= 1 / 16)).all()  # M / 16
        assert float(weight.mean(1).sum()) * 16 == pytest.approx(policy.merged[layer])


def test_a_prompt_in_chunks_keeps_the_same_positions_but_not_the_same_values(model):
    """Compressed after every call by design: the kept positions (StreamingLLM's) do not depend on the
    chunk size; Abar, so p and the merged values, do (later chunks attend to a trimmed cache)."""
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(4))
    caches = []
    for chunk in (40, 7):
        policy, cache = make_policy("cam", 12, merge_mask="expectation"), model.new_cache(1, 4)
        policy.start(40, 40)
        with torch.no_grad():
            for start in range(0, 40, chunk):
                model(ids[:, start : start + chunk], cache, policy)
        caches.append(cache)
    for one, chunked in zip(*(c.layers for c in caches)):
        assert torch.equal(one.positions.sort(-1).values, chunked.positions.sort(-1).values)
    ordered = lambda lc: lc.values.gather(2, lc.positions.argsort(-1)[..., None].expand_as(lc.values))  # noqa: E731
    assert any(not torch.allclose(ordered(a), ordered(b)) for a, b in zip(*(c.layers for c in caches)))


def test_evict_every_n_merges_n_at_once(model):
    policy, cache = make_policy("cam", 12, evict_every=4), model.new_cache(1, 4)
    policy.start(40, 52)
    gen, held = torch.Generator().manual_seed(1), []
    with torch.no_grad():
        for ids in [torch.randint(0, 61, (1, 40), generator=gen)] + [torch.randint(0, 61, (1, 1), generator=gen)] * 12:
            model(ids, cache, policy)
            held.append(cache.lengths()[0])
    assert held == [12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12] and policy.evicted == [40] * 4
