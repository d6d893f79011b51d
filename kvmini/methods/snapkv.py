r"""SnapKV (Li et al. 2024): keys the last prompt window attends to (pooled), once after prefill.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation", Yuhong Li et al., arXiv 2404.14469.

Prefill only. The last `window` prompt tokens are the observation window: their attention over the
earlier keys is summed, pooled along the keys (kernel 7) and the top budget - window keys are kept
together with the window itself. Decode steps append without compressing. A prompt fed in chunks
adds up its window queries' rows chunk by chunk; the call that completes it compresses.
Defaults: window 32, kernel 7, pooling avg (the official code's default; max is an option),
group reduction mean.
"""
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvmini.errors import one_of
from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink
from kvmini.attention import Statistic, add_up, reduce_heads


def window_scores(C: torch.Tensor, held: torch.Tensor, window: int, kernel: int, pooling: str) -> torch.Tensor:
    r"""SnapKV (Sec. 4.2): C_j = \sum_{i \in window} A_{ij}, (B, H_kv, S), pooled along the keys (kernel k,
    stride 1, zero padding k // 2) to keep neighbourhoods. The window itself is always kept: its scores
    are +inf. A row holding fewer entries (held (B, H_kv)) has its window in its own last w; pads -inf."""
    B, H_kv, S = C.shape
    slot = torch.arange(S, device=C.device)
    earlier = slot < held[..., None] - window  # (B, H_kv, S): before the row's window
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    # zeros from the window on act as the pooling's zero padding (C >= 0, so also for max)
    pooled = pool(C.masked_fill(~earlier, 0).view(B * H_kv, 1, S), kernel, stride=1, padding=kernel // 2).view(B, H_kv, S)
    return torch.where(earlier, pooled, torch.where(slot < held[..., None], float("inf"), float("-inf")))


def window_scores_of(lc, C: torch.Tensor, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """`window_scores` of a layer's entries, C (B, H_kv, S) in buffer order: pooled along positions (an eviction
    that moved an entry into another's slot leaves neighbours by slot that are not neighbours by position)."""
    order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order, pads last
    pooled = window_scores(C.gather(2, order), lc.held(), window, kernel, pooling)
    return pooled.scatter(2, order, pooled)  # back in buffer order


@dataclass(frozen=True)
class Options:
    window: int = 32  # observation window: the last prompt tokens whose attention scores the others; always kept
    kernel: int = 7  # pooling kernel along the keys
    pooling: Literal["avg", "max"] = "avg"  # pooling of the window's scores along the keys
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


class SnapKV(Method):
    schedule = "prefill"

    def __init__(self, budget: float, o: Options = Options(), name: str = "snapkv"):
        super().__init__(name, budget)
        self.window, self.kernel, self.reduce = o.window, o.kernel, o.reduce
        self.pooling = one_of(f"{name} pooling", o.pooling, ("avg", "max"))

    def recent(self, b: int) -> int:
        return self.window

    def before(self, cache, step) -> dict | None:
        if step.first:
            self.C = {}  # layer -> this prompt's window rows so far, summed per query head (B, H, S)
        mine = step.end - max(step.start, step.prompt_end - self.window)  # this call's queries in the window
        return {"window_sums": Statistic(mine, None, "heads")} if step.compresses and step.in_prompt and mine > 0 else None

    def after_attention(self, layer: int, cache, stats, step) -> None:
        if "window_sums" not in stats or layer in step.protected:
            return
        C = add_up(self.C, layer, stats["window_sums"])  # (B, H, S): the window's rows so far, 0 at pads
        if step.completes:  # once: the call that completes the prompt
            lc = cache[layer]
            score = window_scores_of(lc, reduce_heads(C, lc.keys.shape[1], self.reduce), self.window, self.kernel,
                                     self.pooling)
            self.compress(layer, cache, score, step)

    def compress(self, layer: int, cache, score: torch.Tensor, step) -> None:
        """Layer `layer` down to its budget by `score` (B, H_kv, S)."""
        lc, b = cache[layer], step.budgets[layer]
        if lc.length > b:
            self.evicted[layer] += lc.length - b
            self.select(layer, lc, score, b, step.newest)

    def select(self, layer: int, lc, score: torch.Tensor, b: int, newest: int) -> None:
        """Keep the window and the b - window best pooled scores before it."""
        shrink(lc, score, b, 0, self.window, newest)


def build(budget: float, o: Options = Options()) -> SnapKV:
    return SnapKV(budget, o)

