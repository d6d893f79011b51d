"""VATP (kvmini.methods.vatp), the method tutorial 9 writes: its score worked by hand, the engine against
a literal masked simulation written from the paper's score, and H2O as its special case."""
from collections import defaultdict

import pytest
import torch

from kvmini.cache import PAD, LayerCache
from kvmini.methods.registry import make_policy
from kvmini.methods.vatp import VATP, Options
from cases import stored
from checks import assert_equal
from reference import engine_run, group_mean, random_model, simulate, top_positions


@pytest.mark.exercise("value_norm")
def test_value_weighting_by_hand():
    """Accumulated attention [.5, .3, .2] times the l1 norms of the values [1, 4, 2] (|1| + |-3| = 4)
    -> [.5, 1.2, .4]: the second token, though less attended than the first, scores highest.
    The norms are kept from the call that cached the values (`keep_norms`), as the attention is."""
    for norm, want in [("l1", [0.5, 1.2, 0.4]), ("l2", [0.5 * 1.0, 0.3 * 10**0.5, 0.2 * 2.5**0.5]), ("off", [0.5, 0.3, 0.2])]:
        lc = LayerCache(1, 1, 2, torch.float32, "cpu", capacity=4)
        lc.append(torch.zeros(1, 1, 3, 2), torch.tensor([[1.0, 0.0], [1.0, -3.0], [0.5, 1.5]]).view(1, 1, 3, 2),
                  torch.tensor([[0, 1, 2]]))
        method = VATP(12, Options(value_norm=norm))
        lc.declare(*method.aux)
        lc.aux("attention_sum").add_(torch.tensor([[[0.5, 0.3, 0.2]]]))  # one call of 3 queries
        if method.p is not None:
            method.keep_norms(lc, 3)
        got = method.score(lc).flatten().tolist()
        assert got == pytest.approx(want), f"VATP's score (`value_norm`, norm {norm}): accumulated attention times the values' norm, got {got}"


@pytest.mark.exercise("value_norm")
def test_value_norm_alone():
    """`VATP.norm` on its own: ||v_j||_p over each value's D entries, in every KV head apart (a token's values in
    two heads are two norms), for any leading dimensions, the values themselves left unchanged. By hand:
    head 0 holds [1, -3] and [0.5, 1.5], head 1 [-2, 0] and [3, 4]: l1 [[4, 2], [2, 7]], l2 [[10^.5, 2.5^.5], [2, 5]]."""
    v = torch.tensor([[[[1.0, -3.0], [0.5, 1.5]], [[-2.0, 0.0], [3.0, 4.0]]]])  # (B = 1, H_kv = 2, S = 2, D = 2)
    for norm, want in (("l1", [[[4.0, 2.0], [2.0, 7.0]]]), ("l2", [[[10**0.5, 2.5**0.5], [2.0, 5.0]]])):
        method, before = VATP(12, Options(value_norm=norm)), v.clone()
        got = method.norm(v)
        assert torch.equal(v, before), f"`value_norm` (`VATP.norm`, {norm}) changed the values it measured: want " \
            f"{before.tolist()}, got {v.tolist()} (an in-place op on `values`?)"
        flat = [x for head in want[0] for x in head]
        assert got.shape == (1, 2, 2) and got.flatten().tolist() == pytest.approx(flat), \
            f"`value_norm` (`VATP.norm`, {norm}): each value's norm per KV head, want {want}, got {got.tolist()}"
        for shape in ((4, 2), (1, 2, 1, 2, 2)):  # any leading dimensions: (S, D), (..., S, D)
            got = method.norm(v.reshape(shape))
            assert got.shape == shape[:-1] and got.flatten().tolist() == pytest.approx(flat), \
                f"`value_norm` (`VATP.norm`, {norm}) of values shaped {shape}: want {flat} shaped {shape[:-1]}, got {got.tolist()}"


def test_a_norm_is_kept_from_the_call_that_cached_the_value():
    """The newly appended values (the last T entries) get their norms; the earlier entries keep theirs,
    also after an eviction moved them."""
    lc = LayerCache(2, 1, 2, torch.float32, "cpu", capacity=8)
    lc.append(torch.zeros(2, 1, 2, 2), torch.tensor([[[[9.0, 9.0], [3.0, 0.0]]], [[[0.0, -1.0], [2.0, 2.0]]]]),
              torch.tensor([[0, 1], [0, 1]]))
    method = VATP(12)
    lc.declare(*method.aux)
    method.keep_norms(lc, 2)
    lc.append(torch.zeros(2, 1, 1, 2), torch.tensor([[[[-4.0, 1.0]]], [[[0.5, 0.5]]]]), torch.tensor([[2], [2]]))
    method.keep_norms(lc, 1)
    lc.evict_one(torch.tensor([[0], [1]]))  # row 0 drops position 0, row 1 position 1: the newest takes the slot
    assert lc.aux("value_norm").tolist() == [[[5.0, 3.0]], [[1.0, 1.0]]]


def vatp_literal(budget, g, sinks=4, recent=None, p=1):
    """VATP in loops: s_j = |v_j|_p * (attention j received so far, query heads of a group averaged);
    keep the first `sinks`, the last `recent` and the best scores between them, after every call."""
    # BEGIN REFERENCE
    recent = budget // 2 if recent is None else recent
    received_so_far = defaultdict(float)  # (layer, b, h, position) -> attention received

    def choose(layer, c, probs, kept, new, values):
        received = group_mean(probs, g).sum(2)  # (B, H_kv, N): this call's column sums

        def rule(b, h, cand):
            for q in cand:
                received_so_far[layer, b, h, q] += received[b, h, q].item()
            if len(cand) <= budget:
                return cand
            first, middle, last = cand[:sinks], cand[sinks : len(cand) - recent], cand[len(cand) - recent :]
            norm = {q: sum(abs(x) ** p for x in values[b, h, q].tolist()) ** (1 / p) for q in middle}
            score = {q: received_so_far[layer, b, h, q] * norm[q] for q in middle}
            return first + top_positions(middle, score, budget - sinks - recent) + last

        return [[rule(b, h, sorted(s + new)) for h, s in enumerate(row)] for b, row in enumerate(kept)]
    return choose
    # END REFERENCE


@stored
def vatp_reference(model, calls, budget, g, **rule):
    """The logits and kept tokens of the rule written out (`vatp_literal`) over `calls`."""
    # BEGIN REFERENCE
    return simulate(model, calls, vatp_literal(budget, g, **rule), with_values=True)
    # END REFERENCE


@pytest.mark.parametrize("options,budget,chunks,p", [
    ({}, 12, [20], 1),
    ({"sinks": 2, "recent": 3}, 9, [7, 11], 1),
    ({"value_norm": "l2"}, 12, [20], 2),
])
@pytest.mark.exercise("value_norm")
def test_engine_equals_literal_masked_simulation(options, budget, chunks, p):
    """The whole method (a batch of two, a prompt in chunks, six decode steps) keeps the tokens, and gives
    the logits, of a full-attention model whose evicted tokens are masked by the rule written out
    (`vatp_literal`: accumulated attention times each value's l_p norm)."""
    model = random_model(L=3, H=4, H_kv=2, seed=len(chunks))
    gen = torch.Generator().manual_seed(11)
    B, steps, n = 2, 6, sum(chunks)
    calls = [torch.randint(0, 61, (B, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (B, 1), generator=gen) for _ in range(steps)]
    got_logits, got_kept = engine_run(model, calls, make_policy("vatp", budget, **options), n)
    rule_options = {k: v for k, v in options.items() if k in ("sinks", "recent")}
    want_logits, want_kept = vatp_reference(model, calls, budget, 2, p=p, **rule_options)
    for c, (got, want) in enumerate(zip(got_kept, want_kept)):
        assert_equal(got, want, f"VATP's score (`value_norm`, p = {p}): the tokens each layer holds entering call {c}")
    assert len(got_kept) == len(want_kept)
    for c, (got, want) in enumerate(zip(got_logits, want_logits)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, c=c: f"the logits of call {c} over the kept cache. {m}")


@pytest.mark.exercise("value_norm")
def test_without_the_value_norm_it_is_h2o():
    """With value_norm off (and no sinks) VATP keeps what H2O keeps; with the norm it keeps something else."""
    model = random_model(L=3, seed=4)
    ids = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(5))
    kept = {}
    for name, options in [("h2o", {}), ("vatp", {"value_norm": "off", "sinks": 0}), ("vatp", {})]:
        cache = model.new_cache(1)
        policy = make_policy(name, 10, **options)
        policy.start(30, 36)
        with torch.no_grad():
            model(ids, cache, policy)
            for t in range(6):
                model(torch.tensor([[t + 1]]), cache, policy)
        kept[name, tuple(options)] = [sorted(cache[l].positions[0, h].tolist()) for l in range(3) for h in range(2)]
    assert_equal(kept["vatp", ("value_norm", "sinks")], kept["h2o", ()], "VATP without `value_norm` and sinks: the tokens kept, as H2O's")
    assert kept["h2o", ()] != kept["vatp", ()], "VATP's score (`value_norm`): the value norms change nothing H2O keeps"
