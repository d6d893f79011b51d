# %% [markdown]
# # 6. WeightedKV: drop the key, keep the value
#
# WeightedKV (Yuan et al. 2025, Sec. III-B, Alg. 1) keeps a fixed number $m$ of cache entries.
# When one too many arrive, the least attended token loses its *key*, but its *value* is not lost:
# it is blended into its right neighbour's value. Code: `kvmini/methods/convex_value_merge.py`.
# Open it as an executed notebook: `python -m kvmini.notebooks 06` (into notebooks/).

# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent))  # find kvmini from root or tutorials/

import torch  # noqa: E402

from kvmini.course.cells import solved  # noqa: E402  (a student copy: skip what needs an exercise not done yet)
from kvmini.cache import LayerCache  # noqa: E402
from kvmini.methods.weightedkv import attended  # noqa: E402
from kvmini.methods.convex_value_merge import convex_value_merge  # noqa: E402
from kvmini.methods.registry import make_policy  # noqa: E402

# %% [markdown]
# ## The ideal merge and its convex approximation (Sec. III-B)
#
# Write $s_i = e^{q_t^\top k_i / \sqrt{d}}$ and $Z = \sum_{i=1}^t s_i$. Attention outputs
# $o = \frac{1}{Z}\sum_i s_i v_i$. Drop key $k_1$ and replace $v_2$ by some $\tilde v$: the output is
# unchanged for this query exactly when
#
# $$\tilde v = \Big(1 - \frac{s_1}{Z}\Big)\Big(\frac{s_1}{s_2} v_1 + v_2\Big) - \frac{s_1}{s_2 Z}\sum_{i \ge 3} s_i v_i,$$
#
# the *ideal merge*. It depends on the query and on every other value, so WeightedKV drops the last
# term and renormalizes, which leaves a convex combination of the two neighbours,
#
# $$\tilde v \approx \frac{s_1}{s_1 + s_2} v_1 + \frac{s_2}{s_1 + s_2} v_2,$$
#
# and, since future queries are unknown, uses each token's *average* attention so far,
# $\bar a = a / n$ (attention received, divided by the number of queries that saw it), as its weight:
#
# $$v_{j+1} \leftarrow \frac{\bar a_j v_j + \bar a_{j+1} v_{j+1}}{\bar a_j + \bar a_{j+1}}.$$
#
# Below: the ideal $\tilde v$ reproduces the output exactly; the convex one does not, and its error
# is small when the dropped token had little attention (`s_1` small), which is why the least attended
# token is the one merged.

# %%
torch.manual_seed(0)
t, d = 6, 4
q, K, V = torch.randn(d), torch.randn(t, d), torch.randn(t, d)
s = (K @ q / d**0.5).exp()  # (t,)
Z = s.sum()
out = (s[:, None] * V).sum(0) / Z  # the full attention output
ideal = (1 - s[0] / Z) * (s[0] / s[1] * V[0] + V[1]) - s[0] / (s[1] * Z) * (s[2:, None] * V[2:]).sum(0)
convex = (s[0] * V[0] + s[1] * V[1]) / (s[0] + s[1])


def output_after(v_tilde):  # attention over k_2..k_t with v_2 replaced
    return (s[1] * v_tilde + (s[2:, None] * V[2:]).sum(0)) / (Z - s[0])


assert torch.allclose(output_after(ideal), out, atol=1e-6)  # exact
err = {}
for scale in (3.0, 1.0, 0.1):  # make the dropped token less and less attended
    K[0] = scale * q / q.norm()  # k_1 along q: its attention grows with `scale`
    s = (K @ q / d**0.5).exp()
    Z = s.sum()
    out = (s[:, None] * V).sum(0) / Z
    convex = (s[0] * V[0] + s[1] * V[1]) / (s[0] + s[1])
    err[scale] = (output_after(convex) - out).norm().item()
    print(f"dropped token's attention {s[0] / Z:.3f}: convex-merge output error {err[scale]:.4f}")
assert err[0.1] < err[3.0]  # the less the dropped token was attended, the better the approximation

# %% [markdown]
# ## Algorithm 1 step by step
#
# ```
# a = [a, 0] + A_t ;  n = [n, 0] + 1               (lines 4-5: running sums, per KV head)
# if len(V) > m:                                   (line 6)
#     abar = a / n                                 (line 7)
#     j = argmin abar  (never the newest token)    (line 8)
#     V[j+1] = (abar_j V[j] + abar_{j+1} V[j+1]) / (abar_j + abar_{j+1})   (line 9)
#     delete K[j], V[j], a[j], n[j]                (line 10)
# ```
#
# For a prompt, kvmini runs this after each chunk of the prefill (default: the capacity $m$, at
# least 64 tokens; `--chunk-size 1` is the algorithm token by token). Within a chunk the deleted
# tokens are those Alg. 1 would delete (the lowest $\bar a$, which no merge changes); by default a
# run of consecutive deleted tokens merges into the kept token after it in one convex step
# (`merge_runs`), which is line 9 exactly for a run of one. Then $n$ counts the chunk's queries
# that can see each token (the causal mask):

# %%
lc = LayerCache(1, 1, 2, torch.float32, "cpu")
for t in [1, 3, 5, 6, 7]:  # cached positions; a chunk of 3 queries at positions 5, 6, 7 just arrived
    lc.append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), torch.tensor([[t]]))
lc.declare("a", "n")  # the buffers WeightedKV keeps in the cache (its `aux`)
attended(lc, torch.tensor([[[0.5, 1.0, 1.5, 0.4, 0.1]]]), start=5, T=3)  # Alg. 1 lines 4-5, as WeightedKV runs them
assert lc.aux("n").tolist() == [[[3, 3, 3, 2, 1]]]

# %% [markdown]
# ## The Fig. 3 toy example, reproduced
#
# Cache size $m = 4$, values $v_t = e_t$ (one-hot, so a merged value shows its weights directly).
# At step 5 the scores are $\bar a = (0.3, 0.1, 0.5, 0.4, 0.6)$: $v_2$ has the lowest and merges into
# $v_3$ as $\frac{0.1 v_2 + 0.5 v_3}{0.6} = \frac{v_2}{6} + \frac{5 v_3}{6}$, exactly as in the paper.
# The paper's figure continues to step 8 and ends with $v_3, v_6, v_7, v_8$, where $v_3$ and $v_6$ each
# carry three values; its later scores are only in the figure image, so steps 6–8 use our own
# numbers, chosen to reach that end state.

# %%
E = torch.eye(8)
lc = LayerCache(1, 1, 8, torch.float32, "cpu")


def arrive(t, abar):
    lc.append(10 * E[t - 1].view(1, 1, 1, 8), E[t - 1].view(1, 1, 1, 8), torch.tensor([[t]]))
    lc.declare("a", "n")  # the buffers WeightedKV keeps (its `aux`); a no-op once they exist
    lc.aux("a")[:] = torch.tensor(abar).view(1, 1, -1) if abar else 0
    lc.aux("n")[:] = 1.0
    convex_value_merge(lc, capacity=4, sinks=0, recent=1)


toy = solved("convex_value_merge")
if toy:
    for t in range(1, 5):
        arrive(t, None)
    arrive(5, [0.3, 0.1, 0.5, 0.4, 0.6])
    assert lc.positions.flatten().tolist() == [1, 3, 4, 5]
    assert torch.allclose(lc.values[0, 0, 1], E[1] / 6 + 5 * E[2] / 6)  # v2/6 + 5 v3/6
    arrive(6, [0.2, 0.5, 0.45, 0.6, 0.7])  # v1 (0.2) merges into v3'
    arrive(7, [0.5, 0.2, 0.3, 0.6, 0.9])  # v4 (0.2) merges into v5
    arrive(8, [0.5, 0.1, 0.4, 0.8, 0.9])  # v5' (0.1) merges into v6
    assert lc.positions.flatten().tolist() == [3, 6, 7, 8]
    print("v3 now mixes v1, v2, v3:", [round(x, 3) for x in lc.values[0, 0, 0, :3].tolist()])
    print("v6 now mixes v4, v5, v6:", [round(x, 3) for x in lc.values[0, 0, 1, 3:6].tolist()])
    assert torch.allclose(lc.values[0, 0].sum(-1), torch.ones(4))  # every value is a convex combination
    assert torch.allclose(lc.keys[0, 0], 10 * E[[2, 5, 6, 7]])  # keys were only ever dropped

# %% [markdown]
# The four values left at step 8, as mixtures of the eight one-hot values that arrived: keys were
# only dropped, values only merged rightwards.

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.notebooks import show  # noqa: E402

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 2.8), gridspec_kw={"width_ratios": [2, 1]})
if toy:  # the run of the cell above
    im = ax.imshow(lc.values[0, 0].numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_yticks(range(4), [f"slot of v{p}" for p in lc.positions.flatten().tolist()])
    ax.set_xticks(range(8), [f"v{t}" for t in range(1, 9)])
    ax.set_title("weight of each original value in the kept ones")
    fig.colorbar(im, ax=ax)
ax2.bar([f"k_1 scale {k:g}" for k in err], list(err.values()), color="tab:orange")
ax2.set_title("convex merge vs ideal: output error")
ax2.tick_params(axis="x", labelsize=8)
show(fig, "06_merge_chain")

# %% [markdown]
# ## Defaults from the experiments (Sec. V-A)
#
# The paper keeps 4 initial tokens and, for its two cache sizes, 508 recent ones at $m = 1024$ and 124 at
# $m = 256$ (Sec. V-A); it states no rule. kvmini's default window is $(m - 8)/2$, a rule that gives both.

# %%
policy = make_policy("weightedkv", 256)
assert policy.sinks == 4 and policy.recent(1024) == 508 and policy.recent(256) == 124

# %% [markdown]
# ## Seeing the merges on a whole model
#
# On a small random model with capacity 16, every evicted token's value went somewhere: the merging
# compressor records each merge when asked (`record_merges`), and `kvmini.view` draws the prompt with
# what each layer and KV head holds. Every grey token has an orange underline (WeightedKV never just
# drops a value); hover it to see the kept token it went into and its weight there: $\bar a_j / (\bar a_j +
# \bar a_{j+1})$ for a token merged alone (Alg. 1 line 9), $\bar a_i / (\bar a_s + \sum_{\text{run}} \bar a)$ for a
# token in a run of consecutive deleted tokens merged at once into the kept token $s$ after it (`merge_runs`;
# most merges of a chunked prompt are such runs).

# %%
import tempfile  # noqa: E402

from kvmini.config import ModelConfig  # noqa: E402
from kvmini.generate import generate  # noqa: E402
from kvmini.model import Transformer  # noqa: E402
from kvmini.notebooks import show_page  # noqa: E402
from kvmini.view import record_merges, write_html  # noqa: E402


class Letters:
    """A stand-in tokenizer for the random model: token i reads as a letter."""

    def token_bytes(self, i):
        return chr(ord("a") + i % 26).encode() + (b" " if i % 3 == 0 else b"")


if solved("convex_value_merge"):  # a student copy: every WeightedKV step runs the exercise
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
    model = Transformer(config).eval()
    policy = make_policy("weightedkv", 16)
    trace = record_merges(policy)
    prompt = torch.randint(0, 50, (1, 48))
    result = generate(model, prompt, 6, policy=policy)
    evicted = {(m.layer, h, p) for m in trace for h in range(2) for p in m.evicted[0, h].tolist()}
    assert len(evicted) == 3 * 2 * (result.cache.seen_tokens - 16)  # each layer and head evicted all but 16
    assert all((m.into >= 0).all() for m in trace)  # and merged every one
    page = write_html(Path(tempfile.gettempdir()) / "06_kept.html", result.cache, Letters(), prompt[0].tolist(),
                      result.tokens[0], policy, trace)
    show_page(page, height=420)

# %% [markdown]
# ## CaM's merge against WeightedKV's, on the same evictions
#
# CaM (Zhang et al., ICML 2024; `kvmini/methods/cache_merging.py`) also drops the key and keeps the
# value, but it evicts the oldest non-sink token (StreamingLLM) and *adds* $M_i v_i / m$ to each of
# the $m$ tokens after it, where $M_i \sim \mathrm{Bernoulli}(p_i)$ and
# $p_i = \mathrm{clamp}(\bar A_i / \mathrm{avg}\,\bar A_{j:j+m}, 0, 1)$ (Eq. 14). WeightedKV blends
# the value into one neighbour, convexly. Below both see ten one-hot values, the same attention
# sums $(2, 0.1, 0.2, \dots, 0.9)$ and evict the same four tokens $v_2..v_5$ (sink $v_1$; the lowest
# $\bar a$ is also the oldest here); CaM with $m = 3$ and its mean merge ($M_i = p_i$,
# `merge_mask=expectation`). First eviction by hand: $p = 0.1 / \mathrm{avg}(0.2, 0.3, 0.4) = 1/3$,
# so $v_3, v_4, v_5$ each gain $v_2 / 9$.

# %%
from kvmini.methods.cache_merging import CacheMerge  # noqa: E402

E10, acc = torch.eye(10), torch.tensor([2.0] + [0.1 * t for t in range(1, 10)])


def ten_values():
    lc = LayerCache(1, 1, 10, torch.float32, "cpu")
    lc.append(torch.zeros(1, 1, 10, 10), E10.view(1, 1, 10, 10).clone(), torch.arange(10)[None])
    lc.declare("a", "n", "attention_sum")
    lc.aux("a")[:], lc.aux("n")[:], lc.aux("attention_sum")[:] = acc, 1.0, acc
    return lc


def cam_down_to(budget):
    """CaM's merge (sinks 1, m = 3, divide by m, M = p) on the ten values, down to `budget` entries."""
    lc, merge = ten_values(), CacheMerge(sinks=1, m=3, divide="fixed", mask="expectation")
    merge.start(1)  # one layer
    merge.trace = []  # record the merges (Merged: evicted, first target, weight M / m)
    merge(0, lc, lc.aux("attention_sum"), budget)  # layer 0: Eq. 14 + Alg. 1, oldest first
    return lc, merge.trace


first, _ = cam_down_to(9)  # one eviction: the newest entry moves into the freed slot, so read by position
in_order = first.values[0, 0, first.positions[0, 0].argsort()]  # (9, 10): v1, v3, v4, ..., v10
assert torch.allclose(in_order[1:4, 1], torch.full((3,), 1 / 9))  # v3, v4, v5 gained v2 / 9
if solved("convex_value_merge"):  # a student copy: WeightedKV's merge is an exercise
    weighted = ten_values()
    convex_value_merge(weighted, capacity=6, sinks=1, recent=1)  # Alg. 1 four times: v2 -> v3 -> v4 -> v5 -> v6
    cam, trace = cam_down_to(6)
    assert weighted.positions.flatten().tolist() == cam.positions.flatten().tolist() == [0, 5, 6, 7, 8, 9]
    print("CaM's merge probabilities p_i:", [round(3 * w, 3) for w in trace[0].weight.flatten().tolist()])
    print("sum of weights per kept value, WeightedKV:", [round(x, 3) for x in weighted.values[0, 0].sum(-1).tolist()])
    print("sum of weights per kept value, CaM:       ", [round(x, 3) for x in cam.values[0, 0].sum(-1).tolist()])
    assert torch.allclose(weighted.values[0, 0].sum(-1), torch.ones(6))  # convex: every kept value weighs 1
    assert (cam.values[0, 0].sum(-1)[1:4] > 1).all()  # additive: a target keeps its own value and gains shares

    fig, axes = plt.subplots(1, 2, figsize=(11, 2.8), sharey=True)
    for ax, lc, title in ((axes[0], weighted, "WeightedKV: v_j into v_{j+1}, convex (a_j, a_{j+1})"),
                          (axes[1], cam, "CaM: p_i v_i / m added to the next m = 3")):
        im = ax.imshow(lc.values[0, 0].numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks(range(10), [f"v{t}" for t in range(1, 11)])
        ax.set_title(title, fontsize=10)
    axes[0].set_yticks(range(6), [f"slot of v{p + 1}" for p in cam.positions.flatten().tolist()])
    fig.colorbar(im, ax=axes)
    show(fig, "06_cam_vs_weightedkv")

# %% [markdown]
# WeightedKV pushes the whole chain $v_2 \to v_6$ into one value (each step convex, so the oldest
# dropped value ends up with a small weight there); CaM leaves every kept value at weight 1 on
# itself and sprinkles fractions of the evicted ones over the next $m$ tokens, as much as Eq. 14's
# $p_i$ says ($1/3, 1/2, 3/5, 2/3$ for $v_2..v_5$: along this ramp a token's sum comes ever closer
# to the mean of its next three). The kept values are no longer convex combinations (their weights
# sum to more than 1). `python run.py --method cam` runs CaM on a real model, sampling $M_i$ from a
# seeded generator; its `paper` and `official` variants differ only in dividing by the targets that
# exist or always by $m$.

# %% [markdown]
# ## What the authors' code does differently
#
# WeightedKV has no public code, so there is nothing to compare: kvmini follows Alg. 1, and the
# tests replay it token by token (`tests/test_weightedkv.py`).

# %% [markdown]
# ## Exercises
#
# 1. *(assignment: `convex_value_merge`)* Implement Alg. 1 lines 6–10, the body of the function
#    `convex_value_merge` in `kvmini/methods/convex_value_merge.py`: merge one entry at a time until
#    the layer holds `capacity`, each row of the batch and each KV head choosing its own $j$. What the
#    tests check: entries are found by their position, not their slot (a decode step leaves the buffer
#    out of position order); $j$ is the lowest $\bar a = a / n$ among the entries that are neither a
#    sink (position below `sinks`) nor among the $\max(\text{recent}, 1)$ newest positions up to `newest`
#    (so the newest token is never $j$, even with `recent=0`; on a tie, the earliest position); its
#    neighbour $j + 1$ is the held entry with the next position (it may be a recent token);
#    $v_{j+1} \leftarrow (\bar a_j v_j + \bar a_{j+1} v_{j+1}) / (\bar a_j + \bar a_{j+1})$ (half each where both
#    averages are 0, never 0/0); entry $j$ is
#    then deleted with its key, $a$ and $n$ (`lc.keep` of the others with `keep_order`, else
#    `lc.evict_one`), and $j + 1$ keeps its own $a$ and $n$; keys are never merged. Check it with
#    `python -m kvmini.course check convex_value_merge`: one merge by hand on inputs that tell the readings
#    of lines 7-9 apart ($n > 1$, a tie, two zero averages, the lowest $\bar a$ just after the sinks), this
#    toy run (Fig. 3), sinks and window, the newest token, a decode step's merge in a mixed-up buffer against
#    the same merge in order, `merge_runs` against your function, and WeightedKV with prompt chunks of one
#    token against Alg. 1 written out.
# 2. Replace the convex merge by plain eviction (drop $v_j$). Predict the change in the fidelity
#    table at a budget of 128, then measure it.
# 3. Why is the newest token never chosen as $j$? What would merging it "into its right neighbour" mean?
