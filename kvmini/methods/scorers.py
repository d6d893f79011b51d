"""Scorers: how important is each cached token? Each (a kvmini.parts.Scorer) returns (B, H_kv, S) scores,
higher = keep, from the statistics it names in its `request`; `accumulates` ones keep sums in lc.aux.
"""
import torch
import torch.nn.functional as F

from kvmini.statistics import Request, Stats, column_sums, last_row, window_sums
from kvmini.cache import LayerCache
from kvmini.errors import one_of
from kvmini.parts import Scorer


class Position(Scorer):
    """StreamingLLM, DBudgetKV: the later a token, the more important (no attention statistics)."""

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return lc.positions.float()  # (B, H_kv, S)

    def describe(self, lc: LayerCache) -> tuple[str, torch.Tensor | None]:
        return "the position itself (the later, the more important)", None


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


class LastRowAttention(Scorer):
    r"""TOVA (Oren et al. 2024): s_j = A_{tj}, the attention of the latest query only."""

    def __init__(self, reduce: str = "mean"):
        self.request = Request(last_row(reduce))

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return stats.last_row


class WindowAttention(Scorer):
    r"""SnapKV (Li et al. 2024, Sec. 4.2): C_j = \sum_{i \in window} A_{ij} over the last w queries,
    then pooled along the keys (kernel k, stride 1, zero padding k // 2) to keep neighbourhoods.
    The window itself is always kept (the recent tokens): its scores are +inf."""

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "avg", reduce: str = "mean"):
        self.window, self.kernel, self.pooling = window, kernel, one_of("WindowAttention pooling", pooling, ("avg", "max"))
        self.request = Request(window_sums(window, reduce))

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        C = stats.window_sums  # (B, H_kv, S)
        B, H_kv, S = C.shape
        prefix = C[:, :, : S - self.window].reshape(B * H_kv, 1, -1)  # (B*H_kv, 1, S - w)
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        pooled = pool(prefix, self.kernel, stride=1, padding=self.kernel // 2).view(B, H_kv, -1)
        inf = C.new_full((B, H_kv, S - pooled.shape[2]), float("inf"))
        return torch.cat([pooled, inf], dim=-1)  # (B, H_kv, S)
