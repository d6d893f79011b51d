r"""EMA-threshold merging (D2O, Eq. 9-12): evicted tokens that closely resemble a kept one are
merged into it instead of being dropped.
The default `d2o` (its `official` variant, the authors' code) merges by `scatter_mean_merge`; `convex_merge`
is the `paper` variant's Eq. 12.

    u_{ij} = \frac{k_i \cdot k_j}{\|k_i\| \|k_j\|},   j^*_i = \arg\max_j u_{ij}  over kept j   (Eq. 9)
    \tau_0 = \mathrm{mean}_{i \in \text{evicted}} u_{i j^*_i}   at a layer's first compression        (Eq. 10)
    \tau_t = \beta \max_j u_{t j} + (1 - \beta) \tau_{t-1}      at decode step t
    i is merged iff u_{i j^*_i} \ge \tau_t   (the threshold updated with this step's similarities)
    k_j \leftarrow w_c k_j + \sum_{i \in E_j} w_i k_i,  v likewise                                  (Eq. 11-12)
    w_i = \frac{e^{u_{ij}}}{\sum_{i' \in E_j} e^{u_{i'j}} + e},   w_c = \frac{e}{\sum_{i' \in E_j} e^{u_{i'j}} + e}

(a softmax over {j itself, similarity 1} and the tokens that chose j), tau per (sequence, KV head), or per
(sequence, layer) with `tau="per_layer"` (the official default). The first compression is the prompt's end
(the paper) or the first decode step (the official default).
`writes` says what a merge overwrites: both the key and the value (the paper), or one of them (an ablation:
docs/methods.md, "Why D2O loses here").
The authors' variants (`weights="official"`, `tau="per_layer"`) and kvmini's reading of Eq. 12:
docs/methods.md, "D2O".
Deviation: the official cache holds every query head (after repeat_kv); kvmini merges per KV head.
"""
import math

import torch
import torch.nn.functional as F

from kvmini.cache import PAD, LayerCache, wide
from kvmini.errors import one_of
from kvmini.methods.merged import Merged
from kvmini.methods.rows import kept, one_over
from kvmini.methods.selectors import lowest

WEIGHTS = ("paper", "official")
TAUS = ("per_head", "per_layer")
WRITES = ("both", "keys", "values")


class EMAMerge:
    """D2O's merge of evicted tokens into kept ones, one layer at a time, and each layer's threshold: called
    with the indices a layer keeps, before the cache gathers them, or (`one`) with the one entry each head evicts.
    `trace`: None (default, no cost), or a list that each call extends with a `Merged` record."""

    at_once = 2**18  # similarities held at once when many keys are evicted (docs/speed.md, "Where D2O's decode step goes")

    def __init__(self, beta: float = 0.7, weights: str = "paper", tau: str = "per_head", writes: str = "both"):
        self.beta, self.weights = beta, one_of("EMAMerge weights", weights, WEIGHTS)
        self.per_layer = one_of("EMAMerge tau", tau, TAUS) == "per_layer"
        writes = one_of("EMAMerge writes", writes, WRITES)
        self.written = {"both": slice(0, 2), "keys": slice(0, 1), "values": slice(1, 2)}[writes]  # of an entry's [k, v]
        self.trace: list[Merged] | None = None
        self.reset()

    def reset(self) -> None:
        """A new run: no layer has a threshold yet."""
        self.tau: dict[int, torch.Tensor] = {}  # layer -> its threshold (Eq. 10), (B, H_kv, 1), or (B, 1, 1) per layer
        self.partial: set[int] = set()  # layers where heads evicted different counts: some may have no threshold (NaN)
        if self.trace is not None:
            self.trace.clear()

    def __call__(self, layer: int, lc: LayerCache, keep: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Every entry of layer `layer` not in `keep` (B, H_kv, b) against the kept ones (Eq. 9-12), before
        they are gathered; `counts` (B, H_kv): each head keeps only its first counts[r] of `keep` (its pads
        neither kept nor merged). Returns the tokens merged (summed over sequences, mean over heads)."""
        pos = lc.positions  # (B, H_kv, S)
        mine = None if counts is None else torch.arange(keep.shape[2], device=keep.device) < counts[..., None]
        kept = torch.zeros_like(pos, dtype=torch.bool).scatter_(2, keep, True if mine is None else mine)
        evicted = ~kept if counts is None else ~kept & (pos != PAD)  # (B, H_kv, S)
        E = pos.shape[2] - keep.shape[2] if counts is None else int(evicted.sum(-1).max())
        evict = evicted.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :E]  # (B, H_kv, E) asc.
        D = lc.keys.shape[-1]
        k_keep = wide(lc.keys.gather(2, keep[..., None].expand(-1, -1, -1, D)))  # (B, H_kv, b, D)
        k_evict = wide(lc.keys.gather(2, evict[..., None].expand(-1, -1, -1, D)))  # (B, H_kv, E, D)
        unit = F.normalize(k_keep, dim=-1)  # the kept keys normalized once for every chunk: their norms are 1
        per_chunk = max(1, self.at_once // max(1, k_keep.shape[:-1].numel()))  # evicted keys per chunk
        others = None if mine is None else ~mine[:, :, None]  # (B, H_kv, 1, b): a head's places past its count
        found = [nearest(chunk, unit, unit.new_ones(unit.shape[:-1]), others) for chunk in k_evict.split(per_chunk, dim=2)]
        best, j_star = (torch.cat(t, -1) for t in zip(*found))  # (B, H_kv, E) each: Eq. 9
        return self.merge(layer, lc, evict, keep, j_star, best, None if mine is None else evicted.gather(2, evict))

    def one(self, layer: int, lc: LayerCache, victim: torch.Tensor, newest: int) -> torch.Tensor:
        """A decode step: each head's one evicted entry `victim` (B, H_kv) is read, then evicted (the new entry takes
        its slot), then compared with every entry held (never a shorter head's pads, positions after `newest`): its
        nearest j (Eq. 9), the threshold (Eq. 10), and j's key and value mixed with its own (Eq. 11-12 with E = 1:
        the same `convex_merge` or `scatter_mean_merge`), written back by index. Returns the tokens merged (summed
        over sequences, mean over heads)."""
        (r, h), (r_, h_) = lc.per_head, lc.per_entry  # index one entry (B, H_kv), or E of them (B, H_kv, E), per head
        x_i = wide(lc.entry_kv[r_, h_, victim[..., None]].flatten(-2))  # (B, H_kv, E = 1, 2D): the victim's [k | v]
        at = None if self.trace is None else lc.positions[r, h, victim][..., None]  # (B, H_kv, 1): its position
        lc.evict(victim)
        pos, kv = lc.positions, lc.entry_kv  # (B, H_kv, S), (B, H_kv, S, 2, D): the victim is no longer held
        k_i = x_i[..., : kv.shape[-1]]  # (B, H_kv, 1, D): its key
        best, j = nearest(k_i, wide(lc.keys), exclude=(pos > newest)[:, :, None] if lc.padded else None)  # Eq. 9
        merge = self.decide(layer, best).expand_as(best)  # (B, H_kv, 1): Eq. 10
        if self.trace is not None:
            self.record(layer, pos, at, j, best, merge)
        combine = convex_merge if self.weights == "paper" else scatter_mean_merge
        x_j = combine(wide(kv[r_, h_, j].flatten(-2)), x_i, torch.zeros_like(j), best, merge)  # (B, H_kv, 1, 2D)
        w = self.written
        kv[:, :, :, w].index_put_((r_, h_, j), x_j.unflatten(-1, (2, -1))[..., w, :].to(kv.dtype))
        return merge.sum() / merge.shape[1]  # tokens merged, mean over heads

    def merge(self, layer: int, lc: LayerCache, evict, targets, j_star, best, real=None) -> torch.Tensor:
        """Eq. 10-12 for the evicted entries `evict` (B, H_kv, E), each nearest to `targets[j_star]` with
        similarity `best` (targets (B, H_kv, T) and evict: indices into the cache; j_star, best (B, H_kv, E);
        `real` (B, H_kv, E): which are evicted, where heads evict different counts): the threshold decides which
        merge, and each target's key and value become their mix (only the targets are written). Returns the
        tokens merged (summed over sequences, mean over heads)."""
        merge = self.decide(layer, best, real).expand_as(best)  # (B, H_kv, E)
        if self.trace is not None:
            self.record(layer, lc.positions, lc.positions.gather(2, evict), targets.gather(2, j_star), best, merge)
        (r, h), kv, w = lc.per_entry, lc.entry_kv, self.written  # (B, 1, 1), (H_kv, 1): index entries (B, H_kv, s)
        pair = lambda idx: wide(kv[r, h, idx].flatten(-2))  # noqa: E731  [k | v] of entries idx, (B, H_kv, s, 2D)
        combine = convex_merge if self.weights == "paper" else scatter_mean_merge
        merged = combine(pair(targets), pair(evict), j_star, best, merge)  # (B, H_kv, T, 2D): [k | v], the same weights
        kv[:, :, :, w].index_put_((r, h, targets), merged.unflatten(-1, (2, -1))[..., w, :].to(kv.dtype))
        return merge.sum() / merge.shape[1]  # tokens merged, mean over heads

    def record(self, layer: int, pos, evicted, into, best, merge) -> None:
        """Append to the trace: the positions `evicted` (B, H_kv, E) of the evicted tokens and the entries `into`
        they are nearest to (indices into `pos`, (B, H_kv, S)), with each one's weight in Eq. 11-12 (or the
        official scatter-mean)."""
        S = pos.shape[2]
        if self.weights == "paper":  # w_i = e^u / (e + sum over the tokens merged into the same j of e^u)
            mass = torch.where(merge, best.exp(), 0.0)
            den = torch.full(pos.shape[:2] + (S,), math.e, dtype=mass.dtype, device=pos.device).scatter_add_(2, into, mass)
        else:  # u / (1 + |E_j|)
            mass = torch.where(merge, best, 0.0)
            den = torch.ones(pos.shape[:2] + (S,), dtype=mass.dtype, device=pos.device).scatter_add_(2, into, merge.to(mass.dtype))
        self.trace.append(Merged(layer, evicted, torch.where(merge, pos.gather(2, into), -1),
                                 mass / den.gather(2, into)))

    def decide(self, layer: int, best: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 10: update layer `layer`'s threshold with the evicted tokens' best similarities `best`
        (B, H_kv, E) and say which of them merge, (B, H_kv, E) bool ((B, 1, E) for a threshold per layer: every
        head alike). `real` (B, H_kv, E): the entries truly evicted, where heads evict different counts; a head that
        evicts none keeps its threshold (NaN: none yet)."""
        sim = best.mean(1, keepdim=True) if self.per_layer else best  # official: one threshold per layer,
        real_sim = None if real is None else real[:, :1] if self.per_layer else real  # similarities averaged over heads
        new = (sim.mean(-1, keepdim=True) if real is None else  # (B, H_kv, 1) or (B, 1, 1)
               torch.where(real_sim, sim, 0).sum(-1, keepdim=True) / real_sim.sum(-1, keepdim=True))
        prev = self.tau.get(layer)
        tau = ema_threshold(prev, new, self.beta)  # tau_0 if it has none yet
        if prev is not None and (real is not None or layer in self.partial):  # per head: tau_0, or no change
            tau = torch.where(prev.isnan(), new, torch.where(new.isnan(), prev, tau))
        self.tau[layer] = tau
        (self.partial.add if real is not None else self.partial.discard)(layer)  # some heads may have none yet
        return sim >= tau if real is None else (sim >= tau) & real


def shrink_merging(merge: EMAMerge, layer: int, lc: LayerCache, score: torch.Tensor, b, sinks: int, recent,
                   newest: int, held: list[int] | None = None) -> torch.Tensor:
    """`selectors.shrink` with the evicted tokens merged (Eq. 9-12): one entry over (a decode step) against every
    entry left once it is evicted (`EMAMerge.one`), more against the kept ones before they are gathered. Returns
    the tokens merged (summed over the sequences, each a mean over its heads)."""
    if one_over(lc, b, held):  # one victim a head: read, evicted, then merged
        return merge.one(layer, lc, lowest(score, lc.positions, sinks, recent, newest), newest)
    keep, counts = kept(lc, score, b, sinks, recent, held)  # (B, H_kv, b), None or (B, H_kv)
    merged = merge(layer, lc, keep, counts)
    lc.keep(keep, counts)
    return merged


def nearest(k_evict: torch.Tensor, keys: torch.Tensor, norms: torch.Tensor | None = None,
            exclude: torch.Tensor | None = None, eps: float = 1e-12):
    """Eq. 9: for every evicted key (B, H_kv, E, D) its most similar key of `keys` (B, H_kv, S, D) by cosine,
    u_ij = k_i . k_j / (|k_i| |k_j|) (each norm at least `eps`): (u_{i j*}, j*), each (B, H_kv, E). `norms`
    (B, H_kv, S): the keys' norms if the cache keeps them, so the keys are only read once, not normalized
    into a copy (unit keys: ones); `exclude` (B, H_kv, E, S) bool: pairs that may not be chosen."""
    # BEGIN EXERCISE ema_merging: tutorials/04_d2o_token_level.py, "Nearest neighbour, threshold and merge (Eq. 9-12)"
    norms = torch.linalg.vector_norm(keys, dim=-1) if norms is None else norms  # (B, H_kv, S)
    u = F.normalize(k_evict, dim=-1, eps=eps) @ keys.transpose(-1, -2) / norms.clamp_min(eps)[..., None, :]
    if exclude is not None:
        u = u.masked_fill(exclude, float("-inf"))
    return u.max(-1)
    # END EXERCISE


def ema_threshold(tau_prev: torch.Tensor | None, new: torch.Tensor, beta: float) -> torch.Tensor:
    """Eq. 10: tau_0 = the mean maximum similarity (`new`), then tau_t = beta new + (1 - beta) tau_{t-1}."""
    # BEGIN EXERCISE ema_merging: tutorials/04_d2o_token_level.py, "Nearest neighbour, threshold and merge (Eq. 9-12)"
    return new if tau_prev is None else beta * new + (1 - beta) * tau_prev
    # END EXERCISE


def convex_merge(x_keep, x_evict, j_star, best, merge) -> torch.Tensor:
    """Eq. 11-12: x_j <- w_c x_j + sum_i w_i x_i, softmax weights over {j (similarity 1)} + E_j."""
    # BEGIN EXERCISE ema_merging: tutorials/04_d2o_token_level.py, "Nearest neighbour, threshold and merge (Eq. 9-12)"
    weight = torch.where(merge, best.exp(), torch.zeros_like(best))  # e^{u_ij*} of merged tokens, 0 otherwise
    den = torch.full(x_keep.shape[:3], math.e, dtype=x_keep.dtype, device=x_keep.device)  # (B, H_kv, b): e + ...
    den.scatter_add_(2, j_star, weight)
    num = math.e * x_keep  # e * x_j ...
    num.scatter_add_(2, j_star[..., None].expand_as(x_evict), weight[..., None] * x_evict)  # + sum e^u x_i
    return num / den[..., None]
    # END EXERCISE


def scatter_mean_merge(x_keep, x_evict, j_star, best, merge) -> torch.Tensor:
    """The authors' code: x_j <- (x_j + sum_{i in E_j} u_ij x_i) / (1 + |E_j|), raw cosine weights."""
    weight = torch.where(merge, best, torch.zeros_like(best))  # (B, H_kv, E)
    count = torch.ones(x_keep.shape[:3], dtype=x_keep.dtype, device=x_keep.device)  # (B, H_kv, b): j itself
    count.scatter_add_(2, j_star, merge.to(x_keep.dtype))
    num = x_keep.clone()
    num.scatter_add_(2, j_star[..., None].expand_as(x_evict), weight[..., None] * x_evict)
    return num / count[..., None]
