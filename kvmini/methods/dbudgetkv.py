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
(`row_budgets`; kvmini.cache's ragged heads).
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.errors import KvminiError
from kvmini.methods.frobenius_stop import eq1_row, to_prune
from kvmini.methods.method import Method
from kvmini.methods.rows import RowBudgets, rows_held, shrink_rows
from kvmini.methods.snapkv import window_scores
from kvmini.attention import Statistic, add_up, reduce_heads

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


class DBudgetKV(RowBudgets, Method):
    schedule = "prefill"

    def __init__(self, o: Options = Options()):
        super().__init__("dbudgetkv", o.fixed_share or None)  # None: the stopping rule chooses each layer's budget
        self.o, self.rule = o, not o.fixed_share
        self.protected_spec = tuple(o.protected_layers) if self.rule else ()
        self.sinks = o.sinks if o.ranking == "position" else 0
        self.window = o.window if o.ranking == "window_attention" else 0
        self.aux = ("attention_sum",) if o.ranking == "cumulative" else ()  # the prompt's column sums

    def recent(self, b: int) -> int:
        return self.window

    def plan(self, b, L: int, n: int) -> list[int]:
        return [n] * L if self.rule else super().plan(b, L, n)  # the rule: nothing is pruned until a layer chose

    def before(self, cache, step) -> dict | None:
        if step.first:
            self.sums, self.row_budgets = {}, None  # layer -> name -> this prompt's sums so far, per query head (B, H, S)
        wanted = {}  # this call's share of the last k queries (Eq. 1), of the window's, of all (cumulative)
        for name, last, needed in (("dbudgetkv_rows", self.o.k, self.rule and step.compresses),
                                   ("dbudgetkv_window", self.window, self.window and step.compresses),
                                   ("column_sums", step.prompt_end, self.o.ranking == "cumulative" and step.keeps_sums)):
            mine = step.end - max(step.start, step.prompt_end - last)  # this call's queries among them
            if needed and step.in_prompt and mine > 0:
                wanted[name] = Statistic(mine, None, "heads")
        return wanted or None

    def after_attention(self, layer: int, cache, stats, step) -> None:
        if layer in step.protected or not step.in_prompt:
            return
        lc = cache[layer]
        H_kv, sums = lc.keys.shape[1], self.sums.setdefault(layer, {})
        for name in stats:  # this call's share added to the prompt's so far
            add_up(sums, name, stats[name])
        if step.compresses and not step.completes:
            return  # a piece of the prompt: its sums wait for the rest
        got = {name: reduce_heads(C, H_kv, self.o.reduce) for name, C in self.sums.pop(layer).items()}
        if step.keeps_sums and "column_sums" in got:
            lc.aux("attention_sum").add_(got["column_sums"])
        if not (step.compresses and step.completes):
            return
        score = {"position": lambda: lc.positions.float(), "cumulative": lambda: lc.aux("attention_sum"),
                 "window_attention": lambda: window_scores(got["dbudgetkv_window"], lc.held(), self.window, 1, "avg")}
        score = score[self.o.ranking]()  # (B, H_kv, S), higher = keep
        held = rows_held(lc)  # what each sequence holds
        if self.rule:  # Alg. 1: prune while the attention norm drops by at most t, each sequence its own cut
            s = eq1_row(got["dbudgetkv_rows"], lc.positions, self.o.k, step.prompt_end)  # Eq. 1
            order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order (an eviction may have mixed the buffer)
            s, ranked = s.gather(2, order), score.gather(2, order)  # each row's entries first (pads sort last)
            self.set_budgets(layer, [S - self.to_prune(s[r : r + 1, :, :S], ranked[r : r + 1, :, :S])
                                     for r, S in enumerate(held)])
        if cut := self.over(layer, lc, self.budget_rows(layer, len(held))):
            shrink_rows(lc, score, cut[0], self.sinks, self.window, step.newest, cut[1])

    def to_prune(self, s: torch.Tensor, score: torch.Tensor) -> int:
        """How many of one sequence's S entries Alg. 1 prunes, s and score (1, H_kv, S) in position order."""
        S = s.shape[-1]
        if self.o.ranking == "position":  # the earliest non-sinks first, the sinks last
            idx = torch.arange(S, device=s.device)
            order = torch.cat([idx[self.o.sinks :], idx[: self.o.sinks]]).expand_as(s)
        else:  # least attended first (the window scores +inf)
            order = score.argsort(dim=-1, stable=True)
        return to_prune(s, order, self.o.threshold, min(self.sinks, S), min(self.window, S), self.o.norm_excludes_kept)

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        if self.o.ranking == "position":
            return "the position itself (the later, the more important)", None
        if self.o.ranking == "cumulative":
            return "accumulated attention (H2O's score: summed over every query so far)", lc.aux("attention_sum")
        return super().describe(lc)


def build(budget: None, o: Options = Options()) -> DBudgetKV:
    if o.k > 1 and o.ranking == "window_attention":
        raise KvminiError("dbudgetkv: --k above 1 needs --ranking position or cumulative (the window ranking "
                          "takes the attention statistics of the last --window queries)")
    return DBudgetKV(o)


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings (given, they are refused)."""
    why = "--fixed-share (they set the stopping rule)"
    return {k: why for k in ("threshold", "protected_layers", "norm_excludes_kept", "k")} if o.fixed_share else {}
