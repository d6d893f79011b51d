"""SnapKV scores with D2O's layer budgets and merging: a composition no paper ran.

    scorer      SnapKV's pooled attention of the observation window (scorers.WindowAttention)
    budgeter    D2O's variance-softmax over layers (variance_softmax.VarianceSoftmax, Eq. 4-5)
    compressor  the observation window + the best-scoring keys (TopK), evicted keys merged into
                their nearest kept key when similar enough (ema_merging.EMAMerge, Eq. 9-12)
    schedule    once, when the prompt is complete (SnapKV's); decode steps append
Defaults: SnapKV's (window 32, kernel 7, avg pooling) and kvmini's reading of D2O (beta 0.7,
allocation zscore, temperature 1); a layer keeps at least window + 4 tokens.
"""
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.scorers import WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.methods.variance_softmax import VarianceSoftmax
from kvmini.parts import PREFILL
from kvmini.policy import Policy


def build(budget: float, window: int = 32, kernel: int = 7, pooling: str = "avg", beta: float = 0.7,
          allocation: str = "zscore", softmax_temperature: float = 1.0, reduce: str = "mean") -> Policy:
    return Policy("snapkv_d2o", budget, WindowAttention(window, kernel, pooling, reduce),
                  VarianceSoftmax(allocation, softmax_temperature, window + 4, reduce),
                  TopK(recent=lambda b: window, merge=EMAMerge(beta)), schedule=PREFILL)
