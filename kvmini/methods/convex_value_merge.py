r"""Convex value merging (WeightedKV, Yuan et al. 2025, Sec. III-B and Alg. 1).

Every token keeps two running sums (cache aux, gathered with the cache):
    a_j  attention it has received, summed over all queries        (Alg. 1 line 4)
    n_j  how many queries have attended to it (could see it)       (Alg. 1 line 5)
Whenever the cache holds more than its capacity m:
    \bar a = a / n                                                  (line 7)
    j = \arg\min \bar a  over the mergeable entries                 (line 8)
    v_{j+1} \leftarrow \frac{\bar a_j v_j + \bar a_{j+1} v_{j+1}}{\bar a_j + \bar a_{j+1}}   (line 9)
    delete k_j, v_j, a_j, n_j; token j+1 keeps its own a and n     (line 10)
Keys are only ever dropped; values are merged convexly into the right neighbour, so no
value vanishes outright. The paper protects no token in Alg. 1 except the newest one (j < m);
its experiments (Sec. V-A) keep 4 initial tokens and (m - 8) // 2 recent ones, our defaults.
Deviation: for a prompt, Alg. 1 runs after each chunk of the prefill (chunk size 1 is Alg. 1
literally); n counts the queries of the chunk that could see the token (causal mask).
"""
import torch

from kvmini.attention import StatsRequest
from kvmini.cache import LayerCache
from kvmini.parts import Compressor, Scorer


class AverageAttention(Scorer):
    """The running sums a and n of Alg. 1 lines 4-5, per KV head (query heads of a group reduced)."""

    accumulates = True

    def __init__(self, reduce: str = "mean"):
        self.request = StatsRequest(column_sums=True, reduce=reduce)

    def update(self, lc: LayerCache, stats: dict, start: int, T: int) -> None:
        """After a call of T queries at positions start..start+T-1."""
        lc.aux("a").add_(stats["column_sums"])  # (B, H_kv, S)  line 4
        # line 5: a key at position p is seen by the queries at positions max(p, start)..start+T-1
        lc.aux("n").add_(T - (lc.positions - start).clamp(min=0))  # (B, H_kv, S)

    def __call__(self, lc: LayerCache, stats: dict) -> torch.Tensor:
        return lc.aux("a") / lc.aux("n")  # line 7: abar (B, H_kv, S)


def convex_value_merge(lc: LayerCache, capacity: int, sinks: int, recent: int) -> None:
    """Alg. 1 lines 6-10, one merge per excess entry, until the layer holds `capacity` entries.

    Mergeable entries j are those after the sinks and before the recent window (at least the
    newest token is never j, as in the paper's j < m); j+1 may be the first recent token.
    """
    # BEGIN EXERCISE convex_value_merge: tutorials/06_weightedkv.py, "Algorithm 1 step by step"
    while lc.length > capacity:
        S = lc.length
        abar = lc.aux("a") / lc.aux("n")  # (B, H_kv, S)  line 7
        last = S - max(recent, 1)  # j < last
        j = abar[:, :, sinks:last].argmin(-1, keepdim=True) + sinks  # (B, H_kv, 1)  line 8
        w_j, w_next = abar.gather(2, j), abar.gather(2, j + 1)  # (B, H_kv, 1) each
        den = w_j + w_next
        share = torch.where(den > 0, w_j / den, 0.5)[..., None]  # (B, H_kv, 1, 1): weight of v_j
        D = lc.values.shape[-1]
        v_j = lc.values.gather(2, j[..., None].expand(-1, -1, -1, D))  # (B, H_kv, 1, D)
        v_next = lc.values.gather(2, (j + 1)[..., None].expand(-1, -1, -1, D))
        merged = share * v_j.float() + (1 - share) * v_next.float()  # line 9
        lc.values.scatter_(2, (j + 1)[..., None].expand(-1, -1, -1, D), merged.to(lc.values.dtype))
        rest = torch.arange(S - 1, device=j.device).expand(*j.shape[:2], S - 1)  # (B, H_kv, S-1)
        lc.keep(rest + (rest >= j).long())  # line 10: every entry but j
    # END EXERCISE


class ConvexValueMerge(Compressor):
    """The compressor: `convex_value_merge` down to the budget; every evicted token's value is merged."""

    def __call__(self, layer: int, lc: LayerCache, score: torch.Tensor, b: int) -> None:
        self.merged[layer] += lc.length - b
        convex_value_merge(lc, b, self.sinks, self.recent(b))
