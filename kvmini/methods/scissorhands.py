r"""Scissorhands (Liu et al. 2023): drop, m at a time, the tokens whose attention was most often below average.

Paper: "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache Compression
at Test Time", Zichang Liu, Aditya Desai, Fangshuo Liao, Weitao Wang, Victor Xie, Zhaozhuo Xu,
Anastasios Kyrillidis, Anshumali Shrivastava (NeurIPS 2023; arXiv 2305.17118).

The persistence of importance: a token that mattered at one step keeps mattering, so a token
that has been unimportant again and again can go. At every step t the query's attention row
alpha_t marks each cached token low when it got less than a uniform share,

    low_j(t) = 1[ \alpha_{tj} < 1 / |K_t| ]          (|K_t|: the keys the query attends to)

and a token's importance record is its count of low steps in the history window of the last w
steps, I_j = \sum_{s = t-w+1}^{t} low_j(s). When the cache reaches B entries, the m tokens with
the largest I_j are dropped at once (the r most recent never), so the cache cycles between B - m
and B entries and the scoring is paid once every m steps (Alg. 1 and 2, as reconstructed below).

In kvmini terms: the budget is the floor B - m, and the drop amount m is the engine's
`evict_every` (hold budget + m - 1, then evict m), whose default this method sets to 16
(ENGINE_DEFAULTS). Per KV head: the low flags of a group's g query heads are added up (a count
of 0..g per step), which ranks as their mean does. Ties of I drop the oldest first (a fall-back to
a sliding window, the LRU reading the paper's name for the record suggests). Defaults: w = 400,
r = 10, no sinks, m = 16.
Chunked prefill: compressed after every call by design; a call's rows count as one step of the
history (below), so `run.py --chunk-size 1` is Alg. 1 token by token.
Deviation: the paper's text was not available to the authors of this module; Alg. 1-2, w = 400
and r = 10 are read from two independent descriptions of it, and m is a free choice here (the
paper's value could not be confirmed). A call of T > 1 queries (a prompt) records the sum of its
last min(T, w) rows' low flags as one step, at its last position, which leaves the window as one
block w steps later (Alg. 1 sees them leave one per step); a decode step is exact.
Deviation: the authors' released code (github lzcemma/Scissorhands, modules/hf_opt_dropkv.py) is a
masked simulation of a different rule (high scores above the 90% quantile of a row, a token kept
while it was high once in the last w rows, no budget); kvmini has the paper's rule only: that code
masks rows inside one teacher-forced pass (a one-token step does nothing), keeps a set of its own
size per query head, and reads its threshold from rows padded to the whole text's length, none of
which a cache that generates can do (docs/methods.md).
"""
from dataclasses import dataclass

import torch

from kvmini.budget import Rule
from kvmini.cache import LayerCache, along
from kvmini.methods.method import Method
from kvmini.methods.selectors import shrink
from kvmini.attention import Statistic

ENGINE_DEFAULTS = {"evict_every": 16}  # m: drop 16 tokens at once, every 16 decode steps


def below_average(rows: torch.Tensor) -> torch.Tensor:
    """low_j = 1[alpha_j < 1 / |K|] for each row (..., T, S) of attention, as bools (their sums count steps);
    keys a row cannot see are 0."""
    seen = rows > 0
    K = seen.sum(-1, keepdim=True)  # (..., T, 1): |K_t|, the keys each query attends to
    return seen & (rows * K < 1)


def remember(lc: LayerCache, low: torch.Tensor, start: int, T: int, w: int) -> None:
    """The importance record after a call of T queries at positions start..start+T-1, its rows one step
    at start+T-1: per entry a ring of the last w steps' low counts (aux "low_history", (B, H_kv, S, w)
    int16, slot = step mod w) and their sum I_j, kept as the ring turns (aux "low_count", (B, H_kv, S)
    int32: the step a slot held leaves as the new one comes, so the ring is never summed).
    low (B, H_kv, S): this call's low flags summed over its last min(T, w) rows and the group's heads."""
    ring, count = lc.aux("low_history"), lc.aux("low_count")  # (B, H_kv, S, w), (B, H_kv, S)
    if T > 1:  # the slots of this call's other steps held steps that have left the window
        earlier = torch.arange(max(start, start + T - w), start + T - 1, device=ring.device) % w
        count.sub_(ring[..., earlier].sum(-1, dtype=torch.int32))
        ring.index_fill_(-1, earlier, 0)
    old, new = ring[..., (start + T - 1) % w], low.to(ring.dtype)  # this step's slot; sums of 0/1 flags, exact
    count.add_(new - old)  # the step w ago leaves the window, this one enters
    old.copy_(new)


def importance_score(lc: LayerCache) -> torch.Tensor:
    """-I_j, ties broken towards keeping the newer token, (B, H_kv, S), higher = keep."""
    position = lc.positions.to(torch.float64) / 2**40  # < 1: breaks ties only
    return -lc.aux("low_count").to(torch.float64) + position


def drop_lowest(lc: LayerCache, score: torch.Tensor, b: int, sinks: int, recent: int, newest: int) -> None:
    """Alg. 2's eviction, down to b entries: the lowest scores go at once, outside the sinks and the window
    (the scores never tie: the position breaks them), and the last entries move into their slots (`drop`),
    so m entries move with their w-step records where `shrink`'s sort and `keep` move all S. One entry,
    the prompt, or rows of different lengths: `shrink` (tests/test_scissorhands.py: the same tokens stay)."""
    if lc.padded or not 1 < lc.length - b <= b:
        shrink(lc, score, b, sinks, recent, newest)
        return
    free = (lc.positions >= sinks) & (lc.positions <= newest - recent)  # (B, H_kv, S)
    drop(lc, score.masked_fill(~free, float("inf")).topk(lc.length - b, -1, largest=False).indices)


def drop(lc: LayerCache, victims: torch.Tensor) -> torch.Tensor:
    """Evict entries `victims` (B, H_kv, m), distinct per head, m <= S - m: the surviving entries of the
    last m places move into the victims' slots below S - m. Returns each kept place's old slot (B, H_kv, S - m).
    Example: S = 6, victims [1, 4] -> entry 5 moves to slot 1; kept [0, 5, 2, 3]."""
    S, m = lc.length, victims.shape[2]
    victims = victims.sort(-1).values  # the holes below S - m first
    tail = torch.arange(S - m, S, device=victims.device)  # (m,): the places that become free
    gone = (victims[..., :, None] == tail).any(-2)  # (B, H_kv, m): tail places whose entry is a victim
    movers = torch.where(gone, S, tail).sort(-1).values  # the surviving tail entries first
    hole = victims < S - m  # as many holes as surviving tail entries, in the same leading places
    dest, src = torch.where(hole, victims, tail), torch.where(hole, movers, tail)  # the rest copy onto themselves
    for buf in (lc.keys, lc.values, lc.positions, *map(lc.aux, lc.aux_names())):  # views (B, H_kv, S, ...)
        buf.scatter_(2, along(dest, buf), buf.gather(2, along(src, buf)))
    lc.length = S - m
    return torch.arange(S, device=victims.device).expand(*victims.shape[:2], S).clone().scatter_(2, dest, src)[..., : S - m]


@dataclass(frozen=True)
class Options:
    history: int = 400  # Scissorhands' history window w: the last steps whose low-attention flags count
    sinks: int = 0  # first tokens always kept
    recent: int | Rule = 10  # most recent tokens always kept


class Scissorhands(Method):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__("scissorhands", budget)
        self.w, self.sinks, self.recent = o.history, o.sinks, Rule.of_(o.recent, "recent")
        self.low = Statistic(self.w, below_average, "sum")  # (B, H_kv, S): the last w rows' low flags
        self.aux = (("low_history", torch.int16, (self.w,)), ("low_count", torch.int32))  # I_j's ring, and I_j

    def before(self, cache, step) -> dict | None:
        return {"low_counts": self.low} if step.keeps_sums else None

    def after_attention(self, layer: int, cache, stats, step) -> None:
        lc, b = cache[layer], step.budgets[layer]
        if step.keeps_sums:
            remember(lc, stats["low_counts"], step.start, step.T, self.w)  # I_j over the last w steps
        if step.compresses and lc.length > b + step.slack:  # while decoding: every m = evict_every steps
            self.evicted[layer] += lc.length - b
            drop_lowest(lc, importance_score(lc), b, self.sinks, self.recent(b), step.newest)  # the m largest I_j

    def describe(self, lc) -> tuple[str, torch.Tensor | None]:
        return f"minus the low-attention steps among the last {self.w} (Scissorhands' importance record)", importance_score(lc)


def build(budget: float, o: Options = Options()) -> Scissorhands:
    return Scissorhands(budget, o)
