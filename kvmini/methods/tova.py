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

import torch

from kvmini.cache import LayerCache
from kvmini.methods.allocators import Uniform
from kvmini.methods.selectors import TopK
from kvmini.parts import EVERY_CALL, Rule, Scorer
from kvmini.policy import Policy
from kvmini.statistics import Request, Stats, last_row


class LastRowAttention(Scorer):
    r"""TOVA (Oren et al. 2024): s_j = A_{tj}, the attention of the latest query only."""

    def __init__(self, reduce: str = "mean"):
        self.request = Request(last_row(reduce))

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return stats.last_row


@dataclass(frozen=True)
class Options:
    sinks: int = 0  # first tokens always kept
    recent: int | Rule = 0  # most recent tokens always kept
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("tova", budget, LastRowAttention(o.reduce), Uniform(), TopK(o.sinks, o.recent), schedule=EVERY_CALL)
