"""What a generic test needs of a method to run it on the tiny random models (tests/reference.py), derived
from the registry and the method itself, so that adding a method to METHODS is the only line a
generic test needs:

    fitted(name)                   its options for prompts of a few dozen tokens: a declared `window` or
                                   `recent` longer than WINDOW tokens is cut to WINDOW (SnapKV's 32 would
                                   otherwise be the whole prompt)
    budget_for(name, b, L, n)      b, or the least mean budget it can work with if that is more
    statistics(name, options)      the attention statistics it reads in a prompt's call
    gives_budgets(name)            its budgets are the numbers it was given (not chosen, none protected)
    statistic_cases(names)         each method in each variant, and with each option value that makes it
                                   read other statistics
"""
import typing

import torch

from kvmini.errors import KvminiError
from kvmini.generate import prefill
from kvmini.methods import options as declared
from kvmini.methods.registry import METHODS, chooses_budget, declarations, make_policy, parse_spec, specs

WINDOW = 3  # tokens: the tiny prompts' observation window and recent window


def fitted(name: str) -> dict:
    """Method `name`'s options for the tiny prompts: each whole-number `window` or `recent` it declares,
    longer than WINDOW, cut to WINDOW; every other option as declared. {"window": 3} for SnapKV."""
    return {d.name: WINDOW for d in declarations(name) if d.name in ("window", "recent")
            and isinstance(d.default, int) and d.default > WINDOW}


def parts(name: str, options: dict):
    """The method with these options, the one a batch row runs."""
    return make_policy(name, **options) if chooses_budget(name) else make_policy(name, 0.5, **options)


def least_budget(name: str, options: dict, L: int, n: int) -> int | None:
    """The least mean budget (tokens per layer) method `name` can work with on an L-layer model and an
    n-token prompt: its plan gives every layer it compresses a budget it accepts (kvmini.methods.method,
    "budget raised ... the least ... can keep"). None: it chooses its budgets, or none works."""
    if chooses_budget(name):
        return None
    policy = parts(name, options)
    protected = policy.protected_in(L)
    for b in range(1, n + 1):
        try:
            budgets = policy.plan(b, L, n)
        except KvminiError:  # a plan that cannot work (DynamicKV: a mean budget within its window)
            continue
        if all(policy.problem(x) is None for layer, x in enumerate(budgets) if layer not in protected):
            return b
    return None


def budget_for(name: str, budget: int, L: int = 3, n: int = 40) -> int | None:
    """`budget` tokens per layer, raised to the least method `name` (with `fitted` options) can keep on an
    L-layer model and an n-token prompt; None for a method that chooses its budgets."""
    if chooses_budget(name):
        return None
    return max(budget, least_budget(name, fitted(name), L, n) or budget)


def statistics(name: str, options: dict) -> frozenset:
    """The attention statistics (name, queries, head reduction, function) the method reads in a prompt's
    call: what it asks for (`wants`) in each call of a 40-token prompt on a tiny random model."""
    from reference import random_model

    policy, asks = parts(name, options), []
    before = policy.before
    policy.before = lambda cache, step: asks.append(before(cache, step)) or asks[-1]
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefill(random_model(L=3), ids, random_model(L=3).new_cache(1), policy)
    return frozenset((name, s.last, s.reduce, getattr(s.f, "__qualname__", None))
                     for wanted in asks if wanted for name, s in wanted.items())


def gives_budgets(name: str) -> bool:
    """Are method `name`'s per-layer budgets the numbers it was given: it does not choose them (DBudgetKV)
    and protects no layer (D2O's official variant: its protected layers keep every token and grow)?"""
    if METHODS[name] is None or chooses_budget(name):
        return False
    return not parts(name, fitted(name)).protected_spec


def statistic_cases(names) -> list[tuple[str, dict]]:
    """(method, options) for each of `names`: each variant (registry.specs), then each value of each of its
    choice options (given to each variant) that makes the method read statistics no case before read, e.g.
    SnapKV's reduce=max. Options from `fitted`."""
    out = []
    for spec in specs():
        name, given = parse_spec(spec)
        if name not in names:
            continue
        seen = {statistics(n, o) for n, o in out if n == name}
        variant = fitted(name) | given
        out.append((name, variant))
        seen.add(statistics(name, variant))
        for d in declarations(name):
            for value in typing.get_args(d.kind) if declared.is_choice(d.kind) and d.name != "variant" else ():
                try:
                    read = statistics(name, variant | {d.name: value})
                except KvminiError:  # a value these settings refuse
                    continue
                if read not in seen:
                    seen.add(read)
                    out.append((name, variant | {d.name: value}))
    return out


def budget_of(policy, layer: int, b: int) -> int:
    """Layer `layer`'s budget for sequence b: its own where each sequence's budgets follow its statistics."""
    rows = getattr(policy, "row_budgets", None)
    return policy.budgets[layer] if rows is None else rows[layer][b]
