r"""CaM (Zhang et al., ICML 2024): StreamingLLM's eviction, each evicted value merged into the next m tokens.

Paper: "CaM: Cache Merging for Memory-efficient LLMs Inference" (Yuxin Zhang, Yuxuan Du, Gen Luo,
Yunshan Zhong, Zhenyu Zhang, Shiwei Liu, Rongrong Ji; ICML 2024, PMLR 235:58840-58850).
Authors' code: github.com/zyxxmu/cam @ fc80e64.

After every call (each prefill chunk, each decode step), per layer:
    1. \bar A_j += this call's attention to each entry (H2O's sums), per KV head
    2. keep the sinks and the most recent tokens; merge each evicted value into the m entries after
       it with probability clamp(\bar A_i / avg \bar A_{j:j+m}, 0, 1) (kvmini.methods.cache_merging,
       Eq. 14 and Algorithm 1)

Two variants; every option below overrides its part of the chosen one:

    option         paper (Eq. 14, Alg. 1)            official (generate_task/streaming_llm/kv_cache_cam.py)
    merge_divide   count: v_i / (targets that exist)  fixed: always v_i / 16 (:37), also with fewer targets
They agree whenever m targets exist (layer budgets of at least sinks + m + 1 tokens). Both: m = 16
(:30), \bar A accumulated over every step (:20-25), p over the mean of the targets' \bar A (:32),
a Bernoulli merge mask (:36), the targets the 16 entries after the evicted one (:39).
Ablations as options: `merge_score=current` is Table 2's "w.o. Acc. Attention" (also the authors' HELM
code, cam_hf/utils_hh/modify_llama_cam.py:28-29); `merge_mask=always` Table 2's "w.o. Merge Mask";
`merge_mask=threshold` the rule of the authors' OPT/GPT-NeoX code (`merge_prob > 1`,
utils_hh/modify_opt_cam.py:30); `merge_mask=expectation` merges p_i v_i / m, the Bernoulli's mean.
Sources: the paper's body could not be retrieved (abstract only, PMLR/OpenReview); Eq. 10, 14,
Theorem 3.3 and Algorithm 1 are read from two independent paper summaries and third-party code
(VeloxQuant-MLX, NVIDIA kvpress CAMPress), which agree with each other and with the authors'
perplexity code; the paper's m, its sink count and its equation numbers other than 7, 10, 14 are unknown.
Defaults: the `official` variant (the one code path with a real bounded cache), 4 sinks, m = 16,
Bernoulli, merge seed 0, group reduction mean.
Without the gate (`merge_mask=always`) each kept value gains 1/m of each of the m values evicted
before it, merges included, so the values grow: Table 2's "w.o. Merge Mask" falls below the eviction
baseline. CaM against its base and against WeightedKV and D2O, measured: docs/evaluation.md.
Chunked prefill: compressed after every call by design: the kept positions do not depend on the
chunk size, but \bar A (so p) and the values do; chunk size 1 is the authors' perplexity path
(eval_long_ppl.py:82-97 feeds one token per forward; tests/test_cam.py checks it line by line).
Deviation: the authors' code draws M from the global, unseeded torch RNG; kvmini draws from a
private generator per layer, seeded at every run (merge_seed), so runs are reproducible, the joint
decode step draws what the layer-by-layer one draws, and generation sampling is untouched.
Deviation: CaM is a plug-in on any eviction (the paper also names H2O, Scissorhands); the authors'
code and headline results use StreamingLLM, the only base kvmini implements.
Deviation: the authors' code keeps start_size sinks (default 1, README 32) and re-ropes keys at their
cache index (pos-shift); kvmini keeps 4 sinks and original positions, as its streaming_llm.
Deviation: the authors' code is per query head (MHA); kvmini is per KV head, \bar A of a group reduced by mean.
Deviation: the authors' HELM and QA scripts (utils_hh, utils_lm_eval) are masked simulations whose cache
never shrinks (HELM: the current step's row, a merge one step early, a denominator over r - 2 entries;
QA: a max over the sinks and window, merged values leaking to earlier queries; OPT/NeoX: ×0.99 and
attention hacks): not reproduced.
Deviation: the prompt's evictions are merged too (the perplexity code has no prefill; the HELM code
drops the prompt's evictions unmerged); the clamp interval is [0, 1] (Table 3 compares others).
"""
from dataclasses import dataclass
from typing import Literal

import torch

from kvmini.budget import Rule
from kvmini.methods.cache_merging import CacheMerge
from kvmini.methods.method import Method
from kvmini.attention import Statistic


@dataclass(frozen=True)
class Options:
    sinks: int = 4  # first tokens always kept
    merge_window: int = 16  # CaM's m: an evicted value is merged into the next m tokens
    # CaM's share of an evicted value: v / (targets that exist) (count) or always v / m (fixed)
    merge_divide: Literal["count", "fixed"] = "fixed"
    # CaM's Eq. 14 on attention accumulated over all steps or the current step's only
    merge_score: Literal["accumulated", "current"] = "accumulated"
    # CaM's merge: sampled with p (bernoulli), by p (expectation), iff ratio > 1 (threshold), always
    merge_mask: Literal["bernoulli", "expectation", "threshold", "always"] = "bernoulli"
    merge_seed: int = 0  # seed of CaM's merge draws (a private generator per layer)
    reduce: Literal["mean", "max", "sum"] = "mean"  # how the query heads of a KV head are combined


VARIANTS = {"paper": Options(merge_divide="count"), "official": Options()}
DEFAULT_VARIANT = "official"


def idle(o: Options) -> dict[str, str]:
    """merge_seed seeds the Bernoulli draws only (given with another merge_mask, it is refused)."""
    return {} if o.merge_mask == "bernoulli" else {"merge_seed": f"--merge-mask {o.merge_mask} (it draws nothing)"}


class CaM(Method):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("cam", budget)
        self.sinks, self.reduce, self.accumulated = o.sinks, o.reduce, o.merge_score == "accumulated"
        self.recent = Rule(f"budget - {o.sinks}", lambda b: b - o.sinks)  # StreamingLLM's window
        self.merger = CacheMerge(o.sinks, o.merge_window, o.merge_divide, o.merge_mask, o.merge_seed)
        self.aux = ("attention_sum",) if self.accumulated else ()  # \bar A per cached token


    def before(self, cache, step) -> dict | None:
        if step.start == 0:
            self.merger.start(len(cache))  # a new run: the merge draws start again
        if self.accumulated:
            return {"column_sums": Statistic(reduce=self.reduce)} if step.keeps_sums else None  # sum_i A_ij
        # "w.o. Acc. Attention": the current step's row only
        return {"last_row": Statistic(last=1, reduce=self.reduce)} if step.compresses else None

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if self.accumulated and step.keeps_sums:
            lc.aux("attention_sum").add_(stats["column_sums"])  # 1. \bar A_j (B, H_kv, S)
        if step.compresses and lc.length > b + step.slack:
            self.evicted[layer] += lc.length - b
            score = lc.aux("attention_sum") if self.accumulated else stats["last_row"]
            self.run.merged[layer] += self.merger(layer, lc, score, b)  # 2. the oldest go, merged (Eq. 14, Alg. 1)

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        if not self.accumulated:
            return super().describe(lc)
        return "accumulated attention (CaM's Eq. 14 reads it; eviction goes by position)", lc.aux("attention_sum")


def build(budget: float, o: Options = Options()) -> CaM:
    return CaM(budget, o)
