"""TopK, the compressor of the methods still made of four parts (kvmini.parts): sinks, a recent window
and the best scores between them (kvmini.methods.selectors), with an optional merge of what it evicts."""
import torch

from kvmini.methods.selectors import keep_top, lowest
from kvmini.budget import Rule
from kvmini.parts import Compressor, most


class TopK(Compressor):
    """Keep the sinks, the recent window and the best-scoring tokens between them (`keep_top`);
    with a `merge` (e.g. D2O's EMAMerge), evicted tokens may first be merged into kept ones.
    Dropping one entry (a decode step) evicts the `lowest` by `LayerCache.evict_one` in O(D); dropping
    more sorts (`keep_top`) and gathers the kept ones (`keep`, O(S·D)): the same result either way."""

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
        order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (earlier steps may have mixed the buffer)
        idx = order.gather(2, keep_top(score.gather(2, order), b, self.sinks, self.recent(b)))  # (B, H_kv, b)
        if self.merge is not None:
            self.count(layers, self.merge(layers, lc, idx))
        lc.keep(idx)
        return idx
