r"""Progressive layer budgets (DynamicKV, Zhou et al. 2024, Sec. 4, Eq. 1-8, Alg. 1).

Inside the prefill forward, layer by layer:
    A_l = \mathrm{pool}(\mathrm{mean}_{i \in \text{last } w_s} \mathrm{softmax}(q_i K^\top))   (Eq. 1, per head)
    b_s = \min(r_{max} (w_t - w_s), n - w_s)                                                  (Eq. 2)
    keep the top b_s keys of A_l and the window                                               (Eq. 3-4)
and every m layers (and after the last one), over the l layers finished so far:
    I = \mathrm{TopK}_{indices}(A_{1..l}, (w_t - w_s) H l),  C_i = |I \cap \text{layer } i|    (Eq. 5-6)
    Z_i = b_s C_i / \max C,  rescaled so that \sum Z = (w_t - w_s) L                          (Eq. 7-8)
    trim each finished layer to its Z_i best keys + the window
Layers only shrink: what a layer dropped earlier cannot come back, so Z_i is capped at what it
holds and the cap's excess goes to the other layers by their counts.
Deviation: the official code forgets the tail re-allocation when L % m != 0; we always
re-allocate after the last layer. Z is rounded to integers with an exact total (largest
remainder) instead of int() floors, so the final total is exactly (w_t - w_s) L + w_s L.
"""
import torch

from kvmini.cache import LayerCache
from kvmini.errors import KvminiError
from kvmini.methods.allocators import proportional
from kvmini.methods.selectors import keep_top


class ProgressiveBudgets:
    """Called by the Policy after each layer is compressed during prefill; re-trims finished layers."""

    def __init__(self, window: int = 8, r_max: float = 10, interval: int = 4):
        self.window, self.r_max, self.interval = window, r_max, interval
        self.reset()

    def reset(self) -> None:
        self.scores: list[torch.Tensor] = []  # A_l over the prefix keys, (B, H_kv, n - ws), per finished layer

    def layer_budget(self, w_t: int) -> int:
        """b_s + w_s (Eq. 2): what a layer keeps before any re-allocation (n - w_s caps it by itself)."""
        if w_t <= self.window:
            raise KvminiError(f"dynamickv: a mean budget of {w_t} tokens per layer must exceed the window of "
                              f"{self.window}; raise --budget or lower --window")
        return int(self.r_max * (w_t - self.window)) + self.window

    def __call__(self, layer: int, cache, score: torch.Tensor, w_t: int) -> None:
        """score (B, H_kv, S) of `layer` before it was compressed; S = n, the whole prompt."""
        n = score.shape[-1]
        self.scores.append(score[:, :, : n - self.window])  # A_l over the non-window keys
        L, l = len(cache), layer + 1
        if l % self.interval and l != L:
            return
        # BEGIN EXERCISE progressive_budgets: tutorials/07_dynamickv.py, "Progressive re-allocation (Eq. 5-8)"
        A = torch.cat(self.scores, dim=-1)  # (B, H_kv, l * (n - ws)): all finished layers side by side
        k = min((w_t - self.window) * A.shape[1] * l, A.shape[-1] * A.shape[1])
        top = A.flatten(1).topk(k, dim=-1).indices % A.shape[-1] // (n - self.window)  # Eq. 5: layer of each hit
        C = torch.bincount(top.flatten(), minlength=l).tolist()  # Eq. 6
        held = [cache[i].length - self.window for i in range(l)]
        Z = proportional(C, (w_t - self.window) * L, 0, held)  # Eq. 7-8, capped: layers only shrink
        # END EXERCISE
        for i in range(l):
            if Z[i] < held[i]:
                self._trim(cache[i], self.scores[i], Z[i])

    def _trim(self, lc: LayerCache, A: torch.Tensor, keep: int) -> None:
        """Keep the `keep` best prefix keys of a layer by its own A, and the window."""
        prefix = lc.positions[:, :, : lc.length - self.window]  # (B, H_kv, held): kept prefix positions
        score = torch.cat([A.gather(2, prefix), A.new_full(prefix.shape[:2] + (self.window,), float("inf"))], -1)
        lc.keep(keep_top(score, keep + self.window, 0, self.window))
