"""SnapKV (Li et al. 2024): keys the last prompt window attends to (pooled), once after prefill.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation".

Prefill only. The last `window` prompt tokens are the observation window: their attention
over the earlier keys is summed, pooled along the keys (kernel 7) and the top budget - window
keys are kept together with the window itself. Decode steps append without compressing.
Defaults: window 32, kernel 7, pooling avg (the official code's default; max is an option),
group reduction mean. Compression happens layer by layer inside the prefill forward.
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.methods.allocators import Uniform
from kvmini.methods.scorers import WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options:
    window: int = 32  # observation window: the last prompt tokens whose attention scores the others; always kept
    kernel: int = 7  # pooling kernel along the keys
    pooling: Literal["avg", "max"] = "avg"  # pooling of the window's scores along the keys
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("snapkv", budget, WindowAttention(o.window, o.kernel, o.pooling, o.reduce), Uniform(),
                  TopK(recent=o.window), schedule=PREFILL)
