"""Named methods: each name maps to a module that declares its options (`Options`, a frozen dataclass
of plain fields, read by kvmini.methods.options) and builds the method from them (`build(budget, options)`).

Everything about an option (its flag, type, default, help, check, and its value in each variant)
is read from the module's declaration; nothing here or in run.py repeats it. A method with
variants names them as instances of its Options (`VARIANTS`, `DEFAULT_VARIANT`): given options
override their part of the chosen variant. `make_policy("h2o", 0.2, recent=16)` -> a fresh method;
`make_policy("full")` -> None. Adding a method: its module (its `build` names the class it returns,
`-> H2O`), one line in METHODS, and its tests.
"""
import dataclasses
import functools
import re
import typing
from typing import Literal

from kvmini.errors import KvminiError
from kvmini.methods import (adakv, cam, d2o, dbudgetkv, dynamickv, h2o, knorm, options, pyramidkv, roco,
                            scissorhands, snapkv, snapkv_d2o, streaming_llm, tova, vatp, weightedkv)
from kvmini.methods.options import Declared
from kvmini.budget import resolve_budget
from kvmini.methods.method import Method

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
    "vatp": vatp,
    "scissorhands": scissorhands,
    "cam": cam,
    "roco": roco,
    "adakv": adakv,
}
DEFAULT_BUDGET = 0.2  # used by run.py when --budget is not given


EVICT_EVERY = Declared(  # an option of the engine (Method.evict_every), for every method that evicts while decoding
    "evict_every", int, 1, "let each layer hold budget + N - 1 entries and evict N at once every N steps (1: every "
    "step, as the papers do)", lambda x: x >= 1, "be a whole number >= 1", {})


@functools.cache
def declarations(name: str) -> tuple[Declared, ...]:
    """Every option method `name` takes, in order: `variant` (if it has variants), its Options'
    fields, and evict_every (if it evicts while decoding)."""
    module = METHODS[name]
    if module is None:
        return ()
    variants = getattr(module, "VARIANTS", None)
    head = [Declared("variant", Literal[tuple(variants)], module.DEFAULT_VARIANT,
                     "paper (the equations) | official (the authors' code)", None, "", {})] if variants else []
    tail = [engine_option(name)] if evicts_while_decoding(name) else []
    return tuple(head + options.declared(module.Options, variants, getattr(module, "CHECKS", None)) + tail)


def engine_option(name: str) -> Declared:
    """evict_every as method `name` takes it: a method may give the engine's option its own default
    (`ENGINE_DEFAULTS = {"evict_every": m}` in its module, e.g. Scissorhands' drop amount)."""
    default = getattr(METHODS[name], "ENGINE_DEFAULTS", {}).get("evict_every", EVICT_EVERY.default)
    return EVICT_EVERY if default == EVICT_EVERY.default else dataclasses.replace(EVICT_EVERY, default=default)


def specs(while_decoding: bool = False) -> list[str]:
    """Every registered method as the evaluation tools run it: each with its defaults, then each of its
    other variants ("d2o[variant=paper]"); while_decoding: only those that evict while decoding."""
    out = []
    for name, module in METHODS.items():
        if module is None or (while_decoding and not evicts_while_decoding(name)):
            continue
        out += [name] + [f"{name}[variant={v}]" for v in getattr(module, "VARIANTS", {}) if v != module.DEFAULT_VARIANT]
    return out


def every_option() -> dict[str, tuple[Declared, list[str]]]:
    """Option name -> (its declaration, the methods that take it): run.py's flags. A name has one
    type and one help wherever it is declared (tests/test_options.py)."""
    out: dict[str, tuple[Declared, list[str]]] = {}
    for name in METHODS:
        for d in declarations(name):
            out.setdefault(d.name, (d, []))[1].append(name)
    return out


def parse_spec(spec: str) -> tuple[str, dict]:
    """A method with options, as the evaluation tools take it, read into typed values:
    "d2o[allocation=uniform,nm=1:1,protected_layers=0,1]" ->
    ("d2o", {"allocation": "uniform", "nm": (1, 1), "protected_layers": (0, 1)}).
    Options are separated by commas; a comma not followed by `name=` continues a list (a
    semicolon may separate a list's items too: protected_layers=0;1)."""
    name, bracket, rest = spec.partition("[")
    if name not in METHODS or name == "full":
        raise KvminiError(f"unknown method {name!r}; choose from {', '.join(list(METHODS)[1:])}")
    if bracket and (not rest.endswith("]") or "[" in rest or "]" in rest[:-1]):
        raise KvminiError(f"bad spec {spec!r}: write name[key=value,...], one pair of brackets closing at the end")
    known = {d.name: d for d in declarations(name)}
    given = {}
    for item in re.split(r",(?=\s*[A-Za-z_]\w*=)", rest.removesuffix("]")) if rest else []:
        key, eq, value = item.strip().partition("=")
        if not eq or key not in known:
            accepted = ", ".join(known) or "none"
            raise KvminiError(f"bad option {item!r} in {spec!r} (write name[key=value,...]; {name}'s options: "
                              f"{accepted})")
        if key in given:
            raise KvminiError(f"{key} is given twice in {spec!r}")
        try:
            given[key] = options.read(known[key].kind, value)
        except ValueError as e:
            raise KvminiError(f"bad value {value!r} for {key} in {spec!r}: it must {e}") from None
    try:
        given = check(name, given)
        refuse_idle(name, given)
        return name, given
    except KvminiError as e:  # a value of the right type that the method refuses: say which spec
        raise KvminiError(f"{spec}: {e}") from None


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
    """Option name -> default for one method (the default variant's values; evict_every excluded)."""
    return {d.name: d.default for d in declarations(name) if d.name != EVICT_EVERY.name}


def resolved_options(name: str, given: dict) -> dict[str, object]:
    """Every option of a method as it will run: the given ones, else the chosen variant's, else the
    declared default (what run.py's report shows)."""
    module, o = METHODS[name], chosen(name, given)
    head = {"variant": given.get("variant", module.DEFAULT_VARIANT)} if hasattr(module, "VARIANTS") else {}
    return head | {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}


def as_run(spec: str) -> tuple:
    """A spec by value: every option as it will run, the defaults too, so `adakv` and
    `adakv[alpha=0.2]` (its default) give one key and a tool can refuse one method named twice."""
    if spec == "full":
        return ("full",)
    name, given = parse_spec(spec)
    return name, repr(sorted(resolved_options(name, given).items())), given.get("evict_every", engine_option(name).default)


def chosen(name: str, given: dict):
    """The method's Options: the chosen variant (or the declared defaults) with the given options."""
    module = METHODS[name]
    variants = getattr(module, "VARIANTS", {})
    base = variants[given.get("variant", module.DEFAULT_VARIANT)] if variants else module.Options()
    return dataclasses.replace(base, **{k: v for k, v in given.items() if k not in ("variant", "evict_every")})


def schedule(name: str) -> str:
    """When method `name` compresses (kvmini.budget), with its default options: the `schedule` its class
    declares, the class its `build` returns, read without building one (D2O's paper variant sets another on
    its policy, "after_prompt", also while decoding)."""
    return typing.get_type_hints(METHODS[name].build)["return"].schedule


def compress_every_call() -> list[str]:
    """Methods that compress after every forward call by design, so a prefill's chunk size changes
    what they keep; every other method keeps, from a prompt in chunks, what one call keeps."""
    return [name for name, module in METHODS.items() if module is not None and schedule(name) == "every_call"]


def chooses_budget(name: str) -> bool:
    """Methods like DBudgetKV pick each layer's budget themselves and take no --budget."""
    return getattr(METHODS[name], "CHOOSES_BUDGET", False)


def evicts_while_decoding(name: str) -> bool:
    """Does the method evict during decoding (the engine option evict_every applies), or only the prompt?"""
    return METHODS[name] is not None and schedule(name) != "prefill"


def check(name: str, given: dict) -> dict:
    """The options as typed values, each checked against method `name`'s declaration; text (as on
    the command line) is read with the option's reader. KvminiError names the flag and what it must be."""
    known = {d.name: d for d in declarations(name)}
    typed = {}
    for key, value in given.items():
        flag = "--" + key.replace("_", "-")
        if key not in known:
            accepted = ", ".join("--" + k.replace("_", "-") for k in known) or "none"
            raise KvminiError(f"{flag} does not apply to method {name} (its options: {accepted})")
        d = known[key]
        if isinstance(value, str) and not options.is_choice(d.kind):
            try:
                value = options.read(d.kind, value)
            except ValueError as e:
                raise KvminiError(f"{flag} must {e}, got {value!r}") from None
        if not options.fits(d.kind, value):
            if options.is_choice(d.kind):
                raise KvminiError(f"{flag} must {options.choices(d.kind)}, got {value}")
            raise KvminiError(f"{flag} must be a {options.kind_name(d.kind)}, got {value!r}")
        if d.check is not None and not isinstance(value, options.Rule) and not d.check(value):
            raise KvminiError(f"{flag} must {d.must}, got {options.show(value, d.kind)}")
        typed[key] = value
    return typed


def refuse_idle(name: str, given: dict) -> None:
    """An option the other settings make do nothing (d2o's beta with merge=off) is refused, never ignored."""
    idle = getattr(METHODS[name], "idle", lambda o: {})(chosen(name, given))
    for key in given:
        if key in idle:
            raise KvminiError(f"--{key.replace('_', '-')} does nothing with {idle[key]}; leave it out")


NO_LIMIT = 2**30  # tokens per layer: a budget no prompt reaches (asks a compressor whether any budget works)


def some_budget_works(policy: Method) -> None:
    """Refuse options with which no budget can work (e.g. d2o nm=0:1 with sinks)."""
    if (never := policy.problem(NO_LIMIT)) is not None:
        raise KvminiError(f"{policy.name}: no budget can work with these options: even a budget of {NO_LIMIT:,} "
                          f"tokens is {never}; use fewer sinks or a smaller window")


def make_policy(name: str, budget: float | None = None, **given) -> Method | None:
    """A fresh policy for method `name`; clear errors for unknown names, options and values.
    Option values are typed (int, float, bool, a tuple for layers or N:M) or text as on the command
    line ("0,1,-1", "3:1", "true"). One policy runs a batch (each sequence's budgets its own where they follow
    its statistics: `row_budgets`). `evict_every=N` is an option of the engine
    (`evict_every` of the method) that every method evicting while decoding takes."""
    if not isinstance(name, str) or name not in METHODS:
        raise KvminiError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    given = check(name, given)
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
    every = given.get("evict_every", engine_option(name).default if evicts_while_decoding(name) else 1)
    o = chosen(name, given)
    refuse_idle(name, given)

    policy = METHODS[name].build(budget, o)
    if budget is not None:
        some_budget_works(policy)
    policy.evict_every = every
    return policy
