"""SnapKV scores with D2O's layer budgets and merging: a composition no paper ran.

    scorer      SnapKV's pooled attention of the observation window (snapkv.WindowAttention)
    budgeter    D2O's variance-softmax over layers (variance_softmax.VarianceSoftmax, Eq. 4-5)
    compressor  the observation window + the best-scoring keys (TopK), evicted keys merged into
                their nearest kept key when similar enough (ema_merging.EMAMerge, Eq. 9-12)
    schedule    once, when the prompt is complete (SnapKV's); decode steps append
Defaults: SnapKV's (window 32, kernel 7, avg pooling) and kvmini's reading of D2O (beta 0.7,
allocation zscore, temperature 1); a layer keeps at least window + 4 tokens.
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.topk import TopK
from kvmini.methods.snapkv import WindowAttention
from kvmini.methods.variance_softmax import VarianceSoftmax, idle_temperature
from kvmini.parts import PREFILL
from kvmini.policy import Policy


@dataclass(frozen=True)
class Options:
    window: int = 32  # observation window: the last prompt tokens whose attention scores the others; always kept
    kernel: int = 7  # pooling kernel along the keys
    pooling: Literal["avg", "max"] = "avg"  # pooling of the window's scores along the keys
    beta: float = 0.7  # EMA weight of the newest similarity in D2O's merge threshold (Eq. 10)
    # D2O's layer allocation: official (min-max) | paper (softmax(-F_v)) | zscore (kvmini's)
    # | reciprocal | uniform (Table 4)
    allocation: Literal["official", "paper", "zscore", "reciprocal", "uniform"] = "zscore"
    softmax_temperature: float = 1.0  # temperature of D2O's softmax over standardized variances (allocation=zscore)
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


idle = idle_temperature  # given with allocation other than zscore, softmax_temperature is refused


def build(budget: float, o: Options = Options()) -> Policy:
    return Policy("snapkv_d2o", budget, WindowAttention(o.window, o.kernel, o.pooling, o.reduce),
                  VarianceSoftmax(o.allocation, o.softmax_temperature, o.window + 4, o.reduce),
                  TopK(recent=o.window, merge=EMAMerge(o.beta)), schedule=PREFILL)
