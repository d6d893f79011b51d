"""A decode step's evictions for all layers at once (`AtOnce.end`: the same parts on the layers held
as the rows of one LayerCache, `at_once.Stack`) equal the same evictions layer by layer (`AtOnce.together = False`: kvmini.policy, the readable specification).

The per-layer path is itself proven against literal references (tests/test_policy.py, test_d2o.py,
test_weightedkv.py); here both paths run the same calls and must leave the same caches: the same
entries in the same buffer slots (positions exactly), the same keys and values, logits, budgets,
evictions, merge counts, D2O thresholds and merge traces. Float64 models, so that no near tie can
flip between the two (their matmuls see batches of different sizes).
"""
import pytest
import torch

from kvmini import at_once
from kvmini.cache import PAD, KVCache, LayerCache
from kvmini.config import ModelConfig
from kvmini.generate import for_batch
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.registry import METHODS, TOGETHER, evicts_while_decoding, make_policy
from kvmini.methods.selectors import lowest
from kvmini.view import record_merges
from reference import random_model

TOL = dict(rtol=1e-12, atol=1e-12)
SKEWED = {"variant": "paper", "allocation": "zscore", "softmax_temperature": 0.2}  # one layer gets far more
DECODE_TIME = [  # every method and variant that evicts while decoding
    ("streaming_llm", 12, {}),
    ("h2o", 12, {}),
    ("h2o", 12, {"recent": 3, "reduce": "max"}),
    ("tova", 12, {}),
    ("tova", 12, {"sinks": 2, "recent": 2}),
    ("weightedkv", 12, {}),
    ("weightedkv", 12, {"sinks": 1, "recent": 3}),
    ("weightedkv", 12, {"chunk_merge": "sequential"}),  # stays layer by layer (Alg. 1's position order)
    ("d2o", 12, {"protected_layers": ""}),  # official: per-layer budgets, so the joined rows are padded (also paper)
    ("d2o", 12, {}),  # official with its protected layers 0, 1 and -1
    ("d2o", 12, {"variant": "paper"}),
    ("d2o", 0.6, {"variant": "paper"}),
    ("d2o", 12, {"variant": "paper", "merge": "official", "tau": "per_layer", "beta": 0.3}),
    ("d2o", 12, {"variant": "paper", "allocation": "uniform", "merge": "off"}),
    ("d2o", 12, {"variant": "official", "split": "paper", "nm": "3:1", "protected_layers": "1"}),
    ("d2o", 12, SKEWED),  # budgets [24, 8, 8, 8]: layer 0, over twice the median, is evicted on its own
    ("d2o", 0.4, SKEWED),  # [40, 8, 8, 8]: layer 0 holds the whole prompt, its first eviction a decode step's
    ("scissorhands", 30, {"evict_every": 3}),  # steps that only update the history at once, and steps that evict
    ("scissorhands", 30, {"evict_every": 3, "history": 2}),  # 3 of 33, layer after layer; the ring turns
    ("scissorhands", 12, {"evict_every": 3}),  # 3 of 15: DropLowest, layer after layer from the joined score
    ("h2o", 30, {"evict_every": 4}),
    ("tova", 12, {"evict_every": 4}),  # nothing to update between evictions
    ("d2o", 12, {"variant": "paper", "evict_every": 3}),  # merges, rows of different lengths: layer after layer
]
DECODE_TIME += [(name, 12, {}) for name in METHODS  # a method added later is checked with its defaults
                if evicts_while_decoding(name) and name not in {case[0] for case in DECODE_TIME}]
DECODE_TIME = [case for case in DECODE_TIME if case[0] in TOGETHER]  # the methods with an at-once step


def run(model, name, budget, options, together: bool, batch: int = 1, steps: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    calls = [torch.randint(0, 61, (batch, 40), generator=gen)]
    calls += [torch.randint(0, 61, (batch, 1), generator=gen) for _ in range(steps)]
    policy = for_batch(make_policy(name, budget, **options), batch)  # a batch's copies are made at its first call
    getattr(policy, "one", policy).together = together
    trace = record_merges(policy)
    policy.start(40, 40 + steps)
    cache = model.new_cache(batch, 4)
    logits = []
    with torch.no_grad():
        for ids in calls:
            logits.append(model(ids, cache, policy)[:, -1])
    return cache, policy, logits, trace


def same(a, b) -> None:
    cache_a, policy_a, logits_a, trace_a = a
    cache_b, policy_b, logits_b, trace_b = b
    for la, lb in zip(logits_a, logits_b):
        torch.testing.assert_close(la, lb, **TOL)
    for lc_a, lc_b in zip(cache_a.layers, cache_b.layers):
        assert lc_a.length == lc_b.length
        assert torch.equal(lc_a.positions, lc_b.positions)  # the same entries in the same slots
        torch.testing.assert_close(lc_a.keys, lc_b.keys, **TOL)
        torch.testing.assert_close(lc_a.values, lc_b.values, **TOL)
        assert lc_a.aux_names() == lc_b.aux_names()
        for name in lc_a.aux_names():
            torch.testing.assert_close(lc_a.aux(name), lc_b.aux(name), **TOL)
    assert policy_a.budgets == policy_b.budgets and policy_a.evicted == policy_b.evicted
    assert policy_a.merged == pytest.approx(policy_b.merged, abs=1e-9)
    assert (trace_a is None) == (trace_b is None)
    for ra, rb in zip(trace_a or [], trace_b or []):
        assert ra.layer == rb.layer and torch.equal(ra.evicted, rb.evicted) and torch.equal(ra.into, rb.into)
        torch.testing.assert_close(ra.weight, rb.weight, **TOL)
    assert len(trace_a or []) == len(trace_b or [])


@pytest.fixture(scope="module")
def model():
    return random_model(L=4).to(torch.float64)


@pytest.mark.parametrize("name, budget, options", DECODE_TIME, ids=lambda x: str(x))
def test_all_layers_at_once_equal_layer_by_layer(model, name, budget, options):
    joint, alone = run(model, name, budget, options, True), run(model, name, budget, options, False)
    same(joint, alone)


@pytest.mark.parametrize("name, options", [(m, {}) for m in ("h2o", "tova", "weightedkv", "streaming_llm") if m in TOGETHER])
def test_a_batch_at_once_equals_layer_by_layer(model, name, options):
    same(run(model, name, 12, options, True, batch=2), run(model, name, 12, options, False, batch=2))


def calls_at_once(monkeypatch) -> list[tuple]:
    """The layers of every `AtOnce.compress_together` call from now on."""
    calls = []
    real = at_once.AtOnce.compress_together
    monkeypatch.setattr(at_once.AtOnce, "compress_together",
                        lambda self, cache, deferred: calls.append(tuple(l for l, _ in deferred)) or real(self, cache, deferred))
    return calls


@pytest.mark.parametrize("name", ["weightedkv"])
def test_the_joint_path_runs(model, name, monkeypatch):
    """The comparison above compares two different paths: the joint one really runs (and the
    layer-by-layer one really does not)."""
    calls = calls_at_once(monkeypatch)
    run(model, name, 12, {}, False)
    assert calls == []
    run(model, name, 12, {}, True)
    assert len(calls) >= 7 and all(layers == (0, 1, 2, 3) for layers in calls)


def test_steps_between_evictions_update_at_once_without_copying(model, monkeypatch):
    """evict_every = 3: the steps that evict nowhere update Scissorhands' history for all layers at once,
    and the steps that evict drop 3 entries from each layer; the layers grow between evictions inside
    the stack's room, so they are copied in once."""
    calls, stacks = calls_at_once(monkeypatch), []
    real = at_once.Stack.__init__
    monkeypatch.setattr(at_once.Stack, "__init__", lambda self, cache, layers, room: stacks.append(room) or real(self, cache, layers, room))
    _, policy, _, _ = run(model, "scissorhands", 30, {"evict_every": 3}, True)
    assert sum(policy.evicted) == 4 * (40 - 30) + 4 * 6  # the prompt, then 3 entries at steps 3 and 6 of 8
    assert len(calls) == 8 and stacks == [3]


def test_stacked_layers_are_views_of_ragged_rows_and_rebuilt_when_one_outgrows_it():
    config = ModelConfig("llama", 11, 8, 16, 3, 2, 1, 4, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64)
    cache = KVCache(config, batch=1)
    for i, lc in enumerate(cache.layers):  # layer i holds 5 + i entries at positions 0..4+i
        n = 5 + i
        lc.append(torch.full((1, 1, n, 4), float(i)), torch.full((1, 1, n, 4), -float(i)), torch.arange(n)[None])
        lc.declare("score")
        lc.aux("score").copy_(torch.arange(n, dtype=torch.float32)[None, None])
    stack = at_once.Stack(cache, (0, 2), room=1)
    joint = stack.joint
    assert type(joint) is LayerCache and joint.keys.shape == (2, 1, 7, 4) and joint.held().tolist() == [[5], [7]]
    assert joint.positions[0, 0].tolist() == [0, 1, 2, 3, 4, PAD, PAD]  # layer 0's row: its entries, then pads
    assert joint.keys[0, 0, 5:].abs().sum() == 0 and joint.aux("score")[0, 0, 5:].tolist() == [0, 0]
    joint.evict_one(torch.tensor([[1], [3]]))  # layer 0 drops position 1, layer 2 position 3: each row's last moves there
    for layer in (0, 2):
        cache[layer].length -= 1
    assert cache[0].positions.tolist() == [[[0, 4, 2, 3]]] and cache[2].positions.tolist() == [[[0, 1, 2, 6, 4, 5]]]
    assert cache[0].aux("score").tolist() == [[[0, 4, 2, 3]]]
    assert cache[2].keys[0, 0, :, 0].tolist() == [2.0] * 6 and cache[1].length == 6  # layer 1 untouched
    assert stack.holds(cache) and joint.length == 6 and joint.held().tolist() == [[4], [6]]  # no copy while they stay in it
    for layer in (0, 2):  # a decode step appends to each layer: each row's next place
        cache[layer].append(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), torch.tensor([[7]]))
    assert stack.holds(cache) and joint.positions[:, 0].tolist() == [[0, 4, 2, 3, 7, PAD, PAD], [0, 1, 2, 6, 4, 5, 7]]
    cache[0].append(torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), torch.arange(8, 13)[None])  # outgrows it
    assert not stack.holds(cache)
    again = at_once.Stack(cache, (0, 2), room=1)
    assert again.joint.held().tolist() == [[10], [7]] and again.joint.positions[0, 0, :10].tolist() == [0, 4, 2, 3, 7, 8, 9, 10, 11, 12]
    assert again.joint.positions[1, 0, :10].tolist() == [0, 1, 2, 6, 4, 5, 7, PAD, PAD, PAD]


def test_lowest_skips_pads_and_takes_a_window_per_row():
    # two rows (layers) of 5 places; row 1 holds 4 entries after a pad
    score = torch.tensor([[[5.0, 1.0, 9.0, 3.0, 0.0]], [[-1.0, 4.0, 2.0, 8.0, 6.0]]])
    positions = torch.tensor([[[0, 1, 2, 3, 4]], [[PAD, 0, 1, 2, 3]]])
    recent = torch.tensor([3, 1])[:, None, None]  # row 0 protects positions 2-4, row 1 position 4 (none held)
    # row 0: free position 1 (score 1); row 1: positions 1, 2, 3 free, the lowest is 1 (score 2), the pad never
    assert lowest(score, positions, 1, recent, newest=4).tolist() == [[1], [2]]
    assert lowest(score, positions, 1, 0, newest=4).tolist() == [[4], [2]]


def test_a_pad_is_never_the_nearest_entry():
    """A pad's key is zero, so its cosine (0) would beat real keys that all point away from the victim."""
    joint = LayerCache(2, 1, 2, torch.float64, "cpu")
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [-1.0, -0.5], [-1.0, 0.1]])  # zero, a victim, two keys pointing away
    joint.append(keys.expand(2, 1, 4, 2), keys.expand(2, 1, 4, 2), torch.arange(4).expand(2, 4))
    joint._pos[0, 0, 0] = PAD  # row 0 holds a pad and 3 entries; row 1 holds 4 (its zero key is real)
    merge = EMAMerge(beta=0.5, weights="official", tau="per_layer")
    merge.trace = []  # a first threshold is the step's own similarity: every evicted token merges
    merge.one((0, 1), joint, torch.tensor([[1], [1]]), 3)
    assert [record.into.item() for record in merge.trace] == [2, 0]  # cosines -0.89 and 0 (not the pad's 0)


def test_thresholds_of_several_layers_equal_each_layer_alone():
    best = torch.rand(3, 2, 1, dtype=torch.float64)  # three layers' rows, batch 1, 2 KV heads, one evicted token
    together, alone = EMAMerge(beta=0.3), EMAMerge(beta=0.3)
    together.reset(3), alone.reset(3)
    first = torch.rand(2, 2, 1, dtype=torch.float64)
    for merge in (together, alone):  # layers 0 and 2 have a threshold, layer 1 none yet
        merge.decide((0,), first[0:1])
        merge.decide((2,), first[1:2])
    merge = together.decide((0, 1, 2), best)
    for layer in range(3):
        assert torch.equal(alone.decide((layer,), best[layer : layer + 1]), merge[layer : layer + 1])
        assert torch.equal(together.tau[layer], alone.tau[layer])
    assert torch.equal(together.tau[1], best[1:2].mean(-1))  # tau_0: this step's mean, exactly


def test_evict_every_n_holds_up_to_budget_plus_n_minus_one_and_evicts_n_at_once(model):
    policy = make_policy("h2o", 12, evict_every=4)
    policy.start(40, 52)
    cache = model.new_cache(1, 4)
    gen = torch.Generator().manual_seed(1)
    held = []
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 40), generator=gen), cache, policy)
        held.append(cache.lengths()[0])
        for _ in range(12):
            model(torch.randint(0, 61, (1, 1), generator=gen), cache, policy)
            held.append(cache.lengths()[0])
    assert held == [12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12]  # the prompt to 12; then every 4th step
    assert policy.evicted == [28 + 12] * 4


def test_evict_every_n_evicts_what_keep_top_of_the_scores_keeps(model):
    """Every N-th step, each layer keeps the budget's best of the budget + N entries it holds by H2O's
    scores: computed here from the scores before the step plus that step's attention row, taken from a
    copy of the cache run without compression, and `keep_top` (tested by hand in test_policy.py)."""
    import copy

    from kvmini.eval.layers import ColumnSums
    from kvmini.methods.selectors import keep_top

    policy = make_policy("h2o", 12, evict_every=3, recent=2)
    policy.start(40, 46)
    cache = model.new_cache(1, 4)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 40), generator=gen), cache, policy)
        for _ in range(2):
            model(torch.randint(0, 61, (1, 1), generator=gen), cache, policy)
        assert cache.lengths() == [14] * 4  # budget + N - 1
        step, copied, row = torch.randint(0, 61, (1, 1), generator=gen), copy.deepcopy(cache), ColumnSums()
        model(step, copied, row)  # the third step's attention rows, nothing evicted
        model(step, cache, policy)
    for lc, full, sums in zip(cache.layers, copied.layers, row.sums):
        score = full.aux("attention_sum") + sums  # (1, H_kv, 15): the scores the eviction sees
        order = full.positions.argsort(-1)
        keep = keep_top(score.gather(2, order), 12, 0, 2)  # (1, H_kv, 12) in position order
        want = full.positions.gather(2, order).gather(2, keep)
        assert torch.equal(lc.positions.sort(-1).values, want)


@pytest.mark.parametrize("options", [{}, {"variant": "paper"}, {"protected_layers": ""}], ids=str)
def test_d2o_first_compression_by_chunks_equals_one_call(model, options, monkeypatch):
    """D2O's first compression (the whole prompt's evicted keys against the kept ones, Eq. 9) takes its
    similarities a chunk of evicted keys at a time when they are many (`EMAMerge.at_once`): forced to
    one evicted key per chunk here, every run (kept entries, keys, values, merges, thresholds, traces,
    logits) equals the one-call specification."""
    from kvmini.methods import ema_merging
    whole = run(model, "d2o", 12, options, False)
    monkeypatch.setattr(ema_merging.EMAMerge, "at_once", 1)  # a row per chunk
    chunked = run(model, "d2o", 12, options, False)
    same(chunked, whole)
    assert sum(whole[1].merged) > 0  # the merges happened


@pytest.mark.slow
@pytest.mark.parametrize("method", ["weightedkv"])
def test_run_py_layer_by_layer_runs_the_specification_loop(method, default_model_dir, tmp_path, monkeypatch, capsys):
    """run.py --layer-by-layer: no decode step goes through at_once's every-layer step, and the answer and
    what the cache kept are the default run's (the same evictions, as the tests above prove)."""
    import run

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Name the planets of the solar system in order, with one fact about each.")
    together = []
    real = at_once.AtOnce.compress_together
    monkeypatch.setattr(at_once.AtOnce, "compress_together",
                        lambda self, cache, deferred: (together.append(1), real(self, cache, deferred)))
    outs = {}
    for flags in ([], ["--layer-by-layer"]):
        together.clear()
        assert run.main(["--method", method, "--prompt", str(prompt), "--max-new-tokens", "8", "--quiet", *flags]) == 0
        out = capsys.readouterr().out
        outs[bool(flags)] = [line.split("; ")[0] if line.startswith("bytes") else line  # (at_once's Stack
                             for line in out.splitlines() if not line.startswith(("prefill", "decode"))]  # reallocates)
        assert bool(together) != bool(flags)  # at_once's step ran by default, never with the flag
    assert outs[True] == outs[False]
