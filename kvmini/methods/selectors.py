"""Selectors: given per-token scores and a budget, which cache entries stay? (`TopK`, a Compressor)."""
import torch

from kvmini.parts import Compressor


def keep_top(score: torch.Tensor, budget: int, sinks: int, recent: int) -> torch.Tensor:
    """Indices to keep, (B, H_kv, budget) ascending: the first `sinks` entries, the last `recent`
    entries, and the `budget - sinks - recent` highest-scoring entries between them.

    score (B, H_kv, S), entries in position order. Ties go to the earlier entry (stable sort).
    Example: score [5, 1, 9, 3, 7, 2], budget 4, sinks 1, recent 1 -> [0, 2, 4, 5].
    """
    B, H_kv, S = score.shape
    heavy = budget - sinks - recent
    middle = score[:, :, sinks : S - recent]  # (B, H_kv, S - sinks - recent)
    top = middle.sort(dim=-1, descending=True, stable=True).indices[:, :, :heavy] + sinks  # (B, H_kv, heavy)
    arange = torch.arange(S, device=score.device).expand(B, H_kv, S)
    return torch.cat([arange[:, :, :sinks], top.sort(-1).values, arange[:, :, S - recent :]], dim=-1)


class TopK(Compressor):
    """Keep the sinks, the recent window and the best-scoring tokens between them (`keep_top`);
    with a `merge` (e.g. D2O's EMAMerge), evicted tokens may first be merged into kept ones."""

    def __init__(self, sinks: int = 0, recent=lambda b: 0, merge=None):
        super().__init__(sinks, recent)
        self.merge = merge

    def start(self, L: int) -> None:
        super().start(L)
        if self.merge is not None:
            self.merge.reset()

    def __call__(self, layer, lc, score: torch.Tensor, b: int) -> torch.Tensor:
        idx = keep_top(score, b, self.sinks, self.recent(b))  # (B, H_kv, b), ascending
        if self.merge is not None:
            self.merged[layer] = self.merged[layer] + self.merge(layer, lc, idx)
        lc.keep(idx)
        return idx
