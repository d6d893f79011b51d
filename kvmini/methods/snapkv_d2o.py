"""SnapKV scores with D2O's layer budgets and merging: a composition no paper ran.

    scorer      SnapKV's pooled attention of the observation window (scorers.WindowAttention)
    budgeter    D2O's variance-softmax over layers (variance_softmax.VarianceSoftmax, Eq. 4-5)
    compressor  the observation window + the best-scoring keys (TopK), evicted keys merged into
                their nearest kept key when similar enough (ema_merging.EMAMerge, Eq. 9-12)
    schedule    once, when the prompt is complete (SnapKV's); decode steps append
Defaults: SnapKV's (window 32, kernel 7, avg pooling) and kvmini's reading of D2O (beta 0.7,
allocation zscore, temperature 1); a layer keeps at least window + 4 tokens.
"""
from dataclasses import dataclass

from kvmini.methods import options
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.scorers import WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.methods.variance_softmax import VarianceSoftmax
from kvmini.parts import PREFILL
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options:
    window: int = options.window(32)
    kernel: int = options.kernel(7)
    pooling: options.Pooling = options.pooling("avg")
    beta: float = options.beta(0.7)
    allocation: options.Allocation = options.allocation("zscore")
    softmax_temperature: float = options.softmax_temperature(1.0)
    reduce: options.Reduce = options.reduce()


idle = options.idle_temperature  # given with allocation other than zscore, softmax_temperature is refused


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("snapkv_d2o", budget, WindowAttention(o.window, o.kernel, o.pooling, o.reduce),
                  VarianceSoftmax(o.allocation, o.softmax_temperature, o.window + 4, o.reduce),
                  TopK(recent=o.window, merge=EMAMerge(o.beta)), schedule=PREFILL)
