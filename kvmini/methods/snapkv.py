"""SnapKV (Li et al. 2024): keys the last prompt window attends to (pooled), once after prefill.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation".

Prefill only. The last `window` prompt tokens are the observation window: their attention
over the earlier keys is summed, pooled along the keys (kernel 7) and the top budget - window
keys are kept together with the window itself. Decode steps append without compressing.
Defaults: window 32, kernel 7, pooling avg (the official code's default; max is an option),
group reduction mean. Compression happens layer by layer inside the prefill forward.
"""
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvmini.cache import LayerCache
from kvmini.errors import one_of
from kvmini.methods.allocators import Uniform
from kvmini.methods.topk import TopK
from kvmini.parts import PREFILL, Scorer
from kvmini.policy import Policy
from kvmini.statistics import Request, Stats, window_sums


class WindowAttention(Scorer):
    r"""SnapKV (Li et al. 2024, Sec. 4.2): C_j = \sum_{i \in window} A_{ij} over the last w queries,
    then pooled along the keys (kernel k, stride 1, zero padding k // 2) to keep neighbourhoods.
    The window itself is always kept (the recent tokens): its scores are +inf. A row holding fewer
    entries than the layer (kvmini.cache) has its window in its own last w; its pads score -inf."""

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "avg", reduce: str = "mean"):
        self.window, self.kernel, self.pooling = window, kernel, one_of("WindowAttention pooling", pooling, ("avg", "max"))
        self.request = Request(window_sums(window, reduce))

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        C = stats.window_sums  # (B, H_kv, S), 0 at pads
        B, H_kv, S = C.shape
        held, slot = lc.held()[..., None], torch.arange(S, device=C.device)  # (B, H_kv, 1), (S,)
        earlier = slot < held - self.window  # (B, H_kv, S): before the row's window
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        # zeros from the window on act as the pooling's zero padding (C >= 0, so also for max)
        pooled = pool(C.masked_fill(~earlier, 0).view(B * H_kv, 1, S), self.kernel, stride=1,
                      padding=self.kernel // 2).view(B, H_kv, S)
        return torch.where(earlier, pooled, torch.where(slot < held, float("inf"), float("-inf")))


@dataclass(frozen=True)
class Options:
    window: int = 32  # observation window: the last prompt tokens whose attention scores the others; always kept
    kernel: int = 7  # pooling kernel along the keys
    pooling: Literal["avg", "max"] = "avg"  # pooling of the window's scores along the keys
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("snapkv", budget, WindowAttention(o.window, o.kernel, o.pooling, o.reduce), Uniform(),
                  TopK(recent=o.window), schedule=PREFILL)
