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

from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink


@dataclass(frozen=True)
class Options:
    sinks: int = 4  # first tokens always kept


class StreamingLLM(Method):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("streaming_llm", budget)
        self.sinks = o.sinks

    def recent(self, b: int) -> int:
        return b - self.sinks  # the budget beyond the sinks: the most recent tokens

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.compresses and lc.length > b + step.slack:  # every call: a prompt chunk, or one decode step
            self.evicted[layer] += lc.length - b
            shrink(lc, lc.positions.float(), b, self.sinks, self.recent(b), step.newest)  # the later, the better

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return "the position itself (the later, the more important)", None


def build(budget: float, o: Options = Options()) -> StreamingLLM:
    return StreamingLLM(budget, o)
