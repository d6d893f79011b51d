# %% [markdown]
# # 8. All methods side by side on the default model
#
# One fidelity table for every method in kvmini, and a picture of how each layer-adaptive method
# spreads its budget over SmolLM2's 30 layers. The prompt here is short (512 tokens, 32
# continuation tokens) so that the tutorial runs in a minute or two (tutorials/README.md has the
# recorded times); results/full/summary.md has the full profile's longer prompts (docs/evaluation.md
# lists its sizes; `python -m kvmini.eval.suite --profile full --only fidelity`).
# Open it as an executed notebook: `python -m kvmini.notebooks 08` (into notebooks/).

# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() if Path("kvmini").is_dir() else Path.cwd().parent))  # find kvmini from root or tutorials/

import torch  # noqa: E402

from kvmini.course.cells import usable  # noqa: E402  (a student copy: leave out what needs an exercise not done yet)
from kvmini.eval.fidelity import pydoc_text, run, table  # noqa: E402
from kvmini.loading import load_model  # noqa: E402
from kvmini.methods.registry import METHODS, make_policy  # noqa: E402
from kvmini.report import layer_bars  # noqa: E402
from kvmini.tokenizer import load_tokenizer  # noqa: E402
from kvmini.weights import ensure_default_model  # noqa: E402

folder = ensure_default_model()
model = load_model(folder, "cpu", "float32")
N, K = 512, 32
ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[: N + K]])

# %% [markdown]
# ## One fidelity table
#
# Each method compresses the same 512-token prompt to 20% (about 102 tokens per layer; DBudgetKV
# chooses its own budget), then the next 32 tokens are teacher-forced. Lower KL and higher top-1
# agreement mean the compressed cache behaves more like the full one. (In a student copy, a method
# that needs an exercise not done yet is left out, with a line saying which.)

# %%
methods = [m for m in METHODS if m != "full" and usable(m)]
rows = run(model, ids, N, methods, [0.2], log=lambda line: None)
print(table(rows, N, K))
assert rows[0]["method"] == "full" and rows[0]["kl"] == 0
assert len(rows) == 1 + len(methods) and all(r["kl"] > 0 for r in rows[1:])

# %% [markdown]
# ## Per-layer allocations
#
# Uniform methods keep the same number of tokens in every layer. PyramidKV's budgets fall
# linearly; D2O follows the layers' attention variance; DynamicKV follows each layer's share of
# the globally best scores; DBudgetKV stops where the attention norm would drop by more than 1%.
# Each bar is one layer (█ = the largest layer of that method).

# %%
allocations = {}
for name in ("snapkv", "pyramidkv", "d2o", "dynamickv", "dbudgetkv"):  # D2O: kvmini's reading, compressing at the prompt
    options = {"d2o": {"variant": "paper", "allocation": "zscore"},  # re-budget DynamicKV's last L % m layers too
               "dynamickv": {"tail_reallocation": True}}.get(name, {})
    if not usable(name, **options):
        continue
    policy = make_policy(name, None if name == "dbudgetkv" else 0.2, **options)
    cache = model.new_cache()
    policy.start(N, N)
    with torch.no_grad():
        model(ids[:, :N], cache, policy)
    allocations[name] = cache.lengths()
    print(f"{name:<10} total {sum(cache.lengths()):>6}")
    for line in layer_bars(cache.lengths(), max(cache.lengths()), per_line=30):
        print("          ", line)
budget_total = 30 * round(0.2 * N)
for name in ("snapkv", "pyramidkv", "d2o", "dynamickv") & allocations.keys():  # the same total, spread differently
    assert sum(allocations[name]) == budget_total
assert len(set(allocations["snapkv"])) == 1 and allocations["pyramidkv"] == sorted(allocations["pyramidkv"], reverse=True)

# %% [markdown]
# ## The same allocations as a picture

# %%
import matplotlib.pyplot as plt  # noqa: E402

from kvmini.notebooks import show  # noqa: E402

fig, ax = plt.subplots(figsize=(8, 3))
for name, kept in allocations.items():
    ax.plot(range(30), kept, marker="o", markersize=3, label=name)
ax.set_xlabel("layer")
ax.set_ylabel("tokens kept")
ax.legend()
fig.tight_layout()
show(fig, "08_allocations")

# %% [markdown]
# ## What each method keeps, token by token
#
# The counts above say how much each layer keeps, not *what*. `kvmini.view` draws the text itself,
# every token shaded by the share of (layer, KV head) pairs whose cache still holds it, for four
# methods on the first 256 tokens of the prompt (8 tokens generated). Pick a layer and a head at the
# top; a token outlined in red is kept by that method and dropped by another; an orange underline is
# an evicted token whose value D2O or WeightedKV merged into a kept one (hover it: into which, with
# what weight). The same page comes from `python run.py --method d2o --prompt FILE --html kept.html`
# or, for several methods, `python -m kvmini.view --methods h2o snapkv d2o --prompt FILE --out kept.html`.

# %%
import tempfile  # noqa: E402

from kvmini.notebooks import show_page  # noqa: E402
from kvmini.view import run_method, write_comparison  # noqa: E402

prompt = ids[:, :256]
runs = [run_method(model, prompt, spec, 0.2, max_new_tokens=8)
        for spec in ("h2o", "snapkv", "d2o", "weightedkv") if usable(spec)]
page = write_comparison(Path(tempfile.gettempdir()) / "08_kept.html", runs, load_tokenizer(folder), prompt[0].tolist())
for cache, policy, trace, spec, generated in runs:  # what the page encodes: each layer and head's held positions
    held = [len(set(cache[layer].positions[0, head].tolist())) for layer in range(30) for head in range(3)]
    print(f"{spec:<20} held per (layer, head): {min(held)}-{max(held)}, merges recorded: {trace is not None}")
    assert held == [cache[layer].length for layer in range(30) for head in range(3)]  # no position held twice
show_page(page)

# %% [markdown]
# ## Does a method need to see the question?
#
# A compressed cache is often used again: a second question about the same document. Then the
# context is compressed *before* the question arrives. SnapKV scores the context by the attention of
# the prompt's last 32 tokens, which is where a question sits; fed after the compression, the
# question arrives too late to choose. `kvmini.eval.query_aware` feeds the same ids both ways: one
# prompt, or the context as a run's first prompt (compressed at once) and the question as its next
# prompt (`prefill` on a cache that already holds tokens). Here on one 512-token passkey prompt:

# %%
from kvmini.chat import load_chat_format, stop_token_ids  # noqa: E402
from kvmini.eval import query_aware  # noqa: E402

tok, chat = load_tokenizer(folder), load_chat_format(folder)
stop = stop_token_ids(model.config.eos_token_ids, tok, chat)
ctx, q = (torch.tensor([x]) for x in query_aware.split_prompt(tok, chat, 512, 0.5, 27182))
for condition, prompts in (("in the prompt", [torch.cat([ctx, q], 1)]), ("after", [ctx, q])):
    if usable("snapkv"):
        answer, _, kept = query_aware.answer_and_logits(model, prompts, make_policy("snapkv", 0.1), [], stop)
        print(f"SnapKV 10%, question {condition:<13}: {tok.decode(answer).strip()!r} (key 27182, {kept[0]} kept per layer)")
_, cache = query_aware.feed(model, [ctx], None)
assert cache.lengths() == [ctx.shape[1]] * 30  # the full cache: nothing compressed

# %% [markdown]
# The suite measures this for every method and two budgets (`python -m kvmini.eval.suite --only
# queryaware`): passkey accuracy, and the KL from the full cache over its answer. The committed
# results, and the methods that depend on seeing the question by the rule printed under the table:

# %%
import json  # noqa: E402

from kvmini.eval.tables import queryaware_table  # noqa: E402
from kvmini.notebooks import ROOT  # noqa: E402

committed = ROOT / "results" / "quick" / "results.json"
results = json.loads(committed.read_text()) if committed.exists() else {}  # a student copy has no results/
if "queryaware" in results:
    print(queryaware_table(results))
    print("depend on the question:", ", ".join(query_aware.question_dependent(results["queryaware"])))
    fig, ax = plt.subplots(figsize=(13, 7.5))
    ax.imshow(plt.imread(committed.with_name("queryaware.png")))  # the suite's figure, as committed
    ax.axis("off")
    show(fig, "08_queryaware")
else:
    print(f"no committed results in {committed.parent}: python -m kvmini.eval.suite --only queryaware --out results/quick")

# %% [markdown]
# ## Exercises
#
# 1. Which method is best at 20% here, and is it the same at the full profile's N = 2048? Why might the
#    ranking depend on the prompt length?
# 2. Compose a new method from the parts — e.g. DynamicKV's progressive budgets with H2O's
#    cumulative scores — and add it to the table.
# 3. Which methods lose the most when the question comes after the context? Read each one's scorer
#    (docs/methods.md): which queries does it look at, and when?
