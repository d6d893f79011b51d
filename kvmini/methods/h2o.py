r"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention + a recent window, after every call.

"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
Zhenyu Zhang et al., NeurIPS 2023, arXiv 2306.14048.

    s_j = \sum_{i \le t} A_{ij}  (per KV head);  kept: the `recent` newest + the budget - recent highest s_j
Compressed after every call (each prefill chunk, each decode step: docs/design.md, "One forward call").
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
