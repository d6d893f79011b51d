"""CaM's released code (zyxxmu/cam, generate_task/: streaming_llm/pos_shift/modify_llama_cam.py's attention with
streaming_llm/kv_cache_cam.py's StartRecentKVCache_cam, as examples/eval_long_ppl.py runs it with --method cam
--enable_pos_shift: their one path with a bounded cache) under kvmini's fidelity protocol on CPU, for
kvmini.eval.authors. Needs transformers 4.33 (PACKAGES; their repository's README.md and INSTALL.md name 4.33.0) in --deps. Below,
llama_cam.py is streaming_llm/pos_shift/modify_llama_cam.py, cache.py streaming_llm/kv_cache_cam.py, ppl.py
examples/eval_long_ppl.py. Their files are read, not edited: two text replacements (PATCHES) are made when
llama_cam.py is loaded, its lines keeping their numbers. Their cache takes one token per call, so kvmini's side
is fed the prompt one token per call too (PROMPT_CHUNK); their merge mask draws kvmini's uniforms.
"""
import contextlib
import io
import sys
import types
from pathlib import Path

REPO, COMMIT = "zyxxmu/cam", "fc80e64f460b343be96c87596f2494fc9d319c45"
FILES = ("generate_task/streaming_llm/kv_cache_cam.py", "generate_task/streaming_llm/pos_shift/modify_llama_cam.py")  # what the cross-check reads of the checkout (checked before any work)
PACKAGES = {"transformers": "4.33.0", "tokenizers": "0.13.3", "huggingface-hub": "0.16.4"}
SPEC, BUDGET = "cam[variant=official]", 0.2
PROMPT_CHUNK = 1  # kvmini's prompt fed one token per call, as their cache takes it (ADAPTATIONS 3)
SINKS, SEED = 4, 0  # kvmini's cam defaults (Options.sinks, Options.merge_seed)
PATCHES = [  # (their text, what runs instead): original positions instead of pos-shift
    ("cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)",
     "cos, sin = self.rotary_emb(value_states, seq_len=max(kv_seq_len, int(position_ids.max()) + 1))"),
    ("key_position_ids = torch.arange(kv_seq_len, device=position_ids.device).unsqueeze(0)",
     "key_position_ids = _held_positions(self, kv_seq_len, position_ids)"),
]


ADAPTATIONS = [
    "ppl.py:36 builds no outer cache for --method cam (it tests the misspelt 'stramingllm'); CaM runs inside "
    "the attention: llama_cam.py:177-193 (enable_llama_pos_shift_attention_cam) replaces each LlamaAttention's "
    "forward and gives it a StartRecentKVCache_cam, called at llama_cam.py:166-167. That function is called "
    "as ppl.py:58-60 calls it; llama_cam.py:30 parses sys.argv at import, so sys.argv is set to ppl.py's "
    "arguments meanwhile. Float32 on CPU (utils.py:46-51: float16, device_map='auto').",
    f"Cache sizes: start_size = {SINKS} (kvmini's sinks; ppl.py default 1, README 32), recent_size = b - {SINKS} "
    "with b = kvmini's budget in tokens (round(0.2 n) = 205 for n = 1024), so cache_size (cache.py:72) = b. "
    "A fresh StartRecentKVCache_cam per layer before every window (its accum_attn, cache.py:78, lives on "
    "otherwise).",
    "The prompt goes in token by token, as ppl.py:82-97 feeds every token, not in one call: cache.py only "
    "handles one token per call. With an n-token call, accum_attn keeps the (B, H, n, n) weights unsummed "
    "over queries (cache.py:21-22), :32 and :36 then give a (B, H, n) mask that :37 cannot broadcast against "
    "the (B, H, D) value; and :37-40 merge only the one entry before the recent window, drop the other "
    "n - b evicted entries unmerged (:95-110) and remove one accum_attn column (:40), so the next call's "
    "accumulation (:24) no longer aligns. Each continuation token then in its own call, as kvmini.",
    "Kept positions: a wrapper around each layer's StartRecentKVCache_cam follows each slot's token position "
    "through every call, checking bitwise that their returned keys are the sinks and the recent_size newest "
    "entries (cache.py:95-110); in layers 1.. this is confirmed by exact key match (kvmini.eval.authors.match) "
    "against the keys the same run gave each token when it entered the cache (llama_cam.py:110 caches keys "
    "before RoPE; CaM never merges keys). Layer 0's pre-RoPE keys repeat with their token, so there key "
    "matching is ambiguous; and with the prompt fed token by token a full-cache pass would give other keys "
    "from layer 1 on, so the table is the run's own.",
    "As released (per query head): llama_cam.py:110 caches the H_kv heads but :116-117 repeat them and the "
    "weights of :136 reach cache.py per query head, so on this GQA model (9 query, 3 KV heads) cache.py:37 "
    "fails (a (1, 3, D) value times a (1, 9, 1) mask). The as-released row runs a copy of the model with "
    "k_proj/v_proj repeated per query head (num_key_value_heads = 9; the same function), so that their cache "
    "holds every query head, as kvmini's per_query_head.",
    "Per KV head only (not the authors' behaviour): a wrapper around each layer's StartRecentKVCache_cam "
    "averages the attention weights it is given (llama_cam.py:167) over each KV head's query heads, so "
    "accum_attn, p and the mask are per KV head, as kvmini's default (reduce mean).",
    "cache.py:36 draws torch.bernoulli(p) from the global, unseeded RNG: `torch` in cache.py's namespace is a "
    "proxy whose bernoulli returns (u < p) with u = torch.rand(p.shape, float64) from kvmini's generator for the "
    f"calling layer (seed {SEED} * 2**20 + layer, reseeded every window, kvmini.methods.cache_merging.CacheMerge."
    "start/merge_mask): the same uniforms in the same order as kvmini draws them, one eviction per call.",
    "Original positions instead of pos-shift (kvmini's documented deviation): llama_cam.py:100 asks rotary_emb "
    "for max(kv_seq_len, position_ids.max() + 1) rows and :112 ropes each held key at its token position (sinks "
    "0..s-1, then a run ending at the newest token: the only shape their cache holds) instead of its cache index; "
    "the query gets its token position (position_ids passed to the model; transformers 4.33 would give the cache "
    "index).",
    "kvmini's side (not the tool's protocol for other methods): its prompt is fed one token per call "
    "(kvmini.generate.prefill's chunk_size, PROMPT_CHUNK), as their code is fed.",
]

_STATE = {"layer": 0, "generators": [], "t": 0}


class TorchProxy:
    """torch as cache.py sees it: its bernoulli draws kvmini's uniforms for the calling layer."""

    def __init__(self, torch):
        self.torch = torch

    def __getattr__(self, name):
        return getattr(self.torch, name)

    def bernoulli(self, p, *a, **kw):
        torch = self.torch
        u = torch.rand(p.shape, generator=_STATE["generators"][_STATE["layer"]], dtype=torch.float64)
        return (u < p).to(p.dtype)


def _held_positions(attn, kv_seq_len, position_ids):
    """The token position of each held entry: sinks 0..s-1, then a run ending at the query's position."""
    import torch

    j = torch.arange(kv_seq_len, device=position_ids.device)
    if attn.kv_cache is None:  # no cache (a full-cache pass): nothing was evicted
        return j.unsqueeze(0)
    s = attn.kv_cache.start_size
    shift = int(position_ids[0, -1]) - (kv_seq_len - 1)
    return torch.where(j < s, j, j + shift).unsqueeze(0)


class Layer:
    """Wraps one layer's StartRecentKVCache_cam: sets the calling layer (for the draws), records each new token's
    key (the table kept sets are matched against), follows each slot's token position (checked against their
    output keys, bitwise) and with groups > 1 averages the weights per KV head."""

    def __init__(self, inner, layer, groups):
        self.inner, self.layer, self.groups, self.keys, self.slots = inner, layer, groups, [], []
        self.start_size = inner.start_size

    def __call__(self, attn_weights, past_key_value):
        import torch

        k = past_key_value[0]
        T = attn_weights.shape[2]
        self.keys.append(k[:, :, -T:].clone())
        self.slots += list(range(_STATE["t"], _STATE["t"] + T))
        g = self.groups
        if g > 1:
            B, H, _, S = attn_weights.shape
            attn_weights = attn_weights.view(B, H // g, g, T, S).mean(2)
        _STATE["layer"] = self.layer
        out = self.inner(attn_weights, past_key_value)
        S, c = k.shape[2], self.inner
        if S > c.cache_size:  # cache.py:95-110: sinks and the recent_size newest, in order
            idx = list(range(c.start_size)) + list(range(S - c.recent_size, S))
            if not torch.equal(out[0], k[:, :, idx]):
                raise AssertionError(f"layer {self.layer}: their kept keys are not the sinks and the newest entries")
            self.slots = [self.slots[i] for i in idx]
        elif out[0] is not k:
            raise AssertionError(f"layer {self.layer}: keys changed without an eviction")
        return out


def load(code, folder):
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    root = Path(code) / "generate_task"
    sys.path.insert(0, str(root))
    argv, sys.argv = sys.argv, ["eval_long_ppl.py", "--enable_start_recent_kv_cache", "--enable_pos_shift",
                                "--start_size", str(SINKS), "--recent_size", "255", "--method", "cam"]
    try:
        from streaming_llm import kv_cache_cam

        path = root / "streaming_llm" / "pos_shift" / "modify_llama_cam.py"
        source = path.read_text()
        for old, new in PATCHES:
            if source.count(old) != 1:
                raise ValueError(f"{path}: expected one {old!r}; is this commit {COMMIT[:7]}?")
            source = source.replace(old, new)
        name = "streaming_llm.pos_shift.modify_llama_cam"
        mod = types.ModuleType(name)
        mod.__file__, mod.__package__ = str(path), "streaming_llm.pos_shift"
        mod._held_positions = _held_positions
        sys.modules[name] = mod
        exec(compile(source, str(path), "exec"), mod.__dict__)
    finally:
        sys.argv = argv
    kv_cache_cam.torch = TorchProxy(torch)
    with contextlib.redirect_stdout(io.StringIO()):
        model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(folder)
    g = config.num_attention_heads // config.num_key_value_heads
    config.num_key_value_heads = config.num_attention_heads
    wide = LlamaForCausalLM(config).to(torch.float32).eval()
    state = model.state_dict()
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[key]
            state[key] = w.view(-1, w.shape[0] // (config.num_attention_heads // g), w.shape[1]).repeat_interleave(
                g, 0).reshape(-1, w.shape[1])
    wide.load_state_dict(state)
    wide.tie_weights()
    for m in (model, wide):
        mod.enable_llama_pos_shift_attention_cam(m)  # ppl.py:58-60
    return {"gqa": model, "wide": wide, "groups": g, "cache_class": kv_cache_cam.StartRecentKVCache_cam}


def run(runner, ids, n: int, kv_head: bool, budget: float):
    """ids (1, N + K) -> (logits (K, V) as kvmini's protocol, [layer][query head] kept prompt positions)."""
    import torch

    from kvmini.budget import resolve_budget
    from kvmini.eval.authors import match

    model = runner["gqa"] if kv_head else runner["wide"]
    G = runner["groups"]
    b = resolve_budget(budget, n)
    layers = [layer.self_attn for layer in model.model.layers]
    for i, a in enumerate(layers):
        a.kv_cache = Layer(runner["cache_class"](start_size=SINKS, recent_size=b - SINKS, k_seq_dim=2, v_seq_dim=2),
                           i, G if kv_head else 1)
    _STATE["generators"] = [torch.Generator().manual_seed(SEED * 2**20 + i) for i in range(len(layers))]
    logits, past = [], None
    with torch.inference_mode():
        for t in range(ids.shape[1] - 1):  # ppl.py:82-97, one token per call
            _STATE["t"] = t
            out = model(input_ids=ids[:, t : t + 1], position_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            if t >= n - 1:
                logits.append(out.logits[0, -1:].float())
    kept = []
    H = model.config.num_attention_heads
    for li, (a, (k, _)) in enumerate(zip(layers, past)):
        followed = [p for p in a.kv_cache.slots if p < n]
        kept.append([followed] * H)
        if li > 0:  # layer 0's keys (before RoPE) repeat with their token, so only layers 1.. match uniquely
            table = torch.cat(a.kv_cache.keys, 2)[:, :, :n]  # (1, H_cache, n, D): each prompt token's key
            held = (k.repeat_interleave(G, 1) if kv_head else k)[:, :, : len(followed)]  # prompt entries come first
            found = match(held, table, G if kv_head else 1)
            if any(f != followed for f in found):
                raise AssertionError(f"layer {li}: key match and followed positions disagree")
        a.kv_cache = None
    return torch.cat(logits), kept
