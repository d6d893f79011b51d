"""D2O (Wan et al. 2024): variance-softmax layer budgets + H2O eviction with EMA-threshold merging.

Paper: "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language Models"
(Zhongwei Wan et al., ICLR 2025; arXiv 2406.13035).

    scorer       cumulative attention (H2O), per KV head
    budgeter     variance-softmax over layers (kvmini.methods.variance_softmax, Eq. 4-5),
                 measured on every layer of the prompt, then every layer is compressed
    compressor   T sinks + N heavy + M recent (Eq. 6-8), with EMA-threshold merging of the
                 evicted tokens (kvmini.methods.ema_merging, Eq. 9-12)
    schedule     when the prompt is complete (paper) or at the first decode step (official),
                 then one eviction (and possible merge) per decode step

Two variants; every option below overrides its part of the chosen one:

    option            paper (the equations)        official (AIoT-MLSys-Lab/D2O, Llama-3 code)
    allocation        paper: softmax(-F_v), raw    official: min-max over heads, clamp [0.01, 1]
    protected_layers  none                         0, 1 and the last layer (-1) never compressed
    nm                3:1                          1:1
    split             paper: T + N + M = S_l       official: the T sinks come out of the N heavy
    merge             paper: convex softmax        official: raw-cosine scatter-mean
    tau               per_head                     per_layer (head-averaged similarity decides)
    beta              0.7                          0.5 (alpha = beta = 0.5)
    start             prompt                       first_decode (scores include that step's row)
`allocation=zscore` is kvmini's own reading (standardized variances, `softmax_temperature`);
`reciprocal` and `uniform` are the paper's Table 4; `merge=off` only evicts. Defaults: the
`official` variant (docs/methods.md, the D2O table, has the measured reason), 4 sinks, group
reduction mean. In a batch, every sequence gets its own budgets (kvmini.per_sequence.PerSequence).
Deviation: the authors' code keeps one cache per query head (after repeat_kv), so each query
head evicts and merges its own tokens; kvmini does this per KV head (query heads of a group
reduced by mean), in both variants.
Deviation: `clamp_budgets` (default true, both variants) gives a layer at least sinks + 4 tokens
and at most n, handing the excess to the other layers; Eq. 5 does neither. With `allocation=official`
the authors' code already clamps each layer's ratio to [0.01, 1] (1% of the layer to all of it) and
hands nothing on; kvmini then only raises the floor to sinks + 4 (1% of a short prompt is less than
the sinks) and redistributes nothing.
`clamp_budgets=false` runs Eq. 5 literally: a budget too small for a layer's sinks and recent
tokens is then a KvminiError.
Deviation: the authors' code never resets its EMA threshold between prompts (`_clean_scores`
clears only the scores), so from the second prompt on its tau_0 mixes in the previous prompt's;
kvmini starts every run afresh (Policy.start), in both variants.
Deviation: the authors' code treats a layer budgeted n - 1 or more (reachable at rho >= 0.4) in three
ways, by its two branches in `LlamaAttention3_D2O.forward`: budgeted n + 1, it is never compressed and
grows; budgeted n, it is compressed at every step but the prompt's column sums are added to its scores
again at each one (by buffer slot), so it keeps other tokens from the second decode step on; budgeted
n - 1, the code fails with a size mismatch at the third decode step. kvmini holds every layer at its
budget and counts each query's attention once (tests/test_official_references.py).
With `start=first_decode` (official) nothing is compressed before the first decode step: a
prefill-only call leaves the prompt whole, as the authors' code does.
A prompt in chunks (kvmini.policy) gives the same F_v, scores and budgets as the prompt in one call.
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.cache import KEY_NORM
from kvmini.methods import options
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.selectors import TopK
from kvmini.methods.variance_softmax import VarianceSoftmax
from kvmini.parts import AFTER_PROMPT, DECODE, Rule
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options:
    allocation: options.Allocation = options.allocation("official")
    protected_layers: options.Layers = options.protected_layers((0, 1, -1))
    nm: options.Ratio = options.option((1, 1), "heavy:recent split of the budget, e.g. 3:1",
                                       lambda x: sum(x) > 0, "have N + M > 0")
    split: Literal["paper", "official"] = options.option(
        "official", "paper (sinks + N + M = budget) | official (the sinks inside the N heavy)")
    merge: Literal["paper", "official", "off"] = options.option(
        "official", "paper (convex, Eq. 11-12) | official (raw-cosine scatter-mean) | off")
    tau: Literal["per_head", "per_layer"] = options.option("per_layer", "merge threshold per_head | per_layer")
    beta: float = options.beta(0.5)
    start: Literal["prompt", "first_decode"] = options.option(
        "first_decode", "compress when the prompt ends (prompt) or at the first decode step (first_decode)")
    sinks: int = options.sinks(4)
    softmax_temperature: float = options.softmax_temperature(1.0)
    clamp_budgets: bool = options.option(True, "clamp each layer's budget to [sinks + 4, n] and give the excess to "
                                               "the others (kvmini's; false: Eq. 5 as written)")
    reduce: options.Reduce = options.reduce()


VARIANTS = {"paper": Options(allocation="paper", protected_layers=(), nm=(3, 1), split="paper", merge="paper",
                             tau="per_head", beta=0.7, start="prompt"),
            "official": Options()}
DEFAULT_VARIANT = "official"


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings -> the setting that makes them idle (given, they
    are refused: kvmini.methods.registry.make_policy)."""
    found = options.idle_temperature(o)
    if o.merge == "off":
        found.update(beta="--merge off (beta and tau set the merge)", tau="--merge off (beta and tau set the merge)")
    return found


def build(budget: float, o: Options = Options()) -> Policy:
    N, M = o.nm
    if o.split == "paper":  # Eq. 8: S_l = T + N + M, N:M of what is not a sink
        recent = Rule(f"(budget - {o.sinks}) * {M} // {N + M}", lambda S_l: (S_l - o.sinks) * M // (N + M))
    else:  # the official code: N:M of S_l, the sinks inside the heavy part
        recent = Rule(f"budget * {M} // {N + M}", lambda S_l: S_l * M // (N + M))
    first_decode = o.start == "first_decode"
    budgeter = VarianceSoftmax(o.allocation, o.softmax_temperature, o.sinks + 4, o.reduce, o.protected_layers,
                               parts=(N, M), measure_in_prompt=first_decode, clamp=o.clamp_budgets)
    merging = None if o.merge == "off" else EMAMerge(o.beta, weights=o.merge, tau=o.tau)
    scorer = CumulativeAttention(o.reduce)
    if merging is not None:  # Eq. 9 divides by the kept keys' norms: the cache keeps them from each append
        scorer.aux = scorer.aux + (KEY_NORM,)  # in a buffer the policy declares with the scorer's own
    return Policy("d2o", budget, scorer, budgeter, TopK(o.sinks, recent, merge=merging),
                  schedule=DECODE if first_decode else AFTER_PROMPT)
