"""DynamicKV's released code (DreamMr/DynamicKV, kv_compression/token_drop/) run under kvmini's fidelity protocol
on CPU, for kvmini.eval.authors. Needs transformers 4.44 (PACKAGES) in --deps; nothing of theirs is edited:
each change below is a run-time substitution.
"""
import contextlib
import io
import sys
import types

REPO, COMMIT = "DreamMr/DynamicKV", "8ab3c08d4f0a93ef3322e267e1faa03c4e12fd24"
FILES = ("kv_compression/token_drop/llama_model_impl", "kv_compression/token_drop/methods")  # what the cross-check reads of the checkout (checked before any work)
PACKAGES = {"transformers": "4.44.2", "tokenizers": "0.19.1", "huggingface-hub": "0.24.6"}
SPEC, BUDGET = "dynamickv[variant=official]", 0.2
ADAPTATIONS = [
    "monkeypatch.py:17-18 imports an InternLM remote module: monkeypatch.py is not imported; its two Llama "
    "assignments are made by hand (LlamaFlashAttention2.forward, :47; LlamaForCausalLM.prepare_inputs_for_generation, :58).",
    "methods/dynamic_v11.py:6 imports jsonlines, unused: an empty module stands in.",
    "llama_model_impl/dynamickv_v11.py:173 calls self._flash_attention_forward, gone from transformers >= 4.43, and "
    "flash-attn does not run on CPU: a stand-in calls torch's SDPA with flash-attn's layout and its bottom-right "
    "causal mask.",
    "pred.py loads with attn_implementation='flash_attention_2', which transformers refuses without flash-attn: the "
    "model is loaded eager, then config._attn_implementation is set to 'flash_attention_2' and each layer's "
    "attention made a LlamaFlashAttention2 (the same weights; the forward is the authors').",
    "Settings as pred.py:174-207 and run_llama3_8b_dynamic_v11.2_max_radio_10.sh write them: window 8, kernel 7, "
    "avgpool, radio_max 10, max_capacity_prompt = round(budget n) (pred.py:177; kvmini's budget in tokens).",
    "kvmini's protocol instead of model.generate: the prompt in one call, then each continuation token in its own "
    "call with its absolute position; each layer's kv_seq_len reset to 0 before a prompt (as utils.py:10-12).",
    "Per KV head only (not the authors' behaviour): the scores pooled at methods/dynamic_v11.py:58-59 are first "
    "averaged over each KV head's query heads, and update_and_reset_budget (:78) sees one head per KV head "
    "(its head_num, :83 and :88, becomes H_kv), its trimmed caches repeated back to the query heads.",
]
_GROUPS = {"g": 1}  # query heads per KV head while a per-KV-head run is on, else 1 (their code as released)


def flash_standin(self, q, k, v, attention_mask, query_length, dropout=0.0, softmax_scale=None, **_):
    """flash_attn_func's contract on CPU: (B, S, H, D) in and out, causal mask aligned bottom-right."""
    import torch
    import torch.nn.functional as F

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    Lq, Lk = q.shape[2], k.shape[2]
    mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(diagonal=Lk - Lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale).transpose(1, 2).contiguous()


class GroupMean:
    """torch.nn.functional as methods/dynamic_v11.py sees it: its pooling reads group-mean scores."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def grouped(self, x):  # (B, H, S)
        g = _GROUPS["g"]
        B, H, S = x.shape
        return x.view(B, H // g, g, S).mean(2, keepdim=True).expand(-1, -1, g, -1).reshape(B, H, S)

    def avg_pool1d(self, x, *a, **kw):
        return self.f.avg_pool1d(self.grouped(x), *a, **kw)

    def max_pool1d(self, x, *a, **kw):
        return self.f.max_pool1d(self.grouped(x), *a, **kw)


def load(code, folder):
    import torch

    sys.path.insert(0, str(code))
    sys.modules.setdefault("jsonlines", types.ModuleType("jsonlines"))
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama as ml
    from kv_compression.token_drop.llama_model_impl import dynamickv_v11 as impl
    from kv_compression.token_drop.llama_model_impl.utils import prepare_inputs_for_generation_llama
    from kv_compression.token_drop.methods import dynamic_v11 as meth

    ml.LlamaFlashAttention2.forward = impl.llama_flash_attn2_forward_DynamicKV_V11
    ml.LlamaForCausalLM.prepare_inputs_for_generation = prepare_inputs_for_generation_llama
    ml.LlamaFlashAttention2._flash_attention_forward = flash_standin
    meth.F = GroupMean(meth.F)
    released = meth.DynamicKVClusterV11.update_and_reset_budget

    def per_kv_head(self, k_cache, v_cache, gather_indices, attn_cache):
        g = _GROUPS["g"]
        if g == 1:
            return released(self, k_cache, v_cache, gather_indices, attn_cache)
        k, v, idx = released(self, [t[:, ::g] for t in k_cache], [t[:, ::g] for t in v_cache], gather_indices,
                             [a[:, ::g] for a in attn_cache])
        return [t.repeat_interleave(g, 1) for t in k], [t.repeat_interleave(g, 1) for t in v], idx

    meth.DynamicKVClusterV11.update_and_reset_budget = per_kv_head
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    model.config._attn_implementation = "flash_attention_2"
    for i, layer in enumerate(model.model.layers):  # their attention class, with this layer's weights
        attention = ml.LlamaFlashAttention2(model.config, layer_idx=i)
        attention.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = attention.eval()
    full = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, full


def run(runner, ids, n: int, kv_head: bool, budget: float):
    """ids (1, N + K) -> (logits (K, V) as kvmini's protocol, [layer][query head] kept prompt positions)."""
    import torch
    from transformers.cache_utils import DynamicCache

    from kvmini.eval.authors import full_keys, match

    model, full = runner
    c = model.config
    groups = c.num_attention_heads // c.num_key_value_heads
    for layer in model.model.layers:
        cfg = layer.self_attn.config
        cfg.window_size, cfg.kernel_size, cfg.pooling, cfg.radio_max = 8, 7, "avgpool", 10
        cfg.max_capacity_prompt = round(budget * n)
        layer.self_attn.kv_seq_len = 0
    _GROUPS["g"] = groups if kv_head else 1
    cache, logits = DynamicCache(), []
    try:
        with torch.inference_mode(), contextlib.redirect_stdout(io.StringIO()):  # their prints
            out = model(ids[:, :n], position_ids=torch.arange(n)[None], past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1:].float())
            held = [k.clone() for k in cache.key_cache]
            for t in range(n, ids.shape[1] - 1):
                out = model(ids[:, t : t + 1], position_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
                logits.append(out.logits[0, -1:].float())
            keys = full_keys(full, ids[:, :n])
    finally:
        _GROUPS["g"] = 1
    return torch.cat(logits), [match(h, f, groups) for h, f in zip(held, keys)]
