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


def keep_top_rows(score: torch.Tensor, held: list[int], budgets: list[int], sinks: int, recent: torch.Tensor):
    """`keep_top` for rows that keep counts of their own: row r (of B) holds its first held[r] entries (then pads)
    and keeps budgets[r] of them, its window recent[r] (B, 1, 1). Returns (idx (B, H_kv, max budget), counts
    (B, H_kv)): each row's kept entries ascending, then others of its own, which `LayerCache.keep` makes pads."""
    B, H_kv, S = score.shape
    i, k = torch.arange(S, device=score.device), torch.tensor(budgets, device=score.device)[:, None, None]  # (S,), (B, 1, 1)
    h = torch.tensor(held, device=score.device)[:, None, None]  # (B, 1, 1)
    always = (i < sinks) | (i >= h - recent)  # the sinks and each row's window: ranked first
    rank = torch.where(always, float("inf"), score).masked_fill(i >= h, float("-inf"))  # a pad ranks last
    top = rank.argsort(dim=-1, descending=True, stable=True)[..., : max(budgets)]  # (B, H_kv, k): ties to the earlier
    past = torch.arange(top.shape[2], device=score.device) >= k  # (B, 1, k): past the row's budget
    return (top + S * past).sort(-1).values % S, k[..., 0].expand(B, H_kv)  # kept ascending first


def shrink(lc, score: torch.Tensor, b, sinks: int, recent, newest: int, held: list[int] | None = None) -> None:
    """Shrink every row of one layer's cache to b entries: the first `sinks`, the last `recent` and the
    best `score`s between them (`keep_top`). One entry over (a decode step) evicts the `lowest` in O(D)
    (`evict`); more sorts and gathers (`keep`, O(S·D)): the same result either way.
    score (B, H_kv, S) in buffer order; newest: the position of the call's newest token. Rows that keep
    counts of their own: b and `held` one int per row, recent (B, 1, 1) (`keep_top_rows`)."""
    if one_over(lc, b, held):  # one entry to drop
        lc.evict(lowest(score, lc.positions, sinks, recent, newest))
        return
    lc.keep(*kept(lc, score, b, sinks, recent, held))


def rows_held(lc) -> list[int]:
    """What each sequence of a layer holds (its first KV head's count), read on the host: once per prompt."""
    return [lc.length] * lc.positions.shape[0] if lc.counts is None else lc.counts[:, 0].tolist()


def per_row(keep: list[int], held: list[int]) -> tuple:
    """`shrink`'s b and held for sequences that keep `keep` of their `held` entries: (an int, None) when all agree."""
    return (keep[0], None) if len(set(keep)) == 1 and len(set(held)) == 1 else (keep, held)


def one_over(lc, b, held: list[int] | None) -> bool:
    """Does every row hold one entry more than its budget b (an int, or one per row with `held`)?"""
    return lc.length == b + 1 if held is None else all(h == x + 1 for h, x in zip(held, b))


def kept(lc, score: torch.Tensor, b, sinks: int, recent, held: list[int] | None = None) -> tuple:
    """What `shrink` keeps when it sorts: (idx (B, H_kv, b) into the buffer, counts: None, or (B, H_kv) per row)."""
    order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (earlier steps may have mixed the buffer)
    if held is None:
        return order.gather(2, keep_top(score.gather(2, order), b, sinks, recent)), None
    idx, counts = keep_top_rows(score.gather(2, order), held, b, sinks, recent)
    return order.gather(2, idx), counts
