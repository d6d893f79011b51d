r"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention + a recent window, after every call.

"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
Zhenyu Zhang et al., NeurIPS 2023, arXiv 2306.14048.

    s_j = \sum_{i \le t} A_{ij}  (per KV head);  kept: the `recent` newest + the budget - recent highest s_j
Compressed after every call (each prefill chunk, each decode step).
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink
from kvmini.budget import Rule
from kvmini.attention import Statistic

HALF = Rule("budget // 2", lambda b: b // 2)


@dataclass(frozen=True)
class Options:
    recent: int | Rule = HALF  # most recent tokens always kept
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


class H2O(Method):
    aux = ("attention_sum",)  # s_j of every cached token, per KV head

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("h2o", budget)
        self.recent, self.reduce = Rule.of_(o.recent, "recent"), o.reduce  # recent(b): the window of budget b

    def before(self, cache, step) -> dict | None:
        return {"column_sums": Statistic(reduce=self.reduce)} if step.keeps_sums else None  # this call's A_ij, summed over i

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b, s = cache[layer], step.budgets[layer], cache[layer].aux("attention_sum")  # s: s_j, (B, H_kv, S)
        if step.keeps_sums:
            s.add_(stats["column_sums"])  # s_j += \sum_i A_ij over this call's queries
        if step.compresses and lc.length > b + step.slack:  # every call: a prompt chunk, or one decode step
            self.evicted[layer] += lc.length - b
            shrink(lc, s, b, sinks=0, recent=self.recent(b), newest=step.newest)  # the top s_j + the recent window

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return "accumulated attention (H2O's score: summed over every query so far)", lc.aux("attention_sum")


def build(budget: float, o: Options = Options()) -> H2O:
    return H2O(budget, o)
