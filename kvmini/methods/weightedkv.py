"""WeightedKV (Yuan et al. 2025): drop the key, merge the value into its neighbour, after every call.

Paper: "WeightedKV: Attention Scores Weighted Key-Value Cache Merging for Large Language Models" (Jian Yuan
et al., 2025; arXiv 2503.01330).

A fixed capacity m (the budget) per layer. Tokens are ranked by average attention a/n; the
weakest non-protected token's value is merged convexly into its right neighbour and its key
dropped (kvmini.methods.convex_value_merge), after every forward call.
Defaults (Sec. V-A): 4 sinks, recent window (m - 8) // 2 (1024 -> 508, 256 -> 124), reduction
mean. The prompt is prefilled in chunks of m tokens (at least 64), so the cache never holds more
than 2m entries; run.py `--chunk-size 1` is Alg. 1 token by token, and `chunk_merge` says how a
chunk's merges are done (see kvmini.methods.convex_value_merge: "runs", all at once, the default;
"sequential", Alg. 1's order).
Chunked prefill: merged after every call by design (Alg. 1 merges at every step), so the chunk
size changes what is kept and merged: c = 1 is Alg. 1 exactly; larger chunks first attend with
up to c extra entries, then merge them down.
"""
from kvmini.methods.allocators import Uniform
from kvmini.methods.convex_value_merge import AverageAttention, ConvexValueMerge
from kvmini.parts import EVERY_CALL
from kvmini.policy import Policy

DEFAULTS_SHOWN = {"recent": "(budget - 8) // 2"}


CHUNK_MERGES = ("runs", "sequential")


def build(budget: float, sinks: int = 4, recent: int | None = None, reduce: str = "mean",
          chunk_merge: str = "runs") -> Policy:
    window = (lambda m: max((m - 8) // 2, 0)) if recent is None else (lambda m: recent)
    return Policy("weightedkv", budget, AverageAttention(reduce), Uniform(),
                  ConvexValueMerge(sinks, recent=window, chunk_merge=chunk_merge), schedule=EVERY_CALL,
                  prefill_chunk=lambda m: max(m, 64))
