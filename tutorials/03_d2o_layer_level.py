# %% [markdown]
# # 3. D2O, layer level: how much cache does each layer get?
#
# D2O (Wan et al. 2024, Sec. 4) observes that shallow layers spread their attention over many
# tokens while deep layers concentrate it on a few, and gives each layer a budget accordingly.
# This tutorial follows Eq. 4–5 with `kvmini/methods/variance_softmax.py`.
# Open it as an executed notebook: `python -m kvmini.notebooks 03` (into notebooks/).

# %%
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent))  # find kvmini from root or tutorials/

import torch  # noqa: E402

from kvmini.course.cells import solved  # noqa: E402  (a student copy: skip what needs an exercise not done yet)
from kvmini.attention import Statistic  # noqa: E402
from kvmini.methods.allocators import proportional  # noqa: E402
from kvmini.methods.variance_softmax import allocate, attention_variance, layer_weights, official_variance, split  # noqa: E402

# %% [markdown]
# ## Attention density per layer (Eq. 4)
#
# For the prompt's attention matrix $A^{(l)}$ of layer $l$, the column sum
# $s_j = \sum_i A^{(l)}_{ij}$ is the attention key $j$ received from all queries. If a layer
# attends evenly, all $s_j$ are similar; if it concentrates on a few tokens, a few $s_j$ are large.
# D2O's Eq. 4 measures this with the variance of the layer's column sums over the key positions; it
# has no heads (the per-head variance is App. A.9's Eq. 20). kvmini takes the variance per head and
# averages it over the heads, its own choice (the module says so):
#
# $$F_v^{(l)} = \frac{1}{H}\sum_h \mathrm{Var}_j\big(s^{(l,h)}_j\big)$$
#
# `attention_variance` takes the column sums that the attention pass returns per KV head
# (`wants = {"column_sums": Statistic()}`), shape $(B, H_{kv}, n)$.

# %%
even = torch.full((1, 2, 6), 1.0)  # every key got the same attention: variance 0
peaked = torch.tensor([[[5.0, 0.2, 0.2, 0.2, 0.2, 0.2], [3.0, 1.0, 0.5, 0.5, 0.5, 0.5]]])
literal = sum(sum((x - sum(row) / 6) ** 2 for x in row) / 6 for row in peaked[0].tolist()) / 2
print("column sums asked for with", Statistic())
if solved("variance_softmax"):  # Eq. 4 is part of exercise 1
    assert attention_variance(even) == 0
    assert abs(attention_variance(peaked) - literal) < 1e-6
    print("F_v:", round(attention_variance(peaked), 4))

# %% [markdown]
# ## Inverse variance softmax (Eq. 5)
#
# Layers with *low* variance (dense attention) need more cache:
#
# $$\alpha_l = \mathrm{softmax}(-F_v)_l \cdot L \cdot \rho, \qquad S_l = \alpha_l \cdot n,
#   \qquad \sum_l S_l = L \rho n.$$
#
# As printed, the softmax is taken over the layers of the *raw* variances: $w_l = e^{-F_v^{(l)}} /
# \sum_k e^{-F_v^{(k)}}$, shares that sum to 1 (`layer_weights(F_v, "paper")`, the `paper` allocation;
# exercise 1). For $F_v = [1, 2, 3]$ that is $[0.665, 0.245, 0.090]$; for raw variances of a long
# prompt, $[400, 900, 1300]$, it is one-hot: $e^{-500}$ is 0 in any float.

# %%
F_v = [1.0, 2.0, 3.0]
if solved("variance_softmax"):
    printed = layer_weights(F_v, "paper")
    assert [round(w, 3) for w in printed] == [0.665, 0.245, 0.09] and abs(sum(printed) - 1) < 1e-12
    long_prompt = layer_weights([400.0, 900.0, 1300.0], "paper")  # raw variances at a long prompt
    print("Eq. 5 as printed at a long prompt:", [round(w, 4) for w in long_prompt])
    assert long_prompt[0] > 0.9999  # one-hot

# %% [markdown]
# **The standardization decision.** Column sums add up to the number of queries, so raw variances
# grow with the prompt length $n$; at $n$ = 2048 they differ between layers by hundreds, and
# $\mathrm{softmax}(-F_v)$ puts the whole budget on a single layer. Two readings avoid that. The
# `zscore` allocation (kvmini's own, an option: `--allocation zscore`, a `Deviation:` in the module)
# z-scores $F_v$ across layers first, with a temperature $\tau$:
#
# $$w_l = \mathrm{softmax}\Big(-\frac{F_v - \bar F_v}{\sigma(F_v)\,\tau}\Big)_l .$$

# %%
z = [(f - 2) / math.sqrt(2 / 3) for f in F_v]
by_hand = [math.exp(-x) / sum(math.exp(-y) for y in z) for x in z]
assert all(abs(a - b) < 1e-9 for a, b in zip(layer_weights(F_v), by_hand))  # zscore is the default `how`
print("standardized:", [round(x, 3) for x in layer_weights([400, 900, 1300])])

# %% [markdown]
# **The case $\sigma = 0$.** When every layer has the same variance (a tiny model, a degenerate
# prompt, a test with equal inputs), the z-score divides 0 by 0. A straightforward implementation
# returns NaN budgets; the right answer is the limit, equal shares for all layers, and
# `layer_weights` checks for it.

# %%
same = [7.0, 7.0, 7.0]
naive = torch.softmax(-(torch.tensor(same) - 7.0) / torch.tensor(same).std(correction=0), 0)
print("naive z-score softmax:", naive.tolist())
assert torch.isnan(naive).all()
print("layer_weights:", layer_weights(same))
assert layer_weights(same) == [1 / 3] * 3

# %% [markdown]
# Budgets are then $S_l = \mathrm{clamp}(\lambda w_l, \text{low}, n)$ with the one $\lambda$ that keeps
# the total at $L\rho n$: a layer that would exceed the prompt is capped and its excess goes to
# the others by weight; a layer below the floor (sinks + 4) is lifted. Integers are rounded so the
# total is exact.

# %%
L, n, rho = 3, 100, 0.5
assert proportional([0.9, 0.05, 0.05], 300, 60, [200] * 3) == [180, 60, 60]
budgets = split(F_v, "zscore", round(rho * n), n, low=8)  # (F_v, allocation, b = rho * n per layer, n)
print("S_l =", budgets)
assert sum(budgets) == L * round(rho * n) and budgets[0] == n  # layer 0 wanted 109 and was capped at n

# %% [markdown]
# ## The default: the authors' allocation (`official`)
#
# What kvmini runs unless told otherwise (`d2o` with no options) is the second reading, the one in
# the authors' code (AIoT-MLSys-Lab/D2O). Per layer it takes each query head's *unbiased* variance
# $\sigma^2_{l,h}$ of the column sums, normalizes them min-max across the layer's $H$ heads and averages:
#
# $$v_l = \frac{1}{H}\sum_h \frac{\sigma^2_{l,h} - \min_{h'} \sigma^2_{l,h'}}{\max_{h'} \sigma^2_{l,h'} - \min_{h'} \sigma^2_{l,h'} + 10^{-6}}
#   \in [0, 1],$$
#
# so $v_l$ says how unequal the layer's heads are, not how large its variance is, and it never grows
# with $n$. Then each layer's budget is a clamped ratio of what it holds, $n'$ (the prompt, or the
# prompt and the first new token when the authors' code compresses at the first decode step):
#
# $$x_l = n' \cdot \mathrm{clamp}\big(\mathrm{softmax}(-v)_l \, L \rho,\ 0.01,\ 1\big), \qquad
#   S_l = \Big\lfloor x_l \tfrac{N}{N+M} \Big\rfloor + \Big\lfloor x_l \tfrac{M}{N+M} \Big\rfloor,$$
#
# the heavy-hitter and recent parts ($N : M$, 1 : 1 by default) floored separately. Since $v_l \in [0, 1]$,
# the softmax weights are within a factor $e$ of each other; the total is about, not exactly, $L \rho n'$.
# Below, both steps by hand on toy numbers against `official_variance` and `allocate`.

# %%
def unbiased_var(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


toy = [[[3.0, 1.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [4.0, 1.0, 1.0, 0.0]],  # layer 0: column sums of 3 heads, n = 4
       [[1.5, 1.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0]]]  # layer 1
v = []
for heads in toy:
    var = [unbiased_var(h) for h in heads]
    v.append(sum((x - min(var)) / (max(var) - min(var) + 1e-6) for x in var) / len(var))
assert all(abs(official_variance(torch.tensor([heads], dtype=torch.float64)) - v_l) < 1e-9 for heads, v_l in zip(toy, v))
print("v_l:", [round(x, 4) for x in v])

v, n_held, L, b = [0.1, 0.9, 0.5], 100, 3, 20  # three layers, a 100-token prompt, 20 tokens per layer (rho = 0.2)
weights = [math.exp(-x) / sum(math.exp(-y) for y in v) for x in v]
x = [n_held * min(max(w * L * b / n_held, 0.01), 1.0) for w in weights]
by_hand = [int(x_l / 2) + int(x_l / 2) for x_l in x]  # N : M = 1 : 1
assert allocate(v, "official", b, n_held, n_held, protected=()) == by_hand
print("S_l:", by_hand, "total", sum(by_hand), "of L * b =", L * b)

# %% [markdown]
# ## The Table 4 alternatives
#
# D2O's ablation compares the softmax with a uniform split and with the reciprocal of the
# variance, $w_l = (1/F_v^{(l)}) / \sum_k 1/F_v^{(k)}$. Both are options (`--allocation`).

# %%
assert layer_weights(F_v, "uniform") == [1 / 3] * 3
if solved("reciprocal_allocation"):
    assert all(abs(a - b) < 1e-12 for a, b in zip(layer_weights(F_v, "reciprocal"), [6 / 11, 3 / 11, 2 / 11]))

# %% [markdown]
# ## On the real model
#
# `python run.py --method d2o --budget 0.2 --prompt doc.txt` prints the per-layer allocation of what
# `d2o` runs by default, the `official` variant: the authors' min-max allocation (section above), which on
# this section's 512-token prompt keeps every layer between 81 and 125 tokens (the last cell prints it),
# and never compresses layers 0, 1 and 29. The standardized softmax of the `zscore` allocation (kvmini's
# reading of Eq. 5, run below as `make_policy("d2o", 0.2, variant="paper", allocation="zscore")`, on the
# command line `--method "d2o[variant=paper,allocation=zscore]"`) is another matter: on SmolLM2 it gives
# the first layers several times the mean and starves some deep layers (the cells below print and check
# it); docs/methods.md's D2O ablations show that this costs fidelity on this small model, where uniform
# budgets do much better. The token-level merge (tutorial 4) is turned off here: it does not change the
# budgets.

# %%
from kvmini.loading import load_model  # noqa: E402
from kvmini.methods.registry import make_policy  # noqa: E402
from kvmini.eval.fidelity import pydoc_text  # noqa: E402
from kvmini.tokenizer import load_tokenizer  # noqa: E402
from kvmini.weights import ensure_default_model  # noqa: E402

folder = ensure_default_model()
model = load_model(folder, "cpu", "float32")
ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[:512]])

# %%
measured = solved("variance_softmax")  # F_v is Eq. 4
if measured:
    policy = make_policy("d2o", 0.2, variant="paper", allocation="zscore", merge="off")  # kvmini's reading of Eq. 5
    policy.start(512)  # the policy is told where the prompt ends (kvmini.generate.prefill does this)
    with torch.no_grad():
        model(ids, model.new_cache(), policy)
    print("F_v per layer:", [round(v, 2) for v, in policy.F_v.values()])  # Eq. 4 on the prompt, one per sequence
    print("S_l per layer:", policy.budgets)
    assert sum(policy.budgets) == 30 * round(0.2 * 512)
    assert max(policy.budgets[:3]) > 2 * 102 and min(policy.budgets) < 102 / 2  # early layers rich, some starved

# %% [markdown]
# Shallow layers spread their attention, deep ones concentrate it: the attention maps of the first
# and the last layer (mean over heads, averaged into blocks), and F_v with the budgets it gives.

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.eval.layers import density_map  # noqa: E402
from kvmini.notebooks import show  # noqa: E402

fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
for ax, layer in zip(axes[:2], (0, 29)):
    im = ax.imshow(density_map(model, ids, layer, bins=32), cmap="magma", norm="log")
    ax.set_title(f"layer {layer}: attention (blocks of 16 tokens)")
    ax.set_xlabel("key block")
    ax.set_ylabel("query block")
    fig.colorbar(im, ax=ax, shrink=0.8)
if measured:  # the F_v and budgets of the cell above
    axes[2].bar(range(30), [v for v, in policy.F_v.values()], color="tab:gray", label="F_v (left)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("F_v")
    right = axes[2].twinx()
    right.plot(range(30), policy.budgets, "o-", color="tab:red", markersize=3, label="S_l, zscore (right)")
    right.set_ylabel("S_l (tokens)")
    axes[2].set_title("variance and budget per layer")
fig.tight_layout()
show(fig, "03_density_and_budgets")

# %% [markdown]
# ## The four allocations on this prompt
#
# Eq. 5 as printed takes the softmax of the *raw* variances. On this model they differ between
# layers by far more than 1 (the figure above), so $e^{-F_v}$ is one-hot in any float: in the run
# below, the `paper` allocation gives the layers of lowest variance the whole prompt (512 tokens),
# one after another, until what is left cannot fill another; the other layers, whose weights are
# all 0, share the rest equally (above the floor of 8). The authors' allocation (`official`, the
# default, section above) keeps every layer within about a factor of 1.5 of the mean; the authors'
# code also never compresses layers 0, 1 and $L-1$ (the `official` variant's protected layers).
# The `zscore` reading sits in between. The committed measurements (docs/methods.md,
# the D2O table: KL to the full cache on one 1,024-token prompt at 20%, lower is better) put the
# paper's allocation and the zscore reading far behind the official allocation and uniform budgets
# (all with the paper's merge), and the whole `official` variant ahead of them all
# (tests/test_docs.py holds this sentence to the committed numbers).

# %%
for how in ("paper", "zscore", "official", "uniform") if solved("variance_softmax") else ("official",):  # Eq. 4: exercise 1
    p = make_policy("d2o", 0.2, variant="paper", allocation=how, merge="off")
    cache = model.new_cache()
    p.start(512)
    with torch.no_grad():
        model(ids, cache, p)
    S = p.budgets
    print(f"{how:<9} S_l from {min(S)} to {max(S)}: {S}")
    if how == "paper":  # the lowest-variance layers fill up to 512; the others share what is left equally
        full = S.count(512)
        assert full >= 1 and set(S) == {512, (30 * round(0.2 * 512) - 512 * full) // (30 - full)}
    if how == "official":  # within a factor e of each other's weight: no layer starved, none given the prompt
        assert min(S) > 0.5 * round(0.2 * 512) and max(S) < 2 * round(0.2 * 512)

# %% [markdown]
# ## Exercises
#
# 1. *(assignment: `variance_softmax`)* Implement Eq. 4 and Eq. 5 as printed in
#    `kvmini/methods/variance_softmax.py`: `attention_variance`, the variance of each head's column sums
#    over the key positions (divided by $n$, or $n$ minus `correction`), averaged over the heads and the
#    batch, as a float; and the `how == "paper"` branch of `layer_weights`: the shares
#    $\mathrm{softmax}(-F_v)$ over the layers, as a list of floats summing to 1. What the tests check:
#    Eq. 4 on the two heads of this tutorial's example (and with `correction=1`, on even attention, on a
#    batch of two), each failure naming `attention_variance`; $F_v = [1, 2, 3]$ gives
#    $e^{-f} / \sum e^{-f}$ exactly (to 1e-6), on the raw variances (no standardizing; the
#    `temperature` argument is not used by this branch); `split(F_v, "paper", b, n)`
#    turns the shares into $S_l$, a split of $L b$ (unclamped: $[20, 7, 3]$ for $F_v = [0, 1, 2]$,
#    $b = 10$); and the `paper` variant on a random 4-layer model budgets each layer by Eq. 5 on
#    its measured $F_v$ (Eq. 4), clamped to [8, n]. Check it with
#    `python -m kvmini.course check variance_softmax`.
# 2. *(assignment: `reciprocal_allocation`)* Implement the reciprocal-of-variance allocator, the
#    `how == "reciprocal"` branch of `layer_weights` in the same file: shares summing to 1 (the checks:
#    $[1, 2, 3] \to [6/11, 3/11, 2/11]$; $[0.5, 2, 8] \to [16/21, 4/21, 1/21]$, which tells $1/F$ from the
#    reciprocal of a rank; a zero variance takes the whole share, and no share is NaN). Check it with
#    `python -m kvmini.course check reciprocal_allocation`.
# 3. Raise `--softmax-temperature` to 4 and predict how the fidelity of kvmini's `zscore` reading
#    changes; check with `python -m kvmini.eval.fidelity --budgets 0.2 --methods
#    "d2o[variant=paper,allocation=zscore]" "d2o[variant=paper,allocation=zscore,softmax_temperature=4]"`.
