"""The compression engine: runs a method's four parts (kvmini.parts) inside the model's forward pass.

The model talks to a policy through three calls per forward pass of T new tokens:
    begin(cache, T)                      before layer 0
    request(layer) -> Request|None       before the layer's attention (None: the fast SDPA path)
    after_attention(layer, cache, stats) after it; this may shrink cache[layer] (and, for a
                                         budgeter that revisits layers, earlier ones)
In a call the schedule says compresses, after layer l attended over its full cache:
    score = scorer(cache[l], stats);  for i, b in budgeter.decide(l, ...): compressor(i, cache[i], score_i, b)
Only later layers and later calls see what was kept. `start()` (called by `generate`) resets a
run; a fresh cache (seen_tokens == 0) without it starts one whose first call is the whole prompt.
A prompt is a prompt, however it arrives: when it comes in several calls (a chunked prefill), a
method that compresses once the prompt is complete (every schedule but EVERY_CALL) gathers the
statistics its parts ask for over the prompt's calls, per query head, and its parts see them in
the call that completes the prompt as if the prompt had come in that one call
(kvmini.statistics.Gathering). Nothing
is compressed before that call, so the cache only grows, and by causality each query's attention
is the one it has in a single call: the kept sets are the one-shot ones. EVERY_CALL methods (H2O,
TOVA, StreamingLLM, WeightedKV) compress after each chunk by design.
Methods whose budgets follow each sequence's statistics run a batch through `PerSequence`.
The data flow, the schedules and every switch of the engine: docs/design.md.
"""
import functools
import math
import sys

import torch
import torch.nn.functional as F

from kvmini.cache import KVCache
from kvmini.errors import KvminiError
from kvmini.parts import AFTER_PROMPT, DECODE, EVERY_CALL, PREFILL
from kvmini.statistics import DECLARED, Gathering, Request, Stats


def resolve_budget(budget: float, prompt_len: int) -> int:
    """docs/design.md, "Budgets": a fraction 0 < x <= 1 is a ratio of the prompt length; a whole number
    (an int, or a float above 1) is tokens per layer.

    0.25 with a 400-token prompt -> 100;  1.0 -> the whole prompt;  1 -> 1 token;  128 -> 128.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise KvminiError(f"--budget must be a finite number > 0 (a ratio in (0, 1] or tokens per layer), got {budget}")
    if isinstance(budget, int):
        return budget
    if budget <= 1:
        return max(1, round(budget * prompt_len))
    if budget != int(budget):
        raise KvminiError(f"--budget above 1 counts tokens per layer and must be a whole number, got {budget}")
    return int(budget)


class Policy:
    """One method = scorer + budgeter + compressor + schedule, and one run's state."""

    def __init__(self, name: str, budget: float | None, scorer, budgeter, compressor, schedule: str = PREFILL,
                 prefill_chunk: int | None = None):
        """budget None: the budgeter chooses; prefill_chunk: the prompt is fed in chunks of this size
        (an int, or a function of the per-layer budget in tokens)."""
        self.name, self.budget, self.schedule, self.prefill_chunk = name, budget, schedule, prefill_chunk
        self.scorer, self.budgeter, self.compressor = scorer, budgeter, compressor
        self.evict_every = 1  # N: during decoding, let a layer hold budget + N - 1 and evict N at once
        self.together = True  # a decode step's one-entry evictions run for all layers at once (see `end`)
        self.start(None)

    def start(self, prompt_len: int | None, total_len: int | None = None) -> None:
        """Fresh state for a run whose prompt has prompt_len tokens (total_len: prompt + new tokens, if known)."""
        self.prompt_len, self.total_len = prompt_len, total_len
        self.started, self.evicted, self.active, self.note = False, [], False, None  # parts start on the first call
        self.unchanged: list[int] | None = None  # the budgets of a prompt too short to compress: all of it
        self.gathered: Gathering | None = None  # a prompt in several calls: its statistics so far
        self.join_limit: int | None = None  # the longest budget a layer may have to be evicted with the others
        self._fresh = prompt_len is not None

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        """The prefill chunk size this method asks for, or None (one call, also when its budget is a no-op)."""
        b = None if self.budget is None else resolve_budget(self.budget, prompt_len)
        if self.prefill_chunk is None or (b is not None and self._is_noop(b, prompt_len, total_len)):
            return None
        return self.prefill_chunk(b) if callable(self.prefill_chunk) else self.prefill_chunk

    def _is_noop(self, b: int, prompt_len: int, total_len: int | None) -> bool:
        """A budget >= the longest the cache gets under this schedule (unknown total: never) changes nothing,
        even where a per-layer plan gives some layer less (as PyramidKV's code does): exactly `full`."""
        longest = prompt_len if self.schedule == PREFILL else total_len
        return longest is not None and b >= longest

    def begin(self, cache: KVCache, T: int) -> None:
        if cache.seen_tokens == 0 and not self._fresh:
            self.start(T)  # a new run without start(): its first call is the whole prompt
        self._fresh = False
        if self.prompt_len is None:
            raise KvminiError(f"{self.name}: call policy.start(prompt_len) before continuing a cache it has not seen")
        if not self.started:
            self._start_parts(len(cache))
            for layer in range(len(cache)):  # the buffers the scorer keeps, in the layers it scores: once a run
                if not self.budgeter.skips(layer):
                    cache[layer].declare(*self.scorer.aux)
        self.cache, self.T, self.call_start, self.scores = cache, T, cache.seen_tokens, {}
        end, n = cache.seen_tokens + T, self.prompt_len  # this call ends at token `end`
        self.in_prompt = end <= n
        when = {PREFILL: end == n, AFTER_PROMPT: end >= n, DECODE: end > n, EVERY_CALL: True}  # the schedule
        self.compress_now = self.active and when[self.schedule]
        self.gathering = self.schedule != EVERY_CALL and self.in_prompt and T < n  # a prompt in several calls
        if self.gathering and self.call_start == 0:
            wanted = Request.merge([self.scorer.request, self.budgeter.request])
            self.gathered = Gathering(wanted, n) if wanted else None
        self.deferred: list[tuple[int, Stats]] = []  # (layer, stats) whose one-entry eviction waits for `end`
        self.one_each = (self.together and self.compress_now and T == 1 and not self.in_prompt and self.evict_every == 1
                         and self.compressor.one_each and isinstance(cache, KVCache) and self.budgeter.known(0) is not None)

    def _start_parts(self, L: int) -> None:
        if any(not -L <= layer < L for layer in self.budgeter.protected_spec):
            raise KvminiError(f"{self.name}: protected layers {list(self.budgeter.protected_spec)} do not all exist; "
                              f"this model has layers 0 to {L - 1}")
        n, b, self.note = self.prompt_len, None if self.budget is None else resolve_budget(self.budget, self.prompt_len), None
        self.compressor.start(L)
        self.started, self.evicted = True, [0] * L
        if isinstance(self.budget, float) and self.budget <= 1 and not self._fits(b, L):
            # a share of a short prompt smaller than what the method always keeps: raise it to the least that works
            fit = next((x for x in range(b + 1, n + 1) if self._fits(x, L)), None)
            if fit is None:
                self.note = f"not compressed: the {n}-token prompt is no longer than what {self.name} always keeps"
                self.unchanged, self.active = [n] * L, False
                return
            self.note, b = f"budget raised from {b} to {fit} tokens per layer, the least {self.name} can keep", fit
        self.budgeter.start(b, L, n)
        if b is not None:
            self._check({layer: b_l for layer, b_l in enumerate(self.budgets)})
        self.active = b is None or not self._is_noop(b, n, self.total_len)

    def _fits(self, b: int, L: int) -> bool:
        """Can the parts work with a mean budget of b tokens per layer? (Asks the budgeter's pure plan.)"""
        try:
            budgets = self.budgeter.plan(b, L, self.prompt_len)
        except KvminiError:
            return False
        return not self._problems(dict(enumerate(budgets)), L)

    def _problems(self, budgets: dict[int, int], L: int) -> list[tuple[int, int, str]]:
        """(layer, budget, why) for the budgets the compressor cannot work with (protected layers never compress)."""
        protected = self.budgeter.protected_in(L)
        return [(layer, b, why) for layer, b in budgets.items()
                if layer not in protected and (why := self.compressor.problem(b)) is not None]

    def _check(self, budgets: dict[int, int]) -> None:
        if problems := self._problems(budgets, len(self.evicted)):
            layer, b, why = problems[0]
            raise KvminiError(f"{self.name}: a budget of {b} tokens (layer {layer}) is {why}; "
                              "raise --budget or lower --sinks/--window")

    def accumulating(self) -> bool:
        """Does the scorer keep running sums now? (Always for decode-time methods, during the prompt otherwise.)"""
        return self.scorer.accumulates and (self.schedule != PREFILL or self.in_prompt)

    def request(self, layer: int) -> Request | None:
        if not self.active or self.budgeter.skips(layer):
            return None
        if self.one_each:  # a decode step's usual case, without building a request: the scorer's, or none
            wanted = self.accumulating() or self.cache[layer].length + 1 > self.budgeter.known(layer)
            return self.scorer.request if wanted else None
        if self.gathering:
            return self.gathered.request(self.call_start, self.T) if self.gathered else None
        wanted = [self.scorer.request] if self.accumulating() else []
        if self.budgeter.accumulates and self.in_prompt:
            wanted.append(self.budgeter.request)
        if self.compress_now:
            known = self.budgeter.known(layer)
            if known is None:
                wanted += [self.scorer.request, self.budgeter.request]
            elif self.cache[layer].length + self.T > known:
                wanted.append(self.scorer.request)
        return Request.merge(wanted)

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        if not self.active or self.budgeter.skips(layer):
            return
        lc = cache[layer]
        if self.gathering:  # a prompt in several calls: its parts see it when it is complete
            complete = self.call_start + self.T == self.prompt_len
            if self.gathered is not None:
                stats = self.gathered.add(layer, stats, lc.keys.shape[1], complete)
            if not complete:
                return
        if self.one_each and lc.length - 1 == self.budgeter.known(layer) <= self.joinable():
            self.deferred.append((layer, stats))  # updated, scored and evicted with the other layers in `end`
            return
        if self.accumulating():
            self.scorer.update(lc, stats, self.call_start, self.T)
        if self.budgeter.accumulates and self.in_prompt:
            self.budgeter.update(layer, lc, stats, self.call_start, self.T)
        known = self.budgeter.known(layer) if self.compress_now else None
        slack = 0 if self.in_prompt else self.evict_every - 1  # held beyond the budget between evictions
        if not self.compress_now or (known is not None and lc.length <= known + slack):
            return
        self.scores[layer] = self.scorer(lc, stats)  # (B, H_kv, S), scored once per layer and call
        decided = self.budgeter.decide(layer, lc, stats, self.scores[layer])
        if self.budget is not None:  # a budget the user gave; self-chosen ones are feasible by construction
            self._check(decided)
        for i, b in decided.items():
            if cache[i].length > b:
                self.evicted[i] += cache[i].length - b
                kept = self.compressor(i, cache[i], self.scores[i], b)
                if self.budgeter.revisits and kept is not None:  # keep the score aligned with what is left
                    self.scores[i] = self.scores[i].gather(2, kept)

    def joinable(self) -> int:
        """The longest budget of a layer evicted with the others: twice the median budget. The joined rows
        are as long as the longest of them, so a layer far longer than the rest (D2O's paper allocation
        gives one layer the whole prompt) would make every row that long; it is evicted on its own."""
        if self.join_limit is None:
            budgets = sorted(b for b in (self.budgeter.known(l) for l in range(len(self.cache))) if b < sys.maxsize)
            self.join_limit = 2 * budgets[len(budgets) // 2] if budgets else 0
        return self.join_limit

    def end(self, cache: KVCache) -> None:
        """After the last layer. A decode step's one-entry evictions, deferred by `after_attention`, run
        here for all those layers at once: each layer's eviction changes only its own cache, which no
        later layer of the same call reads, so waiting changes nothing; the layers, held as the rows of
        one LayerCache (`KVCache.join`), are scored, evicted and merged in one op per step instead of
        one per layer. `together = False` evicts layer by layer instead (the readable specification;
        tests/test_together.py proves both equal)."""
        if not self.deferred:
            return
        layers = tuple(layer for layer, _ in self.deferred)
        joint = cache.join(layers)
        stats = Stacked([stats for _, stats in self.deferred], joint)
        if self.accumulating():
            self.scorer.update(joint, stats, self.call_start, self.T)
        score = self.scorer(joint, stats)  # (R, H_kv, S), R = len(layers) * B
        budgets = [self.budgeter.known(layer) for layer in layers]
        self.compressor.evict_one_each(layers, joint, score, budgets, self.call_start + self.T - 1)
        for layer in layers:  # each dropped one entry
            cache[layer].length -= 1
            self.evicted[layer] += 1
        self.deferred = []

    @property
    def parts(self) -> tuple:
        return self.scorer, self.budgeter, self.compressor

    @property
    def budgets(self) -> list[int] | None:
        """What each layer may keep, as decided so far (None before the first call)."""
        if not self.started:
            return None
        return self.unchanged if self.unchanged is not None else self.budgeter.budgets

    @property
    def merged(self) -> list[float]:
        """Evicted tokens merged into kept ones, per layer (mean over KV heads)."""
        return self.compressor.merged_per_layer()


class Stacked:
    """The statistics of the layers `Policy.end` evicts together, as the rows of the joined cache
    (len(layers) * B, H_kv, S), read as a Stats is: each is stacked when first read, the rows of
    shorter layers padded with zeros."""

    def __init__(self, per_layer: list[Stats], joint):
        self.per_layer, self.S, self.stacked = per_layer, joint.length, {}

    def __getattr__(self, name: str) -> torch.Tensor:
        if name not in DECLARED:
            raise AttributeError(name)
        if name not in self.stacked:
            rows = [getattr(stats, name) for stats in self.per_layer]  # (B, H_kv, S_l) each
            if all(t.shape[-1] == self.S for t in rows):
                self.stacked[name] = torch.cat(rows)  # (len(layers) * B, H_kv, S)
            else:  # one copy of all rows side by side, then each layer's part read out, zero-padded
                side = F.pad(torch.cat(rows, -1), (0, 1))  # (B, H_kv, sum S_l + 1): the last column is 0
                at = padded_index(tuple(t.shape[-1] for t in rows), self.S, side.device)  # (len(layers), S)
                self.stacked[name] = side[:, :, at].permute(2, 0, 1, 3).reshape(-1, side.shape[1], self.S)
        return self.stacked[name]

    def __iter__(self):
        return iter(self.per_layer[0])


@functools.lru_cache(maxsize=16)
def padded_index(lengths: tuple[int, ...], S: int, device) -> torch.Tensor:
    """Where row l's place j is in rows of these lengths laid side by side (plus one zero column at the
    end, for the places past a row's length): (len(lengths), S). Made once per set of lengths."""
    S_l = torch.tensor(lengths, device=device)  # (len(lengths),)
    j = torch.arange(S, device=device)  # (S,)
    return torch.where(j < S_l[:, None], (S_l.cumsum(0) - S_l)[:, None] + j, int(sum(lengths)))


class PerSequence:
    """A batch where every sequence gets its own budgets: one fresh policy per sequence (built by
    `make()`), each acting on its row of the cache (`KVCache.sequence(b)`) with its row of the
    statistics. Rows that keep different counts are padded (kvmini.cache). Batch 1 is the policy itself."""

    def __init__(self, make, one: Policy | None = None):
        self.make = make
        self.one = one if one is not None else make()
        self.name, self.budget = self.one.name, self.one.budget
        self.start(None)

    def start(self, prompt_len: int | None, total_len: int | None = None) -> None:
        self.one.start(prompt_len, total_len)
        self.rows = None

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        return self.one.chunk_for(prompt_len, total_len)

    def begin(self, cache: KVCache, T: int) -> None:
        if cache.seen_tokens == 0:
            self.rows = None  # a new run
        self.one.begin(cache, T)  # the run's prompt length and whether any compression happens
        B = cache[0].positions.shape[0]
        if B == 1 or not self.one.active:
            return
        if self.rows is None:
            self.rows = [self.make() for _ in range(B)]
            for row in self.rows:
                row.start(self.one.prompt_len, self.one.total_len)
        for b, row in enumerate(self.rows):
            row.begin(cache.sequence(b), T)

    def request(self, layer: int) -> Request | None:
        if self.rows is None:
            return self.one.request(layer)
        return next((r for r in (row.request(layer) for row in self.rows) if r is not None), None)

    def end(self, cache: KVCache) -> None:
        for policy in self.rows or [self.one]:
            policy.end(policy.cache)

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        if self.rows is None:
            self.one.after_attention(layer, cache, stats)
            return
        for b, row in enumerate(self.rows):
            view = row.cache  # cache.sequence(b), made in begin()
            S_b = view[layer].length
            row.after_attention(layer, view, stats.map(lambda t: t[b : b + 1, :, :S_b]))

    @property
    def schedule(self) -> str:
        return self.one.schedule

    @property
    def parts(self) -> tuple:
        """(scorer, budgeter, compressor) of the method, as built for one sequence."""
        return self.one.scorer, self.one.budgeter, self.one.compressor

    @property
    def active(self) -> bool:
        return self.one.active

    @property
    def note(self) -> str | None:
        return self.one.note

    def _each(self, attribute: str) -> list[list]:
        return [getattr(p, attribute) for p in (self.rows or [self.one])]

    @property
    def prompt_len(self):
        return (self.rows or [self.one])[0].prompt_len

    @property
    def budgets(self) -> list[int] | None:
        """Mean over the sequences, rounded."""
        rows = self._each("budgets")
        return None if rows[0] is None else [round(sum(r[i] for r in rows) / len(rows)) for i in range(len(rows[0]))]

    @property
    def evicted(self) -> list[int]:
        return [sum(column) for column in zip(*self._each("evicted"))]

    @property
    def merged(self) -> list[float]:
        return [sum(column) for column in zip(*self._each("merged"))]
