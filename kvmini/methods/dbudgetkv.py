"""DBudgetKV (Ni et al. 2025): each layer prunes until its attention norm would drop by more than t.

Paper: "DBudgetKV: Dynamic Budget in KV Cache Compression for Ensuring Optimal Performance"
(Xuanfan Ni et al., 2025; arXiv 2502.16886).

Prefill only; decode appends. There is no --budget: the budget is what the norm-stopping rule
(kvmini.methods.frobenius_stop) chooses for each layer, reported per layer by run.py.
Two variants; every option overrides its part of the chosen one:

    option              paper (Sec. 3, Alg. 1)       official (Patrick-Ni/ReFreeKV scripts)
    ranking             position, 4 sinks            window_attention: last 8 queries, kept
    threshold           0.01                         0.05
    protected_layers    0,1                          none
    norm_excludes_kept  false                        true (sinks / window zeroed out of the row)
`ranking=cumulative` ranks by the prompt's column sums (the paper's Table 3). `fixed_share` replaces the
stopping rule by a fixed budget, the same share of the prompt in every layer (an ablation: the rule against
a fixed budget at the share it chose; kvmini.eval.ablation). Both use k = 1
(the last query's row) and group reduction mean. Default: the `paper` variant (docs/methods.md's
DBudgetKV table has the measured comparison). In a batch, every sequence gets its own budgets
(kvmini.per_sequence.PerSequence).
"""
from dataclasses import dataclass
from typing import Literal

from kvmini.errors import KvminiError
from kvmini.methods.allocators import Uniform
from kvmini.methods.frobenius_stop import FrobeniusStop
from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.topk import TopK
from kvmini.methods.snapkv import WindowAttention
from kvmini.methods.scorers import Position
from kvmini.parts import PREFILL
from kvmini.policy import Policy

CHOOSES_BUDGET = True  # the registry rejects --budget for this method
CHECKS = {"fixed_share": (lambda x: 0 <= x <= 1, "be in [0, 1] (0: the stopping rule chooses)")}


@dataclass(frozen=True)
class Options:
    # DBudgetKV's ranking: position | cumulative (column sums) | window_attention (authors' code)
    ranking: Literal["position", "cumulative", "window_attention"] = "position"
    threshold: float = 0.01  # allowed relative drop of the attention norm
    protected_layers: tuple[int, ...] = (0, 1)  # layers never compressed, -1 the last, e.g. 0,1 (empty: none)
    norm_excludes_kept: bool = False  # zero the always-kept tokens out of the norm (authors' code)
    k: int = 1  # last prompt rows averaged into the attention row (Eq. 1)
    sinks: int = 4  # first tokens always kept
    window: int = 8  # observation window: the last prompt tokens whose attention scores the others; always kept
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined
    fixed_share: float = 0.0  # 0: the stopping rule chooses; else every layer keeps this share of the prompt


VARIANTS = {"paper": Options(),
            "official": Options(ranking="window_attention", threshold=0.05, protected_layers=(), norm_excludes_kept=True)}
DEFAULT_VARIANT = "paper"


def build(budget: None, o: Options = Options()) -> Policy:
    if o.k > 1 and o.ranking == "window_attention":
        raise KvminiError("dbudgetkv: --k above 1 needs --ranking position or cumulative (the window ranking "
                          "takes the attention statistics of the last --window queries)")
    scorer, compressor = {
        "position": (Position(), TopK(o.sinks)),
        "cumulative": (CumulativeAttention(o.reduce), TopK()),
        "window_attention": (WindowAttention(o.window, kernel=1, reduce=o.reduce), TopK(recent=o.window)),
    }[o.ranking]
    if o.fixed_share:
        return Policy("dbudgetkv", o.fixed_share, scorer, Uniform(), compressor, schedule=PREFILL)
    rule = FrobeniusStop(o.threshold, o.k, o.ranking, o.sinks, o.reduce, o.protected_layers, o.window,
                         o.norm_excludes_kept)
    return Policy("dbudgetkv", None, scorer, rule, compressor, schedule=PREFILL)


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings (given, they are refused)."""
    why = "--fixed-share (they set the stopping rule)"
    return {k: why for k in ("threshold", "protected_layers", "norm_excludes_kept", "k")} if o.fixed_share else {}
