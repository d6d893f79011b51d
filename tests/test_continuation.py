"""A cache that lives on (docs/design.md, "A cache that lives on"): a next prompt continues a run.

The rule: a next prompt is planned afresh when it arrives, its ratio budget a share of every token
the run has seen when it completes; a prefill-time method compresses again when it completes, an
every-call method goes on compressing after every call, a decode-time one at its next decode step;
the scorer's running sums and the compressor's state carry over. Expectations come from literal
re-simulations (tests/reference.py) or from runs the rule makes equal, never from the run itself.
And every way of feeding a prompt either does what the rule says or is refused.
"""
import pytest
import torch

from kvmini.errors import KvminiError
from kvmini.generate import fork, generate, prefill
from kvmini.methods.registry import METHODS, chooses_budget, make_policy
from reference import group_mean, random_model, simulate, top_positions
from test_methods_reference import h2o, per_head
from tiny import budget_of, fitted, gives_budgets


def turns(B=1, sizes=(20, 1, 1, 1, 12, 1, 1), seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (B, t), generator=gen) for t in sizes]


@torch.no_grad()
def engine_turns(model, calls, policy, prompts: dict[int, int], total_len=None):
    """calls[c] fed in order; prompts: call index -> the prompt length declared before it (call 0: start).
    Returns (last logits per call, kept positions entering each call and after the last)."""
    B, L, H_kv = calls[0].shape[0], model.config.num_layers, model.config.num_kv_heads
    cache = model.new_cache(B, 4)
    logits, kept = [], []
    for c, ids in enumerate(calls):
        if c in prompts:
            (policy.start if c == 0 else policy.next_prompt)(prompts[c], total_len)
        kept.append([[[sorted(cache[l].positions[b, h].tolist()) for h in range(H_kv)] for b in range(B)]
                     for l in range(L)])
        logits.append(model(ids, cache, policy)[:, -1])
    return logits, kept


def snapkv_turns(budgets: dict[int, int], g, window, kernel):
    """SnapKV written out for a run of several prompts: call c in `budgets` completes a prompt and keeps
    budgets[c] entries: the observation window (the last `window` kept-or-new entries) and the top of
    the rest by the window's pooled attention (kernel along the kept entries, zero padding)."""
    def choose(layer, c, probs, kept, new):
        C = group_mean(probs, g)[:, :, -window:].sum(2)  # (B, H_kv, N)

        def rule(b, h, cand):
            if c not in budgets or len(cand) <= budgets[c]:
                return cand
            prefix, obs = cand[:-window], cand[-window:]
            pooled = {p: sum(C[b, h, prefix[i]].item() for i in range(j - kernel // 2, j + kernel // 2 + 1)
                             if 0 <= i < len(prefix)) / kernel for j, p in enumerate(prefix)}
            return top_positions(prefix, pooled, budgets[c] - window) + obs
        return per_head(kept, new, rule)
    return choose


def assert_equal_runs(got, want):
    (got_logits, got_kept), (want_logits, want_kept) = got, want
    assert got_kept == want_kept
    for x, y in zip(got_logits, want_logits):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_a_prefill_time_method_compresses_each_prompt_with_a_share_of_everything_seen():
    """SnapKV at 0.4: 20 prompt tokens -> 8 kept; 3 decode steps append; the next prompt of 12 completes
    at 35 tokens -> round(0.4 * 35) = 14 kept, chosen by the new prompt's window over all it holds."""
    model = random_model(L=3, seed=3)
    calls = turns(B=2)
    got = engine_turns(model, calls, make_policy("snapkv", 0.4, window=3, kernel=3), {0: 20, 4: 12})
    assert_equal_runs(got, simulate(model, calls, snapkv_turns({0: 8, 4: 14}, g=2, window=3, kernel=3)))
    assert {len(s) for layer in got[1][5] for row in layer for s in row} == {14}


def test_an_every_call_method_just_continues():
    """H2O with 8 tokens per layer: the next prompt is one more call, compressed after it as every call is
    (a budget in tokens stays 8 when re-planned); the sums of attention carry over."""
    model = random_model(L=3, seed=4)
    calls = turns(B=2)
    assert_equal_runs(engine_turns(model, calls, make_policy("h2o", 8), {0: 20, 4: 12}),
                      simulate(model, calls, h2o(8, g=2)))


def last_call(run):
    logits, kept = run
    return [logits[-1]], [kept[-1]]


def test_an_idle_first_prompt_still_counts_the_attention_a_later_prompt_needs():
    """H2O at 0.5 with 8 recent tokens keeps a 3-token prompt whole (it always keeps more); the next prompt
    makes it compress, to round(0.5 * 28) = 14, with every query's attention summed since the first token:
    H2O's sums add up over calls, so the run equals one prompt of all 28 tokens."""
    model = random_model(L=3, seed=5)
    calls = turns(sizes=(3, 25, 1))
    policy = make_policy("h2o", 0.5, recent=8)
    got = engine_turns(model, calls, policy, {0: 3, 1: 25})
    assert policy.budgets == [14, 14, 14]
    one = engine_turns(model, [torch.cat(calls[:2], 1), calls[2]], make_policy("h2o", 0.5, recent=8), {0: 28})
    assert_equal_runs(last_call(got), last_call(one))


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "knorm"])
def test_a_next_prompt_after_an_uncompressed_one_keeps_what_one_prompt_of_both_keeps(name):
    """A budget of 24 tokens that a 14-token prompt never reaches: the cache holds everything, so the next
    prompt (ending at 40) compresses as one 40-token prompt does (its observation window lies in it)."""
    model = random_model(L=3, seed=6)
    calls = turns(B=2, sizes=(14, 26, 1))
    got = engine_turns(model, calls, make_policy(name, 24, **fitted(name)), {0: 14, 1: 26})
    one = engine_turns(model, [torch.cat(calls[:2], 1), calls[2]], make_policy(name, 24, **fitted(name)), {0: 40})
    assert_equal_runs(last_call(got), last_call(one))
    assert {len(s) for layer in got[1][-1] for row in layer for s in row} != {40}


# --- every way of feeding a prompt: right or refused (the cases) ----------------------------

def test_prefill_once_per_piece_is_a_prompt_per_piece():
    """prefill() on a cache that holds tokens feeds the run's next prompt: SnapKV at 0.2 keeps 8 of 40, then
    16 of 80, then 24 of 120 (before, each call restarted the run and nothing was compressed)."""
    model = random_model(L=3, seed=8)
    calls = turns(B=2, sizes=(40, 40, 40, 1), seed=9)
    policy, cache = make_policy("snapkv", 0.2, window=3, kernel=3), model.new_cache(2, 4)
    got_logits, got_kept = [], []
    with torch.no_grad():
        for ids in calls[:3]:
            got_kept.append([[[sorted(cache[l].positions[b, h].tolist()) for h in range(2)] for b in range(2)]
                             for l in range(3)])
            got_logits.append(prefill(model, ids, cache, policy))
    want_logits, want_kept = simulate(model, calls, snapkv_turns({0: 8, 1: 16, 2: 24}, g=2, window=3, kernel=3))
    assert got_kept == want_kept[:3] and cache.lengths() == [24, 24, 24]
    for x, y in zip(got_logits, want_logits):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_one_prompt_in_pieces_is_one_prefill_with_chunk_size_or_start_then_calls():
    """The two ways to feed one prompt in pieces keep what one call keeps."""
    model = random_model(L=3, seed=8)
    ids = turns(sizes=(120,), seed=9)[0]
    kept = []
    for feed in ("one call", "chunk_size", "start then calls"):
        policy, cache = make_policy("snapkv", 0.2, window=3, kernel=3), model.new_cache(1, 4)
        with torch.no_grad():
            if feed == "one call":
                prefill(model, ids, cache, policy)
            elif feed == "chunk_size":
                prefill(model, ids, cache, policy, chunk_size=40)
            else:
                policy.start(120)
                for s in range(0, 120, 40):
                    model(ids[:, s : s + 40], cache, policy)
        kept.append([sorted(lc.positions[0, h].tolist()) for lc in cache for h in range(2)])
    assert kept[0] == kept[1] == kept[2] and len(kept[0][0]) == 24


def test_raw_calls_without_start_are_refused():
    model = random_model(L=3)
    with torch.no_grad(), pytest.raises(KvminiError, match=r"policy.start\(prompt_len\) before the first call"):
        model(turns(sizes=(40,))[0], model.new_cache(1, 4), make_policy("snapkv", 0.2, window=3, kernel=3))


@pytest.mark.parametrize("name,options", [("snapkv", dict(window=3, kernel=3)), ("d2o", dict(variant="paper")),
                                          ("h2o", {})])
def test_a_call_across_the_prompts_end_is_refused_and_changes_nothing(name, options):
    """start(100), then calls of 60 + 60: the second would end the prompt inside itself (before, a prefill-time
    method never compressed and D2O's paper variant read that one call's statistics only)."""
    model = random_model(L=3)
    ids = turns(sizes=(120,))[0]
    policy, cache = make_policy(name, 0.2, **options), model.new_cache(1, 4)
    policy.start(100)
    with torch.no_grad():
        model(ids[:, :60], cache, policy)
        lengths = cache.lengths()  # 60, or 20 for H2O, which compresses after every call by design
        with pytest.raises(KvminiError, match="a call of 60 tokens from position 60 crosses the prompt's end at 100; "
                                              "feed the prompt's last 40 tokens in their own call"):
            model(ids[:, 60:], cache, policy)
        assert cache.seen_tokens == 60 and cache.lengths() == lengths
        model(ids[:, 60:100], cache, policy)  # the documented way on: the prompt's end, then what follows
        model(ids[:, 100:], cache, policy)
    assert cache.seen_tokens == 120 and max(cache.lengths()) < 120


def test_a_next_prompt_before_the_prompt_is_complete_or_without_a_run_is_refused():
    model, policy = random_model(L=3), make_policy("snapkv", 0.2, window=3, kernel=3)
    with pytest.raises(KvminiError, match=r"next_prompt continues a run; call policy.start\(prompt_len\)"):
        policy.next_prompt(10)
    policy.start(30)
    with pytest.raises(KvminiError, match="next_prompt takes the prompt's length in tokens, a whole number >= 1, got 0"):
        policy.next_prompt(0)
    with torch.no_grad():
        model(turns(sizes=(10,))[0], model.new_cache(1, 4), policy)
    with pytest.raises(KvminiError, match="the prompt is not complete \\(20 of its tokens are still to come\\)"):
        policy.next_prompt(10)


def test_a_run_promised_to_end_that_skipped_statistics_refuses_a_next_prompt():
    """generate() tells the policy where the run ends; with H2O's budget never reached there, it keeps no
    sums, and a next prompt would find them missing: refused, naming the way (more_prompts=True)."""
    model = random_model(L=3)
    first = generate(model, turns(sizes=(20,))[0], 3, policy=(policy := make_policy("h2o", 50)))
    with pytest.raises(KvminiError, match=r"start it without total_len \(generate\(..., more_prompts=True\)\)"):
        generate(model, turns(sizes=(5,))[0], 3, policy=policy, cache=first.cache)
    policy = make_policy("h2o", 24)
    first = generate(model, turns(sizes=(20,))[0], 3, policy=policy, more_prompts=True)
    second = generate(model, turns(sizes=(5,))[0], 3, policy=policy, cache=first.cache)
    assert second.cache is first.cache and first.cache.seen_tokens == 20 + 2 + 5 + 2


# --- every method, and questions from copies -----------------------------------------------------

@pytest.mark.parametrize("name", [m for m in METHODS if METHODS[m] is not None])
@pytest.mark.parametrize("B", [1, 2])
def test_every_method_continues_a_conversation(name, B):
    """Three turns on one cache: each row's positions are distinct and below what was seen, and each row of a
    method whose budgets are numbers it was given holds no more than them (+ evict_every's slack, + the
    tokens a prefill-time method appended since its last prompt) after the last turn."""
    model = random_model(L=3, seed=2)
    policy = make_policy(name, None if chooses_budget(name) else 0.5, **fitted(name))
    cache = None
    for size in (24, 9, 15):
        ids = torch.randint(0, 61, (B, size), generator=torch.Generator().manual_seed(size))
        cache = generate(model, ids, 3, policy=policy, cache=cache, more_prompts=True).cache
    seen = 24 + 9 + 15 + 3 * 2
    assert cache.seen_tokens == seen
    held = [[[[p for p in head if p < seen] for head in row] for row in lc.positions.tolist()] for lc in cache]
    assert all(len(set(h)) == len(h) for layer in held for row in layer for h in row)
    if gives_budgets(name):
        slack = policy.evict_every - 1 + (2 if policy.schedule == "prefill" else 0)
        for b in range(B):
            for l, layer in enumerate(held):
                budget = budget_of(policy, l, b)
                counts = [len(h) for h in layer[b]]
                assert sum(counts) / len(counts) <= budget + slack  # per KV head, on average
                assert policy.own_counts or max(counts) <= budget + slack



@pytest.mark.parametrize("name", ["snapkv", "h2o", "d2o", "weightedkv"])
def test_questions_answered_from_copies_of_one_context(name):
    """fork: each question continues its own copy; the context's cache is left as it was, and each answer
    equals the answer of a run that compressed the context afresh before that question."""
    model = random_model(L=3, seed=1)
    context, q1, q2 = turns(sizes=(40, 7, 9), seed=3)

    def compressed():
        policy = make_policy(name, 0.3, **fitted(name))
        with torch.no_grad():
            cache = model.new_cache(1, 4)
            prefill(model, context, cache, policy)
        return cache, policy

    cache, policy = compressed()
    before = [lc.keys.clone() for lc in cache]
    answers = [generate(model, q, 5, policy=p, cache=c).tokens for q in (q1, q2) for c, p in [fork(cache, policy)]]
    assert [torch.equal(x, lc.keys) for x, lc in zip(before, cache)] == [True] * 3
    assert answers == [generate(model, q, 5, policy=p, cache=c).tokens for q in (q1, q2) for c, p in [compressed()]]


def test_a_next_prompt_of_another_batch_or_a_cache_that_is_not_one_is_refused():
    model, policy = random_model(L=3), make_policy("h2o", 8)
    first = generate(model, turns(B=2, sizes=(12,))[0], 2, policy=policy, more_prompts=True)
    with pytest.raises(KvminiError, match="ids hold 1 sequences but the cache 2"):
        generate(model, turns(sizes=(5,))[0], 2, policy=policy, cache=first.cache)
    with pytest.raises(KvminiError, match=r"cache must be a KVCache \(a GenerationResult's .cache\), got list"):
        generate(model, turns(sizes=(5,))[0], 2, policy=policy, cache=[])


def test_a_batch_with_budgets_per_sequence_moves_to_the_next_prompt():
    model, policy = random_model(L=3), make_policy("d2o", 0.5, variant="paper")
    first = generate(model, turns(B=2, sizes=(20,))[0], 2, policy=policy, more_prompts=True)
    generate(model, turns(B=2, sizes=(9,))[0], 2, policy=policy, cache=first.cache)
    assert policy.run.prompt_end == 20 + 1 + 9 and len(policy.row_budgets[0]) == 2  # one policy, a budget per sequence


@pytest.mark.parametrize("name", ["snapkv", "d2o", "h2o"])  # once per prompt, per sequence, every call
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None, "30"])
def test_start_refuses_a_prompt_length_that_is_not_a_whole_number_of_at_least_one(name, bad):
    """start, like next_prompt, is where a prompt's length enters a run: refused there, and the run stays
    unstarted (its first call asks for start, as before any start)."""
    model, policy = random_model(L=3), make_policy(name, 0.2)
    with pytest.raises(KvminiError, match=f"start takes the prompt's length in tokens, a whole number >= 1, got {bad!r}$"):
        policy.start(bad)
    with torch.no_grad(), pytest.raises(KvminiError, match=r"call policy.start\(prompt_len\) before the first call"):
        model(turns(sizes=(10,))[0], model.new_cache(1, 4), policy)


@pytest.mark.parametrize("bad", [10, 59, -5, 2.5, "70", True])
def test_prefill_refuses_a_total_len_short_of_the_prompts_end(bad):
    """total_len promises where a run ends; a promise short of the prompt (here 60 tokens) made h2o at 0.3
    keep all 60 (the budget read as one the run never exceeds), "70" raised a raw TypeError. Refused; the
    prompt's end itself is a valid promise and keeps round(0.3 * 60) = 18 tokens per head."""
    model, ids = random_model(L=3), turns(sizes=(60,))[0]
    with torch.no_grad(), pytest.raises(KvminiError, match=rf"prefill: total_len must be None or a whole number >= "
                                                           rf"the prompt's end \(60\), got {bad!r}$"):
        prefill(model, ids, model.new_cache(1), make_policy("h2o", 0.3), total_len=bad)
    cache = model.new_cache(1)
    with torch.no_grad():
        prefill(model, ids, cache, make_policy("h2o", 0.3), total_len=60)
    assert cache[0].length == 18


def test_a_next_prompts_total_len_counts_the_tokens_before_it():
    """On a cache holding 20 tokens, a next prompt of 12 ends at 32: total_len 31 is short of it."""
    model, (first, second) = random_model(L=3), turns(sizes=(20, 12))
    cache, policy = model.new_cache(1), make_policy("snapkv", 0.5)
    with torch.no_grad():
        prefill(model, first, cache, policy)
        with pytest.raises(KvminiError, match=r"total_len must be None or a whole number >= the prompt's end \(32\), got 31"):
            prefill(model, second, cache, policy, total_len=31)


@pytest.mark.parametrize("model,total_len,fragment", [
    ("x", None, "start takes the run's model, a kvmini Transformer, got str"),
    (None, 19, r"total_len must be None or a whole number >= the prompt's end \(20\), got 19"),
    (None, "30", r"total_len must be None or a whole number >= the prompt's end \(20\), got '30'"),
])
def test_start_refuses_a_model_or_total_len_it_cannot_use(model, total_len, fragment):
    """Method.start(n, model="x") raised a raw TypeError (cannot create weak reference); now one line."""
    with pytest.raises(KvminiError, match=f"h2o: {fragment}$"):
        make_policy("h2o", 0.3).start(20, total_len, model)


def test_next_prompt_refuses_a_total_len_short_of_its_end():
    """Method.next_prompt is an entry too (a run continued without prefill): on 20 tokens fed, a next prompt
    of 12 ends at 32."""
    model, (first, _) = random_model(L=3), turns(sizes=(20, 12))
    policy = make_policy("h2o", 0.5)
    with torch.no_grad():
        prefill(model, first, model.new_cache(1), policy)
    with pytest.raises(KvminiError, match=r"h2o: total_len must be None or a whole number >= the prompt's end \(32\), got 31$"):
        policy.next_prompt(12, 31)
    policy.next_prompt(12, 32)
    assert policy.run.prompt_end == 32


def test_prefill_refuses_a_model_that_is_not_a_transformer():
    with pytest.raises(KvminiError, match=r"model must be a kvmini Transformer \(kvmini.loading.load_model\), got dict$"):
        prefill({}, torch.tensor([[1, 2, 3]]), random_model(L=3).new_cache(1))
