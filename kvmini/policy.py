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

Beside this file: kvmini.budget (what a budget means in tokens, and whether the parts can work with
it), kvmini.at_once (the same decode step with every layer's eviction at once, what
`make_policy` builds for decode-time methods; tests/test_together.py proves both equal) and
kvmini.per_sequence (a batch whose sequences get their own budgets).
"""
from dataclasses import dataclass

from kvmini.budget import check, chunk_size, is_noop, plan, some_budget_works
from kvmini.cache import KVCache
from kvmini.errors import KvminiError
from kvmini.parts import AFTER_PROMPT, DECODE, EVERY_CALL, PREFILL
from kvmini.statistics import Gathering, Request, Stats


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


def prompt_length(name: str, call: str, n) -> int:
    """n, a prompt's length in tokens, or a KvminiError naming the call it was given to."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KvminiError(f"{name}: {call} takes the prompt's length in tokens, a whole number >= 1, got {n!r}")
    return n


class Policy:
    """One method = scorer + budgeter + compressor + schedule, and one run's state."""

    def __init__(self, name: str, budget: float | None, scorer, budgeter, compressor, schedule: str = PREFILL,
                 prefill_chunk: int | None = None):
        """budget None: the budgeter chooses; prefill_chunk: the prompt is fed in chunks of this size
        (an int, or a function of the per-layer budget in tokens)."""
        self.name, self.budget, self.schedule, self.prefill_chunk = name, budget, schedule, prefill_chunk
        self.scorer, self.budgeter, self.compressor = scorer, budgeter, compressor
        self.evict_every = 1  # N: during decoding, let a layer hold budget + N - 1 and evict N at once
        if budget is not None:
            some_budget_works(name, compressor)
        self._new_run(None, None)  # not started: a call before `start` is refused

    def start(self, prompt_len: int, total_len: int | None = None) -> None:
        """A new run whose first prompt has prompt_len tokens. total_len (prompt + new tokens) promises
        the run ends there: no next prompt, so a budget it never reaches computes no statistics."""
        self._new_run(prompt_length(self.name, "start", prompt_len), total_len)

    def _new_run(self, prompt_len: int | None, total_len: int | None) -> None:
        self.prompt_start, self.prompt_end, self.total_len = 0, prompt_len, total_len
        self.started, self.evicted, self.active, self.note = False, [], False, None  # parts start on the first call
        self.seen, self.skipped = 0, False  # tokens fed so far; statistics an idle run did not keep
        self._new_prompt()

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        """Continue the run: its next prompt_len tokens are a new prompt (a next turn, a next question),
        planned afresh when it arrives (docs/design.md, "A cache that lives on"). total_len as in start."""
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
        known = self.budgeter.known(layer) if call.compress_now else None  # None: decided in this call
        slack = 0 if call.in_prompt else self.evict_every - 1  # held beyond the budget between evictions
        if not call.compress_now or (known is not None and lc.length <= known + slack):
            return
        call.scores[layer] = self.scorer(lc, stats)  # (B, H_kv, S), scored once per layer and call
        decided = self.budgeter.decide(layer, lc, stats, call.scores[layer])
        if known is None and self.budget is not None:  # a budget the user gave, decided now: checked once
            check(self.name, self.compressor, decided, self.budgeter.protected_in(len(cache)))
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
