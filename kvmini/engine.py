"""What a run is, kept by the engine and handed to a method's hooks (docs/design.md, "The method form").

A run is one cache and one policy: its prompts (where each starts and ends), what has been fed, each
layer's budget in tokens, whether compressing can change anything. `Run` keeps it and refuses its misuse,
once; before every forward call the model asks it for that call's `Step`, one read-only value that every
hook of the method is handed. A method keeps only its algorithm's own state.

    run = Run(policy, prompt_len=10)        # policy.start(10) makes it
    step = run.step(policy, cache, T=10)    # the prompt in one call: step.completes, step.newest == 9
    step = run.step(policy, cache, T=1)     # a decode step: step.in_prompt is False, step.slack = N - 1
"""
import weakref
from dataclasses import dataclass

from kvmini.budget import layer_budgets
from kvmini.errors import KvminiError


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


@dataclass(frozen=True)
class Step:
    """One forward call of T = end - start tokens, as every hook of the method sees it."""

    start: int  # the call's first position
    end: int  # one past its last
    prompt_start: int  # where this prompt starts (0, or where a next prompt follows the run so far)
    prompt_end: int  # where it ends
    budgets: tuple[int, ...]  # tokens each layer may keep (this prompt's plan)
    mean_budget: int | None  # the mean b they were planned from (None: the method chooses, DBudgetKV)
    protected: tuple[int, ...]  # layers never compressed
    compresses: bool  # compressing can change what this run keeps (else the method only watches)
    keeps_sums: bool  # running statistics are kept in this call: whenever it compresses, and in a run that may go on
    slack: int  # entries a layer may hold beyond its budget: evict_every - 1 while decoding, else 0

    T = property(lambda self: self.end - self.start)  # tokens in the call
    newest = property(lambda self: self.end - 1)  # the call's last position
    first = property(lambda self: self.start == self.prompt_start)  # the call starts its prompt
    in_prompt = property(lambda self: self.end <= self.prompt_end)  # it ends within the prompt (not a decode step)
    completes = property(lambda self: self.end == self.prompt_end)  # it ends the prompt
    first_decode = property(lambda self: self.start == self.prompt_end)  # the first call after the prompt


class Run:
    """One run of a policy: its prompts, what has been fed, this prompt's budgets, and what the tools read
    after it (`evicted`, `merged` per layer; `note`, why a budget was raised)."""

    def __init__(self, method, prompt_len: int, total_len: int | None = None, model=None):
        self.name = method.name
        self.prompt_start, self.prompt_end = 0, prompt_length(self.name, "start", prompt_len)
        self.total_len = run_length(self.name, total_len, prompt_len)
        self.model = None if model is None else weakref.ref(model)  # weak: a `fork` copies the run, not the model
        self.fed, self.skipped = 0, False
        self.budgets = self.unchanged = self.mean_budget = self.note = None  # this prompt's plan: `plan`
        self.protected, self.compresses = (), False
        self.evicted: list[int] = []
        self.merged: list = []  # tokens merged per layer, tensors until read

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        """The run's next prompt_len tokens are a new prompt (docs/design.md, "A cache that lives on")."""
        prompt_length(self.name, "next_prompt", prompt_len)
        if self.fed < self.prompt_end:
            raise KvminiError(f"{self.name}: the prompt is not complete ({self.prompt_end - self.fed} of its tokens are still "
                              "to come); feed them before a next prompt")
        if self.skipped:
            raise KvminiError(f"{self.name}: this run was started to end at {self.total_len} tokens (total_len), so it kept "
                              "no attention statistics while its budget was not reached; to continue a run, start it "
                              "without total_len (generate(..., more_prompts=True))")
        end = self.fed + prompt_len
        self.prompt_start, self.prompt_end, self.total_len = self.fed, end, run_length(self.name, total_len, end)

    def step(self, method, cache, T: int) -> Step:
        """The Step of a call of T tokens on `cache`: refuse one the method would have to guess about; at a run's
        first call declare the method's `aux` buffers; at a prompt's first call plan its budgets."""
        start, end, L = cache.seen_tokens, cache.seen_tokens + T, len(cache)
        self.check_call(start, end)
        if start == 0:
            self.evicted, self.merged = [0] * L, [0.0] * L
            for layer in range(L):
                if layer not in method.protected_in(L):
                    cache[layer].declare(*method.aux)
        if start == self.prompt_start:
            self.plan(method, L)
        self.fed = end
        keeps_sums = self.compresses or self.total_len is None  # an idle run that may go on keeps its sums too
        self.skipped |= bool(method.aux) and not keeps_sums  # then a next prompt would lack them
        return Step(start=start, end=end, prompt_start=self.prompt_start, prompt_end=self.prompt_end,
                    budgets=tuple(self.budgets), mean_budget=self.mean_budget, protected=self.protected,
                    compresses=self.compresses, keeps_sums=keeps_sums,
                    slack=0 if end <= self.prompt_end else method.evict_every - 1)

    def check_call(self, start: int, end: int) -> None:
        if start != self.fed:
            raise KvminiError(f"{self.name}: this cache holds {start} tokens, but this run of the policy has fed {self.fed}; "
                              "a new cache needs policy.start(prompt_len), and one policy follows one cache")
        if start < self.prompt_end < end:
            raise KvminiError(f"{self.name}: a call of {end - start} tokens from position {start} crosses the prompt's end at "
                              f"{self.prompt_end}; feed the prompt's last {self.prompt_end - start} tokens in their own call")

    def plan(self, method, L: int) -> None:
        """This prompt's budgets, for every token the run has seen when it completes (a ratio is of those)."""
        n = self.prompt_end
        plan = layer_budgets(method, L, n, self.total_len)
        self.budgets, self.mean_budget, self.protected, self.compresses, self.note = plan
        self.unchanged = self.budgets if self.mean_budget is None and method.budget is not None else None


def begin(method, cache, T: int) -> Step | None:
    """The Step of a call of T tokens, from the method's run (kvmini.model's forward asks before layer 0);
    None for a recorder that compresses nothing and keeps no run (kvmini.eval.layers.ColumnSums)."""
    if not hasattr(method, "start"):
        return None
    if method.run is None:
        raise KvminiError(f"{method.name}: call policy.start(prompt_len) before the first call, so that the policy knows "
                          "where the prompt ends (kvmini.generate.prefill does it)")
    return method.run.step(method, cache, T)
