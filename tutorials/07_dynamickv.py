# %% [markdown]
# # 7. DynamicKV: layer budgets that are decided as the prefill goes
#
# DynamicKV (Zhou et al. 2024, Sec. 4, Eq. 1–8, Alg. 1) compresses layer by layer *inside* the
# prefill forward: each layer first keeps generously, and every $m$ layers the finished layers are
# re-budgeted against each other. Code: `kvmini/methods/progressive_budgets.py`,
# `kvmini/methods/dynamickv.py`. Open it as an executed notebook: `python -m kvmini.notebooks 07` (into notebooks/).

# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent))  # find kvmini from root or tutorials/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvmini.course.cells import solved  # noqa: E402  (a student copy: skip what needs an exercise not done yet)
from kvmini.methods.registry import make_policy  # noqa: E402
from kvmini.methods.snapkv import window_scores  # noqa: E402

# %% [markdown]
# ## Window scores with pooling (Eq. 1)
#
# As in SnapKV, the last $w_s$ prompt queries (default 8) vote for the keys before them, and the
# votes are smoothed along the keys by average pooling (kernel 7):
#
# $$A_l = \mathrm{pool}\Big(\frac{1}{w_s}\sum_{i > n - w_s} \mathrm{softmax}(q_i K^\top / \sqrt{D})\Big)$$
#
# (kvmini sums instead of averaging; the ranking is the same.)

# %%
window_sums = torch.tensor([[[0.0, 3.0, 0.0, 0.0, 6.0, 0.0, 9.0, 9.0]]])  # 6 prefix keys + a window of 2
held = torch.tensor([[8]])  # the layer scored: one head holding the 8 keys
pooled = window_scores(window_sums, held, window=2, kernel=3, pooling="avg")  # SnapKV's, as DynamicKV reads it
literal = [sum(window_sums[0, 0, i].item() for i in (j - 1, j, j + 1) if 0 <= i < 6) / 3 for j in range(6)]
assert torch.allclose(pooled[0, 0, :6], torch.tensor(literal)) and torch.isinf(pooled[0, 0, 6:]).all()
assert torch.allclose(pooled[0, 0, :6], F.avg_pool1d(window_sums[:, :, :6], 3, 1, 1)[0])

# %% [markdown]
# ## Per-layer top-k (Eq. 2–4)
#
# With a mean budget $w_t$ per layer (the `--budget`, window included), each layer first keeps
#
# $$b_s = \min\big(r_{max}\,(w_t - w_s),\ n - w_s\big)$$
#
# keys with the best $A_l$, plus the window; $r_{max} = 10$ lets a layer keep up to ten times its
# average share until the re-allocation decides.
#
# ## Progressive re-allocation (Eq. 5-8)
#
# Every $m = 4$ layers (Alg. 1 line 24), the scores of all $l$ finished layers are pooled
# together: their $A_l$ over the keys before the window, every KV head of every finished layer in one
# list of $l \cdot H \cdot (n - w_s)$ scores. One top-$k$ is taken over that whole list (heads and layers
# together, not per head nor per layer), $k = (w_t - w_s) \cdot H \cdot l$ (at most the list's length),
# and each hit is counted for the layer it came from: $C_i$, Eq. 5–6 ($H$ the KV heads; a batch's
# sequences are budgeted one by one). Budgets follow the counts,
#
# $$Z_i = \frac{b_s\, C_i}{\max_k C_k}, \qquad r = \frac{\sum_i Z_i}{(w_t - w_s)\, L}, \qquad Z_i \leftarrow Z_i / r,$$
#
# so $\sum Z = (w_t - w_s)\,L$, and every finished layer is trimmed to its best $Z_i$ keys plus the window.
# A layer can only shrink — what it dropped earlier is gone — so kvmini caps $Z_i$ at what the layer
# holds beyond the window and gives the excess to the others by their counts (again, until no cap
# binds; when the caps add up to less than $(w_t - w_s) L$, every layer keeps what it holds). The
# shares are made integers by largest remainder (ties to the earlier layer) and a layer is trimmed
# only when $Z_i$ is below what it holds. For $C = [30, 10, 5, 5]$, $w_t = 12$, $w_s = 4$, $L = 4$:
# $32 \cdot C / 50 = [19.2, 6.4, 3.2, 3.2]$, floors $[19, 6, 3, 3]$ and the last token to the largest
# remainder: $Z = [19, 7, 3, 3]$; with layer 0 holding only 15 beyond its window, $Z_0 = 15$ and the
# other 17 tokens are split $10 : 5 : 5$, $[8.5, 4.25, 4.25] \to [9, 4, 4]$. Alg. 1 (line 24: `if l % m == 0`) and
# the official code re-allocate only every $m$ layers, so when $L$ is not a multiple of $m$ the last
# $L \bmod m$ layers keep $b_s + w_s$; kvmini's option `tail_reallocation=true` re-allocates after
# the last layer too, so that the total is exactly $(w_t - w_s) L + w_s L$.

# %% [markdown]
# ## The resulting budgets on a real prompt

# %%
from kvmini.eval.fidelity import pydoc_text  # noqa: E402
from kvmini.loading import load_model  # noqa: E402
from kvmini.tokenizer import load_tokenizer  # noqa: E402
from kvmini.weights import ensure_default_model  # noqa: E402

folder = ensure_default_model()
model = load_model(folder, "cpu", "float32")
ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[:512]])
w_t, w_s, n = 64, 8, ids.shape[1]
b_s = min(10 * (w_t - w_s), n - w_s)  # Eq. 2: 504
for tail in (False, True) if solved("progressive_budgets") else ():
    cache, policy = model.new_cache(), make_policy("dynamickv", w_t, tail_reallocation=tail)
    policy.start(n)  # where the prompt ends (kvmini.generate.prefill does this)
    with torch.no_grad():
        model(ids, cache, policy)
    lengths = cache.lengths()
    print(f"tail_reallocation={tail}: kept per layer {lengths}, total {sum(lengths)}")
    if tail:  # re-allocated after the last layer too: exactly (w_t - w_s) L + w_s L
        assert sum(lengths) == w_t * 30
    else:  # Alg. 1: the last re-allocation, after layer 27 (counted from 0), shares (w_t - w_s) L among layers
        # 0-27; layers 28 and 29 keep b_s + w_s
        assert lengths[-2:] == [b_s + w_s] * 2 and sum(lengths[:-2]) == (w_t - w_s) * 30 + w_s * 28

# %% [markdown]
# The budgets as the prefill goes: after each layer, what every layer may keep. A layer's line starts
# when it is reached, at b_s + w_s, unless a re-allocation runs right after that layer (every m = 4
# layers): that one already counts it, so its line starts lower. It drops at each later re-allocation.

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.notebooks import show  # noqa: E402

if solved("progressive_budgets"):
    history = []
    policy = make_policy("dynamickv", 64)
    policy.start(n)
    with torch.no_grad():
        model(ids, model.new_cache(), policy, on_layer=lambda i: history.append(list(policy.budgets)))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for layer in range(0, 30, 3):
        ax.plot(range(layer, 30), [history[i][layer] for i in range(layer, 30)], label=f"layer {layer}")
    ax.set_xlabel("after layer")
    ax.set_ylabel("budget (tokens)")
    ax.set_yscale("log")
    ax.legend(ncol=2, fontsize=7)
    show(fig, "07_progressive_budgets")

# %% [markdown]
# ## What the authors' code does differently
#
# The official code (DreamMr/DynamicKV), like Alg. 1, re-allocates only when the layer index is a
# multiple of $m$; with $L = 30$ and $m = 4$ the last two layers keep their first budget $b_s + w_s$.
# It floors every share with `int()`, gives the remainder to the last finished layer and caps a
# layer at $n - w_s$ rather than at what it holds (`rounding=floor`, the `official` variant).
# Alg. 1 itself floors too, but normalises the counts by the largest one and hands out no remainder
# (`rounding=alg1`): for $C = [30, 10]$, $b_s = 40$ and $(w_t - w_s) L = 32$ it gives $[24, 7]$
# where the authors' code gives $[24, 8]$.

# %%
for variant in ("paper", "official") if solved("progressive_budgets") else ():
    p = make_policy("dynamickv", 0.2, variant=variant)
    cache = model.new_cache()
    p.start(n)
    with torch.no_grad():
        model(ids, cache, p)
    print(f"{variant:<8} last layers keep {cache.lengths()[-3:]}, total {sum(cache.lengths())}")

# %% [markdown]
# ## Exercises
#
# 1. *(assignment: `progressive_budgets`)* Implement Eq. 5–8, the region of `reallocate`
#    (`kvmini/methods/progressive_budgets.py`). The function returns two names the region must set:
#    `C` (Eq. 6's counts per layer) and `Z` (Eq. 7-8's budgets beyond the window, one per finished
#    layer, capped at what each holds beyond the window, integers summing to
#    $\min((w_t - w_s) L, \sum$ that$)$, as in "Progressive re-allocation" above: one top-$k$ over every
#    head of every finished layer). `A_finished` holds each finished layer's scores $(1, H, n - w_s)$ (after a
#    next prompt the layers hold different counts: a shorter one is filled with $-\infty$ up to $n - w_s$, a
#    key no top-$k$ may count), `held` what each holds (its window included), `w_t` the mean budget and `w` the
#    window $w_s$. Check it with `python -m kvmini.course check progressive_budgets`: `reallocate` alone by hand
#    (Eq. 5-6: the top $k$ over two KV heads of two layers, one holding a key fewer; Eq. 7-8: the total over
#    all $L$ layers, a cap without the window, the excess handed on), then the whole method against
#    a literal Alg. 1 (its Eq. 7-8 split is kvmini's: capped, rounded by largest remainder) on random models (a prompt and three decode steps; kept tokens and logits) for $L$ from 3 to 5 and $m$
#    from 2 to 4, $L \bmod m \ne 0$ included, with and without `tail_reallocation`, $r_{max}$ 2 to 10
#    (so that caps bind), and the authors' rounding (`rounding=floor`) against their code's steps.
# 2. Set `--interval 30` (one re-allocation at the end) and `--interval 1`: which keeps more fidelity?
# 3. What does `--r-max 1` reduce DynamicKV to?
