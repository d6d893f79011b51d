"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention + a recent window, every step.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models".

Score = attention each token has received, summed over every query so far (prefill column
sums, then + each decode step's row), per KV head. Keep the heavy hitters and a recent window
(default: half of the budget each). The cache is trimmed after the prompt, then one token (the
lowest-scoring one outside the window) is evicted per decode step.
Defaults: window = budget // 2, sinks 0, group reduction mean.
"""
from kvmini.methods.scorers import CumulativeAttention
from kvmini.policy import EVERY_CALL, Policy

DEFAULTS_SHOWN = {"window": "budget // 2"}


def build(budget: float, window: int | None = None, reduce: str = "mean") -> Policy:
    recent = (lambda b: b // 2) if window is None else (lambda b: window)
    return Policy("h2o", budget, scorer=CumulativeAttention(reduce), recent=recent, schedule=EVERY_CALL)
