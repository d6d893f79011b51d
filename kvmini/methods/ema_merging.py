r"""EMA-threshold merging (D2O, Eq. 6-12): evicted tokens that closely resemble a kept one are
merged into it instead of being dropped.

    u_{ij} = \frac{k_i \cdot k_j}{\|k_i\| \|k_j\|},   j^*_i = \arg\max_j u_{ij}  over kept j   (Eq. 9)
    \tau_0 = \mathrm{mean}_{i \in \text{evicted}} u_{i j^*_i}   at prefill                          (Eq. 10)
    \tau_t = \beta \max_j u_{t j} + (1 - \beta) \tau_{t-1}      at decode step t
    i is merged iff u_{i j^*_i} \ge \tau   (for one evicted token, \ge \tau_t \iff \ge \tau_{t-1})
    k_j \leftarrow w_c k_j + \sum_{i \in E_j} w_i k_i,  v likewise                                  (Eq. 11-12)
    w_i = \frac{e^{u_{ij}}}{\sum_{i' \in E_j} e^{u_{i'j}} + e},   w_c = \frac{e}{\sum_{i' \in E_j} e^{u_{i'j}} + e}

(a softmax over {j itself, similarity 1} and the tokens that chose j; the weights sum to 1).
tau is kept per (sequence, KV head). A kept token's accumulated attention is not changed by a
merge. Deviation: the official code merges with raw cosine weights and a scatter-mean (not a
convex combination); we follow the paper.
"""
import math

import torch
import torch.nn.functional as F

from kvmini.cache import LayerCache


class EMAMerge:
    """The merge step of a TopK compressor: called with the indices a layer keeps, before they are
    gathered. Returns how many evicted tokens were merged (mean over KV heads), a 0-d tensor."""

    def __init__(self, beta: float = 0.7):
        self.beta = beta
        self.reset()

    def reset(self) -> None:
        self.tau: dict[int, torch.Tensor] = {}  # layer -> (B, H_kv)

    def __call__(self, layer: int, lc: LayerCache, keep: torch.Tensor) -> torch.Tensor:
        B, H_kv, S = lc.positions.shape
        evicted = torch.ones(B, H_kv, S, dtype=torch.int8, device=keep.device).scatter_(2, keep, 0)  # 1: evicted
        evict = evicted.argsort(dim=-1, descending=True, stable=True)[..., : S - keep.shape[2]]  # (B, H_kv, E) asc.
        D = lc.keys.shape[-1]
        # BEGIN EXERCISE ema_merging: tutorials/04_d2o_token_level.py, "Nearest neighbour, threshold and merge (Eq. 9-12)"
        k_keep = lc.keys.gather(2, keep[..., None].expand(-1, -1, -1, D)).float()  # (B, H_kv, b, D)
        k_evict = lc.keys.gather(2, evict[..., None].expand(-1, -1, -1, D)).float()  # (B, H_kv, E, D)
        u = F.normalize(k_evict, dim=-1) @ F.normalize(k_keep, dim=-1).transpose(-1, -2)  # (B, H_kv, E, b) Eq. 9
        best, j_star = u.max(-1)  # (B, H_kv, E)
        if layer not in self.tau:
            self.tau[layer] = best.mean(-1)  # Eq. 10, tau_0
            tau = self.tau[layer]
        else:
            tau = self.tau[layer]  # tau_{t-1}: the comparison is the same as with tau_t
            self.tau[layer] = self.beta * best.mean(-1) + (1 - self.beta) * tau
        merge = best >= tau[..., None]  # (B, H_kv, E)
        weight = torch.where(merge, best.exp(), torch.zeros_like(best))  # e^{u_ij*} of merged tokens, 0 otherwise
        den = torch.full(keep.shape, math.e, dtype=torch.float32, device=keep.device)  # (B, H_kv, b): e + ...
        den.scatter_add_(2, j_star, weight)
        v_keep = lc.values.gather(2, keep[..., None].expand(-1, -1, -1, D)).float()  # (B, H_kv, b, D)
        v_evict = lc.values.gather(2, evict[..., None].expand(-1, -1, -1, D)).float()  # (B, H_kv, E, D)
        for cache, x_keep, x_evict in ((lc.keys, k_keep, k_evict), (lc.values, v_keep, v_evict)):
            num = math.e * x_keep  # e * k_j ...
            num.scatter_add_(2, j_star[..., None].expand(-1, -1, -1, D), weight[..., None] * x_evict)  # + sum e^u k_i
            merged = (num / den[..., None]).to(cache.dtype)  # Eq. 11-12
            cache.scatter_(2, keep[..., None].expand(-1, -1, -1, D), merged)
        # END EXERCISE
        return merge.float().mean(1).sum()  # tokens merged, mean over heads
