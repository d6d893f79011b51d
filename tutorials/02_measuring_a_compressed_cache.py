# %% [markdown]
# # 2. Measuring what a compressed cache keeps
#
# Every method in kvmini is one class in its own module (`kvmini/methods/`, docs/design.md, "The method
# form") that answers the same questions in its own code: how important is each cached token (its
# score), how many tokens may each layer keep (its budgets), which ones stay and what happens to the
# rest (dropped or merged), and when (after the prompt, layer by layer, or every step). This tutorial
# builds up what the baselines need — attention statistics, budgets, StreamingLLM, H2O, SnapKV,
# PyramidKV — proves that
# evicting a token is the same as masking it, and defines the fidelity metrics used to compare
# methods. Open it as an executed notebook: `python -m kvmini.notebooks 02` (into notebooks/).

# %%
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent))  # find kvmini from root or tutorials/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvmini.attention import Statistic, attend  # noqa: E402
from kvmini.budget import resolve_budget  # noqa: E402
from kvmini.config import ModelConfig  # noqa: E402
from kvmini.methods.pyramidkv import pyramid  # noqa: E402
from kvmini.methods.registry import make_policy  # noqa: E402
from kvmini.methods.selectors import keep_top  # noqa: E402
from kvmini.model import Transformer  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## Attention statistics, per KV head, without an $n \times n$ matrix
#
# With $A = \mathrm{softmax}(QK^\top/\sqrt{D} + \text{mask})$ for the $T$ new queries, the methods ask for
#
# $$\text{column sums } s_j = \sum_i A_{ij}, \qquad \text{window sums } \sum_{i > T - w} A_{ij}, \qquad \text{last row } A_{T j}.$$
#
# Each is a sum over some of the queries (all, the last $w$, the last one) of the attention rows,
# a `Statistic(last, f, reduce)` (`kvmini.attention`); a method names the ones it reads in its `wants`.
# `attend` computes them from the attention rows it writes out for the output (64 queries at a time,
# `in_chunks`), and combines the $g$ query heads of a KV head (mean by default). The check uses the full
# matrix, which is fine at this size.

# %%
B, H, H_kv, T, D = 1, 4, 2, 10, 8
q, k, v = torch.randn(B, H, T, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
pos = torch.arange(T)[None]
out, stats = attend(q, k, v, pos, pos.expand(B, H_kv, T)[:, :, :],
                    {"column_sums": Statistic(), "window_sums": Statistic(last=3), "last_row": Statistic(last=1)})
A = F.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(D)
              + torch.full((T, T), float("-inf")).triu(1), dim=-1)  # (B, H, T, T), the full matrix
A_kv = A.view(B, H_kv, 2, T, T).mean(2)  # mean over the query heads of each KV head
assert torch.allclose(stats["column_sums"], A_kv.sum(2), atol=1e-6)
assert torch.allclose(stats["window_sums"], A_kv[:, :, -3:].sum(2), atol=1e-6)
assert torch.allclose(stats["last_row"], A_kv[:, :, -1], atol=1e-6)

# %% [markdown]
# ## Budgets
#
# One convention everywhere: `--budget x` with $0 < x \le 1$ is a ratio of the prompt length
# (D2O's $\rho$), $x > 1$ an average number of tokens per layer (the "KV size" of
# PyramidKV/DynamicKV/WeightedKV). Sinks and recent windows count inside the budget.

# %%
assert resolve_budget(0.2, 2048) == 410
assert resolve_budget(128, 2048) == 128

# %% [markdown]
# ## Selection: sinks, a recent window, and the best of the rest
#
# All baselines share one selector: keep the first $T$ entries (attention sinks), the last $M$
# (recent window), and the top $b - T - M$ scores in between.
#
# * **StreamingLLM** (Xiao et al. 2023): $T = 4$, $M = b - 4$ — no scores at all.
# * **H2O** (Zhang et al. 2023): $s_j$ = attention accumulated over every query so far; $M = b/2$.
# * **TOVA** (Oren et al. 2024): $s_j$ = the latest query's row; no protected tokens.
# * **SnapKV** (Li et al. 2024): $s_j$ = window sums of the last $w = 32$ prompt queries, pooled along
#   the keys, $M = w$; once, after the prompt.

# %%
score = torch.tensor([5.0, 1, 9, 3, 7, 2, 8, 6]).view(1, 1, 8)
assert keep_top(score, 4, sinks=1, recent=1).tolist() == [[[0, 2, 6, 7]]]  # sink 0, top 9 and 8, recent 7
assert keep_top(score, 4, sinks=4, recent=0).tolist() == [[[0, 1, 2, 3]]]  # StreamingLLM with b = T

# %% [markdown]
# **PyramidKV** (Cai et al. 2024) keeps SnapKV's scores but gives lower layers more: beyond the
# window, layer $l$ of $L$ gets a share falling linearly from $k_{max}$ to $k_{min} = (b - w)/\beta$,
# with $k_{max} = 2(b - w) - k_{min}$, so the total equals the uniform $L \cdot b$.

# %%
budgets = pyramid(128, 30, window=32, beta=20)
assert sum(budgets) == 30 * 128 and budgets[0] > budgets[-1]
print("PyramidKV budgets, layers 0, 10, 20, 29:", budgets[0], budgets[10], budgets[20], budgets[29])

# %% [markdown]
# ## Evicting a token is masking it
#
# A layer attends over its full cache first; only later layers and later steps see the
# compressed cache. So a run that physically drops tokens must give the same logits as a run that
# keeps every token and masks the dropped ones with $-\infty$. Here for one attention call: the
# cache keeps positions {0, 3, 4, 7} of 8; the masked version sees all 8.

# %%
kept = torch.tensor([0, 3, 4, 7])
q1 = torch.randn(1, H, 1, D)  # the next query, at position 8
k8, v8 = torch.randn(1, H_kv, 8, D), torch.randn(1, H_kv, 8, D)
evicted_out, _ = attend(q1, k8[:, :, kept], v8[:, :, kept], torch.tensor([[8]]), kept.expand(1, H_kv, 4), {})
mask = torch.full((8,), float("-inf"))
mask[kept] = 0
masked_out = F.scaled_dot_product_attention(q1, k8.repeat_interleave(2, 1), v8.repeat_interleave(2, 1),
                                            attn_mask=mask.view(1, 1, 1, 8))
assert torch.allclose(evicted_out, masked_out, atol=1e-6)

# %% [markdown]
# The test suite checks the same equivalence for whole models, every baseline and several decode
# steps (`tests/test_methods_reference.py`).
#
# ## A policy in action
#
# `make_policy(name, budget, **options)` builds a fresh policy; the model calls it after each
# layer's attention. On a small random model, H2O with a budget of 8 keeps every layer at 8
# entries through prefill and decode:

# %%
config = ModelConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
model = Transformer(config).eval()
policy = make_policy("h2o", 8)
cache = model.new_cache()
ids = torch.randint(0, 50, (1, 20))
policy.start(20, 25)
with torch.no_grad():
    model(ids, cache, policy)
    for t in range(5):
        model(torch.tensor([[t]]), cache, policy)
        assert cache.lengths() == [8, 8, 8]
print("H2O kept positions, layer 0, KV head 0:", cache[0].positions[0, 0].tolist())

# %% [markdown]
# ## Fidelity metrics
#
# `python -m kvmini.eval.fidelity` compresses a real prompt of $N$ tokens, teacher-forces the next
# $K$ tokens, and compares each next-token distribution $p_\text{method}$ with the full cache's $p$:
#
# $$\text{PPL} = \exp\Big(-\tfrac{1}{K}\sum_t \log p_\text{method}(x_t)\Big), \quad
#   \text{KL} = \tfrac{1}{K}\sum_t \sum_v p(v)\log\frac{p(v)}{p_\text{method}(v)}, \quad
#   \text{top-1} = \tfrac{1}{K}\sum_t [\arg\max p_\text{method} = \arg\max p].$$

# %%
from kvmini.eval.fidelity import compare  # noqa: E402

full = torch.tensor([[0.0, 0.0]])  # p = (1/2, 1/2)
half = torch.tensor([[math.log(3), 0.0]])  # q = (3/4, 1/4)
m = compare(half, full, torch.tensor([0]))
assert abs(m["kl"] - 0.5 * math.log(4 / 3)) < 1e-6 and abs(m["ppl"] - 4 / 3) < 1e-5 and m["top1"] == 1.0

# %% [markdown]
# On the default model (a short run here; results/full/summary.md has N = 2048, K = 256 over five prompts):

# %%
from kvmini.eval.fidelity import pydoc_text, run  # noqa: E402
from kvmini.loading import load_model  # noqa: E402
from kvmini.tokenizer import load_tokenizer  # noqa: E402
from kvmini.weights import ensure_default_model  # noqa: E402

folder = ensure_default_model()
smol = load_model(folder, "cpu", "float32")
text_ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[:288]])
rows = run(smol, text_ids, 256, ["streaming_llm", "h2o", "snapkv"], [64], log=lambda line: None)
for r in rows:
    print(f"{r['method']:<14} kept {r['kept']:>5.0f}  ppl {r['ppl']:6.2f}  KL {r['kl']:.3f}  top-1 {r['top1']:.2f}")
assert rows[0]["kl"] == 0 and all(r["kl"] > 0 for r in rows[1:])

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.notebooks import show  # noqa: E402

fig, ax = plt.subplots(figsize=(5, 3))
ax.bar([r["method"] for r in rows[1:]], [r["kl"] for r in rows[1:]])
ax.set_ylabel("KL(full ‖ method)")
ax.set_title("64 tokens per layer of a 256-token prompt")
show(fig, "02_fidelity")

# %% [markdown]
# ## Exercises
#
# 1. Run H2O with `--recent 0` (no recent window) and with the default `budget // 2`. Predict which
#    has the lower KL, then check with `python -m kvmini.eval.fidelity --methods h2o "h2o[recent=0]"`.
# 2. Write a new method: SnapKV's scores with StreamingLLM's 4 sinks (a subclass of
#    `kvmini.methods.snapkv.SnapKV` whose `select` calls `shrink(lc, score, b, 4, self.window, self.newest)`).
# 3. Why does TOVA, which keeps no recent window, still never evict the token it has just seen
#    in most steps? Look at the last row of attention.
