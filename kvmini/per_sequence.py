"""A batch whose sequences get their own budgets (methods whose budgets follow each sequence's
statistics: D2O, DynamicKV, DBudgetKV): one policy per sequence, each acting on its row of the cache
(`sequence(cache, b)`) with its row of the statistics: kvmini.generate's form of such a policy for a
batch of B > 1 (`PerSequence.of`); a single sequence is run by the method's policy itself.

Sequences that keep different counts are the cache's ragged rows (kvmini.cache: `keep` with counts).
"""
import copy

import torch

from kvmini.cache import PAD, KVCache, LayerCache
from kvmini.errors import KvminiError
from kvmini.methods.method import Method


def sequence(cache: KVCache, b: int) -> "SequenceCache":
    """Sequence b of the batch as a batch-1 cache whose reads, writes and evictions act on this one."""
    return SequenceCache(cache, check_row(b, cache.layers[0]._k.shape[0]))


class PerSequence:
    """A method's interface (kvmini.methods.method: the three hooks, `start`, `chunk_for`, and what a run
    reports) over a batch: `rows`, one policy per sequence, the first the policy given (`one`, which
    also reads the run's schedule), the others copies of it made at a run's first call."""

    def __init__(self, policy: Method):
        self.one = policy
        self.name, self.budget, self.schedule = policy.name, policy.budget, policy.schedule
        self.rows: list[Method] = [policy]
        self.views = None  # each row's view of the cache (`sequence`), made by begin

    @classmethod
    def of(cls, policy):
        """The batch form of `policy` when its budgets follow each sequence (`Budgeter.per_sequence`), kept on
        it (`policy.batch`) so that a run continued later finds its rows; else `policy` itself."""
        if isinstance(policy, PerSequence) or not policy.per_sequence:
            return policy
        found = getattr(policy, "batch", None)
        if found is None or found.one is not policy:
            found = policy.batch = cls(policy)
        return found

    def start(self, prompt_len: int, total_len: int | None = None, model=None) -> None:
        self.one.start(prompt_len, total_len, model)
        self.rows = [self.one]  # the copies are made by the run's first call, when the batch size is known

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        for policy in self.rows:
            policy.next_prompt(prompt_len, total_len)

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        return self.one.chunk_for(prompt_len, total_len)

    def before(self, cache: KVCache, T: int) -> None:
        B = cache[0].positions.shape[0]
        if cache.seen_tokens == 0:  # a new run: copies of the started, not yet called policy
            self.rows = [self.one] + [copy.deepcopy(self.one) for _ in range(B - 1)]
        self.views = [cache] if B == 1 else [sequence(cache, b) for b in range(B)]
        for row, view in zip(self.rows, self.views):
            row.before(view, T)

    @property
    def wants(self) -> dict | None:
        """What any sequence asks for (one attention pass serves the batch), read once per layer."""
        if len(self.rows) == 1:
            return self.one.wants
        wants = {}
        for name, s in ((n, s) for row in self.rows for n, s in (row.wants or {}).items()):
            if wants.setdefault(name, s) != s:
                raise KvminiError(f"two sequences ask for attention statistic {name} defined differently: "
                                  f"{wants[name]} and {s}")
        return wants or None

    def after_attention(self, layer: int, cache: KVCache, seen: dict) -> None:
        if len(self.rows) == 1:
            self.one.after_attention(layer, cache, seen)
            return
        if self.schedule == "prefill" and not self.one.in_prompt:
            return  # a method that compresses only the prompt does nothing past it
        for b, (row, view) in enumerate(zip(self.rows, self.views)):  # views of this cache, made by before
            S_b = view[layer].length
            row.after_attention(layer, view, {n: t[b : b + 1, :, :S_b] for n, t in seen.items()})

    def after_layers(self, cache: KVCache) -> None:
        for row, view in zip(self.rows, self.views):
            row.after_layers(view)

    # what the tools read of the method (kvmini.methods.method): the first sequence's
    protected = property(lambda self: self.one.protected)
    aux = property(lambda self: self.one.aux)
    mean_budget = property(lambda self: self.one.mean_budget)
    merger = property(lambda self: self.one.merger)
    per_sequence = True
    own_counts = property(lambda self: self.one.own_counts)

    sinks = property(lambda self: self.one.sinks)

    def recent(self, b: int) -> int:
        return self.one.recent(b)

    def describe(self, lc):
        return self.one.describe(lc)

    def holds_more_because(self) -> str:
        return self.one.holds_more_because()

    evict_every = property(lambda self: self.one.evict_every)
    active = property(lambda self: self.one.active)
    note = property(lambda self: self.one.note)
    unchanged = property(lambda self: self.one.unchanged)
    prompt_end = property(lambda self: self.one.prompt_end)

    @property
    def budgets(self) -> list[int] | None:
        """Mean over the sequences, rounded."""
        rows = [p.budgets for p in self.rows]
        return None if rows[0] is None else [round(sum(r[i] for r in rows) / len(rows)) for i in range(len(rows[0]))]

    @property
    def evicted(self) -> list[int]:
        return [sum(column) for column in zip(*(p.evicted for p in self.rows))]

    @property
    def merged(self) -> list[float]:
        return [sum(column) for column in zip(*(p.merged for p in self.rows))]


def check_row(b, batch: int) -> int:
    """A sequence's index in a batch of `batch`, or a KvminiError."""
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < batch:
        raise KvminiError(f"sequence: b must be a whole number in [0, {batch - 1}] (the batch has {batch}), got {b!r}")
    return b


class SequenceView:
    """Sequence b of a LayerCache, seen as a batch-1 LayerCache: views of its held entries (in-place
    writes reach the parent) and `keep`, which evicts from that sequence only."""

    def __init__(self, lc: LayerCache, b: int):
        self.lc, self.b = lc, b

    rows = property(lambda self: (self.lc.rows[0][:1], self.lc.rows[1]))  # index this batch-1 view's slots
    entries = property(lambda self: (self.lc.entries[0][:1], self.lc.entries[1]))

    @property
    def length(self) -> int:
        return self.lc.length if self.lc.counts is None else int(self.lc.counts[self.b].max())

    def held(self) -> torch.Tensor:
        return self.lc.held()[self.b : self.b + 1]  # (1, H_kv)

    @property
    def padded(self) -> bool:
        return self.lc.counts is not None and bool((self.lc.counts[self.b] < self.length).any())

    @property
    def keys(self) -> torch.Tensor:
        return self.lc._k[self.b : self.b + 1, :, : self.length]  # (1, H_kv, S_b, D)

    @property
    def values(self) -> torch.Tensor:
        return self.lc._v[self.b : self.b + 1, :, : self.length]  # (1, H_kv, S_b, D)

    @property
    def positions(self) -> torch.Tensor:
        return self.lc._pos[self.b : self.b + 1, :, : self.length]  # (1, H_kv, S_b)

    def aux(self, name: str) -> torch.Tensor:
        return self.lc.aux(name)[self.b : self.b + 1, :, : self.length]  # (1, H_kv, S_b)

    def declare(self, *names: str) -> None:
        self.lc.declare(*names)

    def aux_names(self) -> list[str]:
        return self.lc.aux_names()

    set_keys = LayerCache.set_keys  # on this row's entries

    def keep(self, idx: torch.Tensor, counts=None) -> None:
        """This sequence keeps only its entries `idx` (1, H_kv, s), in that order, the others all of theirs:
        `LayerCache.keep` with each row's count (places past a row's count become pads). O(B·S·D)."""
        counts = self.lc.held().clone()  # (B, H_kv)
        counts[self.b] = idx.shape[2]
        every = torch.arange(int(counts.max()), device=idx.device).repeat(*counts.shape, 1)  # (B, H_kv, S'): rows keep their places
        every[self.b, :, : idx.shape[2]] = idx[0]
        self.lc.keep(every, counts)

    def evict(self, slot: torch.Tensor) -> None:
        """`LayerCache.evict` on this row alone, O(D): its last entry takes `slot` (1, H_kv), its place a pad;
        the cache's rows differ until every row has evicted as many."""
        lc, (b, h) = self.lc, self.rows
        counts = lc.held().clone()  # (B, H_kv)
        last = counts[self.b : self.b + 1] - 1  # (1, H_kv)
        for buf in (lc._k, lc._v, lc._pos, *lc._aux.values()):
            row = buf[self.b : self.b + 1]  # (1, H_kv, cap, ...)
            row.index_put_((b, h, slot), row[b, h, last])
            row[b, h, last] = PAD if buf is lc._pos else 0
        counts[self.b] = last[0]
        lc.length = int(counts.max())
        lc.counts = None if bool((counts == lc.length).all()) else counts


class SequenceCache:
    """One sequence of a KVCache, with the KVCache interface a policy uses."""

    def __init__(self, cache: KVCache, b: int):
        self.layers = [SequenceView(lc, b) for lc in cache.layers]
        self.seen_tokens = cache.seen_tokens

    def __getitem__(self, layer: int) -> SequenceView:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]
