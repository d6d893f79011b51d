"""Selectors: given per-token scores and a budget, which cache entries stay? (`TopK`, a Compressor)."""
import torch

from kvmini.cache import PAD, LayerCache
from kvmini.parts import Compressor, Rule, most


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
    masked = torch.where(free, score, float("inf"))
    low = free & (masked == masked.amin(-1, keepdim=True))  # the lowest free entries (ties)
    return torch.where(low, positions, -1).argmax(-1)  # (B, H_kv): the latest of them


def first_held(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The k held entries of lowest position, (B, H_kv, S) bool (pads, at PAD, come last)."""
    if k <= 0:
        return torch.zeros_like(positions, dtype=torch.bool)
    nth = positions.topk(min(k, positions.shape[-1]), dim=-1, largest=False).values[..., -1:]  # (B, H_kv, 1)
    return (positions <= nth) & (positions != PAD)


def last_held(positions: torch.Tensor, k) -> torch.Tensor:
    """The k held entries of highest position, (B, H_kv, S) bool; k an int or one per row (R, 1, 1)."""
    most = k if isinstance(k, int) else int(k.max())
    if most <= 0:
        return torch.zeros_like(positions, dtype=torch.bool)
    held = positions.masked_fill(positions == PAD, -1)  # pads first from the top
    top = held.topk(min(most, held.shape[-1]), dim=-1).values  # (B, H_kv, most): the latest, descending
    nth = top[..., -1:] if isinstance(k, int) else top.gather(-1, (k - 1).clamp(0, top.shape[-1] - 1).expand(
        -1, held.shape[1], 1))  # (B, H_kv, 1): each row's k-th latest
    latest = (held >= nth) & (held >= 0)
    return latest if isinstance(k, int) else latest & (k > 0)


def lowest_few(score: torch.Tensor, positions: torch.Tensor, sinks: int, recent: int, m: int) -> torch.Tensor:
    """The m entries each head drops, (B, H_kv, m) slots ascending: what `keep_top` with budget S - m
    evicts (the m lowest scores outside the first `sinks` and last `recent` by position, ties to the
    later position), found by two selections of m (topk) instead of sorting all S; for m much
    smaller than S (evict_every's batches). score, positions (B, H_kv, S), any buffer order, no pads.
    Example: score [5, 1, 9, 1, 7, 2] at positions 0..5, sinks 1, recent 1, m 2 -> slots [1, 3]."""
    protected = first_held(positions, sinks) | last_held(positions, recent)
    s = score.masked_fill(protected, float("inf"))
    nth = s.topk(m, dim=-1, largest=False).values[..., -1:]  # (B, H_kv, 1): the m-th lowest
    below, tied = s < nth, (s == nth) & ~protected
    need = m - below.sum(-1, keepdim=True)  # (B, H_kv, 1) >= 1: how many of the tied go, the latest first
    tied_at = torch.where(tied, positions, -1)
    last = tied_at.topk(m, dim=-1).values.gather(-1, need - 1)  # (B, H_kv, 1): the need-th latest tied position
    drop = below | (tied & (tied_at >= last))  # (B, H_kv, S): m per head
    return drop.nonzero()[:, 2].view(*score.shape[:2], m)


class TopK(Compressor):
    """Keep the sinks, the recent window and the best-scoring tokens between them (`keep_top`);
    with a `merge` (e.g. D2O's EMAMerge), evicted tokens may first be merged into kept ones.

    Two ways to shrink a layer, with the same result: dropping one entry (a decode step) finds the
    lowest one (`lowest`) and moves the newest entry into its slot (`LayerCache.evict_one`, O(D));
    dropping many (after the prompt) sorts (`keep_top`) and gathers the kept ones (`keep`, O(S·D)),
    in position order again; dropping a few, at most an eighth (the batches of `evict_every`), selects
    them (`lowest_few`) and moves the last entries into the victims' slots (`LayerCache.evict`, O(m·D)).
    """

    def __init__(self, sinks: int = 0, recent: int | Rule = 0, merge=None):
        super().__init__(sinks, recent)
        self.merge = merge

    def start(self, L: int) -> None:
        super().start(L)
        if self.merge is not None:
            self.merge.reset(L)

    def __call__(self, layers: tuple, lc, score: torch.Tensor, b, newest: int) -> torch.Tensor | None:
        S = lc.length
        if S == most(b) + 1:  # one entry to drop
            victim = lowest(score, lc.positions, self.sinks, self.recent(b), newest)  # (B, H_kv)
            if self.merge is not None:
                self.count(layers, self.merge.one(layers, lc, victim, newest))
            lc.evict_one(victim)
            slots = torch.arange(S - 1, device=score.device)
            return torch.where(slots == victim[..., None], S - 1, slots)  # (B, H_kv, S - 1): the victim's slot holds entry S - 1
        if self.merge is None and isinstance(lc, LayerCache) and 8 * (S - b) <= S:  # evict_every's batches
            victims = lowest_few(score, lc.positions, self.sinks, self.recent(b), S - b)  # (B, H_kv, m)
            return lc.evict(victims)  # moves only the last entries
        order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (earlier steps may have mixed the buffer)
        idx = order.gather(2, keep_top(score.gather(2, order), b, self.sinks, self.recent(b)))  # (B, H_kv, b)
        if self.merge is not None:
            self.count(layers, self.merge(layers, lc, idx))
        lc.keep(idx)
        return idx
