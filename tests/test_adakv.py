"""Ada-KV: its allocation across heads worked by hand, and the authors' code (FFY0/AdaKV,
snapkv_utils.py:449-489) written out in loops against the engine on a random model."""
import pytest
import torch

from kvmini.cache import PAD, LayerCache
from kvmini.methods.adakv import across_heads
from kvmini.methods.registry import make_policy
from reference import engine_run, group_mean, random_model, simulate, top_positions

INF = float("inf")


def two_heads(score: list[list[float]]) -> tuple[LayerCache, torch.Tensor]:
    """A layer of 2 KV heads holding positions 0-7, and scores (the last two: the window)."""
    lc = LayerCache(1, 2, 2, torch.float32, "cpu")
    lc.append(torch.zeros(1, 2, 8, 2), torch.zeros(1, 2, 8, 2), torch.arange(8)[None])
    return lc, torch.tensor([score])


@pytest.mark.parametrize("alpha,want", [(0.0, [[0, 1, 2, 3, 4, 6, 7], [0, 6, 7]]),
                                        (0.5, [[0, 1, 2, 3, 6, 7], [0, 1, 6, 7]]),
                                        (1.0, [[0, 1, 2, 6, 7], [0, 1, 2, 6, 7]])])
def test_a_layer_s_budget_spent_across_heads_by_hand(alpha, want):
    """b = 5 per head, window 2: c = 3 earlier entries per head, 6 in the layer. The layer's 6 best
    (9, 8, 7, 6, 3, 2) are 5 of head 0's and 1 of head 1's: n = (5, 1). The floor is int(3 alpha):
    alpha 0: c_h = n; alpha 0.5: round(0.5 n + 1) = (round(3.5), round(1.5)) = (4, 2), half to even;
    alpha 1: 3 each, SnapKV's uniform budgets."""
    lc, score = two_heads([[9, 8, 7, 3, 2, 1, INF, INF], [6, 0.5, 0.4, 0.3, 0.2, 0.1, INF, INF]])
    idx, counts = across_heads(score, 5, window=2, alpha=alpha)
    assert counts.tolist() == [[len(w) for w in want]]  # each head's own budget
    lc.keep(idx, counts)
    held = lc.held()[0].tolist()
    assert held == [len(w) for w in want]
    assert [lc.positions[0, h, :n].tolist() for h, n in enumerate(held)] == want  # in position order
    assert (lc.positions[0, :, : lc.length] == PAD).sum() == lc.length * 2 - sum(held)  # the rest: pads


def ada_snapkv(budget, g, prefill_calls, window, kernel, pooling, alpha):
    """The authors' Ada-SnapKV after the prompt, per layer (snapkv_utils.py:335-370 and 449-489), in loops:
    SnapKV's pooled window scores per KV head; the layer's H_kv c best earlier scores counted per head;
    c_h = round((1 - alpha) n_h + int(alpha c)); each head keeps its c_h best and its window."""
    def choose(layer, c, probs, kept, new):
        C = group_mean(probs, g)[:, :, -window:].sum(2)  # (B, H_kv, N)
        out = []
        for b, row in enumerate(kept):
            cands = [sorted(s + new) for s in row]
            if c != prefill_calls - 1 or len(cands[0]) <= budget:
                out.append(cands)
                continue
            pooled = []
            for h, cand in enumerate(cands):
                prefix = cand[:-window]
                near = lambda j: [C[b, h, prefix[i]].item() for i in range(j - kernel // 2, j + kernel // 2 + 1)  # noqa: E731
                                  if 0 <= i < len(prefix)]
                pooled.append({p: sum(near(j)) / kernel if pooling == "avg" else max(near(j)) for j, p in enumerate(prefix)})
            per = budget - window
            flat = sorted(((s, h) for h, scores in enumerate(pooled) for s in scores.values()), reverse=True)
            n = [sum(1 for _, hh in flat[: len(cands) * per] if hh == h) for h in range(len(cands))]
            c_h = [int(torch.round(torch.tensor(n_h * (1 - alpha) + int(per * alpha))).item()) for n_h in n]
            out.append([top_positions(list(pooled[h]), pooled[h], c_h[h]) + cand[-window:]
                        for h, cand in enumerate(cands)])
        return out
    return choose


@pytest.mark.parametrize("options,budget,chunks", [
    ({"window": 3, "kernel": 3, "pooling": "avg", "alpha": 0.2}, 9, [20]),
    ({"window": 4, "kernel": 5, "pooling": "max", "alpha": 0.5}, 8, [12, 9]),
    ({"window": 2, "kernel": 3, "pooling": "max", "alpha": 0.0}, 7, [18]),
])
def test_engine_equals_the_authors_code_written_out(options, budget, chunks):
    model = random_model(L=3, H=4, H_kv=2, seed=len(chunks))
    gen = torch.Generator().manual_seed(7)
    B, n = 2, sum(chunks)
    calls = [torch.randint(0, 61, (B, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (B, 1), generator=gen) for _ in range(4)]
    got_logits, got_kept = engine_run(model, calls, make_policy("adakv", budget, **options), n)
    got_kept = [[[[[p for p in h if p != PAD] for h in row] for row in layer] for layer in call] for call in got_kept]
    want_logits, want_kept = simulate(model, calls, ada_snapkv(budget, 2, len(chunks), **options))
    assert got_kept == want_kept
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    counts = [len(h) for layer in got_kept[len(chunks)] for row in layer for h in row]
    assert len(set(counts)) > 1, "the heads keep their own counts here"


def test_a_floor_of_the_whole_budget_is_snapkv():
    """alpha = 1: every head keeps b - w, so with SnapKV's average pooling Ada-KV keeps SnapKV's sets."""
    model = random_model(L=3, H=4, H_kv=2, seed=3)
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(1))
    options = {"window": 4, "kernel": 5, "pooling": "avg"}
    calls = [ids[:, :26]] + [ids[:, t : t + 1] for t in range(26, 30)]
    ada = engine_run(model, calls, make_policy("adakv", 10, alpha=1.0, **options), 26)
    snap = engine_run(model, calls, make_policy("snapkv", 10, **options), 26)
    assert ada[1] == snap[1] and any(len(h) < 26 for layer in ada[1][1] for row in layer for h in row)
    for got, want in zip(ada[0], snap[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("alpha,want", [(0.2, [[0, 1, 5], [1, 5]]), (0.5, [[0, 1, 5], [1, 4, 5]])])
def test_rounding_may_leave_a_layer_below_its_budget(alpha, want):
    """b = 3, window 1: c = 2 per head, 4 in the layer; the best 4 are three of head 0's and one of
    head 1's, n = (3, 1). alpha 0.2: floor int(0.4) = 0, round(2.4) = 2 and round(0.8) = 1: the layer
    keeps 3 earlier entries, not 4, as the authors' code does. alpha 0.5: round(2.5) = 2 (half to
    even) and round(1.5) = 2."""
    lc = LayerCache(1, 2, 2, torch.float32, "cpu")
    lc.append(torch.zeros(1, 2, 6, 2), torch.zeros(1, 2, 6, 2), torch.arange(6)[None])
    score = torch.tensor([[[0.30, 0.25, 0.20, 0.15, 0.10, INF], [0.02, 0.60, 0.03, 0.01, 0.04, INF]]])
    lc.keep(*across_heads(score, 3, window=1, alpha=alpha))
    assert [lc.positions[0, h, :n].tolist() for h, n in enumerate(lc.held()[0].tolist())] == want
