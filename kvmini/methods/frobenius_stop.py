r"""Frobenius-norm stopping (DBudgetKV, Ni et al. 2025, Sec. 3.2-3.3, Alg. 1).

A layer prunes its least important tokens for as long as the attention it loses stays small.

    s_j = \frac{\sum_{i > n-k} A_{ij}}{\#\{i > n-k : A_{ij} \ne 0\}}       (Eq. 1: last k rows, averaged, as
                                                                  its prose says; its sum is printed from i = k)
    \|A'\|_F = \sqrt{\sum_j s_j^2}
    R_i = \sqrt{\sum_{r \ge i} s_{(r)}^2}   (Eq. 2; s_{(0)} the least important, so R_i is the norm
                                             left after removing the i least important tokens)
    prune the largest i with (\|A'\|_F - R_i) / \|A'\|_F \le t           (Alg. 1, t = 1%)

Ranking (`ranking`): `position` (Sec. 3.2; m = 4 in Sec. 4.1): the first m tokens (sinks) are most important,
then the rest from the last to the first, so pruning removes the earliest non-sink tokens first;
`cumulative` (the paper's Table 3, "average attention received"): the column sums of the prompt's
attention (a mean over all n queries, which orders as the sum); `window_attention`
(the authors' code, Patrick-Ni/ReFreeKV, its `h2o` mode): the attention of the last `window`
queries summed, those `window` tokens always kept.
One cut per layer: R_i and \|A'\|_F are averaged over the KV heads (as the official code does),
so all heads of a layer keep the same count. Layers 0 and 1 are never pruned (Sec. 3.3, App. B).
`norm_excludes_kept`: the authors' code zeroes the always-kept tokens (the sinks, or the window)
out of s before both norms; the paper (and the `paper` variant) keeps them in.
Deviation: the official code cuts every query head (after repeat_kv); kvmini every KV head.
Deviation: the paper does not say how one cut per layer combines the heads' norms; both variants
use the authors' code's ratio of head-averaged norms, (mean_h ||A'_h|| - mean_h R_h) / mean_h ||A'_h||.
"""
import torch

from kvmini.statistics import Request, Stats, last_row, window_sums
from kvmini.cache import LayerCache
from kvmini.errors import one_of
from kvmini.parts import Budgeter


def frobenius_stop(s: torch.Tensor, order: torch.Tensor, t: float) -> int:
    """How many tokens to prune. s (B, H_kv, S) reduced attention rows; order (B, H_kv, S) token
    indices from least to most important; t the allowed relative drop of the norm.

    Example: s = [.4, .05, .1, .05, .1, .3], least important first 1, 2, 3, 4, 5, 0: removing token 1
    loses 0.46% of the norm, adding token 2 loses 2.3%, so t = 1% prunes 1 token. At most S - 1
    (the most important token stays); R_i is averaged over the batch and the heads alike; an all-zero
    s loses nothing whatever is removed: S - 1.
    """
    # BEGIN EXERCISE frobenius_stop: tutorials/05_dbudgetkv.py, "The norm-stopping rule (Eq. 2)"
    sq = s.gather(-1, order).double() ** 2  # (B, H_kv, S), least important first
    R = sq.flip(-1).cumsum(-1).flip(-1).sqrt()  # (B, H_kv, S): R[..., i], Eq. (2)
    R_mean = R.mean(dim=(0, 1))  # (S,) averaged over heads
    F = R_mean[0]  # the full norm ||A'||_F (nothing removed), averaged over heads
    if F == 0:  # an all-zero row: removing tokens loses nothing (0 <= t * 0), so all but one may go
        return s.shape[-1] - 1
    drop = (F - R_mean) / F  # (S,) non-decreasing in i
    return int((drop <= t).sum().item()) - 1  # drop[0] = 0, so at least 0
    # END EXERCISE


class FrobeniusStop(Budgeter):
    """The budgeter: in the call that completes the prompt, each layer keeps S - frobenius_stop(...)
    entries, chosen from its own statistics; `protected` layers are never pruned."""

    per_sequence = True

    def __init__(self, threshold: float = 0.01, k: int = 1, ranking: str = "position", sinks: int = 4,
                 reduce: str = "mean", protected: tuple = (0, 1), window: int = 8, norm_excludes_kept: bool = False):
        super().__init__(protected)
        self.threshold, self.k, self.sinks, self.window = threshold, k, sinks, window
        self.ranking = one_of("FrobeniusStop ranking", ranking, ("position", "cumulative", "window_attention"))
        self.excludes_kept = norm_excludes_kept
        # the last row itself when k = 1 (a window of k queries would merge with a ranking window)
        self.request = Request(last_row(reduce) if k == 1 else window_sums(k, reduce))

    def plan(self, b: None, L: int, n: int) -> list[int]:
        return [n] * L  # nothing is pruned until a layer has chosen

    def known(self, layer: int) -> None:
        return None

    def always_kept(self, S: int) -> tuple[int, int]:
        """(first, last): how many leading entries (sinks) and trailing ones (the window) are always kept."""
        return {"position": (min(self.sinks, S), 0), "window_attention": (0, min(self.window, S)),
                "cumulative": (0, 0)}[self.ranking]

    def decide(self, layer: int, lc: LayerCache, stats: Stats, score: torch.Tensor) -> dict[int, int]:
        pos = lc.positions  # (B, H_kv, S)
        S = pos.shape[-1]
        if self.k == 1:
            s = stats.last_row  # Eq. (1) with k = 1: (B, H_kv, S)
        else:  # the window sums of the prompt's last k queries, however many calls the prompt came in
            n = int(pos.max()) + 1  # the prompt length: this runs in the call that completes the prompt
            seen_by = (n - pos).clamp(max=self.k).float()  # queries among the last k that see each key
            s = stats.window_sums / seen_by  # Eq. (1): (B, H_kv, S)
        first, last = self.always_kept(S)
        if self.excludes_kept and first + last:  # the authors' code: zero them out of both norms
            s = s.clone()
            s[..., :first] = 0
            s[..., S - last :] = 0
        if self.ranking == "position":  # earliest non-sinks first, the sinks last
            idx = torch.arange(S, device=pos.device)
            order = torch.cat([idx[self.sinks :], idx[: self.sinks]]).expand_as(pos)
        else:  # by the scorer (window or cumulative attention; the window scores +inf), least attended first
            order = score.argsort(dim=-1, stable=True)
        pruned = min(frobenius_stop(s, order, self.threshold), S - first - last)  # the always-kept stay
        self.budgets[layer] = lc.length - pruned
        return {layer: self.budgets[layer]}
