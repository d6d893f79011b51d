"""The compression engine's recorded behaviour, so a refactor can prove it changed nothing.

For every registered method (and the option specs the fidelity tool and the README's ablations
use) this records, over a prefill and several decode steps: the logits of every call, the kept
positions of every layer and head after every call, the final keys and values (where merges
show), the per-layer budgets and eviction counts. Two scenarios run on a tiny random model
(batch 1 in one prefill call; batch 2 in prefill chunks, where per-sequence methods pad), one on
the default model (a 300-token prompt, budget 64), where only checksums of K/V and logits are kept.

The expected values are the engine's own output from before the refactor (commit "Tests: record
the engine's behaviour ..."), stored in tests/data/engine_regression.safetensors (+ .json).
Regenerate only on purpose: `PYTHONPATH=. python tests/test_engine_regression.py --record`.

What is compared, by position: the order of entries in a buffer means nothing to attention
(positions are explicit), and per-step eviction moves the newest entry into the evicted one's
slot, so every head's entries are put in position order before comparing. The kept positions,
budgets and eviction counts must be exact; logits, keys and values agree to 1e-5, not bit for
bit, because attention sums over the entries in buffer order and a decode step takes its
statistics from the one-query kernel (both changed by issue 14, "compression that pays").
The canary (the uncompressed tiny model's logits, bit for bit?) says in a failure message
whether this CPU's floating-point kernels match the recording machine's.
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from kvmini.methods.registry import make_policy
from reference import random_model

DATA = Path(__file__).resolve().parent / "data" / "engine_regression"
SMALL = {"snapkv": {"window": 3, "kernel": 3}, "pyramidkv": {"window": 3, "kernel": 3},
         "dynamickv": {"window": 2, "kernel": 3, "interval": 1}}
# D2O as recorded: kvmini's reading (z-scored variances) of the paper; now `variant=paper, allocation=zscore`
KVMINI_D2O = {"variant": "paper", "allocation": "zscore"}
# WeightedKV as recorded: Alg. 1's order within a chunk; now `chunk_merge=sequential` (the default merges runs at once)
KVMINI_WKV = {"chunk_merge": "sequential"}
# (label, method, budget, options): every method, and the variants the fidelity tool's specs reach
TINY_VARIANTS = [
    ("full", "full", None, {}),
    ("streaming_llm", "streaming_llm", 12, {}),
    ("h2o", "h2o", 12, {}),
    ("h2o[window=3,reduce=max]", "h2o", 12, {"recent": 3, "reduce": "max"}),  # --window is --recent since the redesign
    ("tova", "tova", 12, {}),
    ("tova[sinks=2,window=2]", "tova", 12, {"sinks": 2, "recent": 2}),
    ("snapkv", "snapkv", 12, SMALL["snapkv"]),
    ("snapkv[pooling=max,reduce=sum]", "snapkv", 12, {**SMALL["snapkv"], "pooling": "max", "reduce": "sum"}),
    ("pyramidkv", "pyramidkv", 12, SMALL["pyramidkv"]),
    ("weightedkv", "weightedkv", 12, KVMINI_WKV),
    ("weightedkv[sinks=1,window=3]", "weightedkv", 12, {**KVMINI_WKV, "sinks": 1, "recent": 3}),
    ("d2o", "d2o", 12, KVMINI_D2O),  # the labels name the options as they were when recorded
    ("d2o[allocation=uniform]", "d2o", 12, {**KVMINI_D2O, "allocation": "uniform"}),
    ("d2o[allocation=reciprocal,nm=1:1,beta=0.3]", "d2o", 12,
     {**KVMINI_D2O, "allocation": "reciprocal", "nm": "1:1", "beta": 0.3}),
    ("d2o[softmax_temperature=0.5,sinks=2]", "d2o", 0.3, {**KVMINI_D2O, "softmax_temperature": 0.5, "sinks": 2}),
    ("dynamickv", "dynamickv", 12, SMALL["dynamickv"]),
    ("dynamickv[r_max=2,interval=2]", "dynamickv", 12, {**SMALL["dynamickv"], "r_max": 2.0, "interval": 2}),
    ("dbudgetkv[threshold=0.1,protected_layers=0]", "dbudgetkv", None, {"threshold": 0.1, "protected_layers": "0"}),
    ("dbudgetkv[ranking=attention,threshold=0.2,k=3]", "dbudgetkv", None,
     {"ranking": "cumulative", "threshold": 0.2, "k": 3, "protected_layers": ""}),
]
DEFAULT_VARIANTS = [("full", "full", None, {})] + [
    (m, m, None if m == "dbudgetkv" else 64, {"d2o": KVMINI_D2O, "weightedkv": KVMINI_WKV}.get(m, {})) for m in
    ("streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "weightedkv", "d2o", "dynamickv", "dbudgetkv")
] + [("d2o[allocation=uniform]", "d2o", 64, {**KVMINI_D2O, "allocation": "uniform"}),
     ("dbudgetkv[ranking=attention]", "dbudgetkv", None, {"ranking": "cumulative"})]


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


@torch.no_grad()
def run(model, calls, name, budget, options, prompt_len):
    """-> tensors (name -> tensor) and facts (budgets, evicted) of one method on one scenario."""
    policy = make_policy(name, budget, **options)
    cache = model.new_cache(calls[0].shape[0], 4)
    if policy is not None:
        policy.start(prompt_len, prompt_len + len(calls) - 1)
    out = {}
    for c, ids in enumerate(calls):
        out[f"logits.{c}"] = model(ids, cache, policy)[:, -1].contiguous()
        for i, lc in enumerate(cache.layers):
            out[f"positions.{c}.{i}"] = lc.positions.contiguous()
    for i, lc in enumerate(cache.layers):
        out[f"keys.{i}"], out[f"values.{i}"] = lc.keys.contiguous(), lc.values.contiguous()
    by_position(out, len(cache.layers))
    facts = {} if policy is None else {"budgets": list(policy.budgets), "evicted": list(policy.evicted)}
    return out, facts


def by_position(out: dict, L: int) -> None:
    """Put every head's entries in position order (the recording's buffers were in that order)."""
    for i in range(L):
        last = max(int(k.split(".")[1]) for k in out if k.startswith("positions.") and k.endswith(f".{i}"))
        order = out[f"positions.{last}.{i}"].argsort(dim=-1, stable=True)  # (B, H_kv, S)
        for name in ("keys", "values"):
            t = out[f"{name}.{i}"]
            out[f"{name}.{i}"] = t.gather(2, order[..., None].expand_as(t)).contiguous()
    for k in out:
        if k.startswith("positions."):
            out[k] = out[k].sort(dim=-1, stable=True).values.contiguous()


def digest(t: torch.Tensor) -> dict:
    """A float tensor's exact fingerprint (sha256 of its bytes) and sums to compare when bits cannot match."""
    t64 = t.double()
    return {"sha256": hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest(), "shape": list(t.shape),
            "sum": t64.sum().item(), "sumsq": (t64 ** 2).sum().item(), "argmax": t.flatten().argmax().item()}


def record_all(default_model=None, default_tokenizer=None):
    from safetensors.torch import save_file

    tensors, facts = {}, {"tiny": {}, "default": {}}
    model = random_model()
    for scenario, (calls, n) in tiny_scenarios().items():
        for label, name, budget, options in TINY_VARIANTS:
            out, f = run(model, calls, name, budget, options, n)
            tensors.update({f"{scenario}/{label}/{k}": v for k, v in out.items()})
            facts["tiny"][f"{scenario}/{label}"] = f
    if default_model is not None:
        calls, n = default_scenario(default_tokenizer)
        for label, name, budget, options in DEFAULT_VARIANTS:
            out, f = run(default_model, calls, name, budget, options, n)
            last = f"positions.{len(calls) - 1}."
            tensors.update({f"default/{label}/{k}": v.to(torch.int16) for k, v in out.items() if k.startswith(last)})
            f["digests"] = {k: digest(v) for k, v in out.items() if not k.startswith("positions.")}
            facts["default"][label] = f
    DATA.parent.mkdir(exist_ok=True)
    save_file(tensors, str(DATA.with_suffix(".safetensors")))
    DATA.with_suffix(".json").write_text(json.dumps(facts, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def recorded():
    from safetensors.torch import load_file

    return load_file(str(DATA.with_suffix(".safetensors"))), json.loads(DATA.with_suffix(".json").read_text())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def exact_tiny(recorded):
    """The canary: can this CPU reproduce the recorded bits of the uncompressed tiny model?"""
    tensors, _ = recorded
    calls, n = tiny_scenarios()["b1"]
    out, _ = run(random_model(), calls, "full", None, {}, n)
    return all(torch.equal(out[k], tensors[f"b1/full/{k}"]) for k in out if k.startswith("logits"))


@pytest.mark.parametrize("scenario", ["b1", "b2_chunked"])
@pytest.mark.parametrize("variant", TINY_VARIANTS, ids=[v[0] for v in TINY_VARIANTS])
def test_tiny_model_behaviour_is_unchanged(recorded, exact_tiny, scenario, variant):
    tensors, facts = recorded
    label, name, budget, options = variant
    calls, n = tiny_scenarios()[scenario]
    out, f = run(random_model(), calls, name, budget, options, n)
    prefix = f"{scenario}/{label}/"
    expected = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    assert sorted(out) == sorted(expected)
    for key, value in out.items():
        if key.startswith("positions"):
            assert torch.equal(value, expected[key]), f"{key}: kept positions differ"
        else:
            assert same(value, expected[key]), f"{key} differs beyond 1e-5" + ("" if exact_tiny else
                                                                               " (this CPU's kernels differ)")
    assert f == facts["tiny"][f"{scenario}/{label}"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", DEFAULT_VARIANTS, ids=[v[0] for v in DEFAULT_VARIANTS])
def test_default_model_behaviour_is_unchanged(recorded, default_model, default_tokenizer, variant):
    tensors, facts = recorded
    label, name, budget, options = variant
    calls, n = default_scenario(default_tokenizer)
    expected = facts["default"][label]
    out, f = run(default_model, calls, name, budget, options, n)
    last = f"positions.{len(calls) - 1}."
    for key, value in out.items():
        if key.startswith("positions."):
            if key.startswith(last):
                assert torch.equal(value, tensors[f"default/{label}/{key}"].long()), f"{key}: kept positions differ"
            continue
        d, e = digest(value), expected["digests"][key]
        assert d["shape"] == e["shape"] and d["argmax"] == e["argmax"], key
        assert d["sum"] == pytest.approx(e["sum"], rel=1e-4, abs=1e-3), f"{key}: sum {d['sum']} vs {e['sum']}"
        assert d["sumsq"] == pytest.approx(e["sumsq"], rel=1e-4, abs=1e-3), key
    assert {k: v for k, v in f.items()} == {k: expected[k] for k in f}


if __name__ == "__main__" and "--record" in sys.argv:  # PYTHONPATH=. python tests/test_engine_regression.py --record
    from kvmini.loading import load_model
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    folder = ensure_default_model()
    record_all(load_model(folder, "cpu", "float32"), load_tokenizer(folder))
    print(f"recorded {DATA}.safetensors/.json")
