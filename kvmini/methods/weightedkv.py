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

import torch

from kvmini.budget import Rule
from kvmini.methods.convex_value_merge import merge_down
from kvmini.methods.merged import Merged
from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink
from kvmini.attention import Statistic

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


def attended(lc, column_sums: torch.Tensor, start: int, T: int) -> None:
    """Alg. 1 lines 4-5 after a call of T queries at positions start..start+T-1: a_j += the attention token j
    received, n_j += the queries that could see it (from max(p_j, start) on), (B, H_kv, S) each."""
    lc.aux("a").add_(column_sums)  # line 4
    lc.aux("n").add_(T - (lc.positions - start).clamp(min=0))  # line 5


class WeightedKV(Method):
    aux = ("a", "n")  # Alg. 1 lines 4-5, per cached token: the attention it received, and from how many queries
    prefill_chunk = CHUNK

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("weightedkv", budget)
        self.sinks, self.recent, self.reduce = o.sinks, Rule.of_(o.recent, "recent"), o.reduce
        self.merges, self.sequential = o.value_merge == "convex", o.chunk_merge == "sequential"
        self.trace: list[Merged] | None = None  # a list to record the merges in (kvmini.view), or None

    merger = property(lambda self: self if self.merges else None)

    def before(self, cache, step) -> dict | None:
        if step.start == 0 and self.trace is not None:
            self.trace.clear()  # a new run
        return {"column_sums": Statistic(reduce=self.reduce)} if step.keeps_sums else None  # this call's A_ij, summed over i

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.keeps_sums:
            attended(lc, stats["column_sums"], step.start, step.T)  # lines 4-5
        if not step.compresses or lc.length <= b + step.slack:  # every call: a prefill chunk, or one decode step
            return
        self.evicted[layer] += lc.length - b
        if not self.merges:  # the ablation: the weakest tokens dropped, key and value
            shrink(lc, lc.aux("a") / lc.aux("n"), b, self.sinks, self.recent(b), step.newest)
            return
        self.run.merged[layer] += lc.length - b
        note = None if self.trace is None else lambda *record: self.trace.append(Merged(layer, *record))
        merge_down(lc, b, self.sinks, self.recent(b), step.newest, self.sequential, note)  # lines 6-10

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return "average attention a/n (WeightedKV's ranking)", lc.aux("a") / lc.aux("n")


def build(budget: float, o: Options = Options()) -> WeightedKV:
    return WeightedKV(budget, o)
