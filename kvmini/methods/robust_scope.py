r"""RoCo's robust eviction scope (Ren & Zhu 2024, arXiv 2402.06262; code DRSY/EasyKV).

A policy is "an importance score" plus "an eviction scope". RoCo's importance is the mean attention a
key received (MAS, "temporal attention"); its scope leaves out the keys whose attention still varies
most (a "robustness measure", the standard deviation of that attention). Per KV head, over the
group-mean attention row, Q_j the queries that saw key j while it was cached (its own included):

    (R1) MAS_j = a_j / n_j,                 a_j = \sum_{i \in Q_j} A_{ij},   n_j = |Q_j|
    (R2) \sigma_j = \sqrt{q_j / n_j - MAS_j^2},   q_j = \sum_{i \in Q_j} A_{ij}^2
    (R3) R = the \rho cached keys of largest \sigma           (the robust set)
    (R4) E = C \setminus R                                    (the eviction scope)
    (R5) evict the e lowest MAS in E                          (e: the entries over the budget)

R1-R5 are numbered here, not by the paper: its full text was not available to us (only its abstract
and second-hand summaries), so the equations are written the way the authors' code computes them.
The size of R is the `scope` rule:
    paper     rho = sinks + recent + r: the first `sinks` and last `recent` keys, then the r keys of
              largest sigma (ties: the earlier key); nothing is ever evicted from the sinks or window
    official  EasyKV (easykv.py:631-637 prompt, :720-724 decode): the first `sinks` and last `recent`
              keys count as sigma = 1e9, and the scope is the k = max(b - r - sinks, e) keys of lowest
              sigma, so rho = min(e + r + sinks, b) (ties: the later key is robust, the k lowest taking
              the earlier columns; torch.topk leaves EasyKV's tie order unspecified). When rho < sinks + recent
              (decode: b < 30 with recent 10) part of that protection leaks: the newest keys stay, the
              sinks go first, as in EasyKV.
The eviction itself is `selectors.shrink`'s (`keep_top`, `lowest`) with every key of R at score +inf.
"""
import torch

from kvmini.cache import PAD, LayerCache
from kvmini.attention import Statistic


def group_mean_square(rows: torch.Tensor) -> torch.Tensor:
    """(..., g, T, S) attention rows -> (mean over the g query heads of a KV head)^2, the same for each of
    them: EasyKV squares the group-mean row (easykv.py:195, :611, :701), not each head's."""
    return rows.mean(-3, keepdim=True).square().expand_as(rows)


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


COLUMN_SQUARES = Statistic(None, group_mean_square, "mean")  # (B, H_kv, S): sum_i Abar_ij^2


def deviation(lc: LayerCache) -> torch.Tensor:
    """(R2) sigma per held entry, (B, H_kv, S). The variance is clamped at 0 (EasyKV does not clamp, so a
    rounding below 0 gives NaN there, which its topk never puts in the scope)."""
    n = lc.aux("n").clamp(min=1)
    mas = lc.aux("a") / n  # (R1)
    return (lc.aux("q") / n - mas * mas).clamp(min=0).sqrt()


def robust_set(sigma: torch.Tensor, positions: torch.Tensor, rho, sinks: int, recent, later_first: bool) -> torch.Tensor:
    """(R3) The rho entries of largest sigma, (B, H_kv, S) bool in buffer order; the first `sinks` and the
    last `recent` held entries (by position) count as sigma = +inf. Ties: the later position first if
    `later_first`, else the earlier. rho and recent: ints, or one per row (R, 1, 1). Pads (position PAD,
    after a shorter row's entries) are never in it.
    Example: sigma [.3, .1, .2, .0] at positions 0..3, rho 2, sinks 0, recent 1 -> [True, False, False, True].

    Ranked by the pair (sigma, position), the set is the rho largest pairs. With a sigma of 32 bits or
    fewer, the pair fits one int64 (`ranking_key`) and the set is one selection (kthvalue), no sort; a
    float64 sigma ranks its ties by position in position order (a sort)."""
    real = positions != PAD
    s = sigma.masked_fill(first_held(positions, sinks) | last_held(positions, recent), float("inf"))
    if isinstance(rho, int) and rho <= 0:
        return torch.zeros_like(real)
    if sigma.element_size() <= 4:
        key = ranking_key(s.float(), positions, later_first).masked_fill(~real, torch.iinfo(torch.long).min)
        robust = (key >= largest(key, rho)) & real  # the keys of a row are distinct: rho of them (or every real one)
        return robust if isinstance(rho, int) else robust & (rho > 0)
    order = positions.argsort(dim=-1, stable=True)  # (B, H_kv, S): buffer slots in position order (stable: faster
    # on a buffer that is nearly in order, as a decode step leaves it)
    s = s.gather(2, order).masked_fill(~real.gather(2, order), float("-inf"))
    t = largest(s, rho)  # (B, H_kv, 1): the rho-th largest; every entry above it is robust ...
    above, tied = s > t, s == t
    need = rho - above.sum(-1, keepdim=True)  # ... and this many of those equal to it, by position
    run = tied.flip(-1).cumsum(-1).flip(-1) if later_first else tied.cumsum(-1)  # ties from the preferred end
    robust = above | (tied & (run <= need))  # (B, H_kv, S) in position order
    return torch.zeros_like(real).scatter_(2, order, robust) & real


def ranking_key(s: torch.Tensor, positions: torch.Tensor, later_first: bool) -> torch.Tensor:
    """float32 s (B, H_kv, S) and positions -> int64 keys ordered as the pairs (s, position) are, the
    later position above on a tie if `later_first`, else the earlier: the high 32 bits are s's bits
    turned into an int32 of the same order (IEEE 754: a negative float's magnitude bits are flipped),
    the low 32 bits the position (positions < 2**32)."""
    bits = (s + 0.0).view(torch.int32)  # + 0.0 turns -0.0 (which equals 0.0) into 0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32, ordered as s
    tie = positions if later_first else 2**32 - 1 - positions  # in [0, 2**32)
    return ordered.long() * 2**32 + tie


def largest(s: torch.Tensor, rho) -> torch.Tensor:
    """The rho-th largest value of each row of s (B, H_kv, S), (B, H_kv, 1); rho an int or one per row
    (B, 1, 1), taken within [1, S] (rho <= 0 then selects nothing above it, rho >= S everything).
    A selection (kthvalue), not a sort, when rho is one int."""
    S = s.shape[-1]
    if isinstance(rho, int):
        return s.kthvalue(S - min(max(rho, 1), S) + 1, dim=-1, keepdim=True).values
    at = (rho - 1).clamp(0, S - 1).expand(-1, s.shape[1], 1)  # (B, H_kv, 1)
    return s.sort(dim=-1, descending=True).values.gather(-1, at)
