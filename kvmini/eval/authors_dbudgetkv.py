"""DBudgetKV's released code (Patrick-Ni/ReFreeKV, modified_models/: its `h2o` attention with the dynamic
budget, as scripts/run_refreekv.sh runs it) under kvmini's fidelity protocol on CPU, for kvmini.eval.authors.
Needs transformers 4.44 (PACKAGES) in --deps. Their files are imported, not edited.
"""
import importlib.machinery
import sys
import types

REPO, COMMIT = "Patrick-Ni/ReFreeKV", "cc6848663c271a81d925b4a9d7119b7920383091"
FILES = ("modified_models/evict_utils.py", "modified_models/llama_model.py")  # what the cross-check reads of the checkout (checked before any work)
PACKAGES = {"transformers": "4.44.2", "tokenizers": "0.19.1", "huggingface-hub": "0.24.6"}
SPEC, BUDGET = "dbudgetkv[variant=official]", None
ADAPTATIONS = [
    "modified_models/llama_model.py:14-15 import flash_attn for forwards not used here (eager attention): modules "
    "that raise stand in, put in place after transformers is imported (it probes for flash_attn).",
    "modified_models/monkeypatch.py replace_llama('h2o') is not imported (it imports the Mistral and Qwen files): "
    "LlamaAttention.forward = llama_attn_forward_H2O (llama_model.py:304), eager as scripts/run_refreekv.sh.",
    "main.py's per-layer settings for --method h2o --dynamic --metric last_token_attn --normalize --budget 1.0 "
    "--threshold 0.05: window 8, kernel 7, maxpool, max_capacity_prompt = n; float32 on CPU (main.py: bfloat16, "
    "device_map='auto').",
    "kvmini's protocol instead of model.generate: the prompt in one call (llama_model.py:363-375 compresses), then "
    "each continuation token in its own call with its position and cache_position (llama_model.py:376-378 "
    "appends). Their generate path passes no cache_position (prepare_inputs_for_modified_generation_llama), so "
    "transformers 4.44 would take it from layer 0's compressed length and llama_model.py:382-388 would mask the "
    "newest entries of any layer holding more than layer 0.",
    "Per KV head only (not the authors' behaviour): in H2OKVCluster.update_kv (modified_models/evict_utils.py) the "
    "two softmaxes, the last 8 queries' window attention that ranks and the last query's row that last_token_attn "
    "measures (dynamic_metrics.py:128, 287-350), are averaged over each KV head's query heads.",
]
_GROUPS = {"g": 1}  # query heads per KV head while a per-KV-head run is on, else 1 (their code as released)


class GroupSoftmax:
    """torch.nn as modified_models/evict_utils.py sees it: its softmax over (B, H, T, S) averaged per KV head."""

    def __init__(self, nn):
        self.nn = nn
        self.functional = types.SimpleNamespace(**{k: getattr(nn.functional, k) for k in dir(nn.functional)
                                                   if not k.startswith("__")})
        self.functional.softmax = self.softmax

    def __getattr__(self, name):
        return getattr(self.nn, name)

    def softmax(self, x, *a, **kw):
        p, g = self.nn.functional.softmax(x, *a, **kw), _GROUPS["g"]
        if g == 1 or p.dim() != 4:
            return p
        B, H, T, S = p.shape
        return p.view(B, H // g, g, T, S).mean(2, keepdim=True).expand(-1, -1, g, -1, -1).reshape(B, H, T, S)


def load(code, folder):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama as ml

    def unavailable(*_, **__):
        raise RuntimeError("flash_attn is not available on CPU")

    for name in ("flash_attn", "flash_attn.bert_padding"):
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
        for f in ("flash_attn_func", "flash_attn_varlen_func", "index_first_axis", "pad_input", "unpad_input"):
            setattr(stub, f, unavailable)
        sys.modules.setdefault(name, stub)
    sys.path.insert(0, str(code))
    from modified_models import evict_utils, llama_model

    evict_utils.nn = GroupSoftmax(evict_utils.nn)
    full_forward = ml.LlamaAttention.forward
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    for layer in model.model.layers:
        c = layer.self_attn.config
        c.kernel_size, c.pooling, c.debug, c.window_size = 7, "maxpool", False, 8
        c.dynamic, c.threshold, c.metric, c.normalize = True, 0.05, "last_token_attn", True
        c.attn_p, c.save_rate, c.save_layer = -1, -1, []
    return model, ml.LlamaAttention, full_forward, llama_model.llama_attn_forward_H2O


def run(runner, ids, n: int, kv_head: bool, budget=None):
    """ids (1, N + K) -> (logits (K, V) as kvmini's protocol, [layer][query head] kept prompt positions)."""
    import torch
    from transformers.cache_utils import DynamicCache

    from kvmini.eval.authors import full_keys, match

    model, attention, full_forward, theirs = runner
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    attention.forward = full_forward  # transformers' own: the prompt's keys, to read what is kept
    keys = full_keys(model, ids[:, :n])
    for layer in model.model.layers:
        layer.self_attn.config.max_capacity_prompt = n
    attention.forward, _GROUPS["g"] = theirs, groups if kv_head else 1
    cache, logits = DynamicCache(), []
    try:
        with torch.inference_mode():
            for t0, t1 in [(0, n)] + [(t, t + 1) for t in range(n, ids.shape[1] - 1)]:
                out = model(input_ids=ids[:, t0:t1], attention_mask=torch.ones(1, t1, dtype=torch.long),
                            position_ids=torch.arange(t0, t1)[None], cache_position=torch.arange(t0, t1),
                            past_key_values=cache, use_cache=True)
                logits.append(out.logits[0, -1:].float())
                if t0 == 0:
                    kept = [match(k, f, groups) for k, f in zip(cache.key_cache, keys)]
    finally:
        attention.forward, _GROUPS["g"] = full_forward, 1
    return torch.cat(logits), kept
