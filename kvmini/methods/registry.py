"""Named methods: each name maps to a module whose `build(budget, **options)` composes a Policy.

Every option is a keyword of that `build` function; its default is the method's default. Each
option name has one meaning (OPTIONS), from which run.py's flags and checks are derived.
`make_policy("h2o", 0.2, recent=16)` -> a fresh Policy; `make_policy("full")` -> None.
"""
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvmini.errors import KvminiError
from kvmini.methods import (d2o, dbudgetkv, dynamickv, h2o, knorm, pyramidkv, snapkv, snapkv_d2o, streaming_llm, tova,
                            weightedkv)
from kvmini.parts import EVERY_CALL, PREFILL
from kvmini.policy import PerSequence, Policy, resolve_budget

METHODS = {
    "full": None,  # no compression
    "streaming_llm": streaming_llm,
    "h2o": h2o,
    "tova": tova,
    "snapkv": snapkv,
    "pyramidkv": pyramidkv,
    "weightedkv": weightedkv,
    "dbudgetkv": dbudgetkv,
    "d2o": d2o,
    "dynamickv": dynamickv,
    "knorm": knorm,
    "snapkv_d2o": snapkv_d2o,
}
DEFAULT_BUDGET = 0.2  # used by run.py when --budget is not given


@dataclass(frozen=True)
class Option:
    type: type
    help: str
    check: Callable[[object], bool]
    must: str  # what `check` demands, for the error message


def one_of(*values: str) -> tuple[Callable[[object], bool], str]:
    return (lambda x: x in values), "be " + ", ".join(values[:-1]) + " or " + values[-1]


OPTIONS = {
    "variant": Option(str, "D2O/DBudgetKV/DynamicKV: paper (the equations) | official (the authors' code)",
                      *one_of("paper", "official")),
    "sinks": Option(int, "first tokens always kept", lambda x: x >= 0, "be >= 0"),
    "recent": Option(int, "most recent tokens always kept", lambda x: x >= 0, "be >= 0"),
    "window": Option(int, "observation window: the last prompt tokens whose attention scores the others; "
                          "always kept", lambda x: x >= 1, "be >= 1 (the queries that score the prompt)"),
    "kernel": Option(int, "pooling kernel along the keys", lambda x: x >= 1 and x % 2 == 1, "be odd and >= 1"),
    "pooling": Option(str, "avg | max", *one_of("avg", "max")),
    "reduce": Option(str, "combine the query heads of a KV head: mean | max | sum", *one_of("mean", "max", "sum")),
    "pyramid_beta": Option(float, "PyramidKV: top-layer share 1/beta of the bottom's extra budget",
                           lambda x: x >= 1, "be >= 1"),
    "threshold": Option(float, "DBudgetKV: allowed relative drop of the attention norm", lambda x: 0 <= x < 1,
                        "be in [0, 1)"),
    "k": Option(int, "DBudgetKV: last prompt rows averaged into the attention row (Eq. 1)", lambda x: x >= 1,
                "be >= 1"),
    "ranking": Option(str, "DBudgetKV: position | cumulative (column sums) | window_attention (authors' code)",
                      *one_of("position", "cumulative", "window_attention")),
    "norm_excludes_kept": Option(bool, "DBudgetKV: zero the always-kept tokens out of the norm (authors' code)",
                                 lambda x: True, "be true or false"),
    "protected_layers": Option(str, "comma-separated layers never compressed, -1 the last, e.g. 0,1 (empty: none)",
                               lambda x: all(re.fullmatch(r"-?[0-9]+", p.strip()) for p in x.split(",") if p.strip()),
                               "be comma-separated layer numbers"),
    "beta": Option(float, "D2O: EMA weight of the newest similarity in the merge threshold (Eq. 10)",
                   lambda x: 0 <= x <= 1, "be in [0, 1]"),
    "nm": Option(str, "D2O: heavy:recent split, e.g. 3:1",
                 lambda x: len(x.split(":")) == 2 and all(p.isdigit() and int(p) >= 0 for p in x.split(":"))
                 and sum(int(p) for p in x.split(":")) > 0, "look like N:M, e.g. 3:1"),
    "split": Option(str, "D2O: paper (sinks + N + M = budget) | official (sinks inside the N heavy)",
                    *one_of("paper", "official")),
    "allocation": Option(str, "D2O: official | paper | zscore | reciprocal | uniform (Table 4)",
                         *one_of("official", "paper", "zscore", "reciprocal", "uniform")),
    "merge": Option(str, "D2O: paper (convex, Eq. 11-12) | official (raw-cosine scatter-mean) | off",
                    *one_of("paper", "official", "off")),
    "tau": Option(str, "D2O: merge threshold per_head | per_layer", *one_of("per_head", "per_layer")),
    "start": Option(str, "D2O: compress when the prompt ends (prompt) or at the first decode step (first_decode)",
                    *one_of("prompt", "first_decode")),
    "r_max": Option(float, "DynamicKV: a layer keeps at most r_max times the mean budget before re-balancing",
                    lambda x: x >= 1, "be >= 1"),
    "interval": Option(int, "DynamicKV: re-balance the finished layers every this many layers", lambda x: x >= 1,
                       "be >= 1"),
    "tail_reallocation": Option(bool, "DynamicKV: re-balance after the last layer too when L is not a "
                                      "multiple of m (kvmini's option; Alg. 1 and the authors' code do not)", lambda x: True, "be true or false"),
    "rounding": Option(str, "DynamicKV: exact (kvmini: largest remainder, capped at what a layer holds) | floor "
                            "(the authors' int() floors, remainder to the last layer)", *one_of("exact", "floor")),
    "chunk_merge": Option(str, "WeightedKV: a prefill chunk's merges all at once (runs) or one by one in Alg. 1's "
                               "order (sequential)", *one_of("runs", "sequential")),
    "clamp_budgets": Option(bool, "D2O: clamp each layer's budget to [sinks + 4, n] and give the excess to the "
                                  "others (kvmini's; false: Eq. 5 as written)", lambda x: True, "be true or false"),
    "evict_every": Option(int, "methods that evict while decoding: let each layer hold budget + N - 1 entries "
                               "and evict N at once every N steps (1: every step, as the papers do)",
                          lambda x: x >= 1, "be a whole number >= 1"),
    "softmax_temperature": Option(float, "D2O: temperature of the softmax over standardized variances (zscore)",
                                  lambda x: x > 0, "be > 0"),
}


def parse_value(name: str, text: str):
    """An option value written as text (a fidelity spec such as d2o[merge=off,beta=0.5])."""
    kind = OPTIONS[name].type
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    return kind(text)


def parse_spec(spec: str) -> tuple[str, dict]:
    """A method with options, as the evaluation tools take it:
    "d2o[allocation=uniform,nm=1:1]" -> ("d2o", {"allocation": "uniform", "nm": "1:1"})."""
    name, _, rest = spec.partition("[")
    if name not in METHODS or name == "full":
        raise KvminiError(f"unknown method {name!r}; choose from {', '.join(list(METHODS)[1:])}")
    options = {}
    for item in filter(None, rest.rstrip("]").split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS:
            raise KvminiError(f"bad option {item!r} in {spec!r} (write name[key=value,...])")
        try:
            options[key] = parse_value(key, value)
        except ValueError:
            raise KvminiError(f"bad value {value!r} for {key} in {spec!r}") from None
    return name, options


def policy_for(spec: str, budget: float | None):
    """A fresh policy for a spec ("full" -> None); self-budgeted methods ignore `budget`."""
    if spec == "full":
        return None
    name, options = parse_spec(spec)
    return make_policy(name, None if chooses_budget(name) else budget, **options)


def summary(name: str) -> str:
    """First line of the method module's docstring."""
    module = METHODS[name]
    return "no compression: every token is kept" if module is None else module.__doc__.strip().splitlines()[0]


def method_options(name: str) -> dict[str, object]:
    """Option name -> default for one method (read from its build() signature)."""
    module = METHODS[name]
    if module is None:
        return {}
    params = list(inspect.signature(module.build).parameters.values())[1:]  # after `budget`
    shown = getattr(module, "DEFAULTS_SHOWN", {})  # how a None default reads, e.g. "budget // 2"
    return {p.name: shown.get(p.name, p.default) for p in params}


def resolved_options(name: str, given: dict) -> dict[str, object]:
    """Every option of a method as it will run: the given ones, else the chosen variant's, else the default."""
    module = METHODS[name]
    options = {**method_options(name), **given}
    variant = getattr(module, "VARIANTS", {}).get(options.get("variant"), {})
    return {k: given.get(k, variant.get(k, v)) for k, v in options.items()}


def compress_every_call() -> list[str]:
    """Methods that compress after every forward call by design, so a prefill's chunk size changes
    what they keep; every other method keeps, from a prompt in chunks, what one call keeps."""
    return [name for name, module in METHODS.items()
            if module is not None and module.build(0.5).schedule == EVERY_CALL]


def chooses_budget(name: str) -> bool:
    """Methods like DBudgetKV pick each layer's budget themselves and take no --budget."""
    return getattr(METHODS[name], "CHOOSES_BUDGET", False)


def evicts_while_decoding(name: str) -> bool:
    """Does the method evict during decoding (the engine option evict_every applies), or only the prompt?"""
    return METHODS[name] is not None and METHODS[name].build(0.5).schedule != PREFILL


def make_policy(name: str, budget: float | None = None, **options) -> Policy | PerSequence | None:
    """A fresh policy for method `name`; clear errors for unknown names, options and values.
    Methods whose budgets follow each sequence's statistics come wrapped in PerSequence (batches).
    `evict_every=N` is an option of the engine (Policy.evict_every) that every method evicting while
    decoding takes."""
    if not isinstance(name, str) or name not in METHODS:
        raise KvminiError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    allowed = method_options(name) | ({"evict_every": 1} if evicts_while_decoding(name) else {})
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if key not in allowed:
            accepted = ", ".join("--" + k.replace("_", "-") for k in allowed) or "none"
            raise KvminiError(f"{flag} does not apply to method {name} (its options: {accepted})")
        kind = OPTIONS[key].type
        if (isinstance(value, bool) and kind is not bool) or not isinstance(
                value, (int, float) if kind is float else kind) or (kind is float and not math.isfinite(value)):
            raise KvminiError(f"{flag} must be a {'finite number' if kind is float else kind.__name__}, got {value!r}")
        if kind is str and not value.isascii() or not OPTIONS[key].check(value):
            raise KvminiError(f"{flag} must {OPTIONS[key].must}, got {value}")
    if budget is not None:
        resolve_budget(budget, 1)  # rejects budgets that mean nothing before any model is loaded
    if METHODS[name] is None:
        if budget is not None:
            raise KvminiError("--budget does not apply to method full (it keeps every token)")
        return None
    if chooses_budget(name):
        if budget is not None:
            raise KvminiError(f"--budget does not apply to method {name}: it chooses each layer's budget itself")
    else:
        budget = DEFAULT_BUDGET if budget is None else budget
    every = options.pop("evict_every", 1)

    def build() -> Policy:
        policy = METHODS[name].build(budget, **options)
        policy.evict_every = every
        return policy

    policy = build()
    return PerSequence(build, policy) if policy.budgeter.per_sequence else policy
