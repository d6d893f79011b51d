"""Selectors: given per-token scores and a budget, which cache entries stay?"""
import torch


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
