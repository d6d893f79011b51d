r"""KNorm (Devoto et al. 2024): keep the keys with the lowest L2 norm; no attention is needed.

Paper: "A Simple and Effective L_2 Norm-Based Strategy for KV Cache Compression", Alessio Devoto, Yu Zhao,
Simone Scardapane, Pasquale Minervini (EMNLP 2024; arXiv 2406.11430).

The paper observes that a key with a small norm tends to receive much attention, so the score
of a cached token is minus its key's norm, per KV head:

    s_j = -\|k_j\|_2

Keys are stored after RoPE, a rotation, so the norm is that of the key before RoPE too. The
prompt is compressed once, layer by layer, when it is complete (as kvpress's KnormPress does);
decode steps append. No statistics are asked of attention, which stays on the fast SDPA path.
"""
from dataclasses import dataclass

import torch

from kvmini.cache import wide
from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink


@dataclass(frozen=True)
class Options:
    """KNorm has no options."""


class KNorm(Method):
    schedule = "prefill"

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("knorm", budget)

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.compresses and step.completes and lc.length > b:  # once, in the call that completes the prompt
            self.evicted[layer] += lc.length - b
            shrink(lc, -wide(lc.keys).norm(dim=-1), b, 0, 0, step.newest)  # s_j = -||k_j||: the lowest norms stay

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return "key norm (KNorm keeps the lowest)", wide(lc.keys).norm(dim=-1)


def build(budget: float, o: Options = Options()) -> KNorm:
    return KNorm(budget, o)
