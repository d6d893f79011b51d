"""RoCo (Ren & Zhu 2024): evict the lowest mean attention, sparing the keys whose attention still varies.

Paper: "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language Model Inference",
Siyu Ren, Kenny Q. Zhu (arXiv 2402.06262, 2024). Authors' code: DRSY/EasyKV, easykv/easykv.py at commit
a1d71ca, kv_policy='roco' (kv_mode 'encoding_decoding', i.e. 'auto' with a budget below the prompt); the
line numbers below (:N) are that file's.

After every call (the prompt in chunks of 64, EasyKV's stride in its README's auto example; run.py
--chunk-size 1 is token-wise; then one eviction per decode step), per layer of b tokens:
    1. the running sums of the mean attention score MAS = a / n and of its deviation (q), per cached
       key (kvmini.methods.robust_scope, R1-R2)
    2. the robust scope: the keys of largest deviation are shielded, the lowest MAS of the rest
       evicted (R3-R5)

The paper's full text was not available: the `paper` variant follows its abstract ("temporal attention
scores and robustness measures"), a summary ("mean attention score for importance, standard deviation
for scope construction") and a quoted sentence ("exclude tokens having top-r standard deviation from
eviction scope"); r, sinks, a recent window, n vs n - 1 in the deviation and GQA are not known from it.
Two variants; every option below overrides its part of the chosen one:

    option             paper (as reported)          official (EasyKV)
    scope              paper: r keys beyond the     official: sigma = 1e9 for sinks and last `recent`,
                       sinks and recent window      scope = the max(b - r - sinks, e) lowest sigma (:635, :722)
    robust             budget // 10 (unverified)    budget // 10 (recent_ratio 0.1, :207, :555)
    robust_decode      budget // 10                 3 * budget // 10 (hard-coded 0.3, :709-710)
    sinks              0                            4 (temp_length, :206, :634)
    decode_sinks       true                         false (no sinks in decode, :721-722)
    recent             0                            10 (cur_std[..., -10:] = 1e9, :633, :721)
    prompt_statistics  all                          after_budget (keep_attention=False, :603, :620)
With scope=official the sinks and the last `recent` keys are robust by sigma = 1e9, not kept outright:
when the robust set is smaller than they are (decode at b < 30), the sinks and then the oldest of the
window enter the scope, as in EasyKV (kvmini.methods.robust_scope).
Default: `official`, the one whose every line could be checked. Both variants: the deviation is the
population one (/n, as the code) over the group-mean attention row (EasyKV's GQA, :188-196, :683-688).
Chunked prefill: compressed after every call by design, so the kept set depends on the chunk size c
(EasyKV's stride; c = 1 is the paper's token-wise eviction).
Deviation: kvmini's budget b is the cache size EasyKV holds (its idx); EasyKV's user budget is b - stride
when (n - b) is a multiple of the stride, and its rules read B = user budget + stride (:546-550).
Deviation: kvmini's chunks start at the prompt's first token; EasyKV first prefills r_idx tokens so that
its chunks end exactly at the prompt's end (:551-554): the same calls when the stride divides n - b.
Deviation: EasyKV's auto mode fails with stride 1 (its slice [:-(stride-1)] at :666 is empty); kvmini
evicts at every decode step with any chunk size.
Deviation: EasyKV's 'decoding' mode (an integer budget above the prompt length: the prompt is never
evicted, the budget bounds the generated tokens, :228-366) is not reproduced: b counts every token.
Deviation: the variance is clamped at 0 (EasyKV's NaN for a rounding below 0 keeps that key robust).
Deviation: ties go by position (EasyKV: torch.topk's unspecified order): on a deviation tie the earlier
key is robust (paper) or the later (official, as a stable topk of the lowest would do); on an MAS tie the
later key is evicted (`keep_top`, `lowest`), where EasyKV's argmin would take the first candidate.
Deviation: statistics are summed from float32 rows (float64 in a float64 model); EasyKV casts each
attention row to the model's dtype (fp16) before summing (llama_patch.py:218-219).
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.budget import Rule
from kvmini.methods.method import Method
from kvmini.methods.robust_scope import COLUMN_SQUARES, deviation, robust_set
from kvmini.methods.selectors import shrink
from kvmini.attention import Statistic

TENTH = Rule("budget // 10", lambda b: b // 10)  # int(0.1 * b), EasyKV's recent_window
THREE_TENTHS = Rule("3 * budget // 10", lambda b: 3 * b // 10)  # int(0.3 * b) in decode
CHUNK = 64  # the prompt's chunks (EasyKV's stride)


@dataclass(frozen=True)
class Options:
    # RoCo's robust set: paper (the `robust` keys of largest deviation, beyond the sinks and recent window) | official
    # (EasyKV: the scope is the budget - robust - sinks keys of lowest deviation)
    scope: Literal["paper", "official"] = "official"
    # RoCo: keys of largest attention deviation kept out of the eviction scope while the prompt is compressed
    robust: int | Rule = TENTH
    robust_decode: int | Rule = THREE_TENTHS  # RoCo: the same while decoding
    sinks: int = 4  # first tokens always kept
    decode_sinks: bool = False  # RoCo: the sinks are protected while decoding too (EasyKV: prompt only)
    recent: int | Rule = 10  # most recent tokens always kept
    # RoCo: which queries the attention statistics count: all | after_budget (EasyKV: from the first call whose cache
    # exceeds the budget)
    prompt_statistics: Literal["all", "after_budget"] = "after_budget"


VARIANTS = {"paper": Options(scope="paper", robust=TENTH, robust_decode=TENTH, sinks=0, decode_sinks=True, recent=0,
                             prompt_statistics="all"),
            "official": Options()}
DEFAULT_VARIANT = "official"


class RoCo(Method):
    aux = ("a", "q", "n")  # per cached key: attention received, its squares, and from how many queries
    prefill_chunk = CHUNK

    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("roco", budget)
        self.o, self.paper = o, o.scope == "paper"
        self.robust, self.robust_decode = Rule.of_(o.robust, "robust"), Rule.of_(o.robust_decode, "robust_decode")
        self.guard_recent = Rule.of_(o.recent, "recent")
        self.sinks = o.sinks if self.paper and o.decode_sinks else 0  # what is always kept (the report, the page)
        self.recent = self.guard_recent if self.paper else Rule.of_(0, "recent")

    def before(self, cache, step) -> dict | None:
        return {"column_sums": Statistic(), "column_squares": COLUMN_SQUARES} if step.keeps_sums else None

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.keeps_sums:
            self.add_up(lc, stats, step)  # (R1-R2)
        if step.compresses and lc.length > b + step.slack:
            self.evicted[layer] += lc.length - b
            self.evict(lc, b, step.newest, decode=not step.in_prompt)  # (R3-R5)

    def add_up(self, lc, stats, step) -> None:
        """(R1-R2) a += sum_i A_ij, q += sum_i A_ij^2, n += the queries that saw j, (B, H_kv, S) each: in every
        call (paper), or from the first call whose cache overflows the budget (EasyKV, :603 and :620)."""
        if self.o.prompt_statistics == "after_budget" and (step.mean_budget is None or lc.length <= step.mean_budget):
            return
        lc.aux("a").add_(stats["column_sums"])
        lc.aux("n").add_(step.T - (lc.positions - step.start).clamp(min=0))  # seen from max(p, start) on
        lc.aux("q").add_(stats["column_squares"])

    def evict(self, lc, b: int, newest: int, decode: bool) -> None:
        """(R3) the robust set R; (R4) the scope, every key but R; (R5) its lowest MAS go, down to b (newest: the
        call's last position; decode: a step past the prompt)."""
        T, L, rho = self.size(b, lc.length - b, decode)
        robust = robust_set(deviation(lc), lc.positions, rho, T, L, later_first=not self.paper)
        mas = lc.aux("a") / lc.aux("n")  # (R1)
        shrink(lc, mas.masked_fill(robust, float("inf")), b, 0, 0, newest)

    def size(self, b: int, e: int, decode: bool) -> tuple[int, int, int]:
        """(sinks, recent, rho) for a layer of budget b holding b + e entries."""
        T = self.o.sinks if not decode or self.o.decode_sinks else 0
        L, r = self.guard_recent(b), (self.robust_decode if decode else self.robust)(b)
        if self.paper:
            return T, L, T + L + r
        return T, L, min(e + r + T, b)  # S - k, k = max(b - r - T, e): easykv.py:635 (prompt), :722 (decode, T = 0)

    def problem(self, b: int) -> str | None:
        if not self.paper:
            return None  # EasyKV runs with any budget; what it protects then leaks (kvmini.methods.robust_scope)
        for decode in (False, True):
            T, L, rho = self.size(b, 1, decode)
            if rho > b:
                return f"too small for {T} sinks, a window of {L} tokens and {rho - T - L} robust tokens"
        return None

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        mas = lc.aux("a") / lc.aux("n").clamp(min=1)
        return "mean attention a/n over the queries that saw each key (RoCo's MAS; the robust set is shielded)", mas


def build(budget: float, o: Options = Options()) -> RoCo:
    return RoCo(budget, o)
