r"""Progressive layer budgets (DynamicKV, Zhou et al. 2024, Sec. 4, Eq. 1-8, Alg. 1).

Inside the prefill forward, layer by layer:
    A_l = \mathrm{pool}(\mathrm{mean}_{i \in \text{last } w_s} \mathrm{softmax}(q_i K^\top))   (Eq. 1, per head)
    b_s = r_{max} (w_t - w_s)   (Eq. 2), capped by kvmini at n - w_s (a layer holds at most n)
    keep the top b_s keys of A_l and the window                                               (Eq. 3-4)
and every m layers (Alg. 1 line 24: l % m == 0), over the l layers finished so far:
    I = \mathrm{TopK}_{indices}(A_{1..l}, (w_t - w_s) H l),  C_i = |I \cap \text{layer } i|    (Eq. 5-6)
    Z_i = b_s C_i / \max C,  rescaled so that \sum Z = (w_t - w_s) L                          (Eq. 7-8)
    trim each finished layer to its Z_i best keys + the window
Alg. 1 (and the authors' code) re-allocates only when l % m == 0, so when L % m != 0 the last
L % m layers keep b_s + w_s each. `tail_reallocation=True` is kvmini's option (not the paper's
algorithm, nor its prose, which says "every m layers") that re-allocates after the last layer too.
`rounding` says how Z becomes whole numbers:
    exact   kvmini's: Z in proportion to C with the exact total (w_t - w_s) L (largest remainder);
            layers only shrink (what a layer dropped cannot come back), so Z_i is capped at what it
            holds and the cap's excess goes to the other layers by their counts
    floor   the authors' code (DreamMr/DynamicKV, update_and_reset_budget): C_i // l,
            Z_i = int(int(b_s C_i / \sum C) / r), normalised by the sum of the counts, the
            remainder to the last finished layer, each capped at n - w_s and never redistributed
    alg1    Alg. 1 lines 6-10 as written: Z_i = int(int(b_s C_i / \max C) / r), normalised by the
            largest count, no remainder handed out (the total may fall short of (w_t - w_s) L)
On the example of `floor_budgets`, alg1 gives [24, 7] where floor gives [24, 8].
Deviation: with `exact`, Z is not floored with int() as Alg. 1 lines 8 and 10 are.
Deviation: with `floor` and `alg1`, a layer given more than it holds keeps what it holds; the authors'
code slices its buffer past the kept keys into the window and then appends the window again, so it
holds some window entries twice (kvmini holds each once).
"""
import torch

from kvmini.errors import KvminiError
from kvmini.methods.allocators import proportional


def first_budgets(b: int, L: int, window: int, r_max: float) -> list[int]:
    """b_s + w_s per layer (Eq. 2): what a layer keeps before any re-allocation (n - w_s caps it by itself)."""
    if b <= window:
        raise KvminiError(f"dynamickv: a mean budget of {b} tokens per layer must exceed the window of "
                          f"{window}; raise --budget or lower --window")
    return [int(r_max * (b - window)) + window] * L


def reallocate(A_finished: list[torch.Tensor], held: list[int], n: int, w: int, w_t: int, L: int) -> tuple[list, list]:
    """Eq. 5-8 over the l finished layers: (C, Z), each layer's count of the global top scores and its new
    budget beyond the window. A_finished: each layer's A_l over its non-window keys (1, H_kv, n - w), -inf after
    them where a layer holds fewer;
    held: what each holds now; w_t the mean budget, L the model's layers."""
    l = len(A_finished)
    # BEGIN EXERCISE progressive_budgets: tutorials/07_dynamickv.py, "Progressive re-allocation (Eq. 5-8)"
    A = torch.cat(A_finished, dim=-1)  # (B, H_kv, l * (n - ws)): all finished layers side by side
    k = min((w_t - w) * A.shape[1] * l, int(A.isfinite().sum()))  # at most every key held (-inf: none there)
    top = A.flatten(1).topk(k, dim=-1).indices % A.shape[-1] // (n - w)  # Eq. 5: layer of each hit
    C = torch.bincount(top.flatten(), minlength=l).tolist()  # Eq. 6
    held = [h - w for h in held]
    Z = proportional(C, (w_t - w) * L, 0, held)  # Eq. 7-8, capped: layers only shrink
    # END EXERCISE
    return C, Z


def floor_budgets(C: list[int], b_s: int, base: int, L: int, cap: int, heads: int) -> list[int]:
    r"""Z of the l finished layers as the authors' code computes it (Eq. 7-8 with int() floors):
    counts C_i // l (after the last layer, the last count topped up to base * heads in all),
    Z_i = int(int(b_s C_i / \sum C) / r) with r = \sum_i int(b_s C_i / \sum C) / (base L),
    the remainder of base L to the last layer, each capped at cap = n - w_s.
    Example: C = [30, 10], b_s = 40, base = 8, L = 4: counts [15, 5], int(40 * [.75, .25]) = [30, 10],
    r = 40 / 32 = 1.25, Z = [24, 8] (sum 32: nothing left over)."""
    l = len(C)
    counts = [c // l for c in C]
    if l == L:
        counts[-1] += base * heads - sum(counts)
    total = sum(counts)
    fix = [int(b_s * c / total) for c in counts] if total else [0] * l
    r = sum(fix) / (base * L)
    fix = [int(k // r) for k in fix] if r else fix
    fix[-1] += base * L - sum(fix)
    return [min(z, cap) for z in fix]


def alg1_budgets(C: list[int], b_s: float, base: int, L: int) -> list[int]:
    r"""Z of the l finished layers as Alg. 1 lines 6-10 write it: the counts normalised by the largest,
    BL_i = int(b_s C_i / max C), r = \sum BL / (base L), Z_i = int(BL_i / r); nothing else is handed out.
    Example: C = [30, 10], b_s = 40, base = 8, L = 4: BL = [40, int(13.3)] = [40, 13], r = 53 / 32,
    Z = [int(24.2), int(7.8)] = [24, 7] (sum 31; `floor_budgets` gives [24, 8])."""
    top = max(C)
    BL = [int(b_s * c / top) for c in C] if top else [0] * len(C)
    r = sum(BL) / (base * L)
    return [int(k / r) for k in BL] if r else BL
