"""TopK, the compressor of the methods still made of four parts (kvmini.parts): sinks, a recent window
and the best scores between them (kvmini.methods.selectors)."""
import torch

from kvmini.budget import Rule
from kvmini.methods.selectors import keep_top, lowest
from kvmini.parts import Compressor


class TopK(Compressor):
    """Keep the sinks, the recent window and the best-scoring tokens between them (`keep_top`). Dropping
    one entry (a decode step) evicts the `lowest` by `LayerCache.evict_one` in O(D); dropping more sorts
    (`keep_top`) and gathers the kept ones (`keep`, O(S·D)): the same result either way. Returns the
    kept entries' old slots, so that a budgeter that revisits the layer keeps its score aligned."""

    def __init__(self, sinks: int = 0, recent: int | Rule = 0):
        super().__init__(sinks, recent)

    def __call__(self, layers: tuple, lc, score: torch.Tensor, b: int, newest: int) -> torch.Tensor:
        S = lc.length
        if S == b + 1:  # one entry to drop
            victim = lowest(score, lc.positions, self.sinks, self.recent(b), newest)  # (B, H_kv)
            lc.evict_one(victim)
            slots = torch.arange(S - 1, device=score.device)
            return torch.where(slots == victim[..., None], S - 1, slots)  # (B, H_kv, S - 1): the victim's slot holds entry S - 1
        order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (earlier steps may have mixed the buffer)
        idx = order.gather(2, keep_top(score.gather(2, order), b, self.sinks, self.recent(b)))  # (B, H_kv, b)
        lc.keep(idx)
        return idx
