"""DynamicKV (Zhou et al. 2024): SnapKV-style scores, per-layer budgets re-balanced every m layers.

Paper: "DynamicKV: Task-Aware Adaptive KV Cache Compression for Long Context LLMs" (Xiabin Zhou et al.,
Findings of EMNLP 2025; arXiv 2412.14838).

Prefill only, layer by layer inside the prefill forward (so the cache never holds every layer
in full); decode appends. Each layer first keeps r_max * (budget - window) keys by its pooled
window attention plus the window; every `interval` layers (Alg. 1 line 24) the finished layers are
re-budgeted by how many of the global top scores they hold (kvmini.methods.progressive_budgets), to
`budget` tokens per layer on average, except that the last L % m layers keep b_s + w_s (below).
Defaults, from the authors' code (the paper gives w_s, r_max and m no values; kv_compression/token_drop/):
window 8, avg pooling, r_max 10 (methods/dynamic_v11.py:144, 150, 152), interval 4
(llama_model_impl/dynamickv_v11.py:122, `layer_idx % 4 == 3`), kernel 7 (DynamicKVClusterV11's own
default, dynamic_v11.py:14; init_dynamickv_V11 sets 5, :148); group reduction mean (kvmini's).
In a batch, every sequence gets its own layer budgets (kvmini.per_sequence.PerSequence).

Variants: `paper` (the default, Alg. 1) and `official` (DreamMr/DynamicKV). Both re-allocate only
when l % m == 0 (Alg. 1 line 24), so when L % m != 0 the last L % m layers keep b_s + w_s;
`tail_reallocation=true` is kvmini's own option that re-allocates after the last layer too (its
budget is then exact). They differ in `rounding` (kvmini.methods.progressive_budgets):
`exact` (paper variant) rounds Z to the exact total and caps a layer at what it holds, giving the
excess to the others; `floor` (official) is the authors' int() floors, remainder to the last
finished layer, a cap of n - w_s and no redistribution (intermediate re-allocations share the
whole model's budget among the finished layers in both). `alg1` is Alg. 1's own rounding (lines 8-10:
normalised by the largest count, no remainder), which neither variant uses.
Deviation: the `paper` variant rounds with `exact`, not Alg. 1's int() floors (lines 8 and 10;
`rounding=alg1` runs those).
Deviation: the authors' code computes A per query head after repeat_kv; kvmini per KV head.
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.methods.allocators import Uniform
from kvmini.methods.progressive_budgets import ProgressiveBudgets
from kvmini.methods.topk import TopK
from kvmini.methods.snapkv import WindowAttention
from kvmini.parts import PREFILL
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options:
    window: int = 8  # observation window: the last prompt tokens whose attention scores the others; always kept
    kernel: int = 7  # pooling kernel along the keys
    pooling: Literal["avg", "max"] = "avg"  # pooling of the window's scores along the keys
    r_max: float = 10.0  # a layer keeps at most r_max times the mean budget before re-balancing
    interval: int = 4  # re-balance the finished layers every this many layers (m)
    # re-balance after the last layer too when L is not a multiple of m (kvmini's; Alg. 1 and the authors' code do not)
    tail_reallocation: bool = False
    # exact (kvmini: largest remainder, capped at what a layer holds) | floor (the authors' int() floors, remainder to
    # the last layer) | alg1 (Alg. 1's floors, normalised by the largest count)
    rounding: Literal["exact", "floor", "alg1"] = "exact"
    # progressive (Alg. 1) | uniform: every layer keeps the mean budget, the same window and kernel (an ablation:
    # SnapKV with DynamicKV's window)
    layer_budgets: Literal["progressive", "uniform"] = "progressive"
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


VARIANTS = {"paper": Options(), "official": Options(rounding="floor")}
DEFAULT_VARIANT = "paper"


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings (given, they are refused)."""
    why = "--layer-budgets uniform (they set the progressive re-allocation)"
    return {k: why for k in ("r_max", "interval", "tail_reallocation", "rounding")} if o.layer_budgets == "uniform" else {}


def build(budget: float, o: Options = Options()) -> Policy:
    budgeter = Uniform() if o.layer_budgets == "uniform" else \
        ProgressiveBudgets(o.window, o.r_max, o.interval, o.tail_reallocation, o.rounding)
    return Policy("dynamickv", budget, WindowAttention(o.window, o.kernel, o.pooling, o.reduce), budgeter,
                  TopK(recent=o.window), schedule=PREFILL)
