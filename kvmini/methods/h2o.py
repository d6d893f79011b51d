"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention + a recent window, after every call.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models".

Score = attention each token has received, summed over every query so far (prefill column
sums, then + each decode step's row), per KV head. Keep the heavy hitters and a recent window
(default: half of the budget each). The cache is trimmed after the prompt, then one token (the
lowest-scoring one outside the window) is evicted per decode step.
Defaults: recent = budget // 2, sinks 0, group reduction mean.
Chunked prefill: compressed after every call by design (each prefill chunk, each decode step), so
a prompt in chunks of c is trimmed to the budget after each chunk: later chunks attend to the
trimmed cache and a token's score sums only the attention it received while it stayed, so the
kept set depends on c (c = 1 is H2O's token-by-token eviction during the prompt).
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.selectors import TopK
from kvmini.parts import EVERY_CALL, Budgeter, Rule
from kvmini.policy import Policy

HALF = Rule("budget // 2", lambda b: b // 2)


@dataclass(frozen=True)
class Options:
    recent: int | Rule = HALF  # most recent tokens always kept
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("h2o", budget, CumulativeAttention(o.reduce), Budgeter(), TopK(recent=o.recent), schedule=EVERY_CALL)
