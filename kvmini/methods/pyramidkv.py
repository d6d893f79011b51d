"""PyramidKV (Cai et al. 2024): SnapKV scoring with budgets falling linearly from bottom to top.

Paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling".

SnapKV's scores and selection, but per-layer budgets that fall linearly from the bottom
layer to the top with the same total as a uniform budget (kvmini.methods.allocators.pyramid:
top layer window + (b - window) / beta, bottom layer window + 2 (b - window) - that).
Defaults: window 32, kernel 7, pooling avg, beta 20 (the official code's), group reduction mean.
"""
from functools import partial

from kvmini.methods.allocators import pyramid
from kvmini.methods.scorers import WindowAttention
from kvmini.policy import PREFILL, Policy


def build(budget: float, window: int = 32, kernel: int = 7, pooling: str = "avg", reduce: str = "mean",
          pyramid_beta: float = 20) -> Policy:
    return Policy("pyramidkv", budget, scorer=WindowAttention(window, kernel, pooling, reduce),
                  allocator=partial(pyramid, window=window, beta=pyramid_beta),
                  recent=lambda b: window, schedule=PREFILL)
