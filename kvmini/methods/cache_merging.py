r"""Cache merging (CaM, Zhang et al., ICML 2024, Sec. 3, Eq. 14, Algorithm 1): an evicted value is
spread over the m tokens after it, with a probability that keeps the output perturbation small.

One head; A_t the step-t attention row; \bar A = \sum_{k \le t} A_k the attention each entry has
received so far (H2O's score, kept by kvmini.methods.cam). When entry i is evicted:

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
One implementation for one eviction (a decode step) and many (after a prompt call): `merge_oldest`.
"""
import torch
import torch.nn.functional as F

from kvmini.cache import PAD, LayerCache, along, wide
from kvmini.errors import one_of
from kvmini.methods.merged import Merged

MASKS = ("bernoulli", "expectation", "threshold", "always")
DIVIDES = ("count", "fixed")


def merge_probability(abar_i: torch.Tensor, abar_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 14 for evicted entries with scores abar_i (...) and their targets' scores (..., m), NaN where
    fewer than m targets exist: (p_i, the ratio before clamping), each (...)."""
    ratio = abar_i / abar_targets.nanmean(-1)  # \bar A_i / avg(\bar A_{j:j+m})
    return ratio.nan_to_num(nan=0.0).clamp(0.0, 1.0), ratio  # 0/0 -> 0; x/0 = inf -> 1


class CacheMerge:
    """StreamingLLM's eviction (the `sinks` first tokens and the most recent budget - sinks) with CaM's
    value merge of every evicted token into the next `m` held ones, and one run's merge draws.

    divide "count": v_i / (targets that exist) (the paper's v_i / m assumes m exist); "fixed": always
    v_i / m, as the authors' code (kv_cache_cam.py:37, with :39 clipping the targets).
    `trace`: None (default, no cost), or a list that each compression extends with a `Merged` record:
    `into` is the FIRST target (the m - 1 after it received the same share; -1: not merged), `weight`
    is M_i / divisor, the coefficient of v_i in every target."""

    def __init__(self, sinks: int = 4, m: int = 16, divide: str = "fixed", mask: str = "bernoulli", seed: int = 0):
        self.sinks, self.m, self.seed = sinks, m, seed
        self.divide, self.mask = one_of("CacheMerge divide", divide, DIVIDES), one_of("CacheMerge mask", mask, MASKS)
        self.trace: list[Merged] | None = None

    def start(self, L: int) -> None:
        """A new run of L layers: each layer's generator seeded again, the trace emptied."""
        self.generators = [torch.Generator().manual_seed(self.seed * 2**20 + layer) for layer in range(L)]
        if self.trace is not None:
            self.trace.clear()  # a new run

    def merge_mask(self, layer: int, p: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
        """M (B, H_kv, E) for p, ratio (B, H_kv, E)."""
        if self.mask == "expectation":
            return p
        if self.mask == "threshold":
            return (ratio > 1).to(p.dtype)  # NaN: no merge
        if self.mask == "always":
            return torch.ones_like(p)
        u = torch.rand((1,) + p.shape[1:], generator=self.generators[layer], dtype=torch.float64)  # Alg. 1 line 2:
        u = u.expand(p.shape[0], -1, -1).to(p.device)  # u < p, u from the layer's own generator, the same for every sequence
        return (u < p).to(p.dtype)

    def divisor(self, count: torch.Tensor) -> torch.Tensor | int:
        return self.m if self.divide == "fixed" else count.clamp(min=1)

    def __call__(self, layer: int, lc: LayerCache, score: torch.Tensor, b: int) -> torch.Tensor:
        """Layer `layer` down to b entries; returns the tokens merged (summed over rows, each a mean over heads)."""
        note = None if self.trace is None else lambda *record: self.trace.append(Merged(layer, *record))
        M = merge_oldest(lc, score, lc.length - b, self, layer, note)
        return M.mean(1).sum(-1).sum()


def merge_oldest(lc: LayerCache, score: torch.Tensor, E: int, cm: CacheMerge, layer: int, note=None) -> torch.Tensor:
    """Algorithm 1 for the E oldest entries after the sinks (positions below `sinks`), oldest first (the
    cascade: a later one may carry earlier merges), each into the m held entries with the next positions
    (pads, at position PAD, never). Found by position, so the buffer may be out of order: a decode step
    (E = 1) costs O(S) to find them and O(m D) to merge, then `evict`; more go by `keep`.
    Returns M (R, H_kv, E)."""
    pos, m = lc.positions, cm.m  # (R, H_kv, S)
    t_pos, slots = pos.masked_fill(pos < cm.sinks, PAD).topk(min(E + m, pos.shape[-1]), largest=False)  # (R, H_kv, E + m')
    real = t_pos != PAD  # the oldest non-sinks, ascending; then sinks and pads, never merged into
    abar = wide(score).gather(2, slots).masked_fill(~real, float("nan"))  # (R, H_kv, E + m')
    targets = F.pad(abar, (0, m), value=float("nan")).unfold(-1, m, 1)[:, :, 1 : 1 + E]  # (R, H_kv, E, m): the m after each
    p, ratio = merge_probability(abar[..., :E], targets)  # Eq. 14, (R, H_kv, E)
    M = cm.merge_mask(layer, p, ratio)  # (R, H_kv, E)
    w = M / cm.divisor(targets.isfinite().sum(-1))  # (R, H_kv, E): the coefficient of v_i in each target
    if note is not None:
        note(t_pos[..., :E], torch.where(w > 0, t_pos[..., 1 : 1 + E], -1), w)
    at = along(slots, lc.values)  # (R, H_kv, E + m', D)
    v = wide(lc.values.gather(2, at))  # in position order
    merged = v.clone()
    for e in range(E):  # Alg. 1 line 3, oldest first: entry e already holds the merges of earlier ones
        merged[:, :, e + 1 : e + 1 + m] += w[:, :, e, None, None] * merged[:, :, e : e + 1]
    lc.values.scatter_(2, at, torch.where(real[..., None], merged, v).to(lc.values.dtype))
    if E == 1:
        lc.evict(slots[..., 0])
    else:
        gone = torch.zeros_like(pos, dtype=torch.int8).scatter_(2, slots[..., :E], 1)
        lc.keep(gone.argsort(dim=-1, stable=True)[..., : pos.shape[-1] - E])  # the others, in buffer order
    return M
