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
Deviation: F_v is the variance of the column sums per KV head, the g query heads of a group
reduced first (by --reduce, default mean), then averaged over the KV heads; the paper takes it
per attention (query) head.
"""
import torch

from kvmini.attention import StatsRequest
from kvmini.methods.allocators import proportional
from kvmini.parts import Budgeter

ALLOCATIONS = ("variance_softmax", "reciprocal", "uniform")


def attention_variance(column_sums: torch.Tensor) -> float:
    """F_v (Eq. 4): column_sums (B, H_kv, n) -> variance over key positions, averaged over heads."""
    return column_sums.var(dim=-1, correction=0).mean().item()


class VarianceSoftmax(Budgeter):
    """The deferred budgeter: measures F_v on every layer in the call that completes the prompt,
    then, after the last layer, budgets all layers at once (Eq. 5) and has them compressed.
    F_v is measured on the prompt's column sums (with a chunked prefill: the last chunk's queries)."""

    per_sequence = True

    def __init__(self, how: str = "variance_softmax", temperature: float = 1.0, low: int = 8, reduce: str = "mean",
                 protected: tuple = ()):
        super().__init__(protected)
        self.how, self.temperature, self.low = how, temperature, low
        self.request = StatsRequest(column_sums=True, reduce=reduce)

    def start(self, b, L, n) -> None:
        super().start(b, L, n)
        self.F_v: dict[int, float] = {}  # layer -> F_v, measured in the call that completes the prompt
        self.allocated = False

    def known(self, layer: int) -> int | None:
        return self.budgets[layer] if self.allocated else None

    def decide(self, layer: int, lc, stats: dict, score) -> dict[int, int]:
        if self.allocated:
            return {layer: self.budgets[layer]}
        self.F_v[layer] = attention_variance(stats["column_sums"])
        measured = [l for l in range(self.L) if not self.skips(l)]  # protected layers are never compressed
        if len(self.F_v) < len(measured):
            return {}  # measured; compressed once every layer is
        S = self.allocate(self.b, len(measured), [self.F_v[l] for l in measured], self.n)
        for l, S_l in zip(measured, S):
            self.budgets[l] = S_l
        self.allocated = True
        return {l: self.budgets[l] for l in measured}

    def allocate(self, b: int, L: int, F_v: list[float], n: int) -> list[int]:
        """S_l per layer (Eq. 5), b = rho * n: layers get between min(low, b) and max(n, b) tokens
        (b > n: room for decoding), L * b in all."""
        share = layer_weights(F_v, self.how, self.temperature)  # softmax(-F_v)_l, summing to 1
        # S_l = alpha_l * n = share_l * L * rho * n = share_l * (L * b): a split of L * b, clamped
        return proportional(share, b * L, min(self.low, b), [max(n, b)] * L)


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
