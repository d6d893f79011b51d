"""A batch whose sequences get their own budgets (methods whose budgets follow each sequence's
statistics: D2O, DynamicKV, DBudgetKV): one policy per sequence, each acting on its row of the cache
(`sequence(cache, b)`) with its row of the statistics: kvmini.generate's form of such a policy for a
batch of B > 1 (`PerSequence.of`); a single sequence is run by the method's policy itself.

Rows that keep different counts are padded (`PaddedLayer`): each row holds its entries first and
pads after them, up to the longest row; a pad's position is PAD, later than any query, so attention
never sees it; `counts` says how many real entries each row holds.
"""
import copy

import torch

from kvmini.cache import KEY_NORM, PAD, KVCache, LayerCache, along, key_norm
from kvmini.errors import KvminiError
from kvmini.policy import Policy
from kvmini.statistics import Request, Stats


class PaddedLayer(LayerCache):
    """A LayerCache whose rows may hold different counts (`counts`, None while they agree); a layer
    becomes one in place (`padded_rows`), keeping its buffers."""

    counts: torch.Tensor | None = None  # (B,) entries held per row when rows differ; None: all hold `length`

    @property
    def padded(self) -> bool:
        """Do some rows hold fewer entries than `length` (the rest of the row being pads)?"""
        return self.counts is not None

    def held(self) -> list[int]:
        """Entries held by each sequence of the batch."""
        return [self.length] * self._k.shape[0] if self.counts is None else self.counts.tolist()

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """As LayerCache.append; when rows differ, each row's new entries go right after its own."""
        if self.counts is None:
            return super().append(k, v, pos)
        T = k.shape[2]
        end = self.length + T
        if end > self.capacity:
            self._resize(max(end, 2 * self.capacity, self.reserve))
        self._set_pads(slice(None), self.length, end)
        at = self.counts[:, None] + torch.arange(T, device=self.counts.device)  # (B, T) destination
        at = at[:, None].expand(-1, k.shape[1], -1)  # (B, H_kv, T)
        self._k.scatter_(2, at[..., None].expand_as(k), k)
        self._v.scatter_(2, at[..., None].expand_as(v), v)
        self._pos.scatter_(2, at, pos[:, None, :].expand_as(at))
        if KEY_NORM in self._aux:
            self._aux[KEY_NORM].scatter_(2, at, key_norm(k))
        self.counts = self.counts + T
        self.length = end

    def keep(self, idx: torch.Tensor) -> None:
        if self.counts is not None:
            raise ValueError("keep() of a layer whose rows differ in length: use keep_row()")
        super().keep(idx)

    def evict_one(self, slot: torch.Tensor) -> None:
        """As LayerCache.evict_one; when rows differ, each row's own last entry moves, and the place it
        leaves becomes a pad."""
        if self.counts is None:
            return super().evict_one(slot)
        at = self._slot(slot)[:, :, None]  # (B, H_kv, 1)
        last = (self.counts - 1)[:, None, None].expand_as(at)  # (B, H_kv, 1): each row's last entry
        for buf in (self._k, self._v, self._pos, *self._aux.values()):  # (B, H_kv, cap, ...)
            buf.scatter_(2, along(at, buf), buf.gather(2, along(last, buf)))
        for buf in (self._k, self._v):  # the place the last entry left becomes a pad
            buf.scatter_(2, last[..., None].expand(-1, -1, -1, buf.shape[3]), 0)
        for buf in self._aux.values():
            buf.scatter_(2, along(last, buf), 0)
        self._pos.scatter_(2, last, PAD)
        self.counts = self.counts - 1  # every row held one more: the longest is one shorter (no device sync)
        self.length -= 1

    def _slot(self, slot) -> torch.Tensor:
        slot = super()._slot(slot)
        if self.counts is not None and slot.device.type == "cpu" and bool((slot >= self.counts[:, None]).any()):
            raise KvminiError(f"evict_one: slots must be in [0, {self.length - 1}] (entries held), got {slot.tolist()}")
        return slot

    def sequence(self, b: int) -> "SequenceView":
        """Row b as a batch-1 layer cache (views of its entries; `keep` evicts from that row only)."""
        return SequenceView(self, check_row(b, self._k.shape[0]))

    def keep_row(self, b: int, idx: torch.Tensor) -> None:
        """Row b keeps only its entries `idx` (1, H_kv, s), in that order; its other places become pads."""
        check_row(b, self._k.shape[0])
        counts = torch.tensor(self.held(), device=self._pos.device)  # (B,)
        s, old = idx.shape[2], int(counts[b])
        row = slice(b, b + 1)
        self._gather(row, idx, old)
        self._set_pads(row, s, old)
        counts[b] = s
        self.length = int(counts.max())
        self.counts = None if bool((counts == self.length).all()) else counts
        self._shrink()

    def _set_pads(self, rows: slice, start: int, end: int) -> None:
        """Places start..end-1 of `rows` become pads: zero K/V and statistics, position PAD."""
        self._k[rows, :, start:end] = 0
        self._v[rows, :, start:end] = 0
        self._pos[rows, :, start:end] = PAD
        for buf in self._aux.values():
            buf[rows, :, start:end] = 0

    def nbytes(self) -> int:
        """Exact bytes of the keys and values held (pads, positions and aux buffers excluded)."""
        return self.entry_nbytes * sum(self.held()) // self._k.shape[0]

    def aux_nbytes(self) -> int:
        per_entry = sum(buf[0, 0, 0].numel() * buf.element_size() for buf in self._aux.values()) * self._k.shape[1]
        return per_entry * sum(self.held())


def padded_rows(cache: KVCache) -> KVCache:
    """`cache` with every layer a PaddedLayer (the same buffers), so its rows may keep different counts."""
    for lc in cache.layers:
        if not isinstance(lc, PaddedLayer):
            lc.__class__ = PaddedLayer
    return cache


def sequence(cache: KVCache, b: int) -> "SequenceCache":
    """Sequence b of the batch as a batch-1 cache whose reads, writes and evictions act on this one."""
    return SequenceCache(padded_rows(cache), check_row(b, cache.layers[0]._k.shape[0]))


class PerSequence:
    """The policy interface (kvmini.policy: the four calls, `start`, `chunk_for`, and what a run
    reports) over a batch: `rows`, one policy per sequence, the first the policy given (`one`, which
    also reads the run's schedule), the others copies of it made at a run's first call."""

    def __init__(self, policy: Policy):
        self.one = policy
        self.name, self.budget, self.schedule = policy.name, policy.budget, policy.schedule
        self.rows: list[Policy] = [policy]
        self.views = None  # each row's view of the cache (`sequence`), made by begin

    @classmethod
    def of(cls, policy):
        """The batch form of `policy` when its budgets follow each sequence (`Budgeter.per_sequence`), kept on
        it (`policy.batch`) so that a run continued later finds its rows; else `policy` itself."""
        if isinstance(policy, PerSequence) or not policy.budgeter.per_sequence:
            return policy
        found = getattr(policy, "batch", None)
        if found is None or found.one is not policy:
            found = policy.batch = cls(policy)
        return found

    def start(self, prompt_len: int, total_len: int | None = None) -> None:
        self.one.start(prompt_len, total_len)
        self.rows = [self.one]  # the copies are made by the run's first call, when the batch size is known

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        for policy in self.rows:
            policy.next_prompt(prompt_len, total_len)

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        return self.one.chunk_for(prompt_len, total_len)

    def begin(self, cache: KVCache, T: int) -> None:
        B = cache[0].positions.shape[0]
        if cache.seen_tokens == 0:  # a new run: copies of the started, not yet called policy
            self.rows = [self.one] + [copy.deepcopy(self.one) for _ in range(B - 1)]
        self.views = [cache] if B == 1 else [sequence(cache, b) for b in range(B)]
        for row, view in zip(self.rows, self.views):
            row.begin(view, T)

    def request(self, layer: int) -> Request | None:
        """What any sequence asks for (one attention pass serves the batch)."""
        if len(self.rows) == 1:
            return self.one.request(layer)
        return Request.merge([row.request(layer) for row in self.rows])

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        if len(self.rows) == 1:
            self.one.after_attention(layer, cache, stats)
            return
        for b, (row, view) in enumerate(zip(self.rows, self.views)):  # views of this cache, made by begin
            S_b = view[layer].length
            row.after_attention(layer, view, Stats(**{n: getattr(stats, n)[b : b + 1, :, :S_b] for n in stats}))

    def end(self, cache: KVCache) -> None:
        for row, view in zip(self.rows, self.views):
            row.end(view)

    @property
    def parts(self) -> tuple:
        """(scorer, budgeter, compressor) of the method, as built for one sequence."""
        return self.one.parts

    @property
    def evict_every(self) -> int:
        return self.one.evict_every

    @property
    def active(self) -> bool:
        return self.one.active

    @property
    def note(self) -> str | None:
        return self.one.note

    @property
    def unchanged(self) -> list[int] | None:
        return self.one.unchanged

    @property
    def prompt_end(self) -> int | None:
        return self.one.prompt_end

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
    """Row b of a PaddedLayer, seen as a batch-1 LayerCache: views of its held entries (in-place
    writes reach the parent) and `keep`, which evicts from that row only."""

    def __init__(self, lc: PaddedLayer, b: int):
        self.lc, self.b = lc, b

    padded = False  # one row holds its own entries only

    @property
    def length(self) -> int:
        return self.lc.length if self.lc.counts is None else int(self.lc.counts[self.b])

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

    def keep(self, idx: torch.Tensor) -> None:
        self.lc.keep_row(self.b, idx)

    def evict_one(self, slot: torch.Tensor) -> None:
        """Evict entry `slot` (1, H_kv): a row of a padded batch keeps the others in order (O(S·D))."""
        S = self.length
        rest = torch.arange(S - 1, device=slot.device).expand(*slot.shape, S - 1)  # (1, H_kv, S-1)
        self.lc.keep_row(self.b, rest + (rest >= slot[..., None]).long())


class SequenceCache:
    """One sequence of a KVCache, with the KVCache interface a policy uses."""

    def __init__(self, cache: KVCache, b: int):
        self.layers = [lc.sequence(b) for lc in cache.layers]
        self.seen_tokens = cache.seen_tokens

    def __getitem__(self, layer: int) -> SequenceView:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]
