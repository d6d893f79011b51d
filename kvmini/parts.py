"""The four parts a compression method is made of, one signature each (docs/design.md, "The four parts").

    scorer      score = scorer(lc, stats)                             how important is each cached token?
    budgeter    {layer: budget} = budgeter.decide(layer, lc, stats, score)    how many may each layer keep, when?
    compressor  compressor(layers, lc, score, budget, newest)             shrink one layer to its budget
    schedule    PREFILL | AFTER_PROMPT | DECODE | EVERY_CALL              when the three above run

A method is one of each, e.g. H2O = CumulativeAttention() + Budgeter() + TopK(recent=HALF) on
EVERY_CALL; kvmini.policy.Policy runs them. The base classes hold the shared defaults. lc is a
LayerCache, stats a kvmini.statistics.Stats (e.g. stats.column_sums (B, H_kv, S)), scores (B, H_kv, S).
"""
import torch

from kvmini.statistics import Request, Stats
from kvmini.budget import PREFILL, Rule  # noqa: F401  (PREFILL: the first of the schedules)
from kvmini.errors import tokens

AFTER_PROMPT = "after_prompt"  # in the call that completes the prompt, then after every later call
EVERY_CALL = "every_call"  # after every forward call (each prefill chunk, each decode step)
DECODE = "decode"  # after every call past the prompt: the first compression at the first decode step


class Scorer:
    """How important is each cached token, per KV head: `__call__(lc, stats) -> (B, H_kv, S)`."""

    request: Request | None = None  # the attention statistics it reads (None: the fast SDPA path)
    accumulates = False  # True: `update` keeps running sums in lc.aux, so it needs every call's statistics
    aux: tuple = ()  # the per-entry buffers it keeps in the cache: names (float) or (name, dtype); the policy declares them

    def update(self, lc, stats: Stats, start: int, T: int) -> None:
        """After a call of T queries at positions start..start+T-1 (accumulating scorers only)."""

    def __call__(self, lc, stats: Stats) -> torch.Tensor:
        raise NotImplementedError


class Budgeter:
    """How many tokens may each layer keep, and when is that known? `start` gives the mean budget b
    (None: the budgeter chooses); `known(layer)` a budget known before this call's statistics, else None;
    `decide` answers {layer: budget} for the layers to compress now (earlier ones too, or none yet)."""

    request: Request | None = None  # statistics `decide` measures (asked for when known() is None)
    accumulates = False  # True: `update` also sees them in every call of the prompt (measured before compressing)
    per_sequence = False  # budgets follow each sequence's statistics: a batch runs one budgeter per sequence
    revisits = False  # `decide` may re-budget layers compressed earlier in the same call

    def __init__(self, protected: tuple = ()):
        self.protected_spec = tuple(protected)  # layers never compressed; -1 is the last
        self.protected = self.protected_spec

    def start(self, b: int | None, L: int, n: int) -> None:
        """A fresh run: L layers, a prompt of n tokens, b tokens per layer on average (or None)."""
        self.b, self.L, self.n = b, L, n
        self.protected = self.protected_in(L)
        self.budgets = self.plan(b, L, n)

    def protected_in(self, L: int) -> tuple[int, ...]:
        """The protected layers of an L-layer model (-1: the last): the one place a protected layer is named."""
        return tuple(p + L if p < 0 else p for p in self.protected_spec)

    def plan(self, b: int | None, L: int, n: int) -> list[int]:
        """The per-layer budgets known before any statistics, for a mean budget b, L layers and a prompt
        of n tokens: uniform by default; a protected layer keeps the whole prompt. A pure function of
        its arguments (and the budgeter's settings), so the engine can ask it without starting a run."""
        protected = self.protected_in(L)
        return [n if layer in protected else b for layer in range(L)]

    def update(self, layer: int, lc, stats: Stats, start: int, T: int) -> None:
        """After a prompt call of T queries at positions start..start+T-1 (accumulating budgeters only)."""

    def skips(self, layer: int) -> bool:
        return layer in self.protected

    def known(self, layer: int) -> int | None:
        return self.budgets[layer]

    def decide(self, layer: int, lc, stats: Stats, score: torch.Tensor) -> dict[int, int]:
        return {layer: self.budgets[layer]}


class Compressor:
    """Shrinks one layer to its budget: `__call__(layers, lc, score, b, newest)`. The first `sinks` tokens
    and the last `recent(b)` (by position: after newest - recent(b), newest the position of the call's
    newest token) are always kept. Returns the kept indices (B, H_kv, b) in their new buffer order, or
    None when entries were merged rather than selected (`merged[layer]` counts the tokens merged).

    `layers` is `(layer,)`, the layer `lc` is."""

    def __init__(self, sinks: int = 0, recent: int | Rule = 0):
        self.sinks, self.recent = sinks, Rule.of_(recent, "recent")

    def start(self, L: int) -> None:
        self.merged = torch.zeros(L, dtype=torch.float64)  # per layer, mean over KV heads

    def count(self, layers: tuple, per_row: torch.Tensor) -> None:
        """Add merges counted per row of `lc` (len(layers) * B,) to each of `layers`' (distinct) counts."""
        self.merged = self.merged.to(per_row.device)
        self.merged[list(layers)] += per_row.view(len(layers), -1).sum(1).to(self.merged.dtype)

    def problem(self, b: int) -> str | None:
        """Why a layer budget of b tokens cannot work, or None."""
        recent = self.recent(b)
        if b <= self.sinks or recent < 0 or self.sinks + recent > b:
            return f"too small for {self.sinks} sinks and a window of {tokens(max(recent, 0))}"
        return None

    def __call__(self, layers: tuple, lc, score: torch.Tensor, b, newest: int) -> torch.Tensor | None:
        raise NotImplementedError
