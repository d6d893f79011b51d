r"""Ada-KV (Feng et al. 2024): a layer's budget is spent across its heads, so each head keeps its own count.

Paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
Yuan Feng, Junlin Lv, Yukun Cao, Xike Xie, S. Kevin Zhou (arXiv 2407.11550). Authors' code: FFY0/AdaKV
@ efe4e2e, Ada-SnapKV, `adaptive_snapkv/monkeypatch/snapkv_utils.py` (cited below as :line).

Scores are SnapKV's (kvmini.methods.snapkv): the last w prompt queries' attention, pooled along the keys
(:335-370). With b entries per KV head on average and the window of w always kept, a layer of H_kv heads
chooses H_kv c entries, c = b - w, among the heads' earlier entries:

    n_h = how many of the layer's H_kv c highest scores, all heads together, are head h's   (:449-458)
    c_h = round((1 - \alpha) n_h + \lfloor \alpha c \rfloor)   the safeguard: every head gets a floor (:305, :460)

and head h keeps its c_h best entries and its window (:478-489). \alpha = 0 is the allocation alone.
Defaults are the code's runs (experiments/LongBench/pred.py:27-29, monkeypatch.py:34): window 32,
kernel 7, max pooling, \alpha = 0.2, the query heads of a KV head averaged (`--gqa_support`, `gqa_func`
mean). Prefill only, once per prompt; decode steps append to every head.
Deviation: the authors' code keeps each head's entries in score order; kvmini keeps position order
(attention masks by position, so the outputs are the same).
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.methods import snapkv
from kvmini.methods.snapkv import SnapKV


def across_heads(score: torch.Tensor, b: int, window: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which entries each head of a layer keeps, (idx (B, H_kv, S'), counts (B, H_kv)): the window of every head
    and the layer's best H_kv (b - w) earlier entries shared out over the heads with a floor (the module
    docstring). score (B, H_kv, S): SnapKV's, +inf in the window, -inf at pads. Row r keeps its first
    counts[r] of idx, in position order; the rest become pads (`LayerCache.keep(idx, counts)`)."""
    B, H_kv, S = score.shape
    c = b - window  # earlier entries each head keeps on average
    earlier = score.isfinite()  # (B, H_kv, S)
    best = score.masked_fill(~earlier, float("-inf")).flatten(1).topk(H_kv * c, dim=-1).indices  # (B, H_kv c)
    counted = earlier.flatten(1).gather(1, best).long()  # a pick among pads or windows counts for nobody
    n = torch.zeros(B, H_kv, dtype=torch.long, device=score.device).scatter_add_(1, best // S, counted)  # n_h, :449-458
    c_h = torch.round(n * (1 - alpha) + int(c * alpha)).long()  # (B, H_kv), the floor: :305 and :460
    counts = (score == float("inf")).sum(-1) + torch.minimum(c_h, earlier.sum(-1))  # window + c_h
    ranked = score.sort(dim=-1, descending=True, stable=True).indices[..., : int(counts.max())]  # window first
    chosen = torch.arange(ranked.shape[-1], device=score.device) < counts[..., None]
    idx = torch.where(chosen, ranked, ranked + S).sort(-1).values  # the chosen first, in position order
    return torch.where(idx >= S, idx - S, idx), counts  # the rest: places that become pads


@dataclass(frozen=True)
class Options:
    window: int = 32  # observation window: the last prompt tokens whose attention scores the others; always kept
    kernel: int = 7  # pooling kernel along the keys
    pooling: Literal["avg", "max"] = "max"  # pooling of the window's scores along the keys
    alpha: float = 0.2  # the safeguard: the share of each head's budget given as a floor (0: the allocation alone)


CHECKS = {"alpha": (lambda x: 0 <= x <= 1, "be in [0, 1]")}


class AdaKV(SnapKV):
    own_counts = True  # the heads of a layer keep their own counts

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__(budget, snapkv.Options(o.window, o.kernel, o.pooling), "adakv")  # query heads averaged
        self.alpha = o.alpha

    def before(self, cache, step) -> dict | None:
        if step.start == 0:
            self.kept = {}  # layer -> (B, H_kv) entries each head kept in this run: its own budget
        return super().before(cache, step)

    def select(self, layer: int, lc, score: torch.Tensor, b: int, newest: int) -> None:
        idx, self.kept[layer] = across_heads(score, b, self.window, self.alpha)
        lc.keep(idx, self.kept[layer])


def build(budget: float, o: Options = Options()) -> AdaKV:
    return AdaKV(budget, o)
