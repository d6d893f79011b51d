"""D2O: variance-softmax layer budgets + H2O eviction with EMA-threshold merging.

"D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language Models",
Zhongwei Wan et al., ICLR 2025, arXiv 2406.13035.

    1. s_j: the attention each cached token received, summed over every query so far (H2O), per KV head
    2. F_v of every layer, from its prompt's attention (Eq. 4), and its budget S_l (Eq. 5: variance_softmax)
    3. each layer keeps T sinks + N heavy hitters + M recent tokens (Eq. 6-8); an evicted token is merged
       into its nearest kept one when similar enough (Eq. 9-12: ema_merging)
Steps 2-3 run when the prompt is complete (paper) or at the first decode step (official); step 3 then
after every decode step.
The default run (`official`) allocates by the authors' min-max variances, not Eq. 5 as printed (a one-hot
on real prompts: raw variances grow with n), and merges by their scatter-mean, not Eq. 12.

Variants `paper` (the equations) and `official` (AIoT-MLSys-Lab/D2O): docs/methods.md, "D2O".
Deviation: one cache per KV head (the g query heads reduced by mean); the authors' code keeps one per query head.
Deviation: `clamp_budgets` (default) bounds each S_l of Eq. 5 to [sinks + 4, n] and hands on the excess; Eq. 5
does not. The official allocation only floors S_l at sinks + 4 (its ratio is the authors', clamped to [0.01, 1]).
Deviation: the EMA threshold restarts with every run; the authors' code never resets it.
Deviation: every layer is held at its budget, also one budgeted n - 1 or more (the authors' code does not).
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.budget import Rule, check
from kvmini.methods.ema_merging import EMAMerge, shrink_merging
from kvmini.methods.method import Method
from kvmini.methods.rows import RowBudgets, rows_held, shrink_rows
from kvmini.methods.variance_softmax import HEADS, allocate, idle_temperature, layer_variance
from kvmini.attention import Statistic, add_up, reduce_heads


@dataclass(frozen=True)
class Options:
    # D2O's layer allocation: official (min-max) | paper (softmax(-F_v)) | zscore (kvmini's)
    # | reciprocal | uniform (Table 4)
    allocation: Literal["official", "paper", "zscore", "reciprocal", "uniform"] = "official"
    protected_layers: tuple[int, ...] = (0, 1, -1)  # layers never compressed, -1 the last, e.g. 0,1 (empty: none)
    nm: tuple[int, int] = (1, 1)  # heavy:recent split of the budget, e.g. 3:1
    # paper (sinks + N + M = budget) | official (the sinks inside the N heavy)
    split: Literal["paper", "official"] = "official"
    # paper (convex, Eq. 11-12) | official (raw-cosine scatter-mean) | off
    merge: Literal["paper", "official", "off"] = "official"
    merge_writes: Literal["both", "keys", "values"] = "both"  # what a merge overwrites (keys or values alone: an ablation)
    tau: Literal["per_head", "per_layer"] = "per_layer"  # merge threshold per_head | per_layer
    beta: float = 0.5  # EMA weight of the newest similarity in D2O's merge threshold (Eq. 10)
    # compress when the prompt ends (prompt) or at the first decode step (first_decode)
    start: Literal["prompt", "first_decode"] = "first_decode"
    sinks: int = 4  # first tokens always kept
    softmax_temperature: float = 1.0  # temperature of D2O's softmax over standardized variances (allocation=zscore)
    # clamp each layer's budget to [sinks + 4, n] and give the excess to the others (kvmini's; false: Eq. 5 as written)
    clamp_budgets: bool = True
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


VARIANTS = {"paper": Options(allocation="paper", protected_layers=(), nm=(3, 1), split="paper", merge="paper",
                             tau="per_head", beta=0.7, start="prompt"),
            "official": Options()}
DEFAULT_VARIANT = "official"


def idle(o: Options) -> dict[str, str]:
    """The options that do nothing in these settings -> the setting that makes them idle (given, they
    are refused: kvmini.methods.registry.make_policy)."""
    found = idle_temperature(o)
    if o.merge == "off":
        found.update({key: "--merge off (beta, tau and merge_writes set the merge)" for key in ("beta", "tau", "merge_writes")})
    return found


class D2O(RowBudgets, Method):
    """D2O's three steps, each at its moment of the run: 1. F_v (Eq. 4) when the prompt is complete; 2. S_l
    (Eq. 5) once, at the first decode step (official) or when the prompt is complete (paper, `start=prompt`);
    3. eviction and merging (Eq. 6-12) at every step after that."""

    schedule = "decode"  # the default variant's: compressed from the first decode step (start=prompt: "after_prompt")
    aux = ("attention_sum",)  # s_j of every cached token, per KV head
    sinks = property(lambda self: self.o.sinks)
    protected_spec = property(lambda self: tuple(self.o.protected_layers))

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("d2o", budget)
        self.o, (N, M) = o, o.nm
        if o.split == "paper":  # Eq. 8: S_l = T + N + M, N:M of what is not a sink
            self.recent = Rule(f"(budget - {o.sinks}) * {M} // {N + M}", lambda S_l: (S_l - o.sinks) * M // (N + M))
        else:  # the official code: N:M of S_l, the sinks inside the heavy part
            self.recent = Rule(f"budget * {M} // {N + M}", lambda S_l: S_l * M // (N + M))
        if o.start == "prompt":
            self.schedule = "after_prompt"
        self.merger = None if o.merge == "off" else EMAMerge(o.beta, weights=o.merge, tau=o.tau, writes=o.merge_writes)


    def before(self, cache, step) -> dict | None:
        if step.start == 0:  # a new run: s_j is kept in a protected layer too (the report and the page show it)
            for layer in range(len(cache)):
                cache[layer].declare(*self.aux)
            if self.merger is not None:
                self.merger.reset()
        if step.first:  # this prompt's F_v (per layer, one per sequence), its pieces' column sums, its S_l
            self.F_v, self.sums, self.row_budgets = {}, {}, None
        if step.compresses and step.first_decode and self.schedule == "decode":
            self.allocate(cache[0].length + step.T, cache[0].positions.device, step)  # 2. at the first decode step
        if not step.keeps_sums:  # (it holds whenever the run compresses, so when F_v is to be measured too)
            return None
        return {"column_sums": Statistic(reduce="heads" if self.per_head(step) else self.o.reduce)}

    def per_head(self, step) -> bool:
        """Are this call's column sums asked per query head: for Eq. 4 per head, or to be added up over a
        prompt fed in pieces?"""
        return step.compresses and step.in_prompt and (self.o.allocation in HEADS or in_pieces(step))

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc = cache[layer]
        column, heads = self.column_sums(layer, lc, stats, step)
        if column is None:
            return  # nothing asked, or a piece of the prompt: its sums wait for the rest
        if step.keeps_sums:
            lc.aux("attention_sum").add_(column)  # s_j += sum_i A_ij, (B, H_kv, S)
        if step.completes and step.compresses:  # 1. Eq. 4 on the whole prompt, each sequence's own
            self.F_v[layer] = [layer_variance(self.o.allocation, column[r : r + 1, :, :S], None if heads is None else
                                              heads[r : r + 1, :, :S]) for r, S in enumerate(rows_held(lc))]
        if step.compresses and not step.in_prompt and layer not in step.protected:  # 3. every step after the prompt
            self.compress(layer, lc, step)

    def after_layers(self, cache, step) -> None:
        """The paper's moment (start=prompt): when the prompt is complete, every layer measured, budgeted (Eq. 5)
        and compressed, in layer order."""
        if self.schedule == "after_prompt" and step.compresses and step.completes:
            self.allocate(cache[len(cache) - 1].length, cache[0].positions.device, step)  # 2.
            for layer in range(len(cache)):
                if layer not in step.protected:
                    self.compress(layer, cache[layer], step)  # 3.

    def column_sums(self, layer: int, lc, stats, step) -> tuple:
        """This call's column sums (B, H_kv, S) and, if Eq. 4 reads them, each query head's (B, H, S); for
        a prompt in pieces, the whole prompt's in the call that completes it and (None, None) before."""
        if not stats:
            return None, None
        C = stats["column_sums"]  # (B, H_kv, S), or (B, H, S) per query head
        if not self.per_head(step):
            return C, None
        if in_pieces(step):
            C = add_up(self.sums, layer, C)  # the prompt's so far
            if not step.completes:
                return None, None
            del self.sums[layer]
        return reduce_heads(C, lc.keys.shape[1], self.o.reduce), C if self.o.allocation in HEADS else None

    def allocate(self, length: int, device, step) -> None:
        """2. S_l of every layer from F_v (Eq. 5; `length`: what a layer holds now), each sequence's own, checked
        once; `budgets` reports their mean."""
        L, B = len(self.F_v), len(self.F_v[0])
        rows = [allocate([self.F_v[l][r] for l in range(L)], self.o.allocation, step.mean_budget, step.prompt_end,
                         length, step.protected, self.o.nm, self.o.sinks + 4, self.o.softmax_temperature,
                         self.o.clamp_budgets) for r in range(B)]
        for row in rows:
            check(self.name, self, dict(enumerate(row)), step.protected)
        for layer, b in enumerate(zip(*rows)):
            self.set_budgets(layer, b)  # each sequence's S_l
        self.recents = [torch.tensor([self.recent(x) for x in b], device=device)[:, None, None] for b in self.row_budgets]

    def compress(self, layer: int, lc, step) -> None:
        """3. Keep T sinks + N heavy hitters + M recent tokens (Eq. 6-8), the evicted merged first (Eq. 9-12);
        each sequence to its own budget, all at once (rows that keep different counts: kvmini.cache)."""
        cut = self.over(layer, lc, self.row_budgets[layer], step.slack)  # S_l of each sequence
        if cut is None:
            return
        b, held = cut  # an int and None when every sequence agrees, else one each
        score = lc.aux("attention_sum")  # (B, H_kv, S): s_j
        recent = self.recent(b) if held is None else self.recents[layer]  # (B, 1, 1): each row's window
        if self.merger is None:
            shrink_rows(lc, score, b, self.sinks, recent, step.newest, held)
        else:
            self.run.merged[layer] += shrink_merging(self.merger, layer, lc, score, b, self.sinks, recent, step.newest, held)

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return "accumulated attention (H2O's score: summed over every query so far)", lc.aux("attention_sum")


def in_pieces(step) -> bool:
    """The call is a piece of a prompt fed in several calls, and measured: its column sums wait for the rest."""
    return step.compresses and step.in_prompt and step.T < step.prompt_end - step.prompt_start


def build(budget: float, o: Options = Options()) -> D2O:
    return D2O(budget, o)
