# %% [markdown]
# # 1. The transformer and its KV cache, from scratch
#
# This tutorial walks through the parts of `kvmini/model.py` and `kvmini/cache.py` that every
# compression paper takes for granted: RMSNorm, rotary position embeddings (RoPE), grouped-query
# attention (GQA), and the key/value cache itself. Every equation is followed by the kvmini code
# that implements it and by a check against a literal computation.
#
# Run it as a script (`python tutorials/01_transformer_and_kv_cache.py`) or open it as a
# notebook (`python -m kvmini.notebooks 01` writes it, executed, to notebooks/).
# A tiny random model is enough for everything except the last section, which uses the
# configuration of the default model (SmolLM2-135M-Instruct).

# %%
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent))  # find kvmini from root or tutorials/

import torch  # noqa: E402

from kvmini.attention import explicit_attention, in_chunks, sdpa_attention  # noqa: E402
from kvmini.cache import PAD, KVCache, LayerCache  # noqa: E402
from kvmini.config import ModelConfig  # noqa: E402
from kvmini.model import RMSNorm, Transformer, apply_rope, rope_frequencies  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## RMSNorm
#
# Each token's hidden vector $x \in \mathbb{R}^C$ is rescaled by its root mean square, then by a
# learned per-channel gain $w$ (Zhang & Sennrich, 2019):
#
# $$\mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\frac{1}{C}\sum_{c} x_c^2 + \epsilon}} \odot w$$

# %%
norm = RMSNorm(8, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
x = torch.randn(3, 8)
literal = torch.stack([row / math.sqrt(sum(v * v for v in row.tolist()) / 8 + 1e-6) * norm.weight for row in x])
assert torch.allclose(norm(x), literal, atol=1e-6)

# %% [markdown]
# ## RoPE: the paper's pairwise form equals the half-split form in the code
#
# RoPE (Su et al., 2021) rotates consecutive pairs $(x_{2i}, x_{2i+1})$ of a query or key at
# position $m$ by the angle $m\theta_i$, with $\theta_i = \text{base}^{-2i/D}$:
#
# $$\begin{pmatrix} x'_{2i} \\ x'_{2i+1} \end{pmatrix} =
#   \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\ \sin m\theta_i & \cos m\theta_i \end{pmatrix}
#   \begin{pmatrix} x_{2i} \\ x_{2i+1} \end{pmatrix}$$
#
# Hugging Face checkpoints (and kvmini's `apply_rope`) pair dimension $i$ with $i + D/2$ instead
# ("half-split"). That is the same rotation applied to a permuted vector: put the even dimensions
# first and the odd ones second, and the pairs line up. Because the *same* permutation is applied to
# queries and keys, every dot product $q \cdot k$ — all attention ever looks at — is unchanged.

# %%
D = 8
TINY = dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=D)  # C = H * D = 32; two query heads share each KV head
config = ModelConfig(**TINY, rope_theta=10000.0)
theta = rope_frequencies(config)  # (D/2,)
assert torch.allclose(theta, torch.tensor([10000 ** (-2 * i / D) for i in range(D // 2)]))


def rope_pairwise(x: torch.Tensor, m: int) -> torch.Tensor:
    """The paper's form, written out pair by pair. x (D,)."""
    out = x.clone()
    for i in range(D // 2):
        c, s = math.cos(m * theta[i]), math.sin(m * theta[i])
        out[2 * i] = c * x[2 * i] - s * x[2 * i + 1]
        out[2 * i + 1] = s * x[2 * i] + c * x[2 * i + 1]
    return out


def rope_half_split(x: torch.Tensor, m: int) -> torch.Tensor:
    """kvmini's apply_rope for one vector at position m."""
    angles = torch.cat([m * theta, m * theta])  # (D,)
    return apply_rope(x.view(1, 1, 1, D), angles.cos(), angles.sin()).view(D)


evens_then_odds = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])  # the permutation P
q, k = torch.randn(D), torch.randn(D)
for m in (0, 3, 17):
    # half-split on P x  ==  P (pairwise on x)
    assert torch.allclose(rope_half_split(q[evens_then_odds], m), rope_pairwise(q, m)[evens_then_odds], atol=1e-5)
# so the attention logits agree, and they depend only on the distance m - n:
logit = lambda f, m, n: f(q, m) @ f(k, n)  # noqa: E731
assert torch.allclose(rope_half_split(q[evens_then_odds], 7) @ rope_half_split(k[evens_then_odds], 3),
                      logit(rope_pairwise, 7, 3), atol=1e-5)
assert torch.allclose(logit(rope_half_split, 7, 3), logit(rope_half_split, 14, 10), atol=1e-5)  # relative

# %% [markdown]
# ## Grouped-query attention
#
# With $H$ query heads and $H_{kv}$ key/value heads, the $g = H / H_{kv}$ query heads of a group
# share one key and one value head. SmolLM2 has $H = 9$, $H_{kv} = 3$: the cache is 3x smaller than
# with one KV head per query head. kvmini never copies K/V to the query heads: query head $h$ reads
# KV head $\lfloor h / g \rfloor$. The check below runs kvmini's two ways to attend (PyTorch's fused SDPA,
# and the attention written out, 2 queries at a time here, which also gives the statistics a method asks
# for) against the literal "repeat each KV head g times" softmax, written out here.

# %%
B, H, H_kv, T = 1, 6, 2, 5
g = H // H_kv
qh, kh, vh = torch.randn(B, H, T, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
pos = torch.arange(T)
k_rep, v_rep = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)  # (B, H, T, D): KV head h // g per query head
scores = qh @ k_rep.transpose(-1, -2) / math.sqrt(D) + torch.full((T, T), float("-inf")).triu(1)  # causal
literal = scores.softmax(-1) @ v_rep  # (B, H, T, D)
prompt = sdpa_attention(qh, kh, vh, pos[None], pos.expand(B, H_kv, T))  # the prompt: SDPA, grouped
one, _ = explicit_attention(qh[:, :, -1:], kh, vh, pos[None, -1:], pos.expand(B, H_kv, T), {})  # a decode step
chunked, _ = in_chunks(qh, kh, vh, pos[None], pos.expand(B, H_kv, T), {}, chunk=2)
assert torch.allclose(prompt, literal, atol=1e-5) and torch.allclose(chunked, literal, atol=1e-5)
assert torch.allclose(one, literal[:, :, -1:], atol=1e-5)

# %% [markdown]
# ## Why a cache: prefill, then decode
#
# A token's key and value at a layer depend only on the tokens before it, so once computed they
# never change. *Prefill* runs the whole prompt at once and stores every layer's keys (after RoPE)
# and values; each *decode* step then computes one new query, key and value per layer, appends
# them, and attends over the cache. The result is exactly what re-running the whole sequence would
# give — without the quadratic re-computation.

# %%
model = Transformer(ModelConfig(**TINY, rope_theta=1000.0)).eval()
ids = torch.randint(0, 50, (1, 12))
with torch.no_grad():
    everything = model(ids, all_logits=True)  # (1, 12, V): no cache reuse
    cache = model.new_cache(batch=1)
    model(ids[:, :8], cache)  # prefill 8 tokens
    steps = [model(ids[:, t : t + 1], cache) for t in range(8, 12)]  # decode 4, one at a time
assert torch.allclose(torch.cat(steps, 1), everything[:, 8:], atol=1e-5)
assert cache.seen_tokens == 12 and cache.lengths() == [12, 12]

# %% [markdown]
# ## What `KVCache` stores
#
# One `LayerCache` per layer, each holding, for every KV head:
#
# | tensor | shape | meaning |
# |---|---|---|
# | `keys` | $(B, H_{kv}, S, D)$ | keys after RoPE |
# | `values` | $(B, H_{kv}, S, D)$ | values |
# | `positions` | $(B, H_{kv}, S)$ | the absolute position of each entry |
# | `aux[name]` | $(B, H_{kv}, S)$ | per-token statistics a compression method keeps |
#
# Positions matter once tokens are evicted: the next token's position is `cache.seen_tokens`, not
# the cache length, and attention masks are built from positions. `keep(idx)` gathers keys,
# values, positions and every aux tensor together, which is all that eviction needs.

# %%
layer = cache[0]
print("keys", tuple(layer.keys.shape), "positions", layer.positions[0, 0].tolist())
layer.declare("score")  # a per-token statistic, declared by the part that keeps it
layer.aux("score")[:] = torch.arange(12.0)
layer.keep(torch.tensor([[0, 5, 11], [1, 2, 11]]).view(1, 2, 3))  # each KV head keeps its own three
assert layer.positions.tolist() == [[[0, 5, 11], [1, 2, 11]]]
assert layer.aux("score").tolist() == [[[0.0, 5.0, 11.0], [1.0, 2.0, 11.0]]]
assert cache.seen_tokens == 12  # eviction does not move the next token's position

# %% [markdown]
# ## Two ways to evict: `keep(idx)` and `evict_one(slot)`
#
# `keep(idx)` is the readable bulk case: after a prompt, a method keeps $b$ of $n$ tokens, and
# every kept entry is copied into place, in position order — $O(S \cdot D)$ work per layer.
# A method that evicts at every decode step (H2O, TOVA, StreamingLLM, D2O, WeightedKV) drops one
# token per head per step. Doing that with `keep` would copy all $S$ entries to move past one
# hole: as much memory traffic as the attention itself, every step. `evict_one(slot)` instead
# moves the newest entry into the evicted one's slot — $O(D)$. The buffer is then out of position
# order, which attention does not mind: it masks by `positions`, never by buffer index, and a sum
# over keys does not depend on their order.

# %%
layer = LayerCache(1, 1, 2, torch.float32, "cpu")
for t in range(5):  # entries at positions 0..4, key = (t, t)
    layer.append(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2), torch.tensor([[t]]))
layer.evict_one(torch.tensor([[1]]))  # drop position 1: the newest entry (position 4) takes slot 1
assert layer.positions.tolist() == [[[0, 4, 2, 3]]]
q = torch.randn(1, 1, 1, 2)
ordered = layer.positions.argsort(dim=-1)[..., None].expand(-1, -1, -1, 2)  # the same entries, sorted
a = sdpa_attention(q, layer.keys, layer.values, torch.tensor([[5]]), layer.positions)
b = sdpa_attention(q, layer.keys.gather(2, ordered), layer.values.gather(2, ordered), torch.tensor([[5]]),
                   layer.positions.sort(dim=-1).values)
torch.testing.assert_close(a, b)  # attention cannot tell the two buffers apart

# %% [markdown]
# A method picks between the two with `selectors.shrink`: `evict` (what `evict_one` does, without
# checking the slot: the method chose it) when exactly one entry must
# go (finding it with `selectors.lowest`, a masked minimum instead of a sort) and `keep` otherwise
# (sorting by position first). Both keep the same tokens; tests/test_policy.py checks it.
#
# ## Rows of their own
#
# A method may let the KV heads of a layer keep different counts (Ada-KV shares a layer's budget out
# over its heads): `keep(idx, counts)` keeps the first `counts[r]` of row r's `idx`, and the places a
# row does not fill become pads (position PAD, never attended to). `evict_one` then moves each row's
# own last entry into the freed slot.

# %%
ragged = LayerCache(1, 2, 2, torch.float32, "cpu")  # batch 1, 2 KV heads, head_dim 2
ragged.append(torch.zeros(1, 2, 5, 2), torch.zeros(1, 2, 5, 2), torch.arange(5)[None])
ragged.keep(torch.tensor([[[0, 2, 4, 1], [0, 1, 3, 4]]]), counts=torch.tensor([[3, 4]]))  # head 0 keeps 3, head 1 keeps 4
assert ragged.held().tolist() == [[3, 4]] and ragged.positions[0, 0, 3] == PAD  # head 0's fourth place: a pad
ragged.evict_one(torch.tensor([[0, 1]]))  # head 0 drops position 0, head 1 position 1
assert ragged.positions[0, 0, :2].tolist() == [4, 2] and ragged.positions[0, 1, :3].tolist() == [0, 4, 3]

# %% [markdown]
# ## The memory formula
#
# Keys and values of every layer, every KV head, every cached token:
#
# $$\text{bytes} = 2 \cdot L \cdot B \cdot H_{kv} \cdot S \cdot D \cdot \text{bytes per element}$$
#
# For SmolLM2-135M ($L = 30$, $H_{kv} = 3$, $D = 64$) in fp32 at its full 8,192-token context
# that is 2 · 30 · 3 · 8192 · 64 · 4 bytes = 360 MiB for one sequence — more than the model's
# own weights (135M parameters in bf16 are 270 MB). `nbytes()` reports exactly this.

# %%
from kvmini.loading import read_config  # noqa: E402
from kvmini.weights import ensure_default_model  # noqa: E402

smol = read_config(ensure_default_model() / "config.json")
L, H_kv, D = smol.num_layers, smol.num_kv_heads, smol.head_dim
S = 1000
cache = KVCache(smol, batch=1, dtype=torch.float32, device="cpu", capacity=S)
zeros = torch.zeros(1, H_kv, S, D)
for layer in cache.layers:  # as if a 1000-token prompt had been prefilled
    layer.append(zeros, zeros, torch.arange(S)[None])
assert cache.nbytes() == 2 * L * 1 * H_kv * S * D * 4
full_context = cache.nbytes() // S * 8192  # the formula is linear in S
print(f"SmolLM2 KV cache: {cache.nbytes() / 2**20:.1f} MiB at {S} tokens, {full_context / 2**20:.0f} MiB at 8192 (fp32)")
assert full_context / 2**20 == 360

# %% [markdown]
# The cache grows linearly with the context, and halves in bf16:

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.notebooks import show  # noqa: E402

lengths = list(range(0, 8193, 512))
per_token = cache.nbytes() // S  # bytes per token over all layers (fp32)
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(lengths, [n * per_token / 2**20 for n in lengths], label="float32")
ax.plot(lengths, [n * per_token / 2 / 2**20 for n in lengths], label="bfloat16")
ax.set_xlabel("tokens in the cache (S)")
ax.set_ylabel("K + V (MiB)")
ax.set_title("SmolLM2-135M: 2 L H_kv D bytes per token")
ax.legend()
show(fig, "01_cache_memory")

# %% [markdown]
# ## Exercises
#
# 1. Change the dtype to `torch.bfloat16` in the last cell: predict `nbytes()` first.
# 2. Llama-3-8B has $L = 32$, $H_{kv} = 8$, $D = 128$. How large is its cache at 8k tokens in bf16?
#    At a batch of 16?
# 3. Show numerically that without RoPE (`theta = 0`) the attention logits do not depend on
#    position at all. Why does that make position information vanish from a decoder?
