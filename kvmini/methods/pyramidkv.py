"""PyramidKV (Cai et al. 2024): SnapKV scoring with budgets falling linearly from bottom to top.

Paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling".

SnapKV's scores and selection, but per-layer budgets that fall linearly from the bottom
layer to the top with the same total as a uniform budget (kvmini.methods.allocators.pyramid:
top layer window + (b - window) / beta, bottom layer window + 2 (b - window) - that).
Defaults: window 32, kernel 7, pooling avg, beta 20 (the official code's), group reduction mean.
"""
from dataclasses import dataclass

from kvmini.methods import snapkv
from kvmini.methods.allocators import Pyramid
from kvmini.methods.selectors import TopK
from kvmini.methods.snapkv import WindowAttention
from kvmini.parts import PREFILL
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options(snapkv.Options):  # SnapKV's, and:
    pyramid_beta: float = 20.0  # the top layer keeps 1/beta of the bottom layer's budget above the window


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("pyramidkv", budget, WindowAttention(o.window, o.kernel, o.pooling, o.reduce),
                  Pyramid(o.window, o.pyramid_beta), TopK(recent=o.window), schedule=PREFILL)
