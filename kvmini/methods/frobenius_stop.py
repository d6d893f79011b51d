r"""Frobenius-norm stopping (DBudgetKV, Ni et al. 2025, Sec. 3.2-3.3, Alg. 1).

A layer prunes its least important tokens for as long as the attention it loses stays small.

    s_j = \frac{\sum_{i > n-k} A_{ij}}{\#\{i > n-k : A_{ij} \ne 0\}}       (Eq. 1: last k rows, averaged)
    \|A'\|_F = \sqrt{\sum_j s_j^2}
    R_i = \sqrt{\sum_{r \ge i} s_{(r)}^2}   (Eq. 2; s_{(0)} the least important, so R_i is the norm
                                             left after removing the i least important tokens)
    prune the largest i with (\|A'\|_F - R_i) / \|A'\|_F \le t           (Alg. 1, t = 1%)

Ranking (Sec. 3.2): by position, the first m = 4 tokens are most important, then the rest from
the last to the first, so pruning removes the earliest non-sink tokens first; or, as in the
paper's Table 3, by attention (the column sums of the prompt's attention).
One cut per layer: R_i and \|A'\|_F are averaged over the KV heads (as the official code does),
so all heads of a layer keep the same count. Layers 0 and 1 are never pruned (Sec. 3.3, App. B).
Deviation: none from the paper; the official scripts use t = 5% where the paper says 1%.
"""
import torch

from kvmini.attention import StatsRequest
from kvmini.cache import LayerCache
from kvmini.parts import Budgeter


def frobenius_stop(s: torch.Tensor, order: torch.Tensor, t: float) -> int:
    """How many tokens to prune. s (B, H_kv, S) reduced attention rows; order (B, H_kv, S) token
    indices from least to most important; t the allowed relative drop of the norm.

    Example: s = [.4, .05, .1, .05, .1, .3], least important first 1, 2, 3, 4, 5, 0: removing token 1
    loses 0.46% of the norm, adding token 2 loses 2.3%, so t = 1% prunes 1 token.
    """
    # BEGIN EXERCISE frobenius_stop: tutorials/05_dbudgetkv.py, "The norm-stopping rule (Eq. 2)"
    sq = s.gather(-1, order).double() ** 2  # (B, H_kv, S), least important first
    R = sq.flip(-1).cumsum(-1).flip(-1).sqrt()  # (B, H_kv, S): R[..., i], Eq. (2)
    R_mean = R.mean(dim=(0, 1))  # (S,) averaged over heads
    F = R_mean[0]  # the full norm ||A'||_F (nothing removed), averaged over heads
    drop = (F - R_mean) / F  # (S,) non-decreasing in i
    return int((drop <= t).sum().item()) - 1  # drop[0] = 0, so at least 0
    # END EXERCISE


class FrobeniusStop(Budgeter):
    """The budgeter: in the call that completes the prompt, each layer keeps S - frobenius_stop(...)
    entries, chosen from its own statistics; `protected` layers are never pruned."""

    per_sequence = True

    def __init__(self, threshold: float = 0.01, k: int = 1, ranking: str = "position", sinks: int = 4,
                 reduce: str = "mean", protected: tuple = (0, 1)):
        super().__init__(protected)
        self.threshold, self.k, self.ranking, self.sinks = threshold, k, ranking, sinks
        self.request = StatsRequest(window=k, reduce=reduce)

    def plan(self) -> list[int]:
        return [self.n] * self.L  # nothing is pruned until a layer has chosen

    def known(self, layer: int) -> None:
        return None

    def decide(self, layer: int, lc: LayerCache, stats: dict, score: torch.Tensor) -> dict[int, int]:
        pos = lc.positions  # (B, H_kv, S)
        n = int(pos.max()) + 1  # the prompt length: this runs in the call that completes the prompt
        # (with a chunked prefill, k must not exceed the last chunk: the window sums cover only that)
        seen_by = (n - pos).clamp(max=self.k).float()  # queries among the last k that see each key
        s = stats["window_sums"] / seen_by  # Eq. (1): (B, H_kv, S)
        if self.ranking == "position":  # earliest non-sinks first, the sinks last
            S = pos.shape[-1]
            idx = torch.arange(S, device=pos.device)
            order = torch.cat([idx[self.sinks :], idx[: self.sinks]]).expand_as(pos)
        else:  # by the scorer's accumulated attention (CumulativeAttention), least attended first
            order = score.argsort(dim=-1, stable=True)
        pruned = frobenius_stop(s, order, self.threshold)
        if self.ranking == "position":  # the sinks are never pruned, even where the rule would reach them
            pruned = min(pruned, max(lc.length - self.sinks, 0))
        self.budgets[layer] = lc.length - pruned
        return {layer: self.budgets[layer]}
