"""The compression engine as its specification: a method's four parts (kvmini.parts) run inside the
model's forward pass, layer by layer. The four calls (`begin`, `request`, `after_attention`, `end`),
the loop and the rules for prompts (`start`, `next_prompt`, chunked prefills) are docs/design.md's
"One forward call" and "A cache that lives on". Beside it: kvmini.budget, kvmini.at_once (every
layer's decode-step eviction at once, a wrapper for the methods in registry.TOGETHER) and
kvmini.per_sequence (per-sequence budgets in a batch).
"""
from dataclasses import dataclass

from kvmini.budget import check, chunk_size, is_noop, plan
from kvmini.cache import KVCache
from kvmini.errors import KvminiError
from kvmini.methods.method import prompt_length
from kvmini.parts import AFTER_PROMPT, DECODE, EVERY_CALL, PREFILL
from kvmini.statistics import Gathering, Request, Stats


@dataclass(slots=True)
class Call:
    """One forward call of T new tokens, read against the schedule once, by `begin`."""

    cache: KVCache
    start: int  # the position of its first token
    T: int
    in_prompt: bool  # it ends within the prompt
    completes: bool  # it ends the prompt
    gathering: bool  # it is a piece of a prompt fed in several calls (and the run compresses)
    updates: bool  # the scorer keeps running sums in this call (an idle run's too, unless told its end)
    measures: bool  # the budgeter measures this call (a prompt call, an accumulating budgeter)
    compress_now: bool  # the schedule compresses in this call
    slack: int  # entries a layer may hold beyond its budget: evict_every - 1 while decoding, else 0
    keeping: Request | None  # what a layer's pass computes to keep its running sums (no eviction in it)
    evicting: Request | None  # ... and to score its entries: its known budget is exceeded
    deciding: Request | None  # ... and to decide its budget now (not known before this call)
    scores: dict  # layer -> its score (B, H_kv, S), scored once in this call


class Policy:
    """One method = scorer + budgeter + compressor + schedule, and one run's state."""

    def __init__(self, name: str, budget: float | None, scorer, budgeter, compressor, schedule: str = PREFILL,
                 prefill_chunk: int | None = None):
        """budget None: the budgeter chooses; prefill_chunk: the prompt's chunk size (or a function of the budget)."""
        self.name, self.budget, self.schedule, self.prefill_chunk = name, budget, schedule, prefill_chunk
        self.scorer, self.budgeter, self.compressor = scorer, budgeter, compressor
        self.evict_every = 1  # N: during decoding, let a layer hold budget + N - 1 and evict N at once
        self._new_run(None, None)  # not started: a call before `start` is refused

    def start(self, prompt_len: int, total_len: int | None = None) -> None:
        """A new run whose first prompt has prompt_len tokens; total_len (if given) promises it ends there."""
        self._new_run(prompt_length(self.name, "start", prompt_len), total_len)

    def _new_run(self, prompt_len: int | None, total_len: int | None) -> None:
        self.prompt_start, self.prompt_end, self.total_len = 0, prompt_len, total_len
        self.started, self.evicted, self.active, self.note = False, [], False, None  # parts start on the first call
        self.seen, self.skipped = 0, False  # tokens fed so far; statistics an idle run did not keep
        self._new_prompt()

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        """The run's next prompt_len tokens are a new prompt (docs/design.md, "A cache that lives on")."""
        prompt_length(self.name, "next_prompt", prompt_len)
        if self.prompt_end is None:
            raise KvminiError(f"{self.name}: next_prompt continues a run; call policy.start(prompt_len) for the first prompt")
        if self.seen < self.prompt_end:
            raise KvminiError(f"{self.name}: the prompt is not complete ({self.prompt_end - self.seen} of its tokens are still "
                              "to come); feed them before a next prompt")
        if self.skipped:
            raise KvminiError(f"{self.name}: this run was started to end at {self.total_len} tokens (total_len), so it kept "
                              "no attention statistics while its budget was not reached; to continue a run, start it "
                              "without total_len (generate(..., more_prompts=True))")
        self.prompt_start, self.prompt_end, self.total_len = self.seen, self.seen + prompt_len, total_len
        self._new_prompt()

    def _new_prompt(self) -> None:
        self.planned = False  # the budgets are planned at the prompt's first call (the layer count is known there)
        self.unchanged: list[int] | None = None  # the budgets of a prompt too short to compress: all of it
        self.gathered: Gathering | None = None  # a prompt in several calls: its statistics so far
        self.call: Call | None = None

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        """The prefill chunk size this method asks for, or None (one call, also when its budget is a no-op)."""
        return chunk_size(self.budget, self.prefill_chunk, self.schedule, prompt_len, total_len)

    def begin(self, cache: KVCache, T: int) -> None:
        """Before layer 0: this call against the schedule, and the requests its layers' passes make."""
        start, n = cache.seen_tokens, self.prompt_end
        end = start + T  # this call ends at token `end`
        self._check_call(cache, start, end)
        if not self.started:
            self.compressor.start(len(cache))
            self.started, self.evicted = True, [0] * len(cache)
            for layer in range(len(cache)):  # the buffers the scorer keeps, in the layers it scores: once a run
                if not self.budgeter.skips(layer):
                    cache[layer].declare(*self.scorer.aux)
        if not self.planned:
            self._plan(len(cache))
        self.seen = end
        when = {PREFILL: end == n, AFTER_PROMPT: end >= n, DECODE: end > n, EVERY_CALL: True}  # the schedule
        compress_now = self.active and when[self.schedule]
        gathering = self.active and self.schedule != EVERY_CALL and end <= n and T < n - self.prompt_start
        accumulating = self.scorer.accumulates and (self.schedule != PREFILL or end <= n)  # decode-time: always
        updates = accumulating and (self.active or self.total_len is None)  # an idle run that may go on, too
        if accumulating and not updates:
            self.skipped = True  # an idle run promised to end (total_len): a next prompt would lack these sums
        measures = self.active and self.budgeter.accumulates and end <= n
        if gathering and start == self.prompt_start:
            wanted = Request.merge([self.scorer.request, self.budgeter.request])
            self.gathered = Gathering(wanted, n) if wanted else None
        if gathering:  # the parts see the prompt's statistics when it is complete
            keeping = evicting = deciding = self.gathered.request(start, T) if self.gathered else None
        else:
            wanted = ([self.scorer.request] if updates else []) + ([self.budgeter.request] if measures else [])
            keeping = Request.merge(wanted)
            evicting = Request.merge(wanted + [self.scorer.request]) if compress_now else keeping
            deciding = Request.merge(wanted + [self.scorer.request, self.budgeter.request]) if compress_now else keeping
        slack = 0 if end <= n else self.evict_every - 1  # held beyond the budget between evictions
        self.call = Call(cache, start, T, end <= n, end == n, gathering, updates, measures, compress_now, slack,
                         keeping, evicting, deciding, {})

    def _check_call(self, cache: KVCache, start: int, end: int) -> None:
        """Refuse a call the policy would have to guess about: it never guesses where a prompt ends, nor
        shares one budget plan among sequences that each need their own."""
        if self.budgeter.per_sequence and cache[0].positions.shape[0] > 1:
            raise KvminiError(f"{self.name}: its budgets follow each sequence, and this batch holds "
                              f"{cache[0].positions.shape[0]}: run it with kvmini.generate (generate or prefill), "
                              "or wrap the policy: kvmini.per_sequence.PerSequence.of(policy)")
        if self.prompt_end is None:
            raise KvminiError(f"{self.name}: call policy.start(prompt_len) before the first call, so that the policy knows "
                              "where the prompt ends (kvmini.generate.prefill does it)")
        if start != self.seen:
            raise KvminiError(f"{self.name}: this cache holds {start} tokens, but this run of the policy has fed {self.seen}; "
                              "a new cache needs policy.start(prompt_len), and one policy follows one cache")
        if start < self.prompt_end < end:
            raise KvminiError(f"{self.name}: a call of {end - start} tokens from position {start} crosses the prompt's end at "
                              f"{self.prompt_end}; feed the prompt's last {self.prompt_end - start} tokens in their own call")

    def _plan(self, L: int) -> None:
        """This prompt's budgets, for every token the run has seen when it completes (a ratio is of those)."""
        n = self.prompt_end
        b, self.note, advice = plan(self.name, self.budget, self.budgeter, self.compressor, L, n)
        self.planned = True
        if b is None and self.budget is not None:  # a prompt no longer than what the method always keeps
            self.unchanged, self.active = [n] * L, False
            return
        self.budgeter.start(b, L, n)
        if b is not None:
            check(self.name, self.compressor, dict(enumerate(self.budgeter.budgets)), self.budgeter.protected_in(L),
                  advice, mean=b)
        self.active = b is None or not is_noop(b, n, self.total_len, self.schedule)

    def before(self, cache: KVCache, T: int) -> None:
        """The model's first hook (kvmini.methods.method): `begin`, and the next layer is 0."""
        self.layer = 0
        self.begin(cache, T)

    @property
    def wants(self) -> Request | None:
        """What the next layer's attention pass computes (`request`); counting the layers as they come."""
        self.layer += 1
        return self.request(self.layer - 1)

    def after_layers(self, cache: KVCache) -> None:
        self.end(cache)

    def request(self, layer: int) -> Request | None:
        """What layer's attention pass computes: one of the call's requests (`begin`)."""
        call = self.call
        if self.budgeter.skips(layer):
            return None
        if not call.compress_now:
            return call.keeping
        known = self.budgeter.known(layer)
        if known is None:
            return call.deciding
        return call.evicting if call.cache[layer].length + call.T > known else call.keeping

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        """docs/design.md's loop ("One forward call"), step for step."""
        call, lc = self.call, cache[layer]
        if self.budgeter.skips(layer):  # a protected layer
            return
        if call.gathering:  # a piece of a prompt: its statistics so far; stop unless it completes the prompt
            if self.gathered is not None:
                stats = self.gathered.add(layer, stats, lc.keys.shape[1], call.completes)
            if not call.completes:
                return
        if call.updates:
            self.scorer.update(lc, stats, call.start, call.T)
        if call.measures:
            self.budgeter.update(layer, lc, stats, call.start, call.T)
        known = self.budgeter.known(layer) if call.compress_now else None  # None: decided in this call
        if not call.compress_now or (known is not None and lc.length <= known + call.slack):
            return
        call.scores[layer] = self.scorer(lc, stats)  # (B, H_kv, S), held for this call
        decided = self.budgeter.decide(layer, lc, stats, call.scores[layer])
        if known is None and self.budget is not None:  # a budget the user gave, decided now: checked once
            check(self.name, self.compressor, decided, self.budgeter.protected_in(len(cache)))
        for i, b in decided.items():
            if cache[i].length > b:
                self.evicted[i] += cache[i].length - b
                kept = self.compressor((i,), cache[i], call.scores[i], b, call.start + call.T - 1)
                if self.budgeter.revisits and kept is not None:  # keep the score aligned with what is left
                    call.scores[i] = call.scores[i].gather(2, kept)

    def end(self, cache: KVCache) -> None:
        """After the last layer: nothing here (every layer was compressed in its own `after_attention`)."""

    @property
    def parts(self) -> tuple:
        return self.scorer, self.budgeter, self.compressor

    # what the tools read of a method (kvmini.methods.method): here, from the parts
    per_sequence = property(lambda self: self.budgeter.per_sequence)
    protected = property(lambda self: self.budgeter.protected)
    aux = property(lambda self: self.scorer.aux)
    mean_budget = property(lambda self: getattr(self.budgeter, "b", None))

    protected_spec = property(lambda self: self.budgeter.protected_spec)
    own_counts = property(lambda self: getattr(self.compressor, "own_counts", False))  # heads keep their own counts

    def problem(self, b: int) -> str | None:
        return self.compressor.problem(b)

    def plan(self, b: int, L: int, n: int) -> list[int]:
        return self.budgeter.plan(b, L, n)

    def protected_in(self, L: int) -> tuple[int, ...]:
        return self.budgeter.protected_in(L)

    sinks = property(lambda self: self.compressor.sinks)

    def recent(self, b: int) -> int:
        return self.compressor.recent(b)

    def describe(self, lc) -> tuple:
        """What the method's score is and its values for lc's entries (B, H_kv, S), or (why none, None)."""
        if not hasattr(self.scorer, "describe"):
            return (f"not kept in the cache ({type(self.scorer).__name__} scores the tokens from one call's attention "
                    "when the method compresses, then discards them)"), None
        return self.scorer.describe(lc)

    def holds_more_because(self) -> str:
        return getattr(self.budgeter, "holds_more_because", lambda: "")()

    @property
    def merger(self):
        """The part that merges evicted tokens (its `trace` records them), or None."""
        merger = getattr(self.compressor, "merge", self.compressor)  # TopK holds D2O's EMAMerge
        return merger if merger is not None and hasattr(merger, "trace") else None

    @property
    def budgets(self) -> list[int] | None:
        """What each layer may keep, as decided so far (None before the first call)."""
        if not self.started:
            return None
        return self.unchanged if self.unchanged is not None else self.budgeter.budgets

    @property
    def merged(self) -> list[float]:
        """Evicted tokens merged into kept ones, per layer (mean over KV heads)."""
        return self.compressor.merged.tolist()
