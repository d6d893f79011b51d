"""Sequences of a batch that keep counts of their own, where budgets follow each sequence's statistics
(D2O, snapkv_d2o, DBudgetKV, DynamicKV): one policy shrinks every row at once, each to its own count,
the batch dimension vectorized like the head dimension (kvmini.cache's ragged heads: entries, then pads).
A single sequence, or rows that agree, take `selectors`' plain form (`per_row`).
"""
import torch

from kvmini.methods.selectors import keep_top, lowest


class RowBudgets:
    """A Method whose budgets follow each sequence: `row_budgets[layer]`, one per sequence, once the method chose
    some in this prompt (None before: the run's plan); `budgets` their means."""

    row_budgets = None

    @property
    def budgets(self) -> list[int] | None:
        rows = self.row_budgets
        return super().budgets if rows is None else [round(sum(r) / len(r)) for r in rows]

    def set_budgets(self, layer: int, rows) -> None:
        """Layer `layer`'s budget in each sequence (`budgets` reports their mean, rounded)."""
        if self.row_budgets is None:
            self.row_budgets = [[b] * len(rows) for b in self.run.budgets]
        self.row_budgets[layer] = list(rows)

    def budget_rows(self, layer: int, B: int) -> list[int]:
        """What layer `layer` may keep in each of B sequences."""
        return [self.budgets[layer]] * B if self.row_budgets is None else self.row_budgets[layer]

    def over(self, layer: int, lc, budgets: list[int], slack: int = 0) -> tuple | None:
        """`shrink_rows`'s (b, held) to bring each sequence of layer `layer` that holds more than its budget +
        `slack` down to its budget, the evictions counted; None when no sequence holds more."""
        held = rows_held(lc)
        keep = [b if h > b + slack else h for h, b in zip(held, budgets)]
        if keep == held:
            return None
        self.evicted[layer] += sum(held) - sum(keep)
        return per_row(keep, held)


def rows_held(lc) -> list[int]:
    """What each sequence of a layer holds (its first KV head's count), read on the host."""
    return [lc.length] * lc.batch if lc.counts is None else [heads[0] for heads in lc.counts.tolist()]


def per_row(keep: list[int], held: list[int]) -> tuple:
    """The b and held of `shrink_rows` for sequences keeping `keep` of their `held` entries: (an int, None)
    when every sequence agrees."""
    return (keep[0], None) if len(set(keep)) == 1 and len(set(held)) == 1 else (keep, held)


def keep_top_rows(score: torch.Tensor, held: list[int], budgets: list[int], sinks: int, recent) -> tuple:
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


def one_over(lc, b, held: list[int] | None) -> bool:
    """Does every row hold one entry more than its budget b (an int, or one per row with `held`)?"""
    return lc.length == b + 1 if held is None else all(h == x + 1 for h, x in zip(held, b))


def kept(lc, score: torch.Tensor, b, sinks: int, recent, held: list[int] | None = None) -> tuple:
    """What a shrink keeps when it sorts: (idx (B, H_kv, b) into the buffer, counts: None, or (B, H_kv) per row)."""
    order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (earlier steps may have mixed the buffer)
    if held is None:
        return order.gather(2, keep_top(score.gather(2, order), b, sinks, recent)), None
    idx, counts = keep_top_rows(score.gather(2, order), held, b, sinks, recent)
    return order.gather(2, idx), counts


def shrink_rows(lc, score: torch.Tensor, b, sinks: int, recent, newest: int, held: list[int] | None) -> None:
    """`selectors.shrink` where b and `held` are one int per row (recent (B, 1, 1)), or an int and None."""
    if one_over(lc, b, held):  # one entry to drop in every row
        lc.evict(lowest(score, lc.positions, sinks, recent, newest))
        return
    lc.keep(*kept(lc, score, b, sinks, recent, held))
