"""Reading, checking and printing the options a method declares. A method's `Options` is a plain
frozen dataclass beside its `build`: each field a type, a default, and its help in the comment beside
it (or the comment lines just above it). run.py's flags, --help and report, the registry's checks and
the evaluation tools' specs ("d2o[nm=3:1,protected_layers=0,1]") are all read from those declarations
here, off the method's reading path; `build(budget, options)` receives typed values and parses nothing.

A field's type says how its value is written as text (`read`, the one reader of the command line,
the specs and text given to `make_policy`) and printed (`show`):

    bool                 true/false, yes/no, on/off, 1/0
    int                  ASCII digits with an optional sign
    float                a finite number in ASCII
    Literal["a", "b"]    one of the names
    tuple[int, ...]      layer numbers separated by commas or semicolons, -1 the last; empty: none
    tuple[int, int]      N:M
    int | Rule           a whole number; the default may be a Rule of the budget, which prints itself

What a number must be is one table keyed by the option's name (CHECKS), so a name means one thing in
every method (tests/test_options.py checks that type and help agree too). An option only one method
takes may be checked in that method's module instead, `CHECKS = {"gamma": (lambda x: x >= 0, "be >= 0")}`,
so that adding a method edits no file but its own and the registry's table.
The design: docs/design.md ("Options").
"""
import functools
import inspect
import math
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

from kvmini.budget import Rule

Layers = tuple[int, ...]  # layer numbers, -1 the last
Ratio = tuple[int, int]  # N:M


def at_least(low) -> tuple[Callable[[object], bool], str]:
    return lambda x: x >= low, f"be >= {low}"


CHECKS = {  # option name -> (the check its values must pass, what it demands, for the refusal)
    "sinks": at_least(0),
    "recent": at_least(0),
    "robust": at_least(0),
    "robust_decode": at_least(0),
    "window": at_least(1),
    "kernel": (lambda x: x >= 1 and x % 2 == 1, "be odd and >= 1"),
    "beta": (lambda x: 0 <= x <= 1, "be in [0, 1]"),
    "softmax_temperature": (lambda x: x > 0, "be > 0"),
    "nm": (lambda x: sum(x) > 0, "have N + M > 0"),
    "threshold": (lambda x: 0 <= x < 1, "be in [0, 1)"),
    "k": at_least(1),
    "r_max": at_least(1),
    "interval": at_least(1),
    "pyramid_beta": at_least(1),
    "history": at_least(1),
    "merge_window": at_least(1),
    "merge_seed": (lambda x: 0 <= x < 2**40, "be in [0, 2**40)"),
}


def helps(Options) -> dict[str, str]:
    """Each field's help, read from the source of `Options` (and of the dataclasses it extends): the
    comment beside the field, else the comment lines just above it, joined."""
    out: dict[str, str] = {}
    for cls in reversed([c for c in Options.__mro__ if "__dataclass_fields__" in vars(c)]):
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines(keepends=True)
        tokens = tokenize.generate_tokens(iter(lines).__next__)
        comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
        for row, line in enumerate(lines, 1):
            name = re.match(r"\s+(\w+)\s*:", line)
            if name is None or name[1] not in vars(cls).get("__annotations__", {}):
                continue
            above = row - 1
            while above in comments and lines[above - 1].lstrip().startswith("#"):
                above -= 1
            out[name[1]] = comments.get(row) or " ".join(comments[r] for r in range(above + 1, row))
    return out


# --- reading and printing -----------------------------------------------------------------------

TRUTH = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def read(kind, text: str):
    """A value of type `kind` written as text; ValueError (with what was expected) if it is not one."""
    return kind_of(kind).read(text.strip())


def show(value, kind=None) -> str:
    """A value as it is written: 3:1 (a Ratio), 0,1,-1 or none (Layers), true, budget // 2 (a Rule)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if kind == Ratio:
        return ":".join(map(str, value))
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


def fits(kind, value) -> bool:
    """Is `value` (a Python value, not text) of type `kind`?"""
    return kind_of(kind).fits(value)


def metavar(kind) -> str:
    """How a flag's value is written, for --help: avg|max, N:M, LAYERS, BOOL, N, X."""
    return kind_of(kind).metavar


def kind_name(kind) -> str:
    """What a value of `kind` is, for an error message."""
    return kind_of(kind).name


def is_choice(kind) -> bool:
    """Is `kind` a Literal of names (its values are the text itself)?"""
    return typing.get_origin(kind) is Literal


def choices(kind) -> str:
    names = typing.get_args(kind)
    return "be " + ", ".join(names[:-1]) + " or " + names[-1]


@dataclass(frozen=True)
class Kind:
    """One option type: what a value is called, how it is written for --help, how text (stripped)
    is read into a value (ValueError: what it must be), and which Python values are of it."""

    name: str
    metavar: str
    read: Callable[[str], object]
    fits: Callable[[object], bool]


def kind_of(kind) -> Kind:
    """The one switch over the option types (the table of the module docstring)."""
    if is_choice(kind):
        names = typing.get_args(kind)
        return Kind("one of " + " | ".join(names), "|".join(names), functools.partial(read_choice, kind),
                    lambda v: v in names)
    if kind is bool:
        return Kind("true or false", "BOOL", read_bool, lambda v: isinstance(v, bool))
    if kind is int or (isinstance(kind, types.UnionType) and set(typing.get_args(kind)) == {int, Rule}):
        return Kind(f"whole number of at most {LARGEST:,} in size", "N", read_int,
                    lambda v: (whole(v) and abs(v) <= LARGEST) or (kind is not int and isinstance(v, Rule)))
    if kind is float:
        return Kind("finite number", "X", read_float,
                    lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    if kind == Layers:
        return Kind("tuple of layer numbers", "LAYERS", read_layers,
                    lambda v: isinstance(v, tuple) and all(whole(x) for x in v))
    if kind == Ratio:
        return Kind("pair of whole numbers (N, M)", "N:M", read_ratio,
                    lambda v: isinstance(v, tuple) and len(v) == 2 and all(whole(x) and x >= 0 for x in v))
    raise TypeError(f"no option type {kind}")


LARGEST = 2**31 - 1  # a whole-number option beyond this overflows torch's int32 sizes (a kernel, a window)


def whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_bool(text: str) -> bool:
    if text.lower() not in TRUTH:
        raise ValueError("be true or false")
    return TRUTH[text.lower()]


def read_int(text: str) -> int:
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError("be a whole number")
    if abs(int(text)) > LARGEST:
        raise ValueError(f"be a whole number of at most {LARGEST:,} in size")
    return int(text)


def read_float(text: str) -> float:
    value = float(text) if text.isascii() and re.fullmatch(r"[0-9eE.+-]+", text) else math.nan
    if not math.isfinite(value):
        raise ValueError("be a finite number")
    return value


def read_layers(text: str) -> Layers:
    parts = [p.strip() for p in re.split(r"[,;]", text)] if text.strip() else []
    if not all(re.fullmatch(r"-?[0-9]+", p) for p in parts):
        raise ValueError("be layer numbers separated by commas, e.g. 0,1,-1 (empty: none)")
    if len(set(map(int, parts))) < len(parts):
        raise ValueError("name each layer once")
    return tuple(int(p) for p in parts)


def read_ratio(text: str) -> Ratio:
    m = re.fullmatch(r"([0-9]+):([0-9]+)", text)
    if not m:
        raise ValueError("look like N:M, e.g. 3:1")
    return int(m[1]), int(m[2])


def read_choice(kind, text: str) -> str:
    if text not in typing.get_args(kind):
        raise ValueError(choices(kind))
    return text


@dataclass(frozen=True)
class Declared:
    """One option of one method, as the registry and run.py see it."""

    name: str
    kind: object  # the field's type
    default: object
    help: str
    check: Callable[[object], bool] | None
    must: str
    by_variant: dict  # variant -> its value, when the variants differ in this option


def declared(Options, variants: dict | None = None, own: dict | None = None) -> list[Declared]:
    """The fields of a method's Options, with the value each variant gives them; `own`: the module's
    checks of the options only it takes (its `CHECKS`)."""
    hints, help_ = typing.get_type_hints(Options), helps(Options)
    out = []
    for f in fields(Options):
        values = {name: getattr(v, f.name) for name, v in (variants or {}).items()}
        differ = len({repr(v) for v in values.values()}) > 1
        check, must = CHECKS.get(f.name) or (own or {}).get(f.name, (None, ""))
        out.append(Declared(f.name, hints[f.name], f.default, help_.get(f.name, ""), check, must,
                            values if differ else {}))
    return out
