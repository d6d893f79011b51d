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
In a batch, every sequence gets its own layer budgets (`row_budgets`; kvmini.cache's ragged heads).

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

import torch
import torch.nn.functional as F

from kvmini.methods import snapkv
from kvmini.methods.progressive_budgets import alg1_budgets, first_budgets, floor_budgets, reallocate
from kvmini.methods.rows import RowBudgets, kept, one_over, rows_held
from kvmini.methods.selectors import lowest
from kvmini.methods.snapkv import SnapKV


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


class DynamicKV(RowBudgets, SnapKV):
    """SnapKV's window scores, layer by layer in the prefill forward; every `interval` layers the finished
    layers are budgeted again against each other (Alg. 1) and trimmed."""

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__(budget, snapkv.Options(o.window, o.kernel, o.pooling, o.reduce), "dynamickv")
        self.o, self.progressive = o, o.layer_budgets == "progressive"

    def plan(self, b: int, L: int, n: int) -> list[int]:
        return first_budgets(b, L, self.window, self.o.r_max) if self.progressive else super().plan(b, L, n)

    def holds_more_because(self) -> str:
        """Why layers may hold more than the mean budget b asks (run.py's report, kvmini.report), or ''."""
        tail = len(self.budgets or ()) % self.o.interval
        if not self.progressive or not tail or self.o.tail_reallocation:
            return ""
        return (f"the last {tail} layers come after the last re-allocation (every {self.o.interval} layers, "
                "Alg. 1 line 24) and keep b_s + w_s; --tail-reallocation true re-budgets them")

    def before(self, cache, step) -> dict | None:
        if step.first:
            self.A, self.lengths, self.scores = [], [], {}  # per finished layer: A_l and its length per sequence, its score
            self.row_budgets = None
        return super().before(cache, step)

    def compress(self, layer: int, cache, score: torch.Tensor, step) -> None:
        if not self.progressive:  # the ablation: SnapKV with DynamicKV's window
            return super().compress(layer, cache, score, step)
        self.scores[layer] = score
        for i, b in self.rebudget(layer, cache, score, step).items():  # this layer, and the finished ones re-budgeted
            if cut := self.over(i, cache[i], b):  # b: per sequence
                slots = trim(cache[i], self.scores[i], *cut, self.window, step.newest)
                self.scores[i] = self.scores[i].gather(2, slots)  # the score follows what is left

    def rebudget(self, layer: int, cache, score: torch.Tensor, step) -> dict[int, list[int]]:
        """{layer: its budget per sequence} for this layer and every finished layer Eq. 5-8 re-budgets now (Alg. 1),
        each sequence by its own scores."""
        w, w_t, L, l, B, H_kv = self.window, step.mean_budget, len(cache), layer + 1, score.shape[0], score.shape[1]
        b_l, n = step.budgets[layer], rows_held(cache[layer])  # this layer's first budget; each sequence's entries
        self.A.append([score[r : r + 1, :, : n[r] - w] for r in range(B)])  # A_l over each sequence's non-window keys
        self.lengths.append([min(h, b_l) for h in n])  # what it holds once kept to b_l, per sequence
        keep = {layer: [b_l] * B}
        if l % self.o.interval == 0 or (l == L and self.o.tail_reallocation):  # Alg. 1 line 24; the tail is kvmini's
            for r in range(B):  # each sequence's own counts: once per re-allocation
                held, A = [h[r] for h in self.lengths], same_width([A_l[r] for A_l in self.A])
                C, Z = reallocate(A, held, A[0].shape[-1] + w, w, w_t, L)
                if self.o.rounding == "floor":
                    cap = n[r] - w
                    Z = floor_budgets(C, min(int(self.o.r_max * (w_t - w)), cap), w_t - w, L, cap, H_kv)
                elif self.o.rounding == "alg1":
                    Z = alg1_budgets(C, self.o.r_max * (w_t - w), w_t - w, L)  # b_s as Alg. 1 line 3
                for i in (i for i in range(l) if Z[i] < held[i] - w):
                    keep.setdefault(i, list(self.lengths[i]))[r] = Z[i] + w  # the other rows as they are
        for i, b in keep.items():
            self.lengths[i] = [min(h, x) for h, x in zip(self.lengths[i], b)]
        for i in range(l):
            self.set_budgets(i, [min(x, h) for x, h in zip(self.budget_rows(i, B), self.lengths[i])])
        return keep


def same_width(A: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's A_l (1, H_kv, n_l - w) at one width, -inf after its own keys: after a next prompt the layers
    hold different counts (what each kept of the prompt before), and Eq. 5 must count each hit for its own layer."""
    width = max(a.shape[-1] for a in A)
    return [F.pad(a, (0, width - a.shape[-1]), value=float("-inf")) for a in A]


def trim(lc, score: torch.Tensor, b, held: list[int] | None, window: int, newest: int) -> torch.Tensor:
    """`selectors.shrink` down to b entries (the window and the best scores; b and `held` one per row where
    sequences keep their own), returning each kept entry's old slot (B, H_kv, b), so that a layer trimmed again
    keeps its score aligned."""
    S = lc.length
    if one_over(lc, b, held):  # one entry to drop: the row's last entry moves into its slot
        victim = lowest(score, lc.positions, 0, window, newest)  # (B, H_kv)
        lc.evict(victim)
        last = S - 1 if held is None else torch.tensor(held, device=score.device)[:, None, None] - 1
        slots = torch.arange(S - 1, device=score.device)
        return torch.where(slots == victim[..., None], last, slots)
    idx, counts = kept(lc, score, b, 0, window, held)  # (B, H_kv, b)
    lc.keep(idx, counts)
    return idx


def build(budget: float, o: Options = Options()) -> DynamicKV:
    return DynamicKV(budget, o)
