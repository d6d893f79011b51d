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
by the norms before adding them up; the norm of a kept value never changes, so the sum is the same,
and kvmini computes each norm once, when the value is cached (the aux buffer `value_norm`).
This module is the method built in tutorials/09_write_your_own_method.py.
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.statistics import Stats
from kvmini.cache import LayerCache, wide
from kvmini.methods.allocators import Uniform
from kvmini.methods.h2o import HALF
from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.topk import TopK
from kvmini.budget import Rule
from kvmini.parts import EVERY_CALL
from kvmini.policy import Policy


class ValueWeightedAttention(CumulativeAttention):
    r"""s_j = \|v_j\|_p \sum_{i \le t} A_{ij}: H2O's running column sums (kept in lc.aux by `update`)
    times each cached value's norm (p = 1 in the paper, 2 for value_norm=l2, None: no weighting).
    A value never changes once cached (VATP does not merge), so its norm is computed once, by `update`
    in the call that appends it, and kept beside it in the aux buffer `value_norm` (B, H_kv, S): a step
    reads S norms instead of recomputing them from the S x D values."""

    def __init__(self, reduce: str = "mean", p: float | None = 1.0):
        super().__init__(reduce)
        self.p = p  # None: no weighting (H2O)
        self.aux = CumulativeAttention.aux + (() if p is None else ("value_norm",))

    def norm(self, values: torch.Tensor) -> torch.Tensor:
        r"""\|v_j\|_p of each value: values (..., S, D) -> (..., S)."""
        # BEGIN EXERCISE value_norm: tutorials/09_write_your_own_method.py, "The scorer"
        # l1 as |v|.sum(): torch's general p-norm is some 12x slower for p = 1 on CPU
        return values.abs().sum(-1) if self.p == 1 else torch.linalg.vector_norm(values, ord=self.p, dim=-1)
        # END EXERCISE

    def update(self, lc: LayerCache, stats: Stats, start: int, T: int) -> None:
        """After a call of T queries: the column sums (H2O's), and the norms of the T values it appended."""
        super().update(lc, stats, start, T)
        if self.p is None:
            return
        at = lc.held()[..., None] - T + torch.arange(T, device=lc.values.device)  # (B, H_kv, T): each row's last T
        new = lc.values.gather(2, at[..., None].expand(-1, -1, -1, lc.values.shape[-1]))  # (B, H_kv, T, D)
        lc.aux("value_norm").scatter_(2, at, self.norm(wide(new)))

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        received = super().__call__(lc, stats)  # (B, H_kv, S)
        return received if self.p is None else received * lc.aux("value_norm")  # (B, H_kv, S)

    def describe(self, lc: LayerCache) -> tuple[str, torch.Tensor | None]:
        if self.p is None:
            return super().describe(lc)
        return f"accumulated attention times the value's l{self.p:g} norm (VATP's score)", self(lc, None)


@dataclass(frozen=True)
class Options:
    sinks: int = 4  # first tokens always kept
    recent: int | Rule = HALF  # most recent tokens always kept
    # VATP: weight the attention score by the value's l1 norm (the paper), l2, or not at all (H2O)
    value_norm: Literal["l1", "l2", "off"] = "l1"
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


def build(budget: float, o: Options = Options()) -> Policy:
    p = {"l1": 1.0, "l2": 2.0, "off": None}[o.value_norm]
    return Policy("vatp", budget, ValueWeightedAttention(o.reduce, p), Uniform(), TopK(o.sinks, o.recent),
                  schedule=EVERY_CALL)
