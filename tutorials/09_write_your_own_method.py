# %% [markdown]
# # 9. Write your own method
#
# From an idea to a registered, tested method in one sitting. The idea is VATP's ("Attention Score
# is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters",
# Zhiyu Guo, Hidetaka Kamigaito, Taro Watanabe, EMNLP 2024, arXiv 2406.12335): an attention
# output is $\sum_j A_{ij} v_j$, so a token that is attended to but whose value vector is small adds
# little to it. H2O ranks tokens by the attention they received; VATP multiplies that by the size
# of their value:
#
# $$s_j = \lVert v_j \rVert_1 \sum_{i \le t} A_{ij}$$
#
# (the paper's $\ell_1$ norm; kvmini's `value_norm=l2` takes $\lVert v_j \rVert_2$ instead).
#
# It lives in `kvmini/methods/vatp.py`. Adding it took what adding any method takes:
#
# 1. **the module**: one class, `VATP`, whose hooks are the algorithm (the shared steps are functions it
#    calls), a typed `Options` declaration and `build`;
# 2. **its line** in `kvmini/methods/registry.py`'s `METHODS` (and its name in the import above it);
# 3. **its tests**: `tests/test_vatp.py` (a worked example, a literal masked simulation, H2O as a special case).
#
# Everything else — the `run.py` flags and `--help`, the report, the evaluation tools' specs, and the
# generic tests over every method — follows from those. Then two commands put it beside the others:
# its behaviour recorded (`tests/test_engine_regression.py --record vatp`) and its measurements added to
# the committed results (the checklist at the end). This tutorial walks through each step; part 2 adds a
# method that needs a new attention statistic (Scissorhands), part 3 a method that waits for every layer,
# part 4 a head-wise method that reads the model's weights (each head's W_o).
# Open it as an executed notebook: `python -m kvmini.notebooks 09` (into notebooks/).

# %%
import inspect
import math
import sys
from pathlib import Path

ROOT = Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent
sys.path.insert(0, str(ROOT))  # find kvmini from root or tutorials/
sys.path.insert(0, str(ROOT / "tests"))  # the literal references ship with the tests

import torch  # noqa: E402

from kvmini.course.cells import solved  # noqa: E402  (a student copy: skip what needs an exercise not done yet)
from kvmini.cache import LayerCache  # noqa: E402
from kvmini.errors import KvminiError  # noqa: E402
from kvmini.methods import registry, vatp  # noqa: E402
from kvmini.methods.registry import make_policy, parse_spec  # noqa: E402

# %% [markdown]
# ## The score
#
# A method is one class in its own module (docs/design.md, "The method form"): it extends `Method`
# (`kvmini/methods/method.py`: its settings and the hook contract) and fills in the hooks the model's
# forward pass calls, each handed the call's `step`, the facts of the run that the engine keeps
# (`kvmini/engine.py`: `step.budgets`, `step.newest`, `step.compresses`, `step.keeps_sums`, ...).
# `before(cache, step)` returns what this call's attention passes compute (here the column sums of its
# queries); `after_attention(layer, cache, stats, step)` is the method's step for one layer, read in order: add this call's column sums $\sum_i A_{ij}$ to every cached token's running
# sum (the cache's aux buffer `attention_sum`, which follows each eviction, as H2O's does), keep the
# norms of the values this call cached, and, when the layer holds more than its budget, `shrink` it to
# the sinks, the best scores and the recent window (`kvmini/methods/selectors.py`, a function H2O
# calls too). The score multiplies the running sum by each cached value's norm, $\ell_p$ with $p = 1$
# (`value_norm=l1`, the paper) or $p = 2$ (`value_norm=l2`). A value never changes once cached, so its
# norm is computed once, in the call that caches it, and kept in a second aux buffer, `value_norm`: a
# decode step then reads S numbers instead of S value vectors. Scores are per KV head, shape
# (B, H_kv, S), higher = keep.

# %%
print(inspect.getsource(vatp.VATP))

# %% [markdown]
# Checked by hand: three tokens that received 0.5, 0.3 and 0.2 of the attention, with values
# $(1, 0)$, $(1, -3)$ and $(0.5, 1.5)$, i.e. $\ell_1$ norms 1, 4 and 2. The scores are
# $0.5 \cdot 1 = 0.5$, $0.3 \cdot 4 = 1.2$ and $0.2 \cdot 2 = 0.4$: the second token, less attended
# than the first, ranks first. With the $\ell_2$ norm (1, $\sqrt{10} \approx 3.16$ and $\sqrt{2.5}
# \approx 1.58$) the scores are 0.5, 0.95 and 0.32: the same order here, by a smaller margin.

# %%
def scored(value_norm: str) -> torch.Tensor:
    """The three tokens cached by one call whose 3 queries gave them the attention above; their scores."""
    lc = LayerCache(1, 1, 2, torch.float32, "cpu", capacity=4)  # batch 1, one KV head, head_dim 2
    lc.append(torch.zeros(1, 1, 3, 2), torch.tensor([[1.0, 0.0], [1.0, -3.0], [0.5, 1.5]]).view(1, 1, 3, 2),
              torch.tensor([[0, 1, 2]]))
    method = vatp.VATP(12, vatp.Options(value_norm=value_norm))
    lc.declare(*method.aux)  # the buffers the method keeps: ("attention_sum", "value_norm")
    lc.aux("attention_sum").add_(torch.tensor([[[0.5, 0.3, 0.2]]]))  # the call's column sums, as after_attention
    method.keep_norms(lc, 3)  # ... and the norms of the 3 values it cached
    return method.score(lc)  # (1, 1, 3)


if solved("value_norm"):
    l1, l2 = scored("l1"), scored("l2")
    print("l1:", l1.flatten().tolist(), " l2:", l2.flatten().tolist())
    assert torch.allclose(l1.flatten(), torch.tensor([0.5, 1.2, 0.4]))
    assert torch.allclose(l2.flatten(), torch.tensor([0.5, 0.3 * math.sqrt(10), 0.2 * math.sqrt(2.5)]))

# %% [markdown]
# ## The declaration
#
# A method's options are one frozen dataclass beside its `build`, plain fields: a type, a default and
# the help in the comment beside the field (or just above it). Options several methods share
# (`sinks`, `recent`, `reduce`) carry the same type and help everywhere, and their checks are one
# table by name (`CHECKS` in `kvmini/methods/options.py`), so a name means one thing (an option only
# one method takes may be checked in its own module's `CHECKS`); VATP adds one
# of its own, `value_norm`, a `Literal` of three choices. `recent` defaults to a `Rule`, a function of the
# budget with a name, so the help can print it. `build` receives the typed values and makes the method.

# %%
print(inspect.getsource(vatp.Options))
print(inspect.getsource(vatp.build))

# %% [markdown]
# Everything about an option is read from this declaration: run.py's flag (with its reader and
# help), `--help`'s list of methods and defaults, the checks of `make_policy`, and the specs of the
# evaluation tools (`"vatp[value_norm=l2,sinks=8]"`).

# %%
for d in registry.declarations("vatp"):
    print(f"--{d.name.replace('_', '-'):<14} default {d.default!s:<12} {d.help}")
print(parse_spec("vatp[value_norm=l2,sinks=8]"))
try:
    make_policy("vatp", 0.2, value_norm="l3")
except KvminiError as e:
    print("refused:", e)
assert parse_spec("vatp[value_norm=l2,sinks=8]") == ("vatp", {"value_norm": "l2", "sinks": 8})
assert str(registry.method_options("vatp")["recent"]) == "budget // 2"

# %% [markdown]
# ## The registry line
#
# `METHODS` maps a name to a module; that one line makes `--method vatp` exist:

# %%
print(next(line for line in inspect.getsource(registry).splitlines() if '"vatp"' in line))
assert registry.METHODS["vatp"] is vatp

# %% [markdown]
# ## The tests it gets for free
#
# Tests that run over every registered method now include VATP, without a line written for it. What
# they need of a method they derive from its declaration and what it says of itself (`tests/tiny.py`): on the tiny
# random models a declared `window` or `recent` longer than 3 tokens is cut to 3, and a test's budget is
# raised to the least the method can keep.
#
# - `tests/test_policy.py`: a budget of the whole sequence keeps exactly everything; with a huge budget
#   the generated tokens equal the full cache's; invariants (held counts, no position twice, sinks and
#   window kept) over random shapes, chunkings and batches, for every registered method on every run; a
#   batch of two equals two single runs;
#   back-to-back prompts equal fresh runs;
# - `tests/test_continuation.py`: three prompts on one cache, and budgets respected where they are given;
# - `tests/test_options.py`: the declaration is typed, has help, and reads back what `--help` prints;
#   a shared name means the same thing;
# - `tests/test_cli.py` and `tests/test_fidelity.py`: the flag and the spec exist, and a short question
#   runs (with the note that a ratio budget was raised, where the method always keeps more);
# - `tests/test_engine_regression.py`: its behaviour is recorded, once you record it (the checklist).
#
# (`tests/test_chunked_prefill.py` runs only the methods that compress once, when the prompt is complete: a
# prompt in chunks keeps what one call keeps. VATP compresses after every call, so it is not among them.)
#
# Here is one of them, run on VATP as the test suite does: a prompt fed in one call and in chunks keeps
# its budget in every layer and head, with the sinks and the recent window, after six decode steps.

# %%
from reference import random_model  # noqa: E402

model = random_model(L=3, H=4, H_kv=2, seed=0)
ids = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(1))
kept = {}
if solved("value_norm"):
    for chunks in ([(0, 30)], [(0, 10), (10, 20), (20, 30)]):  # one call / three calls
        policy = make_policy("vatp", 10)
        cache = model.new_cache(1)
        policy.start(30, 36)
        with torch.no_grad():
            for a, b in chunks:
                model(ids[:, a:b], cache, policy)
            for t in range(6):
                model(torch.tensor([[t + 1]]), cache, policy)
        kept[len(chunks)] = [sorted(cache[layer].positions[0, h].tolist()) for layer in range(3) for h in range(2)]
    print(kept[1][0])
    assert all(len(s) == 10 for s in kept[1] + kept[3])  # the budget, in every layer and head
    assert all(s[:4] == [0, 1, 2, 3] and s[-5:] == list(range(31, 36)) for s in kept[1] + kept[3])  # sinks, window

# %% [markdown]
# ## What a decode step costs
#
# Past the prompt, each decode step appends one entry, so a layer holds one more than its budget, and
# `shrink` drops one in O(D): `selectors.lowest` picks the victim (the window masked by position, one
# masked minimum, ties to the later position) and `LayerCache.evict` lets the new entry take its slot (one
# index read and one `index_put_` for the key and value, which share a buffer, then the position and each
# statistic). Beside the full cache's step, VATP's adds per layer only that, its statistic, its running
# sum's update in place and the new value's norm: no sort, no copy of the cache. In a batch the same ops
# run on every sequence at once. On a GPU a step costs the ops it launches, not the bytes it reads
# (docs/speed.md, "Ops per decode step"), so `tests/test_decode_ops.py` counts one steady-state step of
# every registered method, yours included, and holds it to a limit (1.3x the full cache's; 1.6x for a
# method that merges). VATP's own step is still above its limit: the table in docs/speed.md says by how
# much, and the paragraph under it why.

# %%
from kvmini.eval.ops import step_ops  # noqa: E402

if solved("value_norm"):
    full, vatp_ops = (step_ops(model, name, 1, n=64).n for name in ("full", "vatp"))
    print(f"one decode step on this 3-layer model: full cache {full} ops, VATP {vatp_ops} ({vatp_ops / full:.2f}x)")
    assert vatp_ops > full  # the statistic, the victim and the move are ops of their own

# %% [markdown]
# ## A literal reference: evicting equals masking
#
# The strongest test of a method is a second implementation written from the paper in plain loops,
# that never evicts: `tests/reference.py`'s `simulate` keeps every key and value and hides what the
# method dropped behind a $-\infty$ mask. `tests/test_vatp.py` gives it VATP's rule; if the method
# (which physically removes entries) is right, the kept positions and the logits agree at every call.

# %%
from reference import engine_run, simulate  # noqa: E402
from test_vatp import vatp_literal  # noqa: E402

print(inspect.getsource(vatp_literal))

# %%
gen = torch.Generator().manual_seed(2)
calls = [torch.randint(0, 61, (2, 20), generator=gen)] + [torch.randint(0, 61, (2, 1), generator=gen) for _ in range(6)]
want_logits, want_kept = simulate(model, calls, vatp_literal(12, g=2), with_values=True)
if solved("value_norm"):
    got_logits, got_kept = engine_run(model, calls, make_policy("vatp", 12), 20)  # kept sets entering each call
    assert got_kept == want_kept
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got_logits, want_logits))
    print("kept positions equal at every call; largest logit difference",
          max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits)))

# %% [markdown]
# ## On the real model: what the value norm changes
#
# SmolLM2-135M, the first 512 tokens of Python's documentation, 20% kept. In one layer and KV head,
# every prompt token is a point: the attention it received over the prompt (x, recorded by
# `kvmini.eval.layers.ColumnSums`, a policy that compresses nothing) and its value's $\ell_1$ norm
# (y). Both keep the recent window (half the budget, whatever its attention: the points kept by both
# on the left) and VATP its 4 sinks (the far right: the first tokens draw most of the attention and
# have the smallest values, the paper's observation). Between them, H2O keeps the right-most points
# and VATP those with the largest product: it gives up well-attended tokens with small values for
# less attended ones with large values. We show the layer where the two disagree most.

# %%
from kvmini.eval.fidelity import pydoc_text, run, table  # noqa: E402
from kvmini.eval.layers import ColumnSums  # noqa: E402
from kvmini.loading import load_model  # noqa: E402
from kvmini.tokenizer import load_tokenizer  # noqa: E402
from kvmini.weights import ensure_default_model  # noqa: E402

folder = ensure_default_model()
smol = load_model(folder, "cpu", "float32")
N, K = 512, 32
text_ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[: N + K]])


def prompt_cache(policy):
    cache = smol.new_cache()
    if hasattr(policy, "start"):
        policy.start(N, N)
    with torch.no_grad():
        smol(text_ids[:, :N], cache, policy)
    return cache


scatter = solved("value_norm")
if scatter:
    recorder = ColumnSums()
    full = prompt_cache(recorder)  # nothing evicted: every prompt token's value, in position order
    held = {name: [set(lc.positions[0, 0].tolist()) for lc in prompt_cache(make_policy(name, 0.2))]
            for name in ("h2o", "vatp")}
    LAYER = max(range(30), key=lambda layer: len(held["h2o"][layer] ^ held["vatp"][layer]))
    received = recorder.sums[LAYER][0, 0]  # (N,) attention each token received, KV head 0
    norms = full[LAYER].values[0, 0].abs().sum(-1)  # (N,) l1 norms of the values
    h2o_kept, vatp_kept = held["h2o"][LAYER], held["vatp"][LAYER]
    only_vatp, only_h2o = vatp_kept - h2o_kept, h2o_kept - vatp_kept
    print(f"layer {LAYER}, KV head 0: both keep {len(h2o_kept & vatp_kept)}, only VATP {len(only_vatp)}, "
          f"only H2O {len(only_h2o)}")
    assert only_vatp and len(h2o_kept) == len(vatp_kept) == round(0.2 * N)
    assert norms[sorted(only_vatp)].mean() > norms[sorted(only_h2o)].mean()  # VATP's own picks carry larger values

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.notebooks import show  # noqa: E402

fig, ax = plt.subplots(figsize=(7, 4))
if scatter:  # the runs of the cell above
    groups = [("kept by neither", set(range(N)) - h2o_kept - vatp_kept, "#cccccc"),
              ("kept by both", h2o_kept & vatp_kept, "#4c72b0"),
              ("kept by H2O only", only_h2o, "#dd8452"), ("kept by VATP only", only_vatp, "#55a868")]
    for label, positions, colour in groups:
        p = sorted(positions)
        ax.scatter(received[p], norms[p], s=12, color=colour, label=f"{label} ({len(p)})")
    ax.set_xscale("log")
    ax.set_title(f"SmolLM2-135M, layer {LAYER}, KV head 0: 20% of a {N}-token prompt")
    ax.legend(fontsize=8)
ax.set_xlabel("attention received over the prompt (log)")
ax.set_ylabel(r"$\|v_j\|_1$")
fig.tight_layout()
show(fig, "09_value_norm_vs_attention")

# %% [markdown]
# ## A fidelity run and its figure
#
# Does it help here? The fidelity tool (`python -m kvmini.eval.fidelity`) teacher-forces the next
# K = 32 tokens after each compressed prompt and compares the logits with the full cache's (KL, and
# how often the top-1 token agrees). VATP against H2O, with the $\ell_2$ norm and without the norm:

# %%
specs = ["h2o", "vatp", "vatp[value_norm=l2]", "vatp[value_norm=off]"] if solved("value_norm") else ["h2o"]
rows = run(smol, text_ids, N, specs, [0.1, 0.2], log=lambda line: None)
print(table(rows, N, K))
kl = {(r["method"], r["budget"]): r["kl"] for r in rows}
assert all(value > 0 for key, value in kl.items() if key[0] != "full")

# %%
fig, ax = plt.subplots(figsize=(7, 3))
width = 0.2
for i, spec in enumerate(specs):
    ax.bar([j + i * width for j in range(2)], [kl[spec, b] for b in (0.1, 0.2)], width, label=spec)
ax.set_xticks([j + 1.5 * width for j in range(2)], ["10% kept", "20% kept"])
ax.set_ylabel("KL to the full cache")
ax.legend(fontsize=8)
fig.tight_layout()
show(fig, "09_fidelity")

# %% [markdown]
# At 135M parameters and K = 32 the differences are small and a single prompt is noisy; the
# paper measured LongBench tasks on 7B models. Measure before you believe either way, on a longer
# prompt and continuation: `python -m kvmini.eval.fidelity --n 2048 --k 256 --budgets 0.1 0.2
# --methods h2o vatp "vatp[value_norm=l2]" "vatp[value_norm=off]"`.
#
# ## Part 2: a method that needs a statistic the engine does not compute (Scissorhands)
#
# VATP read a statistic the engine already had (column sums). Scissorhands ("Scissorhands:
# Exploiting the Persistence of Importance Hypothesis for LLM KV Cache Compression at Test Time",
# Zichang Liu et al., NeurIPS 2023, arXiv 2305.17118) needs a new one. At each step the query's
# attention row marks a cached token *low* when it got less than a uniform share of it,
#
# $$\mathrm{low}_j(t) = \mathbb{1}\left[\alpha_{tj} < 1/|K_t|\right],$$
#
# a token's importance record is how often it was low in the last $w$ steps,
# $I_j = \sum_{s=t-w+1}^{t} \mathrm{low}_j(s)$, and when the cache is full the $m$ tokens with the
# largest $I_j$ go at once (the $r$ newest never). Three things the engine does not know about:
# the statistic, a history of $w$ steps per cached token, and dropping $m$ at once. Each is
# *declared* in `kvmini/methods/scissorhands.py`; no engine file changes.
#
# **The statistic.** Every attention statistic is a sum over some of a call's queries of a function
# of their attention rows (`Statistic` in `kvmini/attention.py`). Scissorhands' is the function `below_average`,
# summed over the last $w$ queries; the attention pass computes it chunk by chunk like any other.

# %%
from kvmini.attention import attend  # noqa: E402
from kvmini.methods import scissorhands  # noqa: E402

print(inspect.getsource(scissorhands.below_average))
low = scissorhands.Scissorhands(0.2, scissorhands.Options(history=3)).low
print(low)
g2 = torch.Generator().manual_seed(0)
q, k, v = torch.randn(1, 2, 7, 4, generator=g2), torch.randn(1, 1, 7, 4, generator=g2), torch.randn(1, 1, 7, 4, generator=g2)
pos = torch.arange(7)
_, stats = attend(q, k, v, pos[None], pos[None, None], {"low_counts": low})  # a 7-token prompt, 2 query heads
A = (q @ k.transpose(-1, -2) / 2 + torch.full((7, 7), float("-inf")).triu(1)).softmax(-1)  # (1, 2, 7, 7) by hand
by_hand = ((A > 0) & (A * (A > 0).sum(-1, keepdim=True) < 1)).float()[:, :, -3:].sum((1, 2))  # last 3 rows, both heads
assert torch.equal(stats["low_counts"][0, 0], by_hand[0])
print("low counts over the last 3 queries:", stats["low_counts"][0, 0].tolist())

# %% [markdown]
# **The history.** The method keeps, per cached token, the low counts of the last $w$ steps: an aux
# buffer of its own dtype and shape, `("low_history", torch.int16, (w,))`, a ring whose slot is the
# step modulo $w$, and the ring's sum, `("low_count", torch.int32)`, kept as the ring turns (the step
# a slot held leaves as the new one comes: `remember`), so that an eviction reads $I_j$ without
# summing $w$ values per token. The cache moves both with their token through every eviction and
# counts their bytes (`aux` in run.py's report). The method's layer step reads as the algorithm:

# %%
print(inspect.getsource(scissorhands.Scissorhands.after_attention))

# %% [markdown]
# The hand-worked stream of `tests/test_scissorhands.py` (cache of $B = 6$, $m = 2$, $w = 3$, $r = 2$)
# runs `remember` and the eviction on a cache by hand (`drop_lowest`: it drops the $m$ lowest at once
# by moving only the last $m$ entries; the test runs `shrink`'s sort and keep too, which keep the same
# tokens):

# %%
from test_scissorhands import test_the_hand_worked_stream  # noqa: E402

print(scissorhands.Scissorhands(0.2, scissorhands.Options(history=3)).aux)
print(inspect.getsource(test_the_hand_worked_stream).split('"""')[1])
test_the_hand_worked_stream(scissorhands.drop_lowest)

# %% [markdown]
# **Dropping $m$ at once** is the engine's `evict_every`: a layer holds up to budget + m − 1 entries
# and evicts $m$ when it reaches budget + m. A method gives it its own default
# (`ENGINE_DEFAULTS = {"evict_every": 16}`), which `--help`, the report and the specs show.

# %%
every = {d.name: d for d in registry.declarations("scissorhands")}["evict_every"]
print("evict_every default:", every.default, "| a policy:", make_policy("scissorhands", 0.2).evict_every)
assert every.default == 16

# %% [markdown]
# **The literal reference.** As for VATP: a loop that never evicts (it masks) and counts every
# query head's low flags by hand; the engine (a prompt in one call, then drops of 3) agrees.

# %%
from test_scissorhands import scissorhands_literal  # noqa: E402

sh_calls = [torch.randint(0, 61, (2, 20), generator=gen)] + [torch.randint(0, 61, (2, 1), generator=gen) for _ in range(9)]
got_logits, got_kept = engine_run(model, sh_calls, make_policy("scissorhands", 8, history=4, recent=2, evict_every=3), 20)
want_logits, want_kept = simulate(model, sh_calls, scissorhands_literal(8, 2, 20, w=4, recent=2, m=3))
assert got_kept == want_kept
print("kept sets equal at every call:", [len(kept[0][0][0]) for kept in got_kept])  # layer 0, sequence 0, head 0

# %% [markdown]
# **On the real model.** The same 512-token prompt: for one layer and KV head, each prompt token's
# low count over the last 400 queries (a statistic recorder, as `ColumnSums` records column sums),
# and what Scissorhands keeps at 20%: the tokens that were rarely below average, and the 10 newest.

# %%
class LowCounts(ColumnSums):
    """Records every layer's low counts over the last 400 queries of the prompt, compressing nothing."""

    def before(self, cache, step):
        return {"low_counts": scissorhands.Scissorhands(0.2).low}  # over the last 400 queries

    def after_attention(self, layer, cache, stats, step):
        self.sums.append(stats["low_counts"])


recorder = LowCounts()
prompt_cache(recorder)
kept_sh = [set(lc.positions[0, 0].tolist()) for lc in prompt_cache(make_policy("scissorhands", 0.2))]
LAYER_SH = 15
counts = recorder.sums[LAYER_SH][0, 0]  # (N,) low counts, KV head 0 (its 3 query heads summed)
chosen = sorted(kept_sh[LAYER_SH])
others = sorted(set(range(N)) - kept_sh[LAYER_SH])
assert len(chosen) == round(0.2 * N)
middle = [p for p in chosen if p < N - 10]  # kept for their record, not as the newest
assert counts[middle].max() <= counts[[p for p in others if p < N - 10]].min()  # the lowest counts are kept

fig, ax = plt.subplots(figsize=(7, 3))
ax.scatter(others, counts[others], s=4, c="0.7", label="dropped")
ax.scatter(chosen, counts[chosen], s=6, c="C3", label="kept by Scissorhands")
ax.set_xlabel("position in the prompt")
ax.set_ylabel("low steps of 400 (3 heads)")
ax.set_title(f"layer {LAYER_SH}, KV head 0: the importance record at the prompt's end")
ax.legend(fontsize=8)
fig.tight_layout()
show(fig, "09_scissorhands_low_counts")

# %% [markdown]
# The record counts low steps, so a token younger than the window has had fewer chances to be low:
# after a prompt the counts fall with the position, and what Scissorhands keeps is mostly the end of
# the prompt plus the few old tokens that were almost never below average (the first token, the
# attention sink). The paper counts in a stream, where every kept token has been seen for $w$ steps;
# a prompt is the case where this reading of "most often low" favours the recent.
#
# What it took: `kvmini/methods/scissorhands.py` (the statistic, the history and its eviction, the
# options and the engine default), one line in `METHODS`, and `tests/test_scissorhands.py`. The CLI and
# evaluation tools and the generic tests picked it up from the registry; its recording and results
# came from the commands of the checklist below.
#
# ## Part 3: a method that waits for every layer, and a statistic made of sums
#
# Some methods cannot budget a layer when its attention has just been computed. CAKE ("CAKE: Cascading
# and Adaptive KV Cache Eviction with Layer Preferences", Ziran Qin et al., ICLR 2025, arXiv 2503.12491)
# splits the total L·b between the layers by how each layer's attention is spread and how much it shifts
# over the observation window: it needs every layer measured first. A toy in its spirit (not CAKE):
# each layer's budget in proportion to $V_l$, the variance of the attention a key receives across the
# window's queries, per query head, averaged over heads and keys.
#
# **A statistic made of sums.** A variance is not a sum over queries, but it is made of three:
#
# $$m_j = \sum_{i \in W} 1[i \text{ saw } j], \quad \bar a_j = \frac{1}{m_j} \sum_{i \in W} A_{ij}, \quad
#   \mathrm{Var}_j = \frac{1}{m_j} \sum_{i \in W} A_{ij}^2 - \bar a_j^2$$
#
# $W$ the window's queries, per query head (`reduce="heads"`: (B, H, S)). $m_j$ is how a part learns how
# many queries the window held: it counts them, as a third sum, because the count differs per key (a key
# inside the window is seen only by the queries after it; a prompt shorter than the window has fewer). A
# count of "saw" needs a function that is 0 where a key is unseen: $A_{ij} > 0$ (a softmax weight is
# positive wherever the key is visible). Being sums, the three are computed chunk by chunk and add up
# over a prompt fed in several calls like any other statistic.

# %%
from kvmini.methods.allocators import proportional  # noqa: E402
from kvmini.methods.method import Method  # noqa: E402
from kvmini.methods.selectors import keep_top, shrink  # noqa: E402
from kvmini.attention import Statistic  # noqa: E402

W = 4  # the observation window: the prompt's last 4 queries


def saw(rows: torch.Tensor) -> torch.Tensor:
    """1 where a query saw the key (its attention is > 0), 0 where the key was hidden from it."""
    return (rows > 0).to(rows.dtype)


WINDOW = {"sums": Statistic(last=W, reduce="heads"),  # (B, H, S): sum_i A_ij
          "squares": Statistic(last=W, f=torch.square, reduce="heads"),  # sum_i A_ij^2
          "seen": Statistic(last=W, f=saw, reduce="heads")}  # m_j


def window_variance(stats) -> torch.Tensor:
    """Var_j per query head, (B, H, S); 0 for a key no query of the window saw."""
    m = stats["seen"].clamp(min=1)
    mean = stats["sums"] / m
    return stats["squares"] / m - mean**2


_, stats = attend(q, k, v, pos[None], pos[None, None], WINDOW)  # the 7-token example above
by_hand = torch.zeros(2, 7)
for h in range(2):
    for j in range(7):
        seen_by = [A[0, h, i, j] for i in range(7 - W, 7) if i >= j]  # the window's queries that saw key j
        by_hand[h, j] = torch.stack(seen_by).var(correction=0)
print("variance over the window, head 0:", [round(x, 4) for x in window_variance(stats)[0, 0].tolist()])
assert torch.allclose(window_variance(stats)[0], by_hand, atol=1e-6)
assert stats["seen"][0, 0].tolist() == [4, 4, 4, 4, 3, 2, 1]  # key 6 is seen by the last query only

# %% [markdown]
# **A method that waits.** In the call that completes the prompt, its `after_attention` measures each
# layer and holds the layer's score (here the attention each key received over the prompt), compressing
# nothing: the layer keeps every entry while the next layers attend (they never read this layer's
# cache, so waiting changes nothing). `after_layers`, called once after the last layer, has every
# measure: it budgets all layers and compresses each one with the score it held from that layer's own
# turn. D2O's paper variant waits the same way (`kvmini/methods/d2o.py`). This toy compresses once,
# when the prompt is complete (`schedule = "prefill"`), and takes the prompt in one call (a real method
# adds up its statistics over a prompt's chunks, as SnapKV's does).
#
# What a real method of this kind needs that the toy leaves out: budgets per sequence, so that each
# sequence of a batch gets budgets from its own measures (`kvmini.methods.rows`: `RowBudgets.set_budgets`,
# one budget per sequence, and `shrink_rows` with each row's count, as D2O's `compress` does; without it a batch shares
# one plan).

# %%
class WindowVariance(Method):
    """Layer budgets in proportion to V_l, the mean variance of the attention a key receives across the
    last W queries of the prompt (a toy in the spirit of CAKE's layer preferences, not CAKE); in each
    layer the recent window and the keys the prompt attended to most."""

    schedule = "prefill"  # once, when the prompt is complete

    def recent(self, b):
        return W  # always kept: what the budget must leave room for

    def before(self, cache, step):
        if step.first:  # this prompt's measures: layer -> V_l, and its score
            self.variance, self.score, self.held, self.chosen = {}, {}, [], None
        return WINDOW | {"column_sums": Statistic()} if step.compresses and step.completes else None

    def after_attention(self, layer, cache, stats, step):
        if not stats:
            return
        self.variance[layer] = window_variance(stats)[stats["seen"] > 0].mean().item()  # V_l
        self.score[layer] = stats["column_sums"]  # (B, H_kv, S): the attention each key received
        self.held.append(cache[layer].length)  # nothing compressed yet
        print(f"layer {layer}: V_l = {self.variance[layer]:.5f}, holds {cache[layer].length} entries")

    def after_layers(self, cache, step):
        if not (step.compresses and step.completes):
            return
        L, n = len(cache), step.prompt_end
        V = [self.variance[l] for l in range(L)]
        self.chosen = proportional(V, step.mean_budget * L, low=W + 1, high=[n] * L)  # every layer, sum L·b
        for layer in range(L):
            self.evicted[layer] += cache[layer].length - self.chosen[layer]
            shrink(cache[layer], self.score[layer], self.chosen[layer], 0, W, step.newest)

    @property
    def budgets(self):  # the layer budgets it chose (the report reads them), else the run's plan
        return self.chosen or super().budgets


policy = WindowVariance("window_variance", 10)
cache = model.new_cache(1)
policy.start(30, 30)
with torch.no_grad():
    model(ids, cache, policy)  # the 30-token prompt of the VATP example, in one call
assert policy.held == [30, 30, 30]  # every layer measured while it still held the whole prompt
assert sum(policy.budgets) == 10 * 3 and cache.lengths() == policy.budgets

# %% [markdown]
# Each layer was compressed with the score of its own turn, not the last layer's: layer 0 keeps what
# `keep_top` chooses from layer 0's accumulated attention over the prompt, recorded here by a policy
# that compresses nothing (`ColumnSums`, as in the VATP plot).

# %%
recorder = ColumnSums()
with torch.no_grad():
    model(ids, model.new_cache(1), recorder)
for layer in range(3):
    want = keep_top(recorder.sums[layer], policy.budgets[layer], sinks=0, recent=W)  # (1, H_kv, b), position order
    assert cache[layer].positions.sort(-1).values.tolist() == want.tolist(), layer
print("budgets", policy.budgets, "from V_l", [round(policy.variance[l], 5) for l in range(3)])

# %% [markdown]
# ## Heads that keep their own counts
#
# A budget is per layer, but a method may share a layer's budget out over its KV heads: it calls
# `lc.keep(idx, counts)`, where `counts` (B, H_kv) says how many of each row's `idx` that row keeps,
# and sets `own_counts = True`. The cache then holds each row's entries first and pads after them
# (docs/design.md, "Rows of their own"); attention never sees a pad, and bytes count held entries.
# `kvmini/methods/adakv.py` (Ada-KV) is such a method: SnapKV with its own selection, `across_heads`,
# which counts the layer's best scores per head. The generic tests then hold the mean count per head
# to the budget.

# %% [markdown]
# ## Part 4: a method that reads the model's weights (head-wise)
#
# Some scores need more than the attention: CriticalKV (Feng et al., "Identify Critical KV Cache in LLM
# Inference from an Output Perturbation Perspective", arXiv 2502.03805) weighs each token's attention by
# what its value adds to the layer's output, the norm of $v_j$ through the head's slice of the output
# projection, $\|W_o^{h} v_j\|$ ($W_o^{h}$: the $D$ columns of `o_proj.weight` that read query head $h$).
# A method finds the model of its run in `self.model` (`kvmini.generate.prefill` hands it to `start`),
# so reading a weight needs no change outside the method. The toy below keeps, once when the prompt is
# complete, the recent window and the tokens of highest
#
# $$\mathrm{score}_j = \frac{1}{g} \sum_{h \in \text{KV head}} \Big(\sum_i A^{h}_{ij}\Big)\, \big\|W_o^{h} v_j\big\|_2,$$
#
# per KV head: the attention of each query head times its own output norm, then averaged over the
# $g$ query heads that share the KV head (a statistic with `reduce="heads"` keeps them apart). It is a
# toy in CriticalKV's spirit, not CriticalKV (one stage, one budget per layer), and like the toy of
# part 3 it takes the prompt in one call.

# %%
from kvmini.attention import reduce_heads  # noqa: E402
from kvmini.generate import prefill  # noqa: E402


class OutputAware(Method):
    """Heavy hitters by attention times ||W_o^h v_j|| (per query head, then the mean over a KV head's
    query heads) plus the recent window, once when the prompt is complete."""

    schedule = "prefill"

    def recent(self, b):
        return W

    def before(self, cache, step):
        wanted = step.compresses and step.completes
        return {"columns": Statistic(reduce="heads")} if wanted else None  # (B, H, S): sum_i A^h_ij

    def after_attention(self, layer, cache, stats, step):
        if not stats:
            return
        lc, attn = cache[layer], self.model.model.layers[layer].self_attn  # this layer's attention module
        H, H_kv, D = attn.H, attn.H_kv, attn.D
        W_o = attn.o_proj.weight.view(-1, H, D)  # (C, H, D): W_o^h is W_o[:, h]
        v = lc.values.repeat_interleave(H // H_kv, dim=1)  # (B, H, S, D): the values each query head reads
        through = torch.einsum("bhsd,chd->bhsc", v, W_o).norm(dim=-1)  # (B, H, S): ||W_o^h v_j||
        score = reduce_heads(stats["columns"] * through, H_kv, "mean")  # (B, H_kv, S)
        b = step.budgets[layer]
        self.evicted[layer] += lc.length - b
        shrink(lc, score, b, 0, W, step.newest)


policy = OutputAware("output_aware", 12)
cache = model.new_cache(1)
saved = []  # each layer's queries, keys and values when its attention is done, before the method acts
hooks = [layer.self_attn.register_forward_hook(
    lambda attn, args, out: saved.append((attn.project(args[0], args[2], args[3])[0], args[4].keys.clone(),
                                          args[4].values.clone()))) for layer in model.model.layers]
with torch.no_grad():
    prefill(model, ids, cache, policy)  # the 30-token prompt, in one call
for h in hooks:
    h.remove()

# %% [markdown]
# The same rule in loops, from the queries, keys and values the hooks saved and the weights themselves:
# each query head's attention row by row, each value through its head's columns of $W_o$ one at a time.

# %%
for layer, (q, K, V) in enumerate(saved):
    W_o = model.model.layers[layer].self_attn.o_proj.weight.detach()  # (C, H * D)
    H, H_kv, n, D = q.shape[1], K.shape[1], K.shape[2], K.shape[3]
    g = H // H_kv
    for kv in range(H_kv):
        score = []
        for j in range(n):
            total = 0.0
            for h in range(kv * g, (kv + 1) * g):
                rows = [(q[0, h, i] @ K[0, kv, : i + 1].T / math.sqrt(D)).softmax(-1) for i in range(j, n)]
                attention = sum(float(r[j]) for r in rows)  # sum_i A^h_ij over the queries that see j
                total += attention * float((W_o[:, h * D : (h + 1) * D] @ V[0, kv, j]).norm())
            score.append(total / g)
        b = policy.budgets[layer]
        heavy = sorted(range(n - W), key=lambda j: -score[j])[: b - W]
        want = sorted(heavy) + list(range(n - W, n))
        assert sorted(cache[layer].positions[0, kv].tolist()) == want, (layer, kv)
print("kept per layer:", cache.lengths(), "(budget 12, of which the recent", W, ")")

# %% [markdown]
# ### Reading the residual stream
#
# Some methods read the hidden states, which the model hands no method: SqueezeAttention (Wang et al.,
# "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via Layer-wise Optimal Budget", arXiv
# 2404.04793) sizes each layer's budget by the cosine similarity of the residual stream before and after
# the layer's attention. Torch's forward pre-hooks on `self.model`'s norms give it, with no edit of the
# model, the attention, the cache or `Method`: each block normalizes the stream before its attention
# (`input_layernorm`) and after it (`post_attention_layernorm`), so those norms' first argument is the
# stream, $(B, T, C)$. Hook them in `before` and remove the hooks in `after_layers`, so that every call
# leaves the model as it found it. `tests/reads_model.py` does this (and keeps what H2O keeps); its test
# registers it and runs it everywhere the generic tests start a run, each of which hands `start` the model
# as `prefill` does, so a method that reads the model gets those tests for free too.

# %%
import reads_model  # noqa: E402  (tests/reads_model.py)

print(inspect.getsource(reads_model.ReadsModel))
policy = reads_model.ReadsModel(12)
with torch.no_grad():
    prefill(model, ids, model.new_cache(1), policy)
assert torch.equal(policy.streams[0], model.model.embed_tokens(ids))  # layer 0's stream before attention: the embeddings
print("cosine of the stream before and after each layer's attention:", [round(c, 3) for c in policy.cosines])

# %% [markdown]
# ## A checklist for your own method
#
# 1. A module `kvmini/methods/<name>.py`: a docstring with the paper (title, authors, arXiv ID), the
#    equation, the defaults and every `Deviation:` from the paper or the authors' code; the method,
#    one `Method` subclass whose hooks are its algorithm (reuse the functions that exist, write the
#    step that is new); `Options`, plain fields with their help in a
#    comment (a new number option that needs a check: a `CHECKS` dict in the module, name ->
#    (test, what it must be), e.g. `{"gamma": (lambda x: x >= 0, "be >= 0")}`); `build(budget, o)`.
# 2. Its line in `METHODS` and its name in the import above it (`kvmini/methods/registry.py`).
# 3. `tests/test_<name>.py`: a worked example by hand, a literal reference in loops compared with the
#    engine (`reference.simulate`), and the special cases that must reduce to a known method.
# 4. `git add` the new files: the course's copies and the tests that make them (`tests/test_assignments.py`)
#    take what git tracks, so a module git does not know is missing there.
# 5. Record its behaviour: `PYTHONPATH=. python tests/test_engine_regression.py --record <name>` (its
#    entries only, on the tiny and the default model; every other entry keeps its bytes).
# 6. Run the tests: `python -m pytest -q tests/test_<name>.py`, then the generic ones
#    (`tests/test_policy.py tests/test_decode_steps.py tests/test_continuation.py tests/test_chunked_prefill.py
#    tests/test_options.py tests/test_engine_regression.py`), or the whole suite, `python -m pytest -q`.
# 7. Measure it: `python -m pytest -q tests/test_results_current.py` names it as not measured in each
#    results folder (results/quick, results/full, results/full-speed), with the command that measures it
#    there: `python -m kvmini.eval.suite ... --methods <name>`, with that folder's profile and `--out`
#    (the method alone, in every experiment that measures every method; its rows are merged into the
#    folder's results). Run each command it prints. Two experiments are not merged method by method
#    (`kvmini.eval.suite.BY_METHOD` lacks them): `--only streaming` and `--only layers` re-run every
#    method of the experiment (streaming is the slowest of all), record a new provenance for it, and
#    may move another method's row in its last digit, as any re-measurement does; commit those rows too.
# 8. Regenerate the documents from the results: `python -m kvmini.eval.docs` (`--check` is tested). Then
#    its rows in the README's and docs/methods.md's method tables.
#
# ## Exercises
#
# 1. *(assignment: `value_norm`)* Write the value norm in `VATP.norm` (the
#    region between the `EXERCISE` markers in `kvmini/methods/vatp.py`): $\ell_1$ for $p = 1$, the
#    general $\ell_p$ otherwise ($p = 2$ for `value_norm=l2`), over the last dimension: values
#    $(\dots, S, D) \to (\dots, S)$, any leading dimensions. Check it with
#    `python -m kvmini.course check value_norm`: the by-hand scores above ($p$ = 1 and 2, a value with a
#    negative entry), `VATP.norm` alone (two KV heads, each value's own norm; the values left unchanged;
#    values shaped $(S, D)$ and with three leading dimensions), the whole method against a literal masked
#    simulation (a batch of two, a prompt in chunks, decode steps, sinks and a recent window), and H2O as
#    the special case.
# 2. Write a method of your own: keys instead of values (`-\|k_j\|_2`, as KNorm does, but times the
#    accumulated attention). Which functions do you reuse? Which tests do you get for free?
# 3. VATP keeps the first 4 tokens unconditionally. Run `vatp[sinks=0]` in the fidelity tool: what
#    happens to the first token, and why does its value norm explain it?
