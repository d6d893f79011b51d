"""PyramidKV (Cai et al. 2024): SnapKV scoring with budgets falling linearly from bottom to top.

Paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling".

SnapKV's scores and selection, but per-layer budgets that fall linearly from the bottom
layer to the top with the same total as a uniform budget (`pyramid`:
top layer window + (b - window) / beta, bottom layer window + 2 (b - window) - that).
Defaults: window 32, kernel 7, pooling avg, beta 20 (the official code's), group reduction mean.
"""
from dataclasses import dataclass

from kvmini.methods import snapkv
from kvmini.methods.allocators import round_to_total
from kvmini.methods.snapkv import SnapKV


def pyramid(tokens_per_layer: int, L: int, window: int, beta: float = 20) -> list[int]:
    r"""PyramidKV (Cai et al. 2024, Sec. 3.3): budgets fall linearly from the bottom layer to the top.
    Beyond the `window`, top k_min = (b - w) / \beta, bottom k_max = 2 (b - w) - k_min; total L * b exactly.
    Example: b = 40, L = 4, window 8, beta 4 -> [64, 48, 32, 16]."""
    extra = tokens_per_layer - window
    if L == 1:
        return [tokens_per_layer]
    k_min = extra / beta
    k_max = 2 * extra - k_min
    exact = [k_max - (k_max - k_min) * l / (L - 1) for l in range(L)]
    return [window + k for k in round_to_total(exact, extra * L)]


@dataclass(frozen=True)
class Options(snapkv.Options):  # SnapKV's, and:
    pyramid_beta: float = 20.0  # the top layer keeps 1/beta of the bottom layer's budget above the window


class PyramidKV(SnapKV):
    """SnapKV with layer budgets that fall from the bottom layer to the top (`pyramid`), known from the start."""

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__(budget, o, "pyramidkv")
        self.beta = o.pyramid_beta

    def plan(self, b: int, L: int, n: int) -> list[int]:
        return pyramid(b, L, self.window, self.beta)


def build(budget: float, o: Options = Options()) -> PyramidKV:
    return PyramidKV(budget, o)
