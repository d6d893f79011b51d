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


def eq1_row(rows: torch.Tensor, positions: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Eq. 1's s_j, (B, H_kv, S): the sum of the prompt's last k attention rows `rows` over the queries
    among them that see each key, for a prompt that ends at position n (a pad's s_j is 0: no query sees it)."""
    if k == 1:
        return rows  # the last row itself
    return rows / (n - positions).clamp(min=1, max=k).float()  # queries among the last k that see each key


def to_prune(s: torch.Tensor, order: torch.Tensor, t: float, first: int, last: int, excludes_kept: bool) -> int:
    """How many of a layer's entries go (Alg. 1): `frobenius_stop` on s (B, H_kv, S), ranked least important
    first by `order`, never the `first` leading or `last` trailing ones (the sinks, the window), which the
    authors' code also zeroes out of both norms (`excludes_kept`)."""
    S = s.shape[-1]
    if excludes_kept and first + last:
        s = s.clone()
        s[..., :first] = 0
        s[..., S - last :] = 0
    return min(frobenius_stop(s, order, t), S - first - last)
