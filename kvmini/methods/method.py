"""What every method shares: its name, budget and settings, and the hook contract. A method is a subclass
whose hooks the model's forward pass calls, each handed the call's `step` (kvmini.engine.Step: where the
prompt ends, the budgets in tokens per layer, whether compressing can change anything; docs/design.md,
"The method form"):

    before(cache, step) -> wants           before layer 0: the statistics each layer's attention computes (None: none)
    after_attention(layer, cache, stats, step)   after a layer's attention; `stats` holds what `wants` named
    after_layers(cache, step)              after the last layer

The run itself (its prompts, what has been fed, its budgets) is the engine's (kvmini.engine.Run, made by
`start`); a method keeps only its algorithm's own state. A method that reads the model's weights (each
head's W_o, say) finds the model of the run in `model`.
"""
from kvmini.budget import chunk_size
from kvmini.engine import Run
from kvmini.errors import KvminiError, tokens
from kvmini.model import Transformer


class Method:
    """One method: its settings and its hooks. A subclass sets `sinks`, `recent` (a function of the budget),
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

    run = None  # the engine's record of the current run (kvmini.engine.Run), made by `start`

    def __init__(self, name: str, budget: float | None):
        self.name, self.budget = name, budget
        self.evict_every = 1  # N: while decoding, a layer holds up to budget + N - 1 and evicts N at once

    def recent(self, b: int) -> int:
        """The recent window a layer of budget b always keeps."""
        return 0

    # --- a run: what the engine keeps (kvmini.engine) -----------------------------------------------

    def start(self, prompt_len: int, total_len: int | None = None, model=None) -> None:
        """A new run whose first prompt has prompt_len tokens; total_len (if given) promises it ends there;
        model: the Transformer it runs in (kvmini.generate.prefill passes it)."""
        if model is not None and not isinstance(model, Transformer):
            raise KvminiError(f"{self.name}: start takes the run's model, a kvmini Transformer, got {type(model).__name__}")
        self.run = Run(self, prompt_len, total_len, model)

    def next_prompt(self, prompt_len: int, total_len: int | None = None) -> None:
        """The run's next prompt_len tokens are a new prompt (docs/design.md, "A cache that lives on")."""
        if self.run is None:
            raise KvminiError(f"{self.name}: next_prompt continues a run; call policy.start(prompt_len) for the first prompt")
        self.run.next_prompt(prompt_len, total_len)

    def chunk_for(self, prompt_len: int, total_len: int | None) -> int | None:
        """The prefill chunk size this method asks for, or None (one call, also when its budget is a no-op)."""
        return chunk_size(self.budget, self.prefill_chunk, self.schedule, prompt_len, total_len)

    @property
    def model(self):
        """The model of this run (None when `start` was not given one)."""
        return None if self.run is None or self.run.model is None else self.run.model()

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
        return None if self.run is None or self.run.budgets is None else list(self.run.budgets)

    # --- what the tools read (the report, the kept-token page) -------------------------------------

    merger = None  # what records the method's merges in its `trace` list (kvmini.view), if it merges

    @property
    def evicted(self) -> list[int]:
        """Tokens evicted per layer in this run (a method adds its evictions in place)."""
        return self.run.evicted

    @property
    def merged(self) -> list[float]:
        """Tokens merged per layer (mean over heads, sum over sequences), tensors until read: no step waits to count."""
        return [float(m) for m in self.run.merged]

    def describe(self, lc) -> tuple:
        """What the method's score is and its values for lc's entries (B, H_kv, S), or (why none, None)."""
        return f"not kept in the cache ({self.name} scores the tokens from one call's attention, then discards them)", None

    def holds_more_because(self) -> str:
        """Why a layer may hold more than the budget asks (D2O's protected layers), or ""."""
        return ""

    # --- the hooks a subclass fills in --------------------------------------------------------------

    def before(self, cache, step) -> dict | None:
        """Before layer 0 of a call: the statistics each layer's attention computes for the method (None: none)."""
        return None

    def after_attention(self, layer: int, cache, stats, step) -> None:
        """After layer `layer`'s attention: nothing, unless the method says otherwise."""

    def after_layers(self, cache, step) -> None:
        """After the last layer: nothing, unless the method says otherwise."""
