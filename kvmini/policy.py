"""A compression policy: scorer + allocator + selector + compensator, run on a schedule.

    scorer       how important is each cached token, per KV head?        (B, H_kv, S) scores
    allocator    how many tokens may each layer keep?                     one budget per layer
    selector     which tokens, given scores, budget, sinks, recent window? indices to keep
    compensator  what happens to the evicted tokens (drop, or merge)?    edits K/V in place
    schedule     PREFILL: once, layer by layer, in the call that completes the prompt;
                 EVERY_CALL: after every forward call (each prefill chunk, each decode step);
                 AFTER_PROMPT: once the prompt is complete, and then after every decode step

Methods that pick budgets from statistics add one hook: `layer_rule` (a layer picks its own,
DBudgetKV), `layer_stat` + a deferred allocator (all layers measured first, then budgeted, D2O)
or `rebalance` (finished layers re-budgeted as the prefill goes, DynamicKV); `reducer` replaces
select-and-gather (WeightedKV's merge). AFTER_PROMPT suits methods that evict every step but
need the whole prompt first.

The model talks to a policy through three calls per forward pass of T new tokens:
    begin(cache, T)                     before layer 0
    request(layer) -> StatsRequest|None before the layer's attention (None: fast SDPA path)
    after_attention(layer, cache, stats) after it; this may shrink cache[layer]
A layer always attends over its full appended cache first; only later layers and later
calls see what the policy kept. All state lives in the Policy object and is reset by
`start()` (called by `generate`), or automatically when a fresh cache (seen_tokens == 0) arrives.

Methods that choose budgets per sequence (the hooks above) run a batch as one Policy per
sequence, each acting on its row of the cache (`KVCache.sequence(b)`); rows that keep
different counts are padded (see kvmini.cache). Batching then changes nothing but speed.
"""
import copy
import math
import time
from collections.abc import Callable

import torch

from kvmini.attention import StatsRequest
from kvmini.cache import KVCache, LayerCache
from kvmini.errors import KvminiError
from kvmini.methods.allocators import uniform
from kvmini.methods.selectors import keep_top

PREFILL = "prefill"
EVERY_CALL = "every_call"
AFTER_PROMPT = "after_prompt"  # in the call that completes the prompt, then after every later call


def merge_requests(requests: list[StatsRequest]) -> StatsRequest:
    """One request asking for everything any of `requests` asks for (they must agree on `reduce`)."""
    return StatsRequest(
        column_sums=any(r.column_sums for r in requests),
        window=max(r.window for r in requests),
        last_row=any(r.last_row for r in requests),
        reduce=requests[0].reduce,
    )


def resolve_budget(budget: float, prompt_len: int) -> int:
    """DESIGN.md "Budgets": a fraction 0 < x <= 1 is a ratio of the prompt length; a whole number
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
    """One compression method, composed of parts. Holds one run's state; see the module docstring."""

    def __init__(
        self,
        name: str,
        budget: float | None,  # None: the method chooses each layer's budget itself (`layer_rule`)
        *,
        scorer=None,  # None: position (most recent first), as StreamingLLM
        allocator: Callable[[int, int], list[int]] = uniform,  # (tokens per layer, L) -> per-layer budgets
        sinks: int = 0,  # first tokens always kept
        recent: Callable[[int], int] = lambda b: 0,  # layer budget -> last tokens always kept
        compensator=None,  # None: evicted tokens are dropped; else compensator(layer, lc, keep_idx) before the gather
        reducer=None,  # replaces score/select/compensate: reducer(lc, b, sinks, recent) shrinks lc to b entries
        schedule: str = PREFILL,
        prefill_chunk: int | None = None,  # prefill the prompt in chunks of this size (None: one call)
        layer_rule=None,  # chooses a layer's budget from its statistics: layer_rule(lc, stats) -> int
        layer_stat=None,  # measured per layer on the prompt; allocator(b, L, stats, n) then runs after the last layer
        rebalance=None,  # after a layer is compressed: rebalance(layer, cache, its scores, b) may trim earlier layers
        protected_layers: tuple = (),  # layers never compressed
    ):
        self.name, self.budget, self.scorer, self.allocator = name, budget, scorer, allocator
        self.sinks, self.recent, self.compensator, self.schedule = sinks, recent, compensator, schedule
        self.reducer, self.prefill_chunk = reducer, prefill_chunk
        self.layer_rule, self.layer_stat, self.protected_layers = layer_rule, layer_stat, tuple(protected_layers)
        self.rebalance = rebalance
        self.per_sequence = (layer_rule or layer_stat or rebalance) is not None  # budgets chosen per sequence
        requests = [part.request for part in (scorer, layer_rule, layer_stat) if part is not None]
        self.stats_request = merge_requests(requests) if requests else None
        self.start(None)

    def start(self, prompt_len: int | None, total_len: int | None = None) -> None:
        """Fresh state for a run whose prompt has prompt_len tokens (total_len: prompt + new tokens, if known)."""
        self.prompt_len, self.total_len = prompt_len, total_len
        self.budgets: list[int] | None = None  # per layer, set on the first call
        self.evicted: list[int] = []  # tokens removed per layer, over the whole run
        self.overhead_s = 0.0  # time spent scoring, selecting, merging and gathering
        self.active = False
        self.layer_stats: list[float] = []  # layer_stat of each layer, in the call that completes the prompt
        self._held_stats: list[dict] = []  # each layer's statistics until the deferred allocation
        self._fresh = prompt_len is not None
        self.cache, self.rows = None, None  # rows: one Policy per sequence of a batch (per-sequence methods)
        for part in (self.scorer, self.compensator, self.rebalance):
            if hasattr(part, "reset"):
                part.reset()

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        """The prefill chunk size this method asks for, or None (one call, also when its budget is a no-op)."""
        if self.prefill_chunk is None or (
            self.budget is not None and self._is_noop(resolve_budget(self.budget, prompt_len), prompt_len, total_len)
        ):
            return None
        return self.prefill_chunk

    def _is_noop(self, b: int, prompt_len: int, total_len: int | None) -> bool:
        """A budget >= the longest the cache gets under this schedule (unknown total: never) changes nothing."""
        longest = prompt_len if self.schedule == PREFILL else total_len
        return longest is not None and b >= longest

    def begin(self, cache: KVCache, T: int) -> None:
        if cache.seen_tokens == 0 and not self._fresh:
            self.start(T)  # a new run without start(): its first call is the whole prompt
        self._fresh = False
        if self.prompt_len is None:
            raise KvminiError(f"{self.name}: call policy.start(prompt_len) before continuing a cache it has not seen")
        if self.budgets is None:
            self._set_budgets(len(cache))
        B = cache[0].positions.shape[0]
        if self.active and self.per_sequence and B > 1:
            if self.rows is None:  # fresh copies of this policy, started for this prompt
                self.rows = [copy.deepcopy(self) for _ in range(B)]
                for row in self.rows:
                    row.start(self.prompt_len, self.total_len)
            for b, row in enumerate(self.rows):
                row.begin(cache.sequence(b), T)
        self.cache, self.T, self.call_start = cache, T, cache.seen_tokens
        end = cache.seen_tokens + T
        self.in_prompt = end <= self.prompt_len
        self.compress_now = self.active and (
            self.schedule == EVERY_CALL or end == self.prompt_len or (self.schedule == AFTER_PROMPT and end > self.prompt_len)
        )

    def _set_budgets(self, L: int) -> None:
        if any(layer >= L for layer in self.protected_layers):
            raise KvminiError(f"{self.name}: protected layers {list(self.protected_layers)} do not all exist; "
                              f"this model has layers 0 to {L - 1}")
        self.evicted = [0] * L
        if self.budget is None:  # chosen layer by layer as the prompt is compressed
            self.budgets, self.active = [self.prompt_len] * L, True
            return
        b = self.mean_budget = resolve_budget(self.budget, self.prompt_len)
        self.budgets = [b] * L if self.layer_stat is not None else self.allocator(b, L)  # deferred: see _allocate
        self._check_budgets()
        # a budget >= the sequence is a no-op (even where a per-layer allocation would give some
        # layer less, as PyramidKV's code does): no statistics, the fast path, exactly `full`
        self.active = not self._is_noop(b, self.prompt_len, self.total_len)

    def _check_budgets(self) -> None:
        for layer, b_l in enumerate(self.budgets):
            recent = self.recent(b_l)
            if b_l <= self.sinks or recent < 0 or self.sinks + recent > b_l:
                raise KvminiError(
                    f"{self.name}: a budget of {b_l} tokens (layer {layer}) is too small for {self.sinks} sinks "
                    f"and a window of {max(recent, 0)} tokens; raise --budget or lower --sinks/--window"
                )

    def _allocate(self, cache: KVCache) -> None:
        """Deferred allocation (e.g. D2O): every layer has been measured; budget all, then compress all."""
        self.budgets = self.allocator(self.mean_budget, len(cache), self.layer_stats, self.prompt_len)
        self._check_budgets()
        for layer, lc in enumerate(cache.layers):
            if lc.length > self.budgets[layer]:
                self.evict(layer, lc, self.budgets[layer], self._held_stats[layer])
        self._held_stats = []

    def request(self, layer: int) -> StatsRequest | None:
        if self.rows is not None:  # statistics for the whole batch if any sequence needs them
            return next((r for r in (row.request(layer) for row in self.rows) if r is not None), None)
        if not self.active or self.stats_request is None or layer in self.protected_layers:
            return None
        if self.accumulating():  # running sums need every call's statistics
            return self.stats_request
        per_layer_choice = self.layer_rule is not None or self.rebalance is not None or self.measuring()
        if self.compress_now and (per_layer_choice or self.cache[layer].length + self.T > self.budgets[layer]):
            return self.stats_request
        return None

    def measuring(self) -> bool:
        """Is a deferred allocation still collecting its per-layer statistic (in the call completing the prompt)?"""
        return self.layer_stat is not None and len(self.layer_stats) < len(self.budgets)

    def accumulating(self) -> bool:
        """Does the scorer keep running sums now? (Always for decode-time methods, during the prompt otherwise.)"""
        return self.scorer is not None and self.scorer.accumulates and (self.schedule != PREFILL or self.in_prompt)

    def after_attention(self, layer: int, cache: KVCache, stats: dict) -> None:
        if self.rows is not None:
            self._after_attention_per_sequence(layer, cache, stats)
            return
        if not self.active or layer in self.protected_layers:
            return
        lc = cache[layer]
        t0 = time.perf_counter()
        if self.accumulating():
            self.scorer.update(lc, stats, self.call_start, self.T)
        if self.layer_rule is not None and self.compress_now:
            self.budgets[layer] = self.layer_rule(lc, stats)
        b = self.budgets[layer]
        if self.compress_now and self.measuring():
            self.layer_stats.append(self.layer_stat(lc, stats))  # measure now, compress after the last layer
            self._held_stats.append(stats)  # (B, H_kv, S) tensors, for scorers that score from them
            if len(self.layer_stats) == len(cache):
                self._allocate(cache)
        elif self.compress_now and (lc.length > b or self.rebalance is not None):
            score = self.scorer(lc, stats) if self.rebalance is not None else None  # scored once, used twice
            if lc.length > b:
                self.evict(layer, lc, b, stats, score)
            if self.rebalance is not None:
                before = cache.lengths()
                self.rebalance(layer, cache, score, self.mean_budget)  # may trim layers 0..layer
                for i in range(layer + 1):
                    self.evicted[i] += before[i] - cache[i].length
                    self.budgets[i] = min(self.budgets[i], cache[i].length)
        if lc.keys.is_cuda:
            torch.cuda.synchronize(lc.keys.device)
        self.overhead_s += time.perf_counter() - t0

    def _after_attention_per_sequence(self, layer: int, cache: KVCache, stats: dict) -> None:
        """Each sequence's policy acts on its own row, with its row of the statistics."""
        for b, row in enumerate(self.rows):
            view = row.cache  # cache.sequence(b), made in begin()
            S_b = view[layer].length
            row.after_attention(layer, view, {name: t[b : b + 1, :, :S_b] for name, t in stats.items()})
        # the batch's report: budgets averaged over sequences, evictions and time summed
        B = len(self.rows)
        self.budgets = [round(sum(r.budgets[i] for r in self.rows) / B) for i in range(len(cache))]
        self.evicted = [sum(r.evicted[i] for r in self.rows) for i in range(len(cache))]
        self.overhead_s = sum(r.overhead_s for r in self.rows)
        if hasattr(self.compensator, "merged"):
            self.compensator.merged = {i: sum(r.compensator.merged.get(i, 0) for r in self.rows) for i in range(len(cache))}

    def evict(self, layer: int, lc: LayerCache, b: int, stats: dict, score: torch.Tensor | None = None) -> None:
        """Shrink layer `layer` to b entries: score, select, compensate, gather (or the method's reducer)."""
        self.evicted[layer] += lc.length - b
        if self.reducer is not None:
            self.reducer(lc, b, self.sinks, self.recent(b))
            return
        if score is None:
            score = lc.positions.float() if self.scorer is None else self.scorer(lc, stats)  # (B, H_kv, S)
        idx = keep_top(score, b, self.sinks, self.recent(b))  # (B, H_kv, b), ascending
        if self.compensator is not None:
            self.compensator(layer, lc, idx)
        lc.keep(idx)
