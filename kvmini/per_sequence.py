"""A batch whose sequences get their own budgets (methods whose budgets follow each sequence's
statistics: D2O, DynamicKV, DBudgetKV): one policy per sequence, each acting on its row of the cache
(`KVCache.sequence(b)`) with its row of the statistics. Rows that keep different counts are padded
(kvmini.cache). A batch of one sequence is run by the method's policy itself.
"""
from kvmini.cache import KVCache
from kvmini.policy import Policy
from kvmini.statistics import Request, Stats


class PerSequence:
    """The policy interface (kvmini.policy: the four calls, `start`, `chunk_for`, and what a run
    reports) over a batch. `one` runs batch 1 and reads the run's schedule; `rows`, made by `make()`
    at the first call of a larger batch, are the policies of its sequences (None until then)."""

    def __init__(self, make, one: Policy | None = None):
        self.make = make
        self.one = one if one is not None else make()
        self.name, self.budget, self.schedule = self.one.name, self.one.budget, self.one.schedule
        self.start(None)

    def start(self, prompt_len: int | None, total_len: int | None = None) -> None:
        self.one.start(prompt_len, total_len)
        self.rows: list[Policy] | None = None
        self.views = None  # each row's view of the cache (KVCache.sequence), made by begin

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        for policy in [self.one, *(self.rows or [])]:  # `one` reads the schedule for every row
            policy.next_prompt(prompt_len, total_len)

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        return self.one.chunk_for(prompt_len, total_len)

    def begin(self, cache: KVCache, T: int) -> None:
        if cache.seen_tokens == 0:
            self.rows = None  # a new run
        self.one.begin(cache, T)  # the run's prompt length and whether any compression happens
        B = cache[0].positions.shape[0]
        if B == 1:
            return
        if self.rows is None:
            self.rows = [self.make() for _ in range(B)]
            for row in self.rows:
                row.start(self.one.prompt_end, self.one.total_len)
        self.views = [cache.sequence(b) for b in range(B)]
        for row, view in zip(self.rows, self.views):
            row.begin(view, T)

    def request(self, layer: int) -> Request | None:
        """What any sequence asks for (one attention pass serves the batch)."""
        if self.rows is None:
            return self.one.request(layer)
        return Request.merge([row.request(layer) for row in self.rows])

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        if self.rows is None:
            self.one.after_attention(layer, cache, stats)
            return
        for b, (row, view) in enumerate(zip(self.rows, self.views)):  # views of this cache, made by begin
            S_b = view[layer].length
            row.after_attention(layer, view, stats.map(lambda t: t[b : b + 1, :, :S_b]))

    def end(self, cache: KVCache) -> None:
        if self.rows is None:
            self.one.end(cache)
            return
        for row, view in zip(self.rows, self.views):
            row.end(view)

    @property
    def policies(self) -> list[Policy]:
        """The policies running now: one per sequence, or `one`."""
        return self.rows or [self.one]

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
        rows = [p.budgets for p in self.policies]
        return None if rows[0] is None else [round(sum(r[i] for r in rows) / len(rows)) for i in range(len(rows[0]))]

    @property
    def evicted(self) -> list[int]:
        return [sum(column) for column in zip(*(p.evicted for p in self.policies))]

    @property
    def merged(self) -> list[float]:
        return [sum(column) for column in zip(*(p.merged for p in self.policies))]
