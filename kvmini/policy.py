"""The compression engine as its specification: a method's four parts (kvmini.parts) run inside the
model's forward pass, layer by layer (docs/design.md, "One forward call").

The model talks to a policy through four calls per forward pass of T new tokens:
    begin(cache, T)                      before layer 0: which step of the schedule is this call?
    request(layer) -> Request|None       before the layer's attention (None: the fast SDPA path)
    after_attention(layer, cache, stats) after it; this may shrink cache[layer] (and, for a
                                         budgeter that revisits layers, earlier ones)
    end(cache)                           after the last layer (nothing to do in this form)
In a call the schedule compresses, after layer l attended over its full cache:
    score = scorer(cache[l], stats);  for i, b in budgeter.decide(l, ...): compressor(i, cache[i], score_i, b)
Only later layers and later calls see what was kept. A run is told where each prompt ends and
never guesses: `start(n)` before its first call (kvmini.generate.prefill calls it), `next_prompt(n)`
before a later prompt (a next turn: planned afresh, docs/design.md "A cache that lives on"); calls
after a prompt are generated tokens, one or several at a time. A call the policy would have to
guess about (no start, another cache, one crossing a prompt's end) is refused with a KvminiError.
A prompt fed in several calls (a chunked prefill) is one prompt: a method that compresses once the
prompt is complete (every schedule but EVERY_CALL) sees its statistics, gathered over the calls
(kvmini.statistics.Gathering), in the call that completes it, as if the prompt had come in that one
call; EVERY_CALL methods compress after each chunk by design.

Beside this file: kvmini.at_once (the same decode step with every layer's eviction at once, what
`make_policy` builds for decode-time methods; tests/test_together.py proves both equal) and
kvmini.per_sequence (a batch whose sequences get their own budgets).
"""
import math
from dataclasses import dataclass

from kvmini.cache import KVCache
from kvmini.errors import KvminiError, tokens
from kvmini.parts import AFTER_PROMPT, DECODE, EVERY_CALL, PREFILL
from kvmini.statistics import Gathering, Request, Stats


NO_LIMIT = 2**30  # tokens per layer: a budget no prompt reaches (asks a compressor whether any budget works)


def resolve_budget(budget: float, prompt_len: int) -> int:
    """A budget in tokens per layer (docs/design.md, "Budgets"). Its type decides what it counts:
    a float up to 1.0 is a ratio of the prompt length, an int (or a whole float above 1) is tokens.

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


@dataclass(slots=True)
class Call:
    """One forward call of T new tokens, read against the schedule by `begin`."""

    cache: KVCache
    start: int  # the position of its first token
    T: int
    in_prompt: bool  # it ends within the prompt
    compress_now: bool  # the schedule compresses in this call
    gathering: bool  # it is part of a prompt fed in several calls
    scores: dict  # layer -> its score (B, H_kv, S), scored once in this call


class Policy:
    """One method = scorer + budgeter + compressor + schedule, and one run's state."""

    def __init__(self, name: str, budget: float | None, scorer, budgeter, compressor, schedule: str = PREFILL,
                 prefill_chunk: int | None = None):
        """budget None: the budgeter chooses; prefill_chunk: the prompt is fed in chunks of this size
        (an int, or a function of the per-layer budget in tokens)."""
        self.name, self.budget, self.schedule, self.prefill_chunk = name, budget, schedule, prefill_chunk
        self.scorer, self.budgeter, self.compressor = scorer, budgeter, compressor
        self.evict_every = 1  # N: during decoding, let a layer hold budget + N - 1 and evict N at once
        if budget is not None and (never := compressor.problem(NO_LIMIT)) is not None:  # e.g. d2o nm=0:1 with sinks
            raise KvminiError(f"{name}: no budget can work with these options: even a budget of {NO_LIMIT:,} "
                              f"tokens is {never}; use fewer sinks or a smaller window")
        self.start(None)

    def start(self, prompt_len: int | None, total_len: int | None = None) -> None:
        """A new run whose first prompt has prompt_len tokens. total_len (prompt + new tokens) promises
        the run ends there: no next prompt, so a budget it never reaches computes no statistics."""
        self.prompt_start, self.prompt_end, self.total_len = 0, prompt_len, total_len
        self.started, self.evicted, self.active, self.note = False, [], False, None  # parts start on the first call
        self.seen, self.skipped = 0, False  # tokens fed so far; statistics an idle run did not keep
        self._new_prompt()

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        """Continue the run: its next prompt_len tokens are a new prompt (a next turn, a next question),
        planned afresh when it arrives (docs/design.md, "A cache that lives on"). total_len as in start."""
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise KvminiError(f"{self.name}: next_prompt takes the prompt's length in tokens, a whole number >= 1, "
                              f"got {prompt_len!r}")
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
        start, n = cache.seen_tokens, self.prompt_end
        end = start + T  # this call ends at token `end`
        self._check_call(start, end)
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
        gathering = self.schedule != EVERY_CALL and end <= n and T < n - self.prompt_start  # a prompt in several calls
        self.call = Call(cache, start, T, end <= n, self.active and when[self.schedule], gathering, {})
        if gathering and start == self.prompt_start:
            wanted = Request.merge([self.scorer.request, self.budgeter.request])
            self.gathered = Gathering(wanted, n) if wanted else None
        if not self.active and self.accumulating() and not self.counting():
            self.skipped = True  # an idle run promised to end (total_len): a next prompt would lack these sums

    def _check_call(self, start: int, end: int) -> None:
        """Refuse a call the policy would have to guess about: it never guesses where a prompt ends."""
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
        if any(not -L <= layer < L for layer in self.budgeter.protected_spec):
            raise KvminiError(f"{self.name}: protected layers {list(self.budgeter.protected_spec)} do not all exist; "
                              f"this model has layers 0 to {L - 1}")
        n, b, self.note = self.prompt_end, None if self.budget is None else resolve_budget(self.budget, self.prompt_end), None
        self.planned = True
        fits = b is None or self._fits(b, L)
        fit = None if fits else next((x for x in range(b + 1, n + 1) if self._fits(x, L)), None)  # the least that does
        if isinstance(self.budget, float) and self.budget <= 1 and not fits:  # a ratio (resolve_budget)
            # a share of a short prompt smaller than what the method always keeps: raise it to the least that works
            if fit is None:
                self.note = f"not compressed: the {n}-token prompt is no longer than what {self.name} always keeps"
                self.unchanged, self.active = [n] * L, False
                return
            self.note, b = f"budget raised from {b} to {fit} tokens per layer, the least {self.name} can keep", fit
        self.budgeter.start(b, L, n)
        if b is not None:
            least = (f"the least budget that works on this {n}-token prompt is {fit} tokens per layer" if fit else
                     f"no budget up to the prompt's {n} tokens works: use fewer sinks or a smaller window")
            self._check({layer: b_l for layer, b_l in enumerate(self.budgets)}, f"; {least}", mean=b)
        self.active = b is None or not self._is_noop(b, n, self.total_len)

    def _fits(self, b: int, L: int) -> bool:
        """Can the parts work with a mean budget of b tokens per layer? (Asks the budgeter's pure plan.)"""
        try:
            budgets = self.budgeter.plan(b, L, self.prompt_end)
        except KvminiError:
            return False
        return not self._problems(dict(enumerate(budgets)), L)

    def _problems(self, budgets: dict[int, int], L: int) -> list[tuple[int, int, str]]:
        """(layer, budget, why) for the budgets the compressor cannot work with (protected layers never compress)."""
        protected = self.budgeter.protected_in(L)
        return [(layer, b, why) for layer, b in budgets.items()
                if layer not in protected and (why := self.compressor.problem(b)) is not None]

    def _check(self, budgets: dict[int, int], advice: str = "; raise --budget, or use fewer sinks or a smaller window",
               mean: int | None = None) -> None:
        if problems := self._problems(budgets, len(self.evicted)):
            layer, b, why = problems[0]
            source = f", from a mean budget of {tokens(mean)}" if mean not in (None, b) else ""
            raise KvminiError(f"{self.name}: a budget of {tokens(b)} (layer {layer}{source}) is {why}{advice}")

    def accumulating(self) -> bool:
        """Does the scorer keep running sums now? (Always for decode-time methods, during the prompt otherwise.)"""
        return self.scorer.accumulates and (self.schedule != PREFILL or self.call.in_prompt)

    def counting(self) -> bool:
        """Does an idle run (nothing to compress yet) keep its scorer's running sums? Yes when it may go on
        (no total_len): a next prompt that makes it compress then finds them complete."""
        return self.total_len is None and self.accumulating()

    def request(self, layer: int) -> Request | None:
        call = self.call
        if self.budgeter.skips(layer):
            return None
        if not self.active:
            return self.scorer.request if self.counting() else None
        if call.gathering:
            return self.gathered.request(call.start, call.T) if self.gathered else None
        wanted = [self.scorer.request] if self.accumulating() else []
        if self.budgeter.accumulates and call.in_prompt:
            wanted.append(self.budgeter.request)
        if call.compress_now:
            known = self.budgeter.known(layer)
            if known is None:
                wanted += [self.scorer.request, self.budgeter.request]
            elif call.cache[layer].length + call.T > known:
                wanted.append(self.scorer.request)
        return Request.merge(wanted)

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        call, lc = self.call, cache[layer]
        if self.budgeter.skips(layer):
            return
        if not self.active:
            if self.counting():
                self.scorer.update(lc, stats, call.start, call.T)
            return
        if call.gathering:  # a prompt in several calls: its parts see it when it is complete
            complete = call.start + call.T == self.prompt_end
            if self.gathered is not None:
                stats = self.gathered.add(layer, stats, lc.keys.shape[1], complete)
            if not complete:
                return
        if self.accumulating():
            self.scorer.update(lc, stats, call.start, call.T)
        if self.budgeter.accumulates and call.in_prompt:
            self.budgeter.update(layer, lc, stats, call.start, call.T)
        known = self.budgeter.known(layer) if call.compress_now else None
        slack = 0 if call.in_prompt else self.evict_every - 1  # held beyond the budget between evictions
        if not call.compress_now or (known is not None and lc.length <= known + slack):
            return
        call.scores[layer] = self.scorer(lc, stats)  # (B, H_kv, S), scored once per layer and call
        decided = self.budgeter.decide(layer, lc, stats, call.scores[layer])
        if self.budget is not None:  # a budget the user gave; self-chosen ones are feasible by construction
            self._check(decided)
        for i, b in decided.items():
            if cache[i].length > b:
                self.evicted[i] += cache[i].length - b
                kept = self.compressor(i, cache[i], call.scores[i], b)
                if self.budgeter.revisits and kept is not None:  # keep the score aligned with what is left
                    call.scores[i] = call.scores[i].gather(2, kept)

    def end(self, cache: KVCache) -> None:
        """After the last layer: here every layer was compressed in its own `after_attention`
        (kvmini.at_once.AtOnce uses this call to evict a decode step's layers together)."""

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
