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

Variants: `paper` (the default: Alg. 1 re-allocates after the last layer too) and `official`
(DreamMr/DynamicKV: re-allocates only every m layers, so when L % m != 0 the last L % m layers
keep their first budget b_s + w_s; `tail_reallocation=false`). Other differences of the authors'
code are not options: it floors every count and share with int() and gives the remainder to the
last layer (kvmini rounds by largest remainder), and intermediate re-allocations share the whole
model's budget among the finished layers (kvmini caps them at what they hold).
"""
from kvmini.methods.progressive_budgets import ProgressiveBudgets
from kvmini.methods.scorers import WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL
from kvmini.policy import Policy


VARIANTS = {"paper": dict(tail_reallocation=True), "official": dict(tail_reallocation=False)}
DEFAULTS_SHOWN = {"tail_reallocation": "by variant"}


def build(budget: float, variant: str = "paper", window: int = 8, kernel: int = 7, pooling: str = "avg",
          r_max: float = 10, interval: int = 4, tail_reallocation: bool | None = None, reduce: str = "mean") -> Policy:
    tail = VARIANTS[variant]["tail_reallocation"] if tail_reallocation is None else tail_reallocation
    return Policy("dynamickv", budget, WindowAttention(window, kernel, pooling, reduce),
                  ProgressiveBudgets(window, r_max, interval, tail), TopK(recent=lambda b: window), schedule=PREFILL)
