"""SnapKV scores with D2O's layer budgets and merging: a composition no paper ran.

Once, when the prompt is complete (SnapKV's schedule; decode steps append):
    1. each layer's score: SnapKV's pooled attention of the observation window (snapkv.window_scores)
    2. its budget: D2O's variance softmax over the layers (Eq. 4-5, variance_softmax.allocate), once
       every layer is measured
    3. the observation window + the best-scoring keys kept, the evicted keys merged into their nearest
       kept key when similar enough (D2O's Eq. 9-12, ema_merging)
Defaults: SnapKV's (window 32, kernel 7, avg pooling) and kvmini's reading of D2O (beta 0.7,
allocation zscore, temperature 1); a layer keeps at least window + 4 tokens.
"""
from dataclasses import dataclass
from typing import Literal


from kvmini.budget import check
from kvmini.methods import snapkv
from kvmini.methods.ema_merging import EMAMerge, shrink_merging
from kvmini.methods.rows import RowBudgets, rows_held
from kvmini.methods.snapkv import SnapKV, window_scores_of
from kvmini.methods.variance_softmax import allocate, idle_temperature, layer_variance
from kvmini.attention import Statistic, add_up, reduce_heads


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
COLUMNS = Statistic(None, None, "heads")  # every query's attention, per query head: Eq. 4's


class SnapKVD2O(RowBudgets, SnapKV):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__(budget, snapkv.Options(o.window, o.kernel, o.pooling, o.reduce), "snapkv_d2o")
        self.allocation, self.temperature, self.merger = o.allocation, o.softmax_temperature, EMAMerge(o.beta)


    def before(self, cache, step) -> dict | None:
        if step.start == 0:
            self.merger.reset()  # a new run: the EMA threshold starts again
        if step.first:
            self.columns, self.F_v, self.scores, self.row_budgets = {}, {}, {}, None
        wants = super().before(cache, step)  # SnapKV's: the window's rows, in the calls that hold window queries
        return {"column_sums": COLUMNS, **(wants or {})} if step.compresses and step.in_prompt else wants

    def after_attention(self, layer: int, cache, stats, step) -> None:
        if not stats:
            return
        lc, C = cache[layer], add_up(self.columns, layer, stats["column_sums"])  # (B, H, S): the prompt's so far
        if "window_sums" in stats:
            add_up(self.C, layer, stats["window_sums"])
        if not step.completes:
            return
        H_kv, held = lc.keys.shape[1], rows_held(lc)
        self.F_v[layer] = [layer_variance(self.allocation, reduce_heads(C[r : r + 1, :, :S], H_kv, self.reduce),
                                          C[r : r + 1, :, :S]) for r, S in enumerate(held)]  # 2. Eq. 4, per sequence
        self.scores[layer] = window_scores_of(lc, reduce_heads(self.C.pop(layer), H_kv, self.reduce), self.window,
                                              self.kernel, self.pooling)  # 1.

    def after_layers(self, cache, step) -> None:
        if not (step.compresses and step.completes):
            return
        L, B = len(cache), len(self.F_v[0])
        rows = [allocate([self.F_v[l][r] for l in range(L)], self.allocation, step.mean_budget, step.prompt_end,
                         cache[L - 1].length, (), (1, 1), self.window + 4, self.temperature) for r in range(B)]  # 2. Eq. 5
        for row in rows:
            check(self.name, self, dict(enumerate(row)), ())
        for layer, b in enumerate(zip(*rows)):
            self.set_budgets(layer, b)  # each sequence's S_l
        for layer in range(L):
            if cut := self.over(layer, cache[layer], self.row_budgets[layer]):  # 3.
                self.run.merged[layer] += shrink_merging(self.merger, layer, cache[layer], self.scores[layer], cut[0], 0,
                                                     self.window, step.newest, cut[1])


def build(budget: float, o: Options = Options()) -> SnapKVD2O:
    return SnapKVD2O(budget, o)
