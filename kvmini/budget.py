"""Budgets: what a `--budget` means in tokens, a prompt's budgets per layer, and whether a method can work with them
(docs/design.md, "Budgets"). Pure functions, asked by the engine (kvmini.engine) once per prompt.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass

from kvmini.errors import KvminiError, tokens

ADVICE = "; raise --budget, or use fewer sinks or a smaller window"


def resolve_budget(budget: float, prompt_len: int) -> int:
    """A budget in tokens per layer: a float up to 1.0 is a ratio of the prompt length, an int (or a
    whole float above 1) is tokens. 0.25 of 400 -> 100;  1.0 -> 400;  1 -> 1 token;  128 -> 128."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise KvminiError(f"--budget must be a finite number > 0 (a ratio in (0, 1] or tokens per layer), got {budget}")
    if isinstance(budget, int):
        return budget
    if budget <= 1:
        return max(1, round(budget * prompt_len))
    if budget != int(budget):
        raise KvminiError(f"--budget above 1 counts tokens per layer and must be a whole number, got {budget}")
    return int(budget)


def is_noop(b: int, prompt_len: int, total_len: int | None, schedule: str) -> bool:
    """A budget >= the longest the cache gets under this schedule (unknown total: never) changes nothing,
    even where a per-layer plan gives some layer less (as PyramidKV's code does): exactly `full`."""
    longest = prompt_len if schedule == "prefill" else total_len
    return longest is not None and b >= longest


def chunk_size(budget: float | None, prefill_chunk, schedule: str, prompt_len: int, total_len: int | None) -> int | None:
    """The prefill chunk size a method asks for, or None (one call, also when its budget is a no-op)."""
    b = None if budget is None else resolve_budget(budget, prompt_len)
    if prefill_chunk is None or (b is not None and is_noop(b, prompt_len, total_len, schedule)):
        return None
    return prefill_chunk(b) if callable(prefill_chunk) else prefill_chunk


def problems(method, budgets: dict[int, int], protected: tuple) -> list[tuple[int, int, str]]:
    """(layer, budget, why) for the budgets the method cannot work with (protected layers never compress)."""
    return [(layer, b, why) for layer, b in budgets.items()
            if layer not in protected and (why := method.problem(b)) is not None]


def check(name: str, method, budgets: dict[int, int], protected: tuple, advice: str = ADVICE,
          mean: int | None = None) -> None:
    """Refuse the first budget the method cannot work with."""
    if found := problems(method, budgets, protected):
        layer, b, why = found[0]
        source = f", from a mean budget of {tokens(mean)}" if mean not in (None, b) else ""
        raise KvminiError(f"{name}: a budget of {tokens(b)} (layer {layer}{source}) is {why}{advice}")


def layer_budgets(method, L: int, n: int, total_len: int | None) -> tuple:
    """A prompt's budgets, in one place: (budgets per layer, the mean budget b, the protected layers, whether
    compressing can change anything, a note for the report), for an n-token prompt (every token the run has
    seen when it completes; a ratio is of those), L layers and the method's sinks, window, protected layers
    and layer plan (`method.plan`). A ratio too small for what the method always keeps is raised to the least
    mean budget that works; a budget no layer can work with is refused, once, here."""
    name, budget, protected = method.name, method.budget, method.protected_in(L)
    if any(not -L <= layer < L for layer in method.protected_spec):
        raise KvminiError(f"{name}: protected layers {list(method.protected_spec)} do not all exist; "
                          f"this model has layers 0 to {L - 1}")
    if budget is None:  # the method chooses every layer's budget (DBudgetKV)
        return method.plan(None, L, n), None, protected, True, None
    b, note = resolve_budget(budget, n), None
    fits = _fits(method, b, L, n)
    fit = None if fits else next((x for x in range(b + 1, n + 1) if _fits(method, x, L, n)), None)
    if isinstance(budget, float) and budget <= 1 and not fits:  # a ratio (resolve_budget)
        if fit is None:  # a prompt no longer than what the method always keeps: compressed nowhere
            return [n] * L, None, (), False, f"not compressed: the {n}-token prompt is no longer than what {name} always keeps"
        note, b = f"budget raised from {b} to {fit} tokens per layer, the least {name} can keep", fit
    least = (f"the least budget that works on this {n}-token prompt is {fit} tokens per layer" if fit else
             f"no budget up to the prompt's {n} tokens works: use fewer sinks or a smaller window")
    budgets = method.plan(b, L, n)
    check(name, method, dict(enumerate(budgets)), protected, f"; {least}", mean=b)
    return budgets, b, protected, not is_noop(b, n, total_len, method.schedule), note


def _fits(method, b: int, L: int, n: int) -> bool:
    """Can the method work with a mean budget of b tokens per layer? (Asks its pure `plan`.)"""
    try:
        budgets = method.plan(b, L, n)
    except KvminiError:
        return False
    return not problems(method, dict(enumerate(budgets)), method.protected_in(L))


@dataclass(frozen=True, repr=False)
class Rule:
    """A count that follows a layer's budget b, named so that it prints itself:
    Rule("budget // 2", lambda b: b // 2)(10) == 5; str(...) == "budget // 2"."""

    text: str
    of: Callable[[int], int]

    def __call__(self, b: int) -> int:
        return self.of(b)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Rule({self.text!r})"

    @staticmethod
    def of_(value: "int | Rule", what: str) -> "Rule":
        """An int or a Rule as a Rule; anything else (an unnamed function) is refused."""
        if isinstance(value, Rule):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return Rule(str(value), lambda b: value)  # the same count for every budget
        raise KvminiError(f"{what} must be a whole number or a Rule (a named function of the budget), got {value!r}")
