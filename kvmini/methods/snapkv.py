"""SnapKV (Li et al. 2024): keys the last prompt window attends to (pooled), once after prefill.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation".

Prefill only. The last `window` prompt tokens are the observation window: their attention
over the earlier keys is summed, pooled along the keys (kernel 7) and the top budget - window
keys are kept together with the window itself. Decode steps append without compressing.
Defaults: window 32, kernel 7, pooling avg (the official code's default; max is an option),
group reduction mean. Compression happens layer by layer inside the prefill forward.
"""
from kvmini.methods.allocators import Uniform
from kvmini.methods.scorers import WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL
from kvmini.policy import Policy


def build(budget: float, window: int = 32, kernel: int = 7, pooling: str = "avg", reduce: str = "mean") -> Policy:
    return Policy("snapkv", budget, WindowAttention(window, kernel, pooling, reduce), Uniform(),
                  TopK(recent=lambda b: window), schedule=PREFILL)
