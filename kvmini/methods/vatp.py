r"""VATP (Guo et al. 2024): H2O's accumulated attention weighted by the norm of each token's value.

Paper: "Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction:
Value Also Matters", Zhiyu Guo, Hidetaka Kamigaito, Taro Watanabe (EMNLP 2024; arXiv 2406.12335).
Authors' code: guozhiyu/vatp.

A token that receives much attention but carries a small value vector adds little to the output
(the output is sum_j A_ij v_j), so the score of a cached token is its accumulated attention times
the norm of its value, per KV head: the l1 norm in the paper (`value_norm=l1`, p = 1), or the l2
norm (`value_norm=l2`, p = 2):

    s_j = \|v_j\|_p \sum_{i \le t} A_{ij}

Everything else is H2O's (kvmini.methods.h2o): the recent window, one eviction per decode step,
compression after every call. The first `sinks` tokens are always kept, as the authors' code does
(the first tokens' values tend to be small, so their score would be low although attention sinks
matter). Defaults: 4 sinks (the authors' example command keeps 20 on Llama-2-7B), recent =
budget // 2, l1 norm, group reduction mean. `value_norm=off` is H2O with sinks.
Chunked prefill: compressed after every call by design, as H2O.
Deviation: the authors' code scores per query head (Llama-2 has no grouped heads); kvmini per KV
head, the query heads of a group reduced by mean. Their code multiplies each step's column sums
by the norms before adding them up; the norm of a kept value never changes (VATP does not merge), so
the sum is the same, and kvmini computes each norm once, when the value is cached, and keeps it beside
it (the aux buffer `value_norm`): a step reads S norms instead of the S x D values.
This module is the method built in tutorials/09_write_your_own_method.py.
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.budget import Rule
from kvmini.cache import wide
from kvmini.methods.h2o import HALF
from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink
from kvmini.attention import Statistic


@dataclass(frozen=True)
class Options:
    sinks: int = 4  # first tokens always kept
    recent: int | Rule = HALF  # most recent tokens always kept
    # VATP: weight the attention score by the value's l1 norm (the paper), l2, or not at all (H2O)
    value_norm: Literal["l1", "l2", "off"] = "l1"
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


class VATP(Method):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("vatp", budget)
        self.sinks, self.recent, self.reduce = o.sinks, Rule.of_(o.recent, "recent"), o.reduce
        self.p = {"l1": 1.0, "l2": 2.0, "off": None}[o.value_norm]  # None: no weighting (H2O with sinks)
        self.aux = ("attention_sum",) + (() if self.p is None else ("value_norm",))  # per cached token

    def before(self, cache, step) -> dict | None:
        return {"column_sums": Statistic(reduce=self.reduce)} if step.keeps_sums else None  # this call's A_ij, summed over i

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.keeps_sums:
            lc.aux("attention_sum").add_(stats["column_sums"])  # sum_{i <= t} A_ij, as H2O's (B, H_kv, S)
            if self.p is not None:
                self.keep_norms(lc, step.T)  # ||v_j||_p of the values this call cached
        if step.compresses and lc.length > b + step.slack:  # every call: a prompt chunk, or one decode step
            self.evicted[layer] += lc.length - b
            shrink(lc, self.score(lc), b, self.sinks, self.recent(b), step.newest)  # sinks + top s_j + window

    def score(self, lc) -> torch.Tensor:
        r"""s_j = \|v_j\|_p \sum_{i \le t} A_{ij}, (B, H_kv, S)."""
        received = lc.aux("attention_sum")
        return received if self.p is None else received * lc.aux("value_norm")

    def keep_norms(self, lc, T: int) -> None:
        """The norms of the T newest values: the layer's last T places (VATP's rows all keep one budget, so no
        row holds fewer than another)."""
        lc.aux("value_norm")[:, :, -T:] = self.norm(wide(lc.values[:, :, -T:]))  # (B, H_kv, T)

    def norm(self, values: torch.Tensor) -> torch.Tensor:
        r"""\|v_j\|_p of each value: values (..., S, D) -> (..., S)."""
        # BEGIN EXERCISE value_norm: tutorials/09_write_your_own_method.py, "The score"
        # l1 as |v|.sum(): torch's general p-norm is some 12x slower for p = 1 on CPU
        return values.abs().sum(-1) if self.p == 1 else torch.linalg.vector_norm(values, ord=self.p, dim=-1)
        # END EXERCISE

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        if self.p is None:
            return "accumulated attention (H2O's score: summed over every query so far)", lc.aux("attention_sum")
        return f"accumulated attention times the value's l{self.p:g} norm (VATP's score)", self.score(lc)


def build(budget: float, o: Options = Options()) -> VATP:
    return VATP(budget, o)
