r"""Cache merging (CaM, Zhang et al., ICML 2024, Sec. 3, Eq. 14, Algorithm 1): an evicted value is
spread over the m tokens after it, with a probability that keeps the output perturbation small.

One head; A_t the step-t attention row; \bar A = \sum_{k \le t} A_k the attention each entry has
received so far (H2O's score, kvmini.methods.scorers.CumulativeAttention). When entry i is evicted:

    p_i = \mathrm{clamp}\big(\bar A_i / \mathrm{avg}(\bar A_{j:j+m}), 0, 1\big)            (Eq. 14)
    M_i \sim \mathrm{Bernoulli}(p_i)                                                   (Alg. 1 line 2)
    \bar v_k = v_k + M_i v_i / m   for k = j .. j+m-1                                  (Alg. 1 line 3)
    delete k_i, v_i, \bar A_i; keys are never merged; a target's \bar A is unchanged

j..j+m-1 are the m held entries right after i in position order (fewer near the end of the cache).
Merging into a run of consecutive tokens perturbs the next output by (avg A_{j:j+m} - A_i) v_i
(Eq. 10), less than evicting (-A_i v_i) iff avg < 2 A_i (Theorem 3.3); Eq. 14 samples the merge
with a probability that is 1 when \bar A_i >= avg \bar A and shrinks with \bar A_i below it.
Evictions go one at a time, oldest first, so an evicted value may already carry earlier merges
(the cascade); 0/0 gives p = 0 and x/0 gives p = 1 (the authors' kv_cache_cam.py:34-36).

M_i, per (sequence, KV head), by `mask`:
    bernoulli    M_i ~ Bernoulli(p_i): u < p_i with u ~ U(0, 1) from a private generator per layer
                 (seeded with seed * 2**20 + layer at the start of every run; the global RNG is
                 never touched): a layer draws u of shape (1, H_kv, E) for the E evictions of a call,
                 shared by the sequences of a batch (so a sequence merges as it does alone)
    expectation  M_i = p_i (the mean of the Bernoulli merge; deterministic)
    threshold    M_i = [\bar A_i / avg > 1] (the authors' OPT/GPT-NeoX code, utils_hh/modify_opt_cam.py:30)
    always       M_i = 1 (Table 2's ablation "w.o. Merge Mask")
Two implementations, one result: `merge_one` (a decode step: one eviction per head in a buffer out
of position order, found by position, O(S) to find it and its targets, O(m D) to merge) and
`merge_sequential` (many evictions after a prompt call, in position order).
"""
import torch
import torch.nn.functional as F

from kvmini.cache import PAD, LayerCache, wide
from kvmini.errors import one_of
from kvmini.methods.merged import Merged
from kvmini.parts import Compressor, Rule, most

MASKS = ("bernoulli", "expectation", "threshold", "always")
DIVIDES = ("count", "fixed")


def merge_probability(abar_i: torch.Tensor, abar_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 14 for evicted entries with scores abar_i (...) and their targets' scores (..., m), NaN where
    fewer than m targets exist: (p_i, the ratio before clamping), each (...)."""
    ratio = abar_i / abar_targets.nanmean(-1)  # \bar A_i / avg(\bar A_{j:j+m})
    return ratio.nan_to_num(nan=0.0).clamp(0.0, 1.0), ratio  # 0/0 -> 0; x/0 = inf -> 1


class CacheMerge(Compressor):
    """StreamingLLM's eviction (the `sinks` first tokens and the most recent budget - sinks) with CaM's
    value merge of every evicted token into the next `m` held ones.

    divide "count": v_i / (targets that exist) (the paper's v_i / m assumes m exist); "fixed": always
    v_i / m, as the authors' code (kv_cache_cam.py:37, with :39 clipping the targets).
    `trace`: None (default, no cost), or a list that each compression extends with a `Merged` record:
    `into` is the FIRST target (the m - 1 after it received the same share; -1: not merged), `weight`
    is M_i / divisor, the coefficient of v_i in every target."""

    def __init__(self, sinks: int = 4, m: int = 16, divide: str = "fixed", mask: str = "bernoulli", seed: int = 0):
        super().__init__(sinks, Rule(f"budget - {sinks}", lambda b: b - sinks))
        self.m, self.seed = m, seed
        self.divide, self.mask = one_of("CacheMerge divide", divide, DIVIDES), one_of("CacheMerge mask", mask, MASKS)
        self.trace: list[Merged] | None = None

    def start(self, L: int) -> None:
        super().start(L)
        self.generators = [torch.Generator().manual_seed(self.seed * 2**20 + layer) for layer in range(L)]
        if self.trace is not None:
            self.trace.clear()  # a new run

    def merge_mask(self, layers: tuple, p: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
        """M (R, H_kv, E) for p, ratio (R, H_kv, E), R = len(layers) * B rows, layer after layer."""
        if self.mask == "expectation":
            return p
        if self.mask == "threshold":
            return (ratio > 1).to(p.dtype)  # NaN: no merge
        if self.mask == "always":
            return torch.ones_like(p)
        B = p.shape[0] // len(layers)  # Alg. 1 line 2: u < p, u from each layer's own generator, the same
        u = torch.cat([torch.rand((1,) + p.shape[1:], generator=self.generators[layer], dtype=torch.float64)
                       .expand(B, -1, -1) for layer in layers]).to(p.device)  # (R, H_kv, E)  for every sequence
        return (u < p).to(p.dtype)

    def divisor(self, count: torch.Tensor) -> torch.Tensor | int:
        return self.m if self.divide == "fixed" else count.clamp(min=1)

    def __call__(self, layers: tuple, lc: LayerCache, score: torch.Tensor, b, newest: int) -> None:
        note = None
        if self.trace is not None:
            def note(*record):  # one record per layer, of its rows
                for i, layer in enumerate(layers):
                    self.trace.append(Merged(layer, *(t.chunk(len(layers))[i] for t in record)))
        if lc.length == most(b) + 1:
            M = merge_one(lc, score, self, layers, note)
        else:
            M = merge_sequential(lc, score, b, self, layers, note)
        self.count(layers, M.mean(1).sum(-1))  # mean over KV heads


def merge_one(lc: LayerCache, score: torch.Tensor, cm: CacheMerge, layers: tuple, note=None) -> torch.Tensor:
    """Algorithm 1 once per row and head, in a buffer out of position order: the victim i is the oldest
    entry after the sinks (positions below `sinks`), its targets the m held entries with the next
    positions (pads, at position PAD, never). Merges, evicts (`LayerCache.evict_one`) and returns M (R, H_kv, 1)."""
    pos = lc.positions  # (R, H_kv, S)
    S, D = pos.shape[-1], lc.values.shape[-1]
    i = pos.masked_fill(pos < cm.sinks, PAD).argmin(-1, keepdim=True)  # (R, H_kv, 1): the oldest non-sink
    later = pos.masked_fill(pos <= pos.gather(2, i), PAD)  # the entries after i
    t_pos, t = later.topk(min(cm.m, S), largest=False)  # (R, H_kv, m'): the next m' positions, their slots
    valid = t_pos != PAD  # (R, H_kv, m')
    abar = wide(score)
    abar_t = abar.gather(2, t).masked_fill(~valid, float("nan"))  # (R, H_kv, m'): NaN where no target
    p, ratio = merge_probability(abar.gather(2, i)[..., 0], abar_t)  # Eq. 14, (R, H_kv)
    M = cm.merge_mask(layers, p[..., None], ratio[..., None])  # (R, H_kv, 1)
    w = M / cm.divisor(valid.sum(-1, keepdim=True))  # (R, H_kv, 1): the coefficient of v_i in each target
    if note is not None:
        note(pos.gather(2, i), torch.where(w > 0, t_pos[..., :1], -1), w)
    v_i = wide(lc.values.gather(2, i[..., None].expand(-1, -1, -1, D)))  # (R, H_kv, 1, D)
    at = t[..., None].expand(-1, -1, -1, D)  # (R, H_kv, m', D)
    share = (w * valid)[..., None] * v_i  # (R, H_kv, m', D): Alg. 1 line 3, zero for a missing target
    lc.values.scatter_(2, at, (wide(lc.values.gather(2, at)) + share).to(lc.values.dtype))
    lc.evict_one(i[..., 0])
    return M


def merge_sequential(lc: LayerCache, score: torch.Tensor, b: int, cm: CacheMerge, layers: tuple,
                     note=None) -> torch.Tensor:
    """Algorithm 1 for the E = S - b oldest non-sink entries, one after the other (the cascade), in position
    order; then the layer keeps its sinks and its b - sinks newest entries. Returns M (B, H_kv, E)."""
    S, D, s, E, m = lc.length, lc.values.shape[-1], cm.sinks, lc.length - b, cm.m
    order = lc.positions.argsort(-1)  # (B, H_kv, S): position order
    abar = wide(score).gather(2, order)  # (B, H_kv, S)
    windows = F.pad(abar, (0, m), value=float("nan")).unfold(-1, m, 1)  # (B, H_kv, S + 1, m): [k, k + m)
    targets = windows[:, :, s + 1 : s + 1 + E]  # (B, H_kv, E, m): the m entries after each evicted one
    p, ratio = merge_probability(abar[..., s : s + E], targets)  # Eq. 14, (B, H_kv, E)
    M = cm.merge_mask(layers, p, ratio)  # (B, H_kv, E)
    count = (S - 1 - torch.arange(s, s + E, device=abar.device)).clamp(max=m)  # (E,): targets that exist
    w = M / cm.divisor(count)  # (B, H_kv, E)
    at = order[..., None].expand(-1, -1, -1, D)
    v = wide(lc.values.gather(2, at))  # (B, H_kv, S, D) in position order
    for e in range(E):  # Alg. 1 line 3, oldest first: v_{s+e} already holds the merges of earlier ones
        i = s + e
        v[:, :, i + 1 : i + 1 + m] += w[:, :, e, None, None] * v[:, :, i : i + 1]
    if note is not None:
        pos = lc.positions.gather(2, order)
        first = pos[..., s + 1 : s + 1 + E]  # (B, H_kv, E): each one's first target
        note(pos[..., s : s + E], torch.where(w > 0, first, -1), w)
    lc.values.scatter_(2, at, v.to(lc.values.dtype))
    keep = torch.cat([order[..., :s], order[..., s + E :]], -1)  # (B, H_kv, b): sinks + the newest, by position
    lc.keep(keep)
    return M
