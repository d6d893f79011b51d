"""RoCo's released code (DRSY/EasyKV, easykv/easykv.py: generate() in kv_mode 'auto' -> 'encoding_decoding',
kv_policy='roco', as the README's "Auto Mode" example runs it) under kvmini's fidelity protocol on CPU, for
kvmini.eval.authors. Needs transformers 4.37 (PACKAGES) in --deps. Their files are imported, not edited: every
change is a rebinding of a name in their module (easykv.easykv) or of the model they are given.

EasyKV's selection is per KV head as released (easykv.py:188-196 and :683-688 average the attention rows over a KV
head's query heads; the cache holds KV heads): kv_head=True runs their code as released, and kv_head=False runs it on
the same model with one KV head per query head (k_proj/v_proj repeated), so that it selects per query head.
"""
import contextlib
import copy
import io
import sys
import types

REPO, COMMIT = "DRSY/EasyKV", "a1d71cae3b562d9a709dda3741bd63e46a09ad31"
FILES = ("easykv/easykv.py",)  # what the cross-check reads of the checkout (checked before any work)
PACKAGES = {"transformers": "4.37.2", "tokenizers": "0.15.0", "huggingface-hub": "0.20.2", "accelerate": "0.25.0"}
SPEC, RELEASED = "roco[variant=official]", "per_kv_head"
STRIDE = 64  # kvmini.methods.roco.CHUNK; EasyKV's stride (README "Auto Mode": stride = 64)
# 20% of n = 1024 is 205 tokens in kvmini (round(0.2 * 1024)); EasyKV's cache, with stride 64 and its chunks ending at
# the prompt's end, holds idx with (n - idx) % 64 == 0 (easykv.py:549-550): 192 or 256, never 205. 0.1875 * 1024 =
# 192, the nearest that EasyKV can hold, is the budget at which both run the same calls (kvmini.methods.roco).
BUDGET = 0.1875
ADAPTATIONS = [
    "easykv.py:541, :569 patch LlamaAttention.forward with partial(llama_forward, attn_device='cuda'), and "
    "llama_patch.py:246 moves the attention weights to attn_device: llama_forward is rebound in easykv.easykv to a "
    "function calling their llama_forward with attn_device='cpu' (their code otherwise unchanged).",
    "The model is loaded with attn_implementation='eager' in float32 on CPU (README: float16, device_map='auto'): "
    "utils.py:31 replaces forward only on instances of a class named 'LlamaAttention', which transformers 4.37's "
    "default (LlamaSdpaAttention) is not; unpatched, 4.37's forward would index RoPE past the compressed cache's "
    "length (llama_patch.py:187 'for KV eviction purpose' is their fix).",
    "generate() is called as the README's Auto Mode (enable_fixed_kv(mode='auto', stride=64), kv_policy='roco', "
    "keep_attention=False, temp_length 4 and recent_ratio 0.1 by default) with an integer budget b - 64, so that "
    "easykv.py:546-550 read B = idx = b (b = kvmini's budget, 192): r_idx = 64 (:551-552), the prefix of 64 tokens in "
    "one call (:557), then chunks of 64 (:587-594), the same calls as kvmini's chunks of 64 from the first token.",
    "kvmini's protocol instead of sampling: logits_adapter (easykv.py:115, called at :561, :597, :691) is rebound to "
    "record nothing but return, as the sampling distribution, a one-hot on the window's next token, so "
    "torch.multinomial at :671 feeds the continuation (teacher forcing); max_new_tokens = K - 1, eos_token_ids = [] "
    "(never stops, :675). The logits are each call's last position (:596, :690), recorded by a forward hook on the "
    "model: the last prompt chunk's and the K - 1 decode steps'.",
    "What is kept is read by key: every key their attention writes into the cache (DynamicCache.update with RoPE's "
    "cache_kwargs, llama_patch.py:195) is recorded in position order (each call feeds the next positions), and the "
    "cache left by the last eviction (truncate_kv_cache_silo's result, :727) is matched exactly against them "
    "(boolean-mask copies, :56-82). The positions before the prompt's end are reported, after the K - 1 decode "
    "steps, as kvmini.eval.authors.kvmini_run reports kvmini's.",
    "Per query head only (not the authors' behaviour): the model given to their code has k_proj/v_proj repeated to "
    "one KV head per query head (num_key_value_heads = 9, as kvmini's per_query_head), so that their rep_n = 1 "
    "(:216-218) and their scores and evictions are per query head.",
    "Their prints (:751) go to a buffer. The tokenizer enable_fixed_kv takes (:904) is a stand-in whose decode returns "
    "'' (used only at :752, on the forced tokens): tokenizers 0.15 cannot read SmolLM2's tokenizer.json.",
]


def widened(model):
    """A copy of `model` with k_proj/v_proj repeated so that every query head has its own KV head."""
    import torch

    wide = copy.deepcopy(model)
    c = wide.config
    g = c.num_attention_heads // c.num_key_value_heads
    c.num_key_value_heads = c.num_attention_heads
    for layer in wide.model.layers:
        a = layer.self_attn
        for name in ("k_proj", "v_proj"):
            old = getattr(a, name)
            w = old.weight.data.view(-1, a.head_dim, old.in_features).repeat_interleave(g, 0).reshape(-1, old.in_features)
            new = torch.nn.Linear(old.in_features, w.shape[0], bias=old.bias is not None, dtype=w.dtype)
            new.weight.data.copy_(w)
            if old.bias is not None:
                new.bias.data.copy_(old.bias.data.view(-1, a.head_dim).repeat_interleave(g, 0).reshape(-1))
            setattr(a, name, new)
        a.num_key_value_heads, a.num_key_value_groups = a.num_heads, 1
    return wide.eval()


class Runner:
    def __init__(self, E, narrow, wide):
        self.E, self.models = E, {True: narrow, False: wide}
        self.forced = None  # (1, N + K) token ids while a run is on
        self.seen = 0  # tokens fed so far
        self.logits = []  # each call's last-position logits
        self.keys = None  # [layer] list of (1, H, T, D) keys as written
        self.final = None  # the cache left by the last eviction


def load(code, folder):
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(code))
    import easykv.easykv as E  # noqa: E402  (theirs, unchanged)

    their_forward = E.llama_forward

    def llama_forward_cpu(self, *args, attn_device="cuda", **kwargs):
        return their_forward(self, *args, attn_device="cpu", **kwargs)

    E.llama_forward = llama_forward_cpu
    narrow = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    wide = widened(narrow)
    runner = Runner(E, narrow, wide)
    tokenizer = types.SimpleNamespace(eos_token_id=None, decode=lambda ids, **_: "")  # only :752 uses it
    for model in (narrow, wide):
        with contextlib.redirect_stdout(io.StringIO()):  # its print, easykv.py:908
            E.enable_fixed_kv(model, tokenizer, mode="auto", stride=STRIDE)
        model.register_forward_hook(lambda m, args, kwargs, out: hooked(runner, kwargs, out), with_kwargs=True)

    def forced_distribution(logits, temperature, top_p):
        """logits_adapter's (sampling distribution, softmax): the first a one-hot on the window's next token."""
        prob = torch.softmax(logits, dim=-1)
        nxt = runner.forced[0, min(runner.seen, runner.forced.shape[1] - 1)]
        return torch.nn.functional.one_hot(nxt, prob.shape[-1]).to(prob.dtype)[None], prob

    E.logits_adapter = forced_distribution
    their_silo = E.truncate_kv_cache_silo

    def silo(kv_cache, eviction_ids):
        runner.final = their_silo(kv_cache, eviction_ids)
        return runner.final

    E.truncate_kv_cache_silo = silo
    return runner


def hooked(runner, kwargs, out):
    if runner.forced is not None:
        runner.seen += kwargs["input_ids"].shape[1]
        runner.logits.append(out.logits[0, -1:].float().clone())


def run(runner, ids, n: int, kv_head: bool, budget: float):
    """ids (1, N + K) -> (logits (K, V) as kvmini's protocol, [layer][query head] kept prompt positions)."""
    import torch
    from transformers.cache_utils import DynamicCache

    from kvmini.budget import resolve_budget
    from kvmini.eval.authors import match

    model = runner.models[kv_head]
    K = ids.shape[1] - n
    b = resolve_budget(budget, n)  # kvmini's b; EasyKV's B (budget + stride, :547) is b
    L = model.config.num_hidden_layers
    runner.forced, runner.seen, runner.logits, runner.final = ids, 0, [], None
    runner.keys = [[] for _ in range(L)]
    update = DynamicCache.update

    def recording(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if cache_kwargs is not None:  # from their attention (from_legacy_cache passes none)
            runner.keys[layer_idx].append(key_states.clone())
        return update(self, key_states, value_states, layer_idx, cache_kwargs)

    config = dict(temperature=1.0, top_p=1.0, max_new_tokens=K - 1, budget=b - STRIDE, kv_policy="roco",
                  keep_attention=False, eos_token_ids=[])
    DynamicCache.update = recording
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            model.easykv_generate(input_ids=ids[:, :n], generation_config=config)
    finally:
        DynamicCache.update = update
        runner.forced = None
    if runner.seen != ids.shape[1] - 1:
        raise RuntimeError(f"their run fed {runner.seen} tokens, not {ids.shape[1] - 1}")
    logits = torch.cat(runner.logits[-K:])
    H = model.config.num_attention_heads
    H_cache = model.config.num_key_value_heads
    g = H // H_cache
    kept = []
    for l in range(L):
        written = torch.cat(runner.keys[l], dim=2)  # (1, H_cache, N + K - 1, D), position = index
        sets = match(runner.final[l][0], written, 1)  # [cache head] positions
        sets = [[p for p in s if p < n] for s in sets]
        kept.append([sets[h // g] for h in range(H)])
    runner.keys = None
    return logits, kept
