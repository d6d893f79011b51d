"""What every method shares: its name and budget, and one run's bookkeeping. A method is a subclass
whose three hooks the model's forward pass calls (docs/design.md, "The method form"):

    before(cache, T)                      before layer 0 of a call of T new tokens; sets `wants`
    after_attention(layer, cache, seen)   after a layer's attention; `seen` holds what `wants` named
    after_layers(cache)                   after the last layer

`wants` is read before each layer's attention: the statistics that pass computes (None: none).
`Method.before` does the bookkeeping a subclass's own `before` starts with: where the prompt ends,
what the budget is in tokens per layer (`budgets`), whether compressing does anything (`active`).
A method that reads the model's weights (each head's W_o, say) finds the model of the run in `model`.
"""
import weakref

from kvmini.budget import check, chunk_size, is_noop, plan
from kvmini.errors import KvminiError, tokens
from kvmini.model import Transformer


def prompt_length(name: str, call: str, n) -> int:
    """n, a prompt's length in tokens, or a KvminiError naming the call it was given to."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KvminiError(f"{name}: {call} takes the prompt's length in tokens, a whole number >= 1, got {n!r}")
    return n


def run_length(name: str, total_len, end: int):
    """total_len, the length a run promises to end at (None: no promise), or a KvminiError: a promise short of
    the prompt's `end` would read the budget as one the run never exceeds, and compress nothing."""
    if total_len is not None and (isinstance(total_len, bool) or not isinstance(total_len, int) or total_len < end):
        raise KvminiError(f"{name}: total_len must be None or a whole number >= the prompt's end ({end}), got {total_len!r}")
    return total_len


class Method:
    """One method and one run's state. A subclass sets `sinks`, `recent` (a function of the budget),
    `protected` layers and `schedule`: when its own code compresses, named for the tools that report it
    and for the budget rules (a budget is a no-op if no call ever exceeds it), one of
        "prefill"       once, layer by layer, in the forward call that completes the prompt
        "after_prompt"  in the call that completes the prompt, then after every later call
        "every_call"    after every forward call (each prefill chunk, each decode step)
        "decode"        after every call past the prompt: the first compression at the first decode step"""

    schedule = "every_call"
    own_counts = False  # the heads of a layer keep their own counts (Ada-KV)
    prefill_chunk = None  # the prompt's chunk size the method asks for (None: one call)
    protected_spec: tuple = ()  # layers never compressed, -1 the last
    sinks = 0
    aux: tuple = ()  # the per-entry buffers the method keeps in the cache, declared at a run's first call

    def __init__(self, name: str, budget: float | None):
        self.name, self.budget = name, budget
        self.evict_every = 1  # N: while decoding, a layer holds up to budget + N - 1 and evicts N at once
        self.wants = None
        self._new_run(None, None)

    def recent(self, b: int) -> int:
        """The recent window a layer of budget b always keeps."""
        return 0

    # --- a run: its prompts, and each call against them --------------------------------------------

    def start(self, prompt_len: int, total_len: int | None = None, model=None) -> None:
        """A new run whose first prompt has prompt_len tokens; total_len (if given) promises it ends there;
        model: the Transformer it runs in (kvmini.generate.prefill passes it), held weakly, so that a
        `fork` of the run copies the method's state, not the model."""
        if model is not None and not isinstance(model, Transformer):
            raise KvminiError(f"{self.name}: start takes the run's model, a kvmini Transformer, got {type(model).__name__}")
        self._new_run(prompt_length(self.name, "start", prompt_len), run_length(self.name, total_len, prompt_len))
        self._model = None if model is None else weakref.ref(model)

    @property
    def model(self):
        """The model of this run (None when `start` was not given one)."""
        return None if self._model is None else self._model()

    def _new_run(self, prompt_len, total_len) -> None:
        self.prompt_start, self.prompt_end, self.total_len = 0, prompt_len, total_len
        self.started, self.evicted, self.active, self.note = False, [], False, None
        self.seen, self.skipped, self._merged = 0, False, []
        self.planned, self.unchanged, self._budgets, self.row_budgets = False, None, None, None
        self.mean_budget, self.protected, self._model = None, (), None

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
        end = self.seen + prompt_len
        self.prompt_start, self.prompt_end, self.total_len = self.seen, end, run_length(self.name, total_len, end)
        self.planned, self.unchanged = False, None

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        """The prefill chunk size this method asks for, or None (one call, also when its budget is a no-op)."""
        return chunk_size(self.budget, self.prefill_chunk, self.schedule, prompt_len, total_len)

    def before(self, cache, T: int) -> None:
        """A call of T tokens: refuse one the method would have to guess about; at a run's first call declare
        `aux`; at a prompt's first call plan its budgets. Then `in_prompt` (the call ends within the prompt),
        `completes` (it ends the prompt), `newest` (its last token's position), `slack` (entries a layer may hold beyond its budget) and `updates` (keep running sums in this call)."""
        start, end, n = cache.seen_tokens, cache.seen_tokens + T, self.prompt_end
        self._check_call(start, end)
        if not self.started:
            self.started, self.evicted, self._merged = True, [0] * len(cache), [0.0] * len(cache)
            for layer in range(len(cache)):
                if layer not in self.protected_in(len(cache)):
                    cache[layer].declare(*self.aux)
        if not self.planned:
            self._plan(len(cache))
        self.seen, self.newest, self.in_prompt, self.completes = end, end - 1, end <= n, end == n
        self.slack = 0 if end <= n else self.evict_every - 1
        self.updates = self.active or self.total_len is None  # an idle run that may go on keeps its sums too
        self.skipped |= bool(self.aux) and not self.updates  # then a next prompt would lack them

    def _check_call(self, start: int, end: int) -> None:
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
        b, self.note, advice = plan(self.name, self.budget, self, L, n)
        self.planned, self.row_budgets = True, None
        if b is None and self.budget is not None:  # a prompt no longer than what the method always keeps
            self.unchanged, self.active = [n] * L, False
            return
        self.mean_budget, self.protected, self._budgets = b, self.protected_in(L), self.plan(b, L, n)
        if b is None:  # the method chooses every layer's budget (DBudgetKV)
            self.active = True
            return
        check(self.name, self, dict(enumerate(self._budgets)), self.protected_in(L), advice, mean=b)
        self.active = not is_noop(b, n, self.total_len, self.schedule)

    # --- budgets: what `kvmini.budget` asks of a method ---------------------------------------------

    def plan(self, b: int, L: int, n: int) -> list[int]:
        """Per-layer budgets for a mean of b tokens: b each; a protected layer keeps the whole prompt."""
        protected = self.protected_in(L)
        return [n if layer in protected else b for layer in range(L)]

    def protected_in(self, L: int) -> tuple[int, ...]:
        return tuple(p + L if p < 0 else p for p in self.protected_spec)

    def problem(self, b: int) -> str | None:
        """Why a layer budget of b tokens cannot work (too small for the sinks and the window), or None."""
        recent = self.recent(b)
        if b <= self.sinks or recent < 0 or self.sinks + recent > b:
            return f"too small for {self.sinks} sinks and a window of {tokens(max(recent, 0))}"
        return None

    @property
    def budgets(self) -> list[int] | None:
        """What each layer may keep (None before the first call; the mean over the sequences of a batch)."""
        if not self.started:
            return None
        return self.unchanged if self.unchanged is not None else self._budgets

    # --- what the tools read (the report, the kept-token page) -------------------------------------

    merger = None  # what records the method's merges in its `trace` list (kvmini.view), if it merges

    @property
    def merged(self) -> list[float]:
        """Tokens merged per layer (mean over heads, sum over rows), tensors until read: no step waits to count."""
        return [float(m) for m in self._merged]

    def describe(self, lc) -> tuple:
        """What the method's score is and its values for lc's entries (B, H_kv, S), or (why none, None)."""
        return f"not kept in the cache ({self.name} scores the tokens from one call's attention, then discards them)", None

    def holds_more_because(self) -> str:
        """Why a layer may hold more than the budget asks (D2O's protected layers), or ""."""
        return ""

    # --- the hooks a subclass fills in --------------------------------------------------------------

    def after_attention(self, layer: int, cache, seen) -> None:
        """After layer `layer`'s attention: nothing, unless the method says otherwise."""

    def after_layers(self, cache) -> None:
        """After the last layer: nothing, unless the method says otherwise."""
