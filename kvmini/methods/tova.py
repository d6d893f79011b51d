"""TOVA (Oren et al. 2024): evict the token the latest query attends to least, after every call.

Paper: "Transformers are Multi-State RNNs".

Score = the latest query's attention row only. After the prompt the cache keeps the budget's
best tokens by the last prompt token's attention; afterwards each step evicts the lowest one.
Defaults: no sinks, no protected window, group reduction mean.
Chunked prefill: compressed after every call by design, so a prompt in chunks of c is trimmed
after each chunk by that chunk's last query (c = 1 is the paper's token-by-token TOVA); the kept
set depends on c.
Deviation: scores are per KV head (the g query heads of a group averaged); the paper averages
over all heads of a layer, so one layer evicts the same token in every head.
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink
from kvmini.budget import Rule
from kvmini.attention import Statistic


@dataclass(frozen=True)
class Options:
    sinks: int = 0  # first tokens always kept
    recent: int | Rule = 0  # most recent tokens always kept
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


class TOVA(Method):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("tova", budget)
        self.sinks, self.recent, self.reduce = o.sinks, Rule.of_(o.recent, "recent"), o.reduce

    def before(self, cache, step) -> dict | None:
        return {"last_row": Statistic(last=1, reduce=self.reduce)} if step.compresses else None  # A_tj: the latest query's row

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.compresses and lc.length > b + step.slack:  # every call: a prompt chunk, or one decode step
            self.evicted[layer] += lc.length - b
            shrink(lc, stats["last_row"], b, self.sinks, self.recent(b), step.newest)  # the lowest A_tj goes


def build(budget: float, o: Options = Options()) -> TOVA:
    return TOVA(budget, o)
