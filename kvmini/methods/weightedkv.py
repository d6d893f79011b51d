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
from dataclasses import dataclass
from typing import Literal

from kvmini.methods.allocators import Uniform
from kvmini.methods.average_attention import AverageAttention
from kvmini.methods.convex_value_merge import ConvexValueMerge
from kvmini.methods.topk import TopK
from kvmini.budget import Rule
from kvmini.parts import EVERY_CALL
from kvmini.policy import Policy

HALF_BEYOND_8 = Rule("(budget - 8) // 2", lambda m: max((m - 8) // 2, 0))  # Sec. V-A: 1024 -> 508, 256 -> 124
CHUNK = Rule("max(budget, 64)", lambda m: max(m, 64))  # the prompt's chunks: the cache holds at most 2m


@dataclass(frozen=True)
class Options:
    sinks: int = 4  # first tokens always kept
    recent: int | Rule = HALF_BEYOND_8  # most recent tokens always kept
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined
    # a prefill chunk's merges all at once (runs) or one by one in Alg. 1's order (sequential)
    chunk_merge: Literal["runs", "sequential"] = "runs"
    # convex: the weakest token's value merged into its neighbour (Alg. 1 line 9) | off: dropped, key and value (an ablation)
    value_merge: Literal["convex", "off"] = "convex"


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings (given, they are refused)."""
    return {"chunk_merge": "--value-merge off (nothing is merged)"} if o.value_merge == "off" else {}


def build(budget: float, o: Options = Options()) -> Policy:
    compressor = TopK(o.sinks, o.recent) if o.value_merge == "off" else ConvexValueMerge(o.sinks, o.recent, o.chunk_merge)
    return Policy("weightedkv", budget, AverageAttention(o.reduce), Uniform(), compressor, schedule=EVERY_CALL,
                  prefill_chunk=CHUNK)
