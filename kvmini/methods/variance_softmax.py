r"""Variance-softmax layer allocation (D2O, Eq. 4-5, App. A.2; Table 4 for the alternatives).

A layer whose attention is spread out (column sums of low variance) needs more of the cache;
one that concentrates on a few tokens needs less.
The default `d2o` (its `official` variant) runs `official`, not Eq. 5 as printed: raw variances grow with n,
so softmax(-F_v) is one-hot on real prompts.

    s^{(l,h)}_j = \sum_i A^{(l,h)}_{ij}          attention key j received in the prompt, head h
    F_v^{(l)} = \mathrm{mean}_h \mathrm{Var}_j(s^{(l,h)}_j)   (Eq. 4 omits heads; Var per head is App. A.9's Eq. 20)
    \alpha_l = \mathrm{softmax}(-F_v)_l \cdot L \cdot \rho,   S_l = \alpha_l \cdot n   (Eq. 5)

so \sum_l S_l = L \rho n. `allocation` turns F_v into shares: paper (softmax(-F_v), Eq. 5), official
(the authors' min-max normalized variances, clamped ratio), zscore (kvmini's), reciprocal and uniform
(Table 4); each, the reading of Eq. 4 and what `clamp` does: docs/methods.md, "D2O".
Deviation: zscore's F_v is the variance of the column sums per KV head (query heads reduced first).
Deviation: `clamp` (the default) bounds S_l to [low, n] and redistributes the excess; Eq. 5 does not.
"""
import torch

from kvmini.errors import one_of
from kvmini.methods.allocators import proportional

HEADS = ("official", "paper")  # the allocations that read each query head's column sums


def attention_variance(column_sums: torch.Tensor, correction: int = 0) -> float:
    """F_v (Eq. 4): column_sums (B, heads, n) -> variance over key positions, averaged over heads."""
    # BEGIN EXERCISE variance_softmax: tutorials/03_d2o_layer_level.py, "Attention density per layer (Eq. 4)"
    return column_sums.var(dim=-1, correction=correction).mean().item()
    # END EXERCISE


def official_variance(column_sums_heads: torch.Tensor) -> float:
    """The authors' v_l: per query head the unbiased variance of the column sums, averaged over the
    batch, min-max normalized across the heads of the layer, then averaged. In [0, 1].
    A one-token prompt (one column) has no unbiased variance: it counts as flat (0)."""
    if column_sums_heads.shape[-1] < 2:
        return 0.0
    var = column_sums_heads.var(dim=-1).mean(0)  # (H,)
    return ((var - var.min()) / (var.max() - var.min() + 1e-6)).mean().item()


def layer_variance(how: str, column_sums: torch.Tensor, column_sums_heads: torch.Tensor | None) -> float:
    """F_v of one layer (Eq. 4) as allocation `how` reads it: the official and paper allocations from each
    query head's column sums (B, H, n), zscore from the KV heads' (B, H_kv, n)."""
    if how == "official":
        return official_variance(column_sums_heads)
    if how == "paper":
        return attention_variance(column_sums_heads)
    return attention_variance(column_sums)


def allocate(F_v: list[float], how: str, b: int, n: int, length: int, protected: tuple, parts: tuple = (1, 1),
             low: int = 8, temperature: float = 1.0, clamp: bool = True) -> list[int]:
    """S_l for every layer from its F_v: a mean of b tokens on an n-token prompt, `length` what a layer holds
    now (n, or n + 1 at the first decode step: the official code's base). A protected layer keeps all.
    Official: `official_budgets`, its ratio clamped to [0.01, 1], floored at `low` (kvmini's Deviation);
    the others: Eq. 5's split of L b over the free layers (`split`)."""
    L = len(F_v)
    if how == "official":
        S = official_budgets(F_v, b / n, length, parts)
        floor = min(low, length) if clamp else 0
        return [length if l in protected else max(S_l, floor) for l, S_l in enumerate(S)]
    free = [l for l in range(L) if l not in protected]
    S = dict(zip(free, split([F_v[l] for l in free], how, b, n, low, temperature, clamp)))
    return [S.get(l, n) for l in range(L)]


def split(F_v: list[float], how: str, b: int, n: int, low: int = 8, temperature: float = 1.0,
          clamp: bool = True) -> list[int]:
    """S_l per layer (Eq. 5), b = rho * n: layers get between min(low, b) and max(n, b) tokens
    (b > n: room for decoding), L * b in all."""
    L = len(F_v)
    share = layer_weights(F_v, how, temperature)  # softmax(-F_v)_l, summing to 1
    # S_l = alpha_l * n = share_l * L * rho * n = share_l * (L * b): a split of L * b, clamped or not
    if not clamp:
        return proportional(share, b * L, 0, [b * L] * L)
    return proportional(share, b * L, min(low, b), [max(n, b)] * L)


def idle_temperature(o) -> dict[str, str]:
    """A method's softmax_temperature does nothing unless allocation=zscore (its `idle`: refused if given)."""
    return {} if o.allocation == "zscore" else {
        "softmax_temperature": f"--allocation {o.allocation} (only zscore divides by a temperature)"}


def official_budgets(v: list[float], rho: float, length: int, parts: tuple) -> list[int]:
    """S_l = floor(x_l N/(N+M)) + floor(x_l M/(N+M)), x_l = length * clamp(softmax(-v)_l L rho, 0.01, 1):
    the heavy and recent parts floored separately, as the authors' code does."""
    N, M = parts
    share = torch.softmax(-torch.tensor(v, dtype=torch.float64), dim=0) * len(v) * rho
    x = (share.clamp(0.01, 1.0) * length).tolist()
    return [int(x_l * N / (N + M)) + int(x_l * M / (N + M)) for x_l in x]

def layer_weights(F_v: list[float], how: str = "zscore", temperature: float = 1.0) -> list[float]:
    """Each layer's share of the total (they sum to 1).

    zscore: softmax(-z(F_v) / temperature); paper: softmax(-F_v); reciprocal: (1/F_v) / sum(1/F_v);
    uniform: 1/L.
    Example: F_v = [1, 2, 3] -> z = [-1.22, 0, 1.22] -> softmax(-z) = [0.72, 0.21, 0.06].
    """
    one_of("layer_weights how", how, ("zscore", "paper", "reciprocal", "uniform"))
    F = torch.tensor(F_v, dtype=torch.float64)  # (L,)
    if how == "uniform":
        return [1 / len(F_v)] * len(F_v)
    if how == "reciprocal":
        # BEGIN EXERCISE reciprocal_allocation: tutorials/03_d2o_layer_level.py, "The Table 4 alternatives"
        inv = 1 / F.clamp(min=1e-30)
        return (inv / inv.sum()).tolist()
        # END EXERCISE
    if how == "paper":  # Eq. 5 as written, on the raw variances
        # BEGIN EXERCISE variance_softmax: tutorials/03_d2o_layer_level.py, "Inverse variance softmax (Eq. 5)"
        return torch.softmax(-F, dim=0).tolist()
        # END EXERCISE
    std = F.std(correction=0)
    z = (F - F.mean()) / std if std > 0 else torch.zeros_like(F)
    return torch.softmax(-z / temperature, dim=0).tolist()
