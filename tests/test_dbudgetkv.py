"""DBudgetKV's Frobenius-norm stopping: a 6-token cut by hand, a sequential prune-until-threshold
loop, and whole-model runs against a literal masked simulation (tests/reference.py)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmini.errors import KvminiError
from kvmini.methods.frobenius_stop import frobenius_stop
from kvmini.methods.registry import make_policy
from cases import stored
from checks import assert_equal
from reference import group_mean, random_model, simulate

ROW = torch.tensor([0.4, 0.05, 0.1, 0.05, 0.1, 0.3]).view(1, 1, 6)
BY_POSITION_ONE_SINK = torch.tensor([1, 2, 3, 4, 5, 0]).view(1, 1, 6)  # earliest non-sink first, the sink last


@pytest.mark.exercise("frobenius_stop")
def test_six_token_cut_by_hand():
    """Eq. 2 on one six-token row (worked in the comments): the number of tokens pruned is the last one
    whose removal keeps the norm's drop within the threshold (0.01 -> 1, 0.03 -> 3, 0.05 -> 4, 0 -> 0)."""
    # ||A'||^2 = .16 + .0025 + .01 + .0025 + .01 + .09 = .275. Removing token 1 leaves .2725: the norm
    # drops by 1 - sqrt(.2725/.275) = 0.46%; also token 2 leaves .2625: 2.30%; token 3: .26, 2.77%;
    # token 4: .25, 4.65%; token 5: .16, 23.7%.
    drops = [1 - math.sqrt(x / 0.275) for x in (0.2725, 0.2625, 0.26, 0.25, 0.16)]
    assert [round(d * 100, 2) for d in drops] == [0.46, 2.3, 2.77, 4.65, 23.72]
    for t, want in [(0.01, 1), (0.03, 3), (0.05, 4), (0.0, 0)]:  # threshold 0 prunes nothing
        got = frobenius_stop(ROW, BY_POSITION_ONE_SINK, t)
        assert got == want, f"Eq. 2 (`frobenius_stop`): tokens pruned from the six-token row at threshold {t}: want {want}, got {got}"


@pytest.mark.exercise("frobenius_stop")
def test_edge_cases_by_hand():
    """At most S - 1 tokens go (t = 1: any drop is allowed, the most important token stays); an all-zero
    row loses nothing whatever goes: S - 1 (not -1, which made a budget of S + 1); the norms of a batch
    and of its heads are averaged alike: rows [1, 0] and [0, 1] (order 0, 1) lose 50% on average by
    removing token 0."""
    rows, order = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1]).expand(2, 2)
    for what, args, want in [
            ("the six-token row at t = 1 (the most important token stays)", (ROW, BY_POSITION_ONE_SINK, 1.0), 5),
            ("an all-zero row of five tokens", (torch.zeros(1, 2, 5), torch.arange(5).expand(1, 2, 5), 0.01), 4),
            ("rows [1, 0], [0, 1] as a batch of two at t = 0.49", (rows.view(2, 1, 2), order.view(2, 1, 2), 0.49), 0),
            ("rows [1, 0], [0, 1] as two heads at t = 0.49", (rows.view(1, 2, 2), order.view(1, 2, 2), 0.49), 0),
            ("rows [1, 0], [0, 1] as a batch of two at t = 0.5", (rows.view(2, 1, 2), order.view(2, 1, 2), 0.5), 1)]:
        got = frobenius_stop(*args)
        assert got == want, f"Eq. 2 (`frobenius_stop`): tokens pruned from {what}: want {want}, got {got}"


@stored
def sequential_prune(s: torch.Tensor, order: torch.Tensor, t: float) -> int:
    """Remove the least important token one at a time; stop before the head-averaged norm drops by more than t."""
    # BEGIN REFERENCE
    B, H, S = s.shape
    norm = lambda keep: sum(math.sqrt(sum(s[b, h, j].item() ** 2 for j in keep[b][h]))  # noqa: E731
                            for b in range(B) for h in range(H)) / (B * H)
    full = norm([[order[b, h].tolist() for h in range(H)] for b in range(B)])
    pruned = 0
    while pruned < S - 1:
        keep = [[order[b, h, pruned + 1 :].tolist() for h in range(H)] for b in range(B)]
        if full - norm(keep) > t * full:  # (the drop relative to the full norm, which may be 0)
            break
        pruned += 1
    return pruned
    # END REFERENCE


@settings(max_examples=60, deadline=None)
@given(H=st.integers(1, 4), S=st.integers(1, 24), t=st.sampled_from([0.0, 0.005, 0.01, 0.05, 0.2, 0.6]),
       seed=st.integers(0, 10**6), shared_order=st.booleans())
@pytest.mark.exercise("frobenius_stop")
def test_vectorized_cut_equals_the_sequential_loop(H, S, t, seed, shared_order):
    """`frobenius_stop` on random rows and orders (one order for every head, or one each) gives the count
    that removing tokens one at a time (`sequential_prune`) gives."""
    gen = torch.Generator().manual_seed(seed)
    # away from 0: at t = 0, removing a token of attention 1e-9 changes the norm by less than its rounding,
    # and whether that is "no drop" would depend on the order of the sums
    s = (torch.rand(1, H, S, generator=gen) + 0.01).pow(3)
    s = s / s.sum(-1, keepdim=True)  # attention rows
    if shared_order:
        order = torch.randperm(S, generator=gen).expand(1, H, S)
    else:
        order = torch.stack([torch.randperm(S, generator=gen) for _ in range(H)])[None]
    got, want = frobenius_stop(s, order, t), sequential_prune(s, order, t)
    assert got == want, (f"Eq. 2 (`frobenius_stop`): tokens pruned from {H} random rows of {S} at threshold {t}: "
                         f"removing them one at a time prunes {want}, got {got}")


def dbudgetkv_literal(g, threshold, k, sinks, protected, ranking, window=8, excludes_kept=False):
    """Sec. 3.2 written out: Eq. (1) row over the last k queries, rank, prune while the drop <= t.
    ranking "window_attention" and excludes_kept are the authors' code (Patrick-Ni/ReFreeKV): the
    last `window` queries' attention ranks the others, those `window` tokens are kept, and the
    always-kept tokens are zeroed out of the row before the norms."""
    # BEGIN REFERENCE
    def choose(layer, c, probs, kept, new):
        if layer in protected or c > 0:  # prefill only; decode appends
            return [[sorted(s + new) for s in kept[0]]]
        cand = sorted(new)  # the whole prompt
        P = group_mean(probs, g)[0]  # (H_kv, T, N)
        H_kv, n = P.shape[0], len(cand)
        rows = P[:, -k:]  # (H_kv, k, N): the last k queries
        s = [[rows[h, :, j].sum().item() / (rows[h, :, j] != 0).sum().item() for j in cand] for h in range(H_kv)]
        kept_idx = {"position": range(sinks), "window_attention": range(n - window, n)}.get(ranking, [])
        if excludes_kept:
            s = [[0.0 if j in kept_idx else x for j, x in enumerate(row)] for row in s]
        if ranking == "position":
            order = [list(range(sinks, n)) + list(range(sinks)) for _ in range(H_kv)]
        elif ranking == "window_attention":
            win = P[:, -window:].sum(1)  # (H_kv, N): attention of the last `window` queries
            order = [sorted(range(n - window), key=lambda j: (win[h, cand[j]].item(), j)) + list(kept_idx)
                     for h in range(H_kv)]
        else:
            colsum = P.sum(1)  # (H_kv, N)
            order = [sorted(range(n), key=lambda j: (colsum[h, cand[j]].item(), j)) for h in range(H_kv)]
        pruned = min(sequential_prune(torch.tensor(s)[None], torch.tensor(order)[None], threshold), n - len(kept_idx))
        if ranking == "position":
            return [[cand[:sinks] + cand[sinks + pruned :] for _ in range(H_kv)]]
        return [[sorted(cand[j] for j in order[h][pruned:]) for h in range(H_kv)]]
    return choose
    # END REFERENCE


@stored
def dbudgetkv_reference(model, calls, *literal):
    """What the literal rule keeps and computes over `calls` (`simulate` with `dbudgetkv_literal(*literal)`)."""
    # BEGIN REFERENCE
    return simulate(model, calls, dbudgetkv_literal(*literal))
    # END REFERENCE


@pytest.mark.parametrize("options", [
    {"threshold": 0.05, "protected_layers": "0"},
    {"threshold": 0.2, "k": 3, "sinks": 2, "protected_layers": ""},
    {"threshold": 0.1, "ranking": "cumulative", "protected_layers": "1"},
    {"threshold": 0.3, "protected_layers": "", "norm_excludes_kept": True},  # the authors' norm, position ranking
    {"variant": "official", "window": 4},  # window_attention, t = 5%, no protected layers, kept zeroed
    {"variant": "official", "window": 5, "threshold": 0.3, "norm_excludes_kept": False, "protected_layers": "-1"},
])
@pytest.mark.exercise("frobenius_stop")
def test_whole_model_equals_the_literal_rule(options):
    """The whole method on a random 3-layer model (a prompt and three decode steps) keeps the tokens, and
    gives the logits, of Sec. 3.2 written out as a loop (`dbudgetkv_literal`), for each set of options."""
    model = random_model(L=3, H=4, H_kv=2, seed=9, sharp=1.5)
    gen = torch.Generator().manual_seed(1)
    calls = [torch.randint(0, 61, (1, 24), generator=gen)] + [torch.randint(0, 61, (1, 1), generator=gen)
                                                             for _ in range(3)]
    policy = make_policy("dbudgetkv", **options)
    cache = model.new_cache(1, 4)
    policy.start(24, 26)
    with torch.no_grad():
        got = [model(ids, cache, policy)[:, -1] for ids in calls]
    official = options.get("variant") == "official"
    spec = options.get("protected_layers", "" if official else "0,1")
    protected = tuple(int(x) % 3 for x in spec.split(",") if x)
    want, entering = dbudgetkv_reference(  # entering[c]: what each layer held before call c
        model, calls, 2, options.get("threshold", 0.05 if official else 0.01), options.get("k", 1),
        options.get("sinks", 4), protected, options.get("ranking", "window_attention" if official else "position"),
        options.get("window", 8), options.get("norm_excludes_kept", official))
    budgets = [len(layer[0][0]) for layer in entering[1]]
    assert policy.budgets == budgets, f"Eq. 2 (`frobenius_stop`): each layer's budget, want {budgets}, got {policy.budgets}"
    for l, lc in enumerate(cache.layers):
        assert_equal(lc.positions.sort(dim=-1).values[:, :, :-1].tolist(), entering[-1][l],
                     f"Eq. 2 (`frobenius_stop`, then the cut): the tokens layer {l} keeps")
    for c, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m, c=c: f"the logits of call {c} over the kept cache. {m}")
    assert any(b < 24 for b in policy.budgets)  # something was pruned


def test_budget_and_option_errors():
    with pytest.raises(KvminiError, match="--budget does not apply to method dbudgetkv"):
        make_policy("dbudgetkv", 0.5)
    with pytest.raises(KvminiError, match="--threshold must be in"):
        make_policy("dbudgetkv", threshold=1.5)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_fixed_share_keeps_the_same_count_in_every_layer(share):
    """fixed_share replaces the stopping rule: with the paper's ranking (position, 4 sinks) every layer keeps
    the 4 sinks and the most recent round(share * n) - 4 tokens, protected layers too."""
    from kvmini.generate import prefill

    model = random_model(L=3)
    n = 40
    ids = torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1)
    prefill(model, ids, cache, make_policy("dbudgetkv", fixed_share=share))
    b = round(share * n)
    expected = list(range(4)) + list(range(n - (b - 4), n))
    for lc in cache.layers:
        assert lc.positions.sort(-1).values[0].tolist() == [expected] * lc.positions.shape[1]
