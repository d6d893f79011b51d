"""The scorers several methods of four parts share (a kvmini.parts.Scorer: (B, H_kv, S) scores, higher =
keep): H2O's accumulated attention, StreamingLLM's position, TOVA's last row. Other scorers live in their
paper's module (WindowAttention: snapkv).
"""
import torch

from kvmini.statistics import Request, Stats, column_sums, last_row
from kvmini.cache import LayerCache
from kvmini.parts import Scorer


class CumulativeAttention(Scorer):
    r"""H2O (Zhang et al. 2023): s_j = \sum_{i \le t} A_{ij}, attention received from every query so far."""

    accumulates = True
    aux = ("attention_sum",)

    def __init__(self, reduce: str = "mean"):
        self.request = Request(column_sums(reduce))

    def update(self, lc: LayerCache, stats: Stats, start: int, T: int) -> None:
        """After a call of T queries at positions start..start+T-1."""
        lc.aux("attention_sum").add_(stats.column_sums)  # (B, H_kv, S)

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return lc.aux("attention_sum")

    def describe(self, lc: LayerCache) -> tuple[str, torch.Tensor | None]:
        return "accumulated attention (H2O's score: summed over every query so far)", self(lc, None)


class Position(Scorer):
    """StreamingLLM, DBudgetKV: the later a token, the more important (no attention statistics)."""

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return lc.positions.float()  # (B, H_kv, S)

    def describe(self, lc: LayerCache) -> tuple[str, torch.Tensor | None]:
        return "the position itself (the later, the more important)", None


class LastRowAttention(Scorer):
    r"""TOVA (Oren et al. 2024): s_j = A_{tj}, the attention of the latest query only."""

    def __init__(self, reduce: str = "mean"):
        self.request = Request(last_row(reduce))

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return stats.last_row
