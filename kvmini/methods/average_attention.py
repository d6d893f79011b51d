r"""Average attention (WeightedKV, Yuan et al. 2025, Alg. 1 lines 4-5 and 7): a token's attention received
over the queries that could see it. WeightedKV ranks by it; RoCo's mean attention score (MAS) is the same
ratio (kvmini.methods.robust_scope)."""
import torch

from kvmini.cache import LayerCache
from kvmini.parts import Scorer
from kvmini.statistics import Request, Stats, column_sums


class AverageAttention(Scorer):
    """The running sums a and n of Alg. 1 lines 4-5, per KV head (query heads of a group reduced)."""

    accumulates = True
    aux = ("a", "n")

    def __init__(self, reduce: str = "mean"):
        self.request = Request(column_sums(reduce))

    def update(self, lc: LayerCache, stats: Stats, start: int, T: int) -> None:
        """After a call of T queries at positions start..start+T-1."""
        lc.aux("a").add_(stats.column_sums)  # (B, H_kv, S)  line 4
        # line 5: a key at position p is seen by the queries at positions max(p, start)..start+T-1
        lc.aux("n").add_(T - (lc.positions - start).clamp(min=0))  # (B, H_kv, S)

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return lc.aux("a") / lc.aux("n")  # line 7: abar (B, H_kv, S)

    def describe(self, lc: LayerCache) -> tuple[str, torch.Tensor | None]:
        return "average attention a/n (WeightedKV's ranking)", self(lc, None)
