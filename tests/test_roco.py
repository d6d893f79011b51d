"""RoCo (kvmini.methods.roco, kvmini.methods.robust_scope): the hand-worked toy, the engine against two
literal references on a random model (the paper's shape and EasyKV's code shape, buffers laid out as
easykv/easykv.py lays them out), the new statistic on every attention path, and the rules' edges.

Float64 throughout the model runs, so that no near tie of sigma or MAS can flip between the engine and
the loops. Ties in the references: the paper shape puts the earlier key in R on a sigma tie and evicts
the later key on an MAS tie; the EasyKV shape's "k smallest" take the earlier column (sigma = 1e9 ties,
the protected columns, are the ones that occur).
"""
import math
from collections import defaultdict

import pytest
import torch

from kvmini.attention import Statistic, attend
from kvmini.cache import PAD, LayerCache
from kvmini.errors import KvminiError
from kvmini.methods.registry import make_policy
from kvmini.methods.robust_scope import COLUMN_SQUARES, robust_set
from kvmini.methods.roco import VARIANTS
from reference import engine_run, group_mean, random_model, simulate

PAPER = {"variant": "paper"}
TOY = dict(sinks=1, recent=1)  # the toy's stand-ins for EasyKV's 4 sinks and last 10 (roco.md, 7b)


# --------------------------------------------------------------------------- the hand-worked toy
# One head, a 6-token prompt (positions 0..5), one decode step (6), budget 4. Full-cache rows; row 6
# gives 0 to keys 1, 3 and 4 (the keys the variants evict), so it needs no renormalisation.
TOY_ROWS = [
    [1.0],
    [0.5, 0.5],
    [0.4, 0.2, 0.4],
    [0.3, 0.1, 0.2, 0.4],
    [0.4, 0.1, 0.1, 0.2, 0.2],
    [0.2, 0.0, 0.4, 0.15, 0.05, 0.2],
    [0.3, 0.0, 0.2, 0.0, 0.0, 0.1, 0.4],
]


class OneLayer:
    """A cache of one layer, as the model passes it to a method's hooks."""

    def __init__(self, lc: LayerCache):
        self.layers, self.seen_tokens = [lc], 0

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return 1


def run_toy(calls, budget, options, seen=None):
    """RoCo on the toy, a 6-token prompt: each call's rows (renormalised over the held keys: a softmax over
    fewer keys is the full one restricted and renormalised) as the statistics the attention pass would give.
    seen(call, lc, method) hears the cache after the statistics are added, before the eviction.
    Returns the held positions after each call."""
    method = make_policy("roco", budget, **options)
    method.start(6)
    lc = LayerCache(1, 1, 2, torch.float64, "cpu")
    cache = OneLayer(lc)
    kept, t = [], 0
    for c, T in enumerate(calls):
        step = method.run.step(method, cache, T)  # declares a, q and n at the first call
        method.before(cache, step)
        lc.append(torch.zeros(1, 1, T, 2, dtype=torch.float64), torch.zeros(1, 1, T, 2, dtype=torch.float64),
                  torch.arange(t, t + T)[None])
        held = lc.positions[0, 0].tolist()  # buffer order
        sums, squares = torch.zeros(1, 1, len(held), dtype=torch.float64), torch.zeros(1, 1, len(held), dtype=torch.float64)
        for i in range(t, t + T):
            keys = [p for p in held if p <= i]
            total = sum(TOY_ROWS[i][p] for p in keys)
            for p in keys:
                w = TOY_ROWS[i][p] / total
                sums[0, 0, held.index(p)] += w
                squares[0, 0, held.index(p)] += w * w
        method.add_up(lc, {"column_sums": sums, "column_squares": squares}, step)  # R1-R2
        if seen is not None:
            seen(c, lc, method)
        if lc.length > budget:
            method.evict(lc, budget, step.newest, decode=not step.in_prompt)  # R3-R5
        kept.append(sorted(lc.positions[0, 0].tolist()))
        t += T
        cache.seen_tokens = t
    return kept


def column(lc, name):
    """An aux buffer of the toy's one head in position order."""
    order = lc.positions[0, 0].argsort()
    return lc.aux(name)[0, 0, order].tolist()


def test_toy_paper_block_wise_by_hand():
    """roco.md 7a: after the prompt in one call, a = [2.8, .9, 1.1, .75, .25, .2] (key 0: 1+.5+.4+.3+.4+.2),
    q = [1.7, .31, .37, .2225, .0425, .04], n = [6, 5, 4, 3, 2, 1]; MAS = [.4667, .18, .275, .25, .125, .2];
    sigma^2 = q/n - MAS^2 = [.0656, .0296, .0169, .0117, .0056, 0]. r = 4 // 10 = 0 would shield nothing, so
    r = 1: R = {0} (largest sigma), evict the 2 lowest MAS of {1..5}: 4 (.125) and 1 (.18). Decode: the row
    .3, .2, 0, .1, .4 over {0, 2, 3, 5, 6}: MAS 2 = 1.3/5 = .26, 3 = .75/4 = .1875, 5 = .3/2 = .15, 6 = .4;
    R = {0} (sigma .244); evict 5."""
    want = {"a": [2.8, 0.9, 1.1, 0.75, 0.25, 0.2], "q": [1.7, 0.31, 0.37, 0.2225, 0.0425, 0.04], "n": [6, 5, 4, 3, 2, 1]}

    def seen(c, lc, method):
        if c == 0:
            for name, values in want.items():
                assert column(lc, name) == pytest.approx(values, abs=1e-12)
            mas = (lc.aux("a") / lc.aux("n"))[0, 0, lc.positions[0, 0].argsort()].tolist()
            assert mas == pytest.approx([2.8 / 6, 0.18, 0.275, 0.25, 0.125, 0.2], abs=1e-12)
        else:
            assert column(lc, "a") == pytest.approx([3.1, 1.3, 0.75, 0.3, 0.4], abs=1e-12)
            assert column(lc, "n") == [7, 5, 4, 2, 1]

    kept = run_toy([6, 1], 4, PAPER | {"robust": 1, "robust_decode": 1}, seen)
    assert kept == [[0, 2, 3, 5], [0, 2, 3, 6]]


def test_toy_paper_token_wise_by_hand():
    """roco.md 7a, token-wise: evictions at the ends of calls 4 (key 4, MAS .2), 5 (key 1: row 5 renormalised
    over {0, 1, 2, 3, 5} by .95; MAS 1 = .9/5 = .18) and 6 (key 5, MAS (.2/.95 + .1)/2 = .1553); the same end."""
    kept = run_toy([1] * 7, 4, PAPER | {"robust": 1, "robust_decode": 1})
    assert kept[3:] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3, 5], [0, 2, 3, 6]]


def test_toy_official_by_hand():
    """roco.md 7b, EasyKV's rule with toy constants (1 sink, last 1 protected, robust int(0.4) = 0, decode
    int(1.2) = 1, no sinks in decode), calls of EasyKV's stride 2. The cache reaches 4 = b in call 2 without
    statistics; call 3 (rows 4 and 5 only): a = [.6, .1, .5, .35, .25, .2], n = [2, 2, 2, 2, 2, 1]; sigma =
    [.1, .05, .15, .025, .075, 0] with keys 0 and 5 at 1e9; the scope is the max(4 - 0 - 1, 2) = 3 lowest
    sigma, {3, 1, 4}; evict its 2 lowest MAS, 1 (.05) and 4 (.125). Decode: a = [.9, .7, .35, .3, .4],
    n = [3, 3, 3, 2, 1]; scope = the 4 - 1 = 3 lowest sigma {5 (.05), 0 (.0816), 3 (.085)}; evict 3 (MAS .1167)."""
    def seen(c, lc, method):
        if c == 1:
            assert column(lc, "n") == [0, 0, 0, 0]  # no statistics until the cache overflows
        if c == 2:
            assert column(lc, "a") == pytest.approx([0.6, 0.1, 0.5, 0.35, 0.25, 0.2], abs=1e-12)
            assert column(lc, "q") == pytest.approx([0.2, 0.01, 0.17, 0.0625, 0.0425, 0.04], abs=1e-12)
            assert column(lc, "n") == [2, 2, 2, 2, 2, 1]
        if c == 3:
            assert column(lc, "a") == pytest.approx([0.9, 0.7, 0.35, 0.3, 0.4], abs=1e-12)
            assert column(lc, "n") == [3, 3, 3, 2, 1]

    kept = run_toy([2, 2, 2, 1], 4, TOY, seen)
    assert kept == [[0, 1], [0, 1, 2, 3], [0, 2, 3, 5], [0, 2, 5, 6]]
    # the paper's rule on the same prompt keeps the same, then evicts key 5 instead of the old key 3
    assert run_toy([2, 2, 2, 1], 4, PAPER | {"robust": 1, "robust_decode": 1})[-1] == [0, 2, 3, 6]


def test_toy_official_with_every_query_and_with_easykv_constants():
    """roco.md 7c. prompt_statistics=all (EasyKV keep_attention=True): the paper's sigmas; rho = 2 + 0 + 1 = 3
    is {0, 5} and the largest other sigma, key 1 (.172); evict the 2 lowest MAS of {2, 3, 4}: 4 and 3.
    EasyKV's own constants (4 sinks, last 10): every sigma is 1e9, rho = min(2 + 0 + 4, 4) = 4 takes the
    latest of them, so the sinks 0 and 1 are evicted."""
    assert run_toy([2, 2, 2], 4, TOY | {"prompt_statistics": "all"})[-1] == [0, 1, 2, 5]
    assert run_toy([2, 2, 2], 4, {})[-1] == [2, 3, 4, 5]


def test_robust_set_by_hand():
    sigma = torch.tensor([[[0.3, 0.1, 0.2, 0.0]]])
    pos = torch.tensor([[[0, 1, 2, 3]]])
    assert robust_set(sigma, pos, 2, 0, 1, later_first=False).tolist() == [[[True, False, False, True]]]
    # buffer out of position order: the same entries, found by position
    assert robust_set(sigma[..., [2, 0, 3, 1]], pos[..., [2, 0, 3, 1]], 2, 0, 1, False).tolist() == [[[False, True, True, False]]]
    ties = torch.tensor([[[0.5, 0.5, 0.5, 0.1]]])
    assert robust_set(ties, pos, 1, 0, 0, later_first=False).tolist() == [[[True, False, False, False]]]
    assert robust_set(ties, pos, 1, 0, 0, later_first=True).tolist() == [[[False, False, True, False]]]
    # sinks and window are sigma = inf: with rho 2 < 1 + 2 the newest win the tie (EasyKV's leak)
    assert robust_set(sigma, pos, 2, 1, 2, later_first=True).tolist() == [[[False, False, True, True]]]



def literal_robust_set(sigma, positions, rho, sinks, recent, later_first):
    """R3 one row at a time: the held entries in position order, the first `sinks` and last `recent`
    at +inf, ranked by sigma (descending) and then by position (later or earlier first); the first rho."""
    out = []
    for row_s, row_p, r in zip(sigma.tolist(), positions.tolist(), rho):
        held = sorted((p, s) for p, s in zip(row_p, row_s) if p != PAD)
        n = len(held)
        value = {p: math.inf if i < sinks or i >= n - recent else s for i, (p, s) in enumerate(held)}
        ranked = sorted(value, key=lambda p: (-value[p], -p if later_first else p))
        chosen = set(ranked[:max(r, 0)])
        out.append([p in chosen for p in row_p])
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64: ties by a sort", "float32: one key"])
@pytest.mark.parametrize("later_first", [False, True])
@pytest.mark.parametrize("per_row", [False, True], ids=["one rho", "rho per row"])
def test_robust_set_equals_ranking_every_entry(later_first, per_row, dtype):
    """The robust set is found by a selection (float32: the rho-th largest (sigma, position) key; float64: the
    rho-th largest sigma, then its ties by position), not a ranking: the same set as ranking every entry, on
    rows with many equal sigmas (0, -0.0 and a few values, negative ones too), the buffer out of position
    order, pads, guards, and rho from 0 to past the row."""
    gen = torch.Generator().manual_seed(5)
    R, H, S = 6, 2, 23
    for trial in range(40):
        sigma = torch.randint(-2, 4, (R, H, S), generator=gen).to(dtype) / 4  # many ties, 0 most of all
        sigma = torch.where(torch.rand(R, H, S, generator=gen) < 0.2, -0.0, sigma)  # -0.0 ties 0.0
        positions = torch.stack([torch.randperm(S, generator=gen) * 3 for _ in range(R * H)]).view(R, H, S)
        pads = torch.rand(R, 1, S, generator=gen) < 0.2
        positions = positions.masked_fill(pads, PAD)  # a joined row's pads: the same slots in every head
        sinks, recent = trial % 3, trial % 4
        if per_row:
            rho = torch.randint(0, S + 3, (R, 1, 1), generator=gen)
            rows = rho.repeat_interleave(H, 1).flatten().tolist()
        else:
            rho = trial % (S + 3)
            rows = [rho] * (R * H)
        got = robust_set(sigma, positions, rho, sinks, recent, later_first)
        want = literal_robust_set(sigma.flatten(0, 1), positions.flatten(0, 1), rows, sinks, recent, later_first)
        assert got.flatten(0, 1).tolist() == want, trial

# --------------------------------------------------------------------------- the statistic
@pytest.mark.parametrize("T", [1, 5])
def test_column_squares_is_the_square_of_the_group_mean_row(T):
    """sum_i (mean_g A_ij)^2, as EasyKV (:195, :611), on the chunked explicit pass (T > 1) and the decode row (T = 1)."""
    gen = torch.Generator().manual_seed(0)
    B, H_kv, g, S, D = 2, 2, 3, 9, 4
    q = torch.randn(B, H_kv * g, T, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, D, generator=gen, dtype=torch.float64)
    q_pos = torch.arange(S - T, S).expand(B, T)
    _, stats = attend(q, k, v, q_pos, torch.arange(S).expand(B, H_kv, S), {"column_sums": Statistic(), "column_squares": COLUMN_SQUARES})
    scores = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) / D**0.5  # (B, H, T, S)
    scores = scores.masked_fill(torch.arange(S) > q_pos[:, None, :, None], float("-inf"))
    mean_row = scores.softmax(-1).view(B, H_kv, g, T, S).mean(2)  # (B, H_kv, T, S)
    torch.testing.assert_close(stats["column_squares"], (mean_row**2).sum(2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats["column_sums"], mean_row.sum(2), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- literal references
def mas_and_std(a, q, n, clamp):
    """MAS = a/n (R1), sigma = sqrt(q/n - MAS^2) (R2); a negative variance: 0 (clamp) or NaN (EasyKV)."""
    m = a / n
    var = q / n - m * m
    return m, math.sqrt(var) if var >= 0 else (0.0 if clamp else float("nan"))


def roco_paper(budget, prompt_len, g, robust, robust_decode, sinks=0, recent=0, decode_sinks=True,
               mean_of_squares=False):
    """The paper's RoCo as a `simulate` rule, per (layer, sequence, KV head): after each call add every new
    query's group-mean row to the per-key sums (a += A_ij, q += A_ij^2, n += 1 for each key j it saw); if
    the cache holds more than `budget` keys, evict the excess: the lowest-MAS keys of the scope = the cached
    keys minus the first `sinks`, the last `recent` and the `robust` keys of largest sigma (R3-R5).
    mean_of_squares: q adds the mean of the g heads' squares instead (not RoCo: what a test tells apart)."""
    sums = defaultdict(lambda: [0.0, 0.0, 0])  # (layer, b, h, position) -> [a, q, n]

    def choose(layer, c, probs, kept, new):
        A = group_mean(probs, g)  # (B, H_kv, T, N)
        A2 = group_mean(probs**2, g) if mean_of_squares else A**2  # (B, H_kv, T, N)
        out = []
        for b, row in enumerate(kept):
            out.append([])
            for h, old in enumerate(row):
                cached = sorted(old + new)
                for t, i in enumerate(new):
                    for p in cached:
                        if p <= i:
                            s = sums[layer, b, h, p]
                            s[0], s[1], s[2] = s[0] + A[b, h, t, p].item(), s[1] + A2[b, h, t, p].item(), s[2] + 1
                excess = len(cached) - budget
                if excess > 0:
                    decode = new[-1] >= prompt_len
                    T = sinks if not decode or decode_sinks else 0
                    r = robust_decode if decode else robust
                    stat = {p: mas_and_std(*sums[layer, b, h, p], clamp=True) for p in cached}
                    guard = set(cached[:T]) | set(cached[len(cached) - recent :] if recent else [])
                    middle = [p for p in cached if p not in guard]
                    shielded = set(sorted(middle, key=lambda p: (-stat[p][1], p))[:r])  # R3: largest sigma, earlier on ties
                    scope = [p for p in middle if p not in shielded]  # R4
                    victims = sorted(scope, key=lambda p: (stat[p][0], -p))[:excess]  # R5: lowest MAS, later on ties
                    cached = [p for p in cached if p not in victims]
                out[b].append(cached)
        return out
    return choose


class EasyKVRoCo:
    """easykv.py (a1d71ca) kv_policy='roco', kv_mode 'encoding_decoding', as a `simulate` rule per (layer,
    sequence, KV head): the stat rows S, SQ and the counter C in cache-column order, initialised, accumulated,
    compacted and trimmed as there. `calls`: EasyKV's forward calls (the r_idx-token prefix, chunks of
    `stride`); decode steps follow."""

    def __init__(self, length, budget, stride, g, keep_attention=False, temp_length=4, protect_last=10,
                 recent_ratio=0.1, decode_ratio=0.3):
        B = budget + stride  # :546-547
        if B >= length:
            B -= stride  # :548
        self.idx = next(i for i in range(B, -1, -1) if (length - i) % stride == 0)  # :549-550
        r_idx = next(r for r in range(1, self.idx) if (self.idx - r) % stride == 0)  # :551-552
        self.calls = [r_idx] + [stride] * ((length - r_idx) // stride)
        self.B, self.length, self.stride, self.g, self.keep_attention = B, length, stride, g, keep_attention
        self.recent_window, self.sinks = int(B * recent_ratio), temp_length  # :555-556
        self.protect_last, self.decode_ratio = protect_last, decode_ratio
        self.buf = {}  # (layer, b, h) -> {"S", "SQ", "C", "pos"}

    def fresh(self):
        n = self.idx + self.stride  # h2o_head_score :173-186
        if self.keep_attention:  # :573-577
            C = [float(self.idx - j) for j in range(n)]
        else:
            C = [0.0] * self.idx + [float(-m) for m in range(self.stride)]
        return {"S": [0.0] * n, "SQ": [0.0] * n, "C": C, "pos": []}

    @staticmethod
    def accumulate(buf, rows):
        for r in rows:  # :609-613 / :698-703: sums of the (group-mean) row and of its square
            for j, w in enumerate(r):
                buf["S"][j] += w
                buf["SQ"][j] += w * w

    def victims(self, buf, k, evict, sink_length):
        """:631-636 (prompt) and :720-724 (decode, sink_length 0): the `evict` lowest MAS among the k lowest sigma."""
        std = [mas_and_std(s, sq, c, clamp=False)[1] for s, sq, c in zip(buf["S"], buf["SQ"], buf["C"])]
        L = len(std)
        for j in list(range(max(L - self.protect_last, 0), L)) + list(range(min(sink_length, L))):
            std[j] = 1e9  # cur_std[:, :, -10:] = 1e9; cur_std[:, :, :sink_length] = 1e9
        feasible = smallest(std, k)
        mas = [buf["S"][j] / buf["C"][j] for j in feasible]
        return [feasible[m] for m in smallest(mas, evict)]

    @staticmethod
    def evict_columns(buf, ids, appended):
        keep = [j for j in range(len(buf["S"])) if j not in set(ids)]
        for name, fill in (("S", [0.0] * len(appended)), ("SQ", [0.0] * len(appended)), ("C", list(appended))):
            buf[name] = [buf[name][j] for j in keep] + fill
        buf["pos"] = [p for j, p in enumerate(buf["pos"]) if j not in set(ids)]

    def choose(self, layer, c, probs, kept, new):
        A = group_mean(probs, self.g)  # (B, H_kv, T, N): process_for_mqa_gqa, :188-196
        out = []
        for b, row in enumerate(kept):
            out.append([])
            for h, _ in enumerate(row):
                buf = self.buf.setdefault((layer, b, h), self.fresh())
                buf["pos"] += new
                rows = [[A[b, h, t, p].item() for p in buf["pos"]] for t in range(len(new))]
                rows = [r + [0.0] * (len(buf["S"]) - len(r)) for r in rows]
                if c == 0:  # the prefix :557, no eviction
                    if self.keep_attention:
                        self.accumulate(buf, rows)
                elif new[0] < self.length:  # a prompt chunk :587-644
                    cur = len(buf["pos"])
                    if cur > self.idx or self.keep_attention:  # :603
                        self.accumulate(buf, rows)
                    if cur > self.idx:  # :620
                        buf["C"] = [x + self.stride for x in buf["C"]]  # :621
                        k = max(self.B - self.recent_window - self.sinks, self.stride)  # :635
                        gone = self.victims(buf, k, self.stride, self.sinks)
                        self.evict_columns(buf, gone, [float(-m) for m in range(self.stride)])  # :639-644
                else:  # decode :662-732
                    if new[0] == self.length and self.stride > 1:  # :666-668
                        for name in ("S", "SQ", "C"):
                            buf[name] = buf[name][: -(self.stride - 1)]
                    rows = [[A[b, h, 0, p].item() for p in buf["pos"]]]
                    self.accumulate(buf, rows)  # :698-703
                    buf["C"] = [x + 1.0 for x in buf["C"]]  # :708
                    k = self.B - int(self.B * self.decode_ratio)  # :709-710, :722
                    self.evict_columns(buf, self.victims(buf, k, 1, 0), [0.0])  # :727-732
                out[b].append(sorted(buf["pos"]))
        return out


def smallest(values, k):
    """Indices of the k smallest values (value, then index; NaN largest), like torch.topk(largest=False)."""
    key = lambda j: (math.isnan(values[j]), 0.0 if math.isnan(values[j]) else values[j], j)  # noqa: E731
    return sorted(range(len(values)), key=key)[:k]


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the model and the references' buffers (simulate, group_mean)
    yield
    torch.set_default_dtype(old)


def compare(model, calls, policy, rule, n):
    got_logits, got_kept = engine_run(model, calls, policy, n)
    want_logits, want_kept = simulate(model, calls, rule)
    assert got_kept == want_kept
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


@pytest.mark.parametrize("budget, chunks, options, rule", [
    (12, [20], {}, dict(robust=1, robust_decode=1)),  # block-wise; budget // 10 = 1
    (14, [7, 11, 2], {"sinks": 2, "recent": 3, "robust": 2, "robust_decode": 3},
     dict(robust=2, robust_decode=3, sinks=2, recent=3)),
    (10, [1] * 16, {"sinks": 2, "decode_sinks": False}, dict(robust=1, robust_decode=1, sinks=2, decode_sinks=False)),
])
def test_paper_engine_equals_the_paper_shape(float64, budget, chunks, options, rule):
    model = random_model(L=2, H=4, H_kv=2, seed=len(chunks))
    gen = torch.Generator().manual_seed(3)
    B, n, steps = 2, sum(chunks), 6
    calls = [torch.randint(0, 61, (B, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (B, 1), generator=gen) for _ in range(steps)]
    compare(model, calls, make_policy("roco", budget, **PAPER | options), roco_paper(budget, n, 2, **rule), n)


def test_the_kept_set_pins_sigma_to_the_square_of_the_group_mean_row(float64):
    """Four query heads per KV head and a robust set of 4: here sigma from the square of the group-mean row
    (RoCo as EasyKV computes it) and sigma from the mean of the heads' squares keep different sets, so the
    engine's kept set (against the paper shape) pins which one it computes, end to end."""
    model = random_model(L=2, H=8, H_kv=2, seed=2)
    gen = torch.Generator().manual_seed(3)
    calls = [torch.randint(0, 61, (2, 20), generator=gen)] + [torch.randint(0, 61, (2, 1), generator=gen) for _ in range(6)]
    rule = dict(robust=4, robust_decode=4, sinks=1)
    squared_mean, mean_square = (simulate(model, calls, roco_paper(10, 20, 4, **rule, mean_of_squares=m))[1]
                                 for m in (False, True))
    assert squared_mean != mean_square  # the case tells the two definitions apart
    compare(model, calls, make_policy("roco", 10, **PAPER | rule), roco_paper(10, 20, 4, **rule), 20)


@pytest.mark.parametrize("length, user_budget, stride, options, easykv", [
    (80, 32, 8, {}, {}),  # b = idx = B = 40: prompt rho = 8 + 4 + 4 = 16, decode 1 + 12 = 13: nothing leaks
    (40, 12, 4, {}, {}),  # b = 16: rho 4 + 1 + 4 = 9 < 4 + 10 and decode 1 + 4 = 5 < 10: the protection leaks
    (80, 32, 8, {"prompt_statistics": "all"}, {"keep_attention": True}),
    (60, 18, 6, {"sinks": 2, "recent": 3}, {"temp_length": 2, "protect_last": 3}),
])
def test_official_engine_equals_easykv(float64, length, user_budget, stride, options, easykv):
    """EasyKV's calls (r_idx prefix, then stride) fed to both; kvmini's budget is EasyKV's idx (= B here)."""
    model = random_model(L=2, H=4, H_kv=2, seed=stride)
    rule = EasyKVRoCo(length, user_budget, stride, 2, **easykv)
    assert rule.idx == rule.B and sum(rule.calls) == length
    gen = torch.Generator().manual_seed(stride)
    calls = [torch.randint(0, 61, (1, t), generator=gen) for t in rule.calls]
    calls += [torch.randint(0, 61, (1, 1), generator=gen) for _ in range(6)]
    compare(model, calls, make_policy("roco", rule.idx, **options), rule.choose, length)


# --------------------------------------------------------------------------- edges and invariants
def test_variants_and_defaults():
    assert VARIANTS["official"] == VARIANTS["paper"].__class__()
    paper, official = VARIANTS["paper"], VARIANTS["official"]
    assert (paper.sinks, paper.recent, paper.scope, paper.prompt_statistics) == (0, 0, "paper", "all")
    assert (official.sinks, official.recent, official.decode_sinks) == (4, 10, False)
    assert [official.robust(b) for b in (9, 10, 400)] == [0, 1, 40]
    assert [official.robust_decode(b) for b in (9, 10, 400)] == [2, 3, 120]  # int(0.3 b)


def test_a_paper_budget_too_small_for_its_robust_set_is_refused():
    model = random_model()
    policy = make_policy("roco", 6, variant="paper", sinks=2, recent=2, robust=3)
    policy.start(20, 20)
    with pytest.raises(KvminiError, match="too small for 2 sinks, a window of 2 tokens and 3 robust tokens"):
        model(torch.randint(0, 61, (1, 20)), model.new_cache(1), policy)


@pytest.mark.parametrize("options", [PAPER | {"sinks": 2, "recent": 3}, {}])
def test_never_above_budget_and_the_paper_guards_are_kept(options):
    model = random_model(L=2, seed=1)
    gen = torch.Generator().manual_seed(1)
    policy = make_policy("roco", 12, **options)
    policy.start(30, 40)
    cache = model.new_cache(1)
    with torch.no_grad():
        for t, ids in enumerate([torch.randint(0, 61, (1, 5), generator=gen) for _ in range(6)] +
                                [torch.randint(0, 61, (1, 1), generator=gen) for _ in range(10)]):
            model(ids, cache, policy)
            seen = cache.seen_tokens
            for lc in cache.layers:
                assert lc.length == min(seen, 12)
                for h in range(lc.positions.shape[1]):
                    held = set(lc.positions[0, h].tolist())
                    if options:
                        assert {0, 1} | set(range(seen - 3, seen)) <= held
                    else:  # official: the newest min(rho, 10) keys are robust; here rho >= 10 in the prompt only
                        assert set(range(seen - 4, seen)) <= held  # decode rho = 1 + 3 = 4
                for name in ("a", "q", "n"):
                    assert torch.isfinite(lc.aux(name)).all()
