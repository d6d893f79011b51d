"""DynamicKV (Zhou et al. 2024): SnapKV-style scores, per-layer budgets re-balanced every m layers.

Paper: "DynamicKV: Task-Aware Adaptive KV Cache Compression for Long Context LLMs" (Xiabin Zhou et al.,
Findings of EMNLP 2025; arXiv 2412.14838).

Prefill only, layer by layer inside the prefill forward (so the cache never holds every layer
in full); decode appends. Each layer first keeps r_max * (budget - window) keys by its pooled
window attention plus the window; every `interval` layers and after the last, the finished
layers are re-budgeted by how many of the global top scores they hold
(kvmini.methods.progressive_budgets), ending at `budget` tokens per layer on average.
Defaults: window 8, kernel 7, avg pooling, r_max 10, interval 4, group reduction mean.
In a batch, every sequence gets its own layer budgets (kvmini.policy.PerSequence).

Variants: `paper` (the default, Alg. 1) and `official` (DreamMr/DynamicKV). Both re-allocate only
when l % m == 0 (Alg. 1 line 24), so when L % m != 0 the last L % m layers keep b_s + w_s;
`tail_reallocation=true` is kvmini's own option that re-allocates after the last layer too (its
budget is then exact). They differ in `rounding` (kvmini.methods.progressive_budgets):
`exact` (paper variant) rounds Z to the exact total and caps a layer at what it holds, giving the
excess to the others; `floor` (official) is the authors' int() floors, remainder to the last
finished layer, a cap of n - w_s and no redistribution (intermediate re-allocations share the
whole model's budget among the finished layers in both).
Deviation: the `paper` variant rounds with `exact`, not Alg. 1's int() floors (lines 8 and 10).
Deviation: the authors' code computes A per query head after repeat_kv; kvmini per KV head.
"""
from kvmini.methods.progressive_budgets import ProgressiveBudgets
from kvmini.methods.scorers import WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL
from kvmini.policy import Policy


VARIANTS = {"paper": dict(rounding="exact"), "official": dict(rounding="floor")}
DEFAULTS_SHOWN = {"rounding": "by variant"}


def build(budget: float, variant: str = "paper", window: int = 8, kernel: int = 7, pooling: str = "avg",
          r_max: float = 10, interval: int = 4, tail_reallocation: bool = False, rounding: str | None = None,
          reduce: str = "mean") -> Policy:
    rounding = VARIANTS[variant]["rounding"] if rounding is None else rounding
    return Policy("dynamickv", budget, WindowAttention(window, kernel, pooling, reduce),
                  ProgressiveBudgets(window, r_max, interval, tail_reallocation, rounding), TopK(recent=lambda b: window),
                  schedule=PREFILL)
