"""Selectors: given per-token scores and a budget, which cache entries stay? Plain functions: `keep_top`
(sinks + the best scores + a recent window), `lowest` (the one entry to drop), `shrink` (a layer to its budget).
"""
import torch


def keep_top(score: torch.Tensor, budget: int, sinks: int, recent: int) -> torch.Tensor:
    """Indices to keep, (B, H_kv, budget) ascending: the first `sinks`, the last `recent` and the
    budget - sinks - recent highest scores between them (ties: the earlier). score (B, H_kv, S) in position order.
    Example: score [5, 1, 9, 3, 7, 2], budget 4, sinks 1, recent 1 -> [0, 2, 4, 5]."""
    B, H_kv, S = score.shape
    heavy = budget - sinks - recent
    middle = score[:, :, sinks : S - recent]  # (B, H_kv, S - sinks - recent)
    top = middle.sort(dim=-1, descending=True, stable=True).indices[:, :, :heavy] + sinks  # (B, H_kv, heavy)
    arange = torch.arange(S, device=score.device).expand(B, H_kv, S)
    return torch.cat([arange[:, :, :sinks], top.sort(-1).values, arange[:, :, S - recent :]], dim=-1)


def lowest(score: torch.Tensor, positions: torch.Tensor, sinks: int, recent, newest: int) -> torch.Tensor:
    """The entry each head drops when it must drop exactly one, (B, H_kv): what `keep_top` with budget
    S - 1 evicts (the lowest score outside the sinks and the window, ties to the later position), in O(S).
    score, positions (B, H_kv, S), any buffer order: the sinks are the positions below `sinks`, the window
    the positions after newest - recent (`newest` the call's newest position, `recent` an int or (B, 1, 1)
    per row), so a pad (position PAD > newest) is never chosen.
    Example: score [5, 1, 9, 3, 7, 2] at positions 0..5, sinks 1, recent 1, newest 5 -> entry 1 (score 1)."""
    free = positions <= newest - recent  # not in the window
    if sinks:
        free &= positions >= sinks  # nor a sink
    masked = torch.where(free, score, float("inf"))  # a free entry's score is finite: a budget leaves one
    low = masked == masked.amin(-1, keepdim=True)  # the lowest free entries (ties)
    return torch.where(low, positions, -1).argmax(-1)  # (B, H_kv): the latest of them


def shrink(lc, score: torch.Tensor, b: int, sinks: int, recent: int, newest: int) -> None:
    """Shrink every head of one layer's cache to b entries: the first `sinks`, the last `recent` and the
    best `score`s between them (`keep_top`). One entry over (a decode step) finds the `lowest` in O(S) and evicts
    it in O(D) (`evict`); more sorts and gathers (`keep`, O(S·D)): the same result either way (their tie rules
    agree: tests/test_policy.py, test_lowest_drops_what_keep_top_drops_in_any_buffer_order).
    score (B, H_kv, S) in buffer order; newest: the position of the call's newest token."""
    if lc.length == b + 1:  # one entry to drop
        lc.evict(lowest(score, lc.positions, sinks, recent, newest))
        return
    order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (earlier steps may have mixed the buffer)
    lc.keep(order.gather(2, keep_top(score.gather(2, order), b, sinks, recent)))  # (B, H_kv, b) kept
