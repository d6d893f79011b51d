r"""Variance-softmax layer allocation (D2O, Eq. 4-5, App. A.2; Table 4 for the alternatives).

A layer whose attention is spread out (column sums of low variance) needs more of the cache;
one that concentrates on a few tokens needs less.

    s^{(l)}_j = \sum_i A^{(l)}_{ij}              attention each key received in the prompt
    F_v^{(l)} = \mathrm{Var}_j(s^{(l)}_j)         (Eq. 4, per head, averaged over heads)
    \alpha_l = \mathrm{softmax}(-F_v)_l \cdot L \cdot \rho,   S_l = \alpha_l \cdot n   (Eq. 5)

so \sum_l S_l = L \rho n. Deviation: raw variances grow with n and make the softmax a one-hot,
so F_v is standardized across layers (z-score) before the softmax, divided by a temperature
(default 1). Each S_l is clamped to [low, n] and what the clamp removes or adds is given to
the other layers in proportion to their weights, so the total stays L \rho n (rounding by
largest remainder). The official code instead min-max normalizes variances across the heads
of a layer, which makes budgets nearly uniform.
"""
import torch

from kvmini.attention import StatsRequest
from kvmini.methods.allocators import proportional

ALLOCATIONS = ("variance_softmax", "reciprocal", "uniform")


def attention_variance(column_sums: torch.Tensor) -> float:
    """F_v (Eq. 4): column_sums (B, H_kv, n) -> variance over key positions, averaged over heads."""
    return column_sums.var(dim=-1, correction=0).mean().item()


class AttentionVariance:
    """The per-layer statistic F_v, measured on the prompt's column sums (with a chunked prefill:
    the last chunk's queries)."""

    def __init__(self, reduce: str = "mean"):
        self.request = StatsRequest(column_sums=True, reduce=reduce)

    def __call__(self, lc, stats: dict) -> float:
        return attention_variance(stats["column_sums"])


class VarianceSoftmax:
    """The deferred allocator: (b, L, F_v per layer, n) -> S_l per layer, total L * b (Eq. 5)."""

    def __init__(self, how: str = "variance_softmax", temperature: float = 1.0, low: int = 8):
        self.how, self.temperature, self.low = how, temperature, low

    def __call__(self, b: int, L: int, F_v: list[float], n: int) -> list[int]:
        """Layers get between min(low, b) and max(n, b) tokens (b > n: room for decoding)."""
        return proportional(layer_weights(F_v, self.how, self.temperature), b * L, min(self.low, b), [max(n, b)] * L)


def layer_weights(F_v: list[float], how: str = "variance_softmax", temperature: float = 1.0) -> list[float]:
    """Each layer's share of the total (they sum to 1).

    variance_softmax: softmax(-z(F_v) / temperature); reciprocal: (1/F_v) / sum(1/F_v); uniform: 1/L.
    Example: F_v = [1, 2, 3] -> z = [-1.22, 0, 1.22] -> softmax(-z) = [0.72, 0.21, 0.06].
    """
    F = torch.tensor(F_v, dtype=torch.float64)  # (L,)
    if how == "uniform":
        return [1 / len(F_v)] * len(F_v)
    if how == "reciprocal":
        # BEGIN EXERCISE reciprocal_allocation: tutorials/03_d2o_layer_level.py, "The Table 4 alternatives"
        inv = 1 / F.clamp(min=1e-30)
        return (inv / inv.sum()).tolist()
        # END EXERCISE
    # BEGIN EXERCISE variance_softmax: tutorials/03_d2o_layer_level.py, "Inverse variance softmax (Eq. 5)"
    std = F.std(correction=0)
    z = (F - F.mean()) / std if std > 0 else torch.zeros_like(F)
    return torch.softmax(-z / temperature, dim=0).tolist()
    # END EXERCISE
