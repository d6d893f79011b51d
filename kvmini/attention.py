r"""Attention over the cache, in two paths that must agree.

    \mathrm{softmax}\!\left(\frac{q k^\top}{\sqrt{D}} + \text{mask}\right) v

* `sdpa_attention` — PyTorch's fused kernel (one decode query: two grouped matmuls); no statistics.
* `explicit_attention` — the same maths, a chunk of queries at a time, plus the statistics a method
  asks for (`Statistic`, named in its `wants`); never an (n x n) buffer.
* `attend` picks: SDPA alone without statistics; SDPA plus the explicit pass over the last queries
  when every statistic covers only those (SnapKV, TOVA, ...); the explicit pass otherwise (H2O, D2O).
  A decode step's one attention row gives the output and every statistic.

Masking uses absolute positions, so it stays right after evictions: key j is visible to query i
iff pos_j <= pos_i (and pos_i - pos_j < window on sliding-window layers); pads (kvmini.cache.PAD) never are.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmini.cache import wide

REDUCTIONS = ("mean", "max", "sum", "heads")


@dataclass(frozen=True)
class Statistic:
    r"""What a method asks an attention pass for (its `wants`: a name -> Statistic), one number per cached key j:

        s_j = \mathrm{reduce}_{g} \sum_{i \in Q} f(A_{i\cdot})_j

    Q       the call's last `last` queries (None: every new query; 1: the last row)
    f       rows (..., T, S) -> (..., T, S); None is A itself. A key a query cannot see has A_ij = 0,
            and f must give 0 there too (checked on a row of zeros)
    reduce  how the g query heads sharing a KV head combine: mean | max | sum -> (B, H_kv, S);
            or "heads": each query head its own row -> (B, H, S), query head h = kv_head * g + i
    """

    last: int | None = None
    f: Callable | None = None
    reduce: str = "mean"

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, not {self.reduce!r}")
        if self.last is not None and self.last < 1:
            raise ValueError(f"a statistic's last must be None (every query) or >= 1, got {self.last}")
        if self.f is not None and self.f(torch.zeros(1, 1, 2)).any():
            raise ValueError("a statistic's f must give 0 where a key is not seen (attention 0)")


def reduce_heads(C: torch.Tensor, H_kv: int, reduce: str) -> torch.Tensor:
    """(B, H, S) per query head -> (B, H_kv, S): the g query heads of each KV head combined ("heads": C)."""
    B, H, S = C.shape
    return pool(C.view(B, H_kv, H // H_kv, S), reduce)


def add_up(sums: dict, key, C: torch.Tensor) -> torch.Tensor:
    """A prompt fed in several calls: this call's share C (B, H, S) added to the earlier calls' sums under
    `key` (over fewer keys: zero-padded), kept in `sums` and returned."""
    if key in sums:
        C = F.pad(sums[key], (0, C.shape[-1] - sums[key].shape[-1])) + C
    sums[key] = C
    return C


def finish(wants: dict, sums: dict) -> dict:
    """Each query head's sums, (B, H_kv, g, S) per (last, f), -> each statistic `wants` names (`reduce_heads`)."""
    return {name: pool(sums[s.last, s.f], s.reduce) for name, s in wants.items()}


def pool(C: torch.Tensor, reduce: str) -> torch.Tensor:
    """`reduce_heads` of sums kept per KV head, (B, H_kv, g, S) -> (B, H_kv, S) ("heads": (B, H, S))."""
    if reduce == "heads":
        return C.flatten(1, 2)
    return C.mean(2) if reduce == "mean" else C.amax(2) if reduce == "max" else C.sum(2)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask (B, H_kv, T, S): may query i see key j?  q_pos (B, T), k_pos (B, H_kv, S)."""
    qp = q_pos[:, None, :, None]  # (B, 1, T, 1)
    kp = k_pos[:, :, None, :]  # (B, H_kv, 1, S)
    mask = kp <= qp
    if window is not None:
        mask &= qp - kp < window
    return mask


def sdpa_attention(q, k, v, q_pos, k_pos, window=None, padded=False):
    """q (B, H, T, D); k, v (B, H_kv, S, D) -> (B, H, T, D). GQA without copying k or v.
    padded: some cache entries are pads (only the position mask hides them)."""
    B, H, T, _ = q.shape
    S, H_kv = k.shape[2], k.shape[1]
    if S == T and window is None and not padded:  # empty cache before this call: plain causal prefill
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if T == 1 and window is None and not padded:  # decode: every cached key is in the new token's past
        return _one_query_attention(q, k, v)
    if window is None and not padded:  # a later chunk: the cache's last T entries are its queries' own tokens
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(S - T)  # (T, S), for every row and head
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    mask = visible(q_pos, k_pos, window)  # (B, H_kv, T, S): windows and pads need the positions
    mask = mask[:, :, None].expand(B, H_kv, H // H_kv, T, S).reshape(B, H, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _one_query_attention(q, k, v, mask=None, with_row=False):
    """Decode step, T = 1: two grouped matmuls read K and V once (CPU SDPA is slow for one query).
    mask (B, H_kv, 1, S): the keys it may see, where rows hold pads; with_row: also return the attention
    row p (B, H_kv, g, S) of every query head."""
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    qg = q.view(B, H_kv, H // H_kv, D)  # (B, H_kv, g, D): the g query heads of each KV head
    scores = wide(qg @ k.transpose(-1, -2)) / D**0.5  # (B, H_kv, g, S)
    p = (scores if mask is None else scores.masked_fill(~mask, float("-inf"))).softmax(-1)
    out = (p.to(v.dtype) @ v).view(B, H, 1, D)
    return (out, p) if with_row else out


def attend(q, k, v, q_pos, k_pos, wants: dict | None, window=None, padded=False):
    """The attention of one layer and the statistics `wants` names (name -> Statistic): k, v (B, H_kv, S, D)
    end with the T entries of this call's queries q (B, H, T, D). Returns (out (B, H, T, D), seen: name ->
    (B, H_kv, S) or (B, H, S), float32, float64 for a float64 model)."""
    if not wants:
        return sdpa_attention(q, k, v, q_pos, k_pos, window, padded), {}
    if q.shape[2] == 1 and window is None:  # decode: the row is every statistic
        out, p = _one_query_attention(q, k, v, visible(q_pos, k_pos, None) if padded else None, True)  # (B, H_kv, g, S)
        return out, finish(wants, {(s.last, s.f): p if s.f is None else s.f(p[..., None, :])[..., 0, :]
                                   for s in wants.values()})
    lasts = [s.last for s in wants.values()]
    if None in lasts:
        return explicit_attention(q, k, v, q_pos, k_pos, wants, window, padded=padded)
    last = min(max(lasts), q.shape[2])  # only the last queries: SDPA for the output
    _, seen = explicit_attention(q[:, :, -last:], k, v, q_pos[:, -last:], k_pos, wants, window, padded=padded)
    return sdpa_attention(q, k, v, q_pos, k_pos, window, padded), seen


def explicit_attention(q, k, v, q_pos, k_pos, wants: dict, window=None, chunk: int = 64, padded=False):
    """`sdpa_attention` plus the statistics `wants` names, a chunk of queries at a time (g x 64 x S scores per
    KV head stay in the CPU's caches). Unless `padded`, the last T entries of k, v are the queries' own
    tokens, so a chunk scores only the keys before its end. Returns (out (B, H, T, D), seen: name -> sums)."""
    B, H, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    g = H // H_kv
    qg = q.view(B, H_kv, g, T, D)  # (B, H_kv, g, T, D): the g query heads of each KV head
    out = torch.empty(B, H_kv, g, T, D, dtype=q.dtype, device=q.device)
    sums = {(s.last, s.f): torch.zeros(B, H_kv, g, S, dtype=wide(q).dtype, device=q.device) for s in wants.values()}
    first = {(last, f): 0 if last is None else T - min(last, T) for last, f in sums}  # first query each sum covers
    causal_only = not padded and window is None  # every key before this call is in every query's past
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu_(1)  # query i's future: keys j > i
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        Tc, Sc = c1 - c0, S if padded else S - T + c1  # queries in the chunk, keys it can see at most
        q_c = qg[:, :, :, c0:c1].reshape(B, H_kv, g * Tc, D) * D**-0.5  # g heads share K: one matmul; scaled
        scores = wide(q_c @ k[:, :, :Sc].transpose(-1, -2)).view(B, H_kv, g, Tc, Sc)  # q k^T / sqrt(D)
        if causal_only:  # only the last Tc keys (this chunk's own tokens) can be in a query's future
            scores[..., Sc - Tc :].masked_fill_(future[:Tc, :Tc], float("-inf"))
        else:
            scores.masked_fill_(~visible(q_pos[:, c0:c1], k_pos[..., :Sc], window)[:, :, None], float("-inf"))
        p = scores.softmax(-1)  # (B, H_kv, g, Tc, Sc)
        out[:, :, :, c0:c1] = (p.to(v.dtype).view(B, H_kv, g * Tc, Sc) @ v[:, :, :Sc]).view(B, H_kv, g, Tc, D)
        for (last, f), total in sums.items():
            if c1 > first[last, f]:
                rows = p[:, :, :, max(first[last, f] - c0, 0) :]  # (B, H_kv, g, Tc', Sc): the chunk's queries in Q
                total[..., :Sc] += (rows if f is None else f(rows)).sum(3)
    return out.view(B, H, T, D), finish(wants, sums)
