"""WeightedKV (Yuan et al. 2025): drop the key, merge the value into its neighbour, every step.

Paper: "WeightedKV: Attention Scores Weighted Key-Value Cache Merging for Large Language Models".

A fixed capacity m (the budget) per layer. Tokens are ranked by average attention a/n; the
weakest non-protected token's value is merged convexly into its right neighbour and its key
dropped (kvmini.methods.convex_value_merge), after every forward call.
Defaults (Sec. V-A): 4 sinks, recent window (m - 8) // 2 (1024 -> 508, 256 -> 124), reduction
mean; the prompt is prefilled in chunks of 64 tokens (run.py `--chunk-size 1` is Alg. 1 token by token).
"""
from kvmini.methods.convex_value_merge import AverageAttention, convex_value_merge
from kvmini.policy import EVERY_CALL, Policy

DEFAULTS_SHOWN = {"window": "(budget - 8) // 2"}


def build(budget: float, sinks: int = 4, window: int | None = None, reduce: str = "mean") -> Policy:
    recent = (lambda m: max((m - 8) // 2, 0)) if window is None else (lambda m: window)
    return Policy("weightedkv", budget, scorer=AverageAttention(reduce), reducer=convex_value_merge,
                  sinks=sinks, recent=recent, schedule=EVERY_CALL, prefill_chunk=64)
