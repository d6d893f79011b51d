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
`ranking=cumulative` ranks by the prompt's column sums (the paper's Table 3). Both use k = 1
(the last query's row) and group reduction mean. Default: the `paper` variant (the README's
DBudgetKV table has the measured comparison). In a batch, every sequence gets its own budgets
(kvmini.policy.PerSequence).
"""
from kvmini.errors import KvminiError
from kvmini.methods.frobenius_stop import FrobeniusStop
from kvmini.methods.scorers import CumulativeAttention, Position, WindowAttention
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL
from kvmini.policy import Policy

CHOOSES_BUDGET = True  # the registry rejects --budget for this method
VARIANTS = {
    "paper": dict(ranking="position", threshold=0.01, protected_layers="0,1", norm_excludes_kept=False),
    "official": dict(ranking="window_attention", threshold=0.05, protected_layers="", norm_excludes_kept=True),
}
DEFAULTS_SHOWN = {name: "by variant" for name in VARIANTS["paper"]}


def build(budget: None, variant: str = "paper", ranking: str | None = None, threshold: float | None = None,
          protected_layers: str | None = None, norm_excludes_kept: bool | None = None, k: int = 1, sinks: int = 4,
          window: int = 8, reduce: str = "mean") -> Policy:
    given = dict(ranking=ranking, threshold=threshold, protected_layers=protected_layers,
                 norm_excludes_kept=norm_excludes_kept)
    o = {**VARIANTS[variant], **{key: v for key, v in given.items() if v is not None}}
    if k > 1 and o["ranking"] == "window_attention":
        raise KvminiError("dbudgetkv: --k above 1 needs --ranking position or cumulative (the window ranking "
                          "takes the attention statistics of the last --window queries)")
    scorer, compressor = {
        "position": (Position(), TopK(sinks)),
        "cumulative": (CumulativeAttention(reduce), TopK()),
        "window_attention": (WindowAttention(window, kernel=1, reduce=reduce), TopK(recent=lambda b: window)),
    }[o["ranking"]]
    rule = FrobeniusStop(o["threshold"], k, o["ranking"], sinks, reduce, parse_layers(o["protected_layers"]), window,
                         o["norm_excludes_kept"])
    return Policy("dbudgetkv", None, scorer, rule, compressor, schedule=PREFILL)


def parse_layers(text: str) -> tuple[int, ...]:
    """"0,1" -> (0, 1); "0,1,-1" -> (0, 1, -1) (-1: the last layer); "" -> ()."""
    return tuple(int(x) for x in text.split(",") if x.strip())
