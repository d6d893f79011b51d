"""D2O: variance-softmax layer budgets + H2O eviction with EMA-threshold merging.

"D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language Models",
Zhongwei Wan et al., ICLR 2025, arXiv 2406.13035.

    scorer       cumulative attention (H2O), per KV head
    budgeter     S_l from the variance of each layer's prompt attention (Eq. 4-5: variance_softmax)
    compressor   T sinks + N heavy + M recent (Eq. 6-8); an evicted token merged into its nearest
                 kept one when similar enough (Eq. 9-12: ema_merging)
    schedule     when the prompt is complete (paper) or at the first decode step (official), then every step

Variants `paper` (the equations) and `official` (AIoT-MLSys-Lab/D2O): docs/methods.md, "D2O".
Deviation: one cache per KV head (the g query heads reduced by mean); the authors' code keeps one per query head.
Deviation: `clamp_budgets` (default) bounds each S_l to [sinks + 4, n] and hands on the excess; Eq. 5 does not.
Deviation: the EMA threshold restarts with every run; the authors' code never resets it.
Deviation: every layer is held at its budget, also one budgeted n - 1 or more (the authors' code does not).
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.cache import KEY_NORM
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.topk import TopK
from kvmini.methods.variance_softmax import VarianceSoftmax, idle_temperature
from kvmini.budget import Rule
from kvmini.parts import AFTER_PROMPT, DECODE
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options:
    # D2O's layer allocation: official (min-max) | paper (softmax(-F_v)) | zscore (kvmini's)
    # | reciprocal | uniform (Table 4)
    allocation: Literal["official", "paper", "zscore", "reciprocal", "uniform"] = "official"
    protected_layers: tuple[int, ...] = (0, 1, -1)  # layers never compressed, -1 the last, e.g. 0,1 (empty: none)
    nm: tuple[int, int] = (1, 1)  # heavy:recent split of the budget, e.g. 3:1
    # paper (sinks + N + M = budget) | official (the sinks inside the N heavy)
    split: Literal["paper", "official"] = "official"
    # paper (convex, Eq. 11-12) | official (raw-cosine scatter-mean) | off
    merge: Literal["paper", "official", "off"] = "official"
    merge_writes: Literal["both", "keys", "values"] = "both"  # what a merge overwrites (keys or values alone: an ablation)
    tau: Literal["per_head", "per_layer"] = "per_layer"  # merge threshold per_head | per_layer
    beta: float = 0.5  # EMA weight of the newest similarity in D2O's merge threshold (Eq. 10)
    # compress when the prompt ends (prompt) or at the first decode step (first_decode)
    start: Literal["prompt", "first_decode"] = "first_decode"
    sinks: int = 4  # first tokens always kept
    softmax_temperature: float = 1.0  # temperature of D2O's softmax over standardized variances (allocation=zscore)
    # clamp each layer's budget to [sinks + 4, n] and give the excess to the others (kvmini's; false: Eq. 5 as written)
    clamp_budgets: bool = True
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


VARIANTS = {"paper": Options(allocation="paper", protected_layers=(), nm=(3, 1), split="paper", merge="paper",
                             tau="per_head", beta=0.7, start="prompt"),
            "official": Options()}
DEFAULT_VARIANT = "official"


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings -> the setting that makes them idle (given, they
    are refused: kvmini.methods.registry.make_policy)."""
    found = idle_temperature(o)
    if o.merge == "off":
        found.update({key: "--merge off (beta, tau and merge_writes set the merge)" for key in ("beta", "tau", "merge_writes")})
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
    merging = None if o.merge == "off" else EMAMerge(o.beta, weights=o.merge, tau=o.tau, writes=o.merge_writes)
    scorer = CumulativeAttention(o.reduce)
    if merging is not None:  # Eq. 9 divides by the kept keys' norms: the cache keeps them from each append
        scorer.aux = scorer.aux + (KEY_NORM,)  # in a buffer the policy declares with the scorer's own
    return Policy("d2o", budget, scorer, budgeter, TopK(o.sinks, recent, merge=merging),
                  schedule=DECODE if first_decode else AFTER_PROMPT)
