r"""Attention over the cache, and the statistics a method asks of it.

    A = \mathrm{softmax}\!\left(\frac{q k^\top}{\sqrt{D}} + \text{mask}\right), \qquad \text{out} = A v

* `explicit_attention` writes A out and sums from it the statistics a method asks for (`Statistic`,
  named in its `wants`): the path of a decode step (one query: two matmuls), and, a chunk of queries at
  a time (`in_chunks`, a memory optimization), of a call whose statistics read every query's A (H2O, D2O).
* `sdpa_attention` is PyTorch's fused kernel for a call of several queries that needs no A, or only the
  last few rows of it (SnapKV's window: then `explicit_attention` runs over those rows alone).
* `attend` picks, and combines each statistic's g query heads of a KV head (`pool`).

Masking uses absolute positions, so it stays right after evictions: key j is visible to query i
iff pos_j <= pos_i (and pos_i - pos_j < window on sliding-window layers); pads (kvmini.cache.PAD) never are.
"""
from collections.abc import Callable
from dataclasses import dataclass, replace

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


def pool(C: torch.Tensor, reduce: str) -> torch.Tensor:
    """`reduce_heads` of sums kept per KV head, (B, H_kv, g, S) -> (B, H_kv, S) ("heads": (B, H, S))."""
    if reduce == "heads":
        return C.flatten(1, 2)
    return C.mean(2) if reduce == "mean" else C.amax(2) if reduce == "max" else C.sum(2)


def add_up(sums: dict, key, C: torch.Tensor) -> torch.Tensor:
    """Sums over queries that arrive in parts (chunks of one call, or the calls of a prompt fed in pieces):
    this part's C (..., S) added to the earlier parts' sum under `key` (over fewer keys: zero-padded)."""
    if key in sums:
        C = F.pad(sums[key], (0, C.shape[-1] - sums[key].shape[-1])) + C
    sums[key] = C
    return C


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask (B, H_kv, T, S): may query i see key j?  q_pos (B, T), k_pos (B, H_kv, S)."""
    qp = q_pos[:, None, :, None]  # (B, 1, T, 1)
    kp = k_pos[:, :, None, :]  # (B, H_kv, 1, S)
    mask = kp <= qp
    if window is not None:
        mask &= qp - kp < window
    return mask


def attend(q, k, v, q_pos, k_pos, wants: dict | None, window=None, padded=False):
    """The attention of one layer and the statistics `wants` names (name -> Statistic): q (B, H, T, D);
    k, v (B, H_kv, S, D) end with the T entries of this call's queries; padded: some entries are pads.
    Returns (out (B, H, T, D), stats: name -> (B, H_kv, S) or (B, H, S), float32, float64 for a float64 model)."""
    wants = wants or {}
    T = q.shape[2]
    if T == 1:  # a decode step: its one query's A gives the output and every statistic
        out, sums = explicit_attention(q, k, v, q_pos, k_pos, wants, window, padded)
    elif any(s.last is None for s in wants.values()):  # every query's A is wanted
        out, sums = in_chunks(q, k, v, q_pos, k_pos, wants, window, padded)
    else:  # the output by SDPA, and A written out for the last queries alone, if a statistic reads them
        out, sums = sdpa_attention(q, k, v, q_pos, k_pos, window, padded), {}
        if wants:
            n = min(max(s.last for s in wants.values()), T)
            sums = explicit_attention(q[:, :, -n:], k, v, q_pos[:, -n:], k_pos, wants, window, padded)[1]
    return out, {name: pool(sums[name], s.reduce) for name, s in wants.items()}


def sdpa_attention(q, k, v, q_pos, k_pos, window=None, padded=False):
    """q (B, H, T, D); k, v (B, H_kv, S, D) -> out (B, H, T, D), by PyTorch's fused kernel (GQA without copying
    k or v). Unless a window or pads need the positions, the last T keys are the queries' own: a causal mask."""
    B, H, T, _ = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    if window is None and not padded:
        if S == T:  # an empty cache before this call: a plain causal prefill
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(S - T)  # (T, S): every key before the call
    else:
        mask = visible(q_pos, k_pos, window)[:, :, None].expand(B, H_kv, H // H_kv, T, S).reshape(B, H, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def explicit_attention(q, k, v, q_pos, k_pos, wants: dict, window=None, padded=False):
    """A written out, out = A v, and each statistic `wants` names summed over its queries' rows of A. Unless
    `padded`, the last T entries of k, v are the queries' own tokens (a causal mask on them). Returns
    (out (B, H, T, D), sums: name -> (B, H_kv, g, S), each query head's; `attend` combines the g)."""
    B, H, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    g = H // H_kv
    qg = (q * D**-0.5).reshape(B, H_kv, g * T, D)  # row i*T + t: query t of head kv_head*g + i; they share K
    scores = wide(qg @ k.transpose(-1, -2))  # (B, H_kv, g*T, S): q k^T / sqrt(D), one matmul per KV head
    if padded or window is not None:
        mask = visible(q_pos, k_pos, window)  # (B, H_kv, T, S)
        scores.masked_fill_(~(mask if T == 1 else mask.repeat(1, 1, g, 1)), float("-inf"))  # every head's rows
    elif T > 1:  # only the call's own tokens, the last T keys, can be in a query's future
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1)  # (T, T): key j > query i
        scores[..., S - T :].masked_fill_(future.repeat(g, 1), float("-inf"))
    A = scores.softmax(-1)  # (B, H_kv, g*T, S)
    out = (A.to(v.dtype) @ v).view(B, H, T, D)
    sums = {}
    for name, s in wants.items():
        if T == 1:  # one query: its row is the sum, (B, H_kv, g, S)
            sums[name] = A if s.f is None else s.f(A[:, :, :, None])[:, :, :, 0]
            continue
        rows = A.view(B, H_kv, g, T, S)[:, :, :, T - min(s.last or T, T) :]  # (B, H_kv, g, |Q|, S): Q's rows
        sums[name] = (rows if s.f is None else s.f(rows)).sum(3)  # (B, H_kv, g, S)
    return out, sums


def in_chunks(q, k, v, q_pos, k_pos, wants: dict, window=None, padded=False, chunk: int = 64):
    """`explicit_attention` over `chunk` queries at a time, a memory optimization: never a (T x S) buffer of A
    (g x 64 x S scores per KV head stay in the CPU's caches). Unless `padded`, a chunk ending at query c1 sees
    the keys up to S - T + c1 at most; each chunk's share of a statistic is added up (`add_up`)."""
    T, S = q.shape[2], k.shape[2]
    outs, sums = [], {}
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        Sc = S if padded else S - T + c1  # the keys the chunk can see
        here = {}  # the statistics with queries in this chunk, their `last` counted within it
        for name, s in wants.items():
            first = 0 if s.last is None else T - min(s.last, T)  # the statistic's first query
            if c1 > first:
                here[name] = s if s.last is None else replace(s, last=c1 - max(first, c0))
        out, part = explicit_attention(q[:, :, c0:c1], k[:, :, :Sc], v[:, :, :Sc], q_pos[:, c0:c1], k_pos[..., :Sc],
                                       here, window, padded)
        outs.append(out)
        for name, C in part.items():
            add_up(sums, name, C)
    return torch.cat(outs, 2), sums
