"""A Llama / Mistral / Qwen2 / Qwen3 decoder in one file, reading like the papers.

References: Touvron et al. 2023 (Llama), Jiang et al. 2023 (Mistral, sliding window), Qwen team
2024/2025 (Qwen2 q/k/v bias, Qwen3 q/k RMSNorm), Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA).
Names mirror the Hugging Face checkpoints (model.layers.{i}.self_attn.q_proj.weight, ...): no rename table.

Shapes: B batch, T new tokens, S cached tokens, C hidden size, H query heads, H_kv KV heads, D head dim, V vocabulary.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvmini.attention import attend
from kvmini.cache import KVCache, LayerCache, wide
from kvmini.config import ModelConfig
from kvmini.engine import begin


class RMSNorm(nn.Module):
    r"""y = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \cdot w   (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = wide(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(config: ModelConfig, device=None) -> torch.Tensor:
    r"""\theta_i = \mathrm{base}^{-2i/D}, i < D/2, with Llama-3.1's long-context rescaling if configured."""
    D = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)  # (D/2,)
    if config.rope_scaling is None:
        return inv_freq
    factor, low, high, old_ctx = config.rope_scaling
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x, cos, sin):
    r"""Rotate each (x_i, x_{i+D/2}) pair by angle pos \cdot \theta_i (half-split layout, as in HF):
    x (B, h, T, D); cos, sin (B, 1, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        C, H, H_kv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.H, self.H_kv, self.D = H, H_kv, D
        self.q_proj = nn.Linear(C, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, H_kv * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, H_kv * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, C, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.window = config.sliding_window if layer in config.sliding_layers else None

    def project(self, x, cos, sin):
        """x (B, T, C) -> q (B, H, T, D), k (B, H_kv, T, D) after RoPE, v (B, H_kv, T, D)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.H_kv, self.D)  # (B, T, H_kv, D)
        v = self.v_proj(x).view(B, T, self.H_kv, self.D).transpose(1, 2)  # (B, H_kv, T, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def forward(self, x, pos, cos, sin, cache: LayerCache, wants: dict | None):
        """x (B, T, C); pos (B, T) absolute positions -> (B, T, C), the statistics `wants` names ({} without it)."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        cache.append(k, v, pos)
        K, V, k_pos = cache.keys, cache.values, cache.positions  # (B, H_kv, S, D) x2, (B, H_kv, S)
        out, stats = attend(q, K, V, pos, k_pos, wants, self.window, cache.padded)
        out = out.transpose(1, 2).reshape(B, T, self.H * self.D)  # (B, T, H*D)
        return self.o_proj(out), stats


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        C, I, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(C, I, bias=b)
        self.up_proj = nn.Linear(C, I, bias=b)
        self.down_proj = nn.Linear(I, C, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, pos, cos, sin, cache, wants):
        a, stats = self.self_attn(self.input_layernorm(x), pos, cos, sin, cache, wants)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), stats


class Backbone(nn.Module):
    """The `model.` part of an HF checkpoint: embeddings, blocks, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)  # (D/2,)

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        return KVCache(self.config, batch, self.dtype, self.device, capacity)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, method=None, all_logits: bool = False,
                on_layer=None):
        """Run T new tokens, ids (B, T), through the model, appending them to `cache`. Returns logits
        (B, T, V) if all_logits else (B, 1, V). A compression `method` (kvmini.methods.method) is handed this
        call's step of its run (kvmini.engine.Step) before layer 0, where it names the statistics each
        layer's attention computes for it (`wants`), after each layer's attention and after the last layer.
        on_layer(i), if given, hears that layer i is done (progress reports)."""
        B, T = ids.shape
        cache = cache if cache is not None else self.new_cache(B, T)
        pos = torch.arange(cache.seen_tokens, cache.seen_tokens + T, device=ids.device).expand(B, T)  # (B, T)
        angles = pos[..., None].float() * self.inv_freq  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, D)
        step = begin(method, cache, T) if method is not None else None  # the run's facts for this call
        wants = method.before(cache, step) if method is not None else None
        x = self.model.embed_tokens(ids)  # (B, T, C)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for i, block in enumerate(self.model.layers):
            x, stats = block(x, pos, cos, sin, cache[i], wants)
            if method is not None:
                method.after_attention(i, cache, stats, step)
            if on_layer is not None:
                on_layer(i)
        if method is not None:
            method.after_layers(cache, step)
        cache.seen_tokens += T
        x = x if all_logits else x[:, -1:]
        return self.lm_head(self.model.norm(x))  # (B, T or 1, V)
