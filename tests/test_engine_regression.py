"""The compression engine's recorded behaviour, so a refactor can prove it changed nothing.

For every registered method (every default variant, and the option specs the fidelity tool and
the suite's ablations use) this records, over a prefill and several decode steps: the logits of
every call, the kept positions of every layer and head, the keys and values left in the cache
(where merges show), the per-layer budgets and eviction counts. Two scenarios run on a tiny random
model (batch 1 in one prefill call; batch 2 in prefill chunks, where per-sequence methods pad), one
on the default model (a 300-token prompt, budget 64).

Every scenario runs in float64, so that the recording holds on any CPU. In float32, another CPU's
kernels (or another thread count) move a sum by ~1e-7 relative; where two candidates score within
that of each other (D2O's nearest kept key, H2O's lowest accumulated attention), the winner flips,
and a whole key vector changes. In float64 the same kernels differ by ~1e-15, and every statistic,
score and merge is computed in float64 too (`kvmini.cache.wide`), so a decision flips only for
candidates within ~1e-13 of a tie: then the positions compare exactly, and the floats element by
element within 1e-8 of the tensor's largest magnitude (no sums, which cancel). One exact tie does
occur: KNorm's budget on the default model falls among the layer-0 keys of a repeated token, whose
norms are equal (RoPE rotates one vector) up to the last bit of the rotation, so another CPU may keep
another of them; those trades are checked as trades of equal norms (`swaps_among_ties`). The tests at the
end inject a one-token score change and a 1e-5 change of one merge weight and show both fail.

What is stored: on the tiny model every tensor whole; on the default model the kept positions after
the prompt and after the last call, each call's 16 largest logits (ids and values), and of every
kept key and value its projection on a fixed random direction. Regenerate only on purpose, one method's
entries (a new method's, or one whose behaviour changed on purpose):
`PYTHONPATH=. python tests/test_engine_regression.py --record NAME [NAME ...]` (without a name: every
method). Every other entry keeps its bytes, and so does an entry whose run still matches it, so only new
and changed entries change (the results files record a digest of their methods' entries:
kvmini/eval/provenance.py).

Order within a buffer means nothing to attention (positions are explicit; per-step eviction moves
the newest entry into the evicted slot), so every head's entries are put in position order first.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from kvmini.cache import PAD
from kvmini.methods.registry import chooses_budget, make_policy, parse_spec, specs
from reference import random_model
from tiny import fitted, least_budget

DATA = Path(__file__).resolve().parent / "data" / "engine_regression"
TOL = 1e-8  # of a tensor's largest magnitude: float64 noise across CPUs is ~1e-13, a real change far more
# The tiny scenarios' options of the methods recorded before they were derived from each method's parts
# (tests/tiny.py, `fitted`: it would give SnapKV window=3 but not kernel=3, and RoCo recent=3): kept, so that
# those entries and their labels stay as recorded. A method added since is recorded with `fitted` options.
SMALL = {"snapkv": {"window": 3, "kernel": 3}, "pyramidkv": {"window": 3, "kernel": 3},
         "dynamickv": {"window": 2, "kernel": 3, "interval": 1}, "scissorhands": {"history": 4, "recent": 2},
         "snapkv_d2o": {"window": 3, "kernel": 3}}
AS_DECLARED = ("streaming_llm", "h2o", "tova", "weightedkv", "dbudgetkv", "d2o", "knorm", "vatp", "cam", "roco")
ZSCORE = {"variant": "paper", "allocation": "zscore"}  # kvmini's former reading of D2O (z-scored variances)
SEQUENTIAL = {"chunk_merge": "sequential"}  # WeightedKV: Alg. 1's order within a chunk


def label(name: str, budget, options: dict) -> str:
    """'d2o@12[variant=paper]': the method, its budget and the options given."""
    given = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{name}@{budget}" + (f"[{given}]" if given else "")


def registered(budget: int, options_of, L: int, n: int) -> list[tuple]:
    """(method, budget, options) for every registered method and variant (registry.specs), so a method
    added to METHODS is recorded and checked without touching a list (`--record NAME` adds its entries):
    options_of(name) its options, the budget raised to the least its parts can keep (L layers, n tokens)."""
    out = []
    for spec in specs():
        name, given = parse_spec(spec)
        options = options_of(name)
        least = None if chooses_budget(name) else least_budget(name, options, L, n)
        out.append((name, None if chooses_budget(name) else max(budget, least or budget), {**options, **given}))
    return out


def with_registered(listed: list[tuple], budget: int, options_of, L: int, n: int) -> list[tuple]:
    labels = {label(*v) for v in listed}
    return listed + [v for v in registered(budget, options_of, L, n) if label(*v) not in labels]


def tiny_options(name: str) -> dict:
    return SMALL.get(name, {}) if name in SMALL or name in AS_DECLARED else fitted(name)


# (method, budget, options): every method and variant, and the option specs the fidelity tool reaches
TINY_VARIANTS = [
    ("full", None, {}),
    ("streaming_llm", 12, {}),
    ("h2o", 12, {}),
    ("h2o", 12, {"recent": 3, "reduce": "max"}),
    ("tova", 12, {}),
    ("tova", 12, {"sinks": 2, "recent": 2}),
    ("snapkv", 12, SMALL["snapkv"]),
    ("snapkv", 12, {**SMALL["snapkv"], "pooling": "max", "reduce": "sum"}),
    ("pyramidkv", 12, SMALL["pyramidkv"]),
    ("knorm", 12, {}),
    ("vatp", 12, {}),
    ("vatp", 12, {"value_norm": "l2", "recent": 3}),
    ("weightedkv", 12, {}),
    ("weightedkv", 12, SEQUENTIAL),
    ("weightedkv", 12, {**SEQUENTIAL, "sinks": 1, "recent": 3}),
    ("d2o", 12, {"protected_layers": ""}),  # the official variant; the tiny model's 3 layers are all protected by default
    ("d2o", 12, {"variant": "paper"}),
    ("d2o", 12, ZSCORE),
    ("d2o", 12, {**ZSCORE, "allocation": "uniform"}),
    ("d2o", 12, {**ZSCORE, "allocation": "reciprocal", "nm": "1:1", "beta": 0.3}),
    ("d2o", 0.3, {**ZSCORE, "softmax_temperature": 0.5, "sinks": 2}),
    ("snapkv_d2o", 12, SMALL["snapkv"]),
    ("dynamickv", 12, SMALL["dynamickv"]),
    ("dynamickv", 12, {**SMALL["dynamickv"], "variant": "official"}),
    ("dynamickv", 12, {**SMALL["dynamickv"], "r_max": 2.0, "interval": 2}),
    ("dbudgetkv", None, {}),
    ("dbudgetkv", None, {"variant": "official"}),
    ("dbudgetkv", None, {"threshold": 0.1, "protected_layers": "0"}),
    ("dbudgetkv", None, {"ranking": "cumulative", "threshold": 0.2, "k": 3, "protected_layers": ""}),
]
TINY_VARIANTS = with_registered(TINY_VARIANTS, 12, tiny_options, 3, 40)
DEFAULT_VARIANTS = [("full", None, {})] + [
    (m, 64, {}) for m in ("streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "knorm", "vatp", "weightedkv", "d2o",
                          "snapkv_d2o", "dynamickv")
] + [("weightedkv", 64, SEQUENTIAL), ("d2o", 64, {"variant": "paper"}), ("d2o", 64, ZSCORE),
     ("d2o", 64, {**ZSCORE, "allocation": "uniform"}), ("dynamickv", 64, {"variant": "official"}),
     ("dbudgetkv", None, {}), ("dbudgetkv", None, {"variant": "official"}), ("dbudgetkv", None, {"ranking": "cumulative"})]
DEFAULT_VARIANTS = with_registered(DEFAULT_VARIANTS, 64, lambda name: {}, 30, 300)


def tiny_scenarios():
    gen = torch.Generator().manual_seed(0)
    one = [torch.randint(0, 61, (1, 40), generator=gen)] + [torch.randint(0, 61, (1, 1), generator=gen) for _ in range(6)]
    two = [torch.randint(0, 61, (2, t), generator=gen) for t in (16, 16, 8)]
    two += [torch.randint(0, 61, (2, 1), generator=gen) for _ in range(4)]
    return {"b1": (one, 40), "b2_chunked": (two, 40)}


def default_scenario(tokenizer):
    import pydoc_data.topics

    ids = tokenizer.encode(pydoc_data.topics.topics["assignment"])[: 300 + 5]
    return [torch.tensor([ids[:300]])] + [torch.tensor([[i]]) for i in ids[300:]], 300


def tiny_model():
    return random_model().to(torch.float64)


@torch.no_grad()
def run(model, calls, name, budget, options, prompt_len):
    """-> tensors (name -> tensor) and facts (budgets, evicted) of one method on one scenario."""
    policy = make_policy(name, budget, **options)
    cache = model.new_cache(calls[0].shape[0], 4)
    if policy is not None:
        policy.start(prompt_len, prompt_len + len(calls) - 1, model)
    out = {}
    for c, ids in enumerate(calls):
        out[f"logits.{c}"] = model(ids, cache, policy)[:, -1].contiguous()
        for i, lc in enumerate(cache.layers):
            out[f"positions.{c}.{i}"] = lc.positions.contiguous()
    for i, lc in enumerate(cache.layers):  # a pad's key and value are nothing's: recorded as 0
        pad = (lc.positions == PAD)[..., None]
        out[f"keys.{i}"], out[f"values.{i}"] = lc.keys.masked_fill(pad, 0), lc.values.masked_fill(pad, 0)
    by_position(out, len(cache.layers))
    facts = {} if policy is None else {"budgets": list(policy.budgets), "evicted": list(policy.evicted)}
    return out, facts


def by_position(out: dict, L: int) -> None:
    """Put every head's entries in position order."""
    for i in range(L):
        last = max(int(k.split(".")[1]) for k in out if k.startswith("positions.") and k.endswith(f".{i}"))
        order = out[f"positions.{last}.{i}"].argsort(dim=-1, stable=True)  # (B, H_kv, S)
        for name in ("keys", "values"):
            t = out[f"{name}.{i}"]
            out[f"{name}.{i}"] = t.gather(2, order[..., None].expand_as(t)).contiguous()
    for k in out:
        if k.startswith("positions."):
            out[k] = out[k].sort(dim=-1, stable=True).values.contiguous()


def condensed(out: dict, calls: int, top: torch.Tensor | None = None) -> dict:
    """What the default model's recording keeps of a run: kept positions after the prompt and after
    the last call; each call's logits at the ids `top` (c -> ids; None: the 16 largest); every kept
    key's and value's projection on a fixed random direction (B, H_kv, S)."""
    direction = torch.randn(out["keys.0"].shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kept = {k: v for k, v in out.items() if k.startswith(("positions.0.", f"positions.{calls - 1}."))}
    logits = {}
    for c in range(calls):
        ids = out[f"logits.{c}"].topk(16, dim=-1).indices if top is None else top[c]  # (B, 16)
        logits[f"top_ids.{c}"], logits[f"top_logits.{c}"] = ids, out[f"logits.{c}"].gather(-1, ids)
    projected = {k: (v @ direction).contiguous() for k, v in out.items() if k.startswith(("keys.", "values."))}
    return {**kept, **logits, **projected}


def differences(out: dict, expected: dict) -> list[str]:
    """What differs: integer tensors must be equal, float tensors equal within TOL of the expected
    tensor's largest magnitude, element by element."""
    if sorted(out) != sorted(expected):
        return [f"recorded names differ: {sorted(set(out) ^ set(expected))[:5]}"]
    found = []
    for key, value in out.items():
        want = expected[key]
        if value.shape != want.shape:
            found.append(f"{key}: shape {tuple(value.shape)} vs {tuple(want.shape)}")
        elif not value.is_floating_point():
            if not torch.equal(value.to(want.dtype), want):  # stored narrower; a pad (PAD) reads as -1 in both
                found.append(f"{key}: differs at {int((value != want).sum())} of {value.numel()} entries")
        else:
            error = (value - want).abs().max().item() if value.numel() else 0.0
            scale = want.abs().max().item() if want.numel() else 0.0
            if error > TOL * max(scale, 1e-30):
                found.append(f"{key}: differs by {error:.3g} (largest magnitude {scale:.3g})")
    return found


def record(names=None, default_model=None, default_tokenizer=None, data: Path = DATA) -> None:
    """(Re-)record the entries of the methods `names` (None: every method) and keep every other entry of
    the recording at `data` as its bytes were. Each run that still matches its recorded entry keeps the
    entry's bytes too, so only new and changed entries change. The default model's entries are recorded
    when it is given; without it they are kept as they were."""
    from safetensors.torch import load_file, save_file

    exists = data.with_suffix(".safetensors").exists()
    old = load_file(str(data.with_suffix(".safetensors"))) if exists else {}
    old_facts = json.loads(data.with_suffix(".json").read_text()) if exists else {"tiny": {}, "default": {}}

    def unchanged(out: dict, f: dict, before: dict, facts_before) -> bool:
        """Does this run still match its recorded entry (then the entry keeps its bytes)?"""
        return bool(before) and f == facts_before and differences(out, before) == []

    def named(entry: str) -> bool:  # "h2o@12[recent=3]": an entry of a method recorded now
        return names is None or entry.split("@")[0] in names

    tensors, facts = {}, {"tiny": {}, "default": {}}
    for part, key, f in [(p, k, f) for p in ("tiny", "default") for k, f in old_facts[p].items()]:
        entry = key.split("/")[1] if part == "tiny" else key  # tiny keys are "scenario/entry"
        if not named(entry) or (part == "default" and default_model is None):  # not recorded now: kept as it is
            prefix = f"{key}/" if part == "tiny" else f"default/{key}/"
            tensors.update({k: v for k, v in old.items() if k.startswith(prefix)})
            facts[part][key] = f
    model = tiny_model()
    for scenario, (calls, n) in tiny_scenarios().items():
        for name, budget, options in [v for v in TINY_VARIANTS if named(v[0])]:
            out, f = run(model, calls, name, budget, options, n)
            key = f"{scenario}/{label(name, budget, options)}"
            before = expected_of(old, f"{key}/")
            kept = before if unchanged(out, f, before, old_facts["tiny"].get(key)) else out
            tensors.update({f"{key}/{k}": v for k, v in kept.items()})
            facts["tiny"][key] = f
    if default_model is not None:
        calls, n = default_scenario(default_tokenizer)
        for name, budget, options in [v for v in DEFAULT_VARIANTS if named(v[0])]:
            out, f = run(default_model, calls, name, budget, options, n)
            key = f"default/{label(name, budget, options)}"
            before = expected_of(old, f"{key}/")
            top = {c: before[f"top_ids.{c}"].long() for c in range(len(calls))} if before else None
            recorded_facts = old_facts["default"].get(label(name, budget, options))
            same = unchanged(condensed(out, len(calls), top), f, before, recorded_facts)
            kept = before if same else condensed(out, len(calls))
            tensors.update({f"{key}/{k}": v for k, v in kept.items()})
            facts["default"][label(name, budget, options)] = f
    data.parent.mkdir(exist_ok=True)
    for key, t in tensors.items():  # positions fit in int16 (PAD becomes -1), ids in int32
        if not t.is_floating_point() and t.dtype in (torch.int64, torch.long):
            tensors[key] = t.to(torch.int16 if key.split("/")[-1].startswith("positions") else torch.int32)
    save_file(tensors, str(data.with_suffix(".safetensors")))
    data.with_suffix(".json").write_text(json.dumps(facts, indent=1, sort_keys=True))


def load_recording() -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(DATA.with_suffix(".safetensors"))), json.loads(DATA.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def recorded():
    return load_recording()


def expected_of(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def float64_model(default_model):
    import copy

    return copy.deepcopy(default_model).to(torch.float64)


@pytest.mark.parametrize("scenario", ["b1", "b2_chunked"])
@pytest.mark.parametrize("variant", TINY_VARIANTS, ids=[label(*v) for v in TINY_VARIANTS])
def test_tiny_model_behaviour_is_unchanged(recorded, scenario, variant):
    tensors, facts = recorded
    calls, n = tiny_scenarios()[scenario]
    assert f"{scenario}/{label(*variant)}" in facts["tiny"], f"not recorded: run {RECORD.format(variant[0])}"
    out, f = run(tiny_model(), calls, *variant, n)
    assert differences(out, expected_of(tensors, f"{scenario}/{label(*variant)}/")) == []
    assert f == facts["tiny"][f"{scenario}/{label(*variant)}"]


def swaps_among_ties(now: dict, expected: dict, norms: torch.Tensor, rel: float = 1e-12) -> tuple[list[str], bool]:
    """KNorm's kept positions (positions.c.layer -> (1, H_kv, S)) against the recorded ones, where two
    keys of one norm may have traded places. A repeated token's layer-0 keys are one vector rotated
    by RoPE, so their norms tie exactly and the last bit of the rotation's arithmetic, which differs
    between CPUs, decides which of them a budget keeps. -> (what differs other than such trades, any
    trade?): each head must keep as many entries, and those it keeps instead of the recorded ones must
    all have one norm (within `rel`) as prompt keys (`norms`: (L, H_kv, n))."""
    found, traded = [], False
    for key, kept in now.items():
        layer = int(key.split(".")[2])
        for h in range(kept.shape[1]):
            mine, theirs = set(kept[0, h].tolist()), set(expected[key][0, h].tolist())
            if mine == theirs:
                continue
            traded = True
            tied = [norms[layer, h, p].item() for p in mine ^ theirs if 0 <= p < norms.shape[-1]]
            if len(mine) != len(theirs) or len(tied) < len(mine ^ theirs) or max(tied) - min(tied) > rel * max(tied):
                found.append(f"{key}: head {h} keeps {sorted(mine - theirs)} instead of {sorted(theirs - mine)}, "
                             "not keys of one norm")
    return found, traded


@pytest.mark.slow
@pytest.mark.parametrize("variant", DEFAULT_VARIANTS, ids=[label(*v) for v in DEFAULT_VARIANTS])
def test_default_model_behaviour_is_unchanged(recorded, float64_model, default_tokenizer, variant):
    """Exact, as the tiny scenarios, with one exception found on a CPU other than the recording's:
    KNorm at the default model's budget falls inside a group of exactly tied key norms (a repeated
    token in layer 0), which the last bit of RoPE's float64 arithmetic orders. Where its kept positions
    differ from the recording only by trades inside such a tie (`swaps_among_ties`), the positions are
    checked that way and the floats, which then follow from other (equally ranked) tokens, are not;
    where no trade happened, everything is compared exactly. Its budgets and eviction counts always are."""
    tensors, facts = recorded
    assert label(*variant) in facts["default"], f"not recorded: run {RECORD.format(variant[0])}"
    calls, n = default_scenario(default_tokenizer)
    out, f = run(float64_model, calls, *variant, n)
    expected = expected_of(tensors, f"default/{label(*variant)}/")
    top = {c: expected[f"top_ids.{c}"].long() for c in range(len(calls))}
    got = condensed(out, len(calls), top)
    traded = False
    if variant[0] == "knorm":
        prompt, _ = run(float64_model, calls[:1], "full", None, {}, n)
        norms = torch.stack([prompt[f"keys.{i}"][0].norm(dim=-1) for i in range(float64_model.config.num_layers)])
        found, traded = swaps_among_ties({k: v for k, v in got.items() if k.startswith("positions.")}, expected, norms)
        assert found == []
    if not traded:
        assert differences(got, expected) == []
    assert f == facts["default"][label(*variant)]


# The comparison must still catch a real change: each test below injects one and expects a difference.

def test_only_keys_of_one_norm_may_trade_places():
    """Hand-worked: positions 1 and 2 tie (a one-ulp difference), 3 does not."""
    norms = torch.tensor([[[1.0, 2.0, 2.0 * (1 + 2**-52), 3.0]]], dtype=torch.float64)  # (L, H_kv, n)
    kept = lambda *p: {"positions.0.0": torch.tensor([[list(p)]])}  # noqa: E731  (1, H_kv, S)
    assert swaps_among_ties(kept(0, 1), kept(0, 1), norms) == ([], False)
    assert swaps_among_ties(kept(0, 1), kept(0, 2), norms) == ([], True)
    assert swaps_among_ties(kept(0, 3), kept(0, 2), norms)[0] == [
        "positions.0.0: head 0 keeps [3] instead of [2], not keys of one norm"]
    assert swaps_among_ties(kept(0, 1, 3), kept(0, 2), norms)[0] != []  # a count that differs


def test_a_one_token_score_change_fails(recorded, monkeypatch):
    from kvmini.methods import h2o

    tensors, _ = recorded
    calls, n = tiny_scenarios()["b1"]
    variant = ("h2o", 12, {})
    expected = expected_of(tensors, f"b1/{label(*variant)}/")
    gone = sorted(set(range(n)) - set(expected["positions.0.1"][0, 0].tolist()))[0]  # evicted by the prompt's call
    original = h2o.shrink

    def bumped(lc, score, *args, **kwargs):  # token `gone` scores one more (one query's worth of attention)
        return original(lc, score + (lc.positions == gone), *args, **kwargs)

    monkeypatch.setattr(h2o, "shrink", bumped)
    out, _ = run(tiny_model(), calls, *variant, n)
    assert any(d.startswith("positions.0.1:") for d in differences(out, expected))


def test_a_merge_weight_change_of_1e_5_fails(recorded, monkeypatch):
    from kvmini.methods import ema_merging

    tensors, _ = recorded
    calls, n = tiny_scenarios()["b1"]
    variant = ("d2o", 12, {"variant": "paper"})  # the paper's convex merge (Eq. 11-12)
    original = ema_merging.convex_merge
    monkeypatch.setattr(ema_merging, "convex_merge", lambda x_keep, x_evict, j_star, best, merge: original(
        x_keep, x_evict, j_star, best + 1e-5 * merge, merge))  # e^{u+1e-5}: each merged token's weight up 1e-5
    out, f = run(tiny_model(), calls, *variant, n)
    found = differences(out, expected_of(tensors, f"b1/{label(*variant)}/"))
    assert found and all(d.startswith(("keys.", "values.", "logits.")) for d in found), found  # same positions


def test_a_method_added_to_methods_is_recorded_with_options_fitted_to_the_tiny_scenarios(monkeypatch):
    """A method registered since the options were derived (here SnapKV again under another name, its window
    32): the tiny scenarios cut its window to 3 (tests/tiny.py), the default model's keep it as declared."""
    from kvmini.methods import registry, snapkv

    monkeypatch.setitem(registry.METHODS, "snapkv_again", snapkv)
    again = lambda variants: [v for v in variants if v[0] == "snapkv_again"]  # noqa: E731
    assert again(registered(12, tiny_options, 3, 40)) == [("snapkv_again", 12, {"window": 3})]
    assert again(registered(12, lambda name: {}, 3, 40)) == [("snapkv_again", 32, {})]  # its window, declared


def test_recording_one_method_leaves_every_other_entry_as_it_was(tmp_path):
    """On a copy of the recording, h2o's entries and tova's are spoiled (a logit, a count); `record(["h2o"])`
    (the tiny model only) records h2o's afresh and leaves every other entry, tova's spoiled ones included,
    byte for byte as it was."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "engine_regression"
    tensors, facts = load_recording()
    spoil = lambda k: k.split("/")[1].startswith(("h2o@", "tova@")) and k.endswith("/logits.0")  # noqa: E731
    spoiled = {k: v + 1 if spoil(k) else v for k, v in tensors.items()}
    facts["tiny"]["b1/h2o@12"]["evicted"][0] += 1
    facts["tiny"]["b1/tova@12"]["evicted"][0] += 1
    save_file(spoiled, str(copy.with_suffix(".safetensors")))
    copy.with_suffix(".json").write_text(json.dumps(facts, indent=1, sort_keys=True))
    record(["h2o"], data=copy)
    got, got_facts = load_file(str(copy.with_suffix(".safetensors"))), json.loads(copy.with_suffix(".json").read_text())
    assert got.keys() == tensors.keys()
    h2o = {k for k in got if k.split("/")[1].startswith("h2o@")}
    assert h2o and all(torch.equal(got[k], spoiled[k]) and got[k].dtype == spoiled[k].dtype for k in got.keys() - h2o)
    for entry in {k.rsplit("/", 1)[0] + "/" for k in h2o}:  # recorded afresh: today's run, equal within TOL
        assert differences(expected_of(got, entry), expected_of(tensors, entry)) == []
    assert got_facts["tiny"]["b1/tova@12"] == facts["tiny"]["b1/tova@12"]  # still spoiled
    facts["tiny"]["b1/h2o@12"]["evicted"][0] -= 1
    assert got_facts == facts  # h2o's counts recorded afresh, every other entry's kept


RECORD = "PYTHONPATH=. python tests/test_engine_regression.py --record {}"  # the method's name

if __name__ == "__main__" and sys.argv[1:2] == ["--record"]:  # --record [NAME ...]: those methods (none: all)
    from kvmini.loading import load_model
    from kvmini.methods.registry import METHODS
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    names = sys.argv[2:] or None
    if unknown := [name for name in names or () if name not in METHODS]:
        sys.exit(f"unknown method {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    model = tokenizer = None
    if any(names is None or name in names for name, _, _ in DEFAULT_VARIANTS):
        folder = ensure_default_model()
        model, tokenizer = load_model(folder, "cpu", "float32").to(torch.float64), load_tokenizer(folder)
    record(names, model, tokenizer)
    print(f"recorded {', '.join(names) if names else 'every method'} in {DATA}.safetensors/.json")
