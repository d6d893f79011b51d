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

from kvmini.statistics import Stats
from kvmini.cache import wide
from kvmini.methods.allocators import Uniform
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL, Scorer
from kvmini.policy import Policy


class KNorm(Scorer):
    def __call__(self, lc, stats: Stats) -> torch.Tensor:
        return -wide(lc.keys).norm(dim=-1)  # (B, H_kv, S): the lowest norm scores highest

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return "key norm (KNorm keeps the lowest)", -self(lc, None)


@dataclass(frozen=True)
class Options:
    """KNorm has no options."""


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("knorm", budget, KNorm(), Uniform(), TopK(), schedule=PREFILL)
