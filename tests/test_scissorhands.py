"""Scissorhands: the low-attention flag by hand, the importance record on a hand-worked stream
(Alg. 1-2 with B = 6, m = 2, w = 3, r = 2), and the engine against a literal masked simulation."""
from collections import defaultdict

import pytest
import torch

from kvmini.cache import LayerCache
from kvmini.methods.registry import declarations, make_policy
from kvmini.methods.scissorhands import below_average, drop, drop_lowest, importance_score, remember
from kvmini.methods.selectors import shrink
from reference import engine_run, random_model, simulate


def test_a_token_is_low_when_it_gets_less_than_a_uniform_share():
    """Row (.30, .05, .10, .20, .15, .20) over 6 keys: 1/6 = .167, so keys 1, 2 and 4 are low; a key the
    query cannot see (attention 0) is never low, and a share equal to 1/|K| is not low."""
    row = torch.tensor([[[[0.30, 0.05, 0.10, 0.20, 0.15, 0.20]]]], dtype=torch.float64)
    assert below_average(row).flatten().tolist() == [0, 1, 1, 0, 1, 0]
    four = torch.tensor([[[[0.35, 0.05, 0.10, 0.30, 0.20, 0.0]]]], dtype=torch.float64)  # 5 seen: 1/5 = .20
    assert below_average(four).flatten().tolist() == [0, 1, 1, 0, 0, 0]


ROWS = {  # step t -> the query's attention over the cache, in position order (scissorhands notes, toy 1)
    0: [1.0], 1: [0.6, 0.4], 2: [0.5, 0.2, 0.3], 3: [0.40, 0.10, 0.30, 0.20],
    4: [0.35, 0.05, 0.10, 0.30, 0.20], 5: [0.30, 0.05, 0.10, 0.20, 0.15, 0.20],
    6: [0.30, 0.25, 0.10, 0.15, 0.20], 7: [0.30, 0.10, 0.10, 0.20, 0.10, 0.20],
}


@pytest.mark.parametrize("evict", [shrink, drop_lowest], ids=["shrink", "drop_lowest"])
def test_the_hand_worked_stream(evict):
    """B = 6, m = 2 (budget 4, evict 2 at once), w = 3, r = 2. After step 5 the window is steps 3-5:
    I = 0, 3, 2, 1 for positions 0-3 (4 and 5 are recent), so 1 and 2 go: [0, 3, 4, 5]. After step 7
    (steps 5-7): I(0) = 0, I(3) = 1, I(4) = 3, I(5) = 1: 4 goes, then the tie of 3 and 5 drops the
    older, 3: [0, 5, 6, 7]. The cache holds 1, 2, 3, 4, 5, 4, 5, 4 entries."""
    lc = LayerCache(1, 1, 1, torch.float64, "cpu")
    lc.declare(("low_history", torch.int16, (3,)), ("low_count", torch.int32))  # the ring of w = 3 steps, and I
    sizes, kept = [], {}
    for t, row in ROWS.items():
        lc.append(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), torch.tensor([[t]]))
        order = lc.positions[0, 0].argsort()
        attention = torch.zeros(1, 1, 1, lc.length, dtype=torch.float64)
        attention[..., order] = torch.tensor(row, dtype=torch.float64)  # the row in buffer order
        remember(lc, below_average(attention)[:, :, 0], t, 1, 3)
        if lc.length == 6:  # the cache reached B: drop m = 2
            evict(lc, importance_score(lc), 4, 0, 2, int(lc.positions.max()))
            kept[t] = sorted(lc.positions.flatten().tolist())
        sizes.append(lc.length)
    assert kept == {5: [0, 3, 4, 5], 7: [0, 5, 6, 7]}
    assert sizes == [1, 2, 3, 4, 5, 4, 5, 4]


def test_drop_moves_the_last_surviving_entries_into_the_victims_slots():
    """drop(victims), worked by hand: per head, the victims below S - m take the surviving entries of the
    last m places, smallest hole first; a record of several values per entry moves whole."""
    lc = LayerCache(1, 3, 1, torch.float32, "cpu")
    lc.declare(("history", torch.int16, (2,)))
    for t in range(6):
        lc.append(torch.full((1, 3, 1, 1), float(t)), torch.full((1, 3, 1, 1), 10.0 * t), torch.tensor([[t]]))
    lc.aux("history")[:] = (torch.arange(6, dtype=torch.int16)[:, None] * torch.tensor([1, -1], dtype=torch.int16))
    kept = drop(lc, torch.tensor([[[4, 1], [5, 4], [0, 5]]]))
    # head 0: hole 1, tail 4 (a victim), 5 -> 5 into 1; head 1: both victims in the tail; head 2: 4 into 0
    assert kept.tolist() == [[[0, 5, 2, 3], [0, 1, 2, 3], [4, 1, 2, 3]]]
    assert lc.length == 4 and lc.positions.tolist() == kept.tolist()
    assert lc.keys[..., 0].tolist() == [[[0, 5, 2, 3], [0, 1, 2, 3], [4, 1, 2, 3]]]
    assert lc.values[..., 0].tolist() == [[[0, 50, 20, 30], [0, 10, 20, 30], [40, 10, 20, 30]]]
    assert lc.aux("history")[0, 2].tolist() == [[4, -4], [1, -1], [2, -2], [3, -3]]


@pytest.mark.parametrize("seed", range(40))
def test_drop_lowest_keeps_what_topk_keeps_in_any_buffer_order(seed):
    """Random decode-time caches (sinks at positions 0.., gaps, the window the newest positions), buffers
    in any order, distinct scores: drop_lowest leaves the tokens shrink's sort and keep leave, each with its
    key, value and record."""
    gen = torch.Generator().manual_seed(seed)
    sinks, recent, m = (int(x) for x in torch.randint(0, 4, (3,), generator=gen))
    m, S = m + 2, int(torch.randint(12, 40, (1,), generator=gen))
    b = S - m
    middle = (torch.randperm(3 * S, generator=gen)[: S - sinks - recent] + sinks).sort().values
    top = int(middle.max()) + 1
    positions = torch.cat([torch.arange(sinks), middle, torch.arange(top, top + recent)])  # (S,) ascending
    caches = []
    for evict in (shrink, drop_lowest):
        lc = LayerCache(1, 2, 1, torch.float64, "cpu")
        lc.declare(("record", torch.int16, (3,)))
        perm = torch.stack([torch.randperm(S, generator=torch.Generator().manual_seed(seed + h)) for h in range(2)])
        pos = positions[perm]  # (2, S): each head's buffer in its own order
        lc.append(pos[None, :, :, None].double(), -pos[None, :, :, None].double(), torch.zeros(1, S, dtype=torch.long))
        lc.positions[0] = pos
        lc.aux("record")[0] = pos[..., None].to(torch.int16) * torch.tensor([1, 2, 3], dtype=torch.int16)
        score = torch.sin(pos.double() * 7.3 + seed)[None]  # (1, 2, S): distinct
        if evict is drop_lowest:  # its own path: no entry but the last m moves
            lc.keep = lambda idx: pytest.fail("drop_lowest fell back to keep")
        evict(lc, score, b, sinks, recent, int(positions.max()))
        order = lc.positions.argsort(-1)
        caches.append([lc.positions.gather(2, order), lc.keys[..., 0].gather(2, order),
                       lc.values[..., 0].gather(2, order), lc.aux("record")[..., 2].gather(2, order)])
    for want, got in zip(*caches):
        assert torch.equal(want, got)
    assert torch.equal(caches[1][1], caches[1][0].double()) and torch.equal(caches[1][3], 3 * caches[1][0].to(torch.int16))


def scissorhands_literal(budget, g, n, w=400, sinks=0, recent=10, m=16):
    """Alg. 1-2 in loops, per KV head: after every call, each kept or new token records the number of
    (query head, query) pairs among the call's last min(T, w) queries that gave it less than 1/|K| of
    their attention, as one step at the call's last position; a layer over budget + m - 1 (budget
    during the prompt) drops to the budget the tokens with the most low steps in the last w steps,
    keeping the first `sinks`, the last `recent`, and, on ties, the newer token."""
    history = defaultdict(dict)  # (layer, b, h, position) -> {step: low count}

    def choose(layer, c, probs, kept, new, *_):
        T, end = len(new), new[-1] + 1
        rows = probs[:, :, max(T - w, 0):]  # (B, H, T', N): the call's last min(T, w) queries
        low = (rows > 0) & (rows * (rows > 0).sum(-1, keepdim=True) < 1)

        def rule(b, h, cand):
            for p in cand:
                history[layer, b, h, p][end - 1] = sum(int(low[b, hq, i, p]) for hq in range(h * g, (h + 1) * g)
                                                       for i in range(low.shape[2]))
            slack = 0 if end <= n else m - 1
            if len(cand) <= budget + slack:
                return cand
            importance = {p: sum(x for s, x in history[layer, b, h, p].items() if s >= end - w) for p in cand}
            first, middle, last = cand[:sinks], cand[sinks : len(cand) - recent], cand[len(cand) - recent :]
            best = sorted(middle, key=lambda p: (importance[p], -p))[: budget - sinks - recent]
            return first + sorted(best) + last

        return [[rule(b, h, sorted(s + new)) for h, s in enumerate(row)] for b, row in enumerate(kept)]
    return choose


@pytest.mark.parametrize("options,budget,chunks,steps", [
    ({"history": 4, "recent": 2, "evict_every": 3}, 8, [20], 9),  # a prompt in one call, then drops of 3
    ({"history": 3, "recent": 2, "evict_every": 1}, 8, [1] * 12, 4),  # token by token: Alg. 1 literally
    ({"history": 30, "sinks": 2, "recent": 3, "evict_every": 2}, 9, [7, 11], 6),  # w longer than the run
])
def test_engine_equals_literal_masked_simulation(options, budget, chunks, steps):
    model = random_model(L=3, H=4, H_kv=2, seed=len(chunks)).to(torch.float64)
    gen = torch.Generator().manual_seed(3)
    B, n = 2, sum(chunks)
    calls = [torch.randint(0, 61, (B, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (B, 1), generator=gen) for _ in range(steps)]
    got_logits, got_kept = engine_run(model, calls, make_policy("scissorhands", budget, **options), n)
    rule = {k: v for k, v in options.items() if k in ("sinks", "recent")}
    literal = scissorhands_literal(budget, 2, n, w=options["history"], m=options["evict_every"], **rule)
    want_logits, want_kept = simulate(model.to(torch.float32), calls, literal)
    assert got_kept == want_kept
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=0)


def test_the_drop_amount_is_the_engines_evict_every_with_its_own_default():
    every = {d.name: d for d in declarations("scissorhands")}["evict_every"]
    assert every.default == 16 and {d.name: d for d in declarations("h2o")}["evict_every"].default == 1
    assert make_policy("scissorhands", 32).evict_every == 16
    assert make_policy("scissorhands", 32, evict_every=4).evict_every == 4
    assert make_policy("h2o", 32).evict_every == 1


@pytest.mark.parametrize("chunks", [[20], [7, 11], [1] * 9], ids=["one call", "two chunks", "token by token"])
def test_the_record_kept_as_the_ring_turns_is_the_rings_sum(chunks):
    """I_j is kept as the ring turns ("low_count": the step a slot held leaves as the new one comes), not
    summed from the ring: after every call (a prompt in one call or chunks, the window wrapping, entries
    moved by evictions) it equals the sum of each entry's ring."""
    model = random_model(L=2, H=4, H_kv=2, seed=4).to(torch.float64)
    gen = torch.Generator().manual_seed(6)
    calls = [torch.randint(0, 61, (2, t), generator=gen) for t in chunks]
    calls += [torch.randint(0, 61, (2, 1), generator=gen) for _ in range(14)]
    policy = make_policy("scissorhands", 8, history=5, recent=2, evict_every=3)
    cache = model.new_cache(2, 4)
    policy.start(sum(chunks), sum(ids.shape[1] for ids in calls))
    for ids in calls:
        model(ids, cache, policy)
        for layer in range(2):
            ring = cache[layer].aux("low_history")  # (B, H_kv, S, w)
            assert torch.equal(cache[layer].aux("low_count"), ring.sum(-1, dtype=torch.int32))
    assert sum(policy.evicted) > 0 and int(cache[0].aux("low_count").max()) > 0
