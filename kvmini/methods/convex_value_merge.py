r"""Convex value merging (WeightedKV, Yuan et al. 2025, Sec. III-B and Alg. 1).

Every token keeps two running sums (cache aux, kvmini.methods.average_attention):
    a_j  attention it has received, summed over all queries        (Alg. 1 line 4)
    n_j  how many queries have attended to it (could see it)       (Alg. 1 line 5)
Whenever the cache holds more than its capacity m:
    \bar a = a / n                                                  (line 7)
    j = \arg\min \bar a  over the mergeable entries                 (line 8)
    v_{j+1} \leftarrow \frac{\bar a_j v_j + \bar a_{j+1} v_{j+1}}{\bar a_j + \bar a_{j+1}}   (line 9)
    delete k_j, v_j, a_j, n_j; token j+1 keeps its own a and n     (line 10)
Keys are only ever dropped; values are merged convexly into the right neighbour, so no
value vanishes outright. The paper protects no token in Alg. 1 except the newest one (j < m);
its experiments (Sec. V-A) keep 4 initial tokens and (m - 8) // 2 recent ones, our defaults.
Lines 6-10 run as written in `convex_value_merge`: one merge at a time, entries found by position, so
in any buffer order (a decode step deletes j in O(D) with `LayerCache.evict`, which moves the last
entry into its slot). `merge_runs` does the many merges after a prefill chunk at once (the deviation
below); `merge_down` picks one of them.
Deviation: for a prompt, Alg. 1 runs after each chunk of the prefill (chunk size 1 is Alg. 1
literally); n counts the queries of the chunk that could see the token (causal mask).
Deviation (`chunk_merge="runs"`, the default): within a chunk, `merge_runs` deletes the same
entries as Alg. 1's lines 7-10 repeated on the chunk's cache (the lowest abar, which no merge changes;
token by token, Alg. 1's later rows would see a cache already compressed) but merges a run of consecutive deleted
entries into the surviving entry after it in one convex step, each weighted by its abar:
    v_s \leftarrow \frac{\bar a_s v_s + \sum_{i \in run} \bar a_i v_i}{\bar a_s + \sum_{i \in run} \bar a_i}
This is line 9 exactly for a run of one; for longer runs Alg. 1's order (lowest first, each into
its current neighbour) weighs the run's values differently. `chunk_merge="sequential"` runs
`convex_value_merge`; tests/test_weightedkv.py measures the difference. Measured on the default
model (512-token prompt, capacity 20%, next-token KL): Alg. 1 token by token is 0.049 from the full
cache in 17.9 s; chunks of the capacity 0.035 (runs, 0.8 s) and 0.033 (sequential, 2.5 s), each
0.0055 from Alg. 1; streaming perplexity (2,048 tokens, capacity 256, chunks of 16): 12.46 runs,
12.43 sequential.
"""
import torch

from kvmini.cache import PAD, LayerCache, wide


def convex_value_merge(lc: LayerCache, capacity: int, sinks: int, recent, newest: int | None = None, note=None,
                       keep_order: bool = True) -> None:
    """Alg. 1 lines 6-10, one merge per excess entry, until the layer holds `capacity` entries.

    Entries are found by position, so the buffer may be in any order: j is the lowest abar among the
    entries neither a sink (position < `sinks`) nor in the recent window (the max(recent, 1) newest
    positions, up to `newest`, default the newest held; `recent` an int or one per row), ties to the
    earliest; its right neighbour is the held entry with the next position (it may be a recent one).
    Deleting j: `keep_order` keeps the others in their order (O(S D)), else `LayerCache.evict`
    moves the last entry into j's slot (O(D), a decode step). `note(evicted, into, weight)`, if given,
    hears the positions of j and its neighbour and the weight of v_j, each (B, H_kv, 1), per merge.
    """
    # BEGIN EXERCISE convex_value_merge: tutorials/06_weightedkv.py, "Algorithm 1 step by step"
    while lc.length > capacity:
        pos = lc.positions  # (B, H_kv, S)
        abar = lc.aux("a") / lc.aux("n")  # line 7
        top = pos.amax(-1, keepdim=True) if newest is None else newest
        window = recent.clamp(min=1) if isinstance(recent, torch.Tensor) else max(recent, 1)
        free = (pos >= sinks) & (pos <= top - window)  # j may be these: line 8's range
        masked = abar.masked_fill(~free, float("inf"))
        low = free & (masked == masked.amin(-1, keepdim=True))  # line 8, ties
        j = torch.where(low, pos, PAD).argmin(-1, keepdim=True)  # (B, H_kv, 1): the earliest
        nxt = torch.where(pos > pos.gather(2, j), pos, PAD).argmin(-1, keepdim=True)  # its right neighbour
        w_j, w_next = abar.gather(2, j), abar.gather(2, nxt)  # (B, H_kv, 1) each
        share = torch.where(w_j + w_next > 0, w_j / (w_j + w_next), 0.5)  # (B, H_kv, 1): the weight of v_j
        if note is not None:
            note(pos.gather(2, j), pos.gather(2, nxt), share)
        D = lc.values.shape[-1]
        at_j, at_next = j[..., None].expand(-1, -1, -1, D), nxt[..., None].expand(-1, -1, -1, D)
        w = share[..., None]  # (B, H_kv, 1, 1)
        merged = w * wide(lc.values.gather(2, at_j)) + (1 - w) * wide(lc.values.gather(2, at_next))  # line 9
        lc.values.scatter_(2, at_next, merged.to(lc.values.dtype))
        if keep_order:  # line 10: every entry but j
            rest = torch.arange(lc.length - 1, device=j.device).expand(*j.shape[:2], -1)  # (B, H_kv, S - 1)
            lc.keep(rest + (rest >= j).long())
        else:
            lc.evict(j[..., 0])
    # END EXERCISE


def merge_runs(lc: LayerCache, capacity: int, sinks: int, recent: int, note=None) -> None:
    """Lines 6-10 for S - capacity excess entries at once (the module docstring's deviation).

    Deleted: the S - capacity lowest abar after the sinks and before the recent window, ties to the
    earliest (as line 8 picks them one by one). Each run of deleted entries merges into the held
    entry after it: v_s <- (abar_s v_s + sum abar_i v_i) / (abar_s + sum abar_i) (equal weights if all are 0).
    `note(evicted, into, weight)`, if given, hears each deleted entry's position, the position it merges
    into and its weight there, each (B, H_kv, S - capacity).
    """
    S, D = lc.length, lc.values.shape[-1]
    order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): position order
    abar = (lc.aux("a") / lc.aux("n")).gather(2, order)  # (B, H_kv, S), line 7, in position order
    last = S - max(recent, 1)
    deleted = abar[:, :, sinks:last].argsort(dim=-1, stable=True)[..., : S - capacity] + sinks  # line 8, ranked
    dead = torch.zeros_like(abar, dtype=torch.bool).scatter_(2, deleted, True)  # (B, H_kv, S)
    rank = torch.arange(S, device=abar.device).expand_as(abar)
    target = torch.where(dead, S, rank).flip(-1).cummin(-1).values.flip(-1)  # each entry's first held at or after it
    den = torch.zeros_like(abar).scatter_add_(2, target, abar)  # (B, H_kv, S): sum of weights per held entry
    w = torch.where(den.gather(2, target) > 0, abar, 1.0)  # all-zero groups: equal weights
    den = torch.zeros_like(abar).scatter_add_(2, target, w)
    at = order[..., None].expand(-1, -1, -1, D)
    v = wide(lc.values.gather(2, at))  # (B, H_kv, S, D) in position order
    num = torch.zeros_like(v).scatter_add_(2, target[..., None].expand(-1, -1, -1, D), w[..., None] * v)  # line 9
    if note is not None:
        pos = lc.positions.gather(2, order)  # (B, H_kv, S) in position order
        into = target.gather(2, deleted)  # (B, H_kv, E) ranks
        note(pos.gather(2, deleted), pos.gather(2, into), w.gather(2, deleted) / den.gather(2, into))
    merged_into = torch.zeros_like(abar).scatter_add_(2, target, dead.to(abar.dtype)) > 0  # held entries a run ends at
    lc.values.scatter_(2, at, torch.where(merged_into[..., None], num / den[..., None], v).to(lc.values.dtype))
    held = dead.to(torch.int8).argsort(dim=-1, stable=True)[..., :capacity]  # (B, H_kv, capacity) ranks
    lc.keep(order.gather(2, held))  # line 10, in position order


def merge_down(lc: LayerCache, b: int, sinks: int, recent, newest: int, sequential: bool = False, note=None) -> None:
    """Lines 6-10 until the layer holds b entries, every deleted value merged: one excess entry (a decode
    step) by `convex_value_merge` in O(D); more by `merge_runs`, or one by one with `sequential`."""
    if sequential:
        convex_value_merge(lc, b, sinks, recent, newest, note)
    elif lc.length == b + 1:
        convex_value_merge(lc, b, sinks, recent, newest, note, keep_order=False)
    else:
        merge_runs(lc, b, sinks, recent, note)
