"""StreamingLLM (Xiao et al. 2023): attention sinks + the most recent tokens, trimmed after every call.

Paper: "Efficient Streaming Language Models with Attention Sinks".

Keep the first `sinks` tokens (attention sinks, default 4) and the most recent
budget - sinks tokens; the cache is trimmed after every call (each prefill chunk, each decode step).
Chunked prefill: the kept positions do not depend on the chunk size, but later chunks attend to
the trimmed cache (as a stream does), so their keys, values and logits do.
No attention statistics are needed, so attention stays on the fast SDPA path.
Deviation: keys keep the RoPE rotation of their original positions; the paper re-numbers
positions inside the cache (0..S-1), which we do not do (positions are never rewritten here).
"""
from dataclasses import dataclass

import torch

from kvmini.cache import LayerCache
from kvmini.methods.allocators import Uniform
from kvmini.methods.selectors import TopK
from kvmini.parts import EVERY_CALL, Rule, Scorer
from kvmini.policy import Policy
from kvmini.statistics import Stats


class Position(Scorer):
    """StreamingLLM, DBudgetKV: the later a token, the more important (no attention statistics)."""

    def __call__(self, lc: LayerCache, stats: Stats) -> torch.Tensor:
        return lc.positions.float()  # (B, H_kv, S)

    def describe(self, lc: LayerCache) -> tuple[str, torch.Tensor | None]:
        return "the position itself (the later, the more important)", None


@dataclass(frozen=True)
class Options:
    sinks: int = 4  # first tokens always kept


def build(budget: float, o: Options = Options()) -> Policy:
    recent = Rule(f"budget - {o.sinks}", lambda b: b - o.sinks)
    return Policy("streaming_llm", budget, Position(), Uniform(), TopK(o.sinks, recent), schedule=EVERY_CALL)
